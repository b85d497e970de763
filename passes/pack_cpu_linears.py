"""Mark the bf16 linear layers a CPU plan runs over weights packed once (``ir/cpu_linear``).

A rewrite of how the nodes run, not of the graph: each stays ``aten.linear`` (or ``addmm``, or
the ``nn.Linear`` it calls) for every reader of the graph, and the mark makes the converted
module's code and the conversion's check call it through ``CpuLinears``. Only where this machine
runs bf16 natively and its measured cost table timed the packed call faster than ATen's own bf16
linear for that node (oneDNN's packed kernel is 1.2-1.4x faster at most sizes here, 0.71x at
512 rows of a 2048->768 layer: measured, not assumed); not in training (autograd records ATen's
op) and not for GPU plans.
"""
from __future__ import annotations

import torch

from mpgraph.ir.cpu_linear import packable, packing_available
from mpgraph.ir.graph import fetch_attr
from mpgraph.ir.meta import PACKED, PRECISION
from mpgraph.passes.infra import Pass, PassResult


def _stored_bf16(node: torch.fx.Node, gm, kind: str) -> bool:
    """Whether the plan computes the node in bf16 over a weight stored as a 2-D bf16 tensor."""
    decision = node.meta.get(PRECISION)
    if decision is None or decision.dtype != torch.bfloat16:
        return False
    if kind == "module":
        weight = gm.get_submodule(node.target).weight
    else:
        weight = fetch_attr(gm, node.args[1 if kind == "linear" else 2].target)
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 \
        and weight.dim() == 2 and not weight.is_meta


class PackCpuLinears(Pass):
    stage = "rewrite"
    rewrites = True  # (the module's code changes with the marks)
    also_reads = (PRECISION,)
    writes = (PACKED,)

    def __init__(self, costs=None):
        self.costs = costs  # the plan's cost model: where it timed both, the faster way

    def call(self, gm):
        marked = 0
        faster = getattr(self.costs, "packed_faster", None)
        if packing_available() and faster is not None:
            for node in gm.graph.nodes:
                kind = packable(node, gm)
                if kind is not None and _stored_bf16(node, gm, kind) and faster(node, gm):
                    node.meta[PACKED] = True
                    marked += 1
        return PassResult(gm, marked > 0)
