"""Record the range of every float value over calibration batches.

The float32 graph runs node by node (a torch.fx Interpreter) on each batch; for every floating
value we keep its finite absolute max (per batch, so findings can say "on 3/8 batches"), its
smallest non-zero magnitude and its count of inf/NaN elements. The safety rules read these: a
range seen in float32 is the range the low-precision graph has to hold. Without calibration data
``convert`` passes the example inputs, so every plan has ranges from at least one real run; that
batch is measured once: capture's run on it (``PropagateTensorInfo(observe=True)``) records the
same statistics, and a batch that is those inputs, on a graph that run covered, is taken from it.
"""
from __future__ import annotations

import hashlib
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.errors import CalibrationError
from mpgraph.numerics import float_leaves
from mpgraph.ir.graph import (as_call, flat_inputs, is_batch_encoding, mutated_nodes,
                               run_recording, source_line)
from mpgraph.ir.modules import guard_error
from mpgraph.ir.simulate import run_simulated
from mpgraph.ir.meta import (CONSTANT_INPUTS, OBSERVED, RANGE, REFERENCE, TENSOR, Reference,
                             TensorInfo, ValueRange)
from mpgraph.passes.infra import Pass, PassResult
from mpgraph.ir.fake import is_abstract
from mpgraph.ir.ops import move_names

log = logging.getLogger(__name__)
_LOW = (torch.float16, torch.bfloat16)
_PROGRESS_MIN_BATCHES = 8  # show a progress bar (on a terminal) from this many batches up


def tensor_stats(t: torch.Tensor) -> tuple[float, float, int]:
    """(finite absmax, smallest non-zero finite magnitude, count of inf/NaN) of one tensor;
    absmax inf where no value is finite (nothing bounds it: the overflow rules keep it float32).

    It runs on every value of every calibration batch, so it reads the values as few times as
    it can: one min/max pass (no copy of a strided view) settles values of one sign (softmax,
    exp, a variance); mixed signs add |t| and its min, exact zeros (relu, masks) a masked min,
    and inf/NaN the masks below. Min and max are exact in any float dtype."""
    if t.numel() == 0:
        return 0.0, math.inf, 0
    t = t.detach()
    if t.numel() > _CHUNK:  # weights of GBs: chunks keep the temporaries small and reused
        chunks = t.reshape(-1).split(_CHUNK)
        parts = [tensor_stats(c) for c in chunks]
        bounded = [p for p, c in zip(parts, chunks) if p[2] < c.numel()] or parts
        return max(p[0] for p in bounded), min(p[1] for p in parts), sum(p[2] for p in parts)
    lo, hi = (float(v) for v in torch.aminmax(t))
    if math.isfinite(lo) and math.isfinite(hi):
        if lo > 0 or hi < 0:
            return max(-lo, hi) + 0.0, min(abs(lo), abs(hi)), 0
        a = t.abs()
        small = float(a.min())
        if small == 0 and hi != lo:  # exact zeros: the smallest magnitude among the others
            small = float(a.masked_fill_(a == 0, math.inf).min())
        return max(-lo, hi) + 0.0, small if small > 0 else math.inf, 0  # (+0.0: no -0.0)
    a = t.reshape(-1).abs()
    if a.dtype not in (torch.float32, torch.float64):
        a = a.float()
    nonfinite = 0
    top = a.max()
    if not torch.isfinite(top):  # inf or NaN somewhere (NaN propagates through max)
        finite = torch.isfinite(a)
        nonfinite = int(a.numel() - int(finite.sum()))
        a = a.masked_fill(~finite, 0)
        top = a.max()
    small = torch.where(a > 0, a, math.inf).min()
    if nonfinite == a.numel():  # no finite value: nothing bounds it (not an absmax of 0)
        return math.inf, math.inf, nonfinite
    return float(top), float(small), nonfinite


_CHUNK = 1 << 22  # values per chunk of tensor_stats: 16 MB of float32


def _digest(t: torch.Tensor) -> bytes:
    """A hash of a tensor's bytes, position by position: batches of token ids with equal sums,
    or one the other's permutation, are different batches."""
    flat = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return hashlib.blake2b(flat.numpy().tobytes(), digest_size=16).digest()


