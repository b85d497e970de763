"""Meet a stated output tolerance: measure, attribute the error to nodes, pin, re-solve.

The error is the relative L2 error of each float output on each calibration batch against the
float32 graph's, the worst of them (``mpgraph.numerics``: the metric users compute). When a plan
misses the tolerance, each low-precision node is charged its share of the worst output's error
on the first batch (``attribute``: its own rounding, carried to that output by one backward pass
of the float32 graph; a pooler's dense layer, which tanh alone follows, outranks the matmuls
that a residual and a LayerNorm damp, where their local errors are alike and pinning by those
pinned eleven matmuls of a small BERT where the pooler's alone met the tolerance).
The most expensive nodes are pinned to float32 and the plan re-solved; the number pinned doubles
each round (1, 2, 4, ...), and once the tolerance holds, a bisection over the last round's pins
keeps the shortest prefix that still meets it. O(log n) rebuilds and runs in all, where bisection
over the model (onnxconverter-common's auto_mixed_precision) rebuilds it at every step.
"""
from __future__ import annotations

import logging
import math
import numbers
import operator
import warnings
from typing import Callable, Optional

import torch
import torch.fx

from mpgraph.errors import CalibrationError, ToleranceError, ValueCheckError
from mpgraph.ir.graph import (RecordingInterpreter, flat_inputs, fresh, input_nodes, is_inplace,
                              is_view, mutated_nodes, run_recording, seeded, state_kept)
from mpgraph.ir.simulate import SimulatingInterpreter, run_simulated
from mpgraph.numerics import float_leaves, relative_l2, worst_error
from mpgraph.ir.meta import (CHECK, ESTIMATE, PRECISION, TENSOR, cast_source, dtype_name,
                             is_inserted_cast)

log = logging.getLogger(__name__)


def check_tolerance(tolerance) -> float:
    """The tolerance as a float: any real number, also numpy's (np.float32) and a 0-dim tensor
    (an error measured with torch), which were refused as "not a positive number" (pM 5)."""
    value = tolerance.item() if getattr(tolerance, "ndim", None) == 0 \
        and callable(getattr(tolerance, "item", None)) else tolerance
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"tolerance must be a positive number (a relative L2 error such as 1e-2), "
                         f"got {tolerance!r}")
    return float(value)


def _error(outputs: list, references: list) -> float:
    """The worst output's relative L2 error over the batches (mpgraph.numerics)."""
    return worst_error(list(zip(outputs, references)))


def _call(gm, call, simulate: bool = False):
    """The graph's flat outputs on one batch; ``simulate``: computed as the target would
    (mpgraph.ir.simulate: a GPU plan on a CPU), not in the CPU's emulated kernels."""
    run = run_simulated if simulate else run_recording
    return run(gm, *call, lambda node, value: None)


class _Unrounded(SimulatingInterpreter):
    """A converted graph computed in float32 from its stored weights, nothing rounded: the
    float32 graph where there is no other (a failed value check's)."""

    def __init__(self, gm: torch.fx.GraphModule, on_node):
        super().__init__(gm, on_node, rounding=False)


