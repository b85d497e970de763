"""Meet a stated output tolerance: measure, attribute the error to nodes, pin, re-solve.

The error is the relative L2 error of each float output on each calibration batch against the
float32 graph's, the worst of them (``mpgraph.numerics``: the metric users compute). When a plan misses the tolerance, the float32 and the converted graph run on the
same (first) batch node by node, and each low-precision node is charged the error it adds: the
relative error of its output minus the largest relative error among its activation inputs (its
own rounding, including that of its low-precision weights, without what it merely passes on).
The most expensive nodes are pinned to float32 and the plan re-solved; the number pinned doubles
each round (1, 2, 4, ...), and once the tolerance holds, a bisection over the last round's pins
keeps the shortest prefix that still meets it. O(log n) rebuilds and runs in all, where bisection
over the model (onnxconverter-common's auto_mixed_precision) rebuilds it at every step.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.fx

from mpgraph.errors import CalibrationError, ToleranceError
from mpgraph.ir.graph import input_nodes, is_inplace, run_recording
from mpgraph.ir.simulate import run_simulated
from mpgraph.numerics import float_leaves, relative_l2, worst_error
from mpgraph.ir.meta import ESTIMATE, PRECISION, cast_source, dtype_name

log = logging.getLogger(__name__)


def check_tolerance(tolerance) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
            or not math.isfinite(tolerance) or tolerance <= 0:
        raise ValueError(f"tolerance must be a positive number (a relative L2 error such as 1e-2), "
                         f"got {tolerance!r}")
    return float(tolerance)


def _error(outputs: list, references: list) -> float:
    """The worst output's relative L2 error over the batches (mpgraph.numerics)."""
    return worst_error(list(zip(outputs, references)))


def _call(gm, call, simulate: bool = False):
    """The graph's flat outputs on one batch; ``simulate``: computed as the target would
    (mpgraph.ir.simulate: a GPU plan on a CPU), not in the CPU's emulated kernels."""
    run = run_simulated if simulate else run_recording
    return run(gm, *call, lambda node, value: None)


def attribute(base: torch.fx.GraphModule, converted: torch.fx.GraphModule, call,
              low: torch.dtype, simulate: bool = False) -> dict[str, float]:
    """Error each low-precision node adds, on one batch: node name -> relative error added."""
    ref: dict[str, torch.Tensor] = {}

    def keep(node, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            # an in-place write's result is the tensor written (a buffer), which the run puts
            # back afterwards: a copy, or the store was charged an error of inf against zeros
            ref[node.name] = value.clone() if is_inplace(node, base) else value

    run_recording(base, *call, keep)
    err: dict[str, float] = {}

    def compare(node, value):
        if node.name in ref and isinstance(value, torch.Tensor) \
                and value.shape == ref[node.name].shape:
            err[node.name] = relative_l2(value, ref[node.name])

    (run_simulated if simulate else run_recording)(converted, *call, compare)

    added = {}
    for node in converted.graph.nodes:
        d = node.meta.get(PRECISION)
        if d is None or d.dtype in (None, torch.float32) or node.name not in err or d.stored:
            continue
        inherited = [err.get(cast_source(a).name, 0.0) for a in input_nodes(node)
                     if cast_source(a).op != "get_attr"]
        added[node.name] = max(0.0, err[node.name] - max(inherited, default=0.0))
    return added


def meet_tolerance(base: torch.fx.GraphModule, build: Callable[[dict], torch.fx.GraphModule],
                   first: torch.fx.GraphModule, calls: list, tolerance: float,
                   low: torch.dtype, simulate: bool = False) -> tuple[torch.fx.GraphModule, dict]:
    """The first plan whose error meets ``tolerance``, and the report of the search.

    ``base`` is the float32 graph, ``build(pins)`` converts a fresh copy with the given node
    names pinned to float32, ``first`` is the plan without pins.
    """
    references = [_call(base, c) for c in calls]
    for i, ref in enumerate(references):
        bad = sum(int((~torch.isfinite(t)).sum()) for t in float_leaves(ref))
        if bad:
            raise CalibrationError(f"calibration batch {i}: the float32 model's outputs hold {bad} "
                                   "inf/NaN values, so no error can be measured against them "
                                   "(look for NaN or inf in that batch's inputs)")
    again = _error([_call(base, c) for c in calls], references)
    if again > tolerance:
        raise ToleranceError(f"tolerance {tolerance:g} cannot be met even in float32: two float32 "
                             f"runs of the model differ by {again:.3g} (is it in training mode, "
                             "with dropout?)")
    gm, pins, rounds = first, {}, 0
    start_s = first.meta.get(ESTIMATE, {}).get("plan_s")
    error = _error([_call(gm, c, simulate) for c in calls], references)
    if math.isnan(error):  # inf/NaN where float32 is finite: as far from it as can be
        error = math.inf
    log.info("tolerance %g: error %.3g without pins", tolerance, error)
    def measure(pinned: dict):
        nonlocal rounds
        rounds += 1
        g = build({name: "fp32" for name in pinned})
        e = _error([_call(g, c, simulate) for c in calls], references)
        e = math.inf if math.isnan(e) else e
        log.info("tolerance %g: round %d, %d nodes pinned, error %.3g", tolerance, rounds,
                 len(pinned), e)
        return g, e

    k, last = 1, []
    while error > tolerance:
        added = attribute(base, gm, calls[0], low, simulate)
        candidates = sorted(((e, n) for n, e in added.items() if n not in pins), reverse=True)
        if not candidates:
            raise ToleranceError(
                f"tolerance {tolerance:g} not met: error {error:.3g} with {len(pins)} nodes pinned "
                f"to float32 and no {dtype_name(low)} node left to pin")
        before, last = dict(pins), candidates[:k]
        pins.update({name: e for e, name in last})
        gm, error = measure(pins)
        k *= 2
    if len(last) > 1:  # bisect the last round: the shortest prefix of it that still holds
        lo, hi = 0, len(last)  # prefix hi is known to hold; prefix lo is known not to (lo=0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            trial = {**before, **{name: e for e, name in last[:mid]}}
            g, e = measure(trial)
            if e <= tolerance:
                hi, gm, error, pins = mid, g, e, trial
            else:
                lo = mid
    end_s = gm.meta.get(ESTIMATE, {}).get("plan_s")
    report = {"tolerance": tolerance, "error": error, "rounds": rounds,
              "pinned": sorted(pins.items(), key=lambda kv: -kv[1]),
              "estimated_s_before": start_s, "estimated_s_after": end_s}
    return gm, report
