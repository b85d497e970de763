"""Price every node in float32 and in the low dtype with the plan's cost model.

The cost model (``mpgraph.cost``) is this machine's measured op times or a device's roofline;
the pass writes what it says on each node (``mpgraph.cost``: a NodeCost) and neither knows nor
cares which, so the placement that reads them does not either.
"""
from __future__ import annotations

import torch

from mpgraph.cost.model import CostModel, NodeCost  # noqa: F401 - NodeCost: the meta value
from mpgraph.ir.meta import COST, OP_CLASS
from mpgraph.passes.infra import Pass, PassResult


class EstimateCost(Pass):
    """Analysis: writes ``mpgraph.cost`` (NodeCost) on every call node."""
    stage = "decide"
    reads, writes = (OP_CLASS,), (COST,)

    def __init__(self, costs: CostModel, low_dtype: torch.dtype):
        self.costs = costs
        self.low = low_dtype

    def call(self, gm):
        for node in gm.graph.nodes:
            if node.op.startswith("call_"):
                node.meta[COST] = self.costs.node_cost(node, gm, self.low)
        return PassResult(gm, False)
