"""Price every node in float32 and in the low dtype with the plan's cost model.

The cost model (``mpgraph.cost``) is this machine's measured op times or a device's roofline;
the pass writes what it says on each node (``mpgraph.cost``: a NodeCost) and neither knows nor
cares which, so the placement that reads them does not either.
"""
from __future__ import annotations

import torch

from mpgraph.cost.model import CostModel, NodeCost  # noqa: F401 - NodeCost: the meta value
from mpgraph.ir.meta import CAST_COST, COST, COST_MODEL, OP_CLASS, TENSOR, is_float32_tensor
from mpgraph.passes.infra import Pass, PassResult


class EstimateCost(Pass):
    """Analysis: writes ``mpgraph.cost`` (NodeCost) on every call node, ``mpgraph.cast_cost``
    on every float32 value (what a cast of it to the low dtype and back would cost), and which
    cost model said so (``mpgraph.cost_model`` on the graph): the placement reads these, not
    the model."""
    stage = "decide"
    reads, writes = (OP_CLASS,), (COST, CAST_COST, COST_MODEL)

    def __init__(self, costs: CostModel, low_dtype: torch.dtype):
        self.costs = costs
        self.low = low_dtype

    def call(self, gm):
        gm.meta[COST_MODEL] = {"target": self.costs.name, "source": self.costs.source}
        for node in gm.graph.nodes:
            if node.op.startswith("call_"):
                node.meta[COST] = self.costs.node_cost(node, gm, self.low)
            if is_float32_tensor(node.meta.get(TENSOR)):
                try:
                    node.meta[CAST_COST] = self.costs.cast_cost(node, self.low)
                except NotImplementedError:  # a model that prices no casts: the rules need none
                    pass
        return PassResult(gm, False)
