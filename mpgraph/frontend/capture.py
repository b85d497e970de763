"""Capture a model's graph: torch.fx.symbolic_trace first, torch.export (non-strict) as fallback.

The user's model is never touched: we trace a deep copy, so the converted module owns its own
parameters and the caller's parameters, buffers, training flag and hooks stay as they were.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import io
import logging
import operator
import os
import re
import sys
import threading
import traceback
import types
import warnings
from typing import Any, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.errors import BUILT_CACHE_FIX, EAGER, KV_CACHE_FIX, CaptureError, replaced_forward
from mpgraph.numerics import leaves, relative_l2
from mpgraph.frontend.functions import opaque_functions
from mpgraph.ir.graph import (EXPORT_GUARD, as_call, flat_inputs, fresh, is_view, owned,
                              named_arguments, python_rng_kept, mutated_nodes, run_kept,
                              run_recording, seeded, short_repr, source_line, state_kept)
from mpgraph.ir.meta import (BATCH_NORM_MOMENTA, CAPTURE, CAPTURED_TRAINING, EVAL_OUTPUTS,
                             EVAL_SWITCH, FP32_REGION, GRAD_MODES, MODULE_ALIASES, OBSERVED,
                             READS_TRAINING, STATIC_SHAPES, TENSOR, TensorInfo)
from mpgraph.ir.modules import (CallSignature, ConvertedModule, InputGuard, autocasting,
                                grad_mode, keep_backward_hooks, own_parametrizations)
from mpgraph.ir.fake import fake_mode, is_abstract, module_tensors
from mpgraph.passes.propagate_tensor_info import PropagateTensorInfo
from mpgraph.passes.op_table import MODULE_TABLE

log = logging.getLogger(__name__)

SYMBOLIC = "torch.fx.symbolic_trace"
SYMBOLIC_WHOLE = "torch.fx.symbolic_trace (torch.nn's composite modules whole)"
EXPORT = "torch.export"


# words of the lines in torch's error texts that point into torch's debugging, not at the model
_TORCH_POINTERS = ("TORCH", "For more", "For extended", "If you suspect", "Caused by",
                   "consider using", "User Stack", "docs.google", "github.com",
                   "The following call raised this error", "File \"")
_CALL_SITE = re.compile(r'The following call raised this error:\s*\n\s*File "([^"]+)", line '
                        r'(\d+), in (\S+)\n[ \t]*(\S[^\n]*)')
# frames of the machinery, not of the model's code (torch.nn's modules are model code)
_MACHINERY = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN = os.path.join(_MACHINERY, "nn") + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep  # (inspect's binding of the arguments)
_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # mpgraph/
         os.path.dirname(os.path.abspath(inspect.getfile(PropagateTensorInfo))) + os.sep)


def _brief(exc: BaseException, lines: int = 2) -> str:
    """The first line of an error (up to 400 characters), the next ones that are about the
    model, not pointers into torch's debugging, and the line of the model's code (its own, a
    library's such as transformers', or torch.nn's) that raised it: torch.export names it in
    its message, otherwise it is the innermost such frame of the traceback."""
    text = str(exc).split("The following call raised this error")[0]  # (_call_site says it)
    parts = [p for p in f"{type(exc).__name__}: {text}".strip().splitlines() if p.strip()]
    first, rest = parts[0], [p for p in parts[1:] if not any(w in p for w in _TORCH_POINTERS)]
    out = "\n    ".join([first[:400] + (" ..." if len(first) > 400 else "")] + rest[:lines - 1])
    out += " ..." if len(rest) > lines - 1 else ""
    where = _call_site(exc)
    return out + (f"\n    raised at {where}" if where else "")


def _model_code(filename: str) -> bool:
    """Whether a frame's file is the model's code: not torch's machinery (torch.nn's modules
    are model code), mpgraph's, the standard library's or generated code."""
    path = os.path.abspath(filename)
    return not (path.startswith(_OURS) or filename.startswith("<")
                or (path.startswith(_MACHINERY) and not path.startswith(_TORCH_NN))
                or (path.startswith(_STDLIB) and "-packages" + os.sep not in path))


def _call_site(exc: BaseException) -> str:
    """``file.py:line in function: code`` of the model's code that raised ``exc``, or "": the
    innermost frame of the traceback that is not torch's machinery or mpgraph's, else the call
    torch.export's message names (the outermost line of the model's forward)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if _model_code(frame.filename):
            return (f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}: "
                    f"{(frame.line or '').strip()}")
    found = _CALL_SITE.search(str(exc))
    if found:
        path, line, function, code = found.groups()
        return f"{os.path.basename(path)}:{line} in {function}: {code.strip()}"
    return ""


def _dynamic_shapes(args: tuple, kwargs: dict, static: frozenset = frozenset()):
    """Dim.AUTO on every tensor dimension, so the exported graph is not tied to one shape.

    Dimensions of size 0 or 1 stay static: torch.export specialises them anyway; so do those in
    ``static``, (leaf, dim) pairs numbered over the tensors of (args, kwargs) in pytree order.
    """
    auto = torch.export.Dim.AUTO
    leaf = iter(range(len(pytree.tree_leaves((args, kwargs)))))

    def spec(x):
        i = next(leaf)
        if not isinstance(x, torch.Tensor):
            return None
        return {d: auto for d in range(x.dim()) if x.shape[d] > 1 and (i, d) not in static}

    return pytree.tree_map(spec, args), pytree.tree_map(spec, kwargs)


# Tracing changes process-wide state: torch.fx patches nn.Module.__call__ and __getattr__ for
# the whole process while it traces (its CURRENT_PATCHER is a module global), torch.export keeps
# module globals (_EXPORT_MODULE_HIERARCHY) and a config flag, and the quiet context swaps
# sys.stderr. Two at once corrupt each other and leave the process broken. Captures take turns
# (reentrant: a capture may run a nested one), and the fx patch lets other threads' module calls
# through as they are (_Tracer).
_CAPTURE_LOCK = threading.RLock()
# torch's own loggers that narrate a failed trace (fake-tensor errors, unbacked-symbol warnings);
# CaptureError says what failed, and why, in a few lines
_NARRATORS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes",
              "torch.export", "torch._export", "torch._dynamo")