def attribute(base: torch.fx.GraphModule, converted: torch.fx.GraphModule, call,
              low: torch.dtype, simulate: bool = False,
              unrounded: bool = False) -> dict[str, float]:
    """Error each low-precision node adds, on one batch: node name -> its share of the worst
    output's relative error (``_shares``), or, where that cannot be had (an output that is
    inf, a graph autograd cannot run), the relative error it adds locally (``_local``).
    ``unrounded``: ``base`` is ``converted`` itself, computed in float32 (``_Unrounded``)."""
    runner = _Unrounded if unrounded else RecordingInterpreter
    conv: dict[str, torch.Tensor] = {}

    def keep(node, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            conv[node.name] = value.detach().float().clone()

    output = (run_simulated if simulate else run_recording)(converted, *call, keep)
    # (the casts InsertCasts put in are not the model's nodes: a pin is on what they serve)
    low_nodes = [n.name for n in converted.graph.nodes if n.name in conv
                 and not is_inserted_cast(n) and (d := n.meta.get(PRECISION)) is not None
                 and d.dtype not in (None, torch.float32) and not d.stored]
    # (a view or a value written in place shares its storage with another node)
    written = mutated_nodes(base.graph, base)
    try:
        shares = _shares(base, call, conv, low_nodes, output, written, runner)
    except Exception as e:  # noqa: BLE001 (a ranking only: the local one serves as well)
        log.info("tolerance: error shares not computed (%s: %s); ranking by local errors",
                 type(e).__name__, e)
        shares = None
    if shares and max(shares.values()) > 0:
        unranked = [name for name in low_nodes if name not in shares]
        if unranked:  # (views and values written in place: their local error, the same scale)
            local = _local(base, converted, call, conv, unranked, written, runner)
            shares.update({name: local.get(name, 0.0) for name in unranked})
        return _to_producers(converted, shares)
    return _to_producers(converted, _local(base, converted, call, conv, low_nodes, written, runner))


def _to_producers(converted: torch.fx.GraphModule, added: dict[str, float]) -> dict[str, float]:
    """The errors of a multi-output op's items (an nn.GRU's output and state) charged to the op,
    the largest of them (each an item, a view, ranked by its local error: the same rounding seen
    twice): its own value is a tuple, which gets none, and an item comes out in the op's dtype,
    so a pin on it is not applied (the search logged its own pins as user overrides not applied,
    then found no node left to pin with the GRU still low)."""
    nodes = {n.name: n for n in converted.graph.nodes}
    charged: dict[str, float] = {}
    for name, e in added.items():
        node = nodes[name]
        while node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
                and isinstance(node.args[0].meta.get(TENSOR), (tuple, list)):
            node = node.args[0]  # (nested: nn.LSTM's (out, (h, c)))
        charged[node.name] = max(charged.get(node.name, e), e)
    return charged


def _shares(base, call, conv: dict, low_nodes: list, output, written: set,
            runner=RecordingInterpreter) -> Optional[dict[str, float]]:
    """Each low node's share of the worst output's relative error, to first order.

    A node's own rounding d (its value in the converted run minus what float32 computes from
    the same converted inputs: one run of the float32 graph fed the converted values) reaches
    the output as J d, J the Jacobian from that node to the output; the output's error e is the
    sum of those, so ``<J d, e> / (|y| |e|) = <J^T e, d> / (|y| |e|)`` is the part of the
    relative error |e|/|y| the node accounts for. One backward pass of the float32 graph from
    e gives every J^T e. A node whose rounding grows through what follows it (a pooler's dense
    layer, read by tanh alone, against a block's matmul damped by the residual and LayerNorm
    after it) ranks by that, where its local error alone (``_local``) ranks them alike."""
    # (a view or a value written in place (``written``) shares its storage with another node:
    # replaced by a tensor of its own, the write no longer reaches the other, and the run is not
    # float32's)
    low = set(low_nodes)
    names = {n.name for n in base.graph.nodes if n.name in low
             and not is_view(n) and n not in written and not is_inplace(n, base)}
    own: dict[str, torch.Tensor] = {}

    class Fed(runner):
        """The float32 graph, each low node's result replaced by its converted value."""
        def run_node(self, n):
            result = super().run_node(n)
            value = conv.get(n.name)
            if n.name in names and isinstance(result, torch.Tensor) \
                    and result.shape == value.shape:
                own[n.name] = value - result.detach().float()
                return value.to(result.dtype, copy=True)
            return result

    flat = fresh(flat_inputs(base, *call))
    with torch.no_grad(), seeded(), state_kept(base):
        Fed(base, lambda node, value: None).run(*flat, enable_io_processing=False)

    probes: dict[str, torch.Tensor] = {}

    class Probed(runner):
        """The float32 graph with a zero added to each low node's result, to differentiate by."""
        def run_node(self, n):
            result = super().run_node(n)
            if n.name in own and isinstance(result, torch.Tensor) \
                    and result.shape == own[n.name].shape:
                probes[n.name] = torch.zeros_like(result, requires_grad=True)
                return result + probes[n.name]
            return result

    flat = fresh(flat_inputs(base, *call))
    # no parameter gradient is wanted: autograd then keeps no matmul's input for one
    frozen = [p for p in base.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        with torch.enable_grad(), seeded(), state_kept(base):
            reference = Probed(base, lambda node, value: None).run(*flat,
                                                                    enable_io_processing=False)
            pairs = [(c.detach().float(), r) for c, r in zip(float_leaves(output),
                                                              float_leaves(reference))
                     if c.shape == r.shape and r.is_floating_point()]
            errors = [relative_l2(c, r.detach()) for c, r in pairs]
            if not probes or not errors or not all(map(math.isfinite, errors)) \
                    or max(errors) == 0:
                return None
            y_hat, y = pairs[errors.index(max(errors))]
            if not y.requires_grad:  # the worst output does not depend on any low node
                return None
            finite = torch.isfinite(y.detach())  # where float32 itself is inf/NaN: left out
            e = torch.where(finite, y_hat - y.detach().float(), 0.0)
            weight = e / (torch.where(finite, y.detach().float(), 0.0).norm() * e.norm())
            grads = torch.autograd.grad((y.float() * weight).sum(), list(probes.values()),
                                        allow_unused=True)
    finally:
        for p in frozen:
            p.requires_grad_(True)
        # a buffer the forward wrote in place from a probed value (an EMA) took its grad_fn,
        # which state_kept's copy back does not undo: the next deepcopy of the graph refused it
        for module in base.modules():  # (the conversion's own copy of the model)
            for store in (module._buffers, module.__dict__):
                for name, t in list(store.items()):
                    if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) \
                            and t.grad_fn is not None:
                        store[name] = t.detach()  # (detach_() refuses a view)
    shares = {name: 0.0 if g is None else float((g.float() * own[name]).sum())
              for name, g in zip(probes, grads)}
    return shares if all(map(math.isfinite, shares.values())) else None


def _local(base, converted, call, conv: dict, low_nodes: list, written: set,
           runner=RecordingInterpreter) -> dict[str, float]:
    """Each low node's relative error minus the largest among its activation inputs: its own
    rounding, including that of its low-precision weights, without what it merely passes on."""
    ref: dict[str, torch.Tensor] = {}

    def keep(node, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            # an in-place write's result is the tensor written (a buffer), which the run puts
            # back afterwards: a copy, or the store was charged an error of inf against zeros;
            # a value written later (through a view) is copied as it is now, too
            ref[node.name] = value.clone() if is_inplace(node, base) or node in written \
                else value

    flat = fresh(flat_inputs(base, *call))
    with torch.no_grad(), seeded(), state_kept(base):
        runner(base, keep).run(*flat, enable_io_processing=False)
    err = {name: relative_l2(value, ref[name]) for name, value in conv.items()
           if name in ref and value.shape == ref[name].shape}
    added = {}
    nodes = {n.name: n for n in converted.graph.nodes}
    for name in low_nodes:
        if name not in err:
            continue
        inherited = [err.get(cast_source(a).name, 0.0) for a in input_nodes(nodes[name])
                     if cast_source(a).op != "get_attr"]
        added[name] = max(0.0, err[name] - max(inherited, default=0.0))
    return added


def meet_tolerance(base: torch.fx.GraphModule, build: Callable[[dict], torch.fx.GraphModule],
                   first: torch.fx.GraphModule, calls: list, tolerance: float,
                   low: torch.dtype, simulate: bool = False) -> tuple[torch.fx.GraphModule, dict]:
    """The first plan whose error meets ``tolerance``, and the report of the search.

    ``base`` is the float32 graph, ``build(pins)`` converts a fresh copy with the given node
    names (-> the error attributed to each) pinned to float32, ``first`` is the plan without pins.
    """
    references = [_call(base, c) for c in calls]
    for i, ref in enumerate(references):
        bad = sum(int((~torch.isfinite(t)).sum()) for t in float_leaves(ref))
        if bad:
            raise CalibrationError(f"calibration batch {i}: the float32 model's outputs hold {bad} "
                                   "inf/NaN values, so no error can be measured against them "
                                   "(look for NaN or inf in that batch's inputs)")
    if not any(float_leaves(ref) for ref in references):  # (it was "met, error 0" while
        # 1.6% of an argmax's classes differed)
        warnings.warn(f"tolerance={tolerance:g} bounds the relative L2 error of floating "
                      "outputs, and this model returns none (integer/bool outputs only: an "
                      "argmax, a mask): it constrains nothing, and the summary gives the share of "
                      "their values that differ from float32's. Return the logits to bound "
                      "their error", UserWarning, stacklevel=4)
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
        g = build(dict(pinned))
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
    checked = (gm.meta.get(CHECK) or {}).get("error")
    if checked is not None and checked > max(tolerance, error) * 1.01 + 1e-6:
        # (the search measures against the rewritten graph in float32, the check against the
        # model: they differ where a rewrite changed what the model computes)
        raise ValueCheckError(
            f"tolerance {tolerance:g} met against the converted graph computed in float32 (error "
            f"{error:.3g}), but the converted module differs from the model by {checked:.3g}: "
            "no precision accounts for that: mpgraph rewrote the graph wrongly (please report it "
            "with the model)", checked, tolerance, low)
    end_s = gm.meta.get(ESTIMATE, {}).get("plan_s")
    report = {"tolerance": tolerance, "error": error, "rounds": rounds,
              "pinned": sorted(pins.items(), key=lambda kv: -kv[1]),
              "estimated_s_before": start_s, "estimated_s_after": end_s}
    return gm, report
