"""Run the converted graph once: every value and edge has its planned dtype, and the outputs
are float32's within a bound the plan states.

Static checks alone would trust the op table; this runs the graph (under no_grad, seeded like
Calibrate's run) on the first calibration batch (the example inputs by default) and compares
what each node really produced with what the plan says, so an op whose dtype behaviour we
misjudged is an error at conversion time, never a silently different model. Dtypes right is not
values right: an in-place op writing into a throwaway cast, or a dropped buffer update, has every
dtype right. So the outputs are compared with what the float32 graph gave on the same batch
(Calibrate's ``Reference``), each output by itself with the one metric users compute
(``mpgraph.numerics.relative_l2``: ``||y - y_hat|| / ||y||`` over the whole output): the worst
output above ``VALUE_BOUND_ULPS`` units of the low dtype's rounding (bf16 0.125, fp16 0.0156; plans
err by ~1e-2 and ~1e-3 on the models here, the wrong answers this catches by ~1) is an error that
names that output and the first node whose values part from float32.

Where the plan is for another device (a GPU plan checked on a CPU) the dtypes come from a run on
fake tensors (no arithmetic) and the values from a simulation of the target's arithmetic, which
costs one more float32 forward on this CPU. By default that simulation runs for graphs up to
``SIMULATED_VALUES_MAX_FLOPS`` per batch (every test-sized model; it was 0.9 s of BERT-base's
4.4 s convert at 8x128 on a 2-core CPU) and is reported as not run above it; ``check="values"``
always runs it. Measured by turning it off: the test suite then let no bad plan through (the
dtype check, capture's comparison with the eager model and the tests' own comparisons caught
them); the tests that failed were those asserting the recorded error figure.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.ir.edges import required_dtype
from mpgraph.errors import ConversionError, ValueCheckError
from mpgraph.ir.fake import is_abstract
from mpgraph.ir.graph import CALLS, input_nodes, run_recording, target_name
from mpgraph.ir.simulate import fake_dtypes, run_simulated
from mpgraph.numerics import (discrete_mismatches, float_leaf_positions, float_leaves,
                              output_errors, relative_l2, rounding)
from mpgraph.ir.meta import (CHECK, COST, OP_CLASS, PRECISION, RANGE, REFERENCE, TENSOR, TensorInfo,
                             dtype_name, is_float32_tensor, is_inserted_cast, planned_dtype,
                             tensor_infos)
from mpgraph.passes.infra import Pass, PassResult
from mpgraph.passes.op_table import FOLLOW

log = logging.getLogger(__name__)

VALUE_BOUND_ULPS = 32  # see the module docstring
# an all-float32 plan against the model: rewrites only reorder float32 sums (~1e-7); a rewrite
# that changes what the model computes (an in-place write lost) errs by ~1 (``_rewrite_error``)
FLOAT32_BOUND = 1e-3
SIMULATED_VALUES_MAX_FLOPS = 20e9  # fp32 FLOPs per batch (~0.2 s on a 2-core CPU); see above


def value_bound(low: torch.dtype) -> float:
    """The relative L2 error of the outputs a plan in ``low`` may have against float32."""
    return VALUE_BOUND_ULPS * rounding(low)


def _float32_bound(gm, outputs) -> tuple[float, str]:
    """(what an all-float32 plan may differ from the model by, why): float32's reorderings;
    where the model itself computes in a low dtype (a bf16 model), that dtype's rounding; on a
    GPU that lets float32 matmuls or convs run in TF32 (cuDNN's default), TF32's (a rewrite
    may pick another kernel: NHWC convs)."""
    lows = {i.dtype for n in gm.graph.nodes for i in tensor_infos(n.meta.get(TENSOR))
            if i.dtype in (torch.float16, torch.bfloat16)}
    if lows:
        low = max(lows, key=value_bound)
        return value_bound(low), f"the model computes in {dtype_name(low)} itself"
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    if tf32 and any(t.is_cuda for t in float_leaves(outputs)):
        return VALUE_BOUND_ULPS * 2.0 ** -11, "float32 matmuls and convs run in TF32 here"
    return FLOAT32_BOUND, "float32 sums in another order differ by ~1e-7"


def expected_dtypes(node):
    """The dtype(s) a node must produce: its decision for float32 values, else what was recorded."""
    return planned_dtype(node.meta.get(TENSOR), node.meta.get(PRECISION))


def _actual(value):
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_actual(v) for v in value)
    return None


def _no_kernel(gm, ran: dict, e: NotImplementedError) -> ConversionError:
    """The plan put an op in a dtype this machine's torch has no kernel for (CPU ``avg_pool3d``
    and antialiased ``interpolate`` in fp16/bf16): the node and the way out, not torch's text."""
    node = next((n for n in gm.graph.nodes if n.op in CALLS and n not in ran), None)
    if node is None:
        return ConversionError(f"the converted graph failed: NotImplementedError: {e}")
    dtype = getattr(node.meta.get(PRECISION), "dtype", None)
    key = node.target if node.op == "call_module" else node.name  # (what overrides= takes)
    op = f" ({target_name(node)})" if target_name(node) != key else ""
    return ConversionError(
        f"{key}{op} has no {dtype_name(dtype) + ' ' if dtype else ''}kernel on this machine "
        f"(torch: {str(e).splitlines()[0] if str(e) else 'not implemented'}): keep it in "
        f"float32 with overrides={{'{key}': 'fp32'}}, or plan for a target that runs it (target=)")


