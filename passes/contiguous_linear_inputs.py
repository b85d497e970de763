"""A linear layer reading a strided activation of 3 or more dimensions (``nn.MultiheadAttention``
with ``batch_first=True`` projects ``query.transpose(1, 0)``) reads it made contiguous first.

ATen's ``linear`` folds such an input into one matrix product, copying it where its rows do not
fold, only when the weight requires grad (``should_fold`` in ATen's matmul); with a frozen
weight it runs a batched product over the leading dimension instead. A converted inference
module holds frozen weights, so on a CPU a 512->1536 layer over a (128, 4, 512) transposed view
took 29.4 ms where the model took 10.1 (copy and one product: 10.2 ms), and
``nn.TransformerEncoderLayer(batch_first=True)`` ran 0.5-0.8x the model (pP F1). The explicit
``contiguous`` is the copy the model's own call makes; CPU inference plans only (a GPU plan
keeps cuBLAS's batched product and one node less, a training plan's weights require grad).
"""
from __future__ import annotations

import torch
import torch.fx

from mpgraph.ir.cpu_linear import packable
from mpgraph.ir.graph import mutated_nodes
from mpgraph.ir.meta import INSERTED_BY, LAYOUT, OBSERVED, TENSOR, TensorInfo
from mpgraph.passes.infra import Pass, PassResult

aten = torch.ops.aten


def _strided(x) -> bool:
    """Whether the example run gave ``x`` as a strided (neither contiguous nor channels_last)
    tensor of 3 or more dimensions."""
    info = x.meta.get(TENSOR) if isinstance(x, torch.fx.Node) else None
    return isinstance(info, TensorInfo) and len(info.shape) >= 3 \
        and x.meta.get(LAYOUT) == "strided"


class ContiguousLinearInputs(Pass):
    stage = "prepare"
    rewrites = True
    also_reads = (LAYOUT,)
    writes = (INSERTED_BY, TENSOR, OBSERVED, LAYOUT)  # the new nodes' facts

    def call(self, gm):
        graph, done, made = gm.graph, 0, {}
        written = mutated_nodes(graph, gm)
        for node in list(graph.nodes):
            if packable(node, gm) not in ("linear", "module") or not _strided(node.args[0]):
                continue
            x = node.args[0]
            # one copy for all the linears reading x (q, k and v), taken before the first; a
            # copy of its own for each where x is written in place (a copy taken before the
            # write would give a later linear the old values)
            dense = made.get(x) if x not in written else None
            if dense is None:
                with graph.inserting_before(node):
                    # (an export graph's ATen op; a torch.fx graph's method)
                    dense = graph.call_function(aten.contiguous.default, (x,)) \
                        if node.target is aten.linear.default \
                        else graph.call_method("contiguous", (x,))
                dense.meta.update({TENSOR: x.meta[TENSOR], LAYOUT: "contiguous",
                                   INSERTED_BY: self.name,
                                   "nn_module_stack": x.meta.get("nn_module_stack")})
                if OBSERVED in x.meta:  # (the same elements)
                    dense.meta[OBSERVED] = x.meta[OBSERVED]
                made[x] = dense
            node.replace_input_with(x, dense)
            done += 1
        return PassResult(gm, done > 0)
