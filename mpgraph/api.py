"""The public entry point: ``convert``."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch

from mpgraph.frontend.capture import capture
from mpgraph.cost.device import auto_dtype, range_dtype, resolve_target
from mpgraph.cost.specs import DeviceSpec
from mpgraph.passes.op_table import OpTable
from mpgraph.passes.infra import deferred_recompile, run_passes, stage
from mpgraph.errors import PlanMismatchError
from mpgraph.ir.graph import EXPORT_GUARD, as_call, target_name
from mpgraph.ir.modules import DropoutRate, TrainingBatchNorm, WeightCopies, refuse_hooks
from mpgraph.ir.meta import (CONSTANT_INPUTS, REFERENCE, TENSOR, dtype_name, is_float32_tensor,
                             shape_of)
from mpgraph.plans.plan import MODES, Plan
from mpgraph.tolerance import check_tolerance, meet_tolerance
from mpgraph.frontend.fake import (Abstract, fake_mode, has_meta_tensors, is_abstract, module_tensors,
                                   trace_device)
from mpgraph.tools.weights import load_weights

log = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# convert's check: True (dtypes; values where they cost at most a small simulation), "values"
# (always), "dtypes" (no value run), False (nothing)
CHECKS = (True, False, "values", "dtypes")


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """torch.float16 / torch.bfloat16, or one of their names; anything else is a ValueError.

    ("auto" is resolved by ``convert`` against its target.)"""
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    raise ValueError(f"dtype must be torch.float16 or torch.bfloat16 (or one of "
                     f"{sorted(_DTYPES)}, or 'auto'), got {dtype!r}")


def _needs_inputs(model: torch.nn.Module) -> bool:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.default is inspect.Parameter.empty and
               p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in params)


def convert(model: torch.nn.Module, example_inputs: Any = None, *,
            dtype: Union[str, torch.dtype] = torch.float16,
            example_kwargs: Optional[dict] = None, keep_io_types: bool = True,
            target: Union[None, str, DeviceSpec] = None, strategy: str = "optimal",
            op_table: Optional[Union[OpTable, dict]] = None,
            overrides: Optional[dict] = None, check: Union[bool, str] = True,
            calibration: Optional[Iterable] = None, tolerance: Optional[float] = None,
            progress: Optional[bool] = None, plan: Optional[Plan] = None,
            mode: str = "inference", dynamic: bool = True) -> torch.fx.GraphModule:
    """Convert ``model`` to mixed precision; return a GraphModule carrying ``.plan``.

    The example inputs are run once to learn every value's shape and dtype (and once more to
    check the result when ``check``: every node's dtype against the plan, and the outputs against
    float32's; for a plan for another device (a GPU plan on a CPU) the outputs are simulated for
    graphs up to 20 GFLOP per batch, ``check="values"`` always, ``check="dtypes"`` never). ``target`` is the device to plan for: None for this machine,
    or a name ("h100", "a100", "t4", "cpu", ...). ``strategy="optimal"`` minimises the estimated
    time on it exactly (min-cut over node and cast costs); ``"rules"`` is the list-based decision.
    ``dtype="auto"`` picks the low dtype the target is fast at, or keeps float32 where low
    precision is slower; on GPUs that run fp16 and bf16 alike it picks fp16 and computes the
    nodes fp16's range keeps out of fp16 in bf16 instead of float32. ``op_table`` extends the built-in op classes (a dict from module type /
    function / method name / ATen op to a class name or OpEntry); ``overrides`` maps node names
    or module-path globs to "fp32" or the low dtype. The caller's model is never modified.

    ``calibration`` is an iterable of input batches (each like ``example_inputs``: a tensor, a
    tuple of arguments or a dict of keyword arguments); the float32 graph runs on each and every
    value's range is recorded; values that would overflow the low dtype, and range-expanding ops
    not proven safe, stay float32 (the plan names each with its evidence). Without it the example
    inputs are the calibration data. ``tolerance`` is the relative L2 error of the outputs allowed
    on the calibration data: nodes are pinned to float32, most error-adding first, until it holds
    (``plan.tolerance`` reports them). ``progress`` shows a progress bar over calibration batches
    (default: on a terminal, from 8 batches up).

    ``plan`` (a ``Plan``, e.g. ``Plan.load(path)``, possibly edited) is applied as it is: its dtype,
    target and every node's decision; a plan whose nodes, ops or shapes do not match the model's
    graph is a ``PlanMismatchError`` listing the differences.

    In the default ``mode="inference"`` the returned module's parameters are frozen
    (``requires_grad`` False): the low-precision ones are rounded copies of the model's.
    ``mode="train"``: the parameters stay float32 and are what an optimizer updates (master
    weights); each is cast to the low dtype once per forward inside the graph, shared by its
    readers; backward runs through every cast, so gradients arrive in float32; buffers the model
    writes (batch-norm statistics) keep their dtype; ``.train()``/``.eval()`` switch dropout and
    batch norm as in the model. The converted module trains its own copy of the parameters.

    ``dynamic`` (default True): a graph captured by torch.export keeps every input dimension
    above 1 symbolic, so the converted module runs at other batch sizes and sequence lengths.
    ``dynamic=False`` specialises it to the example's shapes (another shape fails the module's
    input guard): about half the capture time, and a graph without shape arithmetic, for a
    deployment that runs one shape (CUDA graphs, a fixed-size ONNX file).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert expects a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    train = mode == "train"
    if plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be an mpgraph.Plan (Plan.load(path)), got {type(plan).__name__}")
        if tolerance is not None:
            raise ValueError("a saved plan is applied as it is: pass plan= or tolerance=, not both")
        dtype, keep_io_types, strategy = plan.dtype, plan.keep_io_types, plan.strategy or strategy
        mode, train = plan.mode, plan.mode == "train"
        target = target if target is not None else plan.target
    spec = resolve_target(target)
    keep_fp32, second = None, None
    if plan is not None:
        low, keep_fp32 = plan.dtype, plan.kept_fp32
        second = next((getattr(torch, r.dtype) for r in plan.range_nodes), None)
    elif isinstance(dtype, str) and dtype.lower() == "auto":
        low, why = auto_dtype(spec)
        if low is None:
            low, keep_fp32 = torch.bfloat16, why
        second = range_dtype(spec, low)
        log.info("dtype auto on %s: %s", spec.name, why)
    else:
        low = resolve_dtype(dtype)
    if example_inputs is None and example_kwargs is None and _needs_inputs(model):
        raise ValueError("convert needs example_inputs (a tensor or a tuple of the model's "
                         "arguments) to learn which values are float32 and their shapes")
    args, kwargs = as_call(example_inputs, example_kwargs)
    kwargs = without_cache(model, args, kwargs)
    if tolerance is not None:
        tolerance = check_tolerance(tolerance)
        if calibration is not None:
            calibration = list(calibration)  # measured once per round of the search
    table = op_table if isinstance(op_table, OpTable) else OpTable.default(op_table)
    abstract = None
    if has_meta_tensors(model, args, kwargs):
        if calibration is not None or tolerance is not None:
            raise ValueError("calibration and tolerance measure values; a model with tensors on "
                             "the meta device is planned from shapes alone (load its weights, "
                             "or convert the materialised model)")
        abstract = Abstract(trace_device(spec))
        args, kwargs = abstract.fake_inputs(args, kwargs)  # once: capture and the passes share them
    options = Options(low, second, keep_fp32, spec, strategy, keep_io_types, table,
                      dict(overrides or {}), check, calibration, tolerance, progress, plan, train)
    with stage("capture"):
        gm = capture(model, args, kwargs, export_only=train, abstract=abstract, dynamic=dynamic,
                     observe=True)  # Calibrate takes the example batch from capture's run
    # the passes and the tolerance search read graphs, not code: regenerated once, at the end
    with fake_mode(abstract), deferred_recompile():
        gm, report = _convert_captured(gm, model, args, kwargs, options)
    gm.meta.pop(REFERENCE, None)  # the float32 outputs the check compared against: not kept
    if not train and model.training and follows_training_flag(gm):
        warnings.warn(f"{type(model).__name__} is in training mode and is converted for inference: "
                      "the converted module starts in training mode too (dropout on), follows "
                      ".train()/.eval() for dropout and batch norm, but any other read of "
                      "self.training was fixed at trace time; call model.eval() before convert "
                      "(or convert with mode='train' to train it)", UserWarning, stacklevel=2)
    if abstract is not None:
        abstract.finish_(gm)
        real = {name: t for name, t in module_tensors(model) if not is_abstract(t)}
        if real:  # buffers built for real beside meta parameters: cast as the plan stored them
            load_weights(gm, real, device=abstract.device, strict=False)
    record = Plan.from_graph(gm, low, keep_io_types, target=spec.name, strategy=strategy,
                             kept_fp32=keep_fp32, mode=mode, tolerance=report)
    if plan is None and keep_fp32 is None:  # an explicit dtype (auto says why in kept_fp32)
        record = dataclasses.replace(record, warning=little_converted(record, spec))
        if record.warning:
            warnings.warn(record.warning, UserWarning, stacklevel=2)
    record = dataclasses.replace(record, calibration_warning=calibration_warning(
        record, gm.meta.get(CONSTANT_INPUTS, ())))
    if record.calibration_warning:
        warnings.warn(record.calibration_warning, UserWarning, stacklevel=2)
    gm.plan = record
    refuse_hooks(gm)
    # copy.deepcopy of a GraphModule keeps only what its meta lists here: the plan goes along
    gm.meta.setdefault("_user_preserved_attributes", {})["plan"] = gm.plan
    if abstract is None:  # the dtype and layout of every tensor as planned: kept on assignment
        gm.planned_tensors = {
            path: (t.dtype, t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                   and not t.is_contiguous())
            for path, t in list(gm.named_parameters(remove_duplicate=False))
            + list(gm.named_buffers(remove_duplicate=False))}
        gm.meta["_user_preserved_attributes"]["planned_tensors"] = gm.planned_tensors
    shared = [(w.source, w.name) for w in record.weights if w.shared]
    if shared and abstract is None:  # low copies beside their originals, kept in step
        gm.weight_copies = WeightCopies(gm, shared)
        gm.meta["_user_preserved_attributes"]["weight_copies"] = gm.weight_copies
    if plan is not None:
        # a node the plan puts low against a numeric-safety finding stays float32 (AssignPrecision
        # warned): that is the plan applied, not a mismatch
        differ = []
        for r in _to_match(plan, {x.name for x in gm.plan.nodes}):
            got = gm.plan.node(r.name)
            if got.dtype != r.dtype and not (got.safety and got.dtype == "float32"):
                differ.append(f"{r.name}: the plan says {r.dtype}, the conversion gave "
                              f"{got.dtype} ({got.reason})")
        if differ:
            raise PlanMismatchError(differ)
    log.info("%s", gm.plan.summary())
    return gm