def _seen_before(earlier: set, batch) -> bool:
    """Whether ``batch`` holds the values of one already in ``earlier`` (and records it if
    not): ``calibration=[x] * 4`` is one batch's ranges, and its plan must say one batch. A
    fingerprint only (which keyword each value is; shapes, dtypes and a hash of the values of
    each tensor), so that batches streamed from a loader are not all kept alive."""
    leaves, spec = pytree.tree_flatten(batch)
    try:
        key = (str(spec), *((tuple(t.shape), t.dtype, str(t.device), _digest(t))
                            if isinstance(t, torch.Tensor) and not is_abstract(t) else repr(t)
                            for t in leaves))
    except Exception:  # noqa: BLE001 - (a leaf without bytes, a sparse one: never a repeat)
        return False
    if key in earlier:
        return True
    earlier.add(key)
    return False


_EMPTY = ("empty", "empty_like", "new_empty", "empty_strided", "empty_permuted")


def _uninitialised(node: torch.fx.Node) -> bool:
    """A tensor torch.empty* made: its values are whatever memory held until the model writes
    them (a range measured there changed from run to run: 3.48e+17, 5.97e+23)."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return name.split(".")[0] in _EMPTY


def _where(gm: torch.fx.GraphModule, last: str) -> str:
    """The node a run failed at (the one after ``last``, the last it recorded) and the model's
    line that made it: "view_18" alone names nothing the user wrote."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr")]
    names = [n.name for n in nodes]
    at = nodes[names.index(last) + 1] if last in names and names.index(last) + 1 < len(nodes) \
        else None
    if at is None:
        return f"after node {last}"
    line = source_line(at)
    return f"at node {at.name}" + (f" ({line})" if line else "")


def _nan_inputs(names: list[str], inputs: list) -> list[tuple[str, int, int]]:
    """(name, NaN count, size) of each float input holding NaN."""
    found = []
    for name, t in zip(names, inputs):
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) \
                and not is_abstract(t):
            count = int(torch.isnan(t).sum())
            if count:
                found.append((name, count, t.numel()))
    return found


def _refuse_nan(found: list, batch: int) -> None:
    """A NaN in a calibration input that reaches the values the graph computes makes them NaN,
    and NaN bounds nothing: the ranges the overflow rules read would be those of the few values
    it spares (a NaN feature column left every node's absmax at 0, and fp16 overflowed on clean
    inputs). One the model removes first (``torch.nan_to_num(x)``) bounds nothing away, and inf
    is taken (an additive mask's -inf is an input like any other)."""
    name, count, size = found[0]
    raise CalibrationError(
        f"calibration batch {batch}, input {name}: {count} NaN values of {size}: every value "
        "computed from a NaN is NaN, so the ranges calibration measures (what keeps "
        "overflowing values in float32) would miss them; calibrate on inputs without NaN "
        "(without calibration=, the example inputs are the one batch)")


# ops whose output holds exactly their input's elements (views, reshapes, copies): their
# statistics are the input's, not measured again; dropout in eval and the identity too (below)
_SAME_ELEMENTS = move_names(lambda move: move.same_elements)


def same_elements(node: torch.fx.Node, value) -> Optional[torch.fx.Node]:
    """The input whose elements ``node``'s output holds, all and only them (same count, same
    dtype): its statistics are the output's. None for anything else."""
    if node.op not in ("call_function", "call_method") or not node.args \
            or not isinstance(node.args[0], torch.fx.Node) or not isinstance(value, torch.Tensor):
        return None
    target = node.target
    name = target if node.op == "call_method" else \
        getattr(getattr(target, "overloadpacket", target), "__name__", "")
    identity = name == "dropout" and isinstance(target, torch._ops.OpOverload) \
        and len(node.args) > 2 and node.args[2] is False  # aten.dropout(x, p, train=False)
    info = node.args[0].meta.get(TENSOR)
    if (name in _SAME_ELEMENTS or identity) and isinstance(info, TensorInfo) \
            and info.numel == value.numel() and info.dtype == value.dtype:
        return node.args[0]
    return None


def value_stats(node: torch.fx.Node, value, measured: dict, mutated=frozenset()) -> list:
    """``tensor_stats`` of each float tensor in a node's output, from ``measured`` (the same
    run's, by node) where the node only rearranges an input's elements and nothing writes into
    that input in place (``mutated``: mpgraph.ir.graph.mutated_nodes; the input's statistics
    were taken before such a write)."""
    source = same_elements(node, value)
    if source in measured and source not in mutated:
        return measured[source]
    return [tensor_stats(t) for t in float_leaves(value)
            if t.is_floating_point() and not is_abstract(t)]


