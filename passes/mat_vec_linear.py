"""A linear layer applied to one row (a decoder's step at batch 1, a batch-1 classifier head)
as a matrix-vector product: ``mv(W, x)``.

On a CPU ATen's ``linear`` with one row goes through the matrix-matrix path (``mm`` with the
transposed weight); ``mv`` reaches the GEMV kernels, which stream the weight once. Profiled in a
6-layer Llama's decode step on an AMX Xeon (2 threads, float32): a 768x2048 weight 300 us as
``mm``, 224 us as ``mv``; 768x768 121 vs 87 us; the 32000x768 LM head 4.6 ms vs 2.0 ms (bf16
there); the step 15.5 -> 13.4 ms a token (8 interleaved rounds). Each output is one dot product
either way (float32 accumulation for bf16). CPU targets only: on a GPU both reach cuBLAS and the
reshapes are nodes that cost host time in eager mode. A bias is added after (bf16 ``addmv``
with a bias leaves the fast GEMV path).
"""
from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn.functional as F

from mpgraph.ir.graph import fetch_attr
from mpgraph.ir.meta import INSERTED_BY, OBSERVED, TENSOR, TensorInfo
from mpgraph.passes.calibrate import value_stats
from mpgraph.passes.infra import Pass, PassResult

aten = torch.ops.aten
_LINEAR = (aten.linear.default, F.linear)


def _one_row(node: torch.fx.Node, gm: torch.fx.GraphModule):
    """(x, weight, bias, output info) of a linear call on one row, else None; weight and bias
    are nodes, or for an nn.Linear module the attribute names to read them from."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if not isinstance(module, torch.nn.Linear) or type(module).forward is not \
                torch.nn.Linear.forward or len(node.args) != 1 or node.kwargs:
            return None
        x = node.args[0]
        weight = f"{node.target}.weight"
        bias = f"{node.target}.bias" if module.bias is not None else None
        wshape = tuple(module.weight.shape)
    elif node.op == "call_function" and node.target in _LINEAR and not node.kwargs \
            and 2 <= len(node.args) <= 3:
        x, weight = node.args[:2]
        bias = node.args[2] if len(node.args) == 3 else None
        if not isinstance(weight, torch.fx.Node) \
                or not (bias is None or isinstance(bias, torch.fx.Node)) \
                or not isinstance(weight.meta.get(TENSOR), TensorInfo):
            return None
        wshape = weight.meta[TENSOR].shape
    else:
        return None
    xi, out = (a.meta.get(TENSOR) if isinstance(a, torch.fx.Node) else None for a in (x, node))
    if not all(isinstance(i, TensorInfo) for i in (xi, out)) or len(wshape) != 2 \
            or not xi.dtype.is_floating_point or not xi.shape or math.prod(xi.shape[:-1]) != 1:
        return None
    return x, weight, bias, wshape, out


class MatVecLinear(Pass):
    stage = "prepare"
    rewrites = True
    writes = (INSERTED_BY, TENSOR, OBSERVED)  # the new nodes' facts

    def call(self, gm):
        graph, done, unobserved, rows = gm.graph, 0, False, {}
        for node in list(graph.nodes):
            found = _one_row(node, gm)
            if found is None:
                continue
            x, weight, bias, (n, k), out = found
            with graph.inserting_before(node):
                if isinstance(weight, str):  # an nn.Linear: read its parameters
                    weight = graph.get_attr(weight)
                    weight.meta[TENSOR] = TensorInfo((n, k), out.dtype)
                    bias = graph.get_attr(bias) if bias is not None else None
                    if bias is not None:
                        bias.meta[TENSOR] = TensorInfo((n,), out.dtype)
                    for a in (weight, bias):
                        if a is not None:
                            a.meta[INSERTED_BY] = self.name
                            if OBSERVED in node.meta:  # a parameter's statistics, as capture's
                                a.meta[OBSERVED] = value_stats(a, fetch_attr(gm, a.target), {})
                row = rows.get(x)  # one row view of x for all its linears (q, k and v): the plan
                if row is None:   # casts it once, not once per view
                    row = rows[x] = graph.call_function(aten.view.default, (x, [k]))
                    row.meta[TENSOR] = TensorInfo((k,), x.meta[TENSOR].dtype)
                    row.meta[INSERTED_BY] = self.name
                    row.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
                    if OBSERVED in x.meta:  # the capture run's statistics: the same elements
                        row.meta[OBSERVED] = x.meta[OBSERVED]
                y = graph.call_function(aten.mv.default, (weight, row))
                added = [y]
                if bias is not None:
                    y = graph.call_function(aten.add.Tensor, (y, bias))
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
            graph.erase_node(node)
            done += 1
        if unobserved:  # statistics the capture run did not take (mv before its bias): Calibrate
            gm.meta.pop(OBSERVED, None)  # runs the graph again
            for node in graph.nodes:
                node.meta.pop(OBSERVED, None)
        return PassResult(gm, done > 0)
