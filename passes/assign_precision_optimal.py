"""Decide every node's dtype by exact cost minimisation (a minimum s-t cut).

Objective: Σ node time in its dtype + Σ casts, one per (value, dtype) however many readers share
it, with times from the plan's cost model as ``EstimateCost`` wrote them on the nodes. The rule pass runs first and bounds the
search: what it keeps in float32 stays there (fp32-class ops, user overrides, overflowing
constants and weights, explicit casts in the model, graph inputs and outputs, and follow ops that
read a float32 value, which keeps transformers' residual stream in float32 as autocast does: the
numeric policy). Among the nodes the rules allow in low precision, Tensor-Core ops included, the
cut picks exactly those where low precision pays for its casts, ties to float32; an in-place op
and the value it writes into, a view and a value written in place, a dtype-preserving
conversion and its input, and a tuple and the items read from it must agree. So the plan is
never estimated slower than the rules' plan, never less precise, and it knows the device: on an
H100 an 8x8 matmul between float32 ops stays float32 while a 4096x4096 one goes low; an
isolated ReLU is never wrapped in casts.
"""
from __future__ import annotations

from typing import Optional

import torch

from mpgraph.ir.meta import Kind
from mpgraph.ir.edges import required_dtype
from mpgraph.ir.graph import input_nodes, is_export_guard, is_inplace
from mpgraph.passes.op_table import CAST
from mpgraph.ir.meta import (CAST_COST, COST, COST_MODEL, ESTIMATE, OP_CLASS, PRECISION, TENSOR,
                             SAFETY, Decision, TensorInfo, dtype_name, is_float32_tensor)
from mpgraph.cost.mincut import FP32 as CUT_FP32, LOW as CUT_LOW, Problem, solve
from mpgraph.passes.infra import PassResult

from mpgraph.passes.assign_precision import AssignPrecision, aliases_written, explicit_dtype

FP32 = torch.float32
_OUTPUT = "<graph output>"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"


