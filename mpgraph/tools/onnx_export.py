"""ONNX export for fp16/bf16 inference: the exported types are the plan.

ONNX Runtime's CUDA provider runs whatever tensor types the file declares and TensorRT is strongly
typed, so the file *is* the precision plan. We export the converted GraphModule with
``torch.onnx.export(dynamo=True)`` (TorchScript only as a reported fallback), so weights are
already fp16/bf16 initializers and our casts are ordinary Cast nodes; then a few edits on the
ONNX IR make the file say exactly what the plan says (see ``_postprocess``), and ``validate_onnx``
proves it. Nothing is serialised to one protobuf string: the IR is saved with external data when
the weights are large, and every check reads the file by path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import torch
from torch.utils import _pytree as pytree

from mpgraph.api import convert, follows_training_flag, resolve_dtype
from mpgraph.frontend.capture import distinct_inputs, in_inference_mode, outside_inference_mode
from mpgraph.cost.device import auto_dtype, resolve_target
from mpgraph.ir.fake import has_abstract_tensors
from mpgraph.ir.graph import as_call, fresh, state_kept, target_name
from mpgraph.passes.infra import stage
from mpgraph.errors import ExportError, MpgraphError
from mpgraph.ir.meta import STATIC_SHAPES, dtype_name
from mpgraph.ir.modules import computes_sizes, pytree_copies_quiet, refresh_weights
from mpgraph.plans.plan import Plan
from mpgraph.tools.onnx_check import OrtRunError

log = logging.getLogger(__name__)

DEFAULT_TARGET = "a100-80gb"  # what a plan is made for when no GPU is here and none is named
DEFAULT_OPSET = 23  # the first opset with an Attention op whose softmax precision can be stated
MIN_OPSET = 18  # torch.onnx's dynamo exporter writes opset 18 and converts it up from there
EXTERNAL_DATA_THRESHOLD = 1 << 30  # bytes of weights above which they go to a .data file
_PROTOBUF_LIMIT = (1 << 31) - (1 << 26)  # one protobuf must stay under 2 GiB, with room for the graph


def _max_opset() -> int:
    import onnx
    return onnx.defs.onnx_opset_version()


@dataclass
class ExportResult:
    """What was written and what was proved about it."""

    path: str
    exporter: str
    opset: int
    plan: Plan
    external_data: Optional[str] = None
    casts_in_file: int = 0
    casts_expected: int = 0
    # plan casts of values computed from weights alone, which the exporter folded into constants
    # of the cast's dtype: carried out in the file, with no Cast node
    casts_folded: int = 0
    cast_differences: list[str] = field(default_factory=list)
    edits: dict = field(default_factory=dict)
    validation: Any = None  # onnx_check.ValidationResult when validated
    # what was changed so that onnxruntime runs the file (no fusions, ops kept float32), and why
    fallbacks: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"wrote {self.path} ({self.exporter}, opset {self.opset}"
                 + (f", weights in {self.external_data})" if self.external_data else ")"),
                 self.plan.summary(),
                 f"Cast nodes in the file: {self.casts_in_file} (plan: {self.casts_expected}"
                 + (f", {self.casts_folded} of them folded into constants"
                    if self.casts_folded else "") + ")"]
        lines += [f"  difference: {d}" for d in self.cast_differences]
        lines += [f"fallback: {f}" for f in self.fallbacks]
        if self.validation is not None:
            lines.append(self.validation.summary())
        return "\n".join(lines)


def _onnx_modules():
    try:
        import onnx  # noqa: F401
        import onnx_ir as ir
        import onnxscript  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("ONNX export needs the onnx extra: pip install 'mpgraph[onnx]'") from e
    return ir


def is_converted(module) -> bool:
    return isinstance(module, torch.fx.GraphModule) and isinstance(getattr(module, "plan", None), Plan)


def _check_destination(path: str) -> str:
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise ExportError(f"cannot write {path}: it is a directory")
    if not os.path.isdir(parent):
        raise ExportError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {path}: directory {parent} is not writable")
    return path


def _brief(exc: BaseException) -> str:
    """The informative part of an exporter error: its exception summary when it has one."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if "## Exception summary" in text:
        tail = text.split("## Exception summary", 1)[1]
        lines = [l.strip() for l in tail.splitlines() if l.strip() and not l.strip().startswith("⬆")]
        return " ".join(lines[:1])[:600]
    lines = [l.strip() for l in f"{type(exc).__name__}: {text}".splitlines() if l.strip()]
    return " ".join(lines[:2])[:600]


# The exporter's optimiser (onnxscript's no-op rules) removes ``x + c`` for |c| <= 1e-8 and
# ``x * c`` for |c - 1| <= 1e-5 * |c| as if c were exactly 0 or 1: an eps of 1e-12 vanishes and
# sqrt(var + eps) becomes sqrt(0) on constant rows, NaN downstream, in float32 files too.
_NOOP_ABS_TOL, _NOOP_REL_TOL = 1e-8, 1e-5
_ADDS = {"add", "sub", "__add__", "__radd__", "__sub__", "rsub"}
_MULS = {"mul", "div", "truediv", "__mul__", "__rmul__", "__truediv__"}


