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
        and x.meta.get(LAYOUT) in ("strided", "broadcast")


def _contiguous_copy(graph: torch.fx.Graph, x: torch.fx.Node, before: torch.fx.Node,
                     by: str) -> torch.fx.Node:
    """``x.contiguous()`` inserted before ``before`` (an export graph's ATen op where ``before``
    is one, else a torch.fx graph's method), with ``x``'s facts, inserted by ``by``."""
    with graph.inserting_before(before):
        dense = graph.call_function(aten.contiguous.default, (x,)) \
            if isinstance(before.target, torch._ops.OpOverload) \
            else graph.call_method("contiguous", (x,))
    dense.meta.update({TENSOR: x.meta.get(TENSOR), LAYOUT: "contiguous", INSERTED_BY: by,
                       "nn_module_stack": x.meta.get("nn_module_stack")})
    if OBSERVED in x.meta:  # (the same elements)
        dense.meta[OBSERVED] = x.meta[OBSERVED]
    return dense


class ContiguousCopies(Pass):
    """The rewrite both contiguous passes make: each node's input that ``copied_input`` names
    is read through a ``contiguous`` copy, one for all the nodes reading that value, taken
    before the first; a copy of its own for each where the value is written in place (a copy
    taken before the write would give a later reader the old values)."""
    stage = "prepare"
    rewrites = True
    also_reads = (LAYOUT,)
    writes = (INSERTED_BY, TENSOR, OBSERVED, LAYOUT)  # the new nodes' facts

    def copied_input(self, node: torch.fx.Node, gm) -> "torch.fx.Node | None":
        raise NotImplementedError

    def call(self, gm):
        graph, done, made = gm.graph, 0, {}
        written = mutated_nodes(graph, gm)
        for node in list(graph.nodes):
            x = self.copied_input(node, gm)
            if x is None:
                continue
            dense = made.get(x) if x not in written else None
            if dense is None:
                dense = made[x] = _contiguous_copy(graph, x, node, self.name)
            node.replace_input_with(x, dense)
            done += 1
        return PassResult(gm, done > 0)


class ContiguousLinearInputs(ContiguousCopies):
    def copied_input(self, node, gm):
        if packable(node, gm) in ("linear", "module") and _strided(node.args[0]):
            return node.args[0]
        return None