class CheckConversion(Pass):
    stage = "check"
    writes = (CHECK,)  # on gm.meta: the value check's error and bound

    def __init__(self, example_args: tuple, example_kwargs: dict | None = None,
                 keep_io_types: bool = True, simulate: bool = False,
                 values: Optional[bool] = None, tolerance: Optional[float] = None):
        self.args = tuple(example_args)
        self.kwargs = dict(example_kwargs or {})
        self.keep_io_types = keep_io_types
        # the plan is for another device than this one (a GPU plan on a CPU): dtypes from fake
        # tensors, values from the target's arithmetic (mpgraph.ir.simulate), no emulated kernels
        self.simulate = simulate
        # the value check: None for real runs always and simulated ones up to the size above,
        # True always (check="values"), False never
        self.values = values
        # a stated tolerance is the bound, met by the tolerance search after this pass (which
        # pins nodes until it is, or says it cannot): the error is recorded, not raised
        self.tolerance = tolerance

    def call(self, gm):
        gm.graph.lint()
        for node in gm.graph.nodes:
            if is_inserted_cast(node) and is_inserted_cast(node.args[0]):
                raise ConversionError(f"cast of a cast (round trip): {node.format_node()}")
        reference = gm.meta.get(REFERENCE)
        if reference is not None and any(isinstance(t, torch.Tensor) and is_abstract(t)
                                         for t in reference.outputs):
            reference = None  # a model without values (meta): nothing to compare
        args, kwargs = (reference.args, reference.kwargs) if reference else (self.args, self.kwargs)
        skipped = self._skip_values(gm) if reference is not None else None
        if skipped:
            reference = None
        actual, output = {}, None

        def record(node, value):
            actual[node] = _actual(value)

        if self.simulate:  # the target's dtypes from fake tensors; its values only to compare
            if reference is not None:
                output = run_simulated(gm, args, kwargs, lambda node, value: None)
            from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                                       DynamicOutputShapeException,
                                                       UnsupportedOperatorException)
            from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
            try:
                actual = fake_dtypes(gm, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException,
                    UnsupportedOperatorException, GuardOnDataDependentSymNode) as e:
                # an op fake tensors cannot run: run it (any other error is the plan's)
                # (a GRU given a PackedSequence, CTC loss: sizes from values); this machine's
                # own kernels give the same dtypes, emulated where it has no fast low precision
                log.info("dtypes from a real run: fake tensors cannot run the graph (%s: %s)",
                         type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                actual = {}
                run_recording(gm, args, kwargs, record)
        else:
            try:
                output = run_recording(gm, args, kwargs, record)
            except NotImplementedError as e:  # torch has no kernel for an op in its dtype here
                raise _no_kernel(gm, actual, e) from e
        problems = []
        for node in gm.graph.nodes:
            if node.op == "output" or node not in actual:
                continue
            want = expected_dtypes(node)
            if want is not None and not _agrees(actual[node], want):
                problems.append(f"{node.name}: produced {actual[node]}, plan says {want}")
            for arg in input_nodes(node):
                need = required_dtype(node, arg, gm, self.keep_io_types)
                if need is not None and arg in actual and actual[arg] is not None \
                        and not _reads_as(actual[arg], arg.meta.get(TENSOR), need):
                    problems.append(f"{node.name} reads {arg.name} as {actual[arg]}, needs {need}")
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise ConversionError("the converted graph does not match its plan:\n  " + shown + more)
        if reference is not None:
            self._check_values(gm, pytree.tree_leaves(output), reference)
        elif skipped and (low := _low_dtype(gm)) is not None:
            gm.meta[CHECK] = {"error": None, "bound": value_bound(low), "skipped": skipped}
        return PassResult(gm, False)

    def _skip_values(self, gm) -> Optional[str]:
        """Why the value check does not run, or None when it does."""
        if self.values is False:
            return "values not checked (check='dtypes')"
        if not self.simulate or self.values:
            return None
        flops = sum(getattr(n.meta.get(COST), "flops", 0.0) for n in gm.graph.nodes)
        if flops <= SIMULATED_VALUES_MAX_FLOPS:
            return None
        return (f"values not checked: the plan is for another device, and simulating it here "
                f"costs a float32 forward of {flops / 1e9:.0f} GFLOP (check='values', or the "
                f"CLI's --check values, runs it)")

    def _parting(self, gm, args, kwargs) -> dict:
        """Every float node's output on the batch, from two more runs of the converted graph
        (only a failed check needs them, to say where values part, so only it pays): node ->
        (its absmax, its relative L2 against the same graph computed in float32 from the
        stored weights, nothing rounded). The second finds rounding that a normalisation
        hides from magnitudes (``GroupNorm(c(x) + 100)`` in fp16: the add's rounding, which
        named the node after the norm, then the norm, and never the add)."""
        exact: dict = {}
        held = [0]

        def keep(node, value):  # (up to a budget: a large model's every activation is GBs)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() \
                    and held[0] < _PARTING_BYTES:
                exact[node] = value.detach().float().clone()
                held[0] += exact[node].numel() * 4

        try:
            run_simulated(gm, args, kwargs, keep, rounding=False)
        except Exception as e:  # noqa: BLE001 (magnitudes alone then: a packed CPU Linear)
            log.info("CheckConversion: no float32 run of the graph (%s: %s)", type(e).__name__, e)
            exact.clear()
        parting = {}

        def record(node, value):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                absmax = float(value.detach().abs().float()  # (an inf is an inf, not float32's max)
                               .nan_to_num(nan=math.inf, posinf=math.inf).max())
                ref = exact.pop(node, None)
                error = relative_l2(value.detach().float(), ref) \
                    if ref is not None and ref.shape == value.shape else 0.0
                parting[node] = (absmax, error)

        (run_simulated if self.simulate else run_recording)(gm, args, kwargs, record)
        return parting

    def _check_values(self, gm, outputs, reference) -> None:
        low = _low_dtype(gm)  # (None: nothing in low precision, the float32 graph checked as one)
        if low is not None:
            self._same_lengths(gm, outputs, reference.outputs, low)
        errors = output_errors(outputs, reference.outputs)
        error = max(errors, default=0.0)
        bound = None if low is None else value_bound(low) if self.tolerance is None \
            else self.tolerance
        gm.meta[CHECK] = {"error": error, "bound": bound, "outputs": errors,
                          "output_leaves": float_leaf_positions(reference.outputs)}
        if low is None:
            bound, why = _float32_bound(gm, outputs)
            if error > bound:
                self._rewrite_error(gm, outputs, reference, errors, error, bound, why)
            return
        differ = discrete_mismatches(outputs, reference.outputs)
        if differ:  # (not bounded: an argmax may move where two logits tie to rounding)
            gm.meta[CHECK]["discrete"] = differ
        if error <= bound or self.tolerance is not None:
            return
        # (errors count the float outputs; the message, as the other checks, counts every leaf)
        worst = float_leaf_positions(outputs)[errors.index(error)]
        where, names = _first_parting(gm, self._parting(gm, reference.args, reference.kwargs),
                                      bound, worst)
        causes = _causes(gm, (reference.args, reference.kwargs), low, self.simulate, error,
                         bound)
        if causes:  # (a rounding a normalisation amplifies shows first after the norm)
            names = [name for name, _ in causes]
            where += "; the rounding that accounts for it, to first order: " + ", ".join(
                f"{name}'s ({share:.2g} of the {error:.3g})" for name, share in causes)
        keep = ", ".join(f"{name!r}: 'fp32'" for name in names[:3]) or "'<node or module>': 'fp32'"
        raise ValueCheckError(
            f"the converted module's output {worst} differs from float32 by {error:.3g} (relative "
            f"L2 ||y - y_hat|| / ||y|| on the first calibration batch), more than a "
            f"{dtype_name(low)} plan should ({bound:.3g}): {where}. Either a value kept in "
            f"{dtype_name(low)} loses too much there (keep it in float32: "
            f"overrides={{{keep}}}, or state a tolerance= and the nodes that "
            "need it are pinned"
            + ("; or convert in bfloat16, float32's range: dtype='bf16'" if low == torch.float16
               else "") + "), or the conversion is wrong (please report it with the model)",
            error, bound, low)

    def _rewrite_error(self, gm, outputs, reference, errors, error, bound, why) -> None:
        """A ValueCheckError for an all-float32 plan off the model: no dtype explains it, a
        rewrite does. (A low plan's graph computed in float32 tells nothing: it still reads
        the weights the plan stored rounded, which a normalisation can amplify.)"""
        worst = float_leaf_positions(outputs)[errors.index(error)]
        where, _ = _first_parting(gm, self._parting(gm, reference.args, reference.kwargs),
                                  bound, worst)
        raise ValueCheckError(
            f"the converted module's output {worst} differs from the model's by {error:.3g} "
            f"(relative L2) with every node in float32 ({why}: bound {bound:g}): {where}. No "
            "precision accounts for that: mpgraph rewrote the graph wrongly (please report it "
            "with the model; check='dtypes' converts without this check)",
            error, bound, torch.float32)

    @staticmethod
    def _same_lengths(gm, outputs, references, low) -> None:
        """An output whose size depends on its values (``h[h > 0.5]``, ``nonzero``,
        ``masked_select``) that came out another size than float32's: rounding moved values
        across the threshold. No error metric compares the two: a ValueCheckError that names
        the comparison and the way out."""
        for i, (out, ref) in enumerate(zip(outputs, references)):
            if not (isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)) \
                    or out.shape == ref.shape:
                continue
            tests = _comparisons(gm)
            where = (f"; the values it selects by are compared at {', '.join(tests[:3])}"
                     if tests else "")
            keep = ", ".join(f"{v!r}: 'fp32'" for v in _compared_values(gm)[:3]) \
                or "'<node>': 'fp32'"
            raise ValueCheckError(
                f"the converted module's output {i} has shape {tuple(out.shape)} where float32's "
                f"has {tuple(ref.shape)}: its size depends on values (a boolean mask, nonzero, "
                f"masked_select), and rounding to {dtype_name(low)} moved some across the "
                f"threshold{where}. Keep the values compared in float32 (overrides={{{keep}}}), "
                "or return the scores and select outside the converted module",
                math.inf, value_bound(low), low)