@dataclass(frozen=True)
class Observation:
    """One float32 run of the graph on the example inputs, as Calibrate would record it; each
    node's statistics are in its meta (``mpgraph.observed``), beside its ``mpgraph.tensor``."""

    inputs: list    # the flat inputs it ran on (copies of these very objects were run)
    output: Any     # the graph's flat output (as ``run_recording`` returns it)
    buffers: dict   # name -> value of each buffer after the run (the run then put them back)
    weights: dict   # id -> (tensor, its _version, its stats) of each parameter or buffer read:
                    # the same in any run of any rewrite of the graph, while not written

    def weight_stats(self, value) -> Optional[list]:
        """The stats of a parameter or buffer this run read, if it is still what was read."""
        seen = self.weights.get(id(value))
        return seen[2] if seen and seen[0] is value and seen[1] == value._version else None

    def covers(self, gm: torch.fx.GraphModule, inputs: list) -> bool:
        """Whether it stands for a run of ``gm`` on ``inputs``: the same input objects, and
        every node carries its statistics. Rewrites keep that true as they keep
        ``mpgraph.tensor``: removing a node changes no other node's value, and a node that
        replaces one computing the same value takes its meta (Functionalize's out-of-place op,
        FollowTrainingFlag's module, FuseTanhGelu's GELU for the chain it computes to float32
        rounding); a node without it (a new value) makes the batch run again."""
        return _same_inputs(inputs, self.inputs) and all(OBSERVED in n.meta for n in gm.graph.nodes)


