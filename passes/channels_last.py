"""Run low-precision 2-D convolutions in channels_last (NHWC) memory layout.

oneDNN on CPUs and cuDNN's Tensor Core kernels on GPUs work in NHWC; given NCHW tensors they
reorder activations in and out of every convolution (on this CPU about 3.5 copies' worth of
traffic per conv, by the cost model's fit; ResNet-50 in bf16 at batch 1 runs 1.34x faster in
channels_last). Values do not change, only strides: the weights of those convolutions are stored
channels_last once, at conversion time, and each one's input gets ``contiguous(channels_last)``,
which is free when the input already is (batch norm, ReLU, pooling and adds keep the layout).
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.ir.graph import fetch_attr, is_conv2d, set_attr, target_name, with_data
from mpgraph.ir.meta import (INSERTED_BY, OP_CLASS, PRECISION, REFERENCE, TENSOR, Decision,
                             OpInfo, TensorInfo, is_inserted_cast)
from mpgraph.passes.op_table import FOLLOW, TENSOR_CORE
from mpgraph.passes.infra import Pass, PassResult

CL = torch.channels_last


def _cast_for(x, convs) -> bool:
    """Whether ``x`` is a precision cast the plan inserted (``x.to(dtype)``) read only by the
    NHWC convolutions: it can write channels_last itself (a layout copy after it, unpriced by
    the cost model, read its output once more)."""
    return is_inserted_cast(x) and x.op == "call_method" and x.target == "to" \
        and bool(x.users) and all(u in convs and u.args and u.args[0] is x for u in x.users)


def _four_d(node) -> bool:
    info = node.meta.get(TENSOR) if isinstance(node, torch.fx.Node) else None
    return isinstance(info, TensorInfo) and len(info.shape) == 4


def _channels_last_inputs(gm) -> bool:
    """Whether a 4-D example input (the float32 reference's batch) is channels_last."""
    reference = gm.meta.get(REFERENCE)
    found = [] if reference is None else pytree.tree_leaves((reference.args, reference.kwargs))
    return any(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous()
               and t.is_contiguous(memory_format=CL) for t in found)


# ops that draw one random number per element in memory order: given an NHWC value they draw
# another mask than the model's NCHW one (dropout on a conv feature map: a check that failed at
# 0.75 on a right conversion, a noise layer's randn_like at 1.06)
RANDOM = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
          "dropout1d", "dropout2d", "dropout3d", "randn_like", "rand_like", "randint_like",
          "bernoulli", "normal", "uniform", "exponential", "geometric", "cauchy", "log_normal",
          "poisson", "multinomial", "rrelu", "rrelu_with_noise"}


def _op_name(node: torch.fx.Node) -> str:
    name = target_name(node).split(".")
    return name[1] if name[0] == "aten" and len(name) > 1 else name[-1]


def _draws_random(node: torch.fx.Node, gm) -> bool:
    """Whether the node draws random numbers, out of place or in place (``normal_``)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return isinstance(module, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU))
    if node.op not in ("call_function", "call_method"):
        return False
    return _op_name(node).rstrip("_") in RANDOM | {"random"}


def _made_like(node) -> bool:
    """``empty_like(h)``, ``h.new_empty(...)``: a tensor made in another's layout."""
    return isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") \
        and (_op_name(node).endswith("_like") or _op_name(node).startswith("new_"))


def _to_channels_last(value: torch.Tensor) -> torch.Tensor:
    return with_data(value, value.detach().contiguous(memory_format=CL))


