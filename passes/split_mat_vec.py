"""A low-precision matrix-vector product as ``split_mv`` where this machine timed that faster.

ATen's bf16 GEMV on a CPU reads its weight at about half the rate the same rows reach as a
batched product over row blocks (``mpgraph.ir.kernels.split_mv``: a 32000x768 LM head 3.2 ->
1.5 ms on a 2-core AMX Xeon, a 768x768 projection 76 -> 53 us). Whether and how many blocks pays
differs by CPU and shape, so the measured cost model times each split beside ``mv`` and
EstimateCost records the faster kernel on the node (``NodeCost.kernel_low``); this pass follows
that record for the nodes the plan put in that dtype. A roofline (a device we are not on) times
no kernels: nothing changes there.
"""
from __future__ import annotations

import torch
import torch.fx

from mpgraph.ir.graph import fetch_attr
from mpgraph.ir.kernels import mv_splits, split_mv
from mpgraph.ir.meta import COST, PRECISION, TENSOR, TensorInfo
from mpgraph.passes.infra import Pass, PassResult

aten = torch.ops.aten


def _contiguous(gm, weight: torch.fx.Node) -> bool:
    """Whether the weight reaches the product as contiguous rows (a stored weight, or the
    transpose of one StoreWeights stored transposed): split_mv's blocks are then views of it."""
    transposed = weight.op == "call_function" and weight.target is aten.t.default
    source = weight.args[0] if transposed else weight
    if not isinstance(source, torch.fx.Node) or source.op != "get_attr":
        return False
    value = fetch_attr(gm, source.target)
    return isinstance(value, torch.Tensor) and (value.t() if transposed else value).is_contiguous()


class SplitMatVec(Pass):
    stage = "rewrite"
    rewrites = True
    also_reads = (COST, PRECISION)

    def __init__(self, low_dtype: torch.dtype):
        self.low = low_dtype

    def call(self, gm):
        done = 0
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not aten.mv.default:
                continue
            cost, decision = node.meta.get(COST), node.meta.get(PRECISION)
            kernel = getattr(cost, "kernel_low", "")
            if not kernel or decision is None or decision.dtype != self.low:
                continue
            weight, x = node.args
            info = weight.meta.get(TENSOR)
            split = mv_splits(info.shape[0]).get(kernel) if isinstance(info, TensorInfo) else None
            if split is None or not _contiguous(gm, weight):
                continue
            node.target = split_mv
            node.args = (weight, x, *split)
            done += 1
        return PassResult(gm, done > 0)