def _same_inputs(a, b) -> bool:
    """The very same tensors (nested in lists or dicts too), and equal other values."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is not y:
                return False
            continue
        try:
            if type(x) is not type(y) or not bool(x == y):
                return False
        except Exception:  # noqa: BLE001 - a value without a plain equality: not the same
            return False
    return True


def _progress(batches, show: Optional[bool]):
    total = len(batches) if hasattr(batches, "__len__") else None
    if show is None:
        show = total is not None and total >= _PROGRESS_MIN_BATCHES and sys.stderr.isatty()
    if not show:
        return batches
    try:
        from tqdm.auto import tqdm
    except ImportError:  # no tqdm: progress through logging instead
        return _logged(batches, total)
    return tqdm(batches, total=total, desc="mpgraph calibration", unit="batch")


def _logged(batches, total):
    for i, b in enumerate(batches):
        log.info("calibration batch %d%s", i + 1, f"/{total}" if total else "")
        yield b


def _constant(value) -> Optional[float]:
    """The one value a tensor of more than one element holds (all zeros, all ones), else None."""
    if not isinstance(value, torch.Tensor) or value.numel() < 2 or is_abstract(value):
        return None
    flat = value.detach().reshape(-1)
    return flat[0].item() if bool((flat == flat[0]).all()) else None


def _described(args: tuple, kwargs: dict) -> str:
    """'2 positional arguments (a tuple of 0, a dict) and keyword arguments x, mask'."""
    def kind(value) -> str:
        if isinstance(value, torch.Tensor):
            return "a tensor"
        if isinstance(value, (tuple, list)):
            return f"a {type(value).__name__} of {len(value)}"
        return f"a {type(value).__name__}"
    parts = [f"{len(args)} positional argument{'' if len(args) == 1 else 's'}"
             + (f" ({', '.join(kind(a) for a in args)})" if args else "")]
    if kwargs:
        parts.append(f"keyword arguments {', '.join(kwargs)}")
    return " and ".join(parts)


def _pair_hint(args: tuple, kwargs: dict) -> str:
    """The way out for a batch given as an (args, kwargs) pair, as torch.export takes one."""
    if len(args) == 2 and isinstance(args[0], (tuple, list)) and isinstance(args[1], dict) \
            and not kwargs:
        return (" (an (args, kwargs) pair is two positional arguments: give the dict of keyword "
                "arguments, with the positional ones by name)")
    return ""


class Calibrate(Pass):
    """Analysis: writes ``mpgraph.range`` (a ValueRange) on every node with a float output."""
    stage = "calibrate"
    # on gm.meta: REFERENCE, batch 0's float32 outputs; CONSTANT_INPUTS, (input, its value) of
    # inputs constant in every batch (degenerate calibration data, which convert warns about)
    writes = (RANGE, REFERENCE, CONSTANT_INPUTS, OBSERVED)  # OBSERVED: taken, then dropped

    def __init__(self, batches: Iterable, progress: Optional[bool] = None,
                 example: Optional[tuple[tuple, dict]] = None, simulate: bool = False):
        if isinstance(batches, (torch.Tensor, dict)) or is_batch_encoding(batches):
            raise CalibrationError("calibration must be an iterable of batches (e.g. a list of "
                                   "input tensors or tuples), not one batch")
        self.batches = batches
        self.progress = progress
        self.example = example  # (args, kwargs) of capture, to explain a batch that does not fit
        # a plan checked by simulating its target (CheckConversion's simulate): a model that
        # computes in fp16/bf16 itself is its reference as that target computes it, not as this
        # CPU's kernels do (an unchanged bf16 Llama reported 0.0046 "vs the model as it
        # computes", of a module bit-identical to it, pN 7)
        self.simulate = simulate

    def _check_fits(self, gm, i: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The batch as the graph's forward takes it (as a call's: the converted module's
        check), or a CalibrationError saying why it does not fit."""
        signature, checked, refused = gm.__dict__.get("call_signature"), None, None
        if signature is not None:  # what a call may give, a batch may (a None where the
            try:                   # example had a tensor, another fixed value: the graph's not)
                checked = signature.check(tuple(args), dict(kwargs))
            except TypeError as e:  # (after the check of its form, which says more: an
                refused = e         # (args, kwargs) pair given as two positional arguments)
        try:
            try:
                got = flat_inputs(gm, args, kwargs)
            except (TypeError, ValueError):
                if checked is None:
                    raise
                # (as the call passes it on: an fx graph named a forward's mask=None "mask_1")
                got = flat_inputs(gm, *checked)
                args, kwargs = checked
        except (TypeError, ValueError) as e:
            # (torch.export's structures as text are two pytree dumps: what each side is instead)
            why = "" if "TreeSpec" in str(e) else f" ({e})"
            took = f"; the model was converted with {_described(*self.example)}" \
                if self.example is not None else ""
            raise CalibrationError(
                f"calibration batch {i} does not match the model's arguments{why}: it is "
                f"{_described(args, kwargs)}{took}. Give each batch as the model is called: a "
                f"dict of keyword arguments, a tuple of positional arguments or one tensor"
                f"{_pair_hint(args, kwargs)}") from None
        if self.example is not None:
            want = flat_inputs(gm, *self.example)
            for j, (g, w) in enumerate(zip(got, want)):
                if isinstance(w, torch.Tensor) and not isinstance(g, torch.Tensor):
                    raise CalibrationError(f"calibration batch {i}, input {j}: expected a tensor "
                                           f"like the example input, got {type(g).__name__}"
                                           f"{_pair_hint(args, kwargs)}")
                if isinstance(w, torch.Tensor) and (g.dim() != w.dim() or g.dtype != w.dtype):
                    raise CalibrationError(
                        f"calibration batch {i}, input {j}: shape {tuple(g.shape)} {g.dtype} "
                        f"does not fit the example input's {tuple(w.shape)} {w.dtype} (same rank "
                        "and dtype needed)")
        if refused is not None:
            raise CalibrationError(f"calibration batch {i}: {refused}") from None
        return args, kwargs

    def call(self, gm):
        # capture's run on the example inputs (PropagateTensorInfo(observe=True)): a batch that
        # is those very inputs, on the graph that run covered, is taken from it, not run again
        observed = gm.meta.pop(OBSERVED, None)
        mutated = mutated_nodes(gm.graph, gm)
        per_batch: dict[torch.fx.Node, list[float]] = {}
        smallest: dict[torch.fx.Node, float] = {}
        bad: dict[torch.fx.Node, int] = {}
        count = 0
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        constant: Optional[set] = None  # (input, its one value) in every batch so far
        earlier: set = set()  # the batches' fingerprints (a batch given twice counts once)
        for i, batch in enumerate(_progress(self.batches, self.progress)):
            args, kwargs = as_call(batch)
            if _seen_before(earlier, (args, kwargs)):
                log.info("calibration batch %d repeats an earlier one: not counted again", i)
                continue
            args, kwargs = self._check_fits(gm, i, args, kwargs)
            nan_in = _nan_inputs(names, flat_inputs(gm, args, kwargs))
            computed_bad: list = []  # computed nodes with inf/NaN in this batch
            # one value, the same in every batch (a decode step's positions hold one value
            # in each batch, a different one in each: calibration saw them vary)
            here = {(name, v) for name, v in ((name, _constant(t)) for name, t in
                                              zip(names, flat_inputs(gm, args, kwargs)))
                    if v is not None}
            constant = here if constant is None else constant & here
            seen: dict[torch.fx.Node, float] = {}
            measured: dict[torch.fx.Node, list] = {}  # this batch's tensor_stats, by node
            last = ["(graph inputs)"]

            def wanted(node) -> bool:  # a weight is the same on every batch: measured once
                return not (count and node.op == "get_attr" and node in per_batch) \
                    and not _uninitialised(node)

            def add(node, stats) -> None:
                if stats:
                    seen[node] = max(s[0] for s in stats)
                    smallest[node] = min([smallest.get(node, math.inf)] + [s[1] for s in stats])
                    nonfinite = sum(s[2] for s in stats)
                    bad[node] = bad.get(node, 0) + nonfinite
                    if nonfinite and node.op.startswith("call_"):
                        computed_bad.append(node)

            def record(node, value):
                last[0] = node.name
                if wanted(node):
                    known = observed.weight_stats(value) if observed and node.op == "get_attr" \
                        else None  # a weight capture's run measured: the same in this run
                    measured[node] = known if known is not None else \
                        value_stats(node, value, measured, mutated)
                    add(node, measured[node])

            if observed is not None and observed.covers(gm, flat_inputs(gm, args, kwargs)):
                for node in gm.graph.nodes:
                    if wanted(node):
                        add(node, node.meta[OBSERVED])
                output, observed = observed.output, None
            else:
                try:
                    output = run_recording(gm, args, kwargs, record)
                except Exception as e:  # noqa: BLE001 - re-raised with the batch and node named
                    first = str(e).splitlines()[0] if str(e) else ""
                    if isinstance(e, AssertionError) and first.startswith("Guard failed"):
                        # torch.export's input guard: what the converted module says of it
                        raise CalibrationError(f"calibration batch {i} does not fit the graph "
                                               f"captured from the example: "
                                               f"{guard_error(gm, first)}") from None
                    raise CalibrationError(f"calibration batch {i} failed {_where(gm, last[0])}"
                                           f": {type(e).__name__}: {first}") from e
            if nan_in and computed_bad:  # (it reached what the graph computes)
                _refuse_nan(nan_in, i)
            for node, m in seen.items():
                per_batch.setdefault(node, []).append(m)
            if count == 0:  # what the converted graph is checked against (CheckConversion)
                if self.simulate and any(getattr(n.meta.get(TENSOR), "dtype", None) in _LOW
                                         for n in gm.graph.nodes):
                    output = run_simulated(gm, args, kwargs, lambda node, value: None)
                gm.meta[REFERENCE] = Reference(args, kwargs, tuple(
                    v.detach() if isinstance(v, torch.Tensor) else v
                    for v in pytree.tree_leaves(output)))
            count += 1
        if count == 0:
            raise CalibrationError("calibration is empty: pass at least one batch of inputs")
        for node in gm.graph.nodes:
            node.meta.pop(RANGE, None)
            node.meta.pop(OBSERVED, None)  # taken (or stale): not carried into the plan
            if node in per_batch:
                node.meta[RANGE] = ValueRange(max(per_batch[node]), smallest[node], bad[node],
                                              tuple(per_batch[node]))
        # batches that measured values: none on a model without them (planned on the meta
        # device, run as fakes), whose plan is not calibrated and must not say it was
        gm.meta[RANGE] = count if per_batch else 0
        held = dict(constant or ())
        gm.meta[CONSTANT_INPUTS] = tuple((n, held[n]) for n in names if n in held)
        log.debug("calibrated %d values over %d batches", len(per_batch), count)
        return PassResult(gm, False)
