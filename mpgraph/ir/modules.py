"""Small modules that rewritten graphs call, so that ``.train()``/``.eval()`` keep their meaning.

torch.export bakes the training flag into the graph (``aten.dropout(x, p, True)``,
``aten.batch_norm(..., training=True, ...)``, ``num_batches_tracked.add_(1)``); these modules read
``self.training`` at run time instead, as nn.Dropout and nn.BatchNorm do.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import marshal
import math
import os
import re
import sys
import warnings
import weakref
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch.fx.graph import CodeGen, _PyTreeCodeGen
from torch.utils import _pytree as pytree

from mpgraph.errors import InputMismatchError, MissingWeightsError, WeightOverflowError
from mpgraph.ir.fake import TRACED_ON, module_tensors
from mpgraph.ir.meta import (CAPTURE, EVAL_ONLY, GRAD_MODES, PACKED, PRECISION, READS_TRAINING,
                             STATIC_SHAPES, TENSOR, TensorInfo, dtype_name, is_inserted_cast)


class TrainingBatchNorm(torch.nn.Module):
    """``F.batch_norm`` with the statistics of the batch in training, the running ones in eval;
    the running statistics (arguments 3 and 4) are updated in place in training. Given the batch
    counter (argument 5), training counts batches as nn.BatchNorm does, and momentum None is its
    cumulative average (factor 1 / batches seen)."""

    def __init__(self, momentum: Optional[float], eps: float):
        super().__init__()
        self.momentum, self.eps = momentum, eps

    def forward(self, x, weight, bias, running_mean, running_var, counter=None):
        factor = self.momentum
        if self.training and counter is not None:
            counter.add_(1)
            if factor is None:
                factor = 1.0 / float(counter)
        return F.batch_norm(x, running_mean, running_var, weight, bias, self.training,
                            factor or 0.0, self.eps)

    @property
    def mutates_args(self) -> tuple:
        """For mpgraph.ir.graph.mutated_nodes: the running statistics and the counter, written in
        training only."""
        return (3, 4, 5) if self.training else ()


class CountBatches(torch.nn.Module):
    """``num_batches_tracked += 1`` in training only, as nn.BatchNorm does."""

    @property
    def mutates_args(self) -> tuple:
        return (0,) if self.training else ()

    def forward(self, counter):
        if self.training:
            counter.add_(1)
        return counter


class DropoutRate(torch.nn.Module):
    """The dropout probability of a fused op (attention's ``dropout_p``): ``p`` in training,
    0 in eval, as nn.MultiheadAttention passes it."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self) -> float:
        return self.p if self.training else 0.0


class TrainingFlag(torch.nn.Module):
    """The training flag an op takes as an argument (feature and alpha dropout, rrelu, a
    multi-layer RNN's dropout, instance norm's use of batch statistics), at run time: the op
    stays in the graph for plans and exports, and torch.export had baked the flag in."""

    def forward(self) -> bool:
        return self.training


class InputGuard(torch.nn.Module):
    """torch.export's input guard (its ``_guards_fn``: the asserts on input shapes the graph was
    captured under), as a module that pickles and calls the assert function directly: export's
    own holds a closure made for dynamo. The function is kept as its marshalled code and rebuilt
    in the namespace torch.export builds it in, with a ``torch`` whose ``_assert`` passes the
    ``waived`` conditions: the ones capture verified the graph computes right without (a branch
    on a size of 1 in library code that changes nothing: transformers' mask expansion, the
    memory format PyTorch's convolution picks)."""

    _is_impure = True  # a call with no users that must stay (fx's dead-code elimination)

    def __init__(self, fn, waived: frozenset = frozenset()):
        super().__init__()
        self.code = marshal.dumps(fn.__code__)
        self.waived = frozenset(waived)
        self.check = _guard_function(self.code, _Asserts(self.waived))

    def forward(self, *args):
        return self.check(*args)

    def failures(self, *args) -> list[str]:
        """Every condition these inputs break (the messages, "Guard failed: ..."), waived or not."""
        found = _Asserts(frozenset(), collect=[])
        _guard_function(self.code, found)(*args)
        return found.collect

    def waive(self, messages) -> None:
        self.waived = self.waived | frozenset(messages)
        self.check = _guard_function(self.code, _Asserts(self.waived))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("check", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.check = _guard_function(self.code, _Asserts(self.waived))

    @classmethod
    def of(cls, guards: torch.nn.Module) -> Optional["InputGuard"]:
        """An InputGuard doing what torch.export's guard module does, or None when its assert
        function cannot be found (its forward wraps it in a closure)."""
        for cell in getattr(guards.forward, "__closure__", None) or ():
            fn = cell.cell_contents
            if callable(fn) and getattr(fn, "__name__", "") == "_" and hasattr(fn, "__code__"):
                return cls(fn)
        return None


class _Asserts:
    """``torch`` as the guard code sees it: ``_assert`` raises for conditions not waived (or
    collects them), every other name is torch's."""

    def __init__(self, waived: frozenset, collect: Optional[list] = None):
        self.waived, self.collect = waived, collect

    def _assert(self, condition, message):
        if condition or message in self.waived:
            return
        if self.collect is not None:
            self.collect.append(message)
            return
        raise AssertionError(message)

    def __getattr__(self, name):
        return getattr(torch, name)


def _guard_function(code: bytes, asserts: _Asserts):
    import builtins
    import math
    import types
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    # (dynamo, under torch.compile, reads the function's builtins from its globals)
    namespace = {"__builtins__": builtins, **SYMPY_INTERP, "math": math, "inf": float("inf"),
                 "torch": asserts}
    return types.FunctionType(marshal.loads(code), namespace, "_")


_NOT_GIVEN = object()


class CallSignature:
    """The arguments the converted graph was captured with, checked on every call (about a
    microsecond): the graph takes the tensors it was captured with, and computes with the other
    arguments' values at capture (None, a bool, an int: torch.export and symbolic_trace fix them
    in the graph). An argument given at call time that the graph has no input for, or a fixed
    one given another value (a mask that was None at conversion), would be silently ignored:
    it is a TypeError that names the argument and the way out instead."""

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict,
                 graph: torch.fx.GraphModule):
        import inspect
        self.model = type(model).__name__
        # what the graph's own forward takes (torch.export's: the tensors only)
        self.graph_args = tuple(inspect.signature(graph.forward).parameters)
        try:
            params = list(inspect.signature(model.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        kinds = inspect.Parameter
        self.names = tuple(p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY,
                                                                 kinds.POSITIONAL_OR_KEYWORD))
        self.varargs = any(p.kind == kinds.VAR_POSITIONAL for p in params)
        self.arity = len(args)  # (a *args forward's graph takes exactly as many as it was given)
        given = dict(zip(self.names, args), **kwargs)
        self.tensors = frozenset(n for n, v in given.items() if not _fixed(v))
        # the structure of each argument that holds tensors in a container (a list of tensors,
        # a dict batch): the graph takes exactly these items (torch.export flattens them)
        # (as text: a TreeSpec object warns when copied, and a converted module is deepcopied)
        self.structures = {n: _structure(v) for n, v in given.items()
                           if n in self.tensors and not isinstance(v, torch.Tensor)}
        # the values the graph computes with: given non-tensor values, and absent defaults
        self.fixed = {n: v for n, v in given.items() if _fixed(v)}
        for p in params:
            if p.name not in given and p.default is not kinds.empty \
                    and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD):
                self.fixed[p.name] = p.default
        # a number the graph takes as an input and computes with (``h * scale`` traced by
        # torch.fx; torch.export specialises numbers): a call's other value of its type flows
        # through the graph, as a calibration batch's does
        traced = str(graph.meta.get(CAPTURE, "")).startswith("torch.fx")
        self.live = frozenset(n.target for n in graph.graph.nodes if traced
                              and n.op == "placeholder" and n.users
                              and type(self.fixed.get(n.target)) in (int, float))
        self.absent = frozenset(p.name for p in params if p.name not in given)
        # values given at capture that a call must give again: left out, the model would take
        # its default (or have none), while the graph computes with the value given then
        # (use_cache=False: the forward converted without its cache, whatever the call says)
        # (a name the forward takes through **kwargs has no default in its signature: a
        # HuggingFace model reads its config's value then, return_dict or output_attentions)
        config = getattr(model, "config", None)
        defaults = {n: getattr(config, n) for n in given
                    if config is not None and n not in self.names and hasattr(config, n)}
        defaults.update({p.name: p.default for p in params})
        self.required = {
            n: ("its default " + _shown(defaults[n]) if defaults.get(n, kinds.empty) is not
                kinds.empty else "no value for it")
            for n, v in given.items() if n in self.fixed and not (n == "use_cache" and v is False)
            and (defaults.get(n, kinds.empty) is kinds.empty or not _same(v, defaults[n]))}
        # the model's own plain Python attributes (a temperature, a flag): traced as constants;
        # so are those of each submodule the graph traced through, by dotted path (a submodule
        # the graph calls, fx's leaf, reads its own when it runs)
        called = tuple(str(n.target) for n in graph.graph.nodes if n.op == "call_module")
        self.attributes = {
            f"{path}.{k}" if path else k: v for path, module in model.named_modules()
            if not any(path == c or path.startswith(c + ".") for c in called)
            for k, v in _plain_attributes(module).items()}

    def check(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Raise TypeError for a call the graph cannot honour; else the (args, kwargs) to call
        the graph's forward with (the fixed values it does not take left out)."""
        names = self.names
        if self.varargs:
            arity = getattr(self, "arity", None)  # (None: a signature pickled before it had one)
            if arity is not None and len(args) != arity:
                raise TypeError(
                    f"the converted {self.model} takes {arity} positional arguments, as many as "
                    f"it was converted with (its forward takes *args; the graph one input per "
                    f"argument given then); {len(args)} were given. Convert with an example of "
                    f"{len(args)} (one converted module per count)")
            for name, value in kwargs.items():  # (a keyword-only scale=None was Python's bare
                self._one(name, value)          # "unexpected keyword argument", 2.0 too)
            self._refuse_missing_tensors(args, kwargs)
            return args, {n: v for n, v in kwargs.items()
                          if n in self.tensors or n in self.graph_args}
        if len(args) > len(names):
            raise TypeError(f"the converted {self.model} takes {len(names)} positional "
                            f"arguments ({', '.join(names)}), {len(args)} were given")
        for name, value in zip(names, args):
            self._one(name, value)
        for name, value in kwargs.items():
            self._one(name, value)
        if kwargs and len(args):
            twice = [n for n in names[:len(args)] if n in kwargs]
            if twice:  # (Python's own error for the model's forward; the keyword's value won)
                raise TypeError(f"the converted {self.model} got multiple values for argument "
                                f"{twice[0]!r} (positional and keyword), as its forward would")
        if len(args) < len(self.tensors) or kwargs:
            self._refuse_missing_tensors(args, kwargs)
        for name, instead in getattr(self, "required", {}).items():  # (older pickles: none)
            if name not in kwargs and name not in names[:len(args)]:
                raise TypeError(
                    f"argument {name!r} was given ({_shown(self.fixed[name])}) when {self.model} "
                    "was converted, and the converted graph computes with that value; left out, "
                    f"{self.model}'s forward would take {instead}. Pass "
                    f"{name}={_shown(self.fixed[name])}, or convert without it (one converted "
                    "module per set of arguments)")
        if not kwargs and names[:len(args)] == self.graph_args:
            return args, kwargs
        given = dict(zip(names, args), **kwargs)
        return (), {n: given[n] if n in given else self.fixed[n] for n in self.graph_args
                    if n in given or n in self.fixed}

    def _refuse_missing_tensors(self, args: tuple, kwargs: dict) -> None:
        """A TypeError for the first argument that was a tensor at conversion and that this
        call leaves out (the graph computes with it)."""
        missing = sorted(self.tensors - set(self.names[:len(args)]) - set(kwargs))
        if missing:
            raise TypeError(f"argument {missing[0]!r} was a tensor when {self.model} was "
                            "converted and the converted graph computes with it: pass it "
                            "(or convert without it: one converted module per set of "
                            "arguments)")

    def complete(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(args, kwargs) with the values fixed at capture that the graph takes as inputs and
        the call leaves out added as keywords (torch.export keeps ``use_cache=False`` an input)."""
        given = set(self.names[:len(args)]) | set(kwargs)
        extra = {n: self.fixed[n] for n in self.graph_args if n not in given and n in self.fixed}
        return args, {**kwargs, **extra} if extra else kwargs

    def _one(self, name: str, value) -> None:
        if name in self.tensors:
            if value is None:
                raise TypeError(f"argument {name!r} was a tensor when {self.model} was converted "
                                "and the converted graph computes with it: pass a tensor")
            want = self.structures.get(name)
            if want is None and not isinstance(value, torch.Tensor):
                # (a model that takes a number too, `if not torch.is_tensor(t): t =
                # torch.tensor([t])`: the graph holds the branch the tensor took)
                raise TypeError(
                    f"argument {name!r} was a tensor when {self.model} was converted and the "
                    f"converted graph computes with it: {_shown(value)} is not one (the graph "
                    "holds what the model did with a tensor there). Pass a tensor, "
                    f"torch.tensor({_shown(value)}) in the dtype and shape converted with")
            if want is not None and not isinstance(value, torch.Tensor) \
                    and _structure(value) != want:
                raise TypeError(
                    f"argument {name!r} holds other items than when {self.model} was converted "
                    f"(then: {want[1]}; now: {_structure(value)[1]}): the graph computes with "
                    "the items it was captured with. Convert with an example of this structure "
                    "(one converted module per structure)")
            return
        want = self.fixed.get(name, _NOT_GIVEN)
        # (no converted graph takes a cache object: converting with it fails in the capture)
        cache = _is_kv_cache(name, value)
        if want is _NOT_GIVEN:
            way = (_KV_CACHE_WAY if cache else
                   f"Convert with it: mpgraph.convert(model, ..., example_kwargs={{{name!r}: <a "
                   "value like the ones you pass>})")
            raise TypeError(f"the converted {self.model} has no argument {name!r}: it was not "
                            "given when the model was converted, so the graph has no input for "
                            f"it. {way[0].upper()}{way[1:]}")
        if not _same(value, want) and not (name in getattr(self, "live", ())
                                            and type(value) is type(want)):
            was = "not given" if name in self.absent else "given"
            way = ("for generation with a KV cache, convert with mpgraph.convert_decoder"
                   if name == "use_cache" else _KV_CACHE_WAY if cache else
                   f"convert with it: mpgraph.convert(model, ..., example_kwargs={{{name!r}: <a "
                   "value like the ones you pass>}) (one converted module per set of arguments)")
            raise TypeError(
                f"argument {name!r} was {was} ({want!r}) when {self.model} was converted, and the "
                f"converted graph computes with that value: {_shown(value)} would be ignored. "
                f"{way[0].upper()}{way[1:]}")


_KV_CACHE_WAY = ("the converted graph computes the whole sequence, with no KV cache; for "
                 "generation with a KV cache, convert with mpgraph.convert_decoder(model, "
                 "prompt_ids, max_cache_len=...)")


def _is_kv_cache(name: str, value) -> bool:
    """A HuggingFace KV cache: a ``Cache`` object, or anything given as past_key_values."""
    return (name == "past_key_values" and value is not None) or any(
        c.__name__ == "Cache" for c in type(value).__mro__)


def _plain_attributes(module: torch.nn.Module) -> dict:
    """A module's own plain Python attributes (not tensors, submodules, private names or the
    training flag): what a trace reads as constants."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_")
            and k != "training" and not isinstance(v, (torch.Tensor, torch.nn.Module))}


