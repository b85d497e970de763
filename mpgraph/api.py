"""The public entry point: ``convert``."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import logging
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch

from mpgraph.frontend.capture import capture, in_inference_mode, outside_inference_mode
from mpgraph.cost.device import resolve_target
from mpgraph.cost.measured import CostTable, Measured, emulated, measure, one_row_mv_pays
from mpgraph.cost.model import CostModel
from mpgraph.cost.roofline import RUNTIMES, Roofline, read_calibration
from mpgraph.cost.specs import DeviceSpec
from mpgraph.passes.op_table import OpTable
from mpgraph.passes.assign_precision import PINNED_BY_SEARCH
from mpgraph.passes.infra import PassManager, deferred_recompile, run_passes, stage
from mpgraph.passes.pipeline import decide_pipeline, default_pipeline, prepare_pipeline
from mpgraph.errors import ConversionError, PlanMismatchError, ValueCheckError
from mpgraph.numerics import float_leaves, output_errors
from mpgraph.ir.graph import (EXPORT_GUARD, as_call, fresh, named_arguments, own_autocast,
                              run_recording, seeded, state_kept, target_name, weight_copy_paths)
from mpgraph.ir.modules import (ConvertedModule, DropoutRate, FusedWeights, TrainingBatchNorm,
                                TrainingFlag, WeightCopies, part_of_converted, planned_layout,
                                refuse_hooks)
from mpgraph.ir.meta import (COST, CONSTANT_INPUTS, EVAL_OUTPUTS, EVAL_SWITCH, FUSED, OP_CLASS,
                             PRECISION, READS_TRAINING, REFERENCE, STATIC_SHAPES, TENSOR,
                             TENSOR_CORE, Kind, dtype_name, is_float32_tensor, shape_of)
from mpgraph.plans.plan import MODES, Plan
from mpgraph.tolerance import check_tolerance, meet_tolerance
from mpgraph.ir.fake import (Abstract, fake_mode, has_meta_tensors, is_abstract, module_tensors,
                             trace_device)
from mpgraph.plans.weights import load_weights

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
            dtype: Union[None, str, torch.dtype] = None,
            example_kwargs: Optional[dict] = None, keep_io_types: bool = True,
            target: Union[None, str, DeviceSpec] = None, strategy: str = "optimal",
            op_table: Optional[Union[OpTable, dict]] = None,
            overrides: Optional[dict] = None, check: Union[bool, str] = True,
            calibration: Optional[Iterable] = None, tolerance: Optional[float] = None,
            progress: Optional[bool] = None, plan: Optional[Plan] = None,
            mode: Optional[str] = None, dynamic: Optional[bool] = None,
            costs: Optional[CostModel] = None, runtime: str = "eager") -> torch.fx.GraphModule:
    """Convert ``model`` to mixed precision; return a GraphModule carrying ``.plan``.

    The example inputs (a tensor, or a tuple of the model's arguments, with ``example_kwargs``)
    are run to learn every value's shape and dtype and, with ``check``, to check the result
    against float32. Each keyword argument is an option of ``Options`` (documented there, one
    field each): ``dtype`` (None: the cost model's fastest; or fp16/bf16, forced where it pays),
    ``target`` (None: this machine; or a GPU name), ``costs``/``runtime`` (the cost model),
    ``strategy``, ``keep_io_types``, ``op_table``, ``overrides``, ``check``, ``calibration``,
    ``tolerance``, ``progress``, ``plan`` (a saved plan applied as it is), ``mode``
    ("inference", the default, or "train": float32 master weights; a saved plan's own where
    not given) and ``dynamic`` (True unless a saved plan was captured at the example's shapes).
    The model is never modified.
    """
    if in_inference_mode(locals()):  # (see outside_inference_mode)
        return outside_inference_mode(convert, locals())
    _refuse_converted(model)
    _check_flags(keep_io_types=keep_io_types, dynamic=dynamic, progress=progress)
    dynamic = _dynamic_of(plan, dynamic)
    opts, args, kwargs, abstract = Options.resolve(
        model, example_inputs, example_kwargs, dtype=dtype, keep_io_types=keep_io_types,
        target=target, strategy=strategy, op_table=op_table, overrides=overrides, check=check,
        calibration=calibration, tolerance=tolerance, progress=progress, plan=plan, mode=mode,
        costs=costs, runtime=runtime)

    fallback, failed = None, None  # (not a function of its own: capture's warnings count
    # frames up to here)
    # a saved plan is applied to the graph captured in the grad mode it was made in (see Plan)
    grad = torch.is_grad_enabled() if opts.plan is None or opts.plan.grad_enabled is None \
        else opts.plan.grad_enabled
    while True:
        with stage("capture"), torch.set_grad_enabled(grad):
            gm = capture(model, args, kwargs, export_only=opts.train, abstract=abstract,
                         dynamic=dynamic, observe=True,  # Calibrate takes capture's example batch
                         training=opts.train)
        try:
            # the passes and the tolerance search read graphs, not code: regenerated at the end
            with fake_mode(abstract), deferred_recompile():
                gm, report, low, keep_fp32, chosen = _convert_captured(gm, model, args, kwargs,
                                                                       opts, fallback)
                if gm.meta.get(FUSED):  # stacked sibling weights: the members become their views
                    gm.fused_weights = FusedWeights(gm.meta[FUSED])
                    gm.fused_weights.refresh(gm)
                    gm.meta.setdefault("_user_preserved_attributes", {})["fused_weights"] = \
                        gm.fused_weights
            break
        except ValueCheckError as e:  # the cost model's fp16 failed the check: bf16, once
            if fallback is not None:  # (bf16 failed too: a precision loss, not fp16's range;
                # the plan the user is told of is the float16 one the cost model chose)
                log.warning("%s: bfloat16 failed the value check too (error %.3g, more than "
                            "its bound %.3g)", type(model).__name__, e.error, e.bound)
                raise failed from None
            fallback = _fallback(e, opts)
            if fallback is None:
                raise
            failed = e
            log.warning("%s: %s; converting in bfloat16 instead", type(model).__name__,
                        fallback["fallback"])
    gm.meta.pop(REFERENCE, None)  # the float32 outputs the check compared against: not kept
    if not opts.train and model.training and follows_training_flag(gm):
        warnings.warn(f"{type(model).__name__} is in training mode and is converted for inference: "
                      "the converted module starts in training mode too (dropout on), follows "
                      ".train()/.eval() for dropout and batch norm, but any other read of "
                      "self.training was fixed at trace time; call model.eval() before convert "
                      "(or convert with mode='train' to train it)", UserWarning, stacklevel=2)
    if abstract is not None:
        abstract.finish_(gm)
        held = {name for name, _ in module_tensors(gm)}  # (not a buffer forward never reads)
        real = {name: t for name, t in module_tensors(model) if not is_abstract(t)
                and name in held}
        if real:  # buffers built for real beside meta parameters: cast as the plan stored them
            load_weights(gm, real, device=abstract.device, strict=False)
    _keep_unread_tensors(gm, model)
    _in_models_order(gm, model)
    record = Plan.from_graph(gm, low, opts.keep_io_types, target=opts.spec.name,
                             strategy=opts.strategy, kept_fp32=keep_fp32,
                             mode="train" if opts.train else "inference", tolerance=report,
                             dtype_choice=chosen)
    record.grad_enabled = grad
    found, mixed = _computes_low(model)
    if opts.plan is not None:
        _check_applied(opts.plan, record, type(model).__name__, found, mixed)
    if found and not mixed and not record.low_nodes:
        record = dataclasses.replace(record, kept_fp32=None, computes_in=f"{found}, its "
                                     "parameters' dtype", warning=(
            f"{type(model).__name__} computes in {found}, not float32: mpgraph decides which of "
            "a model's float32 nodes run in low precision, and this model's weights are not "
            "float32; it is returned as it computes. Convert model.float() to plan its mixed "
            "precision"))
        warnings.warn(record.warning, UserWarning, stacklevel=2)
    elif found and mixed:  # (the summary said "kept all 12 nodes in float32 ... error 0 vs
        # float32" of a bf16 base model with float32 LoRA adapters, 0.0026 off float32)
        record = dataclasses.replace(
            record, kept_fp32=None if not record.low_nodes else record.kept_fp32,
            computes_in=f"{found} where its parameters are ({mixed})", warning=(
                f"{type(model).__name__} holds {found} parameters ({mixed}) beside float32 ones: "
                "mpgraph plans its float32 nodes, its "
                f"{found} parts compute as the model has them, and the check compares with the "
                "model as it computes, not float32. Convert model.float() to plan all of it"))
        warnings.warn(record.warning, UserWarning, stacklevel=2)
    elif not found:  # its own enabled autocast regions compute low (summary: "error 0 vs
        # float32 (all float32); 1 node of unknown op kept in float32", pN 9)
        regions = [d for n in gm.graph.nodes if (d := own_autocast(n)) is not None]
        if regions:
            dtypes = " and ".join(sorted({dtype_name(d) for d in regions}))
            record = dataclasses.replace(record, computes_in=(
                f"{dtypes} inside its own torch.autocast region{'s' if len(regions) > 1 else ''}"))
    _attach_plan(gm, record, opts, abstract)
    if opts.train and abstract is None:
        _check_gradients(gm, args, kwargs)
    log.info("%s", gm.plan.summary())
    return gm


def _keep_unread_tensors(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """The model's state_dict entries the graph never reads (a training-only auxiliary head, a
    loss's class weights), as float32 copies at their own paths: the traced module dropped
    them, so ``fast.load_state_dict(model.state_dict())`` failed on unexpected keys."""
    have = set(gm.state_dict(keep_vars=True))
    for name, t in model.state_dict(keep_vars=True).items():
        if name in have or not isinstance(t, torch.Tensor) or is_abstract(t):
            continue  # (a meta model's: load_weights fills what the graph reads, no more)
        *path, leaf = name.split(".")
        owner = gm
        for part in path:
            sub = owner._modules.get(part)
            if sub is None:
                if hasattr(owner, part):  # (a name the graph module uses otherwise)
                    owner = None
                    break
                sub = torch.nn.Module()
                owner.add_module(part, sub)
            owner = sub
        if owner is None or leaf in owner._parameters or leaf in owner._buffers \
                or hasattr(owner, leaf):
            log.info("the model's %s is not read by the graph and its path is taken: not kept",
                     name)
            continue
        value = t.detach().clone()
        if isinstance(t, torch.nn.Parameter):
            owner.register_parameter(leaf, torch.nn.Parameter(value, t.requires_grad))
        else:
            owner.register_buffer(leaf, value)


def _in_models_order(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """The converted module's submodules, parameters and buffers in the model's order (what
    the graph holds that the model does not, after): torch.fx registers them in the order the
    forward first uses them, so ``zip(model.parameters(), fast.parameters())`` (a weight sync,
    ``vector_to_parameters``, an EMA) paired each tensor with another layer's of its shape."""
    for path, sub in gm.named_modules():
        try:
            theirs = model.get_submodule(path)
        except AttributeError:
            continue
        for attribute in ("_modules", "_parameters", "_buffers"):
            ours = getattr(sub, attribute)
            rank = {name: i for i, name in enumerate(getattr(theirs, attribute))}
            items = sorted(ours.items(), key=lambda kv: rank.get(kv[0], len(rank)))
            ours.clear()  # (in place: the dict is the module's own)
            ours.update(items)


def _check_gradients(gm, args, kwargs) -> None:
    """A training conversion whose outputs carry no autograd graph would train nothing,
    silently where the loss has another term: torch.export captures
    ``torch.utils.checkpoint(..., use_reentrant=True)`` as a region under no_grad that swallows
    the rest of the forward. One run of the converted module with gradients on (the model is
    not run: its forward may write its weights, count calls, fire hooks), and an error that
    names it."""
    if not any(p.requires_grad for p in gm.parameters()):
        return
    reentrant = _reentrant_checkpoint(gm)
    if reentrant:  # (an output computed before it keeps its gradient: the check below passed)
        raise ConversionError(
            "mode='train': torch.utils.checkpoint(..., use_reentrant=True) was captured as a "
            f"region under no_grad (nodes {', '.join(reentrant[:3])}"
            + (" ..." if len(reentrant) > 3 else "") + "): what it computes, and what follows "
            "it, carries no gradient, so its parameters would silently not train. Use "
            "checkpoint(..., use_reentrant=False) (HF: gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})), or convert the parts "
            "around the region and call them from your own forward")
    with torch.enable_grad(), seeded(), state_kept(gm):
        got = float_leaves(gm(*fresh(args), **fresh(kwargs)))
    if got and not any(g.requires_grad for g in got):
        regions = [n.name for n in gm.graph.nodes
                   if n.op == "call_function" and "set_grad_enabled" in str(n.target)]
        raise ConversionError(
            "mode='train': none of the converted module's outputs carries a gradient, so "
            "training it would change nothing"
            + (f" (torch.export captured {len(regions)} region{'s' if len(regions) > 1 else ''} "
               "of the forward under no_grad: torch.utils.checkpoint(..., use_reentrant=True) "
               "is captured that way)" if regions else "")
            + ". Use checkpoint(..., use_reentrant=False), or convert the parts around the "
            "region and call them from your own forward")


_REENTRANT = re.compile(r'torch[/\\]utils[/\\]checkpoint\.py", line \d+, in forward\b')


def _reentrant_checkpoint(gm) -> list[str]:
    """Nodes torch.export traced inside a reentrant checkpoint (CheckpointFunction.forward, in
    their stack trace; the non-reentrant one leaves no such frame)."""
    return [n.name for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if _REENTRANT.search(n.meta.get("stack_trace") or "")]


def _refuse_converted(model) -> None:
    """A module convert returned, as the model or inside it (a head put on a converted
    backbone): its graph holds its casts and low weights, so a conversion would check it
    against itself, not float32 (a new fp16 plan kept its bf16 weights, its "error 0.00032 vs
    float32" 0.00075 against the float32 model). One inside that kept everything float32
    keeps its plan's dtypes all the same (a conv's weight cast back to float32 where the new
    plan stored it float16: every call failed), so it is refused too."""
    if not isinstance(model, torch.nn.Module):
        return
    for path, module in model.named_modules():
        plan = module.__dict__.get("plan") if isinstance(module, torch.fx.GraphModule) else None
        if not isinstance(plan, Plan):
            continue
        if not path:
            raise TypeError(
                "this module is what mpgraph.convert returned: its graph holds its casts "
                "and low weights, and converting it again would check it against itself, "
                "not float32. Convert the original model instead: mpgraph.convert(model, "
                "inputs, plan=fast.plan) makes the same plan (another target= or dtype= a "
                "new one), and load_state_dict(fast.state_dict()) brings the weights it "
                "holds")
        holds = ("its graph holds its casts and low weights, so this conversion would check it "
                 "against itself, not float32, and" if plan.low_nodes or plan.weights
                 or plan.casts else "it")
        raise TypeError(
            f"submodule {path!r} of {type(model).__name__} is what mpgraph.convert returned: "
            f"{holds} keeps its own plan's dtypes (its tensors are cast back to them when "
            "assigned), which this conversion's plan cannot change. Build the model with the "
            f"original (float32) module at {path!r} and convert the whole; or convert only the "
            f"rest and keep {path!r} as converted")
    part = next(((path, inside) for path, m in model.named_modules()
                 if (inside := part_of_converted(m))), None)
    if part is not None:  # (capture failed on it with the tracers' errors, or a dtype mismatch)
        path, inside = part
        here = f"{type(model).__name__}'s {path!r}" if path else "this module"
        raise TypeError(
            f"{here} is part of a module mpgraph.convert returned (its {inside!r}): it holds "
            f"that conversion's tensors in its plan's dtypes and is run by its graph. Convert "
            f"the original model's {inside.rpartition('.')[2]} instead (model.{inside}), or "
            "convert the whole model with overrides= for this part")


def _computes_low(model: torch.nn.Module) -> tuple[str, str]:
    """The dtypes other than float32 a model computes in, by its parameters (one loaded with
    torch_dtype=torch.bfloat16, or a model.double(); its float32 buffers, such as rotary
    inv_freq, do not count), as text, "" where none; and where float32 ones sit beside low ones
    (a bf16 base model's float32 LoRA adapters), how many of them are low ("6 of 10"), else "".
    (A float64 parameter beside float32 ones, a learnt scale, is the model's own: planned around.)"""
    floats = [t for t in model.parameters() if t.is_floating_point()]
    low = [t for t in floats if t.dtype in (torch.float16, torch.bfloat16)]
    if not low and not any(t.dtype == torch.float32 for t in floats):
        low = [t for t in floats if t.dtype == torch.float64]  # nothing float32 to plan either
    if not low:
        return "", ""
    found = " and ".join(sorted({dtype_name(t.dtype) for t in low}))
    mixed = any(t.dtype == torch.float32 for t in floats)
    return found, f"{len(low)} of {len(floats)}" if mixed else ""


def _attach_plan(gm, record: Plan, opts: "Options", abstract) -> None:
    """The plan on the module, with its warnings; what keeps the module's tensors as planned
    (dtypes kept on assignment, low copies in step with their float32 originals)."""
    if opts.plan is None and opts.low is not None:  # a dtype the user named
        little = little_converted(record, opts.spec)
        if little:
            record = dataclasses.replace(record, warning=little if not record.warning
                                         else f"{record.warning}; and {little}")
            warnings.warn(little, UserWarning, stacklevel=3)
    record = dataclasses.replace(record, calibration_warning=calibration_warning(
        record, gm.meta.get(CONSTANT_INPUTS, ())))
    if record.calibration_warning:
        warnings.warn(record.calibration_warning, UserWarning, stacklevel=3)
    gm.plan = record
    refuse_hooks(gm)
    # copy.deepcopy of a GraphModule keeps only what its meta lists here: the plan goes along
    gm.meta.setdefault("_user_preserved_attributes", {})["plan"] = gm.plan
    if abstract is None:  # the dtype and layout of every tensor as planned: kept on assignment
        gm.planned_tensors = {
            path: (t.dtype, planned_layout(t))
            for path, t in list(gm.named_parameters(remove_duplicate=False))
            + list(gm.named_buffers(remove_duplicate=False))}
        gm.meta["_user_preserved_attributes"]["planned_tensors"] = gm.planned_tensors
    tied = _tied_parameters(gm, record)
    if tied:
        gm.tied_parameters = tied
        gm.meta["_user_preserved_attributes"]["tied_parameters"] = tied
    shared = [(w.source, w.name) for w in record.weights if w.shared]
    if shared and abstract is None:  # low copies beside their originals, kept in step
        gm.weight_copies = WeightCopies(gm, shared)
        gm.meta["_user_preserved_attributes"]["weight_copies"] = gm.weight_copies


def _check_applied(plan: Plan, record: Plan, name: str, found: str, mixed: str) -> None:
    """A PlanMismatchError unless the conversion gave each node the saved plan's dtype; where
    nodes have no float32 tensors because the model computes in another dtype (``found``,
    ``mixed``: _computes_low's), it says so once, with the way out, before the nodes."""
    # a node the plan puts low against a numeric-safety finding stays float32, and an item
    # of a multi-output op comes out in that op's dtype (AssignPrecision warned): that is
    # the plan applied, not a mismatch
    differ, unplanned = [], False
    for r in _to_match(plan, {x.name for x in record.nodes}):
        got = record.node(r.name)
        if got.dtype != r.dtype and not (got.safety and got.dtype == "float32") \
                and not got.reason.startswith("an item of "):
            differ.append(f"{r.name}: the plan says {r.dtype}, the conversion gave "
                          f"{got.dtype} ({got.reason})")
            unplanned |= got.dtype is None
    if differ and found and unplanned:  # (a plan applied to the model loaded in bf16: pC 11)
        where = f" where its parameters are ({mixed})" if mixed else ""
        differ.insert(0, f"{name} computes in {found}{where}, not float32: the plan decides its "
                         f"float32 nodes, and those nodes have none here. Apply it to the model "
                         f"in float32: mpgraph.convert(model.float(), inputs, plan=plan), with "
                         f"float32 inputs")
    if differ:
        raise PlanMismatchError(differ)


def _tied_parameters(gm, record: Plan) -> tuple:
    """Names that hold one parameter (a tied embedding and LM head) in a graph torch.export
    captured: it reads the parameter under one of them for every reader, so a new tensor set
    under one name alone (untying them) would be read for all, or not at all (7.7 off), and
    the call says so (ConvertedModule.__call__). torch.fx's graph reads each module's own."""
    if not record.capture.startswith("torch.export"):
        return ()
    groups: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return tuple(tuple(names) for names in groups.values() if len(names) > 1)


def without_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """The example's keyword arguments with ``use_cache=False`` added for a HuggingFace model
    that would return a KV cache (its config's ``use_cache``, on by default in every decoder):
    the forward is converted without it (mpgraph.convert_decoder converts for generation)."""
    try:
        signature = inspect.signature(model.forward)
        names = list(signature.parameters)
        takes = "use_cache" in names and names.index("use_cache") >= len(args)
        keywords = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
        if "use_cache" not in names and callable(getattr(model, "get_base_model", None)) \
                and keywords:
            # a peft wrapper: its **kwargs reach the causal LM's forward (it was refused as a
            # model returning a KV cache, where the bare LM converted)
            takes = "use_cache" in inspect.signature(model.get_base_model().forward).parameters
        elif "use_cache" not in names and keywords:
            # a HuggingFace model whose **kwargs reach its language model's forward (LLaVA's
            # LlavaForConditionalGeneration: refused for the DynamicCache its Llama returned)
            takes = hasattr(getattr(model, "config", None), "get_text_config")
    except (TypeError, ValueError):
        return kwargs
    if not takes or "use_cache" in kwargs or not _uses_cache(getattr(model, "config", None)):
        return kwargs
    log.info("%s: converted with use_cache=False (the forward without its KV cache output); "
             "for generation with a KV cache, mpgraph.convert_decoder", type(model).__name__)
    return {**kwargs, "use_cache": False}


def _uses_cache(config) -> bool:
    """Whether a HuggingFace config turns the KV cache on: its own ``use_cache``, or for a
    composite model without one (EncoderDecoderModel, VisionEncoderDecoderModel, LLaVA) its
    decoder's, which the forward falls back to when given ``use_cache=None``."""
    if getattr(config, "use_cache", False):
        return True
    try:
        text = config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        return False
    return text is not config and bool(getattr(text, "use_cache", False))


LITTLE = 0.5  # below this share of the matmul/conv FLOPs in the low dtype, convert says why


def little_converted(plan: Plan, spec: DeviceSpec) -> Optional[str]:
    """Why an explicit dtype converted under half of the matmul/conv work, and the way out; None
    when it converted more, or when only the user's own overrides and pins kept it float32."""
    work = [r for r in plan.compute_nodes if r.op_class == "tensor_core"]
    low = dtype_name(plan.dtype)

    def share(records) -> float:
        flops = sum(r.flops or 1.0 for r in records)
        return sum(r.flops or 1.0 for r in records if r.dtype != "float32") / flops

    # what the user's overrides and the tolerance search's pins keep float32 is theirs: named
    # apart, and the rest judged alone (a pooler kept for its casts warned over 14 matmuls the
    # overrides kept, blamed on cost, with strategy='rules' as the way out)
    theirs = [r for r in work if r.dtype == "float32" and r.reason.startswith("user override")]
    pinned = [r for r in work if r.dtype == "float32" and r.reason.startswith(PINNED_BY_SEARCH)]
    rest = [r for r in work if r not in theirs and r not in pinned]
    if not rest or share(rest) >= LITTLE:
        return None
    kept = [r for r in rest if r.dtype == "float32"]
    slower = [r for r in kept if r.reason.startswith("cost:") and r.t_low is not None
              and r.t_fp32 is not None and r.t_low >= r.t_fp32]
    casts = [r for r in kept if r.reason.startswith("cost:") and r not in slower]
    safety = [r for r in kept if r.safety]
    if not (slower or casts or safety):
        return None
    converted = sum(r.dtype != "float32" for r in work)
    text = (f"dtype={low} converted {converted} of {len(work)} matmul/conv nodes "
            f"({share(work):.0%} of their FLOPs) for {spec.name}")
    held = []
    if theirs:
        held.append(f"your overrides keep {len(theirs)} float32 ({_names(theirs)})")
    if pinned:
        held.append(f"the tolerance search pinned {len(pinned)} to float32 ({_names(pinned)})")
    if held:  # (what they keep first, then why the rest stayed float32)
        text += f": {'; '.join(held)}; of the other {len(rest)},"
    why = []
    # a GPU without Tensor Cores for the dtype (a T4 or V100 and bf16): no strategy makes it pay
    missing = spec.kind == Kind.GPU and spec.matmul_peak(plan.dtype) is None
    if slower:
        rate = f": {spec.name} has no {low} Tensor Cores" if missing else ""
        if spec.kind == Kind.CPU:
            key = {"float16": "fp16", "bfloat16": "bf16"}[low]
            ratio = spec.peak[key] / spec.peak["fp32"]
            # 'though' only where the peak promises a gain that these sizes do not get; a dtype
            # this CPU emulates is not timed at their sizes (inf): its peak is the evidence
            said = ("estimated by the roofline at their sizes"
                    if not str(plan.estimate.get("source", "")).startswith("measured") else
                    "measured at their sizes" if any(math.isfinite(r.t_low) for r in slower)
                    else f"this CPU emulates {low}, not timed")
            rate = (f": {said}{', though' if ratio > 1 else ';'} this CPU's peak "
                    f"{low} matmul rate is {ratio:.2f}x float32's (large matrices; {spec.source})")
        why.append(f"{len(slower)} are not faster in {low} there{rate}")
    if casts:
        why.append(f"{len(casts)} are too small to pay for their casts")
    if safety:
        why.append(f"{len(safety)} have numeric-safety findings (plan.safety_nodes)")
    way = []
    if (slower or casts) and spec.kind == Kind.CPU:
        way.append("to plan for the GPU you deploy to, pass target='h100' (or 'a100', 't4', ...)")
    if missing:
        has = [n for n, d in (("fp16", torch.float16), ("bf16", torch.bfloat16))
               if spec.matmul_peak(d)]
        way.append(f"use dtype='{has[0]}', which its Tensor Cores run" if has else
                   "keep float32 there")
    elif slower or casts:
        which = f"the {len(slower) + len(casts)} the cost model kept" if held \
            else "every matmul/conv"
        way.append(f"to put {which} in {low} whatever it costs there, strategy='rules'")
    if safety:
        way.append("the safety findings hold in any plan (their evidence is in the plan)")
    if pinned:
        way.append(f"a looser tolerance than {plan.tolerance['tolerance']:g} pins fewer")
    way_out = "; ".join(way)
    return f"{text}{' ' if held else ': '}{'; '.join(why)}. {way_out[0].upper()}{way_out[1:]}."


def _names(records, most: int = 4) -> str:
    """The first ``most`` node names, and how many more."""
    names = ", ".join(r.name for r in records[:most])
    return names + (f" and {len(records) - most} more" if len(records) > most else "")


def calibration_warning(plan: Plan, constant: tuple) -> Optional[str]:
    """Why the calibration data may not represent real inputs, and the way out; None when
    nothing says so. Calibration decides what overflow keeps in float32: inputs that hold one
    value in every batch (``torch.zeros``) measure nothing real, and one batch shows fp16 the
    ranges of that batch only (bf16 has float32's range: its plans do not rest on them)."""
    if not plan.low_nodes or not plan.calibration_batches or plan.dtype != torch.float16:
        return None  # (bf16 has float32's range: nothing of its plan rests on the ranges seen)
    why = []
    if constant:  # ((name, value), ...): the value said (an all-ones mask is no all-zeros x)
        why.append(f"input{'s' if len(constant) > 1 else ''} "
                   f"{', '.join(f'{name} (all {value:g})' for name, value in constant)} held one "
                   "value in every calibration batch")
    if plan.dtype == torch.float16 and plan.calibration_batches == 1:
        why.append("the float16 plan was calibrated on one batch")
    if not why:
        return None
    return (f"{' and '.join(why)}: the plan keeps in float32 what calibration saw overflow or "
            "lose too much, and inputs larger than it saw can overflow float16 at run time "
            "(inf/NaN outputs). Pass calibration=[a few batches of real inputs, with the largest "
            "values you expect (padded ones, for a mask)] in mpgraph.convert (the command line "
            "calibrates on the factory's example alone: convert in Python with it, then "
            "export_onnx of the module it returns); mpgraph.guard(module) names the node if an "
            "output goes non-finite at run time")


def calibrate(model: torch.nn.Module, example_inputs: Any = None, *,
              example_kwargs: Optional[dict] = None, budget_s: float = 120.0) -> CostTable:
    """Measure ``model``'s ops on this machine afresh (each distinct op, shape and dtype, and the
    casts of its values; see ``mpgraph.cost.measured``), replacing what the cache held for
    them; returns the table of this model's entries as just measured (``.format()`` prints
    it; ``.path`` is the machine's cache file, which now holds them beside every other model's).
    ``convert`` measures what its cache lacks by itself: this is for re-measuring (a noisy run,
    new drivers)."""
    if in_inference_mode(locals()):  # (see outside_inference_mode)
        return outside_inference_mode(calibrate, locals())
    from mpgraph.cost.device import measure_cpu
    from mpgraph.ir.fake import has_abstract_tensors
    if not isinstance(model, torch.nn.Module):  # (convert's check: an AttributeError before)
        raise TypeError(f"calibrate expects a torch.nn.Module, got {type(model).__name__}")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)):
        raise TypeError(f"budget_s must be a number of seconds, got {type(budget_s).__name__} "
                        f"{budget_s!r:.40}")
    if not budget_s > 0:  # (0 measured nothing, NaN bounded nothing; inf: no bound, as asked)
        raise ValueError(f"budget_s must be a positive number of seconds (the time the measuring "
                         f"may take, such as 120), got {budget_s!r}")
    args, kwargs = as_call(example_inputs, example_kwargs)
    if has_abstract_tensors(model, args, kwargs):  # (their timings were cached as this CPU's)
        raise ValueError("calibrate times this machine's kernels on real values; the model or "
                         "its inputs hold tensors on the meta device (or fake tensors): load "
                         "its weights and pass real inputs (convert plans a meta model from "
                         "shapes alone, measuring nothing)")
    kwargs = without_cache(model, args, kwargs)
    with stage("capture"):
        gm = capture(model, args, kwargs)
    device = _device_of(args, kwargs, model)
    # this CPU's micro-benchmark too: its peaks say which low dtypes are measured here
    spec = resolve_target("cuda") if device.type == "cuda" else measure_cpu(fresh=True)
    lows = _native_lows(spec)
    fresh = CostTable.for_device(device, fresh=True)  # (its path, and the machine's best probe)
    # the graph convert times (its one-row linears as mv where that was faster, timed again)
    gm = run_passes(prepare_pipeline(args, kwargs, kind=spec.kind, one_row_mv=lambda layers:
                                     one_row_mv_pays(fresh, layers, (torch.float32,) + lows)), gm)
    with stage("measure"):
        measure(gm, args, kwargs, fresh, lows, budget_s=budget_s, packs=spec.kind == Kind.CPU)
    return fresh  # (measure saved it over the cache's entries: the other models' are kept)


def plan(model: torch.nn.Module, example_inputs: Any = None, **options) -> Plan:
    """The plan ``convert`` makes for ``model``, without keeping the converted module: for a
    model on the meta device (too big to materialise) this is the whole point, and nothing of
    its weights is allocated. Options as for ``convert``."""
    with deferred_recompile(discard=True):  # the module is dropped: its code is never needed
        return convert(model, example_inputs, **options).plan


@dataclass(frozen=True)
class Options:
    """Every option of a conversion, resolved once from ``convert``'s keyword arguments
    (``Options.resolve``) and read by the driver and the pipelines.

    - ``low`` (``dtype=``): the low dtype, fp16 or bf16; None (``dtype=None`` or "auto"): the one
      the cost model estimates fastest on the target, per node where it pays. A named dtype is
      used where it pays and the plan says what stayed float32 and why.
    - ``range_dtype``: bf16 beside fp16 for the nodes fp16's range keeps out (a saved plan's; else
      chosen with the dtype). ``keep_fp32``: why every node stays float32 (a saved plan's).
    - ``spec`` (``target=``): the device planned for: None for this machine, or a name ("h100",
      "a100", "t4", "cpu", ...). ``here``: it is this machine and the model has values.
    - ``strategy``: "optimal" (min-cut over node and cast costs) or "rules" (the list-based one).
    - ``keep_io_types``: inputs and outputs keep the model's dtypes.
    - ``table`` (``op_table=``): the op classes, extended by a dict from module type / function /
      method name / ATen op to a class name or OpEntry. ``overrides``: node names or module-path
      globs to "fp32" or the low dtype.
    - ``check``: True (every node's dtype against the plan; the outputs against float32's,
      simulated for a plan for another device up to 20 GFLOP a batch), "values" (always),
      "dtypes" (no value run), False (nothing).
    - ``calibration``: input batches the float32 graph runs on to record every value's range
      (values that would overflow the low dtype stay float32); default: the example inputs.
      ``tolerance``: the relative L2 error of the outputs allowed on them (nodes pinned to
      float32, most error-adding first, until it holds). ``progress``: a bar over the batches.
    - ``plan``: a saved ``Plan`` applied as it is (its dtype, target, decisions); a mismatch is a
      ``PlanMismatchError``.
    - ``train`` (``mode="train"``): parameters stay float32 master weights, cast once per forward
      inside the graph; else (inference) the module's parameters are frozen rounded copies.
    - ``costs``: a cost model (``mpgraph.cost``); default: measured on this machine when the
      target is it, else the target's roofline. ``runtime``: "eager" (each node pays its host
      time) or "graphs" (CUDA graphs / torch.compile: it does not).
    (``dynamic``, capture's: input dimensions above 1 stay symbolic in a torch.export capture;
    False specialises the module to the example's shapes.)
    """

    low: Optional[torch.dtype]
    range_dtype: Optional[torch.dtype]
    keep_fp32: Optional[str]
    spec: DeviceSpec
    strategy: str
    keep_io_types: bool
    table: OpTable
    overrides: dict
    check: Union[bool, str]
    calibration: Optional[list]
    tolerance: Optional[float]
    progress: Optional[bool]
    plan: Optional[Plan]
    train: bool
    costs: Optional[CostModel]
    runtime: str
    here: bool

    @classmethod
    def resolve(cls, model, example_inputs, example_kwargs, *, dtype, keep_io_types, target,
                strategy, op_table, overrides, check, calibration, tolerance, progress, plan,
                mode, costs, runtime):
        """(options, example args, example kwargs, the fake-tensor context of a model on the
        meta device or None), every argument checked with an error that names it."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"convert expects a torch.nn.Module, got {type(model).__name__}")
        # this machine, unless a target is named: a saved plan's own target, a CPU's name, is
        # this CPU (it got the roofline: pC 7); a GPU's stays the roofline it was made with
        here = (target is None and (plan is None or not isinstance(plan, Plan) or not plan.target
                                    or plan.target.startswith("CPU"))) \
            or isinstance(target, str) and target.lower() in ("cpu", "cuda")
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(check, (bool, str)) or check not in CHECKS:  # (1 == True: pM 5)
            raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
        keep_fp32 = range_dtype = None
        if plan is not None:
            if not isinstance(plan, Plan):
                raise TypeError("plan must be an mpgraph.Plan (Plan.load(path)), got "
                                f"{type(plan).__name__}")
            if tolerance is not None:
                raise ValueError("a saved plan is applied as it is: pass plan= or tolerance=, "
                                 "not both")
            # what the plan decides, asked for otherwise, would be ignored: said instead
            conflicts = [f"overrides={overrides!r} (edit the saved plan's nodes, or convert "
                         "without plan= and with the overrides)"] if overrides else []
            if mode is not None and mode != plan.mode:  # (either way: pA 8)
                conflicts.append(f"mode={mode!r} (the plan is for mode={plan.mode!r})")
            if dtype is not None and not (isinstance(dtype, str) and dtype.lower() == "auto") \
                    and resolve_dtype(dtype) != plan.dtype:
                conflicts.append(f"dtype={dtype!r} (the plan is {dtype_name(plan.dtype)})")
            if not keep_io_types and plan.keep_io_types:
                conflicts.append("keep_io_types=False (the plan keeps the inputs' and outputs' "
                                 "dtypes)")
            if strategy != "optimal" and plan.strategy and strategy != plan.strategy:
                conflicts.append(f"strategy={strategy!r} (the plan was made by "
                                 f"strategy={plan.strategy!r})")
            named = resolve_target(target) if target is not None else None
            # (a CPU plan applies on any CPU: its name says the threads it was measured with)
            if named is not None and plan.target and named.name != plan.target and not (
                    named.kind == Kind.CPU and plan.target.startswith("CPU")):
                conflicts.append(f"target={target!r} (the plan was made for {plan.target}; "
                                 "convert without plan= to plan for it)")
            if conflicts:
                raise ValueError("a saved plan is applied as it is, with its own dtype, mode, "
                                 "target and decisions: " + "; ".join(conflicts))
            keep_io_types, strategy = plan.keep_io_types, plan.strategy or strategy
            mode = plan.mode
            target = target if target is not None else plan.target
            low, keep_fp32 = plan.dtype, plan.kept_fp32
            range_dtype = next((getattr(torch, r.dtype) for r in plan.range_nodes), None)
        elif dtype is None or isinstance(dtype, str) and dtype.lower() == "auto":
            low = None  # the cost model picks it, once the graph is captured
        else:
            low = resolve_dtype(dtype)
        spec = resolve_target(target)
        _check_override_keys(overrides)
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
        if costs is not None and not isinstance(costs, CostModel):
            raise TypeError(f"costs must be an mpgraph.cost CostModel, got {type(costs).__name__}")
        if example_inputs is None and example_kwargs is None and _needs_inputs(model):
            raise ValueError("convert needs example_inputs (a tensor or a tuple of the model's "
                             "arguments) to learn which values are float32 and their shapes")
        args, kwargs = as_call(example_inputs, example_kwargs)
        _refuse_sparse(model, args, kwargs)
        _refuse_reserved_names(model)
        kwargs = without_cache(model, args, kwargs)
        if tolerance is not None:
            tolerance = check_tolerance(tolerance)
        if calibration is not None and (tolerance is not None or (
                low is None and plan is None and iter(calibration) is calibration)):
            # read more than once: per round of the tolerance search (the same batches), or
            # again where an automatic fp16 falls back to bf16 (a generator: empty by then)
            calibration = list(calibration)
        table = op_table if isinstance(op_table, OpTable) else OpTable.default(op_table)
        abstract = None
        if has_meta_tensors(model, args, kwargs):
            if calibration is not None or tolerance is not None:
                raise ValueError("calibration and tolerance measure values; a model with tensors "
                                 "on the meta device is planned from shapes alone (load its "
                                 "weights, or convert the materialised model)")
            abstract = Abstract(trace_device(args, kwargs))
            if spec.kind == Kind.GPU and abstract.device.type != "cuda":
                log.info("planning for %s: traced for %s, where the example inputs are (and the "
                         "materialised model given them runs); CUDA inputs give a CUDA trace, "
                         "whose layout-only nodes such as .contiguous() may differ", spec.name,
                         abstract.device)
            args, kwargs = abstract.fake_inputs(args, kwargs)  # capture and passes share them
        opts = cls(low, range_dtype, keep_fp32, spec, strategy, keep_io_types, table,
                   dict(overrides or {}), check, calibration, tolerance, progress, plan,
                   mode == "train", costs, runtime, here and abstract is None)
        return opts, args, kwargs, abstract


def _one_row_mv(opts: Options, args: tuple, kwargs: dict, model):
    """Whether MatVecLinear runs: a saved plan's nodes say; a plan the cost model picks the
    dtype of for this CPU asks the measured table whether ``mv`` pays (in float32 and the low
    dtypes this CPU runs natively; an AVX2-only CPU runs small one-row linears slower as ``mv``);
    a forced dtype or another machine's plan: True (bf16's one-row ``linear`` leaves the GEMV
    path: 408 against 242 us, README)."""
    if opts.plan is not None:
        return any(r.inserted_by == "MatVecLinear" for r in opts.plan.nodes)
    if opts.low is not None or opts.spec.kind != Kind.CPU or opts.train:
        return True
    if opts.costs is not None:
        return getattr(opts.costs, "one_row_mv_pays", None) or True
    here = _measured_here(opts, args, kwargs, model)
    if here is None:
        return True
    table, lows = here

    def pays(layers: list) -> bool:
        with stage("measure"):
            answer = one_row_mv_pays(table, layers, (torch.float32,) + lows)
        if table.measured_now:
            table.save()
        return answer
    return pays


def _native_lows(spec: DeviceSpec) -> tuple:
    """The low dtypes ``spec``'s matmuls run natively (measured op by op)."""
    if spec.kind == Kind.CPU:
        return tuple(d for d in LOW_DTYPES if not emulated(d, spec))
    return tuple(d for d in LOW_DTYPES if spec.matmul_peak(d) is not None)