class AssignPrecisionOptimal(AssignPrecision):
    writes = (PRECISION, ESTIMATE)  # ESTIMATE on gm.meta: the plan's time on the target
    also_reads = (SAFETY, COST, CAST_COST, COST_MODEL)

    def __init__(self, low_dtype: torch.dtype, kernels: Kind, keep_io_types: bool = True,
                 overrides: Optional[dict] = None, keep_fp32: Optional[str] = None,
                 range_dtype: Optional[torch.dtype] = None,
                 from_plan: Optional[dict] = None, train: bool = False,
                 pins: Optional[dict] = None):
        super().__init__(low_dtype, keep_io_types, overrides, keep_fp32, range_dtype, from_plan, train,
                         kernels=Kind(kernels), pins=pins)  # "cpu", "gpu", "onnx"; a CostModel is refused

    def requires(self, gm):
        super().requires(gm)  # TENSOR and OP_CLASS on every node; and what it prices:
        if COST_MODEL not in gm.meta:
            raise self.fail(f"needs {COST_MODEL} on the graph: run EstimateCost first")
        for node in gm.graph.nodes:
            if node.op.startswith("call_") and COST not in node.meta and not is_export_guard(node):
                raise self.fail(f"needs {COST} on every call node: run EstimateCost first", node)

    def call(self, gm):
        super().call(gm)  # the rule decisions: their pinned ones are our hard constraints
        order = list(gm.graph.nodes)
        dec = {n: n.meta[PRECISION] for n in order}
        problem, variables, tied = self._problem(order, gm, dec)
        labels, total = solve(problem)
        low_of = {CUT_FP32: FP32, CUT_LOW: self.low}
        for n in variables:
            c = n.meta[COST]
            dtype = low_of[labels[n]]
            alone = self.low if c.t_low < c.t_fp32 else FP32
            why = f"cost: {_us(c.t_fp32)} in float32, {_us(c.t_low)} in {dtype_name(self.low)}"
            if dtype != alone:
                why += f"; {dtype_name(dtype)} saves the casts {dtype_name(alone)} would need"
            if dec[n].param_dtype is not None and dtype == self.low:
                why += f"; {dec[n].reason}"
            dec[n] = Decision(dtype, why, param_dtype=dec[n].param_dtype if dtype == self.low else None)
        for n, (how, _) in tied.items():
            dec[n] = Decision(low_of[labels[n]], f"{how} ({dtype_name(low_of[labels[n]])})", pinned=True,
                              reads_any=dec[n].reads_any)
        stored = {n for n in order if dec[n].stored}
        self._decide_stored(order, gm, dec, stored)
        for n in order:
            n.meta[PRECISION] = dec[n]
        if self.range_dtype is not None and any(dec[n].dtype == self.range_dtype for n in order):
            # the cut priced the nodes fp16's range keeps in bf16 as float32 nodes (its side of
            # the cut), without their casts: the plan built is priced instead, each node at its
            # dtype (bf16 at fp16's rate, a GPU with both) and each cast (a layer 186 us "in
            # float32" made an A100 plan 1.73x where it is 4.7x)
            AssignPrecision._estimate(self, gm)
        else:
            baseline = sum(n.meta[COST].t_fp32 for n in order if COST in n.meta)
            rest = sum(n.meta[COST].t_fp32 for n in order
                       if COST in n.meta and n not in problem.cost)
            gm.meta[ESTIMATE] = {"target": gm.meta[COST_MODEL]["target"], "fp32_s": baseline,
                                 "plan_s": total + rest, "source": gm.meta[COST_MODEL]["source"]}
        return PassResult(gm, False)

    def _estimate(self, gm) -> None:
        pass  # (call writes the cut's exact total)

    def _problem(self, order, gm, dec):
        problem = Problem()
        variables, tied = [], {}
        convertible = (FP32, self.low)
        # bf16 nodes beside fp16 are fixed, on the cut's float32 side: not fp16, so a cast
        # separates them from fp16 neighbours as it would a float32 node (their casts to float32
        # neighbours are not priced: an approximation for the few nodes fp16's range excludes)
        label = {FP32: CUT_FP32, self.low: CUT_LOW}
        if self.range_dtype is not None:
            label[self.range_dtype] = CUT_FP32
        for n in order:
            d = dec[n]
            if d.dtype is None or d.stored:
                continue
            if n.op in ("placeholder", "get_attr"):
                problem.fixed[n] = label[d.dtype]
                continue
            if n.op == "output":
                continue
            c = n.meta[COST]
            problem.cost[n] = (c.t_fp32, c.t_low)
            partner = self._tie(n, gm, dec, convertible)
            if partner is not None:
                problem.equal.append((n, partner[1]))
                tied[n] = partner
            elif d.pinned or d.dtype == FP32:  # the rules' float32 is a bound, not a suggestion
                problem.fixed[n] = label[d.dtype]
            else:
                variables.append(n)
        if self.keep_io_types:
            problem.fixed[_OUTPUT] = CUT_FP32
        for v in order:
            d = dec[v]
            if d.dtype is None or d.stored or not is_float32_tensor(v.meta[TENSOR]):
                continue
            readers = []
            for u in v.users:
                if u.op == "output":
                    if self.keep_io_types:  # (a multi-output value: each float item)
                        readers.append(_OUTPUT)
                    continue
                du = dec[u]
                if du.dtype is None or du.reads_any or u in tied and tied[u][1] is v:
                    continue
                if isinstance(v.meta[TENSOR], tuple):  # items of a tuple cannot be cast alone
                    problem.equal.append((v, u))
                    continue
                if required_dtype(u, v, gm, self.keep_io_types, dec.get) is not None:
                    readers.append(u)
            if readers:
                problem.reads[v] = readers
                if CAST_COST not in v.meta:
                    raise self.fail(f"needs {CAST_COST} on the values it may cast: the cost "
                                    "model prices no casts (CostModel.cast_cost)", v)
                problem.cast_cost[v] = v.meta[CAST_COST]
        return problem, variables, tied

    def _tie(self, n, gm, dec, convertible):
        """(why, the node whose dtype ``n`` must share), or None."""
        def usable(partner):
            return partner is not None and dec[partner].dtype in convertible and not dec[partner].stored

        if n.args and isinstance(n.args[0], torch.fx.Node) and is_inplace(n, gm) and usable(n.args[0]):
            return "in place on the value it writes into", n.args[0]
        # (a cast between them: the write through the view, or a later one into the value,
        # lands in a copy; h[:, :512].mul_(2) read by softmax was 0.45 off, reported 4e-4)
        if aliases_written(n, gm, self._mutated) and usable(n.args[0]):
            return "a view of a value written in place, the same tensor", n.args[0]
        if n.meta[OP_CLASS].op_class == CAST:
            asked = explicit_dtype(n)
            if isinstance(asked, tuple) and usable(asked[1]):
                return f"casts to the dtype of {asked[1].name}", asked[1]
            first = input_nodes(n)[0] if input_nodes(n) else None
            if asked is None and usable(first):
                return "dtype-preserving conversion of its input", first
        return None