@contextlib.contextmanager
def _quiet():
    """Keep torch's narration of a failed trace (log records, and the partial graph torch.export
    prints to stderr) off the screen; with mpgraph's DEBUG logging on, it is logged instead."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(name) for name in _NARRATORS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_EXPORTABLE = (torch.Tensor, bool, int, float, str, type(None), torch.SymInt, torch.SymFloat)


def _refuse_unexportable(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """An argument torch.export cannot take (an Enum member, a torch.dtype or device, an object
    of the user's own class): torch said "Unfamiliar meta val" or "Unsupported input type",
    naming no argument. Named here, with the way out."""
    for name, value in named_arguments(model, args, kwargs):
        leaf = next((v for v in pytree.tree_leaves(value) if not isinstance(v, _EXPORTABLE)
                     and not type(v).__name__.endswith("Cache")), None)  # (a KV cache: its
        # own report and fix, INPUT_CACHE_FIX)
        if leaf is None:
            continue
        kind = type(leaf).__name__
        if dataclasses.is_dataclass(leaf):
            way = (f"register it before converting, torch.export.register_dataclass({kind}), "
                   "or pass its tensors as arguments")
        else:
            way = (f"convert a wrapper that passes it as a constant (class Wrapped(nn.Module): "
                   f"forward(self, x) returns model(x, {name}={short_repr(leaf)})), or make it a "
                   "module attribute set before converting")
        shown = f"an instance of the dataclass {kind}" if dataclasses.is_dataclass(leaf) else \
            f"{short_repr(leaf)} (a {kind})"
        raise TypeError(f"argument {name!r} is {shown}: torch.export takes tensors, "
                        f"Python numbers, strings and None (in lists, tuples and dicts); {way}")


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic: bool = True,
            train: bool = False, state: Optional[dict] = None,
            changed: Optional[list] = None) -> torch.fx.GraphModule:
    """torch.export, non-strict. ``state`` (``_python_state``): the attributes the forward
    changes are added to ``changed`` (torch.export puts them back after its trace, saying
    nothing of those that are not tensors)."""
    _refuse_unexportable(model, args, kwargs)
    frozen = [f"{k}={v!r}" for k, v in list(enumerate(args)) + list(kwargs.items())
              if isinstance(v, (bool, int, float)) and not isinstance(v, torch.Tensor)]
    if frozen:  # (a call with another value is a TypeError naming it: CallSignature)
        log.info("torch.export fixes Python scalar arguments in the graph (%s): the converted "
                 "module computes with these values", ", ".join(frozen))
    # size-oblivious: a symbolic size is not assumed to differ from 0 and 1, so the graph holds
    # for any size, and a branch of the model on one (if x.shape[0] == 1) is an explicit guard
    # (torch.export otherwise takes a size > 1 as given and checks nothing: a module converted
    # at batch 2 ran the batch-2 branch at batch 1, silently)
    # a custom autograd.Function is one op that keeps its backward (frontend.functions)
    watch = None if state is None or changed is None else model.register_forward_hook(
        lambda module, inputs, output: changed.extend(
            _changed_state(module, state, restore=False, traced=True)))
    inference: list = []
    try:
        with _quiet(), _size_oblivious(), opaque_functions("train" if train else "inference"), \
                _explicit_keywords(model, args, kwargs), _inference_regions(inference):
            ep = torch.export.export(model, args, kwargs, strict=False,
                                     dynamic_shapes=dynamic_spec(model, args, kwargs) if dynamic else None)
    finally:
        if watch is not None:
            watch.remove()
    if inference and torch.is_grad_enabled():
        where = ", ".join(sorted(set(inference))[:3])
        if train:
            raise RuntimeError(
                f"the forward enters torch.inference_mode() ({where}), which torch.export "
                "records nothing of: the converted module would train what the model freezes "
                "there. Write the region as `with torch.no_grad():` (the graph keeps it), or "
                "compute it outside the converted forward")
        log.warning("the forward enters torch.inference_mode() (%s), which torch.export records "
                    "nothing of: gradients taken through the converted module flow through that "
                    "region (write it as `with torch.no_grad():`, which the graph keeps)", where)
    with warnings.catch_warnings():
        # (a plain tensor attribute the forward adds a computed value into, self.mem.add_(h),
        # requires grad in capture's copy: torch.export takes it as a constant, detached, and
        # tells the user to make it a parameter, which it is not)
        warnings.filterwarnings("ignore", message=r"A model attribute `.*` requires gradient")
        unlifted = ep.module()
    guards = getattr(unlifted, EXPORT_GUARD, None)
    if guards is not None and InputGuard.of(guards) is not None:  # one that pickles
        setattr(unlifted, EXPORT_GUARD, InputGuard.of(guards))
    # A GraphModule of our own on the same graph and attributes: the unlifted module refuses
    # .train() and .eval(), which users call on what convert returns (FollowTrainingFlag gives
    # the flag its meaning back). Its generated code reads the pytree specs from the module.
    return ConvertedModule.wrap(unlifted)


class _AutocastOff:
    """While torch.fx traces a model: its own ``with torch.autocast(device, enabled=False):``
    regions (code its author keeps in float32: a rotary embedding's angles, a loss, a router),
    for the tracer to tag each node made inside (``node.meta["custom"][FP32_REGION]``).
    symbolic_trace runs through the context manager and records nothing of it: the region was
    planned low, silently. (torch.export records it as one wrap_with_autocast call, float32.)
    One entry per autocast entered: its region, or None for one the author enabled (code in it
    is planned). One whose flag cannot be told (a ``@torch.autocast("cuda", enabled=False)``
    decorator, made before the trace on a machine without CUDA, where torch sets every CUDA
    autocast's flag False) is taken as a region: the decorator form keeps code float32 far more
    often than it asks for fp16 (custom_fwd does that), and float32 is the safe reading (pN 3:
    planned fp16 before, where the ``with`` form of the same code stayed float32)."""

    def __init__(self):
        self._owner = threading.get_ident()
        self._stack: list[Optional[str]] = []

    @property
    def region(self) -> Optional[str]:
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def watching(self):
        cls = torch.amp.autocast_mode.autocast
        init, enter, leave = cls.__init__, cls.__enter__, cls.__exit__
        watcher = self

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            # what the author asked: torch turns off an autocast for a device it does not have
            # (autocast("cuda", dtype=torch.float16) planned for an A100 on a CPU machine)
            self.__dict__["_mpgraph_enabled"] = bool(kwargs.get(
                "enabled", args[2] if len(args) > 2 else True))

        def __enter__(self):
            out = enter(self)
            if threading.get_ident() == watcher._owner:
                asked = self.__dict__.get("_mpgraph_enabled", _asked(self))
                if asked:
                    region = None
                elif asked is False:
                    region = f"torch.autocast({self.device!r}, enabled=False)"
                else:  # (a decorator's flag this machine cannot tell)
                    region = (f"torch.autocast({self.device!r}) decorator (enabled=False "
                              f"assumed: this machine has no {self.device} to tell)")
                watcher._stack.append(region)
            return out

        def __exit__(self, *exc):
            out = leave(self, *exc)
            if threading.get_ident() == watcher._owner and watcher._stack:
                watcher._stack.pop()
            return out

        cls.__init__, cls.__enter__, cls.__exit__ = __init__, __enter__, __exit__
        try:
            yield self
        finally:
            cls.__init__, cls.__enter__, cls.__exit__ = init, enter, leave
            self._stack.clear()


def _asked(autocast) -> Optional[bool]:
    """Whether an autocast made before the trace (a decorator) was asked enabled: its flag where
    this machine has its device (torch keeps what was asked), None where it cannot be told."""
    here = autocast.device == "cpu" or (autocast.device == "cuda" and torch.cuda.is_available())
    return autocast._enabled if here else None


@contextlib.contextmanager
def _explicit_keywords(model: torch.nn.Module, args: tuple, kwargs: dict):
    """While exporting, a forward that takes each given keyword as a parameter of its own, where
    the model's takes some through ``**kwargs`` (HF's output_hidden_states=True): torch.export
    cannot match its dynamic-shapes spec to a non-tensor value nested there."""
    params = inspect.signature(model.forward).parameters
    rest = [n for n in kwargs if n not in params]
    if not rest or not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        yield
        return
    original = model.forward
    named = [n for n in params if params[n].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    positional = named[:len(args)]  # what the call gives: these, the rest of args, the keywords
    # the arguments past the named ones go to the forward's *args (a wrapper's
    # forward(self, *args, **kwargs)): kept as *args, not dropped
    star = next((n for n in params if params[n].kind == inspect.Parameter.VAR_POSITIONAL), None)
    star = [f"*{star}"] if star and len(args) > len(named) else []
    keywords = [n for n in kwargs if n not in positional]
    if not all(n.isidentifier() for n in positional + keywords):
        yield
        return
    source = (f"def forward({', '.join(positional + star + keywords)}):\n"
              f"    return call({', '.join(positional + star + [f'{n}={n}' for n in keywords])})\n")
    space = {"call": original}
    exec(source, space)  # noqa: S102 - a signature built from the model's own parameter names
    model.forward = space["forward"]
    try:
        yield
    finally:
        del model.forward


def _size_oblivious():
    from torch.fx.experimental import _config
    return _config.patch(backed_size_oblivious=True)


def dynamic_spec(model, args, kwargs, static: frozenset = frozenset()):
    """torch.export wants one spec per forward parameter; with kwargs, a dict by name, where the
    keywords a ``**kwargs`` parameter takes (HF's output_hidden_states) sit under its name.
    ``static``: dimensions kept static (``_dynamic_shapes``)."""
    dyn_args, dyn_kwargs = _dynamic_shapes(args, kwargs, static)
    params = inspect.signature(model.forward).parameters
    names = list(params)
    star = next((i for i, p in enumerate(params.values()) if p.kind == p.VAR_POSITIONAL), None)
    if star is not None and len(dyn_args) > star:  # *args: one spec, a tuple of them
        dyn_args = (*dyn_args[:star], tuple(dyn_args[star:]))
    if not kwargs:
        return dyn_args
    spec = {names[i]: d for i, d in enumerate(dyn_args)}
    rest = next((p.name for p in params.values() if p.kind == p.VAR_KEYWORD), None)
    for name, d in dyn_kwargs.items():
        if name in params or rest is None:
            spec[name] = d
        else:
            spec.setdefault(rest, {})[name] = d
    return spec


def in_inference_mode(arguments: dict) -> bool:
    """Whether an entry point called with ``arguments`` (its ``locals()``) is under
    ``torch.inference_mode()`` or ``torch.autocast``, or is given tensors made under inference
    mode: then outside_inference_mode."""
    return torch.is_inference_mode_enabled() or bool(autocasting()) or any(
        isinstance(t, torch.Tensor) and torch.is_inference(t)
        for t in pytree.tree_leaves(list(arguments.values())))


def outside_inference_mode(fn, arguments: dict):
    """``fn`` called again with ``arguments`` (its ``locals()`` on entry) outside
    ``torch.inference_mode()`` and ``torch.autocast``, where an entry point was called under
    them or given tensors made under inference mode (in_inference_mode): conversion copies the
    model and runs it, reading tensors' version counters (what a run wrote), which inference
    tensors do not have, and torch.export records autograd, which refuses them; under autocast
    the float32 reference the plan and its check are made against would itself run in low
    precision (the check would compare autocast with autocast, and the capture would record
    autocast's dtypes). Example tensors made under inference mode are taken as normal copies.
    The warnings of that call are said again at the entry point's caller, as outside inference
    mode (their stacklevels count the frames of a direct call). The converted module may be
    called under either mode."""
    args, kwargs = [], {}
    for name, p in inspect.signature(fn).parameters.items():
        value = arguments[name]
        if p.kind == p.VAR_KEYWORD:
            kwargs.update(value)
        elif p.kind == p.VAR_POSITIONAL:
            args.extend(value)
        elif p.kind == p.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    autocast = autocasting()
    if autocast:
        log.info("%s: torch.autocast (%s) is off during the conversion: the plan is made and "
                 "checked against float32", getattr(fn, "__name__", "conversion"),
                 ", ".join(autocast))

    def normal(t):
        return t.clone() if isinstance(t, torch.Tensor) and torch.is_inference(t) else t

    caller = sys._getframe(2)  # (this function <- the entry point <- its caller)
    said = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                inference = torch.is_inference_mode_enabled()
                with torch.inference_mode(False), contextlib.ExitStack() as stack:
                    for device in autocast:
                        stack.enter_context(torch.autocast(device, enabled=False))
                    if inference and (arguments.get("mode") or getattr(
                            arguments.get("plan"), "mode", None)) != "train":
                        # (grad stays off, as the caller had it: a forward's branch on
                        # torch.is_grad_enabled() is captured as it runs under inference_mode)
                        stack.enter_context(torch.no_grad())
                    args, kwargs = pytree.tree_map(normal, (args, kwargs))
                    return fn(*args, **kwargs)
            finally:
                said = list(caught)
    finally:  # (the caller's filters apply again here)
        registry = caller.f_globals.setdefault("__warningregistry__", {})
        for w in said:
            warnings.warn_explicit(w.message, w.category, caller.f_code.co_filename,
                                   caller.f_lineno, module=caller.f_globals.get("__name__"),
                                   registry=registry)


def capture(model: torch.nn.Module, example_inputs: Any = None,
            example_kwargs: Optional[dict] = None, *, export_only: bool = False,
            abstract=None, observe: bool = False, dynamic: bool = True,
            training: bool = False) -> torch.fx.GraphModule:
    """Return a GraphModule computing ``model``, traced from a copy of it.

    With example inputs, every node's output shape and dtype is recorded in
    ``node.meta["mpgraph.tensor"]``, and a symbolic trace that fails to run on them falls back to
    torch.export. Raises CaptureError naming what each tracer reported when none works.
    ``abstract`` (an ``mpgraph.ir.fake.Abstract``): trace fakes of the model's tensors and of the
    example inputs on the device it fakes (a model on the meta device, see mpgraph.ir.fake).
    ``observe`` (``convert`` sets it): that run also records what calibration measures of the example inputs
    (``PropagateTensorInfo``, in ``gm.meta["mpgraph.observed"]``), which ``convert``'s Calibrate
    takes instead of running them again.
    ``dynamic``: torch.export with every dimension > 1 symbolic, so the graph takes other batch
    sizes and sequence lengths; False specialises it to the example's shapes (about half the
    export time: symbolic shapes are what torch.export spends the rest on). A symbolic_trace
    graph is not tied to shapes either way.
    ``training``: trace the forward as it runs in training mode whatever the model's flag (the
    graph keeps the model's flag): a ``mode="train"`` conversion of a model in eval mode
    (``from_pretrained`` returns one) would otherwise bake in eval's dropout rate of 0 and batch
    norm's eval arithmetic (no batch counter, a cumulative average's factor of 0), which no
    later ``.train()`` could bring back.
    """
    if in_inference_mode(locals()):
        return outside_inference_mode(capture, locals())
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    scripted = [path or type(model).__name__ for path, m in model.named_modules()
                if isinstance(m, torch.jit.ScriptModule)]
    if scripted:  # (fx and torch.export both fail inside it, with errors that name neither)
        top = [p for p in scripted if not any(p.startswith(q + ".") for q in scripted)]
        raise CaptureError({"TorchScript": (
            f"{', '.join(top[:3])} {'is a' if len(top) == 1 else 'are'} TorchScript module"
            f"{'' if len(top) == 1 else 's'} (torch.jit.script/trace), which neither "
            "torch.fx nor torch.export traces into. Convert the model built with the eager "
            "module in its place (script it after converting, or not at all: the converted "
            "module runs under torch.compile)")})
    wrapped = _distributed_wrapper(model)
    if wrapped:  # (deepcopy, torch.export's compiler.disable: errors that name neither)
        raise CaptureError({"torch.distributed": (
            f"{wrapped} is wrapped by torch.distributed, whose hooks and sharded parameters "
            "(DTensors) no tracer captures")})
    args, kwargs = distinct_inputs(*as_call(example_inputs, example_kwargs))
    has_inputs = example_inputs is not None or example_kwargs is not None
    memo = computed_attributes(model)
    try:
        work = copy.deepcopy(model, memo)
    except Exception as e:
        raise CaptureError({"copy.deepcopy": "the model must be deep-copyable so that it is never "
                                             "modified: " + _brief(e)}) from e
    own_parametrizations(work)
    own = own_closures(work, memo)
    if training:
        keep_parameter_hooks(model, memo, own)
    with _parametrizations_uncached():
        return _capture_copy(work, model, args, kwargs, has_inputs, export_only, abstract,
                             observe, dynamic, training)


@contextlib.contextmanager
def _parametrizations_uncached():
    """torch's ``parametrize.cached()`` off while the copy is traced and run (a convert inside
    the user's ``with cached():``): the trace would leave its Proxy in the cache, where the copy's
    next read, the eager run it is compared with, found it. The caller's cache is put back."""
    from torch.nn.utils import parametrize
    saved = parametrize._cache_enabled, parametrize._cache
    parametrize._cache_enabled, parametrize._cache = 0, {}
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = saved


def _capture_copy(work, model, args, kwargs, has_inputs, export_only, abstract, observe,
                  dynamic, training):
    if abstract is not None:
        abstract.fake_module_(work)
        args, kwargs = abstract.fake_inputs(args, kwargs)
    # the Python state before the first run of the forward (_trains_alike's): each run's
    # changes are put back to it (taken in _trace, the model "as it was" held what
    # _trains_alike's runs set: the example's activation, kept though the model never ran)
    state = _python_state(work)
    evaluated = _trains_alike(work, args, kwargs, state) \
        if training and not model.training and has_inputs and abstract is None else None
    if evaluated is not None:
        work.train()
    # (a training conversion's: an inference one of a model in training mode is told at
    # convert to convert model.eval(); this costs a forward: review rA 6)
    switched = _evaluated_with_state(work, args, kwargs, state) if training \
        and model.training and has_inputs and abstract is None and reads_training(work) else None
    own = _tensor_paths(work)  # (before the tracers add their constants to it)
    depth = len(torch._C._functorch.get_interpreter_stack() or ())
    with _CAPTURE_LOCK, fake_mode(abstract), python_rng_kept():  # (the tracers run the forward)
        try:
            gm = _trace(work, model, args, kwargs, has_inputs, export_only, observe, dynamic,
                        state)
        finally:
            _leave_transforms(depth)
    _refuse_users_tensors(gm, model, own)
    if abstract is not None:
        _refuse_value_reads(gm, model)
        _refuse_unread_meta(gm, model, work)
    if evaluated is not None:  # (compared with the graph in eval mode: api._say_if_eval_differs)
        gm.meta[EVAL_OUTPUTS] = evaluated
    if switched is not None:  # (and here: api._eval_switches_alike)
        gm.meta[EVAL_SWITCH] = switched
    return gm


def _evaluated_with_state(work: torch.nn.Module, args: tuple, kwargs: dict, state: dict):
    """The outputs of a model in training mode whose own forward reads ``self.training``, run
    in eval mode, and its buffers after that run (both put back), or None where that run fails:
    what the converted module in eval mode is compared with (api._eval_switches_alike)."""
    try:
        return _model_in_eval_mode(work, args, kwargs, buffers=True)
    except Exception as e:  # noqa: BLE001 - then .eval() says what it says
        log.info("eval mode not run before the trace: %s", _brief(e))
        return None
    finally:
        work.train(True)
        _changed_state(work, state)


def _model_in_eval_mode(work: torch.nn.Module, args: tuple, kwargs: dict,
                        buffers: bool = False):
    """The copy's outputs in eval mode (detached), and with ``buffers`` its buffers as that run
    left them; the run seeded, its buffers put back. Autograd on, as the graph runs: without it
    nn.TransformerEncoder takes its nested-tensor fast path, which zeroes padded positions the
    graph computes (a difference api._say_if_eval_differs took for a branch on self.training)."""
    with torch.enable_grad(), seeded(), state_kept(work):
        out = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                              owned(work.train(False)(*fresh(args), **fresh(kwargs)), work))
        held = {name: b.detach().clone() for name, b in work.named_buffers()} if buffers else {}
    return out, held


def _distributed_wrapper(model: torch.nn.Module) -> Optional[str]:
    """What of ``model`` a torch.distributed wrapper holds (DistributedDataParallel, FSDP's
    fully_shard or FullyShardedDataParallel, parameters sharded as DTensors), else None."""
    from mpgraph.ir.modules import is_dtensor
    if not torch.distributed.is_available():
        return None
    from torch.distributed import fsdp
    kinds = tuple(k for k in (torch.nn.parallel.DistributedDataParallel,
                              getattr(fsdp, "FSDPModule", None),
                              getattr(fsdp, "FullyShardedDataParallel", None)) if k is not None)
    for path, m in model.named_modules():
        if isinstance(m, kinds):
            return f"{path or 'the model'} ({type(m).__name__})"
    sharded = next((name for name, p in model.named_parameters() if is_dtensor(p)), None)
    return f"the model's parameter {sharded} (a DTensor)" if sharded else None


def _tensor_paths(module: torch.nn.Module) -> set:
    """The paths of the tensors ``module`` holds: parameters, buffers, tensor attributes."""
    return {f"{prefix}{'.' if prefix else ''}{name}"
            for prefix, m in module.named_modules(remove_duplicate=False)
            for name, t in [*m._parameters.items(), *m._buffers.items(), *vars(m).items()]
            if isinstance(t, torch.Tensor)}


def _refuse_users_tensors(gm: torch.fx.GraphModule, model: torch.nn.Module, own: set) -> None:
    """A graph holding a tensor of the user's model (itself, or its storage) as a constant on
    none of the copy's paths ``own`` (``_tensor_paths``): the forward reached the model by a
    global name or through an object deepcopy shares (a hook
    ``lambda module, inputs, output: model.head(output)``), not through the copy. The tracers
    froze it as a constant, shared with the model: the model's later edits changed the
    converted module, and a ``load_state_dict`` into the converted module was ignored. A
    tensor on a path of the copy is its own (a submodule whose ``__deepcopy__`` returns itself
    shares it on purpose)."""
    users: dict = {}
    for path, t in module_tensors(model):
        users.setdefault(id(t), path)
        users.setdefault(_tensor_key(t), path)
    users.pop(None, None)
    held = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in own:
            t = gm
            for part in node.target.split("."):
                t = getattr(t, part, None)
            path = (users.get(id(t)) or users.get(_tensor_key(t))) \
                if isinstance(t, torch.Tensor) else None
            if path:
                held[node.target] = path
    if held:
        said = ", ".join(f"{path} (as {attr})" for attr, path in list(held.items())[:4])
        raise CaptureError({"tensors of your model": replaced_forward(model, said) or (
            f"the forward reads {said} of the {type(model).__name__} you passed, not of the copy "
            "mpgraph converts: a function reaches your model by a global name or through an "
            "object the module does not hold (a hook `lambda module, inputs, output: "
            "model.head(output)` with model a global, or a list the hook closes over), or is "
            "kept deeper than mpgraph rebinds it (two levels into a module's attributes); or "
            "the forward reads a global tensor that is also registered on your model (read it "
            "as the module's buffer instead), so the graph would hold these tensors as "
            "constants shared with your model, and a load_state_dict into the converted module "
            "would not reach them")})


def _tensor_key(t):
    """Where a tensor's values are, or None for one without its own storage (fake, meta,
    sparse, empty, a subclass)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or is_abstract(t) or t.is_meta \
            or t.layout != torch.strided:
        return None
    ptr = t.untyped_storage().data_ptr()
    return (t.device, ptr) if ptr else None


def _refuse_value_reads(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """A model without values (the meta device) whose forward reads a tensor's value (``.item()``,
    ``.tolist()``): torch.export traces it as an unbacked number, but conversion's runs on fakes
    cannot compute it (a PassError from deep in torch's fake mode, late)."""
    for node in gm.graph.nodes:
        target = node.target
        reads = (node.op == "call_method" and target in ("item", "tolist")) or (
            node.op == "call_function" and (target is torch.ops.aten.item.default or
                                            torch.Tag.data_dependent_output in
                                            getattr(target, "tags", ())))
        if not reads:
            continue
        where = f" at {source_line(node)}" if source_line(node) else ""
        read = node.args[0].name if node.args and isinstance(node.args[0], torch.fx.Node) else "?"
        raise ValueError(f"{type(model).__name__}'s forward reads the value of a tensor "
                         f"({node.name} of {read}{where}), which a model on the meta device does "
                         "not have: its plan is made from shapes alone. Convert the materialised "
                         "model, or compute with the tensor instead of its value (x / self.temp, "
                         "not x / self.temp.item())")


def _refuse_unread_meta(gm: torch.fx.GraphModule, model: torch.nn.Module,
                        work: torch.nn.Module) -> None:
    """A model with real parameters whose meta-device tensors the graph never reads (torch's
    ensembling tutorial keeps a meta copy of a member as functional_call's template): it is not
    a model without values, but planned as one it would be unchecked and refuse every call
    until the tensors it never reads were loaded."""
    meta = [path for path, t in module_tensors(model) if t.device.type == "meta"]
    real = [path for path, t in model.named_parameters() if t.device.type != "meta"]
    if not meta or not real:
        return
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    called = [str(n.target) + "." for n in gm.graph.nodes if n.op == "call_module"]
    if any(path in read or path.startswith(tuple(called)) for path in meta):
        return
    reports = {"the meta device": (
        f"{type(model).__name__} holds tensors on the meta device ({', '.join(meta[:3])}"
        f"{' ...' if len(meta) > 3 else ''}) that its graph never reads, beside real parameters "
        f"({', '.join(real[:2])}{' ...' if len(real) > 2 else ''}): taken for a model without "
        "values, it would be planned unchecked and refuse every call until tensors it never "
        "reads were loaded")}
    reports.update(_untraceable(work) or {})
    raise CaptureError(reports)


def _trains_alike(work: torch.nn.Module, args: tuple, kwargs: dict, state: dict):
    """Whether a model in eval mode runs in training mode too and returns the same structure
    there: then its training conversion is traced in training mode (``capture``'s
    ``training``), and this returns its outputs in eval mode (what the converted module, in
    eval mode, is compared with); else None. Not where its training forward fails (batch norm
    given a batch of one) or returns something else (Inception's auxiliary logits): that model
    is traced as it is, in eval mode, as before. Runs ``work`` (the copy) twice; its state is
    put back, and so is what the runs change of ``state`` (``_python_state``), unsaid (the
    tracers' runs say it)."""
    outs = []
    try:
        outs.append(_model_in_eval_mode(work, args, kwargs)[0])
        outs.append(run_kept(work.train(True), args, kwargs))
    except Exception as e:  # noqa: BLE001 - traced in eval mode instead
        log.info("not traced in training mode: its training forward fails: %s", _brief(e))
        return None
    finally:
        work.eval()
        _changed_state(work, state)
    if pytree.tree_structure(outs[0]) != pytree.tree_structure(outs[1]):
        log.info("not traced in training mode: it returns another structure there")
        return None
    return outs[0]


def computed_attributes(model: torch.nn.Module) -> dict:
    """deepcopy's memo with a detached copy of each tensor attribute computed with autograd
    (``torch.nn.utils.weight_norm`` and ``spectral_norm`` set ``module.weight`` from their
    parameters that way): deepcopy refuses such tensors, so no model using them converted. The
    hooks compute them again on every call."""
    return {id(t): t.detach().clone() for m in model.modules() for t in vars(m).values()
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
            and t.grad_fn is not None}


# a list or dict attribute of more items is not looked into for functions to rebind: a label
# map or a vocabulary (HF ViT's 21k-label config, walked once per module holding it, cost 0.24-0.5 s)
_WALKED_ITEMS = 1000


def own_closures(work: torch.nn.Module, memo: dict):
    """Rebind the functions the copy's modules hold (``self.fn = lambda t: self.l(t)`` set in
    ``__init__``, a forward hook closing over the model) to the copy: deepcopy shares functions,
    so the copy's closures still read the user's model, whose weights the tracers then froze
    into the graph as constants (a ``load_state_dict`` into the converted module was ignored)
    or shared with it. Reached: a module attribute or hook, and two levels into what deepcopy
    copied there (a list, tuple or dict, a ``functools.partial``'s function and arguments, an
    object's attributes). ``memo``: deepcopy's, the user's objects to their copies. Returns
    the rebinding, ``own(value, depth)``, for other functions the copy is given."""
    done: dict = {}
    # what deepcopy made anew (not what it kept: a __deepcopy__ returning itself is the user's)
    copies = {id(v) for k, v in memo.items() if k != id(memo) and k != id(v)}
    cells_of: dict = {}  # the user's closure cells to the copy's: two closures sharing a
    # nonlocal (a pre-hook setting it, a hook reading it) share it in the copy too
    seen: set = set()  # (a container several modules hold, an HF config: walked once)

    def rebind(value):
        if not isinstance(value, types.FunctionType):
            return memo.get(id(value), value) if id(value) != id(memo) else value
        if id(value) in done:
            return done[id(value)]
        # fresh exists before its cells are filled: a recursive function's cell holds itself
        cells = tuple(cells_of.setdefault(id(c), types.CellType()) if _filled(c) else c
                      for c in value.__closure__ or ())
        fresh = types.FunctionType(value.__code__, value.__globals__, value.__name__,
                                   value.__defaults__, cells or None)
        done[id(value)] = fresh
        held = [c.cell_contents if _filled(c) else c for c in value.__closure__ or ()]
        defaults = value.__defaults__ or ()
        keywords = value.__kwdefaults__ or {}
        owned = [rebind(v) if _filled(c) else c for c, v in zip(value.__closure__ or (), held)]
        owned_defaults = tuple(map(rebind, defaults))
        owned_keywords = {k: rebind(v) for k, v in keywords.items()}
        if all(a is b for a, b in zip([*owned, *owned_defaults, *owned_keywords.values()],
                                      [*held, *defaults, *keywords.values()])):
            done[id(value)] = value
            return value
        for cell, c, v in zip(cells, value.__closure__ or (), owned):
            if _filled(c):
                cell.cell_contents = v
        fresh.__defaults__ = owned_defaults or None
        fresh.__kwdefaults__ = owned_keywords or None
        fresh.__qualname__ = value.__qualname__
        fresh.__dict__.update(value.__dict__)
        return fresh

    def own(value, depth):
        """``value`` with the functions in it rebound; what deepcopy copied is changed in place,
        the user's own objects (a ``__deepcopy__`` returning itself) never."""
        if isinstance(value, types.FunctionType):
            return rebind(value)
        if depth == 0 or isinstance(value, (torch.Tensor, torch.nn.Module, type)):
            return value
        if type(value) is functools.partial:  # (a subclass's methods: left as it is)
            parts = [own(value.func, depth - 1), *(own(a, depth - 1) for a in value.args)]
            keywords = {k: own(v, depth - 1) for k, v in value.keywords.items()}
            if all(a is b for a, b in zip([*parts, *keywords.values()],
                                          [value.func, *value.args, *value.keywords.values()])):
                return value
            fresh = functools.partial(*parts, **keywords)
            fresh.__dict__.update(value.__dict__)
            return fresh
        if type(value) is tuple:
            items = tuple(own(v, depth - 1) for v in value)
            return value if all(a is b for a, b in zip(items, value)) else items
        if id(value) not in copies or id(value) in seen or (
                isinstance(value, (list, dict)) and len(value) > _WALKED_ITEMS):
            return value  # (a label map or vocabulary holds no function to rebind)
        seen.add(id(value))
        if isinstance(value, list):
            value[:] = [own(v, depth - 1) for v in value]
        elif isinstance(value, dict):
            for key, v in list(value.items()):
                value[key] = own(v, depth - 1)
        elif isinstance(getattr(value, "__dict__", None), dict):
            store = vars(value)
            for key, v in list(store.items()):
                store[key] = own(v, depth - 1)
        return value

    for module in work.modules():
        if id(module) not in copies:  # (a submodule deepcopy kept: the user's, left alone)
            continue
        store = vars(module)
        for key, value in list(store.items()):  # (hooks: _forward_hooks, ... hold them)
            if not key.startswith(("_parameters", "_buffers", "_modules")):
                store[key] = own(value, 2)
    return own


def keep_parameter_hooks(model: torch.nn.Module, memo: dict, own) -> None:
    """The hooks on ``model``'s parameters that transform or read their gradients
    (``p.register_hook``: per-element clipping, logging), which deepcopy drops, on the copy's
    (a training conversion's float32 masters), rebound as own_closures rebinds: they never
    ran, and the gradients were 55x the clip (probe pA 1). ``register_post_accumulate_grad_hook``
    hooks (an optimizer step in backward) act on the model's own parameters, its optimizers
    keyed by them: not carried (one raised KeyError inside backward), said instead."""
    kept, stepped = 0, []
    for name, p in model.named_parameters():
        mine = memo.get(id(p))
        if mine is None or mine is p:
            continue
        if getattr(p, "_post_accumulate_grad_hooks", None):
            stepped.append(name)
        if not p._backward_hooks or not mine.requires_grad:
            continue  # (a frozen parameter's hook never runs: torch refuses to register it)
        for hook in p._backward_hooks.values():
            mine.register_hook(own(hook, 2))
            kept += 1
    if kept:
        log.info("%d hooks on %s's parameters are kept on the converted module's (they see its "
                 "gradients)", kept, type(model).__name__)
    if stepped:
        warnings.warn(
            f"{len(stepped)} of {type(model).__name__}'s parameters ({', '.join(stepped[:3])}"
            f"{', ...' if len(stepped) > 3 else ''}) have register_post_accumulate_grad_hook "
            "hooks (an optimizer step in backward), which act on the model's own parameters: "
            "the converted module trains its own, so they are not on it. Register them on the "
            "converted module's parameters (converted.named_parameters(), the model's names)",
            UserWarning, stacklevel=4)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # (a closure variable not yet assigned)
        return False
    return True


def distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example with a copy of each tensor that shares its storage with an earlier one
    (``model(x, x)``, attention's ``(q, q, q)``): torch.export takes two arguments that are one
    tensor as one input, and the graph then read the last argument in place of each (a call
    with two different tensors computed from one of them, silently)."""
    seen = set()

    def distinct(t):
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or is_abstract(t) \
                or t.layout != torch.strided:  # (a subclass's storage may be no real one)
            return t
        key = (t.device, t.untyped_storage().data_ptr())
        if key in seen and t.numel():
            return t.clone()
        seen.add(key)
        return t
    return pytree.tree_map(distinct, (args, kwargs))


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer with buffers read as graph values, as parameters are. torch.fx's default
    hands the forward the buffer's tensor itself: whatever is computed from buffers alone is run
    once at trace time and frozen into the graph as a constant (``self.acc * 0.9`` from the
    buffer as it was then; a buffer loaded later is never read), and an in-place op on one
    (``self.acc.mul_(0.9)``) runs once on the trace's copy and is missing from the graph."""

    proxy_buffer_attributes = True

    def __init__(self, whole: bool = False):
        super().__init__()
        self.whole = whole  # torch.nn's composites as leaves: one unknown op each, float32

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # nn.MultiheadAttention as one opaque call would run its softmax in whatever the plan
        # gives the call, and export to ONNX as ops the plan never decided: traced into
        # (torch.export takes it where fx cannot, with the softmax its own float32 op)
        if isinstance(m, torch.nn.MultiheadAttention):
            return False
        # torch.nn's composites the op table does not know as one op (nn.TransformerEncoder,
        # nn.Transformer and their layers) are traced into as well: one opaque call is an
        # unknown op, kept float32 whole with every matmul in it
        if not self.whole and _composite(m):
            return False
        # a parametrized layer (torch.nn.utils.parametrize: weight_norm, orthogonal, ...) as
        # one call stored its originals in the call's dtype and recomputed its weight from them
        # there on every call, which the check simulated in float32 (orthogonal's linalg has
        # no float16 kernel: every call failed, matrix_exp gave NaN): traced into, the
        # parametrization is a call of its own (an unknown op: float32) and the layer's op
        # reads its result through a planned cast, as for a custom module's parametrization
        if torch.nn.utils.parametrize.is_parametrized(m):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root, concrete_args=None):
        self._thread = threading.get_ident()
        self._regions = _AutocastOff()
        # (a trace run with gradients off, a convert inside no_grad, cannot see such regions)
        self._grad_at_start = torch.is_grad_enabled()
        with self._regions.watching():
            return super().trace(root, concrete_args)

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        regions = getattr(self, "_regions", None)
        if regions is not None and regions.region is not None:
            node.meta.setdefault("custom", {})[FP32_REGION] = regions.region
        if getattr(self, "_grad_at_start", False) and not torch.is_grad_enabled() \
                and threading.get_ident() == self._thread and node.op.startswith("call_"):
            # computed inside the forward's no_grad / inference_mode (not a parameter read
            # there first: fx reads it once for the whole graph, and it keeps its gradient)
            node.meta[_GRAD_OFF] = True
        return node

    # torch.fx patches nn.Module for the whole process while it traces: a module another thread
    # runs meanwhile goes through these; it runs as it always does
    def call_module(self, m, forward, args, kwargs):
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


_GRAD_OFF = "mpgraph.grad_off"  # a symbolic trace's node made where the forward turned grad off


def _detach_where_grad_was_off(gm: torch.fx.GraphModule) -> int:
    """The forward's own ``torch.no_grad()`` / ``set_grad_enabled(False)`` / ``inference_mode()``
    regions, which symbolic_trace runs through and records nothing of: each tensor a region
    computes and code outside it reads is read through a ``detach`` (what the region gave it: a
    value no gradient flows back through). Without it, gradients taken through an inference
    conversion flowed into the region (a stop-gradient teacher branch: an input gradient 2.65x
    the model's, pN 1). Not seen: an in-place write inside a region to a value made outside it
    (``h.mul_(2)``), which the graph still differentiates. Returns the number of detaches."""
    count = 0
    for node in list(gm.graph.nodes):
        if not node.meta.pop(_GRAD_OFF, False) or not isinstance(node.meta.get(TENSOR), TensorInfo):
            continue
        outside = [u for u in node.users if not u.meta.get(_GRAD_OFF)]
        if not outside:
            continue
        with gm.graph.inserting_after(node):
            detached = gm.graph.call_method("detach", (node,))
        detached.meta.update({k: v for k, v in node.meta.items() if k != "custom"})
        for user in outside:
            user.replace_input_with(node, detached)
        count += 1
    if count:
        gm.recompile()
    return count


@contextlib.contextmanager
def _inference_regions(seen: list):
    """While torch.export traces: each ``torch.inference_mode()`` the forward enters (as a
    ``with`` or a decorator) appended to ``seen``. torch.export records nothing of it (it keeps
    ``no_grad`` as ``_set_grad_enabled`` calls), so a training conversion would train what the
    model freezes there."""
    cls = torch.autograd.grad_mode.inference_mode
    enter = cls.__enter__
    owner = threading.get_ident()

    def __enter__(self):
        if threading.get_ident() == owner and self.mode and not torch.is_inference_mode_enabled():
            seen.append(_user_frame())
        return enter(self)
    cls.__enter__ = __enter__
    try:
        yield seen
    finally:
        cls.__enter__ = enter


def _user_frame() -> str:
    """file:line of the innermost frame of the model's code (``_model_code``) on the stack."""
    for frame in reversed(traceback.extract_stack()):
        if _model_code(frame.filename):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "the forward"


def _absent_nones(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """The forward's parameters that default to None and that the example leaves out, as
    symbolic_trace's concrete_args: traced as a Proxy, ``if past_key_values is None and ...``
    is always False (a Proxy is not None), so the branch was dropped from the graph where the
    model takes it on other inputs, silently; as None, the trace takes the path the model
    takes, and a call that gives a value is refused (CallSignature)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = set(positional[:len(args)]) | set(kwargs)
    return {p.name: None for p in params if p.default is None and p.name not in given
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _composite(m: torch.nn.Module) -> bool:
    """A torch.nn module of modules that the op table does not know as one op."""
    return type(m).__module__.startswith("torch.nn") and next(m.children(), None) is not None \
        and not isinstance(m, (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)) \
        and not any(klass in MODULE_TABLE for klass in type(m).__mro__)


def _has_composites(model: torch.nn.Module) -> bool:
    return any(_composite(m) for _, m in model.named_modules() if m is not model)


def _symbolic_trace(model: torch.nn.Module, args: tuple = (), kwargs: Optional[dict] = None,
                    whole: bool = False) -> torch.fx.GraphModule:
    # a forward that assigns to a buffer (self.n += 1) leaves the traced value (a Proxy) there:
    # the buffers are put back before the graph module takes its attributes from the model
    buffers = [(m, dict(m._buffers)) for m in model.modules()]
    with _quiet(), opaque_functions("inference"), warnings.catch_warnings():
        # (torch's, from a hooked submodule given proxies: _say_what_hooks_do says what it means)
        warnings.filterwarnings("ignore", "For backward hooks to be called")
        tracer = _Tracer(whole)
        try:
            graph = tracer.trace(model, concrete_args=_absent_nones(model, args, kwargs or {})
                                 or None)
        finally:
            for m, saved in buffers:
                m._buffers.clear()
                m._buffers.update(saved)
        gm = ConvertedModule.wrap(torch.fx.GraphModule(tracer.root, graph,
                                                       type(model).__name__))
        _keep_parametrized(gm, model)
        return gm


def _keep_parametrized(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """The parametrized modules the graph traced into, whole in ``gm`` (the copy's own, with
    the tensors and parametrizations the graph reads): fx left bare modules holding those,
    where ``fast.layer.weight`` read nothing and an assignment to it changed nothing."""
    from torch.nn.utils import parametrize
    kept = []
    for path, m in model.named_modules():
        if not path or not parametrize.is_parametrized(m) \
                or any(path.startswith(p + ".") for p in kept):
            continue
        try:
            gm.get_submodule(path)
        except AttributeError:  # (the graph reads nothing of it)
            continue
        gm.set_submodule(path, m)
        kept.append(path)


def _without_values(args: tuple, kwargs: dict) -> bool:
    """Example inputs on the meta device (or fake): the model cannot show what it computes."""
    return any(is_abstract(t) for t in pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor))


def _parts_from_eager(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple,
                      kwargs: dict, outputs: Optional[list] = None) -> Optional[str]:
    """How the traced graph differs from the model on the example inputs (the outputs, their
    structure, the buffers after the run), or None. The graph's side is its recorded run
    (PropagateTensorInfo's Observation); the model runs once, eagerly, seeded the same way.
    The model's outputs are appended to ``outputs`` (the export graph is compared with them)."""
    if _without_values(args, kwargs):
        return None  # no values to compare (a model on the meta device)
    try:
        with torch.no_grad(), seeded(), state_kept(model):
            ran_args, ran_kwargs = fresh(args), fresh(kwargs)
            want = owned(model(*ran_args, **ran_kwargs), model)
            want_buffers = {n: b.clone() for n, b in model.named_buffers()}
    except Exception as e:  # noqa: BLE001 - the export route may do better
        return "running it failed: " + _brief(e)
    if outputs is not None:
        outputs.append(want)
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        given, ran = flat_inputs(gm, args, kwargs), flat_inputs(gm, ran_args, ran_kwargs)
    except Exception as e:  # noqa: BLE001 - (inputs that do not bind here: no such test)
        log.debug("the inputs' writes and reads were not tested: %s", _brief(e))
        given = ran = []
    if given and len(given) == len(places) == len(ran):
        written = mutated_nodes(gm.graph, gm)
        for place, before, after in zip(places, given, ran):
            if isinstance(before, torch.Tensor) and place not in written \
                    and not _same(before, after):
                return (f"the forward writes its input {place.name} in place and the graph does "
                        f"not (fx traces an augmented assignment on an argument, x += y, as "
                        f"x = x + y)")
        ignored = _read_but_ignored(model, args, kwargs, places, given, want)
        if ignored:
            return (f"{ignored} (a branch on isinstance(x, torch.Tensor) or torch.is_tensor(x)? "
                    f"fx's proxies are not tensors, so the trace took the other branch)")
    seen = gm.meta[OBSERVED]
    got = gm.graph.process_outputs(seen.output)  # as gm(...) returns it
    # a buffer the graph does not hold (fx dropped what read it) is as the model had it before
    got_buffers = {n: seen.buffers.get(n, b) for n, b in model.named_buffers()}
    want_leaves, want_spec = pytree.tree_flatten(want)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if want_spec != got_spec or type(want) is not type(got):
        return (f"the model returns {type(want).__name__}, the graph {type(got).__name__} "
                f"({len(want_leaves)} vs {len(got_leaves)} values)")
    for i, (w, g) in enumerate(zip(want_leaves, got_leaves)):
        if not _same(w, g):
            return f"output {i} differs"
    for name, w in want_buffers.items():
        if not _same(w, got_buffers[name]):
            return f"buffer {name} is not updated as the model updates it"
    return None


_EXPORT_TOLERANCE = 1e-4  # relative L2: an export graph runs the model's own ops, kernels aside


def _export_parts(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple, kwargs: dict,
                  eager) -> Optional[str]:
    """How an export graph's outputs differ from the model's on the example inputs, or None.
    ``eager``: the outputs a symbolic attempt's comparison ran the model for (under no_grad),
    or None. Where those differ, or there are none, the model runs in the grad mode the graph
    was traced in: torch.nn's fast paths taken under no_grad only (nn.TransformerEncoder's
    nested tensors) are no difference of the graph's, nor is a branch on
    torch.is_grad_enabled() (_grad_modes_differ)."""
    if _without_values(args, kwargs):
        return None  # no values to compare (a model on the meta device)
    got = gm.graph.process_outputs(gm.meta[OBSERVED].output)
    if eager is not None and _close(eager, got) is None:
        return None
    try:
        with seeded(), state_kept(model):  # (the caller's grad mode, as torch.export traced)
            want = owned(model(*fresh(args), **fresh(kwargs)), model)
    except Exception as e:  # noqa: BLE001 - traced, so it ran there: nothing to compare with
        log.info("the export graph was not compared with the model: %s", _brief(e))
        return None
    parted = _close(want, got)
    if parted is not None:  # the model against itself: one drawing from a random state of its
        # own (a torch.Generator it keeps: noise injection) gives other values on each run
        with seeded(), state_kept(model):
            itself = _close(want, owned(model(*fresh(args), **fresh(kwargs)), model))
        if itself is not None:
            log.info("the export graph was not compared with the model: the model's own runs "
                     "differ (%s)", itself)
            return None
    return parted


def _close(want, got) -> Optional[str]:
    """How the outputs ``got`` differ from ``want`` beyond _EXPORT_TOLERANCE, or None."""
    want, got = leaves(want), leaves(got)
    if len(want) != len(got):
        return f"the model returns {len(want)} values, the graph {len(got)}"
    for i, (w, g) in enumerate(zip(want, got)):
        if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) \
                and w.shape == g.shape and w.dtype == g.dtype \
                and (w.is_floating_point() or w.is_complex()):
            error = relative_l2(g.detach(), w.detach())
            if error > _EXPORT_TOLERANCE:
                return f"output {i} differs ({error:.3g} relative L2)"
        elif not _same(w, g):
            return f"output {i} differs"
    return None


def _read_but_ignored(model: torch.nn.Module, args: tuple, kwargs: dict, places: list,
                      given: list, want) -> Optional[str]:
    """Why a tensor input whose values the traced graph never reads (at most its shape or
    dtype) is one the model's output depends on, or None: an all-ones mask, a unit scale or a
    zero bias in the example hides a branch fx dropped. One eager run with other values in it
    (another with one element changed where the model refuses those), for each such input."""
    for place, value in zip(places, given):
        if not isinstance(value, torch.Tensor) or not value.numel() or is_abstract(value) \
                or any(not _reads_metadata(user) for user in place.users):
            continue
        for other in (_other_values(value), _other_values(value, first_only=True)):
            changed = pytree.tree_map(lambda v: other if v is value else v, (args, kwargs))
            try:
                with torch.no_grad(), seeded(), state_kept(model):
                    got = owned(model(*fresh(changed[0]), **fresh(changed[1])), model)
            except Exception:  # noqa: BLE001 - values it refuses: try fewer changed
                continue
            if not _same_leaves(got, want):
                return (f"the graph ignores input {place.name}, which the model's output depends "
                        f"on")
            break
        else:  # (it refused both: nothing shows the model ignores it as the graph does)
            return (f"the graph ignores input {place.name}, and the model refused other values "
                    f"of it, so it could not be shown to ignore it too")
    return None


# what reads a tensor's shape, dtype or device, not its values
_METADATA_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "get_device", "ndimension", "nelement"})