class ChannelsLast(Pass):
    stage = "rewrite"
    rewrites = True
    reads = (OP_CLASS, PRECISION)
    writes = (INSERTED_BY, TENSOR, OP_CLASS, PRECISION)  # the facts of the layout copies it adds

    def call(self, gm):
        convs = [n for n in gm.graph.nodes if n.meta.get(OP_CLASS) is not None
                 and n.meta[OP_CLASS].op_class == TENSOR_CORE and is_conv2d(n, gm)
                 and n.meta[PRECISION].dtype in (torch.float16, torch.bfloat16)]
        edits = 0
        for conv in convs:
            self._weight(conv, gm)
            x = conv.args[0]
            info = x.meta.get(TENSOR) if isinstance(x, torch.fx.Node) else None
            if not isinstance(info, TensorInfo) or len(info.shape) != 4 \
                    or x.meta.get(INSERTED_BY) == self.name:
                continue
            if _cast_for(x, convs):  # the cast writes NHWC itself: one copy, not two
                if x.kwargs.get("memory_format") != CL:
                    x.kwargs = {**x.kwargs, "memory_format": CL}
                    edits += 1
                continue
            with gm.graph.inserting_before(conv):
                nhwc = gm.graph.create_node("call_method", "contiguous", (x,), {"memory_format": CL},
                                            name=f"{x.name}_nhwc")
            nhwc.meta[TENSOR] = info
            nhwc.meta[PRECISION] = Decision(x.meta[PRECISION].dtype, "channels_last layout for the "
                                            "convolution (free when it already is)", pinned=True)
            nhwc.meta[OP_CLASS] = OpInfo(FOLLOW, "memory layout only", "Tensor.contiguous")
            nhwc.meta[INSERTED_BY] = self.name
            conv.replace_input_with(x, nhwc)
            edits += 1
        edits += self._keep_model_layout(gm, convs)
        return PassResult(gm, edits > 0)

    def _keep_model_layout(self, gm, convs) -> int:
        """``contiguous()`` (free on a contiguous tensor) before what sees the layout: each
        ``view`` of a value the NHWC convolutions reach (the model's own ``x.view(B, -1)`` after
        a conv failed on NHWC strides), each random draw on one (``RANDOM``: the model's mask is
        drawn in NCHW order), and each 4-D output they reach (a user's
        ``out.view(B, -1)`` failed on the converted module's NHWC output), unless the example
        inputs were channels_last: torch's convolutions then return NHWC in the model too."""
        reached, stack = set(convs), list(convs)
        while stack:  # (not through this pass's own copies: a second run adds none)
            for user in stack.pop().users:
                if user not in reached and user.op != "output" \
                        and user.meta.get(INSERTED_BY) != self.name:
                    reached.add(user)
                    stack.append(user)
        edits = 0

        def nchw(value: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
            nonlocal edits
            with gm.graph.inserting_before(before):
                out = gm.graph.create_node("call_method", "contiguous", (value,),
                                           name=f"{value.name}_nchw")
            out.meta[TENSOR] = value.meta.get(TENSOR)
            out.meta[PRECISION] = Decision(value.meta[PRECISION].dtype, "the model's layout "
                                           "(contiguous) where the NHWC convolutions' output is "
                                           "viewed or returned", pinned=True)
            out.meta[OP_CLASS] = OpInfo(FOLLOW, "memory layout only", "Tensor.contiguous")
            out.meta[INSERTED_BY] = self.name
            edits += 1
            return out

        for node in list(gm.graph.nodes):
            if node.op == "output":
                continue
            x = node.args[0] if node.args else None
            if _draws_random(node, gm) and _made_like(x) and x.args \
                    and x.args[0] in reached and _four_d(x.args[0]):
                # an in-place draw into a tensor made like an NHWC value
                # (``torch.empty_like(h).normal_()``): that tensor made in the model's layout
                x.replace_input_with(x.args[0], nchw(x.args[0], x))
            elif x in reached and _four_d(x) and not _op_name(node).endswith("_") and (
                    (node.op == "call_method" and node.target == "view")
                    or node.target is torch.ops.aten.view.default or _draws_random(node, gm)):
                node.replace_input_with(x, nchw(x, node))
        if _channels_last_inputs(gm):  # torch's convs keep it: the model returns NHWC too
            return edits
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        done: dict = {}

        def restore(value: torch.fx.Node) -> torch.fx.Node:
            if value not in reached or not _four_d(value):
                return value
            if value not in done:
                done[value] = nchw(value, output)
            return done[value]

        output.args = torch.fx.node.map_arg(output.args, restore)
        return edits

    def _weight(self, conv, gm) -> None:
        if conv.op == "call_module":
            module = gm.get_submodule(conv.target)
            module.weight = _to_channels_last(module.weight)
            return
        weight = conv.args[1]
        if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" \
                and all(is_conv2d(u, gm) for u in weight.users):
            set_attr(gm, weight.target, _to_channels_last(fetch_attr(gm, weight.target)))
