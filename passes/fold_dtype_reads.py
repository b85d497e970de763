"""A value's ``.dtype`` read in the forward becomes the dtype the model computes it in.

``x.to(self.proj.weight.dtype)`` (diffusers', CLIP's idiom) and ``torch.full(..., dtype=h.dtype)``
ask the model's own precision: float32 for a float32 model, on every call. A symbolic trace keeps
the read as a node, and once the plan stores ``proj.weight`` in bf16 or computes ``h`` in fp16
it answers with the plan's dtype instead: ``x.to(...)`` then gave a float32 input to a layer whose
weight was bf16 (a dtype error inside torch), and the factory a tensor in a dtype its plan did
not say (a ConversionError). torch.export folds these reads at capture; this pass does the same
for symbolic traces, so the plan sees constants and places its casts around them.

Graph inputs' dtypes stay read at run time: they are the caller's, whatever the plan.
"""
from __future__ import annotations

import torch
import torch.fx

from mpgraph.ir.meta import TENSOR, TensorInfo
from mpgraph.passes.infra import Pass, PassResult


def _captured_dtype(node: torch.fx.Node):
    """The dtype ``node`` (a ``getattr(value, "dtype")``) read at capture, where it is the
    model's and not the caller's; None otherwise."""
    if node.op != "call_function" or node.target is not getattr or len(node.args) != 2 \
            or node.args[1] != "dtype" or not isinstance(node.args[0], torch.fx.Node):
        return None
    value = node.args[0]
    info = value.meta.get(TENSOR)
    if value.op == "placeholder" or not isinstance(info, TensorInfo) \
            or not info.dtype.is_floating_point:
        return None
    return info.dtype


class FoldDtypeReads(Pass):
    stage = "prepare"
    rewrites = True

    def call(self, gm):
        folded = 0
        for node in list(gm.graph.nodes):
            dtype = _captured_dtype(node)
            if dtype is None:
                continue
            for user in list(node.users):
                user.args = torch.fx.node.map_arg(user.args, lambda n: dtype if n is node else n)
                user.kwargs = torch.fx.node.map_arg(user.kwargs,
                                                    lambda n: dtype if n is node else n)
            value = node.args[0]
            gm.graph.erase_node(node)
            if value.op == "get_attr" and not value.users:  # (read for its dtype alone)
                gm.graph.erase_node(value)
            folded += 1
        return PassResult(gm, folded > 0)