def _comparisons(gm) -> list[str]:
    """Nodes that compare float values into a bool mask (what a data-dependent size hangs on)."""
    return [n.name for n in gm.graph.nodes if n.op in CALLS and _bool(n)
            and any(is_float32_tensor(a.meta.get(TENSOR)) or _low(a) for a in input_nodes(n))]


def _compared_values(gm) -> list[str]:
    """The low-precision values those comparisons are computed from (``_low_sources``)."""
    out: list[str] = []
    for n in gm.graph.nodes:
        if n.op in CALLS and _bool(n):
            for a in input_nodes(n):
                out += [name for name in _low_sources(a) if name not in out]
    return out


def _planned_low(node) -> bool:
    """Whether the plan gives ``node``'s value (or the value a cast of it reads) a low dtype."""
    source = node.args[0] if is_inserted_cast(node) else node
    decision = source.meta.get(PRECISION)
    return decision is not None and decision.dtype in (torch.float16, torch.bfloat16) \
        and source.op != "get_attr"


def _bool(node) -> bool:
    """Whether the node's value is a bool tensor (a mask)."""
    info = node.meta.get(TENSOR)
    return isinstance(info, TensorInfo) and info.dtype == torch.bool


def _low(node) -> bool:
    """Whether the node's value is a low-precision tensor (an inserted cast to fp16/bf16)."""
    info = node.meta.get(TENSOR)
    return isinstance(info, TensorInfo) and info.dtype in (torch.float16, torch.bfloat16)