def _warn_attribute_ignored(where: str, was, value) -> None:
    warnings.warn(f"{where} was {_shown(was)} when the model was converted, and the converted "
                  f"graph computes with that value: setting it to {_shown(value)} here changes "
                  "nothing. Set it on the model and convert again (or make it a tensor: "
                  "register_buffer, read at run time)", UserWarning, stacklevel=3)


class _TracedThrough(torch.nn.Module):
    """A submodule of a converted module whose forward the graph traced through (fx's bare
    holder of its weights): its Python attributes were read as constants, so setting one of
    them warns, as on the converted module itself."""

    def __setattr__(self, name, value):
        where, attributes = self.__dict__.get("_captured_attributes", ("", {}))
        if name in attributes and not _same(value, attributes[name]):
            _warn_attribute_ignored(f"{where}.{name}", attributes[name], value)
        super().__setattr__(name, value)

    def _get_name(self):
        return "Module"  # (its repr, as before)


def _mark_traced_through(gm: torch.nn.Module, signature: CallSignature) -> None:
    """The submodules of ``gm`` that hold the attributes of a traced-through submodule of the
    model (fx's bare ``nn.Module`` holders) made ``_TracedThrough``."""
    held: dict = {}
    for key, value in signature.attributes.items():
        path, _, name = key.rpartition(".")
        if path:
            held.setdefault(path, {})[name] = value
    for path, attributes in held.items():
        try:
            module = gm.get_submodule(path)
        except AttributeError:  # (one without weights: the converted module has none there)
            continue
        if type(module) in (torch.nn.Module, _TracedThrough):
            module.__class__ = _TracedThrough
            module.__dict__["_captured_attributes"] = (f"{signature.model}.{path}", attributes)


def _structure(value) -> tuple[str, str]:
    """(a container's pytree structure as text, the same in a few words: 'a list of 3',
    "a dict with keys ['x', 'mask']")."""
    spec = pytree.tree_structure(value)
    if spec.is_leaf() and not isinstance(value, torch.Tensor):  # an object holding tensors
        # (a dataclass, PyG's Data): torch.fx reads its fields at each call, so its type and
        # its tensor fields by name are the structure (another instance is another batch; the
        # order, metadata fields beside them, a cached property touched since are not)
        fields = sorted(k for k, v in _fields(value).items() if _holds_tensor(v))
        kind = type(value)
        return (f"{kind.__module__}.{kind.__qualname__} with fields {fields}",
                f"a {kind.__name__} with fields {fields}")
    kind = getattr(spec.type, "__name__", str(spec.type))
    if spec.type is dict or kind in ("OrderedDict", "defaultdict"):
        words = f"a {kind} with keys {list(spec.context)}"
    else:
        words = f"a {kind} of {spec.num_children}"
    # (a None item is a leaf as a tensor is: the graph holds the branch its None took, so
    # where the items are None is the structure too)
    nones = [pytree.keystr(path) for path, leaf in pytree.tree_flatten_with_path(value)[0]
             if leaf is None]
    if nones:
        return f"{spec} None at {nones}", f"{words}, None at {', '.join(nones)}"
    return str(spec), words


def _fixed(value) -> bool:
    """A value the graph fixes at capture (no tensor in it)."""
    return not _holds_tensor(value)


def _holds_tensor(value, depth: int = 3) -> bool:
    """A tensor among the value's pytree leaves, or among the fields of an object there (a
    dataclass, a ``SimpleNamespace``, PyG's ``Data``: the graph reads their tensors at each
    call, so another instance is another input, not a fixed value to refuse)."""
    for v in pytree.tree_leaves(value):
        if isinstance(v, torch.Tensor):
            return True
        if depth and not isinstance(v, (type, torch.nn.Module)):
            fields = list(_fields(v).values())
            if fields and _holds_tensor(fields, depth - 1):
                return True
    return False


def _fields(value) -> dict:
    """An object's fields by name: a dataclass's, else its instance attributes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    return dict(getattr(value, "__dict__", {}))


_SEQUENCES = (tuple, list, torch.Size)  # (x.shape[-2:] given where (32, 32) was: the same)


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) in _SEQUENCES and type(b) in _SEQUENCES:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain equality
        return False


def _shown(value) -> str:
    from mpgraph.ir.graph import short_repr
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return short_repr(value)


def overflow_absmax(value, dtype: torch.dtype) -> Optional[float]:
    """The absmax of ``value``'s finite values where it exceeds ``dtype``'s max (cast to
    ``dtype``, they would be inf: NumericSafety's "weight" overflow), else None. One aminmax
    pass; none where no cast narrows the range (same dtype, float32 into float32 or float64)."""
    if not _narrower(value, dtype) or value.numel() == 0:
        return None
    top = torch.finfo(dtype).max
    from mpgraph.ir.fake import is_abstract
    v = value.detach()
    if is_dtensor(v):
        v = v.to_local()  # (this rank's shard: each rank checks its own)
    if is_abstract(v) or v.numel() == 0:
        return None
    lo, hi = (float(x) for x in torch.aminmax(v))
    if math.isfinite(lo) and math.isfinite(hi):
        absmax = max(-lo, hi)
    else:  # inf/NaN in the source too: not an overflow; the finite values' absmax
        a = v.abs()
        absmax = float(a.masked_fill_(~torch.isfinite(a), 0).max())
    return absmax if absmax > top else None


def check_fits(items: Iterable, action: str, outcome: str = "nothing was written") -> None:
    """Raise WeightOverflowError for the ``(name, value, dtype)`` items whose values overflow
    ``dtype`` (``overflow_absmax``), naming each, what was being done (``action``:
    "load_state_dict") and what came of it (``outcome``); else nothing."""
    found = []
    for name, value, dtype in items:
        absmax = overflow_absmax(value, dtype)
        if absmax is not None:
            found.append(f"{name} absmax {absmax:.3g} overflows {dtype_name(dtype)} "
                         f"(max {torch.finfo(dtype).max:.5g})")
    if not found:
        return
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    one = len(found) == 1
    raise WeightOverflowError(
        f"{action}: {'; '.join(found[:5])}{more}. The converted module stores "
        f"{'this tensor' if one else 'these tensors'} in that dtype (its plan chose it for the "
        "values at conversion, and a converted module's dtypes are fixed), so the cast would "
        f"store inf: {outcome}. To run with these weights, convert the model that holds them: "
        "mpgraph.convert(model_with_new_weights, example_inputs, ...) keeps weights that "
        "overflow in float32, and so does applying this module's plan to it, "
        "mpgraph.convert(model_with_new_weights, example_inputs, plan=module.plan)")


def compiler_disable(reason: str):
    """``torch.compiler.disable`` with the reason dynamo's fullgraph=True error shows (a torch
    older than its ``reason=`` takes none)."""
    try:
        return torch.compiler.disable(reason=reason)
    except TypeError:
        return torch.compiler.disable


# whether the compiled graph refreshes low copies itself (``_register_refresh_op``)
_REFRESH_OP: list = []


_COPIES: "weakref.WeakValueDictionary[int, WeightCopies]" = weakref.WeakValueDictionary()
_COPY_KEYS = itertools.count()


class WeightCopies:
    """The low-precision copies a plan keeps beside their float32 originals (a weight read in
    both precisions: a tied embedding and output layer), kept in step with them: a copy is
    refreshed on the next call after its original is written (``load_state_dict``,
    ``param.copy_()``, a new tensor set in its place). A write through ``.data``
    (``p.data.copy_(new)``: an EMA, some checkpoint loaders) bumps no version counter the copy
    can see: the copy stays stale until the module's state dict is loaded again (README, Current
    limits). The copies are not in the state dict; the originals are, under the model's keys.

    Under ``torch.compile`` the check runs inside the compiled graph, as an opaque op
    (``mpgraph::refresh_weight_copy``, kept out of CUDA graphs) that writes the copy in place
    where its original changed: no graph break, ``fullgraph=True`` compiles, and a compiled
    module sees new weights as an eager one does. An original whose new values overflow its
    copy's dtype is a WeightOverflowError at the call (the copy is left as it was)."""

    def __init__(self, root: torch.nn.Module, pairs):
        self.pairs = tuple(pairs)  # (original's path, copy's path)
        self.seen = {copy: _stamp(_tensor_at(root, source)) for source, copy in self.pairs}
        self.shared: set = set()  # copies of originals in shared memory: written on every call
        self._register()

    def _register(self) -> None:
        # the key the compiled op finds this object by (an int: what a graph can hold)
        self.key = next(_COPY_KEYS)
        _COPIES[self.key] = self

    def __getstate__(self):
        return {"pairs": self.pairs, "seen": dict(self.seen), "shared": set(self.shared)}

    def __setstate__(self, state):  # (copy.deepcopy: a key of its own)
        self.pairs, self.seen = state["pairs"], state["seen"]
        self.shared = state.get("shared", set())
        self._register()

    def invalidate(self, path: str) -> None:
        """A tensor was set at ``path``: the copies of it (or the copy itself) are refreshed on
        the next call, whatever its address (a new tensor may reuse a freed one's)."""
        for source, copy in self.pairs:
            if path in (source, copy):
                self.seen.pop(copy, None)

    def refresh(self, root: torch.nn.Module) -> None:
        if torch.compiler.is_compiling():
            if not _REFRESH_OP:
                return self._refresh_eagerly(root)
            for index, (source, copy) in enumerate(self.pairs):
                torch.ops.mpgraph.refresh_weight_copy(
                    _tensor_at(root, source).detach(), _tensor_at(root, copy), self.key, index)
            return
        self._refresh_all(root)

    def _refresh_all(self, root: torch.nn.Module) -> None:
        for index, (source, copy) in enumerate(self.pairs):
            self.refresh_one(index, _tensor_at(root, source), _tensor_at(root, copy))

    @compiler_disable(
        "mpgraph: the converted module's low-precision weight copies are checked against their "
        "float32 originals before each call, outside the compiled graph on this torch (one "
        "graph break): compile without fullgraph=True, or use a torch with "
        "torch.Tag.cudagraph_unsafe, where the check runs inside the graph")
    def _refresh_eagerly(self, root: torch.nn.Module) -> None:
        self._refresh_all(root)

    def refresh_one(self, index: int, original: torch.Tensor, low: torch.Tensor) -> None:
        """The copy of pair ``index`` (``low``) written from ``original`` where that changed
        since the last refresh."""
        source, copy = self.pairs[index]
        stamp = _stamp(original)
        if self.seen.get(copy) == stamp and copy not in self.shared:
            return
        if original.is_shared():  # (share_memory(): its address moved, so this is a miss)
            self.shared.add(copy)  # another process's writes move no version here: every call
        else:
            self.shared.discard(copy)
        check_fits([(f"{source} (read as its {dtype_name(low.dtype)} copy {copy})", original,
                     low.dtype)], f"{source} was written",
                   f"{copy} was not refreshed, and each call raises this until {source} holds "
                   "values that fit")
        with torch.no_grad():
            low.copy_(original)
        self.seen[copy] = stamp