def near_identity_constants(gm: torch.fx.GraphModule) -> list[str]:
    """'node: op c' for float constants the exporter's optimiser would treat as exact 0 or 1."""
    found = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        parts = target_name(node).replace("::", ".").split(".")  # "add", "aten.add.Tensor"
        name = next((p for p in parts if p in _ADDS | _MULS), None)
        for c in node.args if name else ():
            if not isinstance(c, float) or c == 0.0:
                continue
            if name in _ADDS and abs(c) <= _NOOP_ABS_TOL:
                found.append(f"{node.name}: {name} {c:g}")
            elif name in _MULS and c != 1.0 and abs(c - 1.0) <= _NOOP_REL_TOL * abs(c):
                found.append(f"{node.name}: {name} {c!r}")
    return found


def output_names(gm: torch.fx.GraphModule) -> list[str]:
    """ONNX output names from the module's output structure: the keys of a dict or ModelOutput
    (``last_hidden_state``), positions of a tuple (``output_0``), joined for nests."""
    from torch.utils import _pytree as pytree
    spec = getattr(gm, "_out_spec", None)
    if spec is not None:  # the export route: the structure torch.export recorded
        tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    else:
        tree = pytree.tree_map(_dataclass_fields, next(n for n in gm.graph.nodes
                                                       if n.op == "output").args[0])
    names, seen = [], set()
    for i, (path, _) in enumerate(pytree.tree_flatten_with_path(tree)[0]):
        parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", "")))) for k in path]
        name = "_".join(re.sub(r"\W+", "_", p).strip("_") for p in parts if p != "")
        name = name if name and not name[0].isdigit() else f"output_{name or i}"
        while name in seen:
            name += "_"
        seen.add(name)
        names.append(name)
    return names