def without_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """The example's keyword arguments with ``use_cache=False`` added for a HuggingFace model
    that would return a KV cache (its config's ``use_cache``, on by default in every decoder):
    the forward is converted without it (mpgraph.convert_decoder converts for generation)."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return kwargs
    config = getattr(model, "config", None)
    if "use_cache" not in names or "use_cache" in kwargs or names.index("use_cache") < len(args) \
            or not getattr(config, "use_cache", False):
        return kwargs
    log.info("%s: converted with use_cache=False (the forward without its KV cache output); "
             "for generation with a KV cache, mpgraph.convert_decoder", type(model).__name__)
    return {**kwargs, "use_cache": False}


LITTLE = 0.5  # below this share of the matmul/conv FLOPs in the low dtype, convert says why


def little_converted(plan: Plan, spec: DeviceSpec) -> Optional[str]:
    """Why an explicit dtype converted under half of the matmul/conv work, and the way out; None
    when it converted more, or when only the user's own overrides and pins kept it float32."""
    work = [r for r in plan.compute_nodes if r.op_class == "tensor_core"]
    if not work:
        return None
    low = dtype_name(plan.dtype)
    flops = sum(r.flops or 1.0 for r in work)
    share = sum(r.flops or 1.0 for r in work if r.dtype != "float32") / flops
    kept = [r for r in work if r.dtype == "float32"]
    slower = [r for r in kept if r.reason.startswith("cost:") and r.t_low is not None
              and r.t_fp32 is not None and r.t_low >= r.t_fp32]
    casts = [r for r in kept if r.reason.startswith("cost:") and r not in slower]
    safety = [r for r in kept if r.safety]
    if share >= LITTLE or not (slower or casts or safety):
        return None
    text = (f"dtype={low} converted {len(work) - len(kept)} of {len(work)} matmul/conv nodes "
            f"({share:.0%} of their FLOPs) for {spec.name}")
    why = []
    if slower:
        rate = ""
        if spec.kind == "cpu":
            key = {"float16": "fp16", "bfloat16": "bf16"}[low]
            rate = (f": this CPU runs {low} matmul at {spec.peak[key] / spec.peak['fp32']:.2f}x "
                    f"float32, {spec.source}")
        why.append(f"{len(slower)} are slower in {low} there{rate}")
    if casts:
        why.append(f"{len(casts)} are too small to pay for their casts")
    if safety:
        why.append(f"{len(safety)} have numeric-safety findings (plan.safety_nodes)")
    way = []
    if (slower or casts) and spec.kind == "cpu":
        way.append("to plan for the GPU you deploy to, pass target='h100' (or 'a100', 't4', ...)")
    if slower or casts:
        way.append(f"to put every matmul/conv in {low} whatever it costs there, strategy='rules'")
    if safety:
        way.append("the safety findings hold in any plan (their evidence is in the plan)")
    way_out = "; ".join(way)
    return f"{text}: {'; '.join(why)}. {way_out[0].upper()}{way_out[1:]}."