def _measured_here(opts: Options, args: tuple, kwargs: dict, model):
    """(this machine's cost table, the low dtypes it measures) where the plan's costs are
    measured: the target is this machine and the model runs on it; else None."""
    device = _device_of(args, kwargs, model)
    if not opts.here or (opts.spec.kind == Kind.GPU) != (device.type == "cuda"):
        return None
    return CostTable.for_device(device), _native_lows(opts.spec)


def cost_model(opts: Options, gm, args: tuple, kwargs: dict, model) -> CostModel:
    """The plan's cost model: the one given; this machine's measured op times where the target
    is this machine and the model runs on it (``mpgraph.cost.measured``); else the target's
    roofline, calibrated where a GPU run left a calibration file."""
    if opts.costs is not None:
        return opts.costs
    spec = opts.spec
    calibration = read_calibration(spec) if spec.kind == Kind.GPU else None
    roofline = Roofline(spec, calibration=calibration, runtime=opts.runtime)
    here = _measured_here(opts, args, kwargs, model)
    if here is None:
        return roofline
    table, lows = here
    packs = spec.kind == Kind.CPU and not opts.train  # (PackCpuLinears: inference on a CPU)
    with stage("measure"):
        keys = measure(gm, args, kwargs, table, lows, packs=packs)
    if table.measured_now:
        log.info("measured %d op variants on %s", table.measured_now, table.name)
    return Measured(table, roofline, lows, keys, packs=packs)


