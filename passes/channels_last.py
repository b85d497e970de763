"""Run low-precision 2-D convolutions in channels_last (NHWC) memory layout.

oneDNN on CPUs and cuDNN's Tensor Core kernels on GPUs work in NHWC; given NCHW tensors they
reorder activations in and out of every convolution (on this CPU about 3.5 copies' worth of
traffic per conv, by the cost model's fit; ResNet-50 in bf16 at batch 1 runs 1.34x faster in
channels_last). Values do not change, only strides: the weights of those convolutions are stored
channels_last once, at conversion time, and each one's input gets ``contiguous(channels_last)``,
which is free when the input already is (batch norm, ReLU, pooling and adds keep the layout).
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx

from mpgraph.ir.graph import (alias_base, draws_random, fetch_attr, input_nodes, is_conv2d,
                             is_inplace, is_view, mutated_nodes, set_attr, short_op_name,
                             with_data)
from mpgraph.ir.meta import (INSERTED_BY, LAYOUT, MEMORY_FORMATS, OP_CLASS, PRECISION, TENSOR,
                             Decision, OpInfo, TensorInfo, is_inserted_cast)
from mpgraph.passes.op_table import FOLLOW, TENSOR_CORE
from mpgraph.passes.infra import Pass, PassResult

log = logging.getLogger(__name__)

CL = torch.channels_last


def _cast_for(x, convs) -> bool:
    """Whether ``x`` is a precision cast the plan inserted (``x.to(dtype)``) read only by the
    NHWC convolutions: it can write channels_last itself (a layout copy after it, unpriced by
    the cost model, read its output once more)."""
    return is_inserted_cast(x) and x.op == "call_method" and x.target == "to" \
        and bool(x.users) and all(u in convs and u.args and u.args[0] is x for u in x.users)


# ops whose result depends on their input's strides, or that refuse some (``view``)
STRIDED = {"view", "view_as", "_unsafe_view", "as_strided"}
MATMULS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm"}


def _sees_layout(node: torch.fx.Node, gm) -> bool:
    """Whether the node's result depends on its first argument's strides (or it refuses some)."""
    return bool(node.args) and isinstance(node.args[0], torch.fx.Node) and (
        draws_random(node, gm) or node.op in ("call_function", "call_method")
        and short_op_name(node) in STRIDED)


def _matmul(node: torch.fx.Node, gm) -> bool:
    """A matrix product (``nn.Linear``, ``matmul``...): it writes a fresh contiguous result."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), torch.nn.Linear)
    return node.op in ("call_function", "call_method") and short_op_name(node) in MATMULS


def _model_layout(node: torch.fx.Node):
    """The layout the model gave the value (``mpgraph.layout``): a node a pass added after
    capture (a cast) has its input's where it keeps its shape, else is taken as contiguous;
    None where the value is no tensor."""
    while LAYOUT not in node.meta:
        info, inputs = node.meta.get(TENSOR), input_nodes(node)
        if not isinstance(info, TensorInfo):
            return None
        if not inputs or getattr(inputs[0].meta.get(TENSOR), "shape", None) != info.shape:
            return "contiguous"
        node = inputs[0]
    return node.meta[LAYOUT]


def _to_channels_last(value: torch.Tensor) -> torch.Tensor:
    return with_data(value, value.detach().contiguous(memory_format=CL))