def _refresh_weight_copy(original: torch.Tensor, copy: torch.Tensor, key: int,
                         index: int) -> None:
    """The compiled graph's refresh of one low copy (``WeightCopies.refresh``)."""
    copies = _COPIES.get(key)
    if copies is not None and index < len(copies.pairs):
        copies.refresh_one(index, original, copy)
    else:  # (its WeightCopies is gone: a fresh copy is never wrong)
        with torch.no_grad():
            copy.copy_(original)


def _register_refresh_op() -> None:
    """``mpgraph::refresh_weight_copy``: ``WeightCopies``' check as an op opaque to
    torch.compile, tagged to stay out of CUDA graphs (its Python runs on every call). A torch
    without that tag refreshes eagerly under torch.compile instead (a graph break)."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        return
    if not hasattr(torch.ops.mpgraph, "refresh_weight_copy"):  # (else: an earlier import's)
        try:
            op = torch.library.custom_op("mpgraph::refresh_weight_copy", mutates_args=("copy",),
                                         tags=(tag,))(_refresh_weight_copy)
        except TypeError:  # (a custom_op without tags=)
            return
        op.register_fake(lambda original, copy, key, index: None)
    _REFRESH_OP.append(True)


class FusedWeights:
    """FuseSiblingGemv's stacked weights kept one with their members: each member (the model's
    own q/k/v or gate/up weight, in the state dict under its key) is a row view of its stack,
    so in-place writes (``load_state_dict``, ``param.copy_()``) reach the stack. Where a member
    was replaced (``load_state_dict(assign=True)``, ``.to()``, ``load_weights``, a new
    Parameter, a swapped submodule), the next call builds a new stack from the members' values,
    in the stack's dtype, and points each member object at its rows again (``.data``: the
    Parameter a caller holds stays the one in the module). A new stack, not a write into the
    old one, so that two members swapped keep their values and a copy of the module sharing the
    old stack (``copy.copy``) keeps its weights."""

    def __init__(self, records):
        self.records = tuple((target, tuple(spans)) for target, spans in records)
        # what the last refresh left: (root, [(dict, name, object)] of each module on the paths,
        # [(dict, name, tensor, data_ptr)] of each stack and member), or None
        self._watch = None

    def __getstate__(self):
        return {"records": self.records}

    def __setstate__(self, state):
        self.__init__(state["records"])

    def in_step(self, root: torch.nn.Module) -> bool:
        """Whether every module on the paths, every stack and every member is still the object,
        at the address, that the last refresh left (each call's check, ~0.3 us an entry)."""
        watch = self._watch
        return watch is not None and watch[0] is root \
            and all(d.get(name) is m for d, name, m in watch[1]) \
            and all(d.get(name) is t and t.data_ptr() == ptr for d, name, t, ptr in watch[2])

    @property
    def stacks(self) -> set:
        return {target for target, _ in self.records}

    @property
    def members(self) -> set:
        return {path for _, spans in self.records for path, _, _ in spans}

    def adopt(self, copied: torch.nn.Module, source: torch.nn.Module) -> None:
        """After fx copied ``source`` (``copy.copy``, ``copy.deepcopy``): the stacks buffers out
        of the state dict again (fx registers a buffer it copies as a persistent one, which
        ``load_state_dict`` would then want), and members that no get_attr names, which a
        shallow copy leaves out, taken from ``source``."""
        from torch.fx.graph_module import _copy_attr
        for target, spans in self.records:
            for path, _, _ in spans:
                try:
                    _tensor_at(copied, path)
                except (KeyError, AttributeError):
                    _copy_attr(source, copied, path)
            owner, leaf = _owner(copied, target)
            owner._non_persistent_buffers_set.add(leaf)
        self._watch = None

    # (data_ptr reads and new stacks set on the module: under torch.compile it runs eagerly,
    # a graph break; fullgraph=True is refused with this reason)
    @compiler_disable(
        "mpgraph: this converted module's stacked GEMV weights (FuseSiblingGemv, CPU plans) are "
        "checked against their members before each call, outside the compiled graph (one graph "
        "break): compile it without fullgraph=True")
    def refresh(self, root: torch.nn.Module) -> None:
        if self.in_step(root):
            return
        with torch.inference_mode(False), torch.no_grad():  # (a stack built under inference
            self._refresh(root)  # mode would be an inference tensor: no later in-place load)

    def _refresh(self, root: torch.nn.Module) -> None:
        from mpgraph.ir.fake import is_abstract
        from mpgraph.ir.graph import set_attr, with_data
        self._watch = None
        watch = True
        for target, spans in self.records:
            owner, leaf = _owner(root, target)
            stack = owner._buffers.get(leaf)  # (None: its submodule was swapped for another)
            members = [(path, start, stop, _tensor_at(root, path)) for path, start, stop in spans]
            valued = [not is_abstract(t) for *_, t in members]
            if not all(valued):  # a plan without weights (meta, fakes): the views' dtypes
                if not any(valued) and stack is not None and is_abstract(stack):
                    for path, start, stop, t in members:
                        if t.dtype != stack.dtype or t.device != stack.device:
                            set_attr(root, path, with_data(t, stack[start:stop]))
                watch = False  # (some loaded, some not: load_weights refreshes when all are)
                continue
            if stack is not None and all(_rows_of(t, stack, start) for _, start, _, t in members):
                continue
            width = stack.shape[1] if stack is not None else members[0][3].shape[-1]
            for path, start, stop, t in members:
                if tuple(t.shape) != (stop - start, width):
                    raise ValueError(f"{path} has shape {tuple(t.shape)}; the converted graph "
                                     f"reads it as {(stop - start, width)} (convert the model "
                                     "again for another shape)")
            if stack is not None:
                check_fits([(f"{path} (a member of the stacked weight {target})", t, stack.dtype)
                            for path, _, _, t in members], "refreshing stacked weights",
                           f"{target} was not rebuilt")
            new = torch.empty((spans[-1][2], width), device=members[0][3].device,
                              dtype=stack.dtype if stack is not None else members[0][3].dtype)
            sharded = False
            for path, start, stop, t in members:
                if is_dtensor(t):  # FSDP2's shard: the whole weight, gathered
                    t, sharded = t.full_tensor(), True
                new[start:stop].copy_(t)
            if leaf in owner._buffers:
                owner._buffers[leaf] = new
            else:
                owner.register_buffer(leaf, new, persistent=False)
            if sharded:  # the members stay FSDP's (gathered again on the next call)
                watch = False
                continue
            for path, start, stop, t in members:
                t.data = new[start:stop]
        if watch:
            self._watch = _watch(root, [p for target, spans in self.records
                                        for p in (target, *(s[0] for s in spans))])


def refresh_weights(module: torch.nn.Module) -> None:
    """Every converted module in ``module`` (itself included) with its low weight copies and
    stacked weights in step with their originals, now, eagerly: before a trace reads them (an
    export, a capture), which would otherwise see the copies as the last call left them."""
    for m in module.modules():
        copies = m.__dict__.get("weight_copies")
        if copies is not None:
            copies._refresh_all(m)
        refresh_fused(m)


def refresh_fused(module: torch.nn.Module) -> None:
    """``module``'s stacked GEMV weights (FuseSiblingGemv) in step with their members, if it
    has any: before a call, after a load, a device move, and before an export."""
    fused = module.__dict__.get("fused_weights")
    if fused is not None:
        fused.refresh(module)


def _owner(root: torch.nn.Module, path: str) -> tuple:
    *modules, leaf = path.split(".")
    owner = root
    for part in modules:
        owner = owner._modules[part]
    return owner, leaf


def _watch(root: torch.nn.Module, paths: list) -> tuple:
    """What ``FusedWeights.in_step`` compares: each module on ``paths`` by the dict and name
    that hold it (a submodule swapped anywhere below the root), each tensor by its holder and
    its address (``.data =``, ``.to()``)."""
    links, tensors = {}, []
    for path in paths:
        *modules, leaf = path.split(".")
        owner = root
        for part in modules:
            links[(id(owner), part)] = (owner._modules, part, owner._modules[part])
            owner = owner._modules[part]
        d = owner._parameters if owner._parameters.get(leaf) is not None else owner._buffers
        tensors.append((d, leaf, d[leaf], d[leaf].data_ptr()))
    return root, list(links.values()), tensors


def forward_constants(paths: list) -> Optional[str]:
    """Why a meta plan's tensors its forward creates (torch.tensor([...]): torch.export's
    ``_tensor_constant*``) among ``paths`` have no value, and the way out; None if none is."""
    made = [path for path in paths if path.split(".")[-1].startswith("_tensor_constant")]
    if not made:  # (in no checkpoint: loading cannot give them a value)
        return None
    return (f"the converted module holds {len(made)} tensor(s) its forward creates "
            f"(torch.tensor(...), torch.ones(...) in the model's code: {', '.join(made[:5])}), "
            "which a model on the meta device computes without values: register each as a "
            "buffer of the model (then load it with the weights), or convert the materialised "
            "model")


def is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (a torch built without distributed)
        return False
    return isinstance(t, DTensor)


def _rows_of(t: torch.Tensor, stack: torch.Tensor, start: int) -> bool:
    """Whether ``t`` is the view of ``stack``'s rows from ``start``."""
    return not is_dtensor(t) and t.dtype == stack.dtype and t.device == stack.device \
        and t.stride() == stack.stride() \
        and t.data_ptr() == stack.data_ptr() + start * stack.stride(0) * stack.element_size()


def _stamp(t: torch.Tensor) -> tuple:
    """What changes when a tensor is written in place or replaced (its address and version
    counter, which a detached alias shares: the compiled graph passes one; a tensor set in its
    place through an assignment also clears its pair, ``WeightCopies.invalidate``)."""
    return t.data_ptr(), t._version, t.device


def _tensor_at(root: torch.nn.Module, path: str) -> torch.Tensor:
    owner, leaf = _owner(root, path)
    found = owner._parameters.get(leaf)
    return found if found is not None else owner._buffers[leaf]


_HOOKS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
          "register_full_backward_pre_hook", "register_backward_hook")


class _NoHooks:
    """In place of a hook registration method on a submodule the graph never calls."""

    def __init__(self, path: str, method: str, module: Optional[torch.nn.Module] = None):
        self.path, self.method = path, method
        self.order = list(module._parameters) if module is not None else []
        self._module = weakref.ref(module) if module is not None else None

    @property
    def module(self) -> Optional[torch.nn.Module]:
        return self._module() if self._module is not None else None

    def __deepcopy__(self, memo):  # (a copy's refers to the copied module, not this one)
        module = self.module
        new = _NoHooks(self.path, self.method)
        new.order = list(self.order)
        copied = memo.get(id(module)) if module is not None else None
        new._module = weakref.ref(copied) if copied is not None else None
        return new

    def __call__(self, *args, **kwargs):
        hook = args[0] if args else kwargs.get("hook")
        prune = sys.modules.get("torch.nn.utils.prune")
        if prune is not None and isinstance(hook, prune.BasePruningMethod) \
                and self.module is not None:
            # prune registers its hook last, after moving the parameter to NAME_orig, setting
            # NAME and registering NAME_mask: undone here (NAME back in its place) so that its
            # own rollback (NAME_orig to NAME) leaves the module as it was; it failed on the NAME
            # it had set, and left the module broken
            name = getattr(hook, "_tensor_name", None)
            params = self.module._parameters
            if name and name not in params and f"{name}_orig" in params:
                vars(self.module).pop(name, None)
                self.module._buffers.pop(f"{name}_mask", None)
                order = [k for k in self.order if k in params or k == name]
                kept = {k: params[f"{name}_orig"] if k == name else params[k] for k in order}
                kept.update((k, v) for k, v in params.items() if k not in kept)
                params.clear()
                params.update(kept)
            raise RuntimeError(
                f"torch.nn.utils.prune on {self.path!r} of a converted module: its mask would "
                "never be applied (the converted graph reads the weight itself and never calls "
                "this module; torch.export inlines modules into ATen ops). Prune the model and "
                "convert it again (the mask is then part of the graph, and a training conversion "
                "trains the pruned weight); nothing was changed")
        raise RuntimeError(
            f"{self.method} on {self.path!r} of a converted module: the hook would never run. "
            "The converted graph computes this module's ops itself and never calls it (torch.export "
            "inlines modules into ATen ops). Register the hook on the model before converting "
            "(what it computes is traced into the graph), or on the converted module itself")


