"""Keep torch.export's ``_assert_tensor_metadata`` checks true after precisions change.

torch.export records the dtype each ``.to()`` input had at capture; when the plan lowers that
input, the assertion must name the new dtype or the converted graph would fail its own check.
"""
from __future__ import annotations

import torch

from mpgraph.ir.meta import PRECISION
from mpgraph.passes.infra import Pass, PassResult

_ASSERT = getattr(torch.ops.aten, "_assert_tensor_metadata", None)


class RetargetDtypeAsserts(Pass):
    stage = "rewrite"
    rewrites = True

    def call(self, gm):
        changed = 0
        if _ASSERT is None:
            return PassResult(gm, False)
        for node in gm.graph.nodes:
            if node.op != "call_function" or getattr(node.target, "overloadpacket", None) is not _ASSERT:
                continue
            if "dtype" not in node.kwargs or not node.args:
                continue
            decision = node.args[0].meta.get(PRECISION)
            if decision is None or decision.dtype is None or decision.dtype == node.kwargs["dtype"]:
                continue
            node.update_kwarg("dtype", decision.dtype)
            changed += 1
        return PassResult(gm, changed > 0)