class ChannelsLast(Pass):
    stage = "rewrite"
    rewrites = True
    reads = (OP_CLASS, PRECISION)
    also_reads = (LAYOUT,)
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
        """``contiguous()`` (free where it already is) where the layout is seen on a value the
        NHWC convolutions reach: the input of each ``view`` (LeNet's own ``x.view(B, -1)``;
        ``h.flatten(2).view(B, -1)`` failed on the strides NHWC gives it), each random draw
        (``mpgraph.ir.graph.RANDOM``: one number per element in memory order, another mask than the model's for
        the same seed) and each output (a user's ``out.view(B, -1)`` failed) get the model's
        layout back (``mpgraph.layout``). A conv the model too ran NHWC (channels_last inputs)
        changes nothing; a matrix product writes a fresh contiguous result."""
        reached = {c for c in convs if _model_layout(c) != "channels_last"}
        stack = list(reached)
        while stack:  # (not through this pass's own copies: a second run adds none)
            for user in stack.pop().users:
                if user not in reached and user.op != "output" and not _matmul(user, gm) \
                        and user.meta.get(INSERTED_BY) != self.name:
                    reached.add(user)
                    stack.append(user)
        copies = []
        seen: set = set()  # (each read once: a diamond of elementwise ops doubled the walk)
        mutated, rerooted = mutated_nodes(gm.graph, gm), set()

        def restore(user: torch.fx.Node, x) -> None:
            """``user`` reads ``x`` with the strides the model gave it."""
            if x not in reached or (user, x) in seen:
                return
            seen.add((user, x))
            layout = _model_layout(x)
            # (the value in NHWC that x may be: what a write through x writes into)
            root = alias_base(x, gm, lambda n: n.args[0] in reached) if x in mutated else None
            if root is not None and _model_layout(root) in MEMORY_FORMATS \
                    and not is_inplace(user, gm):
                # x, or a view of it, is written in place (h.view(B, -1)[:, :k] = 0): a copy
                # before the view would take the write and lose it. The value itself goes back
                # to the model's layout where it is computed, every alias taken from that.
                if root not in rerooted:
                    rerooted.add(root)
                    with gm.graph.inserting_after(root):
                        copies.append(self._copy(gm, root, MEMORY_FORMATS[_model_layout(root)],
                                                 None))
                    root.replace_all_uses_with(copies[-1], lambda u: u is not copies[-1])
            elif layout in MEMORY_FORMATS and not is_inplace(user, gm):
                # (just before it: after whatever writes into x)
                copies.append(self._copy(gm, x, MEMORY_FORMATS[layout], user))
                user.replace_input_with(x, copies[-1])
            elif not (is_inplace(user, gm) and is_view(x)):
                # strides of no plain layout (a slice, a transpose), a tuple, or ``user`` writes
                # into ``x`` (``empty_like(h).exponential_()``): the model's layout where ``x``
                # is computed from
                for arg in input_nodes(x):
                    restore(x, arg)
            else:
                log.debug("%s reads %s in another layout than the model's", user.name, x.name)

        for node in list(gm.graph.nodes):
            if node.op == "output":
                for x in input_nodes(node):
                    restore(node, x)
            elif _sees_layout(node, gm):
                restore(node, node.args[0])
        return len(copies)

    def _copy(self, gm, x: torch.fx.Node, memory_format, user) -> torch.fx.Node:
        """``x.contiguous(memory_format)`` before ``user`` (None: where the graph inserts):
        ``x`` in the model's layout."""
        nchw = memory_format == torch.contiguous_format
        with gm.graph.inserting_before(user) if user is not None else contextlib.nullcontext():
            out = gm.graph.create_node("call_method", "contiguous", (x,),
                                       {} if nchw else {"memory_format": memory_format},
                                       name=f"{x.name}_{'nchw' if nchw else 'model_layout'}")
        out.meta[TENSOR] = x.meta.get(TENSOR)
        out.meta[PRECISION] = Decision(x.meta[PRECISION].dtype, "the model's layout where the "
                                       "NHWC convolutions' output is viewed, drawn on or "
                                       "returned", pinned=True)
        out.meta[OP_CLASS] = OpInfo(FOLLOW, "memory layout only", "Tensor.contiguous")
        out.meta[INSERTED_BY] = self.name
        return out

    def _weight(self, conv, gm) -> None:
        if conv.op == "call_module":
            module = gm.get_submodule(conv.target)
            module.weight = _to_channels_last(module.weight)
            return
        weight = conv.args[1]
        if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" \
                and all(is_conv2d(u, gm) for u in weight.users):
            set_attr(gm, weight.target, _to_channels_last(fetch_attr(gm, weight.target)))