def _builds_dataclass(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" \
        and isinstance(node.target, type) and dataclasses.is_dataclass(node.target)


def _dataclass_fields(node):
    """A traced dataclass constructor call as {field: value} (the output names its fields, as a
    ModelOutput's keys); anything else as it is."""
    if not _builds_dataclass(node):
        return node
    fields = [f.name for f in dataclasses.fields(node.target)]
    return {**dict(zip(fields, node.args)), **node.kwargs}


def unflattened_dataclass_outputs(gm: torch.fx.GraphModule) -> list[str]:
    """The names of dataclasses the traced graph returns that torch's pytree cannot flatten:
    torch.onnx's exporters fail on them with raw pytree errors."""
    if getattr(gm, "_out_spec", None) is not None:  # (torch.export flattened the output)
        return []
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return sorted({n.target.__name__ for n in pytree.tree_leaves(out)
                   if _builds_dataclass(n) and n.target not in pytree.SUPPORTED_NODES})


def non_tensor_outputs(gm: torch.fx.GraphModule) -> list[str]:
    """'tag (a str, 'hello')' for the graph's outputs that are Python values held as constants,
    not tensors: an ONNX output is a tensor, and torch's exporters failed inside on them
    (None is left out of the file by the exporter, and is fine)."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    spec = getattr(gm, "_out_spec", None)
    flat = isinstance(out, (tuple, list)) and spec is not None and len(out) == spec.num_leaves
    leaves = list(out) if flat else pytree.tree_leaves(out)  # (in output_names' order)

    def a(kind: str) -> str:
        return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    return [f"{name} ({a(type(v).__name__)}, {v!r:.40})" for name, v in zip(output_names(gm), leaves)
            if v is not None and not isinstance(v, torch.fx.Node)]


def _legacy_inputs(gm: torch.nn.Module, args: tuple, kwargs: dict, auto: bool):
    """The TorchScript exporter's ``input_names`` (each tensor by its forward argument's name,
    ``NAME_i`` for the i-th tensor in a container) and ``dynamic_axes`` (with
    ``dynamic_shapes="auto"``: the dimensions torch.export keeps symbolic, as the dynamo
    exporter's file has them). Without them its file took ``input``, ``onnx::LSTM_1`` at the example's
    shapes only (probe pB F2)."""
    params = _forward_names(gm)
    named = [(params[i] if i < len(params) else f"input_{i}", v) for i, v in enumerate(args)]
    names = []
    for name, value in named + list(kwargs.items()):
        leaves = pytree.tree_leaves(value)
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        names += [name] if isinstance(value, torch.Tensor) else [
            f"{name}_{i}" for i in range(len(tensors))]
    if not auto:
        return names, None
    if computes_sizes(gm.graph):
        # (the TorchScript exporter traces: sizes the graph computes become the example's, and
        # a file declared dynamic failed inside onnxruntime at other shapes: review rA 4)
        return names, None
    try:  # torch.export itself ran (what failed was its ONNX translation): its dims
        program = torch.export.export(gm, tuple(args), dict(kwargs), strict=False,
                                      dynamic_shapes=auto_dynamic_shapes(gm, args, kwargs))
        spec = program.graph_signature
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        shapes = [placeholders[i].meta["val"].shape for i in spec.user_inputs
                  if isinstance(placeholders[i].meta.get("val"), torch.Tensor)]
    except Exception as e:  # noqa: BLE001 - the file then takes the example's shapes
        log.info("no dynamic axes for the TorchScript exporter: %s", _brief(e))
        return names, None
    if len(shapes) != len(names):
        return names, None
    axes = {name: {d: f"{name}_dim{d}" for d, n in enumerate(shape)
                   if not isinstance(n, int)}
            for name, shape in zip(names, shapes)}
    return names, {k: v for k, v in axes.items() if v} or None


def auto_dynamic_shapes(gm: torch.nn.Module, args: tuple, kwargs: dict):
    """Dim.AUTO on every input dimension above 1 that the converted module's input guard does
    not fix: torch.export keeps dynamic what the graph does not fix (batch, sequence), static
    the rest (hidden sizes). The converted graph's own export sees no guard on what the first
    capture fixed (a ViT's channels and image size, Whisper's mel bins): its file took any
    size there, and ran other image sizes silently or failed inside onnxruntime."""
    from mpgraph.frontend.capture import dynamic_spec
    return dynamic_spec(gm, args, kwargs, _guarded_dims(gm, args, kwargs))


def _guarded_dims(gm: torch.nn.Module, args: tuple, kwargs: dict) -> frozenset:
    """(leaf, dim) pairs of the inputs' tensors (pytree order of (args, kwargs)) that the
    module's input guard (mpgraph.ir.modules.InputGuard: torch.export's asserts from the
    capture) fixes. Dims of one size change together (a mask's sequence is its ids'); of those,
    a dim is fixed where leaving it unchanged takes a broken condition away (an image's size
    beside a sequence of the same length), and the rest only if the guard refuses them both
    larger and smaller (a bound, a sequence at the model's maximum, is no fix)."""
    from mpgraph.ir.graph import flat_inputs
    from mpgraph.ir.modules import InputGuard
    guard = next((m for m in gm.modules() if isinstance(m, InputGuard)), None)
    if guard is None:
        return frozenset()
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    sizes = {(i, d): n for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)
             for d, n in enumerate(x.shape) if n > 1}

    def broken(changed, delta: int) -> set:
        trial = [torch.empty([n + delta * ((i, d) in changed) for d, n in enumerate(x.shape)],
                             dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
                 for i, x in enumerate(leaves)]
        a, k = pytree.tree_unflatten(trial, spec)
        # (the conditions capture waived, a size-1 branch in library code, the module does
        # not check either)
        return {m for m in guard.failures(*flat_inputs(gm, a, k)) if m not in guard.waived}

    fixed = set()
    try:
        for size in sorted(set(sizes.values())):
            group = {key for key, n in sizes.items() if n == size}
            smaller = -1 if size > 2 else 2  # (not down to 1, a size torch specialises)
            failing = broken(group, 1)
            held = {key for key in group if len(broken(group - {key}, 1)) < len(failing)} \
                if failing else set()
            rest = group - held
            # refused smaller and larger: one larger, or twice the size for a guard on
            # size // patch (Dinov2's, BEiT's patch count: holds at 33 for 32, breaks at 31 and
            # 64); refused on one side only, a bound (a sequence past half the position table)
            if rest and broken(rest, smaller) and (broken(rest, 1) or broken(rest, size)):
                held |= rest
            fixed |= held
    except Exception as e:  # noqa: BLE001 (a guard that reads values: no finding)
        log.info("input guard not probed (%s); every dimension left dynamic", e)
        return frozenset()
    return frozenset(fixed)


@contextlib.contextmanager
def as_onnx_export():
    """``torch.onnx.is_in_onnx_export()`` true meanwhile, as in torch.onnx.export: a model's
    export-only branch (a detection head's decoding, ``if torch.onnx.is_in_onnx_export():``) is
    what the file must hold, and the float32 model is run on it for validation; captured
    outside export, the file silently held the eager branch. (torch.onnx's own flag: on a torch
    without it, nothing is set.)"""
    try:
        from torch.onnx._internal.exporter import _flags
    except ImportError:
        yield
        return
    before = getattr(_flags, "_is_onnx_exporting", None)
    if before is None:
        yield
        return
    _flags._is_onnx_exporting = True
    try:
        yield
    finally:
        _flags._is_onnx_exporting = before


def in_signature_order(kwargs: dict, names) -> dict:
    """``kwargs`` in the order of the parameter ``names`` (those a ``**kwargs`` takes after them,
    as given). torch.export names the file's inputs in the order the keywords are given, while
    the converted graph takes them in its forward's order: a ``forward(input_ids,
    attention_mask)`` given the mask first wrote a file whose input named ``attention_mask``
    was read as the ids."""
    order = {n: i for i, n in enumerate(names)}
    return dict(sorted(kwargs.items(), key=lambda kv: order.get(kv[0], len(order))))


def _forward_names(module: torch.nn.Module) -> tuple:
    """The parameter names of ``module``'s forward (the model's own for a converted module,
    then its graph's)."""
    import inspect
    signature = module.__dict__.get("call_signature")
    names = tuple(signature.names) if signature is not None else ()
    try:
        names += tuple(n for n in inspect.signature(module.forward).parameters if n not in names)
    except (TypeError, ValueError):
        pass
    return names


def written_buffers(program) -> list[str]:
    """The buffers the exported forward writes (a step counter, an EMA): an ONNX file has no
    state, so every run of it computes from their values at export."""
    signature = getattr(getattr(program, "exported_program", None), "graph_signature", None)
    return sorted(set(getattr(signature, "buffers_to_mutate", {}).values())) if signature else []


def _export_ir(converted, args, kwargs, opset, dynamic_shapes, workdir):
    """(ir.Model, exporter description, the exporter's ExportedProgram or None)."""
    ir = _onnx_modules()
    auto = isinstance(dynamic_shapes, str) and dynamic_shapes == "auto"
    signature = converted.__dict__.get("call_signature")
    if signature is not None:  # the exporter traces forward itself: the fixed values given
        given = set(kwargs)
        args, kwargs = signature.complete(args, kwargs)
        if isinstance(dynamic_shapes, dict):  # (a spec by name must name those too: no dims)
            dynamic_shapes = {**dynamic_shapes, **{n: None for n in kwargs
                                                   if n not in given and n not in dynamic_shapes}}
    kwargs = in_signature_order(kwargs, _forward_names(converted))
    # (the exporters may run the forward: on copies, its buffers put back)
    args, kwargs = fresh((args, kwargs))
    tiny = near_identity_constants(converted)
    if tiny:
        log.warning("exporting without the ONNX optimiser: it would drop %s", ", ".join(tiny[:4]))
    if isinstance(dynamic_shapes, str) and dynamic_shapes == "auto":
        dynamic_shapes = auto_dynamic_shapes(converted, args, kwargs)
        # (torch.export keeps a size of 1 static: a batch-1 example's file takes batch 1 only)
        params = _forward_names(converted)
        named = [(params[i] if i < len(params) else f"input {i}", x) for i, x in enumerate(args)]
        batched = [(name, x) for name, x in named + list(kwargs.items())
                   if isinstance(x, torch.Tensor) and x.dim() >= 2]
        ones = [name for name, x in batched if x.shape[0] == 1]
        if ones and len(ones) == len(batched):  # (a (1, n) bias beside a batch is no batch)
            warnings.warn(f"the example's {', '.join(ones)} {'has' if len(ones) == 1 else 'have'} "
                          "batch 1: the file takes batch 1 only (torch.export keeps a size of 1 "
                          "static); export with an example of batch 2 or more for a dynamic "
                          "batch", UserWarning, stacklevel=3)
    names = output_names(converted)
    # torch.onnx takes a dict last among the positional arguments for the keywords, unless an
    # empty dict follows it: a forward(self, batch) given its dict batch was called without it
    call_args = args + ({},) if not kwargs and args and isinstance(args[-1], dict) else args
    try:
        # optimised here, as torch.onnx does with optimize=True: onnxscript's optimizer, then
        # its ONNX fusions (RMSNormalization, RotaryEmbedding, GQA at opset 23), keeping the
        # unfused graph (a clone sharing the weights) for a runtime that fails on a fused op
        with pytree_copies_quiet(), _exporter_quiet(), _registry_built_once(), \
                state_kept(converted):
            program = torch.onnx.export(converted, call_args, kwargs=kwargs or None,
                                        dynamo=True, opset_version=opset,
                                        dynamic_shapes=dynamic_shapes, output_names=names,
                                        optimize=False, verbose=False,
                                        custom_translation_table=borrowed_translations(
                                            converted) or None)
        written = written_buffers(program)
        if written:
            log.warning("the forward writes %s: an ONNX file holds no state, so every run of it "
                        "computes from their values at export (what the first call computes)",
                        ", ".join(written[:4]) + (", ..." if len(written) > 4 else ""))
        model, unfused, fused = program.model, None, {}
        if not tiny:
            import onnxscript.optimizer
            import onnxscript.rewriter.onnx_fusions
            onnxscript.optimizer.optimize_ir(model)
            unfused = model.clone()
            fused = {k: v for k, v in onnxscript.rewriter.onnx_fusions.fuse(model).items() if v}
        how = "torch.onnx.export(dynamo=True)" if not tiny else (
            f"torch.onnx.export(dynamo=True, optimize=False: its optimiser would drop "
            f"{', '.join(tiny[:2])})")
        return Exported(model, how, getattr(program, "exported_program", None),
                        unfused if fused else None, fused)
    except Exception as dynamo_error:
        reason = _brief(dynamo_error)
        if opset > 18:  # (its opset-23 Attention asserts on some models: Whisper's encoder)
            log.warning("dynamo ONNX export at opset %d failed (%s); trying opset 18", opset,
                        reason)
            try:
                exported = _export_ir(converted, args, kwargs, 18,
                                      "auto" if auto else dynamic_shapes, workdir)
            except ExportError:
                pass
            else:
                if exported.how.startswith("torch.onnx.export(dynamo=True"):
                    return replace(exported, how=f"{exported.how} at opset 18 [opset {opset} "
                                                 f"failed: {reason}]")
                return exported
        log.warning("dynamo ONNX export failed (%s); trying the TorchScript exporter", reason)
    legacy_opset = min(opset, 20)  # the TorchScript exporter stops at opset 20
    tmp = os.path.join(workdir, "torchscript.onnx")
    said = converted.__dict__.get("_said_jit_trace", False)
    converted.__dict__["_said_jit_trace"] = True  # (its trace: this file says it, not that)
    try:
        inputs, axes = _legacy_inputs(converted, args, kwargs, auto)
        static = auto and axes is None  # (said in the result's fallbacks)
        with state_kept(converted):
            try:  # (inputs named by argument, dynamic where the graph does not fix them)
                torch.onnx.export(converted, call_args, tmp, kwargs=kwargs or None,
                                  dynamo=False, opset_version=legacy_opset,
                                  output_names=names, input_names=inputs, dynamic_axes=axes)
            except Exception as e:  # noqa: BLE001 - as the exporter names them, static
                log.info("TorchScript export with input names and dynamic axes failed (%s): "
                         "exported without them", _brief(e))
                torch.onnx.export(converted, call_args, tmp, kwargs=kwargs or None,
                                  dynamo=False, opset_version=legacy_opset, output_names=names)
        model = ir.load(tmp)
        # (its values carry no types: the plan's edits and the Cast count read them, and
        # counted 1 Cast of a file's 6; ONNX's own inference gives them)
        try:
            ir.passes.common.ShapeInferencePass(strict_mode=False)(model)
        except Exception as e:  # noqa: BLE001 - the file stands; validation types it again
            log.info("ONNX type inference on the TorchScript exporter's file failed: %s",
                     _brief(e))
    except Exception as ts_error:
        missing = re.search(r"No ONNX function found for <OpOverload\(op='([\w.]+)'", reason)
        op = missing.group(1) if missing else ""
        blocker = (f"the graph calls {op}, which torch.onnx has no ONNX function for ("
                   + ("torch's own op: keep it out of the exported part, convert and export the "
                      "parts around it" if op.startswith("aten.") else
                      "a custom op: export a model that computes it with torch operators")
                   + ")\n" if missing else "")
        # (the TorchScript exporter calls forward with every parameter, those the conversion
        # fixed too: the converted module's refusal is no advice about the user's arguments)
        ts_reason = ("it cannot call the converted module (it passes every parameter of the "
                     "forward, those fixed at conversion too)" if _argument_check_refused(ts_error)
                     else _brief(ts_error))
        raise ExportError("the model could not be exported to ONNX:\n" + blocker +
                          f"  torch.onnx.export(dynamo=True): {reason}\n"
                          f"  torch.onnx.export(dynamo=False): {ts_reason}") from ts_error
    finally:
        converted.__dict__["_said_jit_trace"] = said
    shapes = "; at the example's shapes only (it traces the sizes the graph computes)" \
        if static else ""
    return Exported(model, f"torch.onnx.export(dynamo=False) [fallback; dynamo said: "
                           f"{reason}{shapes}]")


def _argument_check_refused(error: BaseException) -> bool:
    """The converted module's own argument check (CallSignature) raised ``error``."""
    import traceback
    from mpgraph.ir import modules
    return isinstance(error, TypeError) and any(
        os.path.abspath(f.filename) == os.path.abspath(modules.__file__)
        and f.name in ("check", "_one") for f in traceback.extract_tb(error.__traceback__))


# ops torch.onnx has no ONNX function for, translated by the library that defines them: the MoE
# experts of transformers (its custom op grouped_mm_fallback, and aten._grouped_mm it may call)
# by transformers' own ONNX exporter (a MatMul per expert)
BORROWED_TRANSLATIONS = {"transformers.grouped_mm_fallback": "transformers.exporters.exporter_onnx",
                         "aten._grouped_mm": "transformers.exporters.exporter_onnx"}


def borrowed_translations(gm: torch.fx.GraphModule) -> dict:
    """torch.onnx's ``custom_translation_table`` for the ``BORROWED_TRANSLATIONS`` ops that
    ``gm`` calls, from their library's own table (none where that library has none)."""
    import importlib
    called = {target_name(n).replace("::", ".") for n in gm.graph.nodes if n.op == "call_function"}
    table = {}
    for op, where in BORROWED_TRANSLATIONS.items():
        if not any(name == op or name.startswith(op + ".") for name in called):
            continue
        try:
            theirs = importlib.import_module(where)._ONNX_TRANSLATION_TABLE
        except (ImportError, AttributeError) as e:
            log.info("no ONNX translation of %s from %s: %s", op, where, e)
            continue
        table.update({k: f for k, f in theirs.items() if str(k).startswith(op + ".")})
    return table


@contextlib.contextmanager
def _exporter_quiet():
    """torch.onnx's exporter logs a warning per op library it does not find (torchvision) and
    per fallback it considers: kept off the screen unless mpgraph's debug logging is on."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


_REGISTRIES: dict = {}  # from_torchlib's arguments -> torch.onnx's registry, built once a process
_PATCHED = {"exports": 0, "torch": None}  # exports inside, torch's own from_torchlib meanwhile
_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _registry_built_once():
    """torch.onnx.export builds its registry of ONNX functions anew on every call: onnxscript
    parses the source of ~500 torchlib functions, 2.2 s of a 3.5 s export of a two-layer MLP,
    paid again by each opset and fallback tried. Built once a process here; each export gets a
    copy of its lists, so what it registers (a custom translation table) stays its own. Exports
    in several threads share one patch, put back when the last one ends."""
    try:
        from torch.onnx._internal.exporter import _registration
        owner = _registration.ONNXRegistry
        owner.__dict__["from_torchlib"].__func__
    except (ImportError, AttributeError, KeyError):  # (another torch: built as it builds it)
        yield
        return
    with _PATCH_LOCK:
        if _PATCHED["exports"] == 0:
            _PATCHED["torch"] = owner.__dict__["from_torchlib"]
            owner.from_torchlib = classmethod(_built_once(_PATCHED["torch"].__func__))
        _PATCHED["exports"] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCHED["exports"] -= 1
            if _PATCHED["exports"] == 0:
                owner.from_torchlib = _PATCHED["torch"]


def _built_once(build):
    """``build`` (torch's from_torchlib) run once for each set of its arguments; a copy each call."""
    signature = inspect.signature(build)

    def once(cls, *args, **kwargs):
        bound = signature.bind(cls, *args, **kwargs)
        bound.apply_defaults()  # (from_torchlib() and from_torchlib(opset_version=23): one)
        key = tuple(bound.arguments.items())
        if key not in _REGISTRIES:
            _REGISTRIES[key] = build(cls, *args, **kwargs)
        built, copy = _REGISTRIES[key], cls.__new__(cls)
        copy.__dict__.update(built.__dict__)
        copy.functions = {k: list(v) for k, v in built.functions.items()}
        return copy
    return once


@dataclass
class Exported:
    """What the exporter gave: the IR, how it was made, torch.export's program (dynamo), and the
    graph before onnxscript's fusions with what they fused, where they fused anything."""

    model: Any
    how: str
    program: Any = None
    unfused: Any = None
    fused: dict = field(default_factory=dict)


def _provenance(plan: Plan, exporter: str) -> dict[str, str]:
    fp32 = [{"node": r.name, "op_class": r.op_class, "reason": r.reason}
            for r in plan.compute_nodes if r.dtype == "float32"]
    casts = [{"cast": c.name, "value": c.value, "from": c.src, "to": c.dst,
              "inserted_by": c.inserted_by, "readers": list(c.consumers)} for c in plan.cast_sequence()]
    return {
        "mpgraph.dtype": dtype_name(plan.dtype),
        "mpgraph.summary": plan.summary(),
        "mpgraph.exporter": exporter,
        "mpgraph.casts": json.dumps(casts),
        "mpgraph.fp32_nodes": json.dumps(fp32),
    }


def node_origins(program, gm: torch.fx.GraphModule) -> dict[str, str]:
    """The node of ``gm`` each node of torch.export's ``program`` was traced from (torch.fx's
    ``from_node`` provenance), by name: how the file's Casts are paired with the plan's."""
    origins = {}
    for node in program.graph.nodes if program is not None else ():
        sources = list(node.meta.get("from_node") or ())
        while sources:
            source = sources.pop(0)
            if source.graph_id == id(gm.graph):
                origins[node.name] = source.name
                break
            sources += source.from_node
    return origins


def _postprocess(model, plan: Plan, exporter: str, ir,
                 origins: Optional[dict] = None) -> tuple[dict, tuple[int, int, list[str], int]]:
    """The plan's edits on the exported IR (mpgraph.tools.onnx_passes), the casts paired with
    the plan's (by ``origins``, node_origins', where known), and the plan's provenance in the
    model's metadata."""
    from mpgraph.tools.onnx_passes import AnnotatePlanCasts, plan_passes
    edits = {}
    for p in plan_passes():
        p(model)
        edits[p.description] = p.count
    annotate = AnnotatePlanCasts(plan, origins)
    annotate(model)
    model.metadata_props.update(_provenance(plan, exporter))
    return edits, (annotate.in_file, annotate.expected, annotate.differences, annotate.folded)


def _initializer_bytes(model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += tensor.nbytes
    return total


# -- the public entry points -------------------------------------------------------------------
def export_onnx(model_or_converted: torch.nn.Module, example_inputs: Any, path: Union[str, os.PathLike],
                *, dtype: Union[None, str, torch.dtype] = None, opset: Optional[int] = None,
                dynamic_shapes: Any = "auto", example_kwargs: Optional[dict] = None,
                target: Optional[str] = None, strategy: str = "optimal", keep_io_types: bool = True,
                external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
                validate: bool = True, device: Optional[str] = None) -> ExportResult:
    """Export a model (converted first) or an mpgraph-converted module to ONNX, and prove it.

    The file is written through a temporary directory beside ``path`` and moved into place only
    when export, edits and validation all succeeded: a failure leaves no half-written file.
    Weights go to ``<path>.data`` when they exceed ``external_data_threshold`` bytes. ``target``
    is the GPU the file is for (default: the one here, else ``DEFAULT_TARGET``): a plan made for
    this CPU would keep fp16 out of every node, since fp16 is slow on CPUs. ``dtype``: float16
    (the default for a model) or bfloat16; a converted module is exported in its plan's dtype.
    ``dynamic_shapes="auto"`` (the default) leaves every input dimension the graph does not fix
    dynamic (batch, sequence: what deployment varies); None exports the example's shapes; or
    torch.export's own spec. Outputs are named by the model's output structure
    (``last_hidden_state``, ``pooler_output``; ``output_0``... for tuples).
    """
    if in_inference_mode(locals()):  # (see outside_inference_mode)
        return outside_inference_mode(export_onnx, locals())
    ir = _onnx_modules()
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int)
                              or not MIN_OPSET <= opset <= _max_opset()):
        # (torch's exporter writes opset 18 and converts to others: below 18 the conversion
        # failed and opset 18 was written, silently)
        raise ValueError(f"opset must be an int from {MIN_OPSET} to {_max_opset()} (the opsets "
                         f"torch.onnx's exporter and this onnx write; default {DEFAULT_OPSET}), "
                         f"got {opset!r}")
    if target is None:
        target = "cuda" if torch.cuda.is_available() else DEFAULT_TARGET
    path = _check_destination(path)
    if dtype is None:
        low = getattr(getattr(model_or_converted, "plan", None), "dtype", torch.float16)
    elif isinstance(dtype, str) and dtype.lower() == "auto":
        # one low dtype per file: "auto" picks it for the target, without bf16 regions beside fp16
        low = auto_dtype(resolve_target(target))[0] or dtype
    else:
        low = resolve_dtype(dtype)
    args, kwargs = distinct_inputs(*as_call(example_inputs, example_kwargs))  # (one per input)
    if isinstance(model_or_converted, torch.nn.Module):
        kwargs = in_signature_order(kwargs, _forward_names(model_or_converted))
    if isinstance(model_or_converted, torch.nn.Module) and has_abstract_tensors(
            model_or_converted, args, kwargs):
        # (torch's exporter failed on them, then the TorchScript one, before this was said)
        raise ExportError("an ONNX file holds the weights' values and is validated on real "
                          "inputs; the model or its inputs hold tensors on the meta device (or "
                          "fake tensors): load its weights first (mpgraph.load_weights(module, "
                          "weights) for a module converted on the meta device) and pass real "
                          "inputs")
    if isinstance(model_or_converted, torch.nn.Module) and model_or_converted.training and (
            follows_training_flag(model_or_converted)  # dropout, batch norm (its own or ours)
            or type(model_or_converted).__module__.startswith("transformers.")):  # (F.dropout)
        name = "the converted module" if is_converted(model_or_converted) else \
            type(model_or_converted).__name__
        raise ExportError(f"{name} is in training mode (dropout on, "
                          "batch norm updating its statistics): an ONNX file is for inference. "
                          "Call .eval() on it before export_onnx")
    reference = None
    if is_converted(model_or_converted):
        converted = model_or_converted
        if low != converted.plan.dtype:
            raise ExportError(f"this module was converted to {dtype_name(converted.plan.dtype)}; "
                              f"dtype={dtype!r} cannot re-plan it: export it as it is (no dtype) "
                              f"or export the model itself with dtype={dtype!r}")
    else:
        if not isinstance(model_or_converted, torch.nn.Module):
            raise TypeError(f"export_onnx expects a torch.nn.Module, got {type(model_or_converted).__name__}")
        reference = model_or_converted
        try:
            # a static file: a static capture; onnxruntime runs a graph, no Python per node:
            # priced as replayed (kernel time), not as eager PyTorch calls
            with as_onnx_export():  # (the model's branch on torch.onnx.is_in_onnx_export())
                converted = convert(model_or_converted, args, example_kwargs=kwargs, dtype=low,
                                    keep_io_types=keep_io_types, target=target,
                                    strategy=strategy, dynamic=dynamic_shapes is not None,
                                    runtime="graphs")
        except MpgraphError as e:
            raise ExportError(f"could not convert the model before export: {e}") from e
    if converted.meta.get(STATIC_SHAPES) and dynamic_shapes is not None:
        # its graph holds the example's sizes as constants: a file with dynamic inputs took
        # other shapes and answered with outputs of the conversion's shapes
        if not (isinstance(dynamic_shapes, str) and dynamic_shapes == "auto"):
            raise ExportError("this module was converted with dynamic=False: its graph computes "
                              "at the example's shapes only, so it cannot be exported with "
                              "dynamic_shapes; export it with dynamic_shapes=None, or convert "
                              "with dynamic=True (the default)")
        log.info("exporting the example's shapes: the module was converted with dynamic=False")
        dynamic_shapes = None
    refresh_weights(converted)  # low copies and stacked weights in step with what was written since
    if converted.plan.range_nodes:
        raise ExportError(f"this plan mixes {dtype_name(converted.plan.dtype)} with "
                          f"{converted.plan.range_nodes[0].dtype} ({len(converted.plan.range_nodes)} "
                          "nodes, dtype='auto'); ONNX export takes one low dtype: convert with "
                          "dtype='fp16' or 'bf16'")
    constants = non_tensor_outputs(converted)
    if constants:
        raise ExportError(f"output{'s' if len(constants) > 1 else ''} {', '.join(constants)} "
                          f"{'are' if len(constants) > 1 else 'is'} not a tensor: an ONNX file's "
                          "outputs are tensors; return such values outside the exported module "
                          "(or as tensors)")
    classes = unflattened_dataclass_outputs(converted)
    if classes:
        shown = ", ".join(classes)
        raise ExportError(f"the model returns a plain dataclass ({shown}), which torch.onnx "
                          "cannot flatten into the file's outputs: register it with PyTorch's "
                          f"pytree before export_onnx, torch.utils._pytree.register_dataclass"
                          f"({classes[0]}) (the outputs are then named by field), or return a "
                          "NamedTuple or a dict")
    opset = opset or DEFAULT_OPSET
    workdir = tempfile.mkdtemp(prefix=".mpgraph-export-", dir=os.path.dirname(path))
    name = os.path.basename(path)
    fallbacks: list[str] = []

    def write(exported: Exported, converted) -> ExportResult:
        """The IR edited, saved in the work directory and validated; the result."""
        model = exported.model
        with stage("export"):
            edits, (in_file, expected, differences, folded) = _postprocess(
                model, converted.plan, exported.how, ir, node_origins(exported.program, converted))
            if differences:
                log.warning("Cast nodes in the file differ from the plan:\n  %s",
                            "\n  ".join(differences))
            data = None
            if _initializer_bytes(model) > min(external_data_threshold, _PROTOBUF_LIMIT):
                data = name + ".data"
            ir.save(model, os.path.join(workdir, name), external_data=data)
        written = model.opset_imports.get("", opset)
        if exported.how.startswith("torch.onnx.export(dynamo=False)") \
                and not any("TorchScript" in f for f in fallbacks):
            fallbacks.append(f"the TorchScript exporter wrote the file: "
                             f"{exported.how.partition('[fallback; ')[2].rstrip(']')}")
        if written != opset and not any("opset" in f for f in fallbacks):
            fallbacks.append(f"asked for opset {opset}, the exporter wrote opset {written}")
        result = ExportResult(path=path, exporter=exporter, opset=written,
                              plan=converted.plan, external_data=data, casts_in_file=in_file,
                              casts_expected=expected, casts_folded=folded,
                              cast_differences=differences, edits=edits,
                              fallbacks=fallbacks)
        if validate:
            from mpgraph.tools.onnx_check import validate_onnx
            with stage("validate"), as_onnx_export():  # (the float32 model as exported)
                result.validation = validate_onnx(os.path.join(workdir, name), converted, args,
                                                  kwargs, reference=reference,
                                                  exported_program=exported.program,
                                                  device=device, display_name=path)
        return result

    try:
        while True:
            with stage("export"):
                exported = _export_ir(converted, args, kwargs, opset, dynamic_shapes, workdir)
            exporter = exported.how + (f" at opset {opset}" if fallbacks and opset == 18 else "")
            try:
                result = write(exported, converted)
                break
            except OrtRunError as failed:
                # a runtime that fails on the file as fused, or crashes on some ops in the low
                # dtype: the same plan without onnxscript's fusions, then those ops kept float32
                if exported.unfused is not None:
                    fused = ", ".join(f"{op} x{n}" for op, n in exported.fused.items())
                    log.info("retrying without onnxscript's ONNX fusions (%s): %s", fused, failed)
                    try:
                        exported.model, exporter = exported.unfused, exported.how + \
                            " without onnxscript's ONNX fusions"
                        fallbacks.append(f"exported without onnxscript's ONNX fusions ({fused}): "
                                         f"{failed}")
                        result = write(exported, converted)
                        break
                    except OrtRunError as again:
                        fallbacks.pop()
                        failed = again
                if _failing_op(failed) == "Attention" and opset > 18:
                    # opset 23's Attention op, which onnxruntime cannot run as exported (1.31:
                    # a key-padding mask broadcast over the queries): opset 18's decomposed
                    # attention, its softmax read in float32 (onnx_passes)
                    fallbacks.append(f"exported at opset 18, attention as MatMul and Softmax: "
                                     f"{failed}")
                    log.warning("%s", fallbacks[-1])
                    opset = 18
                    continue
                pins = _runtime_pins(converted.plan)
                if not pins or reference is None:
                    way = (f"; convert it with overrides={{{', '.join(repr(p) + ': ' + repr('fp32') for p in pins)}}} "
                           "and export that" if pins else "")
                    if not pins and "crashed" in str(failed) and dynamic_shapes is not None:
                        # (1.31 on nn.MultiheadAttention with a key_padding_mask: probe pB F1)
                        way = ("; onnxruntime's optimiser crashes on some files of dynamic "
                               "shapes (1.31: nn.MultiheadAttention given a key_padding_mask, at "
                               "opset 23 and 18): export_onnx(..., dynamic_shapes=None) writes "
                               "the example's shapes, which it runs; or run the file with "
                               "graph_optimization_level=ORT_ENABLE_BASIC (mpgraph.ort_session)")
                    raise ExportError(f"{failed}; nothing is written{way}") from None
                fallbacks.append(f"kept float32: {', '.join(pins)} ({_RUNTIME_PIN_WHY}: {failed})")
                log.warning("%s", fallbacks[-1])
                try:
                    converted = convert(reference, args, example_kwargs=kwargs, dtype=low,
                                        keep_io_types=keep_io_types, target=target,
                                        strategy=strategy, dynamic=dynamic_shapes is not None,
                                        overrides={p: "fp32" for p in pins}, runtime="graphs")
                except MpgraphError as e:
                    raise ExportError(f"could not convert the model again with {pins} in "
                                      f"float32: {e}") from e
        for produced in (name, result.external_data):
            if produced:
                os.replace(os.path.join(workdir, produced), os.path.join(os.path.dirname(path), produced))
        log.info("%s", result.summary())
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ops whose low-precision form onnxruntime's CPU provider has been seen to crash on at its
# default optimisation level (1.31: an fp16 GRU or LSTM followed by another op, SIGSEGV), and
# which a file falls back to float32 for when its run crashes
RUNTIME_FP32_OPS = ("nn.GRU", "nn.LSTM", "nn.RNN", "aten.gru", "aten.lstm", "aten.rnn_tanh",
                    "aten.rnn_relu")
_RUNTIME_PIN_WHY = "onnxruntime could not run them in low precision"


def _failing_op(error: Exception) -> Optional[str]:
    """The op type onnxruntime names in a failure ("... while running Attention node ...")."""
    found = re.search(r"running (\w+) node", str(error))
    return found.group(1) if found else None


def _runtime_pins(plan: Plan) -> list[str]:
    """The low nodes of ``RUNTIME_FP32_OPS`` in a plan: what a crashing file is re-planned
    without."""
    return [r.name for r in plan.compute_nodes if r.dtype != "float32"
            and any(r.kind == op or r.kind.startswith(op + ".") for op in RUNTIME_FP32_OPS)]