def calibration_warning(plan: Plan, constant: tuple) -> Optional[str]:
    """Why the calibration data may not represent real inputs, and the way out; None when
    nothing says so. Calibration decides what overflow keeps in float32: inputs that hold one
    value in every batch (``torch.zeros``) measure nothing real, and one batch shows fp16 the
    ranges of that batch only (bf16 has float32's range: its plans do not rest on them)."""
    if not plan.low_nodes or not plan.calibration_batches:
        return None
    why = []
    if constant:
        why.append(f"input{'s' if len(constant) > 1 else ''} {', '.join(constant)} held one value "
                   "(all zeros, or constant) in every calibration batch")
    if plan.dtype == torch.float16 and plan.calibration_batches == 1:
        why.append("the float16 plan was calibrated on one batch")
    if not why:
        return None
    return (f"{' and '.join(why)}: the plan keeps in float32 what calibration saw overflow or "
            "lose too much, and inputs larger than it saw can overflow float16 at run time "
            "(inf/NaN outputs). Pass calibration=[a few batches of real inputs, with the largest "
            "values you expect]; mpgraph.guard(module) names the node if an output goes "
            "non-finite at run time")


def plan(model: torch.nn.Module, example_inputs: Any = None, **options) -> Plan:
    """The plan ``convert`` makes for ``model``, without keeping the converted module: for a
    model on the meta device (too big to materialise) this is the whole point, and nothing of
    its weights is allocated. Options as for ``convert``."""
    with deferred_recompile(discard=True):  # the module is dropped: its code is never needed
        return convert(model, example_inputs, **options).plan