LOW_DTYPES = (torch.float16, torch.bfloat16)


def _device_of(args: tuple, kwargs: dict, model) -> torch.device:
    from torch.utils import _pytree as pytree
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors += list(itertools.islice(model.parameters(), 1))
    return tensors[0].device if tensors else torch.device("cpu")


# what the converted module (a torch.fx GraphModule) holds under its own names, beside the
# model's top-level submodules, parameters and buffers
_RESERVED = frozenset(set(dir(ConvertedModule)) - set(dir(torch.nn.Module))) | {
    "graph", "code", "meta", "plan", "planned_tensors", "tied_parameters", "fused_weights",
    "weight_copies", "call_signature", "config", "cpu_linears"}


def _refuse_reserved_names(model: torch.nn.Module) -> None:
    """A top-level submodule or tensor under a name the converted module uses (a GNN's
    ``self.graph``, ``self.meta``, ``self.plan``): torch's "cannot assign 'Plan' as child module",
    a "the model itself" report for a model that runs, or keys silently left out."""
    taken = sorted(_RESERVED & {*model._modules, *model._parameters, *model._buffers})
    if taken:
        raise ValueError(
            f"{type(model).__name__} holds {', '.join(f'self.{n}' for n in taken)}: the "
            "converted module (a torch.fx GraphModule) uses that name for its own "
            f"{'attributes' if len(taken) > 1 else 'attribute'}. Rename it in the model, or "
            "convert a wrapper that holds the model (class Wrapped(nn.Module): self.model = "
            "model; forward returns self.model(...))")