def _reads_metadata(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return node.args[1] in _METADATA_ATTRIBUTES
    return node.op == "call_method" and node.target in _METADATA_METHODS


def _other_values(t: torch.Tensor, first_only: bool = False) -> torch.Tensor:
    """A tensor like ``t`` with other values: noise added to floats, bools negated, integers
    0 where they were not and 1 where they were (valid indices, a mask turned over); with
    ``first_only``, only its first element changed (a float doubled, or 1 where it was 0)."""
    floating = t.is_floating_point() or t.is_complex()
    if first_only:
        mixed, first = t.clone(), (0,) * t.dim()  # (any strides: a transposed input too)
        # (a float doubled, its sign kept: a scale stays positive)
        mixed[first] = (t[first] * 2 if bool(t[first] != 0) else 1) if floating \
            else _other_values(t[first])
        return mixed
    if floating:
        noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
        return t + noise.to(device=t.device, dtype=t.dtype)
    if t.dtype == torch.bool:
        return ~t
    return (t == 0).to(t.dtype)


def _narrowed(args: tuple, kwargs: dict, dim: int):
    """The inputs with dimension ``dim`` of every tensor that shares the first tensor's size
    there (> 1: a batch, a sequence) cut to 1, or None where there is none."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    size = next((t.shape[dim] for t in tensors if t.dim() > dim), 1)
    if size <= 1:
        return None
    return pytree.tree_map(lambda t: t.narrow(dim, 0, 1).clone() if isinstance(t, torch.Tensor)
                           and t.dim() > dim and t.shape[dim] == size else t, (args, kwargs))


# guards that exclude exactly a size of 1 (and 0): what a run at size 1 can show harmless
_SIZE_ONE = re.compile(r"\.size\(\)\[\d+\] (!= 1|> 1|>= 2)$")


def _waive_harmless_guards(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple,
                           kwargs: dict) -> None:
    """A guard on a size of 1 (batch 1, sequence 1) that the graph computes right without is
    waived: the model run eagerly at that size and the graph run past the guard agree, on the
    example cut to that size and on the variations of it ``_beyond_example`` makes. Such
    guards come from library code that branches on a size of 1 to no effect (transformers'
    mask expansion, the memory format PyTorch's convolution picks); one on a branch of the
    model's that changes the answer stays (if x.shape[0] == 1: ...). ``model`` is capture's
    own copy, whose tensors the graph shares."""
    guard = getattr(gm, EXPORT_GUARD, None)
    if not isinstance(guard, InputGuard) or _without_values(args, kwargs):
        return  # (a model without values cannot show what it computes: its guards stay)
    constant = None
    for dim in (0, 1):
        variant = _narrowed(args, kwargs, dim)
        if variant is None:
            continue
        small_args, small_kwargs = variant
        before = guard.waived
        try:
            failed = [m for m in guard.failures(*flat_inputs(gm, small_args, small_kwargs))
                      if m not in before]
            if not failed or not all(_SIZE_ONE.search(m) for m in failed):
                continue  # (a guard that excludes other sizes than 1 is not tested here)
            guard.waive(failed)
            if constant is None:  # (one pass over the weights, for both dimensions)
                constant = _constant_valued(model)
            with contextlib.closing(_beyond_example(constant, small_args, small_kwargs)) as runs:
                agree = all(_same_leaves(run_kept(model, a, k), gm.graph.process_outputs(
                    run_recording(gm, a, k, lambda node, value: None))) for a, k in runs)
        except Exception as e:  # noqa: BLE001 - the guards stay as they were
            log.debug("guards at size 1 of dimension %d stay: %s", dim, _brief(e))
            guard.waived = before
            guard.waive(())
            continue
        if not agree:
            guard.waived = before
            guard.waive(())
        log.info("%s at size 1 of dimension %d: %s", "; ".join(failed), dim,
                 "waived (the graph computes what the model does there)" if agree
                 else "kept (the model computes something else there)")


_SCALE = 10.0  # how much larger than the example the scaled inputs are


def _constant_valued(model: torch.nn.Module) -> list[tuple[torch.Tensor, float]]:
    """(tensor, its value) for each float parameter and buffer whose elements are all equal."""
    found = []
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and t.numel() and not is_abstract(t):
            lo, hi = torch.aminmax(t.detach())
            if lo == hi:
                found.append((t, float(lo)))
    return found


def _beyond_example(constant: list, args: tuple, kwargs: dict):
    """The inputs a size-1 branch is tested on, each yielded while it runs: the example as it
    is, its float tensors ``_SCALE`` times larger, and the example again with the weights in
    ``constant`` (``_constant_valued``: an untrained bias of zeros, a gain of ones, a
    zero-initialised adapter, fresh batch-norm statistics) set to random values around their
    constant (of its sign), put back exactly afterwards. One sample proves little: a
    branch that adds a zero bias, scales by a gain of one, or clamps at a bound the example does
    not reach agreed on the example alone, and was waived (then a batch-1 call after
    ``load_state_dict`` skipped it, silently)."""
    yield args, kwargs
    if any(isinstance(t, torch.Tensor) and t.is_floating_point()
           for t in pytree.tree_leaves((args, kwargs))):  # (token ids alone: nothing to scale)
        yield pytree.tree_map(lambda t: t * _SCALE if isinstance(t, torch.Tensor)
                              and t.is_floating_point() else t, (args, kwargs))
    generator = torch.Generator().manual_seed(0)
    swapped = []
    try:
        for t, c in constant:
            noise = torch.rand(t.shape, generator=generator, dtype=torch.float32)
            # (zero: values in [-1, 1); c: in [c/2, 3c/2), of c's sign: a variance stays > 0)
            varied = (noise * 2 - 1) if c == 0 else c * (0.5 + noise)
            swapped.append((t, t.data))
            t.data = varied.to(device=t.device, dtype=t.dtype)
        if swapped:  # (trained weights: nothing constant to vary)
            yield args, kwargs
    finally:
        for t, data in swapped:
            t.data = data


def _same_leaves(a, b) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(_same(x, y) for x, y in zip(la, lb))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and \
            torch.allclose(a, b, rtol=1e-4, atol=1e-6, equal_nan=True)
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):  # (its == compares tensors as tuples: ambiguous)
        return all(_same(x, y) for x, y in zip(leaves(a), leaves(b)))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - no plain equality: not the same as far as we can tell
        return False


def _names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):  # nested functions and comprehensions
            names |= _names(const)
    return names


def _calls_in_forward(model: torch.nn.Module, name: Optional[str], *functions) -> Optional[str]:
    """Where a module's own forward (user code, not torch's or transformers') calls one of
    ``functions``, as "file:line: code", or None: found in its bytecode as ``<module>.<name>``
    (torch.autograd.grad, torch.func.vmap, an alias of the module), as a global holding the
    function (``from torch.func import vmap``) or as an attribute of a module such a global
    holds (``torch.compiler.is_compiling``)."""
    import linecache
    modules = (torch, torch.autograd, torch.func)

    def calls(code, glob):
        for ins, value, last in _loads(code, glob):
            if (name is not None and ins.argval == name and (
                    last in ("autograd", "func") or any(last is m for m in modules))) or (
                    value is not None and any(value is f for f in functions)):
                return (ins.positions.lineno if ins.positions else None) or code.co_firstlineno
        for const in code.co_consts:  # nested functions, lambdas and comprehensions
            if hasattr(const, "co_code"):
                line = calls(const, glob)
                if line:
                    return line
        return None

    classes, seen = set(), set()  # (each class and function once: 1000 blocks took 0.4 s)
    for m in model.modules():
        if type(m) in classes or type(m).__module__.startswith(("torch.", "transformers.")):
            continue
        classes.add(type(m))
        # its forward and the user's helpers it calls (a flag read in a helper was missed)
        for function in _forward_and_its_methods(type(m)):
            code = function.__code__
            if code in seen:
                continue
            seen.add(code)
            line = calls(code, function.__globals__)
            if line:
                text = linecache.getline(code.co_filename, line).strip()
                return f"{os.path.basename(code.co_filename)}:{line}: {text}"
    return None


def _loads(code, glob: dict):
    """Each instruction of ``code`` with what it loads where that is known, a global's value or
    an attribute of a module the instruction before loaded (``torch.func.vmap``,
    ``linalg_utils.safe_cholesky``), else None; and what the instruction before loaded (that
    value, or the name it loaded)."""
    import dis
    last = None
    for ins in dis.get_instructions(code):
        value = None
        if ins.opname == "LOAD_GLOBAL":
            value = glob.get(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(last, types.ModuleType):
            value = getattr(last, ins.argval, None)
        yield ins, value, last
        last = value if value is not None else ins.argval


def _helpers(code, klass: type, glob: dict) -> list:
    """The user's functions a forward's ``code`` names: methods of its class loaded as
    attributes, functions of the user's modules loaded as globals or as attributes of a module
    (``import linalg_utils; linalg_utils.safe_cholesky(a)``), not torch's or transformers',
    unwrapped from their decorators."""
    found = []
    for ins, value, _ in _loads(code, glob):
        if value is None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            value = inspect.getattr_static(klass, ins.argval, None) \
                if isinstance(ins.argval, str) else None
            value = getattr(value, "__func__", value)  # (static and class methods)
        elif ins.opname not in ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD"):
            continue
        if isinstance(value, types.FunctionType) and not (value.__module__ or "").startswith(
                ("torch", "transformers")):
            found.append(inspect.unwrap(value))
    return found


def _untraceable(model: torch.nn.Module) -> Optional[dict]:
    """The report for a call in the forward that no tracer captures as one forward graph, if
    there is one (the tracers' reports then quote torch's internals, not the cause)."""
    where = _calls_in_forward(model, "grad", torch.autograd.grad)
    if where:
        return {"torch.autograd.grad": (
            f"{type(model).__name__}'s forward calls torch.autograd.grad ({where}): a gradient "
            "taken inside the forward is a backward pass, which no tracer captures as part of a "
            "forward graph")}
    where = _calls_in_forward(model, "vmap", torch.vmap, torch.func.vmap)
    if where:
        return {"torch.vmap": (
            f"{type(model).__name__}'s forward calls torch.vmap ({where}): a vmapped "
            "function (functional_call over stacked parameters) is not captured as one graph "
            "mpgraph can plan")}
    return None


def _rebound_buffers(model: torch.nn.Module, args: tuple, kwargs: dict, state: dict
                     ) -> Optional[dict]:
    """The report for a buffer the forward rebinds in a way no graph writes back, if there is
    one (the tracers' reports then quote torch's internals, not the cause): ``self.ema.data =
    ...`` (torch.export lifts the new value as a constant), or a buffer given a new shape on
    every call (``self.kc = torch.cat([self.kc, k], 1)``: the graph writes it back into the old
    one). One eager run, on the failure path only; the buffers are put back after it, and
    what it changes of ``state`` (``_python_state``: a table a global holds, built from the
    example's length, failed the user's model on another length)."""
    before = [(path, m, name, b, b.data, tuple(b.shape)) for path, m in model.named_modules()
              for name, b in m._buffers.items() if b is not None]
    try:
        run_kept(model, args, kwargs)
    except Exception:  # noqa: BLE001 - the tracers' reports say what failed
        return None
    finally:
        after = {(id(m), name): (m._buffers.get(name), b.data_ptr())
                 for _, m, name, b, *_ in before}
        _rebind([(m, name, b, data) for _, m, name, b, data, _ in before])
        _changed_state(model, state)
    for path, m, name, b, data, shape in before:
        (now, ptr), attr = after[(id(m), name)], f"self.{name}"
        buffer = f"buffer {path + '.' if path else ''}{name}"
        if now is b and ptr != data.data_ptr():
            return {buffer: (
                f"{type(m).__name__}'s forward assigns {attr}.data"
                f"{_line_in_forward(m, f'{attr}.data =')}: a write through .data is not an op, "
                "so no graph records it")}
        if isinstance(now, torch.Tensor) and tuple(now.shape) != shape:
            line = _line_in_forward(m, f'{attr} =')
            if not _grows_again(model, args, kwargs, state, m, name):
                return {buffer: (
                    f"{type(m).__name__}'s forward grows it once, on its first call, {shape} -> "
                    f"{tuple(now.shape)}{line}, and keeps it: each traced call would grow it "
                    "again from the shape it was captured with")}
            return {buffer: (
                f"{type(m).__name__}'s forward gives it a new shape on every call, {shape} -> "
                f"{tuple(now.shape)}{line}: a graph writes a buffer back in its shape")}
    return None


def _buffer_bindings(model: torch.nn.Module) -> list:
    return [(m, name, b, b.data) for m in model.modules()
            for name, b in m._buffers.items() if b is not None]


def _rebind(bindings: list) -> None:
    """Each buffer back in its place with its values (a forward that rebinds one, ``self.pe =
    table(T)``, is not undone by state_kept)."""
    for m, name, b, data in bindings:
        b.data = data
        m._buffers[name] = b


def _grows_again(model, args, kwargs, state, module, name) -> bool:
    """Whether a second call gives the buffer a new shape again (``torch.cat`` onto it every
    call), not only the first (a table built at the first call's length)."""
    bindings = _buffer_bindings(model)
    try:  # (run_kept puts values back, not a rebound buffer: the second run starts grown)
        run_kept(model, args, kwargs)
        shape = tuple(module._buffers[name].shape)
        run_kept(model, args, kwargs)
        return tuple(module._buffers[name].shape) != shape
    except Exception:  # noqa: BLE001 - the first run said it grows: as before
        return True
    finally:
        _rebind(bindings)
        _changed_state(model, state)


def _line_in_forward(module: torch.nn.Module, text: str) -> str:
    """" (file:line: code)" of the first line of the module's forward that holds ``text``
    (spaces aside), else ""."""
    try:
        lines, first = inspect.getsourcelines(type(module).forward)
        file = os.path.basename(inspect.getsourcefile(type(module).forward) or "")
    except (OSError, TypeError):
        return ""
    for i, line in enumerate(lines):
        if text.replace(" ", "") in line.replace(" ", ""):
            return f" ({file}:{first + i}: {line.strip()})"
    return ""


def _tracing_flags() -> tuple:
    """The functions that tell a forward it is being traced: True under torch.export (and
    is_fx_tracing under torch.fx too), False when the model runs eagerly."""
    found = [getattr(m, f, None) for m, f in (
        (torch.compiler, "is_compiling"), (torch.compiler, "is_exporting"),
        (torch._dynamo, "is_compiling"), (torch._dynamo.external_utils, "is_compiling"),
        (torch._utils, "is_compiling"), (torch.fx._symbolic_trace, "is_fx_tracing"))]
    hf = sys.modules.get("transformers.utils.import_utils")
    if hf is not None:
        found += [getattr(hf, "is_torchdynamo_compiling", None),
                  getattr(hf, "is_torchdynamo_exporting", None)]
    return tuple(f for f in found if f is not None)


@contextlib.contextmanager
def _mha_fastpath(enabled: bool):
    """torch.nn.MultiheadAttention's/TransformerEncoder's inference fast path switched."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


_GRAD_MODES = {"grad": lambda: torch.enable_grad(), "no_grad": lambda: torch.no_grad(),
               "inference_mode": lambda: torch.inference_mode()}


def _grad_modes_differ(work: torch.nn.Module, args: tuple, kwargs: dict, state: dict
                       ) -> Optional[tuple]:
    """Where a forward of the user's branches on the grad mode (torch.is_grad_enabled(),
    torch.is_inference_mode_enabled()), which any captured graph keeps as it was at capture:
    (that line, the mode at capture, the other modes in which the model computes other values
    on the example inputs), for the converted module to refuse calls in those; else None (a
    branch that computes the same either way: gradient checkpointing). One eager run per mode,
    for such forwards only; what they change of ``state`` (``_python_state``) is put back."""
    where = _calls_in_forward(work, None, torch.is_grad_enabled, torch.is_inference_mode_enabled)
    if where is None or _without_values(args, kwargs):
        return None  # (a model without values cannot show what it computes: nothing to tell)
    captured = grad_mode()
    outputs = {}
    for mode in [captured] + [m for m in _GRAD_MODES if m != captured]:
        try:  # (torch.nn's own no_grad-only fast path, nested tensors in nn.TransformerEncoder,
            # off: its padding differs from the graph's in every mode, no branch of the model's)
            with seeded(), state_kept(work), _GRAD_MODES[mode](), _mha_fastpath(False):
                out = work(*fresh(args), **fresh(kwargs))
                outputs[mode] = pytree.tree_map(
                    lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, out)
        except Exception as e:  # noqa: BLE001 - that mode is not told apart
            log.info("%s: the model was not run under %s: %s", where, mode, _brief(e))
        finally:
            _changed_state(work, state)
    if captured not in outputs:
        return None
    differ = tuple(m for m, out in outputs.items()
                   if m != captured and _close(outputs[captured], out) is not None)
    return (where, captured, differ) if differ else None


def reads_training(model: torch.nn.Module) -> list[str]:
    """Paths of the modules whose own forward (user code: not torch's or transformers', whose
    dropout and batch norm the converted module follows) reads ``self.training``: a Python
    branch on it is fixed in any captured graph."""
    out = []
    for path, m in model.named_modules():
        forward = getattr(type(m), "forward", None)
        code = getattr(forward, "__code__", None)
        if code is None or type(m).__module__.startswith(("torch.", "transformers.")):
            continue
        if "training" in _names(code):
            out.append(path or type(model).__name__)
    return out


_FORWARD = ("_forward_hooks", "_forward_pre_hooks")
_BACKWARD = ("_backward_hooks", "_backward_pre_hooks")


def _users_hooks(module: torch.nn.Module, kinds: tuple = _FORWARD + _BACKWARD) -> list:
    """The hooks on a module, but those transformers installs itself on its first call to
    collect hidden states and attentions (what the traced forward returns anyway)."""
    hooks = [hook for kind in kinds for hook in getattr(module, kind).values()]
    return [h for h in hooks if not (getattr(h, "__module__", None) or "").startswith(
        "transformers.utils.output_capturing")]


def _say_where_exceptions_are_caught(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """A try/except in a user forward the graph traced through is a Python branch no tracer
    sees: the graph holds the path the example inputs took, and an input for which the model
    takes the other one gets the traced path (torch's own error where the model caught it: a
    safe cholesky's fallback). Said, naming the line; a warning, as most handlers never fire."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    found = []
    for path, m in model.named_modules():
        if type(m).__module__.startswith(("torch.", "transformers.")) \
                or any(path == c or path.startswith(c + ".") for c in called):
            continue
        for function in _forward_and_its_methods(type(m)):
            where = _caught_in(function)
            if where:
                found.append(f"{where} (in the {function.__name__} of "
                             f"{path or type(model).__name__})")
    if found:
        warnings.warn(
            f"{type(model).__name__}'s forward catches exceptions: {'; '.join(found[:3])}. The "
            "converted graph holds the path the example inputs took, on every input: where the "
            "model would take the other branch, the converted module does not (it computes the "
            "traced one, or raises the error the model caught). Compute such a fallback with "
            "tensors (torch.linalg.cholesky_ex and torch.where, torch.cond), or keep that part "
            "out of the graph: convert the parts before and after it", UserWarning, stacklevel=5)


def _forward_and_its_methods(cls: type) -> list:
    """A class's forward, decorators unwrapped (a ``functools.wraps`` decorator's own code is
    not the user's), and the user's functions it calls, two calls deep (``_helpers``: methods
    of the class, ``self._safe(x)``, and functions of the user's modules, a module-level
    ``safe_cholesky(a)``): the user code a trace of the forward ran through."""
    try:
        forward = inspect.unwrap(getattr(cls, "forward", None))
    except ValueError:  # (a cycle of __wrapped__)
        return []
    if getattr(forward, "__code__", None) is None:
        return []
    found, todo = [forward], [(forward, 0)]
    while todo:
        function, depth = todo.pop(0)
        if depth >= 2:
            continue
        for helper in _helpers(function.__code__, cls, getattr(function, "__globals__", {})):
            if helper not in found and getattr(helper, "__code__", None) is not None:
                found.append(helper)
                todo.append((helper, depth + 1))
    return found


def _caught_in(function) -> Optional[str]:
    """The first ``try`` in a function's source with a fallback for the input's values, as
    "file:line: try:", or None (no source). Not such a fallback: a ``try`` whose body only
    imports, besides setting or returning constants (an optional kernel's probe, ``import apex;
    return True``: the environment decides, alike on every input); handlers of ImportError or
    of a lookup miss alone (a memo's ``except KeyError: build it``, whose two paths compute
    the same); a handler that always raises (its last statement is a ``raise`` and it has no
    ``return``, ``break``, ``continue`` or ``yield``), which computes no other path: it fails,
    as the converted module would. A handler that returns before its ``raise`` (``if
    self.jitter: return ...``) is a fallback."""
    import ast
    import textwrap
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    imports = {"ImportError", "ModuleNotFoundError", "KeyError", "AttributeError", "LookupError"}

    def probes(statement) -> bool:
        """An import, or a statement that cannot raise (``return True``, ``HAVE_APEX = True``,
        ``pass``): a body of these only raises on what the environment has installed."""
        if isinstance(statement, (ast.Import, ast.ImportFrom, ast.Pass)):
            return True
        if isinstance(statement, ast.Return):
            return isinstance(statement.value, (ast.Constant, type(None)))
        if isinstance(statement, ast.Assign):
            return isinstance(statement.value, ast.Constant) and all(
                isinstance(target, ast.Name) for target in statement.targets)
        return False

    def falls_back(handler) -> bool:
        caught = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
        if {getattr(n, "id", None) for n in caught} <= imports:
            return False
        leaves = (ast.Return, ast.Break, ast.Continue, ast.Yield, ast.YieldFrom)
        always_raises = isinstance(handler.body[-1], ast.Raise) and not any(
            isinstance(n, leaves) for statement in handler.body for n in ast.walk(statement))
        return not always_raises

    for node in ast.walk(tree):
        if not isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            continue
        if all(probes(statement) for statement in node.body):
            continue
        if any(falls_back(h) for h in node.handlers):
            code = function.__code__
            return (f"{os.path.basename(code.co_filename)}:"
                    f"{code.co_firstlineno + node.lineno - 1}: try:")
    return None


def _say_what_hooks_do(gm: torch.fx.GraphModule, model: torch.nn.Module, train: bool) -> None:
    """Forward hooks on modules the graph does not call ran while the model was traced: what
    they compute is in the graph, but they do not run again (a hook that appends to a list,
    counts calls or prints did so at conversion only). That is said, once. Backward hooks ran
    not at all: the model's own are kept on the converted module (keep_backward_hooks), but a
    submodule's have no module call left to run on, so gradients would differ from the
    model's: an error in a training conversion, a warning in an inference one."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    inlined = [(path, m) for path, m in model.named_modules()
               if not any(path == c or path.startswith(c + ".") for c in called)]
    hooked = [path or type(model).__name__ for path, m in inlined if _users_hooks(m, _FORWARD)]
    dropped = [f"{getattr(h, '__name__', None) or type(h).__name__} on {path!r} "
               f"({type(m).__name__})" for path, m in inlined if path
               for h in _users_hooks(m, _BACKWARD)]
    if dropped:
        text = (f"backward hook{'s' if len(dropped) > 1 else ''} {', '.join(dropped[:3])}"
                f"{' ...' if len(dropped) > 3 else ''} of {type(model).__name__} "
                f"{'are' if len(dropped) > 1 else 'is'} not in the converted graph: "
                f"{'torch.export inlines every submodule' if train else 'fx traced through it'}"
                ", so no module call is left to run it on, and gradients through the converted "
                "module are not changed by it")
        if train:
            raise CaptureError({"backward hooks": text})
        warnings.warn(text + ". Keep that submodule out of the converted graph (convert the "
                      "parts before and after it and call it, hooked, from your own forward), "
                      "or register the hook on the model itself (the model's own backward hooks "
                      "are kept on the converted module)", UserWarning, stacklevel=5)
    fast_path = [path for path, m in model.named_modules()
                 if isinstance(m, torch.nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False)
                 and not any(path == c or path.startswith(c + ".") for c in called)]
    if fast_path:
        warnings.warn(f"{', '.join(p or type(model).__name__ for p in fast_path[:3])} "
                      "(nn.TransformerEncoder, enable_nested_tensor) runs PyTorch's nested-tensor "
                      "fast path in eval under no_grad when given a src_key_padding_mask, which "
                      "gives 0 at padded positions; the converted graph computes the standard "
                      "path, whose values there are not 0 "
                      "(real positions agree). Build it with enable_nested_tensor=False to compare "
                      "outputs whole", UserWarning, stacklevel=5)
    if hooked:
        warnings.warn(f"forward hooks on {', '.join(hooked[:5])}"
                      f"{' ...' if len(hooked) > 5 else ''} of "
                      f"{type(model).__name__} ran while it was traced: what they compute is in "
                      "the converted graph, but they do not run on its calls (their Python side "
                      "effects, such as appending to a list, happened at conversion only)",
                      UserWarning, stacklevel=5)


def _keep_persistence(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """The model's non-persistent buffers (HF's position_ids) stay out of the graph module's
    state dict (torch.export registers every buffer as persistent), nor do the constants
    torch.export lifts out of the forward (Falcon's ``lifted_tensor_0``): its keys are the
    model's."""
    gone = {f"{prefix}{'.' if prefix else ''}{name}" for prefix, m in model.named_modules()
            for name in m._non_persistent_buffers_set}
    model_buffers = {path for path, _ in model.named_buffers(remove_duplicate=False)}
    for path, _ in list(gm.named_buffers()):
        if path in gone or path not in model_buffers:
            owner_path, _, leaf = path.rpartition(".")
            gm.get_submodule(owner_path)._non_persistent_buffers_set.add(leaf)


# what every nn.Module has in its __dict__ (its parameters, buffers, submodules, hooks, flag)
_MODULE_STATE = frozenset(vars(torch.nn.Module()))


# what torch.fx sets on the traced module for a tensor the forward makes (its constants)
_FX_CONSTANT = re.compile(r"_tensor_constant\d+$")


# what a symbolic trace says when the forward wrote a parameter or buffer while fx traced it
_WROTE_AT_TRACE = ("the forward wrote a parameter or buffer while fx traced it (a write fx "
                   "does not record, such as p.clamp_(...) over self.parameters()): the graph "
                   "would never make it")


def _stamp(t: torch.Tensor):
    """A tensor's version counter and, where it holds values, a checksum of its bits (a write
    through ``.data``, ``p.data.clamp_(...)``, bumps no counter). The bits summed as int64
    words: exact, NaN-proof, and as fast as a float32 sum (a float64 sum of a 2 GB model's
    weights cost 9 s of its conversion)."""
    if t.is_meta or is_abstract(t) or not (t.is_floating_point() or t.is_complex()):
        return t._version
    flat = t.detach().reshape(-1).view(torch.uint8)
    try:
        return t._version, int(flat.view(torch.int64).sum())
    except RuntimeError:  # (a size or offset not a whole number of 8-byte words)
        return t._version, int(flat.sum(dtype=torch.int64)), int(flat[1::2].sum(dtype=torch.int64))


def _versions(model: torch.nn.Module) -> tuple[dict, list]:
    """What a write to the model's parameters and buffers changes, by name, and to the tensors
    it keeps as plain attributes (``self.mem = torch.zeros(d)``: fx reads those as constants,
    runs a write into one, ``self.mem.mul_(0.5)``, at trace time, and records none of it), by
    tensor: one the forward replaces (``self.last = h.detach()``) was not written. One pass
    over the weights, for symbolic traces only."""
    named = {name: _stamp(t) for name, t in (*model.named_parameters(), *model.named_buffers())}
    plain = [(t, _stamp(t)) for m in model.modules() for t in vars(m).values()
             if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)]
    return named, plain


def _wrote_at_trace(before: tuple, model: torch.nn.Module) -> bool:
    """Whether a parameter, buffer or plain tensor attribute recorded in ``before``
    (``_versions``) was written since; a plain one only if the same tensor is still held."""
    named, plain = _versions(model)
    now = {id(t): stamp for t, stamp in plain}
    return named != before[0] or any(id(t) in now and now[id(t)] != was for t, was in before[1])


def _writes_constant(gm: torch.fx.GraphModule) -> Optional[str]:
    """Why a symbolic trace is not the model when its forward writes in place into a tensor it
    makes at a fixed size (``counts = torch.zeros(4)``, then ``counts.scatter_add_(...)``,
    ``out[idx] = h``, ``acc += h``): fx made that tensor once, at trace time, and every call
    would write into the one copy, the results piling up from call to call (the first call,
    all a comparison sees, is right). torch.export makes it afresh in each call."""
    written = set(mutated_nodes(gm.graph, gm))
    for node in gm.graph.nodes:  # (item assignment: fx's __setitem__, out[idx] = h)
        if node.op in ("call_method", "call_function") and node.args \
                and node.target in ("__setitem__", operator.setitem):
            target = node.args[0]
            while isinstance(target, torch.fx.Node):
                written.add(target)
                target = target.args[0] if is_view(target) and target.args else None
    written = sorted({n.target for n in written
                      if n.op == "get_attr" and _FX_CONSTANT.search(str(n.target))})
    if not written:
        return None
    return ("it writes in place into a tensor the forward makes at a fixed size "
            f"({', '.join(written)}), which fx would make once for every call")


class _State(dict):
    """``_python_state``: the attributes by (module path, name); ``globals``, the namespaces of
    the user's module classes' code as (namespace, copy of it, ``_held``'s copy of it)."""
    globals: list


def _python_state(model: torch.nn.Module) -> dict:
    """Each module's own Python attributes (``self.step``, ``self.initialised``, ``self.cache``),
    with a copy of the lists, dicts and sets among them, and the module globals its code may
    assign (``global STEP; STEP += 1``): what a forward may change that no graph records."""
    state = _State({where: (value, _contents(value)) for where, value in _user_attributes(model)})
    names = [(namespace, _own_names(namespace)) for namespace in _user_namespaces(model)]
    state.globals = [(namespace, own, _held(own)) for namespace, own in names]
    return state


# a dict or list global of more items is not looked into: a dataset or a vocabulary, not a memo
# a forward fills (copying and comparing a 2M-item list at each of conversion's runs made a
# conversion 50x slower: 0.05 s to 3 s)
_HELD_ITEMS = 100_000


def _held(names: dict) -> dict:
    """What a forward may change inside a global without rebinding it: a copy of each dict's
    and list's items (a per-length memo ``_CACHE[n] = table``) and each ``functools.lru_cache``
    function's count of computed results. A tracer's run fills them with its traced values (torch.export's
    FakeTensors), which the user's model then returned on its later calls."""
    held = {}
    for key, value in names.items():
        if type(value) in (dict, list):
            if len(value) <= _HELD_ITEMS:
                held[key] = copy.copy(value)
        elif _cache_fills(value) is not None:
            held[key] = _cache_fills(value)
    return held


def _cache_fills(value) -> Optional[int]:
    """How many results a ``functools.lru_cache`` (``functools.cache``) function has computed
    (its misses: a full bounded cache evicts one for each, its size unchanged), else None."""
    if inspect.ismodule(value) or not callable(getattr(value, "cache_clear", None)):
        return None
    try:
        fills = value.cache_info().misses
    except Exception:  # noqa: BLE001 - not functools' cache_info
        return None
    return fills if isinstance(fills, int) else None


def _new_items(old, value) -> list:
    """The items of a dict or list ``value`` (keys and values) that its copy ``old`` lacks."""
    if len(value) == len(old) and (  # (unchanged, at C speed: a vocabulary list of millions)
            all(map(operator.is_, value, old)) if isinstance(value, list) else
            value.keys() == old.keys() and all(map(operator.is_, value.values(), old.values()))):
        return []
    if isinstance(value, dict):
        return [(k, v) for k, v in value.items() if k not in old or old[k] is not v]
    known = len(old)
    return [v for i, v in enumerate(value) if i >= known or old[i] is not v]


_ABSENT = object()


def _user_namespaces(model: torch.nn.Module) -> list:
    """The module namespaces (``__globals__``) of the methods of the user's module classes (not
    torch's or transformers'), decorators unwrapped: where the forward, or a helper function of
    its module it calls (``bump()``), assigns a global. A snapshot of names, not a bytecode scan
    of the methods (which missed both)."""
    found = {}
    for kind in {type(m) for m in model.modules()}:
        for cls in kind.__mro__:
            if cls.__module__.startswith(("torch.", "transformers.", "builtins")):
                continue
            for function in vars(cls).values():
                try:
                    function = inspect.unwrap(getattr(function, "__func__", function))
                except ValueError:  # (a cycle of __wrapped__)
                    continue
                namespace = getattr(function, "__globals__", None)
                if isinstance(namespace, dict) and not str(namespace.get("__name__", "")) \
                        .startswith(("torch.", "transformers.")):
                    found[id(namespace)] = namespace
    return list(found.values())


# The names torch.compile installs in a compiled function's module globals, which its compiled
# code reads back (torch/_dynamo: OutputGraph.install_global and install_global_by_id, whose
# names end in _<id>_c<compile id>, unique_id's resume and comprehension functions, import
# aliases, codegen's ___module_ and the resume code's ___context_manager_)
_COMPILE_NAMES = re.compile(
    r"__(compiled_fn|resume_at|builtins_dict__|import_|gen_rand_values|warnings_warn_wrapper"
    r"|comprehension_|subclass_|optimizer_)|___|.*_\d+_c\d+$")


def _own_names(namespace: dict) -> dict:
    """A module's globals, shallow, without its dunders (``__warningregistry__``, which a
    warning adds) and what torch.compile installs there for a compiled function the forward
    calls (``__compiled_fn_1_...``, ``__builtins_dict___0``: put back as absent, the user's
    model failed with a NameError after conversion). A global of the user's named ``__calls``
    is the user's (every name starting with "__" was left out: changed unsaid)."""
    return {k: v for k, v in namespace.items()
            if not (k.startswith("__") and k.endswith("__")) and not _COMPILE_NAMES.match(k)}


def _user_attributes(model: torch.nn.Module):
    """((module path, name), value) of each attribute ``_users_state`` counts."""
    return (((path, key), value) for path, m in model.named_modules()
            for key, value in vars(m).items() if _users_state(m, key, value))


def _contents(value):
    """What a forward may change inside an attribute's value: a list's, dict's or set's items,
    a plain object's attributes (``self.sched.step += 1``); None for anything else."""
    if type(value) in (list, dict, set):
        return copy.copy(value)
    if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)) \
            and not inspect.isroutine(value) and not inspect.ismodule(value) \
            and type(value).__module__.split(".")[0] not in ("torch", "transformers", "numpy"):
        return dict(vars(value))
    return None


