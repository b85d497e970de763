"""Price every node in float32 and in the low dtype with the plan's cost model.

The cost model (``mpgraph.cost``) is this machine's measured op times or a device's roofline;
the pass writes what it says on each node (``mpgraph.cost``: a NodeCost) and neither knows nor
cares which, so the placement that reads them does not either.
"""
from __future__ import annotations

import math

import torch

from mpgraph.cost.model import CostModel, NodeCost  # noqa: F401 - NodeCost: the meta value
from mpgraph.ir.graph import is_export_guard
from mpgraph.ir.meta import CAST_COST, COST, COST_MODEL, OP_CLASS, TENSOR, is_float32_tensor
from mpgraph.passes.infra import Pass, PassResult


class EstimateCost(Pass):
    """Analysis: writes ``mpgraph.cost`` (NodeCost) on every call node (not export's input
    guard: none of the model's ops), ``mpgraph.cast_cost`` on every float32 value (what a cast of
    it to the low dtype and back would cost), and which cost model said so
    (``mpgraph.cost_model`` on the graph): the placement reads these, not the model."""
    stage = "decide"
    reads, writes = (OP_CLASS,), (COST, CAST_COST, COST_MODEL)

    def __init__(self, costs: CostModel, low_dtype: torch.dtype):
        self.costs = costs
        self.low = low_dtype

    def call(self, gm):
        gm.meta[COST_MODEL] = {"target": self.costs.name, "source": self.costs.source}
        for node in gm.graph.nodes:
            if node.op.startswith("call_") and not is_export_guard(node):
                cost = node.meta[COST] = self.costs.node_cost(node, gm, self.low)
                if not isinstance(cost, NodeCost):
                    raise self.fail(f"{self._model()}.node_cost returned "
                                    f"{type(cost).__name__}, not a NodeCost", node)
                self._check(node, "node_cost", {"t_fp32": cost.t_fp32, "t_low": cost.t_low})
            if is_float32_tensor(node.meta.get(TENSOR)):
                try:
                    down, up = node.meta[CAST_COST] = self.costs.cast_cost(node, self.low)
                except NotImplementedError:  # a model that prices no casts: the rules need none
                    continue
                self._check(node, "cast_cost", {"down": down, "up": up})
        return PassResult(gm, False)

    def _model(self) -> str:
        return f"the cost model {type(self.costs).__name__} ({self.costs.name or 'unnamed'})"

    def _check(self, node, method: str, seconds: dict) -> None:
        """A time that is NaN or negative (a user's cost model; a damaged cache) made a summary
        say 'estimated nanx' or left the dtype choice no candidate ('min() arg is an empty
        sequence'): said here, naming the cost model."""
        bad = {k: v for k, v in seconds.items() if not _time(v)}
        if bad:
            raise self.fail(f"{self._model()}.{method} priced {node.name} at "
                            + ", ".join(f"{k}={v!r}" for k, v in bad.items())
                            + ": a cost is seconds, 0 or more (inf: never worth it)", node)


def _time(value) -> bool:
    """Whether ``value`` reads as seconds: a number (numpy's, a 0-d tensor), not NaN, 0 or more."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return False
    return not math.isnan(value) and value >= 0