def _refuse_sparse(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A sparse input (a GCN's adjacency for torch.sparse.mm): the passes read every value's
    range and cast dense tensors; a sparse one failed deep inside torch (aminmax has no
    SparseCPU kernel), blamed on the traced graph."""
    from torch.utils import _pytree as pytree
    held = next(((path, t) for path, t in module_tensors(model) if t.layout != torch.strided),
                None)
    if held is not None:
        raise ValueError(
            f"{held[0]} is a {str(held[1].layout).replace('torch.', '')} tensor: mpgraph "
            "converts graphs of dense tensors. Convert the dense parts (the layers around the "
            f"sparse product) with mpgraph.convert and call them from {type(model).__name__}'s "
            "forward, or hold it dense (.to_dense())")
    for name, value in named_arguments(model, args, kwargs):
        leaf = next((t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
                     and t.layout != torch.strided), None)
        if leaf is not None:
            raise ValueError(
                f"argument {name!r} is a {str(leaf.layout).replace('torch.', '')} tensor: "
                "mpgraph converts graphs of dense tensors. Convert the dense parts (the layers "
                f"around the sparse product) with mpgraph.convert and call them from "
                f"{type(model).__name__}'s forward, or pass the input dense (.to_dense())")


def _fallback(error: ValueCheckError, opts: Options) -> Optional[dict]:
    """How the dtype is chosen when the cost model's choice, float16, failed the value check
    and bfloat16 (float32's range: values too small or too large for fp16) runs natively on the
    target too: the choice's record with why float16 was left. None where the dtype was named,
    a plan or a tolerance was given, or bfloat16 is no candidate."""
    chosen = getattr(error, "dtype_choice", None)
    if not chosen or getattr(error, "planned_low", None) != torch.float16 or opts.low is not None \
            or opts.plan is not None or opts.tolerance is not None \
            or "bfloat16" not in chosen.get("candidates", ()):
        return None
    return {**chosen, "fallback": f"float16's plan failed the value check (error "
                                  f"{error.error:.3g}, more than its bound {error.bound:.3g})"}


def _convert_captured(gm, model, args, kwargs, opts: Options, fallback: Optional[dict] = None):
    """The captured graph through the pipelines (and the tolerance search): (module, report,
    the low dtype, why everything stayed float32 if it did, how the dtype was chosen).
    ``fallback``: bfloat16, where the automatic choice's float16 failed the check (_fallback)."""
    # a saved plan names the nodes it was made on: stacked GEMVs only if it has them
    fuse, contiguous, mask_copy = (
        opts.plan is None or any(r.inserted_by == rewrite for r in opts.plan.nodes)
        for rewrite in ("FuseSiblingGemv", "ContiguousLinearInputs", "ContiguousAttentionMask"))
    simulate = elsewhere(opts.spec, args, kwargs, model)
    apart = opts.overrides if opts.plan is None else {  # the GEMVs a saved plan kept apart (an
        r.name: None for r in opts.plan.nodes           # override named them), by node name
        if r.inserted_by == "MatVecLinear" and r.target == "aten.mv.default"}
    gm = run_passes(prepare_pipeline(args, kwargs, opts.calibration, opts.progress, opts.train,
                                     opts.spec.kind, overrides=apart, fuse=fuse,
                                     one_row_mv=_one_row_mv(opts, args, kwargs, model),
                                     simulate=simulate, contiguous=contiguous,
                                     mask_copy=mask_copy), gm)
    if EVAL_OUTPUTS in gm.meta:
        _say_if_eval_differs(gm, model, args, kwargs, gm.meta.pop(EVAL_OUTPUTS))
    if EVAL_SWITCH in gm.meta:
        _eval_switches_alike(gm, args, kwargs, *gm.meta.pop(EVAL_SWITCH))
    base = copy.deepcopy(gm) if opts.tolerance is not None else None
    from_plan = None
    if opts.plan is not None:
        check_plan_fits(opts.plan, gm, model)
        from_plan = {r.name: (r.dtype, r.reason) for r in opts.plan.compute_nodes}
    costs = cost_model(opts, gm, args, kwargs, model)
    low, range_dtype, keep_fp32, chosen = opts.low, opts.range_dtype, opts.keep_fp32, None
    if fallback is not None:
        low, chosen = torch.bfloat16, fallback
    elif low is None and not any(costs.supports(d) for d in LOW_DTYPES):
        low, chosen = torch.bfloat16, {"candidates": [], "estimates_s": {}}
        keep_fp32 = (f"no node is faster in float16 or bfloat16 than in float32 on {costs.name}: "
                     f"it emulates both ({costs.source})")
    elif low is None:
        low, chosen = _choose_low(gm, costs, opts, args, kwargs)
        if costs.kind == Kind.GPU and low == torch.float16 and costs.supports(torch.bfloat16):
            range_dtype = torch.bfloat16  # bf16 where fp16's range keeps a node out of fp16

    def build(graph, pins: Optional[dict] = None):
        passes = default_pipeline(low, args, kwargs, costs=costs, spec=opts.spec,
                                  strategy=opts.strategy, keep_io_types=opts.keep_io_types,
                                  op_table=opts.table,
                                  overrides=opts.overrides, pins=pins,
                                  keep_fp32=keep_fp32, check=opts.check,
                                  range_dtype=range_dtype, from_plan=from_plan, train=opts.train,
                                  simulate=simulate, tolerance=opts.tolerance)
        return run_passes(passes, graph)

    try:
        gm = build(gm)
    except ValueCheckError as e:  # (convert falls back to bf16 from an automatic fp16)
        e.dtype_choice, e.planned_low = chosen, low
        raise
    report = None
    if opts.tolerance is not None:
        calls = [as_call(b) for b in opts.calibration] if opts.calibration is not None \
            else [(args, kwargs)]
        with stage("tolerance search"):
            gm, report = meet_tolerance(base, lambda pins: build(copy.deepcopy(base), pins), gm,
                                        calls, opts.tolerance, low, simulate)
    _restore_buffers(gm, model)
    if not opts.train:
        # inference: the low-precision parameters are rounded copies, not something to train (an
        # optimizer step on them would round away); frozen, a sharding wrapper such as FSDP2's
        # fully_shard accepts their mix of dtypes (it demands one dtype among trainable ones)
        gm.requires_grad_(False)
    if chosen is not None and chosen["candidates"] and not any(
            (d := n.meta.get(PRECISION)) is not None and d.dtype in LOW_DTYPES
            and n.op.startswith("call_") for n in gm.graph.nodes):
        matmuls = [(n.name, n.meta[PRECISION].reason) for n in gm.graph.nodes
                   if n.op.startswith("call_") and n.meta.get(PRECISION) is not None
                   and getattr(n.meta.get(OP_CLASS), "op_class", None) == TENSOR_CORE]
        if matmuls and all(r.startswith(("user override", PINNED_BY_SEARCH)) for _, r in matmuls):
            theirs = sorted({r[len("user override ("):-1] for _, r in matmuls
                             if r.startswith("user override")})
            pins = sorted(repr(name) for name, r in matmuls if r.startswith(PINNED_BY_SEARCH))
            keys = sorted(theirs + pins)
            if theirs and pins:
                keep_fp32 = (f"the overrides ({', '.join(theirs)}) and the tolerance search's "
                             f"pins ({', '.join(pins)}) keep every matmul/conv in float32")
            else:
                keep_fp32 = (("the overrides" if theirs else "the tolerance search's pins")
                             + f" keep every matmul/conv in float32 ({', '.join(keys)})")
        else:
            # nodes faster alone, kept float32 by their casts: not 'no node is faster'
            faster = sum(1 for n in gm.graph.nodes if n.op.startswith("call_")
                         and (c := n.meta.get(COST)) is not None and c.t_low < c.t_fp32)
            keep_fp32 = (f"no node is faster in {' or '.join(chosen['candidates'])} "
                         f"than in float32 on {costs.name} ({costs.source})" if not faster else
                         f"no placement in {' or '.join(chosen['candidates'])} beats float32 on "
                         f"{costs.name} once its casts are counted ({faster} node"
                         f"{'s are' if faster > 1 else ' is'} faster alone in {dtype_name(low)}; "
                         f"{costs.source})")
    return gm, report, low, keep_fp32, chosen


_STATIC = " at the example's shapes"  # (how a plan's capture says dynamic=False)


def _dynamic_of(plan: Optional[Plan], dynamic: Optional[bool]) -> bool:
    """``dynamic`` as given, else the saved plan's (a static capture's nodes are not always a
    dynamic one's: BERT's plan did not fit), else True."""
    if dynamic is not None:
        return dynamic
    return not (isinstance(plan, Plan) and str(plan.capture).endswith(_STATIC))


def _check_flags(**flags) -> None:
    """Each a bool (progress, dynamic: or None): keep_io_types="False" was taken as True,
    silently, as any non-empty string is (pM 5)."""
    for name, value in flags.items():
        if not isinstance(value, bool) and not (name in ("progress", "dynamic") and value is None):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} "
                            f"{value!r:.40}")


def _check_override_keys(overrides) -> None:
    """Overrides map node names or module-path globs (strings) to dtypes: anything else failed
    deep in a pass ("object of type 'int' has no len()" for ``{0: 'fp32'}``, an nn.Sequential
    child's index) or in dict() ("dictionary update sequence element #0 ...")."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise TypeError(f"overrides must be a dict of node names or module-path globs to dtypes "
                        f"({{'encoder.layer.0.*': 'fp32', 'fc2': 'low'}}), got "
                        f"{type(overrides).__name__} {overrides!r:.80}")
    bad = [k for k in overrides if not isinstance(k, str)]
    if bad:
        hint = (f" (an nn.Sequential's child is named by its index as a string: "
                f"{{'{bad[0]}': 'fp32'}})") if isinstance(bad[0], int) else ""
        raise TypeError(f"overrides keys are node names or module-path globs, as strings: "
                        f"{bad[0]!r} ({type(bad[0]).__name__}) is not one{hint}")


def _graph_in_eval_mode(gm, args, kwargs, evaluated, buffers: bool = False
                  ) -> Optional[tuple[float, dict]]:
    """The float32 graph run once in eval mode on the example inputs (its training flags put
    back): the worst relative L2 of its outputs against ``evaluated``, the model's in eval
    mode, and with ``buffers`` its buffers as the run left them; None where the outputs do not
    pair up (logged)."""
    flags = {m: m.training for m in gm.modules()}
    written: dict = {}

    def keep(g):
        written.update((n, b.detach().clone()) for n, b in g.named_buffers())

    torch.nn.Module.train(gm, False)
    try:
        out = run_recording(gm, args, kwargs, lambda node, value: None,
                            after=keep if buffers else None)
        return max(output_errors(out, evaluated), default=0.0), written
    except Exception as e:  # noqa: BLE001 (outputs that do not pair up: nothing to compare)
        log.info("eval mode not compared with the model's: %s", e)
        return None
    finally:
        for m, flag in flags.items():
            m.training = flag


def _say_if_eval_differs(gm, model, args, kwargs, evaluated) -> None:
    """A model in eval mode converted with mode='train' is traced in training mode, so that
    dropout and batch norm train, and starts in eval mode; dropout and batch norm switch, but a
    Python branch on ``self.training`` (Mixtral's router jitter, a noise layer's
    ``if self.training: h = h + noise``) stays the training one. Its float32 graph in eval mode
    is compared with the model's eval forward on the example inputs, and a difference is said:
    a validation loop in eval mode got the training branch's values (1.32 off), silently."""
    ran = _graph_in_eval_mode(gm, args, kwargs, evaluated)
    if ran is None:
        return
    worst, _ = ran
    if worst > 1e-4:
        readers = gm.meta.get(READS_TRAINING, ((), True))[0]
        where = f" ({', '.join(readers[:3])} read it)" if readers else ""
        warnings.warn(
            f"{type(model).__name__} is in eval mode and converted with mode='train': the graph "
            "is traced in training mode (so that dropout and batch norm train) and starts in "
            "eval mode, where dropout and batch norm switch, but in eval mode it computes "
            f"other values than the model does ({worst:.3g} relative L2 on the example inputs, "
            f"in float32): a branch on self.training in the forward{where} keeps what training "
            "mode does. Evaluate with a conversion of the model in eval mode "
            "(mpgraph.convert(model.eval(), ...) with the trained weights: "
            "load_state_dict(fast.state_dict()))", UserWarning, stacklevel=4)


def _eval_switches_alike(gm, args, kwargs, evaluated, buffers: dict) -> None:
    """A model in training mode whose own forward reads ``self.training`` (capture's
    reads_training: a syntactic test) made the converted module's ``.eval()`` warn that the
    graph keeps the training branch, also where the read switches in the graph as dropout does
    (attention's ``dropout_p=p if self.training else 0.0``: probe pA 5). The float32 graph in eval
    mode is run on the example inputs: where its outputs and the buffers it writes are the
    model's in eval mode (capture's _evaluated_with_state), the reads switched, and nothing is
    said; else ``.eval()`` warns, as before."""
    ran = _graph_in_eval_mode(gm, args, kwargs, evaluated, buffers=True)
    if ran is None:  # (.eval() says what it says)
        return
    worst, written = ran
    kept = [n for n, b in buffers.items() if n in written and not (
        written[n].shape == b.shape and torch.allclose(written[n].double(), b.double(),
                                                       rtol=1e-4, atol=1e-6, equal_nan=True))]
    if worst <= 1e-4 and not kept:
        readers = gm.meta.pop(READS_TRAINING, ((),))[0]
        log.info("%s read self.training, and the graph in eval mode computes what the model "
                 "does in eval mode (on the example inputs): .eval() switches them",
                 ", ".join(readers[:3]))


def _choose_low(gm, costs: CostModel, opts: Options, args, kwargs) -> tuple[torch.dtype, dict]:
    """The low dtype whose cost-optimal plan the cost model estimates fastest, with the
    estimates: each candidate's decisions run (analysis passes only: nothing is rewritten)."""
    candidates = [d for d in LOW_DTYPES if costs.supports(d)] or [torch.bfloat16]
    named = _override_lows(opts.overrides)
    if named:  # an override that names a low dtype says which one the plan has
        if costs.kind == Kind.GPU and torch.float16 in named:
            named = {torch.float16}  # (fp16 with bf16 beside it: a GPU plan holds both)
        usable = [d for d in candidates if d in named]
        if len(usable) != 1:
            raise ValueError(
                f"the overrides name {' and '.join(dtype_name(d) for d in sorted(named, key=str))} "
                f"for nodes, which a plan for {costs.name} cannot hold (its low dtypes: "
                f"{', '.join(dtype_name(d) for d in candidates)}; a CPU plan has one): name "
                "one of them, or 'low' (the plan's low dtype, whichever the cost model picks)")
        candidates = usable
    estimates = {}
    with stage("choose dtype"):
        for dtype in candidates:
            # fp16 on a GPU that has bf16 too: with bf16 where fp16's range keeps a node out
            range_dtype = torch.bfloat16 if dtype == torch.float16 and costs.kind == Kind.GPU \
                and costs.supports(torch.bfloat16) else None
            PassManager(decide_pipeline(dtype, costs=costs, spec=opts.spec, strategy="optimal",
                                        keep_io_types=opts.keep_io_types, op_table=opts.table,
                                        overrides=opts.overrides, range_dtype=range_dtype,
                                        train=opts.train),
                        label=f"choose:{dtype_name(dtype)}")(gm)  # analysis passes only
            estimates[dtype] = gm.meta["mpgraph.estimate"]["plan_s"]
    best = min(estimates.values())
    ruled = False
    if costs.kind == Kind.GPU and torch.float16 in estimates:
        # every GPU with bf16 Tensor Cores runs fp16 at the same rate: fp16 (3 more mantissa
        # bits), bf16 for the nodes fp16's range keeps out (priced as float32 in the cut, so
        # its estimate may read higher than a pure-bf16 plan's)
        low = torch.float16
        ruled = estimates[low] > 1.02 * best  # (then not the estimate's choice: said so)
    else:  # within 2% of the best: bf16 on a CPU (its range), else the fastest
        near = [d for d in candidates if estimates[d] <= 1.02 * best]
        low = torch.bfloat16 if torch.bfloat16 in near else min(near, key=estimates.get)
    log.info("dtype on %s: %s (estimated %s; %s)", costs.name, dtype_name(low),
             ", ".join(f"{dtype_name(d)} {estimates[d] * 1e3:.3g} ms" for d in candidates),
             costs.source)
    return low, {"candidates": [dtype_name(d) for d in candidates],
                 "estimates_s": {dtype_name(d): estimates[d] for d in candidates},
                 **({"named_by": "the overrides"} if named else {}),
                 **({"rule": "gpu_fp16"} if ruled and not named else {})}


def _override_lows(overrides: Optional[dict]) -> set:
    """The low dtypes the overrides name (fp16, bf16, by any of their names; not 'low'):
    with the dtype left to the cost model, they choose it, rather than failing the candidate
    they do not name."""
    named = set()
    for value in (overrides or {}).values():
        if isinstance(value, str) and value.lower() == "auto":
            continue
        try:
            named.add(resolve_dtype(value))
        except (ValueError, TypeError):  # fp32, 'low', or a bad name AssignPrecision reports
            pass
    return named


def elsewhere(spec: DeviceSpec, args: tuple, kwargs: dict, model: torch.nn.Module) -> bool:
    """Whether the plan is for a GPU while the model runs on this CPU: then conversion's own
    runs of the converted graph compute as the GPU would (mpgraph.ir.simulate) rather than in
    the CPU's emulated fp16/bf16 kernels."""
    from torch.utils import _pytree as pytree
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors += list(itertools.islice(model.parameters(), 1))
    return spec.kind == Kind.GPU and not any(t.device.type == "cuda" for t in tensors)


def follows_training_flag(gm: torch.nn.Module) -> bool:
    """Whether the converted module holds anything that behaves differently in training
    (dropout, batch norm: the modules FollowTrainingFlag put there, or the model's own)."""
    kinds = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm,
             TrainingBatchNorm, DropoutRate, TrainingFlag)
    return any(isinstance(m, kinds) for m in gm.modules())