def _reads_as(actual, info, need: torch.dtype) -> bool:
    """Whether a value produced in ``actual`` dtype(s) is read in ``need``: each item that was
    float32 at capture (a multi-output value's others keep theirs)."""
    if isinstance(info, tuple) and isinstance(actual, tuple) and len(info) == len(actual):
        return all(_reads_as(a, i, need) for a, i in zip(actual, info))
    if isinstance(info, TensorInfo):
        return info.dtype != torch.float32 or actual == need
    return True


def _agrees(actual, want) -> bool:
    """A node's dtypes as run against the plan's; a part the recorded run did not return as a
    tensor (nn.MultiheadAttention's weights with need_weights=False: None) is not compared."""
    if isinstance(want, tuple) and isinstance(actual, tuple) and len(want) == len(actual):
        return all(w is None or _agrees(a, w) for a, w in zip(actual, want))
    return actual == want


def _low_dtype(gm) -> Optional[torch.dtype]:
    """The coarsest low dtype the graph computes in (bf16 beside fp16: bf16's bound)."""
    used = {d.dtype for n in gm.graph.nodes if (d := n.meta.get(PRECISION)) is not None}
    return next((t for t in (torch.bfloat16, torch.float16) if t in used), None)


def _output_node(gm, index: int) -> Optional[torch.fx.Node]:
    """The node that computes the graph's output ``index`` (outputs flattened as the check
    flattens them: a multi-output node stands for as many), or None."""
    flat = []
    for item in pytree.tree_leaves([n.args[0] for n in gm.graph.nodes if n.op == "output"]):
        info = item.meta.get(TENSOR) if isinstance(item, torch.fx.Node) else None
        flat += [item] * (len(pytree.tree_leaves(info)) if isinstance(info, tuple) else 1)
    item = flat[index] if index < len(flat) else None
    return item if isinstance(item, torch.fx.Node) else None