def refuse_hooks(gm: torch.fx.GraphModule) -> None:
    """Hook registration on a submodule the graph never calls is a clear error, not a hook that
    silently never fires; submodules the graph calls (symbolic_trace's leaf modules) keep
    theirs."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for path, module in gm.named_modules():
        if not path or any(path == c or path.startswith(c + ".") for c in called):
            continue
        for method in _HOOKS:
            module.__dict__[method] = _NoHooks(path, method, module)


@contextlib.contextmanager
def pytree_copies_quiet():
    """torch 2.13's pytree warns from copyreg whenever a TreeSpec is deep-copied (its own
    deprecated LeafSpec check, nothing the caller did; torch.export and torch.onnx copy them):
    kept off the user's screen."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                category=FutureWarning)
        yield


def planned_layout(t: torch.Tensor) -> str:
    """The memory layout a plan stored a tensor in: "channels_last" (ChannelsLast's conv
    weights), "transposed" (StoreWeights' column-major copy of a GEMV's weight), or ""."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
            and not t.is_contiguous():
        return "channels_last"
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return "transposed"
    return ""


def in_layout(t: torch.Tensor, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A copy of ``t`` in ``dtype`` and the ``planned_layout`` ``layout`` ("" keeps its strides)."""
    if layout == "transposed" and t.dim() == 2:
        return torch.empty_strided(t.shape, (1, t.shape[0]), dtype=dtype,
                                   device=t.device).copy_(t.detach())
    memory = torch.channels_last if layout == "channels_last" and t.dim() == 4 \
        else torch.preserve_format
    return t.detach().to(dtype=dtype, memory_format=memory)


def _off_plan(t, dtype: torch.dtype, layout: str) -> bool:
    """Whether ``t`` (a module's tensor) is in another dtype or layout than the plan's (FSDP's
    shards, DTensors, are FSDP's to place)."""
    return isinstance(t, torch.Tensor) and not t.is_meta and not is_dtensor(t) \
        and (t.dtype != dtype or bool(layout and planned_layout(t) != layout))


def _put(owner: torch.nn.Module, leaf: str, old: torch.Tensor, data: torch.Tensor) -> None:
    """``data`` in place of ``owner``'s tensor ``leaf`` (``old``): a Parameter for a parameter."""
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(data, old.requires_grad)
    else:
        owner._buffers[leaf] = data


class _Registry:
    """module -> value, by identity (a module class may define ``__eq__`` and so have no hash)
    and weakly: an entry leaves with its module."""

    def __init__(self):
        self._entries: dict = {}  # id(module) -> (weak reference to it, value)

    def get(self, module):
        found = self._entries.get(id(module))
        return found[1] if found is not None and found[0]() is module else None

    def __setitem__(self, module, value) -> None:
        key, entries = id(module), self._entries

        def gone(ref):
            if entries.get(key, (None,))[0] is ref:
                del entries[key]
        entries[key] = (weakref.ref(module, gone), value)


# Each submodule of a converted module with a plan: (its planned_tensors, its path there, its
# WeightCopies or None, a weak reference to the converted module). Weak: a module dropped by its
# converted module leaves here too.
_PLANNED = _Registry()
_REGISTRATION_HOOKS: list = []  # (the handles of the three, once installed)


def part_of_converted(module: torch.nn.Module) -> Optional[str]:
    """The path of ``module`` inside a module mpgraph converted (a submodule of one with a
    plan, which holds the plan's tensors), else None."""
    entry = _PLANNED.get(module)
    return entry[1] if entry is not None and entry[1] else None


def keep_planned(root: torch.nn.Module) -> None:
    """Assignments into ``root``'s submodules take the plan's dtypes from now on: a parameter or
    buffer set in another dtype (``fast.out.weight = nn.Parameter(w)``,
    ``load_state_dict(assign=True)``) is cast to the dtype and layout the plan stored, and a
    submodule swapped in has its tensors cast, as they are set (torch's global registration
    hooks, which run only when something is registered and act only on these modules); a value
    that would overflow that dtype is a WeightOverflowError before anything is set."""
    planned = root.__dict__.get("planned_tensors")
    if not planned:
        return
    copies = root.__dict__.get("weight_copies")
    for path, module in root.named_modules(remove_duplicate=False):
        _PLANNED[module] = (planned, path, copies, weakref.ref(root))
        if path:  # (the converted module's own load_state_dict checks its loads)
            _checks_loads(module)
    if not _REGISTRATION_HOOKS:
        from torch.nn.modules import module as nn_module
        _REGISTRATION_HOOKS.extend([
            nn_module.register_module_parameter_registration_hook(_on_tensor_set),
            nn_module.register_module_buffer_registration_hook(_on_tensor_set),
            nn_module.register_module_module_registration_hook(_on_module_set)])


def _joined(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _narrower(value, dtype: Optional[torch.dtype]) -> bool:
    """Whether writing floating ``value`` into a tensor of ``dtype`` narrows its range."""
    return dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point() \
        and dtype.is_floating_point and value.dtype != dtype \
        and torch.finfo(dtype).max < torch.finfo(value.dtype).max


def planned_slots(planned: dict, prefix: str, state_dict, copies, dtype_now=None) -> list:
    """(name, value, dtype) for each floating value of ``state_dict`` (loaded into the
    submodule at ``prefix``) that goes into a tensor the plan stored in a narrower dtype than the
    value's (float32 into float16): what ``check_fits`` scans. A value for a float32 tensor, or
    in its tensor's own dtype, costs a dict lookup. The low copies of ``copies`` (WeightCopies)
    count too, under their originals' keys. ``dtype_now(path)``: the dtype of a tensor the plan
    does not list."""
    slots = []
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        full = _joined(prefix, key)
        want = planned.get(full)
        dtype = want[0] if want is not None else dtype_now(full) if dtype_now else None
        if _narrower(value, dtype):
            slots.append((full, value, dtype))
    for source, copy_path in copies.pairs if copies is not None else ():
        if prefix and not source.startswith(prefix + "."):
            continue
        value = state_dict.get(source[len(prefix) + 1:] if prefix else source)
        want = planned.get(copy_path)
        if value is not None and want is not None and _narrower(value, want[0]):
            slots.append((f"{source} (read as its {dtype_name(want[0])} copy {copy_path})",
                          value, want[0]))
    return slots


def _check_load(module: torch.nn.Module, state_dict, prefix: str, *_) -> None:
    """A load_state_dict pre-hook on each submodule of a converted module: a load into the
    submodule itself (``fast.head.load_state_dict(sd)``; a load that begins above it has a
    prefix, and was checked where it began) checked as the converted module's own is, before
    anything is written."""
    entry = _PLANNED.get(module)
    if prefix or entry is None:
        return
    planned, path, copies, _ = entry
    check_fits(planned_slots(planned, path, state_dict, copies),
               f"{path}.load_state_dict" if path else "load_state_dict", "nothing was loaded")


def _checks_loads(module: torch.nn.Module) -> None:
    if not any(getattr(h, "hook", h) is _check_load
               for h in module._load_state_dict_pre_hooks.values()):
        module.register_load_state_dict_pre_hook(_check_load)


def _on_tensor_set(module: torch.nn.Module, name: str, tensor):
    """torch's hook on a parameter or buffer being set: the plan's dtype where it has one."""
    entry = _PLANNED.get(module)
    if entry is None or not isinstance(tensor, torch.Tensor):
        return None
    planned, path, copies, _ = entry
    full = _joined(path, name)
    want = planned.get(full)
    if want is not None and _off_plan(tensor, *want):
        check_fits([(full, tensor, want[0])], f"setting {full}", "nothing was set")
        data = in_layout(tensor, *want)
        tensor = torch.nn.Parameter(data, tensor.requires_grad) \
            if isinstance(tensor, torch.nn.Parameter) else data
    else:
        tensor = None
    if copies is not None:
        copies.invalidate(full)
    return tensor


def _on_module_set(container: torch.nn.Module, name: str, module):
    """torch's hook on a submodule being set: its tensors in the plan's dtypes (cast in place
    of the module's own), and assignments into it kept so."""
    entry = _PLANNED.get(container)
    if entry is None or not isinstance(module, torch.nn.Module):
        return None
    planned, path, copies, converted = entry
    prefix = _joined(path, name)
    # the caller's module is left as it was (the user's own layer put back, `fast.head =
    # model.head`, was cast to fp16 in place and broke the model): a copy of its modules, its
    # tensors shared until the plan's dtype replaces them in the copy, is what is registered
    module = copy.deepcopy(module, {id(t): t for _, t in itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False))})
    own_parametrizations(module)
    root = converted()
    graph = getattr(root, "graph", None)
    called = {str(n.target): getattr(n.meta.get(PRECISION), "dtype", None)  # (called whole)
              for n in (graph.nodes if graph is not None else ()) if n.op == "call_module"}
    whole = next((c for c in called if prefix == c or prefix.startswith(c + ".")), None)
    low = called[whole] if whole is not None and called[whole] not in (None, torch.float32) \
        else None
    if whole is None or low is not None:  # (a float32 call runs any module as the model does)
        fused = root.__dict__.get("fused_weights") if root is not None else None
        _refuse_other_tensors(planned, prefix, module, fused.stacks if fused else set(), low)
    todo, seen = [], set()
    for sub, owner in module.named_modules(remove_duplicate=False):
        for store in (owner._parameters, owner._buffers):
            for leaf, t in store.items():
                full = _joined(prefix, sub, leaf)
                want = planned.get(full)
                if want is not None and _off_plan(t, *want) and (id(owner), leaf) not in seen:
                    seen.add((id(owner), leaf))
                    todo.append((full, owner, leaf, t, want))
    check_fits([(full, t, want[0]) for full, _, _, t, want in todo], f"setting {prefix}",
               "nothing was set")
    for full, owner, leaf, t, want in todo:
        _put(owner, leaf, t, in_layout(t, *want))
    for sub, owner in module.named_modules(remove_duplicate=False):
        _PLANNED[owner] = (planned, _joined(prefix, sub), copies, converted)
        _checks_loads(owner)
    if copies is not None:
        for full, *_ in todo:
            copies.invalidate(full)
        for source, copy_path in copies.pairs:
            if source.startswith(prefix + ".") or copy_path.startswith(prefix + "."):
                copies.invalidate(source)
    return module  # (registered in place of the caller's)


def _refuse_other_tensors(planned: dict, prefix: str, module: torch.nn.Module,
                          stacks: set, low: Optional[torch.dtype]) -> None:
    """A module swapped in where the graph inlined the one it replaces (torch.export, or a
    traced-through submodule) is read tensor by tensor: one without every tensor the graph
    reads failed inside the generated code (a bare ``KeyError: 'weight'``), and one holding
    more (a LoRA wrapper) would have been silently ignored beyond them. Where the graph calls
    it whole in ``low`` (fx), its own code would run in that dtype, never checked there (a
    hand-written RMSNorm overflowed fp16: 0.996 off, no error)."""
    # (FuseSiblingGemv's stacks are mpgraph's, built again from their members on the next call)
    old = {p for p in planned if p.startswith(prefix + ".") and p not in stacks}
    new = {_joined(prefix, sub, leaf)
           for sub, owner in module.named_modules(remove_duplicate=False)
           for leaf, t in (*owner._parameters.items(), *owner._buffers.items()) if t is not None}
    if not old or old == new:
        return
    def listed(paths):
        return ", ".join(paths[:3]) + (" ..." if len(paths) > 3 else "")
    if low is not None:
        how = (f"calls the module it replaces in {dtype_name(low)}, and this one's code was "
               f"never checked in {dtype_name(low)} (its tensors {listed(sorted(new))} are not "
               f"the plan's {listed(sorted(old))})")
    else:
        missing, extra = sorted(old - new), sorted(new - old)
        said = "; ".join(
            ([f"it lacks {listed(missing)}, which the graph reads"] if missing else [])
            + ([f"it holds {listed(extra)}, which the graph would never read"] if extra else []))
        how = ("computes the module it was converted with, inlined, reading its tensors by "
               f"path ({said})")
    raise TypeError(
        f"setting {prefix} to {type(module).__name__}(...), of another structure: the converted "
        f"graph {how}. Convert the model with the new {prefix.rpartition('.')[2]} in place, "
        "or call the new module on the converted module's outputs, outside it")