def _restore_buffers(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """Undo what conversion's own runs wrote into buffers (a model in training mode updates its
    batch-norm statistics on every run): the converted module starts from the model's state."""
    original = dict(model.named_buffers())
    derived = weight_copy_paths(model)  # (a converted model's low copies: as its call has them)
    with torch.no_grad():
        for name, buf in gm.named_buffers():
            src = original.get(name) if name not in derived else None
            if src is None or src.shape != buf.shape or is_abstract(src) or is_abstract(buf):
                continue
            if not torch.equal(src.to(buf.dtype), buf):
                buf.copy_(src)


def _to_match(plan: Plan, names: set) -> list:
    """The plan's decided nodes that a graph with these node names must have: not export's input
    guard (only a graph captured at the example's shapes has it: a plan moves between static and
    dynamic captures of one model), nor a node a rewriting pass added that the graph lacks
    (ChannelsLast's layout change: that pass adds it again), nor a ``.dtype`` read that
    FoldDtypeReads now folds (a plan saved before it)."""
    return [r for r in plan.compute_nodes if r.target != EXPORT_GUARD
            and not ((r.inserted_by or r.target == "getattr") and r.name not in names)]


def _dropout_in(plan: Plan, model: Optional[torch.nn.Module]) -> bool:
    """Whether a plan holds dropout nodes (FollowTrainingFlag's "dropout_mode", or a call of a
    model's nn.Dropout): made from the model in training mode."""
    for r in plan.nodes:
        if r.target.endswith("_mode") and "dropout" in r.target:
            return True
        try:
            module = model.get_submodule(r.module) if model is not None and r.module else None
        except AttributeError:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            return True
    return False


def check_plan_fits(plan: Plan, gm: torch.fx.GraphModule,
                    model: Optional[torch.nn.Module] = None) -> None:
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
    if problems and not gm.training and _dropout_in(plan, model):
        problems.insert(0, "the plan was made from the model in training mode (its dropout "
                           "nodes), and the model is in eval mode now: put it in the mode the "
                           "plan was made in (model.train()), or make a plan in this one")
    static = str(plan.capture).endswith(_STATIC)
    if problems and str(plan.capture).startswith("torch.export") \
            and static != bool(gm.meta.get(STATIC_SHAPES)):
        problems.insert(0, f"the plan was made with dynamic={not static} ({plan.capture}) and "
                           f"this conversion captured with dynamic={static}: leave dynamic "
                           f"out, or pass dynamic={not static}")
    regions = [any("set_grad_enabled" in t for t in targets) for targets in (
        [r.target for r in plan.nodes], [target_name(n) for n in gm.graph.nodes])]
    if problems and regions[0] != regions[1]:  # (a region's nodes, inlined or not: new names)
        problems.insert(0, "the plan was made with gradients " + ("on" if regions[0] else "off")
                        + " and this conversion runs with them " + ("off" if regions[0] else "on")
                        + ": torch.export keeps the forward's no_grad region as one "
                        "wrap_with_set_grad_enabled node with gradients on, and inlines it "
                        "with them off. Apply the plan in the grad mode it was made in ("
                        + ("outside torch.no_grad()" if regions[0] else "inside torch.no_grad()")
                        + "), or make a plan in this one")
    if problems and all(": shape " in p for p in problems):
        problems.insert(0, "a plan is made for the shapes of the inputs it was made with, and "
                           "these inputs give other shapes: apply it with inputs of those "
                           "shapes, or make a plan at these (mpgraph.convert(model, inputs, "
                           "...), with overrides= for your edits)")
    if problems:
        raise PlanMismatchError(problems)