@dataclass(frozen=True)
class Options:
    """What ``convert`` resolved from its arguments, for the driver and the pipelines."""

    low: torch.dtype                     # the plan's low dtype
    second: Optional[torch.dtype]        # bf16 beside fp16 (dtype="auto" on GPUs that run both)
    keep_fp32: Optional[str]             # why every node stays float32 (auto on a slow target)
    spec: DeviceSpec                     # the target
    strategy: str
    keep_io_types: bool
    table: OpTable
    overrides: dict
    check: Union[bool, str]
    calibration: Optional[list]
    tolerance: Optional[float]
    progress: Optional[bool]
    plan: Optional[Plan]                 # a saved plan to apply
    train: bool


def _convert_captured(gm, model, args, kwargs, opts: Options):
    """The captured graph through the pipelines (and the tolerance search): (module, report)."""
    from mpgraph.passes.pipeline import default_pipeline, prepare_pipeline
    gm = run_passes(prepare_pipeline(args, kwargs, opts.calibration, opts.progress, opts.train), gm)
    simulate = elsewhere(opts.spec, args, kwargs, model)
    base = copy.deepcopy(gm) if opts.tolerance is not None else None
    from_plan = None
    if opts.plan is not None:
        check_plan_fits(opts.plan, gm)
        from_plan = {r.name: (r.dtype, r.reason) for r in opts.plan.compute_nodes}

    def build(graph, pins: Optional[dict] = None):
        passes = default_pipeline(opts.low, args, kwargs, spec=opts.spec, strategy=opts.strategy,
                                  keep_io_types=opts.keep_io_types, op_table=opts.table,
                                  overrides={**opts.overrides, **(pins or {})},
                                  keep_fp32=opts.keep_fp32, check=opts.check,
                                  range_dtype=opts.second, from_plan=from_plan, train=opts.train,
                                  simulate=simulate)
        return run_passes(passes, graph)

    gm = build(gm)
    report = None
    if opts.tolerance is not None:
        calls = [as_call(b) for b in opts.calibration] if opts.calibration is not None \
            else [(args, kwargs)]
        with stage("tolerance search"):
            gm, report = meet_tolerance(base, lambda pins: build(copy.deepcopy(base), pins), gm,
                                        calls, opts.tolerance, opts.low, simulate)
    _restore_buffers(gm, model)
    if not opts.train:
        # inference: the low-precision parameters are rounded copies, not something to train (an
        # optimizer step on them would round away); frozen, a sharding wrapper such as FSDP2's
        # fully_shard accepts their mix of dtypes (it demands one dtype among trainable ones)
        gm.requires_grad_(False)
    return gm, report