def own_parametrizations(root: torch.nn.Module) -> None:
    """Give each parametrized submodule of ``root`` (a deep copy) a class and properties of its
    own. torch.nn.utils.parametrize makes one class per parametrized module, whose property keys
    ``parametrize.cached()``'s slot by the module it was registered on: deep copies keep that
    class, so a copy read and wrote its original's slot (the user's model computed with the
    converted module's float16 weight, or the other way round) and ``remove_parametrizations``
    on the copy deleted the original's property. Copies of a module owned here own theirs."""
    from torch.nn.utils import parametrize
    for module in root.modules():
        if parametrize.is_parametrized(module):
            _own_parametrizations(module)


def _own_parametrizations(module: torch.nn.Module) -> None:
    from torch.nn.utils import parametrize
    module.__class__ = parametrize.type_before_parametrizations(module)
    parametrize._inject_new_class(module)
    for name in module.parametrizations:
        parametrize._inject_property(module, name)
    deepcopy = type(module).__deepcopy__  # (torch's, or the module class's own)

    def owned_deepcopy(self, memo):
        fresh = id(self) not in memo
        replica = deepcopy(self, memo)
        if fresh:
            _own_parametrizations(replica)
        return replica
    type(module).__deepcopy__ = owned_deepcopy


# what convert sets on a converted module after its call signature (and copies set again): its
# own, not the model's attribute of that name (a model's ``self.plan``), which it replaces
_OWN = frozenset({"plan", "tied_parameters", "fused_weights"})