def _users_state(module: torch.nn.Module, key: str, value) -> bool:
    """Whether ``module.key`` is state of the user's (``self.step``, ``self._cache``) in a
    module of the user's: not what every module has, fx's constants, methods, or anything of
    torch's and transformers' own modules (nn.RNN's ``_flat_weights``, Swin's window size set
    again on every call, transformers' hooks installed on the first)."""
    if type(module).__module__.startswith(("torch.", "transformers.")):
        return False  # (their forwards keep no state of that kind: Swin's window size, ...)
    return not (key in _MODULE_STATE or _FX_CONSTANT.match(key) or key in _set_by_hooks(module)
                or (callable(value) and not isinstance(value, (torch.Tensor, torch.fx.Proxy))))


def _changed_state(model: torch.nn.Module, before: dict, restore: bool = True,
                   traced: bool = False) -> list[str]:
    """The attributes a run of the forward changed (set, rebound, added to, deleted), put back
    as they were (``restore``): each tracer runs the forward, and the next one must see the
    model unchanged (a Proxy fx left on ``self.running`` failed torch.export after it).
    ``traced``: the run was a tracer's, where a global's first-call state may be kept."""
    now = dict(_user_attributes(model))
    changed = []
    for (path, key), value in now.items():
        name = f"self.{path + '.' if path else ''}{key}"
        if (path, key) not in before:
            changed.append(f"{name} (set to {_brief_value(value)})")
            if restore:
                delattr(model.get_submodule(path), key)
            continue
        old, content = before[(path, key)]
        # (torch.export's own snapshot rebuilds containers: a dict equal item for item is kept)
        rebuilt = type(value) is type(old) and isinstance(old, (list, tuple, dict, set)) and \
            not _differ(content if content is not None else old, value)
        same = isinstance(old, (bool, int, float, str)) and type(_plain(value)) is type(old) \
            and _plain(value) == old  # (a SymInt standing for the same number)
        if value is not old and not rebuilt and not same:
            changed.append(f"{name} ({_brief_value(old)} -> {_brief_value(value)})")
        elif content is not None and _differ(content, _contents(value)):
            changed.append(f"{name} (its items changed)")
        else:
            continue
        if restore:
            if content is not None and type(old) not in (list, dict, set):
                vars(old).clear()
                vars(old).update(content)  # (a plain object: its attributes as they were)
                setattr(model.get_submodule(path), key, old)
            else:
                setattr(model.get_submodule(path), key,
                        copy.copy(content) if content is not None else old)
    for (path, key), (old, content) in before.items():
        if (path, key) not in now:
            changed.append(f"self.{path + '.' if path else ''}{key} (deleted)")
            if restore:
                setattr(model.get_submodule(path), key, old)
    for namespace, names, held in getattr(before, "globals", ()):
        now_names = _own_names(namespace)
        for key in names.keys() | now_names.keys():
            old, value = names.get(key, _ABSENT), now_names.get(key, _ABSENT)
            if value is old and key in held:
                changed.extend(_changed_inside(key, value, held, restore, traced))
                continue
            if value is old or (type(value) is type(old) and not _differ(value, old)):
                continue
            if traced and _first_call_state(old, value):
                # (left as the forward set it, as its first call would: a lookup table a
                # custom op's kernel reads was put back to None, and the graph failed on it).
                # Only a tracer's run tells: there a value made from the inputs is a traced
                # one. The eager runs come after it, where such state is set already: what
                # one sets (_LAST = h.detach(), a plain tensor there) is the inputs' (kept,
                # it held the example's activation). The state conversion leaves from now on:
                names[key] = value
                held.update(_held({key: value}))
                log.info("the forward set global %s on its first call: kept", key)
                continue
            changed.append(f"global {key} ({_brief_value(old)} -> {_brief_value(value)})")
            if restore:
                if old is _ABSENT:
                    namespace.pop(key, None)
                else:
                    namespace[key] = old
    return changed


