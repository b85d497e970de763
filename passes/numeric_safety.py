"""Numeric safety: the findings that keep a node in float32, each with its evidence.

Runs after ClassifyOps and Calibrate; the precision assignment treats every finding as a hard
constraint on a node that would otherwise compute in low precision. Rules:

- ``range``: a value whose calibrated absmax exceeds ``finfo(low).max / RANGE_MARGIN`` is produced
  and read in float32 (a low reader would overflow at its input cast). The margin of 2 is one
  binade of headroom: calibration sees a sample, and a value twice as large as any seen is the
  smallest excursion that still overflows an fp16 value already at half its range (one doubling,
  e.g. a residual add of two such values). bf16 shares float32's exponent, so this rule only
  fires there for values near float32's own limit.
- ``constant``: a float operand of an op that computes in the low dtype that overflows the low dtype (|c| > max, e.g. -1e9 masks,
  ``finfo(float32).min``) or underflows it to zero (0 < |c| < smallest subnormal: eps 1e-12 in fp16).
- ``weight``: a parameter or buffer read in low precision that overflows, or that underflows:
  a small tensor (<= 16 values, an eps or a scale) with any value flushed to zero, or a larger one
  with more than 1% of its non-zero values flushed.
- ``unproven_range``: range-expanding ops (exp, pow, ...) are float32-only in fp16 unless
  calibration proves them safe: their output stayed finite and under the limit on every batch,
  in which case they become ``follow`` ops (the finding is then the evidence for lowering).

Long reductions (sum, mean, var, norms, cumsum) are float32-only by op class in every low dtype,
so no rule is needed for them here; matmul and conv accumulate in float32 on every backend we
target (Tensor Cores, AVX512-BF16/AMX, ONNX Runtime), so large K is a precision cost the tolerance
search measures rather than an overflow rule.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Optional

import torch
import torch.fx

from mpgraph.ir.graph import fetch_attr, input_nodes
from mpgraph.ir.meta import OP_CLASS, RANGE, SAFETY, OpInfo, SafetyFinding, ValueRange, dtype_name
from mpgraph.passes.op_table import CAST, FOLLOW, FP32_ONLY, RANGE_EXPANDING_REASON, TENSOR_CORE
from mpgraph.passes.infra import Pass, PassResult
from mpgraph.passes.calibrate import tensor_stats
from mpgraph.frontend.fake import is_abstract

log = logging.getLogger(__name__)

RANGE_MARGIN = 2.0             # limit = finfo(low).max / margin (see the module docstring)
SMALL_TENSOR = 16              # up to this many values: any underflow counts
UNDERFLOW_FRACTION = 0.01      # larger tensors: this share of non-zero values flushed to zero
_CALLS = ("call_function", "call_method", "call_module")


def smallest_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps  # 2**-24 for fp16, 2**-133 for bf16


def _tensor_findings(name: str, t: torch.Tensor, low: torch.dtype,
                     stats: tuple[float, float, int]) -> list[SafetyFinding]:
    """Findings for one weight, from its ``tensor_stats``; the values are read again only when
    some of them underflow (to count them)."""
    absmax, smallest, nonfinite = stats
    top, tiny = torch.finfo(low).max, smallest_subnormal(low)
    if absmax > top:
        return [SafetyFinding("weight", f"{name} absmax {absmax:.3g} overflows "
                                        f"{dtype_name(low)} (max {top:.5g})")]
    if smallest >= tiny / 2:
        return []
    a = t.detach().abs().float()
    zeros = int(torch.count_nonzero(a == 0))
    nonzero = t.numel() - zeros - nonfinite
    flushed = int(torch.count_nonzero(a < tiny / 2)) - zeros  # rounds to zero in the low dtype
    if flushed and (t.numel() <= SMALL_TENSOR or flushed > UNDERFLOW_FRACTION * nonzero):
        return [SafetyFinding("weight", f"{name}: {flushed} of {nonzero} non-zero values "
                                        f"(smallest {smallest:.3g}) underflow "
                                        f"{dtype_name(low)} to zero")]
    return []


class NumericSafety(Pass):
    """Analysis: writes ``mpgraph.safety`` (a tuple of SafetyFinding) on nodes that must stay
    float32; relaxes calibrated-safe range-expanding ops to ``follow`` in fp16."""
    stage = "decide"

    def __init__(self, low_dtype: torch.dtype, margin: float = RANGE_MARGIN,
                 alt_dtype: Optional[torch.dtype] = None):
        if margin < 1:
            raise ValueError(f"margin must be >= 1, got {margin}")
        self.low = low_dtype
        # bf16 beside fp16 (dtype="auto"): findings that bf16 clears are marked ``cleared_by``
        if alt_dtype not in (None, torch.bfloat16):
            raise ValueError(f"the second low dtype can only be bfloat16, got {alt_dtype}")
        self.alt = NumericSafety(alt_dtype, margin) if alt_dtype is not None else None
        self._seen: dict = {}  # weight statistics of the current run, by tensor
        self.limit = torch.finfo(low_dtype).max / margin
        self.top = torch.finfo(low_dtype).max
        self.tiny = smallest_subnormal(low_dtype)

    def requires(self, gm):
        for node in gm.graph.nodes:
            if node.op in _CALLS and OP_CLASS not in node.meta:
                raise self.fail("run ClassifyOps first", node)

    def _range_evidence(self, node) -> Optional[str]:
        r = node.meta.get(RANGE)
        if r is None or r.absmax <= self.limit:
            return None
        return (f"{node.name} absmax {r.absmax:.3g} > limit {self.limit:.3g} "
                f"({dtype_name(self.low)} max / {self.top / self.limit:g}) on "
                f"{r.batches_over(self.limit)}/{len(r.batch_absmax)} batches")

    def _constant_findings(self, node) -> list[SafetyFinding]:
        out = []
        for a in list(node.args) + list(node.kwargs.values()):
            # float operands only: int arguments are indices and sizes (slice ends of 2**63 - 1)
            if not isinstance(a, float) or not math.isfinite(a):
                continue
            if abs(a) > self.top:
                out.append(SafetyFinding("constant", f"constant {a:g} overflows {dtype_name(self.low)} "
                                                     f"(max {self.top:.5g})"))
            elif 0 < abs(a) < self.tiny / 2:
                out.append(SafetyFinding("constant", f"constant {a:g} underflows {dtype_name(self.low)} "
                                                     f"to 0 (smallest {self.tiny:.3g})"))
        return out

    def _weight_findings(self, node, gm) -> list[SafetyFinding]:
        weights = []
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            weights += [(f"{node.target}.{name}", t)
                        for name, t in list(mod.named_parameters()) + list(mod.named_buffers())]
        weights += [(str(a.target), fetch_attr(gm, a.target), a.meta.get(RANGE))
                    for a in input_nodes(node) if a.op == "get_attr"]
        out = []
        for name, t, *seen in weights:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() \
                    and not is_abstract(t):
                out += _tensor_findings(name, t, self.low, self._stats(t, seen[0] if seen else None))
        return out

    def _stats(self, t: torch.Tensor, seen: Optional[ValueRange]) -> tuple[float, float, int]:
        """tensor_stats of a weight: what Calibrate recorded for its get_attr node, else scanned
        once per run of this pass (and shared with the bf16 check)."""
        if seen is not None:
            return seen.absmax, seen.min_nonzero, seen.nonfinite
        key = (id(t), t._version)
        if key not in self._seen:
            self._seen[key] = tensor_stats(t)
        return self._seen[key]

    def _relax(self, node) -> Optional[SafetyFinding]:
        """A range-expanding op in fp16: follow when calibration proves it, else a finding."""
        info: OpInfo = node.meta[OP_CLASS]
        r = node.meta.get(RANGE)
        if r is not None and r.nonfinite == 0 and r.absmax <= self.limit:
            node.meta[OP_CLASS] = OpInfo(FOLLOW, f"{info.reason}; calibration: absmax "
                                                 f"{r.absmax:.3g} <= limit {self.limit:.3g} on all "
                                                 f"{len(r.batch_absmax)} batches",
                                         info.key, info.params_as_values, info.low_io)
            return None
        seen = "not calibrated" if r is None else (
            f"absmax {r.absmax:.3g} > limit {self.limit:.3g} on "
            f"{r.batches_over(self.limit)}/{len(r.batch_absmax)} batches" if r.absmax > self.limit
            else f"{r.nonfinite} inf/NaN values in float32")
        return SafetyFinding("unproven_range", f"range-expanding op not proven safe: {seen}")

    def _node_findings(self, node, gm) -> list[SafetyFinding]:
        info: OpInfo = node.meta[OP_CLASS]
        found = []
        if info.op_class == FP32_ONLY and info.reason.startswith(RANGE_EXPANDING_REASON) \
                and self.low == torch.float16:
            relaxed = self._relax(node)
            found += [relaxed] if relaxed else []
        if info.op_class in (TENSOR_CORE, FOLLOW):  # the others compute in float32 inside
            found += self._constant_findings(node)
        found += self._weight_findings(node, gm)
        own = self._range_evidence(node)
        if own:
            found.append(SafetyFinding("range", f"output {own}"))
        for a in input_nodes(node):
            ev = self._range_evidence(a) if a.op != "get_attr" else None
            if ev:
                found.append(SafetyFinding("range", f"input {ev}"))
        return found

    def call(self, gm):
        self._seen = {}
        if self.alt is not None:
            self.alt._seen = self._seen  # dtype-independent statistics: scanned once for both
        findings: dict[torch.fx.Node, list[SafetyFinding]] = {}
        for node in gm.graph.nodes:
            node.meta.pop(SAFETY, None)
        for node in gm.graph.nodes:
            if node.op not in _CALLS or node.meta[OP_CLASS].op_class == CAST:
                continue
            found = self._node_findings(node, gm)
            if found and self.alt is not None and not self.alt._node_findings(node, gm):
                found = [replace(f, cleared_by=dtype_name(self.alt.low)) for f in found]
            if found:
                findings[node] = found
        for node, found in findings.items():
            node.meta[SAFETY] = tuple(found)
            log.debug("%s: %s", node.name, "; ".join(f.evidence for f in found))
        return PassResult(gm, False)