class ConvertedModule(torch.fx.GraphModule):
    """The class of what capture and convert return: a GraphModule whose parameters carry the
    plan's dtypes (low ones for low nodes, float32 for the rest, read through the graph's
    casts), so a module-wide dtype change (``.half()``, ``.to(torch.float16)``) is refused with
    what to do instead; moving it to a device (``.to("cuda")``) is what ``to`` is for."""

    @classmethod
    def wrap(cls, gm: torch.fx.GraphModule) -> "ConvertedModule":
        """``gm`` as a ConvertedModule: same graph, attributes, pytree specs and meta."""
        new = cls(gm, gm.graph, class_name=type(gm).__name__)
        for key in ("_in_spec", "_out_spec"):
            if hasattr(gm, key):
                setattr(new, key, getattr(gm, key))
        new.meta = gm.meta
        if "call_signature" in gm.__dict__:
            new.call_signature = gm.call_signature
        if "config" in gm.__dict__:
            new.config = gm.config
        new._tracer_cls = None  # torch.export's own tracer cannot re-trace a pickled module
        return new

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            signature = self.__dict__.get("call_signature")
            model = signature.model if signature is not None else "model"
            plan = self.__dict__.get("plan")
            trained = (" (a training conversion trains its own copy of the weights: load "
                       "them into it first, model.load_state_dict(converted.state_dict()))"
                       if getattr(plan, "mode", None) == "train" else "")
            raise AttributeError(
                f"the converted {model} has no attribute {name!r}: a converted module keeps the "
                "model's forward (as its graph) and its weights, not the model's other methods "
                f"and attributes (a HuggingFace model's config is kept). Use them on the {model} "
                f"itself{trained}; to generate text, mpgraph.convert_decoder(model, ...)"
                ".generate") from None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # values that would be inf in the dtype the plan stored them in: an error, before
        # anything is written (a float16 slot is float16 for good; 1e5 there is inf)
        check_fits(self._planned_slots(state_dict), "load_state_dict", "nothing was loaded")
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:  # the tensors assigned as they came: back to the dtypes the plan stored
            self.restore_planned_dtypes()
            self._retie()
        refresh_fused(self)  # now, not on the next call: forward() and exports read the stack too
        return result

    def _retie(self) -> None:
        """After ``assign=True``: names that held one parameter (tied) and were given equal
        copies (a state dict of clones, from safetensors) hold one again, the first name's, as
        HF's tie_weights does: the graph reads one of them for all, and training the others
        would change nothing (the next call refused them). Unequal ones are left to the call's
        check."""
        from mpgraph.ir.graph import set_attr
        for names in self.__dict__.get("tied_parameters", ()):
            first = self.get_parameter(names[0])
            for name in names[1:]:
                other = self.get_parameter(name)
                if other is not first and other.shape == first.shape \
                        and torch.equal(other, first):
                    set_attr(self, name, first)

    def _planned_slots(self, state_dict) -> list:
        """``planned_slots`` of a state dict for the whole module."""
        current = None

        def dtype_now(path: str):  # (a plan without planned_tensors, or a tensor added since)
            nonlocal current
            if current is None:
                current = {p: t.dtype for p, t in [*self.named_parameters(remove_duplicate=False),
                                                   *self.named_buffers(remove_duplicate=False)]}
            return current.get(path)

        return planned_slots(self.__dict__.get("planned_tensors") or {}, "", state_dict,
                             self.__dict__.get("weight_copies"), dtype_now)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        if "_cpu_linears" in self.__dict__:  # (.to(): no host pack outlives its weights' move)
            self.cpu_linears.clear()
        if self.__dict__.get("planned_tensors"):
            refresh_fused(self)  # (.to(device): the members moved apart from their stack)
        return result

    def restore_planned_dtypes(self, prefix: str = "") -> list[str]:
        """Tensors (under ``prefix``) that were replaced by ones of another dtype or layout than
        the plan stored (written through ``.data``, a submodule's ``.half()``) converted back to
        the plan's; returns their paths. (Assignments, ``load_state_dict(assign=True)`` and
        submodules swapped in take the plan's dtypes as they are made.) Values that would
        overflow the plan's dtype are a WeightOverflowError, before anything is converted."""
        planned = self.__dict__.get("planned_tensors") or {}
        todo = []
        for path, (dtype, layout) in planned.items():
            if not path.startswith(prefix):
                continue
            owner_path, _, leaf = path.rpartition(".")
            try:
                owner = self.get_submodule(owner_path)
            except AttributeError:
                continue
            t = owner._parameters.get(leaf, owner._buffers.get(leaf))
            if _off_plan(t, dtype, layout):
                todo.append((path, owner, leaf, t, dtype, layout))
        check_fits([(path, t, dtype) for path, _, _, t, dtype, _ in todo],
                   "restore_planned_dtypes", "nothing was converted")
        copies = self.__dict__.get("weight_copies")
        for path, owner, leaf, t, dtype, layout in todo:
            _put(owner, leaf, t, in_layout(t, dtype, layout))
            if copies is not None:
                copies.invalidate(path)
        return [path for path, *_ in todo]

    def __setattr__(self, name, value):
        if isinstance(value, torch.nn.Module) and name in self.__dict__.get("_modules", {}):
            super().__setattr__(name, value)  # a submodule swapped in: in the plan's dtypes
            self.restore_planned_dtypes(prefix=name + ".")  # (keep_planned's hook did it)
            return
        if name in ("planned_tensors", "weight_copies"):  # (convert, copy.copy, deepcopy)
            super().__setattr__(name, value)
            keep_planned(self)
            return
        if name == "call_signature":
            super().__setattr__(name, value)
            self._fixed_defaults()
            if value is not None:
                _mark_traced_through(self, value)
            return
        signature = self.__dict__.get("call_signature")
        if signature is not None and name in signature.attributes and name not in _OWN \
                and not _same(value, signature.attributes[name]):
            _warn_attribute_ignored(f"{signature.model}.{name}", signature.attributes[name], value)
        super().__setattr__(name, value)

    def __call__(self, *args, **kwargs):
        if torch._C._is_any_autocast_enabled():  # (~0.2 us; dynamo guards on autocast's state)
            devices = self._autocast_devices(args, kwargs)
            if devices:
                return self._call_without_autocast(devices, args, kwargs)
        return self._call(args, kwargs)

    def _call_without_autocast(self, devices: list, args: tuple, kwargs: dict):
        """The call with torch.autocast off for each of ``devices`` (asked once a call)."""
        with torch.autocast(devices[0], enabled=False):
            if len(devices) > 1:
                return self._call_without_autocast(devices[1:], args, kwargs)
            return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict):
        """The call's input checks, the weight copies' refresh, and the graph."""
        if "_has_values" not in self.__dict__ and self.meta.get(TRACED_ON) not in (None, "meta"):
            self._check_has_values()
        if not torch.compiler.is_compiling() and torch._C._is_tracing() \
                and not self.__dict__.get("_said_jit_trace"):  # (dynamo cannot trace that)
            self._say_jit_trace_fixes_sizes()
        signature = self.__dict__.get("call_signature")
        if signature is not None:
            args, kwargs = signature.check(args, kwargs)
        if GRAD_MODES in self.meta:
            self._check_grad_mode(*self.meta[GRAD_MODES])
        wanted = self.__dict__.get("_input_dtypes")
        if wanted:  # (under torch.compile: a guard on each input's dtype, which dynamo keeps)
            for value in (*args, *kwargs.values()):  # (a tensor in a list: the except below)
                if isinstance(value, torch.Tensor) and value.is_floating_point() \
                        and value.dtype not in wanted:
                    self._refuse_input_dtypes(args, kwargs)
                    break
        for name, (index, dtype, rank) in self.__dict__.get("_input_kinds", {}).items():
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):  # (~0.5 us an input)
                if value.dtype is not dtype and _kind(value.dtype) != _kind(dtype):
                    self._refuse_input_kind(name, value.dtype, dtype)
                if rank is not None and value.dim() != rank:
                    self._refuse_input_rank(name, value.dim(), rank)
        nested = self.__dict__.get("_nested_kinds")
        if nested:  # (a tensor in a dict or list argument: ~10 us, only for such arguments)
            off = self._inputs_off_kind(args, kwargs, nested)
            if off:
                self._refuse_input_kind(*off)
        for names in self.__dict__.get("tied_parameters", ()):
            self._check_tied(names)
        copies = self.__dict__.get("weight_copies")
        if copies is not None:
            copies.refresh(self)
        refresh_fused(self)
        try:
            return super().__call__(*args, **kwargs)
        except (AssertionError, IndexError) as e:  # torch.export's input guard (_guards_fn)
            off = self._inputs_off_rank(args, kwargs)  # (an item of a container: size()[2])
            if off:
                raise _rank_error(off) from None
            if not str(e).startswith("Guard failed"):
                raise
            raise guard_error(self, str(e)) from None
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # a tensor put in place of a planned one, in another dtype?
            # (any RuntimeError: a conv's says "Input type (c10::BFloat16) and bias type ...")
            if "Batching rule not implemented for aten::sym_size" in str(e):
                raise _vmap_error(self._model_name()) from None
            changed = self.unplanned_tensors()
            if not changed:
                off = self._inputs_off_dtype(args, kwargs)
                if off:  # (the model's own cast of it, a branch on its dtype, was traced out)
                    raise _off_dtype_error(
                        off, f" ({type(e).__name__}: {str(e).splitlines()[0]})") from None
                raise
            raise self._off_plan_error(changed, e) from None

    def _say_jit_trace_fixes_sizes(self) -> None:
        """torch.jit.trace of a graph that computes sizes as Python numbers (torch.export's
        ``sym_size`` nodes) records the example's sizes as constants: the traced module failed
        at other shapes deep inside torch (shape '[16, 16, 8]' is invalid for input of size
        576), or, with as many elements, could compute other values (probe pB F4). Said once."""
        self.__dict__["_said_jit_trace"] = True
        if not computes_sizes(self.graph):
            return
        name = self._model_name()
        warnings.warn(
            f"torch.jit.trace of the converted {name} records the example's sizes as constants "
            "(its graph computes sizes such as batch and sequence length as Python numbers): "
            "the traced module is right at the example's shapes only (other shapes fail, or "
            "with as many elements compute other values). For other shapes use "
            "torch.export.export(converted, ...), torch.compile, or mpgraph.export_onnx",
            UserWarning, stacklevel=caller_outside(os.path.dirname(torch.__file__),
                                             os.path.dirname(os.path.dirname(__file__))))

    @compiler_disable("mpgraph: a call inside torch.autocast, which the converted module turns off "
                      "for its graph (said once): call it outside torch.autocast")
    def _autocast_devices(self, args: tuple, kwargs: dict) -> list[str]:
        """The device types whose torch.autocast the call is inside, of those the module computes
        on (its first tensor's, its inputs'), said once per module: the plan decides each node's
        precision, and autocast would run its float32 nodes low too (silently), or, of the other
        low dtype, fail inside torch ("mixed dtype" in layer_norm). The graph runs with autocast
        off, as the model was converted. (Autocast for another device changes nothing here.)"""
        first = next(itertools.chain(self.parameters(), self.buffers()), None)
        used = {t.device.type for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)} | ({first.device.type} if first is not None else set())
        on = [d for d in autocasting() if d in used or not used]
        if on and not self.__dict__.get("_said_autocast"):
            self.__dict__["_said_autocast"] = True
            name = self._model_name()
            dtypes = ", ".join(f"torch.autocast({d!r}, dtype={torch.get_autocast_dtype(d)})"
                               for d in on)
            warnings.warn(
                f"the converted {name} was called inside {dtypes}: a converted module decides "
                "its own precision (its plan puts each node low or in float32), so it runs with "
                "autocast off. Call it outside torch.autocast (what you compute around it "
                "still autocasts)", UserWarning, stacklevel=4)
        return on

    def _check_grad_mode(self, where: str, captured: str, differ: tuple) -> None:
        """A call in a grad mode where the model computes other values than the graph, which
        keeps the branch its forward took on torch.is_grad_enabled() or
        torch.is_inference_mode_enabled() at capture (capture's _grad_modes_differ)."""
        now = grad_mode()
        if now not in differ:
            return
        name = self._model_name()
        called = {"grad": "with grad enabled", "no_grad": "under torch.no_grad()",
                  "inference_mode": "under torch.inference_mode()"}
        way = ("convert it under torch.no_grad() and call it under torch.no_grad() (conversion "
               "runs outside inference mode, so no graph takes that branch)"
               if now == "inference_mode" else
               f"convert it {called[now]} too (with torch."
               f"{'enable_grad' if now == 'grad' else 'no_grad'}(): mpgraph.convert(...))")
        raise InputMismatchError(
            f"{name}'s forward branches on the grad mode ({where}): the graph keeps the branch "
            f"it took when captured {called[captured]}, and {called[now]} the model computes "
            f"other values (on the example inputs). Call it {called[captured]}, {way}, or pass "
            "the choice to forward as an argument")

    def _check_has_values(self) -> None:
        """A module planned on meta computes only once every tensor has a value: CPU kernels
        read a meta operand as uninitialised memory (garbage or NaN, no error). Walked on each
        call until every tensor is real, then never again (a flag)."""
        empty = [path for path, t in module_tensors(self)
                 if (t.to_local() if is_dtensor(t) else t).is_meta]
        made = forward_constants(empty)
        if made:
            raise MissingWeightsError(made)
        if empty:
            raise MissingWeightsError(
                f"{len(empty)} tensors of the converted module have no value (it was planned on "
                f"the meta device): {', '.join(empty[:10])}" + (" ..." if len(empty) > 10 else "")
                + ": load them before calling it, mpgraph.load_weights(module, weights) (with "
                "strict=True it names any it did not find; non-persistent buffers, such as "
                "position ids or rotary inv_freq, are in no checkpoint: build them for real "
                "beside the meta parameters, or pass them in a dict)")
        self.__dict__["_has_values"] = True

    @compiler_disable(
        "mpgraph: a float input in another dtype than the converted module was converted with "
        "(the call raises a TypeError naming it): pass it in the dtype it was converted with")
    def _refuse_input_dtypes(self, args: tuple, kwargs: dict) -> None:
        """A TypeError naming the float inputs in another dtype than at conversion, before the
        graph runs: the model's own cast of an input (or a branch on its dtype) was traced out,
        and under torch.compile the graph's failure on them is dynamo's, not this module's."""
        off = self._inputs_off_dtype(args, kwargs)
        if off:
            raise _off_dtype_error(off, "")

    @compiler_disable(
        "mpgraph: an input in another kind of dtype (integer, bool, float) than the converted "
        "module was converted with (the call raises a TypeError naming it)")
    def _refuse_input_kind(self, name: str, got: torch.dtype, want: torch.dtype) -> None:
        """An input whose dtype is of another kind than at conversion (uint8 pixels where float
        ones were converted, a bool mask for an additive one): the graph holds what the model
        did with the example's kind, a branch on its dtype included, checked even where the
        model's code casts or reads dtypes (which lifts the float dtype check)."""
        raise _off_dtype_error([(name, got, want)], "", kind=True)

    @compiler_disable(
        "mpgraph: an input in another number of dimensions than the converted module was "
        "converted with (the call raises an InputMismatchError naming it)")
    def _refuse_input_rank(self, name: str, got: int, want: int) -> None:
        """An input of another rank than at conversion: torch.export's guard indexed a missing
        dimension (a bare IndexError) or named a size, not the rank."""
        raise _rank_error([(name, got, want)])

    def _placed_inputs(self, args: tuple, kwargs: dict) -> list:
        """(placeholder, value) of each flat input of a call, or [] for inputs that do not map
        onto the graph's (the call itself says why)."""
        from mpgraph.ir.graph import flat_inputs
        try:
            values = flat_inputs(self, args, kwargs)
        except Exception:  # noqa: BLE001 (inputs that do not map: nothing to say here)
            return []
        return list(zip((n for n in self.graph.nodes if n.op == "placeholder"), values))

    def _inputs_off_kind(self, args: tuple, kwargs: dict, nested: dict) -> Optional[tuple]:
        """(placeholder, dtype given, dtype converted with) of the first tensor inside a
        container argument whose dtype is of another kind than at conversion, or None."""
        placed = self._placed_inputs(args, kwargs)
        for index, (name, dtype) in nested.items():
            value = placed[index][1] if index < len(placed) else None
            if isinstance(value, torch.Tensor) and _kind(value.dtype) != _kind(dtype):
                return name, value.dtype, dtype
        return None

    def _inputs_off_rank(self, args: tuple, kwargs: dict) -> list:
        """(placeholder, rank given, rank converted with) of the inputs of a torch.export graph
        in another number of dimensions than at conversion."""
        if getattr(self.graph._codegen, "pytree_info", None) is None:
            return []  # (symbolic_trace's graph computes any rank the model's code does)
        return [(node.name, v.dim(), rank) for node, v in self._placed_inputs(args, kwargs)
                if isinstance(v, torch.Tensor) and (rank := _rank(node)) is not None
                and v.dim() != rank]

    def _inputs_off_dtype(self, args: tuple, kwargs: dict) -> list:
        """(placeholder, dtype given, dtype converted with) of float inputs whose dtype is not
        the one the graph was converted with."""
        return [(node.name, v.dtype, info.dtype) for node, v in self._placed_inputs(args, kwargs)
                if isinstance(v, torch.Tensor) and v.is_floating_point()
                and isinstance(info := node.meta.get(TENSOR), TensorInfo)
                and info.dtype.is_floating_point and info.dtype != v.dtype
                and not _cast_only(node)]

    def _check_tied(self, names: tuple) -> None:
        """Names that held one parameter when converted still hold the same values (the graph
        reads one of them for all): one tensor, or equal ones (``load_state_dict(assign=True)``
        sets each name its own copy), compared once per change of them."""
        # (by attribute: torch.func.functional_call puts plain tensors in for one call)
        held = [getattr(*_owner(self, n)) for n in names]
        if all(t is held[0] for t in held[1:]):
            return
        stamp = tuple((id(t), t._version) for t in held)
        seen = self.__dict__.setdefault("_tied_seen", {})
        if seen.get(names) == stamp:
            return
        if not all(t.shape == held[0].shape and torch.equal(t, held[0]) for t in held[1:]):
            raise TypeError(
                f"{' and '.join(names)} were one parameter (tied) when the model was "
                "converted, and the converted graph reads it once for all of them: a tensor "
                "set under one name alone is read for every one or for none. Write new values "
                f"into the tied tensor (fast.get_parameter({names[0]!r}).copy_(...) under "
                "torch.no_grad(), or load_state_dict), or untie them in the model and convert it")
        seen[names] = stamp

    def _off_plan_error(self, changed: list, e: RuntimeError) -> TypeError:
        """The error for the tensors at paths ``changed``, not in the plan's dtypes: put in by
        torch.func.functional_call (the tensors it was given), or written by the user."""
        on_stack, given = _swapped_in()
        if on_stack and given is None:  # (cannot tell which: both causes, both ways out)
            said = [f"{_names(changed)} not in the dtype the plan stored: either "
                    f"{_SWAPPED} {_SWAPPED_FIX}, or {_WRITTEN} {_WRITTEN_FIX}"]
        else:
            tensors = dict(self.named_parameters(remove_duplicate=False))
            tensors.update(self.named_buffers(remove_duplicate=False))
            theirs = [p for p in changed if on_stack and id(tensors.get(p)) in given]
            others = [p for p in changed if p not in theirs]
            said = ([f"{_names(theirs)} not in the dtype the plan stored: {_SWAPPED}. "
                     f"{_SWAPPED_FIX[0].upper()}{_SWAPPED_FIX[1:]}"] if theirs else []) + \
                ([f"{_names(others)} not in the dtype the plan stored ({_WRITTEN}?): "
                  f"{_WRITTEN_FIX}"] if others else [])
        return TypeError("; ".join(said) + f" ({type(e).__name__}: {str(e).splitlines()[0]})")

    def unplanned_tensors(self) -> list[str]:
        """Paths of parameters and buffers whose dtype is not the one the plan stored."""
        planned = self.__dict__.get("planned_tensors") or {}
        found = dict(self.named_parameters(remove_duplicate=False))
        found.update(self.named_buffers(remove_duplicate=False))
        return [p for p, (dtype, _) in planned.items() if p in found and found[p].dtype != dtype]

    def __copy__(self):
        # (ConvertedModule's wrap, not type(self)'s: fx makes each instance's class anew, and an
        # object of a class that is not type(self)'s subclass was returned uninitialised)
        new = ConvertedModule.wrap(self)
        # (wrap copies what the graph reads: a tensor only the state dict or the weight-copy
        # refresher reads, the float32 bias of a layer read in float16, was left out)
        _copy_tensors(new, self)
        for name, value in self.meta.get("_user_preserved_attributes", {}).items():
            setattr(new, name, value)
        if "fused_weights" in new.__dict__:
            new.fused_weights = copy.copy(new.fused_weights)
            new.fused_weights.adopt(new, self)
        _keep_non_persistent(new, self)
        refuse_hooks(new)  # (on the submodules wrap made anew, as on the original's)
        return new

    def __reduce_ex__(self, protocol):
        # GraphModule pickles its code and re-traces it on loading, with fx's plain tracer:
        # torch.export's graphs do not re-trace, and what the converted module checks on each
        # call would be lost
        raise TypeError(
            "a converted module does not pickle (torch.save(module), multiprocessing): save its "
            "plan and its weights instead, fast.plan.save('plan.json') and "
            "torch.save(fast.state_dict(), 'weights.pt'), and make it again with "
            "mpgraph.convert(model, inputs, plan=mpgraph.Plan.load('plan.json')) and "
            "load_state_dict(torch.load('weights.pt')); copy.deepcopy works")

    def __deepcopy__(self, memo):
        with pytree_copies_quiet():
            new = super().__deepcopy__(memo)
        if "fused_weights" in new.__dict__:
            new.fused_weights.adopt(new, self)
        _keep_non_persistent(new, self)
        _keep_call_hooks(new, self)
        refresh_weights(new)  # (a copy may be traced before it is called: a capture of a model
        # holding it, an export)
        return new

    @property
    def cpu_linears(self):
        """The weights this module's bf16 linears run over, packed (``ir/cpu_linear``):
        ``clear()`` after writing a weight through ``.data``."""
        from mpgraph.ir.cpu_linear import cpu_linears_of
        return cpu_linears_of(self)

    def recompile(self):
        """GraphModule's code, with each parameter and buffer read as a lookup in the dict that
        holds it (``self._modules['encoder']._modules['0']._parameters['weight']``) instead of a
        chain of ``nn.Module.__getattr__`` calls: the same objects, read from where
        ``load_state_dict``, ``.to()``, FSDP and ``setattr`` put them, at ~0.3 us less per
        module level per weight per call (eager GPU runs are host-bound: tiny-width ConvNeXt,
        126 weights, 2.75 -> 2.21 ms per call on a CPU). Reads that are neither (a submodule, a
        plain attribute) keep fx's own code."""
        with self.graph.on_generate_code(lambda previous: _direct_reads(self, previous)):
            code = super().recompile()
        # GraphModule's own __call__ wrapper prints the generated code around any error raised
        # inside it to stderr, then raises it: this class's __call__ says what went wrong instead
        type(self).__call__ = _own_call()
        self._fixed_defaults()
        # the float dtypes the inputs were converted with (checked on each call, in __call__);
        # none when the model's own code casts or reads a dtype: it may take other dtypes
        # (nor those the plan's casts alone read; under torch.compile the check of one sent
        # every call through a graph break, and fullgraph refused it)
        self.__dict__["_input_dtypes"] = frozenset() if _reads_dtypes(self.graph) else frozenset(
            info.dtype for n in self.graph.nodes if n.op == "placeholder"
            and isinstance(info := n.meta.get(TENSOR), TensorInfo) and info.dtype.is_floating_point
            and not _cast_only(n))
        self.__dict__["_input_kinds"], self.__dict__["_nested_kinds"] = _input_kinds(self)
        return code

    def _fixed_defaults(self) -> None:
        """The graph's last inputs that take a value fixed at capture (torch.export keeps
        ``use_cache=False`` an input) given it as their default, in the graph (fx's placeholder
        default): ``fast.forward(ids)``, and ``torch.export.export(fast, (ids,))``, which binds
        against forward's signature and runs the graph on fx's Interpreter, not ``__call__``,
        then find it as ``fast(ids)`` does; they failed on a missing 'use_cache'."""
        signature = self.__dict__.get("call_signature")
        if signature is None:
            return
        changed = False
        for node in reversed([n for n in self.graph.nodes if n.op == "placeholder"]):
            name = str(node.target)
            if name not in signature.fixed or name in signature.tensors \
                    or not isinstance(signature.fixed[name], (bool, type(None))):
                break
            if not node.args:
                node.args, changed = (signature.fixed[name],), True
        if not changed:
            return
        codegen = self.graph._codegen
        if type(codegen) is _PyTreeCodeGen:
            self.graph._codegen = _DefaultsPyTreeCodeGen(codegen.pytree_info)
        self.recompile()

    def _refuse(self, call: str, dtype: Optional[torch.dtype] = None):
        plan = getattr(self, "plan", None)
        planned = str(plan.dtype).replace("torch.", "") if plan is not None else "its low dtype"
        if plan is not None and plan.mode == "train":
            held = (f"its float32 master weights (cast to {planned} inside the graph where nodes "
                    f"compute in {planned}; read as they are by its float32 nodes)")
        else:
            held = (f"the dtypes its plan gave each parameter ({planned} where nodes compute in "
                    f"{planned}, float32 elsewhere) under the graph's casts")
        way = ("A converted module computes in float32 and its low dtype: for float64, use the "
               "model itself" if dtype == torch.float64 else
               "Convert the model again with the dtype you want: mpgraph.convert(model, ..., "
               "dtype=...)")
        return TypeError(f"{call} on a converted module would change {held}. {way}; .to(device) "
                         "moves it")

    def train(self, mode: bool = True):
        meta = self.__dict__.get("meta", {})
        removed = meta.get(EVAL_ONLY)
        readers, captured = meta.get(READS_TRAINING, ((), mode))
        name = self._model_name()
        norms = [path for path, m in self.named_modules() if isinstance(
            m, (torch.nn.modules.batchnorm._BatchNorm, TrainingBatchNorm))] if mode else []
        if mode and removed:
            low = self._low_running_stats() if not self.training else []
            switches = (f", except batch norm ({', '.join(norms[:3])}), which switches to the "
                        "batch's statistics and updates its running statistics"
                        + (f" (stored in low precision: {', '.join(low[:3])})" if low else "")
                        + "; .eval() does not put them back") if norms else ""
            warnings.warn(f"{name}.train(): this module was converted for "
                          f"inference from a model in eval mode ({removed}, other reads of "
                          "self.training fixed at trace time): it keeps computing as in eval "
                          f"mode{switches}. To train, convert with mpgraph.convert(model, ..., "
                          "mode='train')", UserWarning, stacklevel=2)
        elif mode and not self.training and (low := self._low_running_stats()):
            warnings.warn(f"{name}.train(): this inference conversion stores batch norm's "
                          f"running statistics ({', '.join(low[:3])}) in "
                          "low precision, and in training mode batch norm updates them there "
                          "(they drift from float32's). To train, convert with "
                          "mpgraph.convert(model, ..., mode='train')", UserWarning, stacklevel=2)
        if readers and mode != captured and not (mode and removed):
            warnings.warn(f"{name}.{'train' if mode else 'eval'}(): the forward of "
                          f"{', '.join(readers[:3])} reads self.training, and the graph keeps the "
                          f"branch it took when captured in {'training' if captured else 'eval'} "
                          "mode (dropout and batch norm do switch). Convert the model in the mode "
                          "you run it in", UserWarning, stacklevel=2)
        return super().train(mode)

    def _low_running_stats(self) -> list[str]:
        """Batch norm running statistics this module stores in fp16/bf16 (an inference plan's:
        in eval mode batch norm only reads them)."""
        return [path for path, b in self.named_buffers()
                if path.rpartition(".")[2] in ("running_mean", "running_var")
                and b.dtype in (torch.float16, torch.bfloat16)]

    def requires_grad_(self, requires_grad: bool = True):
        plan = getattr(self, "plan", None)
        if requires_grad and plan is not None and plan.mode == "inference" and any(
                p.dtype in (torch.float16, torch.bfloat16) for p in self.parameters()):
            warnings.warn(
                "requires_grad_() on a module converted for inference: its low-precision "
                "parameters are rounded copies, and an optimizer step on them rounds most updates "
                "away (1.9% of a bf16 weight's elements changed in 5 SGD steps at lr 1e-3). To "
                "train, convert with mpgraph.convert(model, ..., mode='train') (float32 masters)",
                UserWarning, stacklevel=2)
        return super().requires_grad_(requires_grad)

    def _model_name(self) -> str:
        """The converted model's class name, for messages (this class's where none was kept)."""
        signature = self.__dict__.get("call_signature")
        return signature.model if signature is not None else type(self).__name__

    def half(self):
        if self._holds_only(torch.float16):  # (as .float() and .bfloat16(): nothing to change)
            return self
        raise self._refuse(".half()")

    def __prepare_scriptable__(self):
        """torch.jit.script compiles every method of the class, mpgraph's own included, and
        failed on their source ("import statements aren't supported"): refused by name."""
        raise TypeError("torch.jit.script cannot compile a module mpgraph converted (its class "
                        "holds mpgraph's own Python, which TorchScript does not take): use "
                        "torch.compile(fast), torch.export.export(fast, args), "
                        "mpgraph.export_onnx(model, args, path), or torch.jit.trace(fast, args) "
                        "(shapes fixed at the example's)")

    def _holds_only(self, dtype: torch.dtype) -> bool:
        """Whether every floating parameter and buffer already has ``dtype`` (a training
        conversion's float32 masters and ``.float()``): then a dtype change changes nothing."""
        return all(t.dtype == dtype for t in (*self.parameters(), *self.buffers())
                   if t.is_floating_point())

    def float(self):
        if self._holds_only(torch.float32):
            return self
        raise self._refuse(".float()")

    def bfloat16(self):
        if self._holds_only(torch.bfloat16):
            return self
        raise self._refuse(".bfloat16()")

    def double(self):
        raise self._refuse(".double()", torch.float64)

    def type(self, dst_type):
        if isinstance(dst_type, torch.dtype) and self._holds_only(dst_type):
            return self
        raise self._refuse(f".type({dst_type})", dst_type)

    def to(self, *args, **kwargs):
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and not self._holds_only(dtype):
            raise self._refuse(f".to({dtype})", dtype)
        return super().to(*args, **kwargs)