def _ancestors(node: torch.fx.Node) -> set:
    """``node`` and every node it reads, directly or not."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack += n.all_input_nodes
    return seen


_PARTING_BYTES = 1 << 30  # float32 values a failed check keeps to say where values part


def _first_parting(gm, parting: dict, bound: float,
                   output: Optional[int] = None) -> tuple[str, list[str]]:
    """Where values part: the first node (graph order) that the failing output reads, directly
    or not, whose output magnitude parts from the float32 run's on the same batch (Calibrate's
    absmax of batch 0) by more than the bound, or turns inf/NaN, or whose values part from the
    graph's own computed in float32 by more than the bound (``_parting``); and the
    low-precision values to keep in float32 there (the node itself, or where it computes in
    float32, the low values it is computed from)."""
    out = _output_node(gm, output) if output is not None else None
    upstream = _ancestors(out) if out is not None else None
    for node in gm.graph.nodes:
        seen = node.meta.get(RANGE)
        if node not in parting or is_inserted_cast(node) \
                or (upstream is not None and node not in upstream):
            continue
        got, error = parting[node]
        want = seen.batch_absmax[0] if seen is not None and seen.batch_absmax else None
        if want is not None and (not math.isfinite(got) or abs(got - want) > bound * max(want, 1e-30)):
            where = (f"values first part at node {node.name} ({target_name(node)}): absmax "
                     f"{got:.4g}, float32 {want:.4g}")
        elif error > bound:
            where = (f"values first part at node {node.name} ({target_name(node)}): relative L2 "
                     f"{error:.3g} from what the graph computes there in float32")
        else:
            continue
        low = _low_sources(node)
        if low and low != [node.name]:
            where += f", computed in float32 from {', '.join(low)}, kept in low precision"
        return where, low
    return "no single node's magnitude parts (the outputs differ in their values' placement)", []


def _causes(gm, call, low: torch.dtype, simulate: bool, error: float,
            bound: float) -> list[tuple[str, float]]:
    """The low-precision nodes whose rounding accounts for the error (the tolerance search's
    attribution, against the graph computed in float32): the fewest, largest first (at most
    3), whose shares bring the rest under the bound or make 80% of all (first order: a
    rounding a LayerNorm turns into a constant row is charged a third of it); [] where no
    three do (the error spread thin: the first parting and tolerance= say more)."""
    from mpgraph.tolerance import attribute
    try:
        shares = attribute(gm, gm, call, low, simulate, unrounded=True)
    except Exception as e:  # noqa: BLE001 (advice only: the first parting names a node anyway)
        log.info("CheckConversion: error not attributed (%s: %s)", type(e).__name__, e)
        return []
    ranked = sorted(((n, s) for n, s in shares.items() if s > 0 and math.isfinite(s)),
                    key=lambda item: -item[1])
    total = sum(share for _, share in ranked)
    causes, left = [], error
    for name, share in ranked[:3]:
        causes.append((name, share))
        left -= share
        if left <= bound or sum(s for _, s in causes) >= 0.8 * total:
            return causes
    return []


def _low_sources(node: torch.fx.Node) -> list[str]:
    """The nodes whose low precision ``node``'s value inherits, to name in an override: the
    nearest low values upstream through float32 nodes (a float32 node only inherits their
    rounding), and through low elementwise ones (``follow``: an override of what they read
    turns them float32 too) to the ops that chose the low dtype (a matmul, a conv); the
    follow ones themselves where no such op is found."""
    chosen: list[str] = []
    followers: list[str] = []
    stack, seen = [node], set()
    while stack:
        n = stack.pop(0)
        n = n.args[0] if is_inserted_cast(n) else n
        if n in seen or n.op in ("placeholder", "get_attr"):
            continue
        seen.add(n)
        info = n.meta.get(OP_CLASS)
        if not _planned_low(n):
            stack += input_nodes(n)
        elif info is not None and info.op_class == FOLLOW:
            followers.append(n.name)
            stack += input_nodes(n)
        else:
            chosen.append(n.name)
    return chosen or followers[:1]