def _changed_inside(key: str, value, held: dict, restore: bool, traced: bool) -> list[str]:
    """A global dict or list the run changed in place, or an lru_cache function it filled
    (``held``: ``_held``'s copy): where a tracer's run left its traced values there, the dict
    or list is put back (said, as a global rebound to them is) and the cache cleared (unsaid: it
    computes its values again on the next call). Other contents, a constant table memoised
    once, are kept as the model's first call leaves them."""
    if type(value) not in (dict, list):  # (an lru_cache: how many results it computed)
        fills = _cache_fills(value) or 0
        if traced and restore and fills > held[key]:
            value.cache_clear()  # (what it cached under the tracer: fake tensors, Proxies)
            log.info("the forward filled the cache of %s under a tracer: cleared", key)
        if restore:
            held[key] = _cache_fills(value) or 0
        return []
    old = held[key]
    new = _new_items(old, value)
    if not new and len(value) == len(old):
        return []
    if not (traced and _traced(new)):
        held[key] = copy.copy(value)  # (the state conversion leaves from now on)
        return []
    if restore:
        value.clear()
        if isinstance(value, dict):
            value.update(old)
        else:
            value.extend(old)
    return [f"global {key} (its items changed to traced values)"]


def _first_call_state(old, value) -> bool:
    """Whether a global went from "not yet" (None, False, unset) to a value the tracers did not
    make: a warn-once flag, a lazily built cache, as the model's first call would set it (said,
    it advised a buffer for a warn-once flag). A value made from the traced inputs
    (``LAST_ATTN = a.detach()`` on every call) is no such state."""
    return (old is None or old is False or old is _ABSENT) and not _traced(value)