class _DefaultsPyTreeCodeGen(_PyTreeCodeGen):
    """torch.export's code generator, with the placeholders' defaults in forward's signature
    (``forward(self, input_ids, use_cache=False)``): fx's own writes them into the line that
    unpacks the inputs, which is then no Python."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def=False):
        if self.pytree_info is None:
            return super().gen_fn_def(free_vars, maybe_return_annotation,
                                      expanded_def=expanded_def)
        names, defaults = [], {}
        for var in free_vars:
            name, sep, default = var.partition(" = ")
            names.append(name)
            if sep:
                defaults[name.split(":")[0].strip()] = default
        fn_args = list(self.pytree_info.orig_args)
        if fn_args and fn_args[0] == "self":
            names.insert(0, "self")
        code = CodeGen.gen_fn_def(
            self, [f"{a} = {defaults[a]}" if a in defaults else a for a in fn_args],
            maybe_return_annotation, expanded_def=expanded_def)
        if names:
            code += self.gen_var_bindings(fn_args, names, expanded_def)
        return code


def _cast_only(placeholder: torch.fx.Node) -> bool:
    """An input the plan's casts alone read: it takes any float dtype (they give it the planned
    one; a float16 input to an fp16 plan computes exactly what a float32 one does)."""
    return bool(placeholder.users) and all(is_inserted_cast(u) for u in placeholder.users)


_CAST_METHODS = frozenset(("float", "double", "half", "bfloat16", "to", "type", "type_as"))
_CAST_OPS = frozenset(("_to_copy", "to", "type_as", "_autocast_to_full_precision",
                       "_autocast_to_reduced_precision"))


def _reads_dtypes(graph: torch.fx.Graph) -> bool:
    """Whether the model's own code in ``graph`` casts a value or reads a dtype (not the plan's
    casts): ``self.fc(x.float()).to(x.dtype)`` takes any float input, and the check on inputs
    before the call would refuse what it computes right."""
    for node in graph.nodes:
        if is_inserted_cast(node):
            continue
        if node.op == "call_method" and node.target in _CAST_METHODS:
            return True
        if node.op == "call_function":
            if node.target is getattr and len(node.args) > 1 and node.args[1] == "dtype":
                return True
            if isinstance(node.target, torch._ops.OpOverload) \
                    and node.target._schema.name.partition("::")[2] in _CAST_OPS:
                return True
    return False


_SWAPPED = ("torch.func.functional_call put them in for this call as given, which nothing "
            "casts")
_SWAPPED_FIX = ("pass the tensors in the converted module's dtypes: functional_call(model, "
                "{k: v.to(model.state_dict()[k].dtype) for k, v in params.items()}, args) (the "
                "cast is differentiable: gradients reach your float32 tensors)")
_WRITTEN = "written through .data, or a submodule's .half() or .float()"
_WRITTEN_FIX = ("call module.restore_planned_dtypes(), or load weights with load_state_dict "
                "(which casts) or by assignment (which takes the plan's dtype)")


def _names(paths: list) -> str:
    return f"{', '.join(paths[:3])} {'is' if len(paths) == 1 else 'are'}"


def _swapped_in() -> tuple[bool, Optional[set]]:
    """Whether this call runs inside torch.func.functional_call (torch.nn.utils.stateless), which
    puts its tensors straight into the modules' dicts for one call, past the cast to the plan's
    dtypes that an assignment makes, and the ids of the tensors it was given (read from its
    frame; None where they cannot be read). The error path only."""
    import torch._functorch.functional_call
    import torch.nn.utils.stateless
    files = {torch.nn.utils.stateless.__file__, torch._functorch.functional_call.__file__}
    on_stack, given = False, None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename in files:
            on_stack = True
            passed = frame.f_locals.get("parameters_and_buffers") \
                if frame.f_code.co_name == "_functional_call" else None
            if isinstance(passed, dict):  # (each call's, nested ones too)
                given = (given or set()) | {id(t) for t in passed.values()}
        frame = frame.f_back
    return on_stack, given


def _off_dtype_error(off: list, detail: str, kind: bool = False) -> TypeError:
    """The error for inputs ``(name, dtype given, dtype converted with)`` in another dtype;
    ``kind``: another kind of dtype, which a cast does not make the same input (uint8 pixels)."""
    was = dtype_name(off[0][2])
    way = (f"it holds what the model's code did with {'an' if was.startswith('int') else 'a'} "
           f"{was} input (a branch on its dtype, if x.dtype == torch.uint8: ..., took the "
           "example's way; a cast the plan put first reads any kind): pass it as the example "
           "was (uint8 pixels as x.float() / 255), or convert with an example of this kind of "
           "dtype (one converted module per kind)" if kind else
           "pass it in that dtype (x.float()), or convert with an example in this one")
    return TypeError(
        "; ".join(f"input {name} is {dtype_name(got)}, it was {dtype_name(want)} when the model "
                  "was converted" for name, got, want in off[:3])
        + f": the converted graph computes with the dtypes it was converted with; {way}{detail}")


def _vmap_error(name: str) -> TypeError:
    """torch.vmap over a dynamic-shape export graph: it reads sizes through
    ``aten.sym_size.int``, which functorch has no batching rule for (as ``x.size(d)`` instead,
    torch.jit.trace failed: a traced size is a tensor there, which ``arange`` refuses)."""
    return TypeError(
        f"torch.vmap over {name} converted with dynamic shapes: its graph reads sizes through "
        "torch.ops.aten.sym_size.int, which torch.vmap cannot batch. Convert with "
        "dynamic=False and the per-example shape (what vmap passes each call), or call the "
        "converted module on the whole batch")


def _rank_error(off: list) -> InputMismatchError:
    """The error for inputs ``(name, rank given, rank converted with)``."""
    return InputMismatchError(
        "; ".join(f"input {name} has {got} dimensions, it had {want} when the model was "
                  "converted" for name, got, want in off[:3])
        + ": torch.export's graph holds what the model's code did at the example's rank (a "
        "branch on x.dim(), the unbatched-input convention, took the example's way) and computes "
        "for that rank only: convert with an example of this rank (one converted module per rank)")


def _rank(placeholder: torch.fx.Node) -> Optional[int]:
    info = placeholder.meta.get(TENSOR, placeholder.meta.get("val"))
    return len(info.shape) if isinstance(info, (TensorInfo, torch.Tensor)) else None


def _children(spec) -> list:
    """A TreeSpec's children (newer torch warns that ``children_specs`` is deprecated)."""
    return list(spec.children()) if callable(getattr(spec, "children", None)) \
        else spec.children_specs


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocasting() -> list[str]:
    """The device types whose torch.autocast is on here (capture runs outside them, and a
    converted module's call turns them off for its graph)."""
    on = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                on.append(device)
        except (RuntimeError, ValueError):  # (a device type this build does not know)
            pass
    return on


