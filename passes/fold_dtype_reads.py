"""A value's ``.dtype`` read in the forward becomes the dtype the model computes it in.

``x.to(self.proj.weight.dtype)`` (diffusers', CLIP's idiom) and ``torch.full(..., dtype=h.dtype)``
ask the model's own precision: float32 for a float32 model, on every call. A symbolic trace keeps
the read as a node, and once the plan stores ``proj.weight`` in bf16 or computes ``h`` in fp16
it answers with the plan's dtype instead: ``x.to(...)`` then gave a float32 input to a layer whose
weight was bf16 (a dtype error inside torch), and the factory a tensor in a dtype its plan did
not say (a ConversionError). torch.export folds these reads at capture; this pass does the same
for symbolic traces, so the plan sees constants and places its casts around them.

Graph inputs' dtypes stay read at run time, and so do those of values that take theirs
(``x.flatten(1).dtype``, ``(x * 2).dtype``): they are the caller's, whatever the plan. A value
computed with a weight or with a value of the model's (``a(x) @ x.T``), or cast to a named dtype,
has the model's.
"""
from __future__ import annotations

import torch
import torch.fx

from mpgraph.ir.meta import TENSOR, TensorInfo
from mpgraph.passes.infra import Pass, PassResult


_NAMED_CASTS = {"float", "half", "double", "bfloat16"}


def _models_value(node: torch.fx.Node, follows: set) -> bool:
    """Whether ``node`` is a float tensor of the model's dtype that fixes the dtype of an op
    reading it: ``a(x) @ x.T`` is float32 for a float32 model, whatever ``x``'s dtype. A 0-dim
    one does not (``x * torch.tensor(2.)`` keeps ``x``'s dtype, as type promotion does)."""
    info = node.meta.get(TENSOR)
    return node not in follows and isinstance(info, TensorInfo) and \
        info.dtype.is_floating_point and len(info.shape) > 0


def _callers_dtype(gm: torch.fx.GraphModule) -> set:
    """The nodes whose dtype follows a float graph input's: reached from one through ops that
    neither read a parameter or buffer or a value of the model's dtype (a weight fixes the
    dtype: float32) nor cast to a dtype they name."""
    follows = set()
    for node in gm.graph.nodes:
        info = node.meta.get(TENSOR)
        if node.op == "placeholder":
            if isinstance(info, TensorInfo) and info.dtype.is_floating_point:
                follows.add(node)
            continue
        if not node.op.startswith("call_"):
            continue
        named = (node.op == "call_method" and node.target in _NAMED_CASTS) or any(
            isinstance(a, torch.dtype) for a in list(node.args[1:]) + list(node.kwargs.values()))
        weighted = any(a.op == "get_attr" for a in node.all_input_nodes) or (
            node.op == "call_module" and
            next(gm.get_submodule(node.target).parameters(), None) is not None)
        weighted = weighted or any(_models_value(a, follows) for a in node.all_input_nodes)
        if not named and not weighted and any(a in follows for a in node.all_input_nodes):
            follows.add(node)
    return follows


def _captured_dtype(node: torch.fx.Node, callers: set):
    """The dtype ``node`` (a ``getattr(value, "dtype")``) read at capture, where it is the
    model's and not the caller's; None otherwise."""
    if node.op != "call_function" or node.target is not getattr or len(node.args) != 2 \
            or node.args[1] != "dtype" or not isinstance(node.args[0], torch.fx.Node):
        return None
    value = node.args[0]
    info = value.meta.get(TENSOR)
    if value in callers or not isinstance(info, TensorInfo) or not info.dtype.is_floating_point:
        return None
    return info.dtype


class FoldDtypeReads(Pass):
    stage = "prepare"
    rewrites = True

    def call(self, gm):
        folded, callers = 0, _callers_dtype(gm)
        for node in list(gm.graph.nodes):
            dtype = _captured_dtype(node, callers)
            if dtype is None:
                continue
            def constant(n, node=node, dtype=dtype):
                return dtype if n is node else n
            for user in list(node.users):
                user.args = torch.fx.node.map_arg(user.args, constant)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, constant)
            value = node.args[0]
            gm.graph.erase_node(node)
            if value.op == "get_attr" and not value.users:  # (read for its dtype alone)
                gm.graph.erase_node(value)
            folded += 1
        return PassResult(gm, folded > 0)
