"""A linear layer applied to one row (a decoder's step at batch 1, a batch-1 classifier head)
as a matrix-vector product: ``mv(W, x)``.

On a CPU ATen's ``linear`` with one row goes through the matrix-matrix path (``mm`` with the
transposed weight); ``mv`` reaches the GEMV kernels, which stream the weight once. Profiled in a
6-layer Llama's decode step on an AMX Xeon (2 threads, float32): a 768x2048 weight 300 us as
``mm``, 224 us as ``mv``; 768x768 121 vs 87 us; the 32000x768 LM head 4.6 ms vs 2.0 ms (bf16
there); the step 15.5 -> 13.4 ms a token (8 interleaved rounds). Each output is one dot product
either way (float32 accumulation for bf16). CPU targets only: on a GPU both reach cuBLAS and the
reshapes are nodes that cost host time in eager mode. A bias is added after (bf16 ``addmv``
with a bias leaves the fast GEMV path); the add is marked (``LINEAR_BIAS``) so that the plan
treats its parameter as the layer's weight it is.

GPT-2's Conv1D, ``addmm(b, x, W)`` with W stored k x n, becomes ``mv(t(W), x) + b``, and
StoreWeights stores its low-precision copy transposed (``read_transposed``), so that the GEMV
reads contiguous rows. A 768x3072 bf16 projection, each call on a weight read from memory (24
copies in turn, 2-core AMX Xeon): ``addmm`` 408-415 us, ``mv`` over the stored transpose 242-248
us, ``mv`` over a row-major weight's transpose 532-573 us; float32 ``addmm`` 337-346 us and
``mv(t(W))`` 347-375 us (a tie). GPT-2 small's decode step went 25 -> 19 ms a token.

Only where the graph fixes the row count: a torch.export graph whose value there has concrete
sizes (export holds a dimension that is 1 in the example at 1, and its input guard rejects
another size). A torch.fx graph runs any shape: a batch-1 example must not make the converted
module fail on 4 rows, or return (1, n) for an input of shape (k,).
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch
import torch.fx

from mpgraph.cost.measured import weight_of
from mpgraph.ir.graph import mutated_nodes
from mpgraph.ir.meta import INSERTED_BY, LINEAR_BIAS, OBSERVED, TENSOR, TensorInfo
from mpgraph.passes.infra import Pass, PassResult

aten = torch.ops.aten
log = logging.getLogger(__name__)


def _fixed_rows(x: torch.fx.Node) -> bool:
    """Whether the graph fixes every dimension of ``x`` but the last (export's sizes are ints)."""
    val = x.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 1 \
        and all(type(d) is int for d in val.shape[:-1])


def _transpose_of(node: torch.fx.Node):
    """The 2-D value ``node`` transposes (``t``, ``transpose(0, 1)``), else None."""
    if node.op != "call_function" or not isinstance(node.args[0], torch.fx.Node):
        return None
    info = node.args[0].meta.get(TENSOR)
    if not isinstance(info, TensorInfo) or len(info.shape) != 2:
        return None
    if node.target is aten.t.default or (node.target is aten.transpose.int
                                        and sorted(d % 2 for d in node.args[1:3]) == [0, 1]):
        return node.args[0]
    return None


def _one_row(node: torch.fx.Node):
    """(x, weight, bias, transposed, the product's output info) of a linear on one row, else
    None: ``linear(x, W, b)`` (W is n x k), and ``addmm(b, x, W)`` / ``mm(x, W)`` on a weight
    (W is k x n: GPT-2's Conv1D), ``transposed``, which becomes ``mv(t(W), x)``."""
    if node.op != "call_function" or node.kwargs:
        return None
    args, bias = node.args, None
    if node.target is aten.linear.default and 2 <= len(args) <= 3:
        (x, weight), transposed = args[:2], False
        bias = args[2] if len(args) == 3 else None
    elif node.target is aten.addmm.default and len(args) == 3:
        (bias, x, weight), transposed = args, True
    elif node.target is aten.mm.default and len(args) == 2:
        (x, weight), transposed = args, True
    else:
        return None
    if transposed and isinstance(weight, torch.fx.Node) and _transpose_of(weight) is not None:
        weight, transposed = _transpose_of(weight), False  # x @ W.t(): mv(W, x), no t(t(W))
    if not isinstance(x, torch.fx.Node) or not isinstance(weight, torch.fx.Node) \
            or not (bias is None or isinstance(bias, torch.fx.Node)) or not _fixed_rows(x) \
            or (transposed and weight_of(weight) is None):
        return None
    xi, wi, out = (a.meta.get(TENSOR) for a in (x, weight, node))
    if not all(isinstance(i, TensorInfo) for i in (xi, wi, out)) or len(wi.shape) != 2 \
            or not xi.dtype.is_floating_point or not xi.shape or math.prod(xi.shape[:-1]) != 1:
        return None
    n = wi.shape[1] if transposed else wi.shape[0]
    if bias is not None and getattr(bias.meta.get(TENSOR), "shape", None) != (n,):
        return None  # (addmm's bias may broadcast from another shape)
    return x, weight, bias, transposed, out


class MatVecLinear(Pass):
    """``pays``: asked with the (k, n, bias, transposed) of every one-row linear of the graph
    (``mpgraph.cost.measured.one_row_mv_pays``), whether ``mv`` runs them faster here; False
    leaves them all ``linear`` (one answer for the graph: a saved plan says by its nodes
    whether it has them). None: rewritten (a forced dtype, another machine's plan)."""
    stage = "prepare"
    rewrites = True
    writes = (INSERTED_BY, TENSOR, OBSERVED, LINEAR_BIAS)  # the new nodes' facts

    def __init__(self, pays: Optional[Callable[[list], bool]] = None):
        self.pays = pays

    def call(self, gm):
        graph, done, unobserved, rows = gm.graph, 0, False, {}
        if self.pays is not None:
            found = filter(None, map(_one_row, graph.nodes))
            layers = [(w.meta[TENSOR].shape[0 if t else 1], w.meta[TENSOR].shape[1 if t else 0],
                       b is not None, t) for _, w, b, t, _ in found]
            if not layers:
                return PassResult(gm, False)
            if not self.pays(layers):
                log.info("%d one-row linears kept as linear: mv was not faster on this machine",
                         len(layers))
                return PassResult(gm, False)
        written = mutated_nodes(graph, gm)
        for node in list(graph.nodes):
            found = _one_row(node)
            if found is None:
                continue
            x, weight, bias, transposed, out = found
            n, k = weight.meta[TENSOR].shape[::-1] if transposed else weight.meta[TENSOR].shape
            with graph.inserting_before(node):
                # one row view of x for all its linears (q, k and v), so that a plan casts it
                # once; not where x is written in place (a view taken before the write would
                # give a later linear the old values once cast)
                row = rows.get(x) if x not in written else None
                if row is None:
                    row = graph.call_function(aten.view.default, (x, [k]))
                    row.meta[TENSOR] = TensorInfo((k,), x.meta[TENSOR].dtype)
                    row.meta[INSERTED_BY] = self.name
                    row.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
                    if OBSERVED in x.meta:  # the capture run's statistics: the same elements
                        row.meta[OBSERVED] = x.meta[OBSERVED]
                    if x not in written:
                        rows[x] = row
                if transposed:  # k x n read as n x k (StoreWeights stores it so, contiguous)
                    weight = self._transposed(graph, weight, node)
                    unobserved |= OBSERVED not in weight.meta
                y = graph.call_function(aten.mv.default, (weight, row))
                added = [y]
                if bias is not None:
                    y = graph.call_function(aten.add.Tensor, (y, bias))
                    y.meta[LINEAR_BIAS] = True
                    added.append(y)
                shaped = graph.call_function(aten.view.default, (y, list(out.shape)))
            for v in added:
                v.meta[TENSOR] = TensorInfo((n,), out.dtype)
            shaped.meta.update({key: v for key, v in node.meta.items()
                                if key in (TENSOR, "nn_module_stack", "stack_trace", "val")})
            for v in added + [shaped]:
                v.meta[INSERTED_BY] = self.name
                v.meta.setdefault("nn_module_stack", node.meta.get("nn_module_stack"))
            if OBSERVED in node.meta and OBSERVED in row.meta and bias is None:
                y.meta[OBSERVED] = shaped.meta[OBSERVED] = node.meta[OBSERVED]
            else:
                unobserved = True
            node.replace_all_uses_with(shaped)
            read = node.args[2 if node.target is aten.addmm.default else 1]
            graph.erase_node(node)
            if _transpose_of(read) is not None and not read.users:  # the model's own t(W)
                graph.erase_node(read)
            done += 1
        if unobserved:  # statistics the capture run did not take (mv before its bias): Calibrate
            gm.meta.pop(OBSERVED, None)  # runs the graph again
            for node in graph.nodes:
                node.meta.pop(OBSERVED, None)
        return PassResult(gm, done > 0)

    def _transposed(self, graph, weight: torch.fx.Node, node: torch.fx.Node) -> torch.fx.Node:
        t = graph.call_function(aten.t.default, (weight,))
        k, n = weight.meta[TENSOR].shape
        t.meta.update({TENSOR: TensorInfo((n, k), weight.meta[TENSOR].dtype),
                       INSERTED_BY: self.name, "nn_module_stack": node.meta.get("nn_module_stack")})
        if OBSERVED in weight.meta:  # the same elements
            t.meta[OBSERVED] = weight.meta[OBSERVED]
        return t