def elsewhere(spec: DeviceSpec, args: tuple, kwargs: dict, model: torch.nn.Module) -> bool:
    """Whether the plan is for a GPU while the model runs on this CPU: then conversion's own
    runs of the converted graph compute as the GPU would (mpgraph.ir.simulate) rather than in
    the CPU's emulated fp16/bf16 kernels."""
    from torch.utils import _pytree as pytree
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors += list(itertools.islice(model.parameters(), 1))
    return spec.kind == "gpu" and not any(t.device.type == "cuda" for t in tensors)


def follows_training_flag(gm: torch.nn.Module) -> bool:
    """Whether the converted module holds anything that behaves differently in training
    (dropout, batch norm: the modules FollowTrainingFlag put there, or the model's own)."""
    kinds = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm,
             TrainingBatchNorm, DropoutRate)
    return any(isinstance(m, kinds) for m in gm.modules())


def _restore_buffers(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """Undo what conversion's own runs wrote into buffers (a model in training mode updates its
    batch-norm statistics on every run): the converted module starts from the model's state."""
    original = dict(model.named_buffers())
    with torch.no_grad():
        for name, buf in gm.named_buffers():
            src = original.get(name)
            if src is None or src.shape != buf.shape or is_abstract(src) or is_abstract(buf):
                continue
            if not torch.equal(src.to(buf.dtype), buf):
                buf.copy_(src)


def _to_match(plan: Plan, names: set) -> list:
    """The plan's decided nodes that a graph with these node names must have: not export's input
    guard (only a graph captured at the example's shapes has it: a plan moves between static and
    dynamic captures of one model), nor a node a rewriting pass added that the graph lacks
    (ChannelsLast's layout change: that pass adds it again)."""
    return [r for r in plan.compute_nodes
            if r.target != EXPORT_GUARD and not (r.inserted_by and r.name not in names)]


def check_plan_fits(plan: Plan, gm: torch.fx.GraphModule) -> None:
    """Raise PlanMismatchError unless every node the plan decides is in ``gm`` with the same op
    and output shape, and every node of ``gm`` that needs a decision is in the plan."""
    records = {r.name: r for r in _to_match(plan, {node.name for node in gm.graph.nodes})}
    listed = {r.name for r in plan.nodes}
    problems = []
    seen = set()
    for node in gm.graph.nodes:
        if not node.op.startswith("call_") or node.op == "call_module" and node.target == EXPORT_GUARD:
            continue
        record = records.get(node.name)
        info = node.meta.get(TENSOR)
        if record is None and node.name in listed:
            continue  # in the plan without a decision (export's dtype asserts)
        if record is None:
            if is_float32_tensor(info) or any(is_float32_tensor(a.meta.get(TENSOR))
                                              for a in node.all_input_nodes):
                problems.append(f"node {node.name} ({target_name(node)}) is not in the plan")
            continue
        seen.add(node.name)
        if record.target != target_name(node):
            problems.append(f"node {node.name}: op {target_name(node)}, the plan has {record.target}")
        shape = shape_of(info)
        if record.shape is not None and shape is not None and tuple(record.shape) != shape:
            problems.append(f"node {node.name}: shape {shape}, the plan has {tuple(record.shape)}")
    problems += [f"node {name} of the plan is not in the model's graph"
                 for name in records if name not in seen]
    if problems and all(": shape " in p for p in problems):
        problems.insert(0, "a plan is made for the shapes of the inputs it was made with, and "
                           "these inputs give other shapes: apply it with inputs of those "
                           "shapes, or make a plan at these (mpgraph.convert(model, inputs, "
                           "...), with overrides= for your edits)")
    if problems:
        raise PlanMismatchError(problems)