def grad_mode() -> str:
    """The grad mode a call runs in: "inference_mode", "no_grad" or "grad"."""
    return "inference_mode" if torch.is_inference_mode_enabled() else \
        "grad" if torch.is_grad_enabled() else "no_grad"


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def _input_kinds(gm: torch.fx.GraphModule) -> tuple[dict, dict]:
    """For a torch.export graph, whose graph holds the model's branches on an input's dtype or
    x.dim() as the example took them: {argument of the graph's forward: (its position, dtype
    and rank converted with)} for the arguments that are one tensor each, and {placeholder
    index: (name, dtype converted with)} for the tensors inside container arguments. Nothing
    for symbolic_trace's graph, which holds no such branch (fx cannot trace one: the model
    went to torch.export) and computes any dtype or rank the model's code does (uint8 pixels
    into ``img.float() / 255``), except for its float inputs the plan's casts alone read: the
    cast computes on any kind (uint8 pixels the model's conv refused came out 100x off)."""
    import inspect
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [n for n, p in inspect.signature(gm.forward).parameters.items()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "in_spec", None)
    if spec is None:
        return {n.target: (names.index(n.target), info.dtype, None) for n in placeholders
                if n.target in names and _cast_only(n) and isinstance(
                    info := n.meta.get(TENSOR), TensorInfo) and info.dtype.is_floating_point}, {}

    def info(node):  # (torch.export's own record, where no pass has rewritten the graph since)
        found = node.meta.get(TENSOR, node.meta.get("val"))
        return found if isinstance(found, (TensorInfo, torch.Tensor)) else None

    by_name, nested, leaves = {}, {}, 0  # (the placeholders: the leaves of ((args), {kwargs}))
    positional, keywords = _children(spec)
    for name, child in zip([*names[:positional.num_children], *keywords.context],
                           [*_children(positional), *_children(keywords)]):
        if child.is_leaf() and leaves < len(placeholders):
            by_name[name] = placeholders[leaves]
        else:
            for index in range(leaves, min(leaves + child.num_leaves, len(placeholders))):
                if (found := info(placeholders[index])) is not None:
                    nested[index] = (f"{name} ({placeholders[index].name})", found.dtype)
        leaves += child.num_leaves
    return ({name: (names.index(name), found.dtype, _rank(node))
             for name, node in by_name.items()
             if name in names and (found := info(node)) is not None}, nested)


def _own_call():
    """``ConvertedModule.__call__`` with a code object of its own, for one module's class (fx
    makes a class per instance): torch.compile traces ``__call__`` and keeps its compiled graphs
    on the code object, at most ``recompile_limit`` (8) of them, so with one shared code object
    the 9th converted module compiled in a process ran eagerly. Each module gets its own budget,
    as a plain module's generated forward does."""
    import types
    shared = ConvertedModule.__call__
    own = types.FunctionType(shared.__code__.replace(), shared.__globals__, shared.__name__,
                             shared.__defaults__, shared.__closure__)
    own.__qualname__, own.__doc__ = shared.__qualname__, shared.__doc__
    return own


def _copy_tensors(copied: torch.nn.Module, source: torch.nn.Module) -> None:
    """Every parameter and buffer of ``source`` that ``copied`` (fx's copy of it, which takes
    what its graph reads) lacks, shared as fx shares the rest; then each submodule's tensors and
    children in ``source``'s order, so that the state dicts list their keys alike."""
    from torch.fx.graph_module import _copy_attr
    for path, _ in [*source.named_parameters(remove_duplicate=False),
                    *source.named_buffers(remove_duplicate=False)]:
        owner_path, _, leaf = path.rpartition(".")
        try:
            owner = copied.get_submodule(owner_path)
        except AttributeError:
            owner = None
        if owner is None or (owner._parameters.get(leaf) is None
                             and owner._buffers.get(leaf) is None):
            _copy_attr(source, copied, path)
    for path, module in source.named_modules(remove_duplicate=False):
        try:
            twin = copied.get_submodule(path)
        except AttributeError:
            continue
        if twin is module:
            continue
        for store in ("_parameters", "_buffers", "_modules"):
            mine, theirs = getattr(twin, store), getattr(module, store)
            if list(mine) != [k for k in theirs if k in mine]:
                ordered = [k for k in theirs if k in mine] + [k for k in mine if k not in theirs]
                for key in ordered:
                    mine[key] = mine.pop(key)


def _keep_non_persistent(copied: torch.nn.Module, source: torch.nn.Module) -> None:
    """fx's copies register every buffer they copy as persistent: the ones ``source`` keeps out
    of its state dict (rotary ``inv_freq``) out of the copy's too, or a strict
    ``load_state_dict`` of the model's weights into the copy fails on them."""
    for path, module in source.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        try:
            twin = copied.get_submodule(path)
        except AttributeError:
            continue
        twin._non_persistent_buffers_set |= module._non_persistent_buffers_set & set(twin._buffers)


_STATIC_DIM = re.compile(r"Guard failed: (\w+)\.size\(\)\[(\d+)\] == (\d+)$")


_RECURRENT = ("aten.lstm", "aten.gru", "aten.rnn_tanh", "aten.rnn_relu")


def _recurrent(module: torch.nn.Module) -> bool:
    """Whether a graph runs a recurrent layer's ATen op (torch.export's capture of it)."""
    graph = getattr(module, "graph", None)
    return graph is not None and any(
        n.op == "call_function" and str(n.target).startswith(_RECURRENT) for n in graph.nodes)


def computes_sizes(graph: torch.fx.Graph) -> bool:
    """Whether a graph computes sizes as Python numbers (torch.export's ``sym_size`` nodes),
    which a tracer (torch.jit.trace, the TorchScript ONNX exporter) records as the example's."""
    return any(n.op == "call_function" and "sym_size" in str(n.target) for n in graph.nodes)


def caller_outside(*folders: str) -> int:
    """The stacklevel, for its caller's warnings.warn, of the first frame outside ``folders``
    (torch's tracer and mpgraph between the user's call and the warning)."""
    roots = tuple(os.path.abspath(f) + os.sep for f in folders)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    return level


def guard_error(module: torch.nn.Module, message: str) -> "InputMismatchError":
    """torch.export's "Guard failed: <condition>" as an error that says why the graph holds
    only under that condition and what to do."""
    condition = message.removeprefix("Guard failed: ")
    head = (f"this call's inputs break a condition the converted graph was captured under: "
            f"{condition}. ")
    static = _STATIC_DIM.match(message)
    if module.meta.get(STATIC_SHAPES):
        why = ("It was converted with dynamic=False, for the example's shapes only: convert "
               "with dynamic=True (the default) to run other shapes, or at the shapes you run")
    elif static and int(static.group(3)) in (0, 1):
        why = (f"torch.export keeps a dimension that is {static.group(3)} in the example fixed "
               f"(dimension {static.group(2)} of {static.group(1)}): convert with an example "
               "larger than 1 there to run other sizes")
    elif static and _recurrent(module):
        why = (f"torch.export fixes dimension {static.group(2)} of {static.group(1)} at the "
               f"example's {static.group(3)} for the recurrent layers (nn.LSTM, nn.GRU, nn.RNN: "
               "their kernels' sequence length), or the model's code does: convert with an "
               "example of the length you call it with (pad to it), or make the forward one "
               "torch.fx traces (mpgraph then keeps the recurrent layer whole, for any length)")
    elif static:
        why = (f"The model's code fixed dimension {static.group(2)} of {static.group(1)} at the "
               f"example's {static.group(3)} (a layer's size, a reshape, a check of its own): "
               "convert with an example of the size you call it with")
    elif module.meta.get(TRACED_ON) and condition.endswith("!= 1"):
        why = ("It was planned on the meta device, where a guard that excludes only a size of 1 "
               "cannot be tested (no values to compare the size-1 run with): each such guard "
               "stays. Convert the materialised model to run size 1 (mpgraph.convert(model, "
               "example, plan=module.plan) keeps the plan, and waives the guards its test passes)")
    else:
        why = ("The code the graph was traced through branches on this size (the model's own, "
               "or a library's it calls: if x.shape[0] == 1: ...), and the graph holds the "
               "branch the example took: convert with an example of the size you call it with "
               "(one converted module per branch)")
    return InputMismatchError(head + why)


def _direct_reads(root: torch.fx.GraphModule, previous):
    """A code transformer for ``Graph.on_generate_code``: see ``ConvertedModule.recompile``.
    Nodes PackCpuLinears marked call ``self.cpu_linears`` (``ir/cpu_linear``)."""
    def transform(body: list) -> list:
        body = previous(body) if previous is not None else body
        nodes = {n.name: n for n in root.graph.nodes
                 if n.op in ("get_attr", "call_module") or n.meta.get(PACKED)}
        out = []
        for line in body:
            name, sep, rhs = line.partition(" = ")
            node = nodes.get(name) if sep else None
            if node is not None and node.meta.get(PACKED):
                line = _packed_line(root, node)
            elif node is not None and node.op == "get_attr":
                expr = _lookup(root, node.target)
                line = f"{name} = {expr}" if expr else line
            elif node is not None:  # a submodule call: fx writes getattr(self.body, "0")(x)
                called, found = _fx_path(node.target) + "(", _module_path(root, node.target)
                if found and rhs.startswith(called):
                    line = f"{name} = {found[1]}({rhs[len(called):]}"
            out.append(line)
        return out
    return transform


def _packed_line(root: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """fx's line for ``node`` (``name = op(args)``; fx emits the names it frees after it as a
    body entry of their own) calling ``CpuLinears`` instead."""
    from mpgraph.ir.cpu_linear import packed_code
    module_expr = None
    if node.op == "call_module":
        found = _module_path(root, node.target)
        module_expr = found[1] if found else _fx_path(node.target)
    return f"{node.name} = {packed_code(node, module_expr)}"


def _fx_path(target: str) -> str:
    """How fx's code generator writes the object at a dotted target (torch.fx.graph)."""
    expr = "self"
    for part in target.split("."):
        expr = f"{expr}.{part}" if part.isidentifier() else f'getattr({expr}, "{part}")'
    return expr


def _module_path(root: torch.nn.Module, target: str):
    """(the submodule, ``self._modules[..]._modules[..]``) for a dotted target ('' for the
    root), or None when it is not a submodule."""
    module, expr = root, "self"
    for part in filter(None, target.split(".")):
        module = module._modules.get(part) if isinstance(module, torch.nn.Module) else None
        if module is None:
            return None
        expr += f"._modules[{part!r}]"
    return module, expr


def _lookup(root: torch.nn.Module, target: str):
    """``self._modules[..]._parameters[..]`` (or ``_buffers``) for a dotted target, or None."""
    path, _, leaf = target.rpartition(".")
    found = _module_path(root, path)
    if found is None:
        return None
    module, expr = found
    for store in ("_parameters", "_buffers"):
        if getattr(module, store, {}).get(leaf) is not None:
            return f"{expr}.{store}[{leaf!r}]"
    return None


_register_refresh_op()


# the hooks a module's call runs: GraphModule's deepcopy makes a fresh module without them
_CALL_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")


def _keep_call_hooks(new: torch.nn.Module, old: torch.nn.Module) -> None:
    """The copy runs the hooks the original runs, as nn.Module's deepcopy keeps them: a copy of
    a guarded module (``mpgraph.guard``) that silently returned inf where the original raises
    would be the guard's promise broken. Each dict is the copy's own: a hook removed from one
    stays in the other."""
    for attr in _CALL_HOOKS:
        if attr in old.__dict__:
            setattr(new, attr, type(old.__dict__[attr])(old.__dict__[attr]))
    if old.__dict__.get("_is_full_backward_hook") is not None:
        new._is_full_backward_hook = old._is_full_backward_hook


def keep_backward_hooks(new: torch.nn.Module, old: torch.nn.Module) -> None:
    """``old``'s backward hooks (full or not, and pre-hooks) on ``new`` too: no tracer records
    one (they act on gradients, not on the forward's values), so the model's own are kept on
    the module that converts it, where they run on its calls as on the model's."""
    for attr in ("_backward_hooks", "_backward_pre_hooks"):
        if attr in old.__dict__:
            setattr(new, attr, type(old.__dict__[attr])(old.__dict__[attr]))
    if old.__dict__.get("_is_full_backward_hook") is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