def _traced(value) -> bool:
    """Whether a tracer made the value, or an item of it, from the traced inputs: an fx Proxy,
    torch.export's fake or functional tensors and symbolic sizes, also inside a tuple, list or
    dict (``_ROPE = (f.cos(), f.sin())`` was kept holding fx's Proxies: the user's model then
    returned a Proxy, and torch.export failed on them)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    made = (torch.fx.Proxy, FakeTensor, FunctionalTensor, torch.SymInt, torch.SymFloat,
            torch.SymBool)
    return any(isinstance(leaf, made) for leaf in pytree.tree_leaves(value))


def _set_by_hooks(module: torch.nn.Module) -> set:
    """What torch's weight_norm/spectral_norm pre-hooks set on every call (``weight``)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    return {hook.name for hook in module._forward_pre_hooks.values()
            if isinstance(hook, (WeightNorm, SpectralNorm))}


def _say_what_state_changes(model: torch.nn.Module, changed: list[str]) -> None:
    """A graph neither keeps the model's Python attributes nor reads them again: what the
    forward computes from one it changes (a step counter, a flag set by a first-call
    initialisation) is frozen at its value when traced. Said, once; a cache the forward fills
    the same way each call (rotary tables, a recorded shape) is harmless."""
    # each name once, as the first run changed it (a tracer's: the eager runs after it set
    # the same global from the example, "a traced value" then "a tensor (2, 16)")
    shown = sorted({c.split(" (")[0]: c for c in reversed(changed)}.values())
    what = " and ".join(w for w, said in (
        ("its Python attributes", any(c.startswith("self.") for c in shown)),
        ("module globals", any(c.startswith("global ") for c in shown))) if said)
    warnings.warn(f"{type(model).__name__}'s forward changes {what}: "
                  f"{', '.join(shown[:5])}{' ...' if len(shown) > 5 else ''}. The converted graph "
                  "neither keeps nor reads them again: it computes with their values when it was "
                  "traced, so a counter or a first-call initialisation does not go on as in the "
                  "model. Keep such state in a buffer (register_buffer: the graph updates it), "
                  "or run the model once before converting; a cache filled the same way on every "
                  "call is harmless", UserWarning, stacklevel=5)


def _differ(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:  # (items that compare as tensors do)
        return True


def _plain(value):
    """A symbolic number torch.export traced (SymInt) as the number it stands for."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = getattr(value.node, "hint", None)
        return hint if hint is not None else value
    return value


def _brief_value(value) -> str:
    if value is _ABSENT:
        return "unset"
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, torch.fx.Proxy):
        return "a traced value"
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)}"
    if not pytree.tree_is_leaf(value) and _traced(value):
        return f"a {type(value).__name__} of traced values"
    return f"a {type(value).__name__}"


def _keep_aliases(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """A submodule the model holds under two names (``self.alias = self.fc``,
    ``nn.ModuleList([block] * 3)``) is held under both in the graph module too: its state dict
    then has the model's keys (the tracers name each module once, and a load of the model's
    state dict failed on the other name's keys). The names go in ``MODULE_ALIASES``: an override
    by either covers the module's nodes, recorded under the first (pM 6)."""
    first = {id(m): path for path, m in model.named_modules()}
    have = dict(gm.named_modules(remove_duplicate=False))
    aliases: list = []
    for path, m in model.named_modules(remove_duplicate=False):
        if path and first[id(m)] != path and not any(path.startswith(a + ".") for a, _ in aliases):
            aliases.append((path, first[id(m)]))  # (the topmost: its submodules follow from it)
        target = have.get(first[id(m)])
        if not path or path in have or target is None:
            continue
        owner = gm
        *parents, leaf = path.split(".")
        for name in parents:  # (a container the tracer did not keep: an empty one)
            if name not in owner._modules:
                owner._modules[name] = torch.nn.Module()
            owner = owner._modules[name]
        owner._modules[leaf] = target
        have = dict(gm.named_modules(remove_duplicate=False))
    if aliases:
        gm.meta[MODULE_ALIASES] = tuple(aliases)


def _holds_hf_model(model: torch.nn.Module) -> bool:
    """Whether the model is or holds a HuggingFace model (a PreTrainedModel): transformers 5's
    forwards do not trace with plain fx, so a wrapper around one (convert_decoder's cache step,
    a user's classifier around a BertModel) fails there too, after a pass over its weights."""
    if type(model).__module__.startswith("transformers."):
        return True
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    return base is not None and any(isinstance(m, base) for m in model.modules())


def _trace(work, model, args, kwargs, has_inputs, export_only, observe, dynamic, state):
    reports: dict[str, str] = {}
    # export_only (training): every parameter a get_attr node, no leaf module hiding its weights.
    # HuggingFace models do not trace with plain fx (transformers 5): straight to torch.export
    hf = has_inputs and _holds_hf_model(model)
    attempts = [] if export_only or hf else [(SYMBOLIC, lambda: _symbolic_trace(work, args, kwargs))]
    # what the forward changed under the tracers that made a graph (each change is put back at
    # once): said when one of them is taken
    changes: list[str] = []

    def put_back(traced: bool = False) -> None:
        changes.extend(_changed_state(work, state, traced=traced))

    if has_inputs:
        attempts.append((EXPORT, lambda: _export(work, args, kwargs, dynamic, export_only, state,
                                                 changes)))
    if attempts and attempts[0][0] == SYMBOLIC and _has_composites(work):
        # (what was captured before torch.nn's composites were traced into: nn.Transformer with
        # a causal mask it checks by value stops both tracers inside it)
        attempts.append((SYMBOLIC_WHOLE, lambda: _symbolic_trace(work, args, kwargs, whole=True)))
    failure = None  # the last tracer's exception (CaptureError.exception, for debugging)
    ran: list = []  # the model's outputs, where a symbolic attempt's comparison ran it
    # the weights as the forward found them: a symbolic trace that changed them ran a write
    # fx does not record (one pass over the weights, taken once for every symbolic attempt)
    versions = _versions(work) if any(n.startswith(SYMBOLIC) for n, _ in attempts) else None
    for name, trace in attempts:
        try:
            gm = trace()
            if name.startswith(SYMBOLIC) and _wrote_at_trace(versions, work):
                raise RuntimeError(_WROTE_AT_TRACE)
        except Exception as e:
            failure = e
            reports[name] = _brief(e)
            log.info("%s failed: %s", name, reports[name])
            changed = _changed_state(work, state, traced=True)
            if changed:  # (what the forward did before it failed may be why)
                reports[name] += f" (the forward changed {', '.join(changed[:3])})"
            continue
        put_back(traced=True)  # (every tracer runs the forward)
        if has_inputs:
            symbolic = name.startswith(SYMBOLIC)
            # an export graph is compared with the model's outputs where a symbolic attempt ran
            # the model (free), and where a forward of the user's reads a flag that is True
            # while torch.export traces (torch.compiler.is_compiling()): then one eager run.
            # (HF models go straight to torch.export; their own flags branch alike)
            flag = _calls_in_forward(work, None, *_tracing_flags()) \
                if name == EXPORT and not ran else None
            compare = symbolic or bool(name == EXPORT and (ran or flag))
            try:  # one run: shapes, what calibration measures, and what the comparison needs
                PropagateTensorInfo(args, kwargs, observe=observe or compare, buffers=symbolic)(gm)
                if symbolic:
                    _detach_where_grad_was_off(gm)
            except Exception as e:
                failure = e
                reports[name] = "traced, but the traced graph failed on the example inputs: " + _brief(e)
                log.info("%s", reports[name])
                _changed_state(work, state)  # (the next tracer starts from the model as it was)
                continue
            # symbolic_trace records what the forward does to proxies: attribute assignments
            # (self.n += 1), output objects it cannot build, reads of self.training are lost or
            # frozen silently; torch.export keeps them, so a trace that parts goes there
            if symbolic:
                parted = _writes_constant(gm) or _parts_from_eager(gm, work, args, kwargs, ran)
            else:
                parted = _export_parts(gm, work, args, kwargs, ran[-1] if ran else None) \
                    if compare else None
                flag = parted and (flag or _calls_in_forward(work, None, *_tracing_flags()))
                if flag:
                    parted += (f": {type(model).__name__}'s forward asks whether it is traced "
                               f"({flag}), True while torch.export traces, so the graph took "
                               "the branch for traced code. Make both branches compute the "
                               "same values, or choose the branch with an argument of forward")
            if not observe:
                gm.meta.pop(OBSERVED, None)
                for node in gm.graph.nodes:
                    node.meta.pop(OBSERVED, None)
            if parted:
                reports[name] = f"traced, but the graph is not the model on the example inputs: {parted}"
                log.info("%s", reports[name])
                put_back()  # (that eager run's)
                continue
            if name == EXPORT and dynamic:
                _waive_harmless_guards(gm, work, args, kwargs)
            put_back()  # (the eager runs' above)
        if changes:
            _say_what_state_changes(model, changes)
        gm.meta[CAPTURE] = name
        _keep_persistence(gm, model)
        _keep_aliases(gm, model)
        _say_what_hooks_do(gm, work, export_only)
        _say_where_exceptions_are_caught(gm, work)
        keep_backward_hooks(gm, work)
        readers = reads_training(work)
        if readers:
            gm.meta[READS_TRAINING] = (tuple(readers), bool(work.training))
        modes = _grad_modes_differ(work, args, kwargs, state) if has_inputs else None
        if modes:
            gm.meta[GRAD_MODES] = modes
        if has_inputs:  # every call is checked against the arguments the graph was made with
            gm.call_signature = CallSignature(model, args, kwargs, gm)
            gm.meta.setdefault("_user_preserved_attributes", {})["call_signature"] = \
                gm.call_signature
        config = getattr(work, "config", None)
        if config is not None and not isinstance(config, (torch.Tensor, torch.nn.Module)):
            if has_inputs and "config" in gm.call_signature.attributes:
                # (the config the graph computed with is the copy's, as its forward left it: an
                # HF classifier given labels sets config.problem_type there, and setting it
                # below warned "changes nothing". Only the config: the copy's other attributes,
                # as its forward left them, can hold tensors it computed, which no deepcopy of
                # the converted module takes)
                gm.call_signature.attributes["config"] = config
            # (a HuggingFace model's: users and pipelines read fast.config; the copy's, as the
            # model's own object written through fast.config changed what the model computes,
            # and the graph follows neither)
            gm.config = config
            gm.meta.setdefault("_user_preserved_attributes", {})["config"] = config
        if name == EXPORT and not dynamic:
            gm.meta[STATIC_SHAPES] = True  # its input guard is then what rejects another shape
        gm.training = model.training  # a fresh GraphModule says "training"; keep the model's flag
        gm.meta[CAPTURED_TRAINING] = work.training  # (what the graph's baked flags followed)
        gm.meta[BATCH_NORM_MOMENTA] = {
            path: m.momentum for path, m in work.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats}
        if reports:
            log.info("captured with %s after: %s", name, "; ".join(reports))
        return gm
    eager = _eager_failure(work, args, kwargs, state) if has_inputs else None
    if eager:  # the tracers' reports blame what the model does with these very inputs
        reports = {EAGER: eager, **reports}
    else:  # (the tracers' reports quote torch's internals, not the cause)
        reports = _untraceable(work) \
            or (has_inputs and _rebound_buffers(work, args, kwargs, state)) or reports
    error = CaptureError(reports)
    if kwargs.get("use_cache") is False or getattr(getattr(model, "config", None), "use_cache",
                                                   None) is False:
        error.retold(KV_CACHE_FIX, BUILT_CACHE_FIX)
    error.exception = failure  # (not chained: its text is torch's long debugging narration)
    raise error


def _leave_transforms(depth: int) -> None:
    """Pop the torch.func transforms (vmap, grad) a failed run left entered: an exception in a
    vmapped forward run on capture's failure path (_eager_failure) left its level on
    functorch's stack, and every later random op in the process failed ("vmap: called random
    operation", nn.Linear(...) among them)."""
    from torch._C import _functorch as functorch
    leave = {functorch.TransformType.Vmap: functorch._vmap_decrement_nesting,
             functorch.TransformType.Grad: functorch._grad_decrement_nesting,
             functorch.TransformType.Jvp: functorch._jvp_decrement_nesting,
             functorch.TransformType.Functionalize: functorch._func_decrement_nesting}
    while len(functorch.get_interpreter_stack() or ()) > depth:
        leave[functorch.peek_interpreter_stack().key()]()


def _eager_failure(work: torch.nn.Module, args: tuple, kwargs: dict, state: dict
                   ) -> Optional[str]:
    """What the model's own forward raises on the example inputs, or None: every tracer fails
    on inputs the model cannot take (a wrong shape or dtype), and its report would send the
    user to rewrite a model that is fine. One eager run, on the failure path only."""
    bindings = _buffer_bindings(work)
    try:
        run_kept(work, args, kwargs)
    except Exception as e:  # noqa: BLE001 - reported, with the tracers' reports
        return _brief(e)
    finally:
        _rebind(bindings)  # (_rebound_buffers runs it again, from the buffers it started with)
        _changed_state(work, state)
    return None
