"""Small helpers over torch.fx graphs shared by several passes."""
from __future__ import annotations

import collections.abc
import contextlib
import functools
import inspect
import logging
import math
import operator
import os
import re
import sys
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree

from mpgraph.ir.meta import (FUSED, INSERTED_BY, MODULE_ALIASES, OP_CLASS, PACKED, TENSOR,
                             TensorInfo, shape_of, tensor_infos)
from mpgraph.ir.ops import move_names

log = logging.getLogger(__name__)

# Ops whose output aliases their first input (a view), so mutating the output mutates the input.
_VIEW_METHODS = move_names(lambda move: move.view)
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv}
# the node kinds that call an op (the others: placeholder, get_attr, output)
CALLS = ("call_function", "call_method", "call_module")
# the submodule torch.export's ep.module() calls first: it checks the inputs, returns nothing
EXPORT_GUARD = "_guards_fn"


class Call(NamedTuple):
    """A batch given as positional and keyword arguments (how convert passes its example)."""

    args: tuple
    kwargs: dict


def as_call(batch: Any, kwargs: Optional[dict] = None) -> tuple[tuple, dict]:
    """Inputs as (args tuple, kwargs dict): a tensor, a tuple/list of arguments, a dict (or a
    tokenizer's BatchEncoding) of keyword arguments, a Call, or None (no positional arguments);
    ``kwargs`` are added."""
    if kwargs is not None and not isinstance(kwargs, collections.abc.Mapping):
        raise TypeError(f"example_kwargs must be a dict of keyword arguments (name: value), "
                        f"got {type(kwargs).__name__} {short_repr(kwargs)}: positional "
                        "arguments go in example_inputs, as a tuple")
    extra = dict(kwargs or {})
    if batch is None:
        return (), extra
    if isinstance(batch, Call):
        return tuple(batch.args), {**batch.kwargs, **extra}
    if isinstance(batch, dict) or is_batch_encoding(batch):
        return (), {**batch, **extra}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), extra
    return (batch,), extra


def short_repr(value, most: int = 60) -> str:
    """``repr(value)``, cut to fewer than ``most`` characters for a message."""
    text = repr(value)
    return text if len(text) < most else text[:most - 3] + "..."


def named_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) of each argument of a call of ``module``: positional ones by the forward's
    parameter names ("#3" past them), then the keywords."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        names = []
    return [(names[i] if i < len(names) else f"#{i}", a) for i, a in enumerate(args)] \
        + list(kwargs.items())


def source_line(node: torch.fx.Node) -> str:
    """Where the model's code made ``node``: "modeling_t5.py:1234: loss = ...", or ""."""
    found = re.findall(r'File "([^"]+)", line (\d+)[^\n]*\n\s*(.*)',
                       node.meta.get("stack_trace") or "")
    return f"{os.path.basename(found[-1][0])}:{found[-1][1]}: {found[-1][2].strip()}" \
        if found else ""


def is_batch_encoding(value) -> bool:
    """A tokenizer's output (transformers.BatchEncoding, a UserDict, not a dict): keyword
    arguments, as ``model(**tokenizer(...))`` takes it. (Another mapping may be what a
    ``forward(self, batch)`` takes whole.)"""
    return isinstance(value, collections.abc.Mapping) and type(value).__name__ == "BatchEncoding"


def is_export_guard(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls torch.export's input guard: a check of the inputs' shapes, none of
    the model's ops (no dtype to choose, no time to price, not counted among its nodes)."""
    return node.op == "call_module" and node.target == EXPORT_GUARD


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Every node read by ``node``, in argument order, each once."""
    return list(dict.fromkeys(node.all_input_nodes))


def is_inplace(node: torch.fx.Node, root: torch.nn.Module) -> bool:
    """True when ``node`` writes into its first argument."""
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.startswith("__")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        if isinstance(node.target, torch._ops.OpOverload):
            return _writes_first_argument(node.target)
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.startswith("_") and \
                getattr(torch, name, None) is node.target:  # torch.relu_, torch.sigmoid_, ...
            return True
        return bool(node.kwargs.get("inplace", False))
    if node.op == "call_module":
        return bool(getattr(root.get_submodule(node.target), "inplace", False))
    return False


@functools.lru_cache(maxsize=None)
def _writes_first_argument(op: torch._ops.OpOverload) -> bool:
    """From the op's schema (read once per op: the checks read it for every edge)."""
    arguments = op._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None \
        and arguments[0].alias_info.is_write


# Calls that return their input itself when it already is what they ask for (a dtype, a device;
# ``h.float()`` of a float32 ``h`` is ``h``), and dropout, which returns it in eval mode: writing
# into their result writes their input, as into a view's
_CONVERSIONS = frozenset("to type type_as float double half bfloat16".split())
_MAY_RETURN_INPUT = _CONVERSIONS | frozenset("""cpu cuda dropout alpha_dropout
    feature_alpha_dropout feature_dropout dropout1d dropout2d dropout3d""".split())


def is_conversion(node: torch.fx.Node) -> bool:
    """A dtype conversion the model wrote (``h.float()``, ``h.to(x)``): the same tensor in the
    model where there was nothing to convert, a copy in a plan where its input is another
    dtype; the write into it then lands in the copy (an explicit float32 copy takes -1e9)."""
    if node.op == "call_method":
        return node.target in _CONVERSIONS
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _CONVERSIONS


# modules that return their input, or a view of it
_ALIASING_MODULES = (torch.nn.Identity, torch.nn.modules.dropout._DropoutNd, torch.nn.Flatten,
                     torch.nn.Unflatten)


def may_alias(node: torch.fx.Node, root: torch.nn.Module) -> bool:
    """True when ``node``'s output may be its first input's storage: a view, a conversion
    that had nothing to convert, or a module that may return its input or a view of it
    (``nn.Identity``, a dropout, ``nn.Flatten``, a leaf module of the user's own)."""
    if is_view(node):
        return True
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        return isinstance(module, _ALIASING_MODULES) \
            or not type(module).__module__.startswith(("torch.", "mpgraph."))
    if node.op == "call_method":
        return node.target in _MAY_RETURN_INPUT
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):  # aten.to.dtype: "-> Tensor(a)"
            returns = node.target._schema.returns
            return bool(returns) and returns[0].alias_info is not None \
                or node.target._schema.name.split("::")[-1] in _MAY_RETURN_INPUT
        return getattr(node.target, "__name__", "") in _MAY_RETURN_INPUT
    return False


def alias_base(x: torch.fx.Node, root: torch.nn.Module,
               through: Callable[[torch.fx.Node], bool] = lambda n: True) -> torch.fx.Node:
    """What a write into ``x`` writes into: back through views, calls that may return their
    input (``may_alias``) and in-place ops' results, as far as ``through(node)`` lets the walk
    step from a node to its first input."""
    while (may_alias(x, root) or is_inplace(x, root)) and x.args \
            and isinstance(x.args[0], torch.fx.Node) and through(x):
        x = x.args[0]
    return x


def is_view(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        if node.target is operator.getitem:
            return True
        if node.target is getattr and len(node.args) > 1 and node.args[1] == "data":
            return True  # x.data: the same storage (x.data.clamp_(...) writes x)
        if isinstance(node.target, torch._ops.OpOverload):
            return node.target.is_view
        name = getattr(node.target, "__name__", "")  # torch.transpose, torch.flatten, ...
        return name in _VIEW_METHODS and getattr(torch, name, None) is node.target
    return False


# In-place ops that only store into their first argument (overwrite slots with other values),
# never combine with what it held: a KV cache written this way can live in any dtype its
# writers cast to
_STORES = {"index_copy_", "copy_", "index_put_", "__setitem__"}


def _store_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name.split("::")[-1]
    return "__setitem__" if node.target is operator.setitem else ""


def stored_into_only(buffer: torch.fx.Node, root: torch.nn.Module) -> list[torch.fx.Node]:
    """The nodes that write into ``buffer`` (a get_attr) when every write is a plain store
    (``index_copy_``, ``copy_``, ``index_put_`` without accumulate, item assignment) of values
    computed without reading the buffer (new keys and values: a cache), else []. A store of
    something made from the buffer's own contents (``acc.copy_(0.9 * acc + y)``) is state that
    accumulates across calls: rounding it to a low dtype on every call drifts."""
    writers = [u for u in buffer.users if u.args and u.args[0] is buffer and is_inplace(u, root)
               or u.op == "call_function" and u.target is operator.setitem and u.args[0] is buffer]
    return writers if writers and all(_plain_store(w, buffer) for w in writers) else []


def _plain_store(writer: torch.fx.Node, buffer: torch.fx.Node) -> bool:
    """Whether ``writer`` stores into ``buffer`` (or a view of it) values computed without
    reading it: no accumulation (``index_put_(..., accumulate=True)``, ``acc.copy_(0.9 * acc +
    y)``)."""
    name = _store_name(writer)
    return name in _STORES and not writer.kwargs.get("accumulate") \
        and not (len(writer.args) > 3 and writer.args[3] is True and name == "index_put_") \
        and not _reads_attr(list(writer.args[1:]) + list(writer.kwargs.values()), buffer.target)


def stored_through_views_only(buffer: torch.fx.Node, root: torch.nn.Module) -> bool:
    """Whether every write into ``buffer`` or a view of it (``self.cache_k[:, s:s + T] = k``:
    torch.export's ``copy_`` into a slice) is a plain store of values computed without reading
    the buffer: a cache whose contents calibration sees computed, not state that accumulates."""
    views, stack, writers = set(), [buffer], []
    while stack:
        value = stack.pop()
        views.add(value)
        for user in value.users:
            if user.args and user.args[0] is value and (
                    is_inplace(user, root) or user.target is operator.setitem):
                writers.append(user)
            elif is_view(user) and user.args and user.args[0] is value:
                stack.append(user)
    return bool(writers) and all(_plain_store(w, buffer) for w in writers)


def _reads_attr(values: list, target: str) -> bool:
    """Whether any node in ``values`` is computed from a read of the attribute ``target``."""
    stack = [v for v in pytree.tree_leaves(values) if isinstance(v, torch.fx.Node)]
    seen: set = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v.op == "get_attr" and v.target == target:
            return True
        stack += v.all_input_nodes
    return False


def mutated_nodes(graph: torch.fx.Graph, root: torch.nn.Module) -> set[torch.fx.Node]:
    """Values written in place somewhere in the graph, including what a written value may be
    the storage of (``may_alias``: the bases of mutated views, the input of a conversion that
    had nothing to convert, of ``nn.Identity``, of a dropout)."""
    out: set[torch.fx.Node] = set()
    for node in graph.nodes:
        written = []
        if node.args and isinstance(node.args[0], torch.fx.Node) and is_inplace(node, root):
            written.append(node.args[0])
        if node.op == "call_module":  # modules that declare the arguments they write into
            for i in getattr(root.get_submodule(node.target), "mutates_args", ()):
                if i < len(node.args) and isinstance(node.args[i], torch.fx.Node):
                    written.append(node.args[i])
        written += _written_inside(node, root)
        for target in written:
            while True:
                out.add(target)
                if may_alias(target, root) and target.args \
                        and isinstance(target.args[0], torch.fx.Node):
                    target = target.args[0]
                else:
                    break
    return out


def _written_inside(node: torch.fx.Node, root: torch.nn.Module) -> list[torch.fx.Node]:
    """The arguments a higher-order op's body writes in place: torch.export puts a region under
    ``torch.no_grad()`` or autocast in a submodule (``wrap_with_set_grad_enabled(False,
    submod_1, weight)``) whose placeholders are the operands after it; a write there
    (``self.fc.weight[:, :8] = 0``) writes the operand."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    for i, a in enumerate(node.args):
        body = fetch_attr(root, a.target) if isinstance(a, torch.fx.Node) and a.op == "get_attr" \
            else None
        if isinstance(body, torch.fx.GraphModule):
            places = [n for n in body.graph.nodes if n.op == "placeholder"]
            inside = mutated_nodes(body.graph, body)
            operands = node.args[i + 1:]
            return [operands[k] for k, p in enumerate(places)
                    if p in inside and k < len(operands) and isinstance(operands[k], torch.fx.Node)]
    return []


def flat_inputs(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The values of gm's placeholders, in order, for a call ``gm(*args, **kwargs)``."""
    signature = gm.__dict__.get("call_signature")
    if signature is not None:  # as the call itself: the values fixed at capture filled in
        args, kwargs = signature.complete(tuple(args), dict(kwargs))
    codegen = gm.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None \
            and codegen.pytree_info.in_spec is not None:
        spec = codegen.pytree_info.in_spec
        leaves, call_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if call_spec != spec:
            # kwargs may arrive in another order than at capture: reorder them by the spec.
            ordered = dict(sorted(kwargs.items(), key=lambda kv: _spec_key_index(spec, kv[0])))
            leaves, call_spec = pytree.tree_flatten((tuple(args), ordered))
            if call_spec != spec:
                raise ValueError(f"inputs do not match the captured signature: {call_spec} vs {spec}")
        return leaves
    sig = inspect.signature(gm.forward)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for name, param in sig.parameters.items():
        value = bound.arguments.get(name)
        if param.kind == inspect.Parameter.VAR_POSITIONAL:
            values.extend(value or ())
        elif param.kind == inspect.Parameter.VAR_KEYWORD:
            values.extend((value or {}).values())
        else:
            values.append(value)
    return values


def _spec_key_index(spec, key: str) -> int:
    try:
        kw_spec = spec.children_specs[1]
        return list(kw_spec.context).index(key)
    except (AttributeError, IndexError, ValueError):
        return 0


# ops that draw a training-time mask (or slope) rather than values a user compares
MASKS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
         "dropout1d", "dropout2d", "dropout3d", "rrelu", "rrelu_with_noise"}
# ops that draw one random number per element in memory order (``normal_`` in place too)
RANDOM = MASKS | {"randn_like", "rand_like", "randint_like", "bernoulli", "normal", "uniform",
                  "exponential", "geometric", "cauchy", "log_normal", "poisson", "multinomial",
                  "random"}
# scaled_dot_product_attention as torch.export and torch.fx record it
SDPA = (torch.ops.aten.scaled_dot_product_attention.default,
        torch.nn.functional.scaled_dot_product_attention)
_LOW = (torch.float16, torch.bfloat16)


def draws_random(node: torch.fx.Node, root: torch.nn.Module, kinds=RANDOM) -> bool:
    """Whether the node draws random numbers, out of place or in place (``normal_``);
    ``kinds=MASKS``: a dropout mask or RReLU's slopes."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        return isinstance(module, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU))
    if node.op not in ("call_function", "call_method"):
        return False
    return short_op_name(node).rstrip("_") in kinds


def short_op_name(node: torch.fx.Node) -> str:
    """The op's name without namespace or overload: "dropout" for aten.dropout.default and
    torch.nn.functional.dropout."""
    name = target_name(node).split(".")
    return name[1] if name[0] == "aten" and len(name) > 1 else name[-1]


class RecordingInterpreter(torch.fx.Interpreter):
    """Runs a graph node by node and hands every node's output to ``on_node``.

    A dropout mask (or RReLU's slopes, or an attention's dropout) on a low-precision value is
    drawn in float32 and the result rounded: CUDA's kernels draw another mask in fp16/bf16 than
    in float32 for the same seed (BERT training's dropout: 0.57 off float32 on an H200, a
    ValueCheckError on a right conversion), so a comparison with the float32 graph compared two masks, not two roundings.
    The converted module draws its own (as autocast's and ``.half()``'s do: any mask is a
    sample of the same dropout). Values a user compares (``randn_like`` noise) are drawn as the
    module draws them: a plan whose sample differs from the model's fails the check, not passes
    it (the CPU's bf16 ``rand_like`` did: it is kept in float32)."""

    masks_in_float32 = True  # (False: mpgraph.profile, which times the module's own kernels)

    def __init__(self, gm: torch.fx.GraphModule, on_node):
        super().__init__(gm)
        self._on_node = on_node

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.meta.get(PACKED):  # as the converted module's code runs it (PackCpuLinears)
            from mpgraph.ir.cpu_linear import run_packed
            with self._set_current_node(n):
                args, _ = self.fetch_args_kwargs_from_env(n)
                result = run_packed(self.module, n, args)
        elif self.masks_in_float32 and (draws_random(n, self.module, MASKS)
                                        or _attention_dropout(n)):
            result = self._draw_in_float32(n)
        else:
            result = super().run_node(n)
        self._on_node(n, result)
        return result

    def _draw_in_float32(self, n: torch.fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            leaves = pytree.tree_leaves((args, kwargs))
            low = [t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.dtype in _LOW]
            if not low:
                return getattr(self, n.op)(n.target, args, kwargs)
            up_args, up_kwargs = pytree.tree_map(
                lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in _LOW else t,
                (args, kwargs))
            result = getattr(self, n.op)(n.target, up_args, up_kwargs)
            if up_args and result is up_args[0]:  # (nothing drawn: dropout in eval, or p=0,
                return args[0]                    # gives its input itself, written later in place)
            result = pytree.tree_map(
                lambda t: t.to(low[0]) if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                else t, result)
            if is_inplace(n, self.module) and args and isinstance(args[0], torch.Tensor):
                args[0].copy_(up_args[0])  # (what it wrote goes where the graph reads it)
                return args[0]
            return result


def _attention_dropout(n: torch.fx.Node) -> bool:
    """An attention that drops probabilities (``dropout_p`` > 0, kept in training): its kernels
    draw the mask too, another one in fp16 (flash) than in float32. Drawn in float32 with the
    rest, its own rounding is not in the check's figure then (training checks only)."""
    if n.op != "call_function" or n.target not in SDPA:  # (not the private kernels' ops,
        return False                                       # whose fifth argument is another)
    p = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
    return not isinstance(p, (int, float)) or p > 0


RUN_SEED = 0  # every run conversion makes draws its random numbers from this seed


def fresh(value):
    """Tensors in a nest cloned: a model that writes into its inputs (``x.mul_(2)``) writes into
    the copy, so the caller's example tensors and the next run's inputs stay as they were."""
    return pytree.tree_map(lambda v: _copy_as_is(v) if isinstance(v, torch.Tensor) else v, value)


def _copy_as_is(t: torch.Tensor) -> torch.Tensor:
    """A copy with the tensor's own strides, not only its values: ``clone`` makes a column
    slice (``labels[:, :16]``) contiguous, and a model whose ``labels.view(-1)`` raises on the
    caller's tensor then ran on every copy conversion made, and failed only in the check."""
    if t.layout != torch.strided or t.is_contiguous() or t.requires_grad or t.is_meta \
            or type(t) not in (torch.Tensor, torch.nn.Parameter) \
            or torch._C._dispatch_tls_local_include_set().has(torch._C.DispatchKey.Python):
        return t.clone()  # (dense tensors keep their strides through clone as it is)
    if not overlapping(t):  # (a slice of a large tensor: its own span only)
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    copy = torch.empty(0, dtype=t.dtype, device=t.device)  # an expanded view: its storage
    return copy.set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())


@contextlib.contextmanager
def seeded():
    """Runs that draw the same random numbers (dropout in training mode: the float32 and the
    converted graph compare mask for mask), without consuming the caller's random stream."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() \
        and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), python_rng_kept():
        torch.manual_seed(RUN_SEED)
        yield


@contextlib.contextmanager
def python_rng_kept():
    """Python's ``random`` and numpy's global streams put back after the block: a forward that
    draws from them (``x * random.random()``) ran for conversion's ends, and a seeded script
    drew other numbers after ``convert``."""
    import random
    numpy = sys.modules.get("numpy")  # (imported by now if the forward uses it)
    saved = random.getstate(), numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        if saved[1] is not None:
            numpy.random.set_state(saved[1])


def run_kept(module: torch.nn.Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` as conversion runs a model for its own ends: without grad, on
    fresh copies of the inputs, seeded, its state put back (``state_kept``): the caller's
    tensors, random stream and buffers are left as they were."""
    with torch.no_grad(), seeded(), state_kept(module):
        return owned(module(*fresh(args), **fresh(kwargs)), module)


def owned(value, module: torch.nn.Module):
    """``value`` with a copy of each tensor that shares its storage with state of ``module``
    that ``state_kept`` puts back: a forward that updates a buffer in place and returns it
    (``return h, self.ema``, a static KV cache or a view of it) returns the buffer itself, and
    an output kept past the run read the values put back (a reference of zeros: conversion's
    check said the converted module differed by inf). Call it before ``state_kept`` ends."""
    state = {storage_key(t) for t in [*_plain_tensors(module), *module.buffers(),
                                   *written_parameters(module)]}
    state.discard(None)
    if not state:
        return value
    return pytree.tree_map(lambda v: _copy_as_is(v) if isinstance(v, torch.Tensor)
                           and storage_key(v) in state else v, value)


def storage_key(t: torch.Tensor):
    """Where a tensor's values are, or None for one without a storage of its own."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided \
            or t.is_meta or torch._C._dispatch_tls_local_include_set().has(
                torch._C.DispatchKey.Python):
        return None
    ptr = t.untyped_storage().data_ptr()
    return (t.device, ptr) if ptr else None


def _plain_tensors(module: torch.nn.Module) -> list:
    """Tensors the modules keep as plain attributes (``self.mem = torch.zeros(d)``)."""
    return [t for m in module.modules() for t in vars(m).values()
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)]


def written_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters a forward writes in place: an embedding with ``max_norm`` renormalises the
    rows it looks up, on every call."""
    return [m.weight for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            and m.max_norm is not None and isinstance(m.weight, torch.Tensor)]


def weight_copy_paths(module: torch.nn.Module) -> set:
    """The paths in ``module`` of every low weight copy its converted modules keep
    (``WeightCopies``): derived state, in step with its original on the next call, which a
    restore of the module's buffers must not put back as it was."""
    return {f"{prefix}{'.' if prefix else ''}{copy}" for prefix, m in module.named_modules()
            if "weight_copies" in m.__dict__ for _, copy in m.weight_copies.pairs}


@contextlib.contextmanager
def state_kept(module: torch.nn.Module):
    """Buffers the run writes into (running statistics, counters), and parameters a forward
    writes (``written_parameters``), are put back afterwards: every run conversion makes starts
    from the model's state, as the reference run did, and leaves it so."""
    stacks = {id(fetch_attr(module, t)) for t, _ in getattr(module, "meta", {}).get(FUSED, ())}
    # (a converted module's low copies of its weights: what a call refreshed them to stays, as
    # their record of it does; put back, they would be stale and never refreshed again)
    stacks |= {id(fetch_attr(module, path)) for path in weight_copy_paths(module)}
    # a tensor kept as a plain attribute (``self.mem = torch.zeros(d)``, no register_buffer)
    # that the forward updates in place is state as a buffer is: conversion's runs advanced it
    # (put back where its version moved; an expanded view cannot be written in place, and a
    # large one, a table the forward only reads, is not copied on every run)
    plain = [t for t in _plain_tensors(module) if id(t) not in stacks and not overlapping(t)]
    small = [(t, t._version, t.clone()) for t in plain if t.numel() <= _PLAIN_COPIED]
    large = [(t, t._version) for t in plain if t.numel() > _PLAIN_COPIED]
    saved = [(b, b.clone()) for b in list(module.buffers()) + written_parameters(module)
             if id(b) not in stacks and not overlapping(b)]  # (FuseSiblingGemv's stacks:
    # never written; nor is an expanded view, which no in-place op can write)
    try:  # (kernels that update running statistics do not bump _version)
        yield
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)
            for t, version, copy in small:
                if t._version != version:
                    t.copy_(copy)
        for t, version in large:
            if t._version != version:
                log.warning("a tensor attribute of %d values (not a registered buffer) was "
                            "written by a run conversion made and is left so: register it as a "
                            "buffer (register_buffer) to have it put back", t.numel())


_PLAIN_COPIED = 1 << 20  # values of a plain tensor attribute state_kept copies before a run


def overlapping(t: torch.Tensor) -> bool:
    """An expanded view (stride 0 along a dimension of size > 1): its elements share memory."""
    return any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape))


def run_recording(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, on_node,
                  after=None) -> Any:
    """Run ``gm`` on fresh copies of (args, kwargs), seeded, under no_grad, its buffers kept,
    calling ``on_node(node, value)`` for each node; returns the graph's flat output.
    ``after(gm)``: called once the graph has run, before its buffers are put back."""
    flat = fresh(flat_inputs(gm, args, kwargs))
    with torch.no_grad(), seeded(), state_kept(gm):
        output = RecordingInterpreter(gm, on_node).run(*flat, enable_io_processing=False)
        if after is not None:
            after(gm)
        return owned(output, gm)


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the module that produced this node, or '' at the top level.

    A call_module node's target is its module's path (symbolic_trace), except for the modules a
    pass put into the graph (``dropout_3_mode``, in place of an exported ``aten.dropout``): those
    were given a fresh name at the root, and the module they stand for is the one in the
    ``nn_module_stack`` copied from the node they replaced (``encoder.layer.0...dropout``)."""
    stack = node.meta.get("nn_module_stack")
    path = str(list(stack.values())[-1][0]) if stack else ""
    if node.op in ("call_module", "get_attr"):
        if node.op == "call_module" and path and node.meta.get(INSERTED_BY) is not None:
            return path
        return str(node.target)
    return path


def module_names(node: torch.fx.Node) -> set[str]:
    """``module_path(node)`` and the module's other names (``self.shared = self.blocks[3]``:
    "shared.fc" beside "blocks.3.fc"; ``MODULE_ALIASES``): an override by any of them names the
    same module (the alias matched nothing under torch.fx, one call of two under torch.export)."""
    gm = node.graph.owning_module
    aliases = gm.meta.get(MODULE_ALIASES, ()) if gm is not None else ()
    names = {module_path(node)}
    while aliases:  # (until no new name: ModuleList([block] * 3) names layers.1 via layers.0)
        more = {b + p[len(a):] for p in names for alias, first in aliases
                for a, b in ((first, alias), (alias, first))
                if p == a or p.startswith(a + ".")} - names
        if not more:
            break
        names |= more
    return names


def target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)


def fetch_attr(root: torch.nn.Module, target: str):
    """The object at a dotted attribute path (a get_attr target)."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def free_attr_name(root: torch.nn.Module, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ...: the first dotted path not yet taken on ``root``."""
    name, i = base, 1
    while True:
        owner, leaf = owner_of(root, name)
        if not hasattr(owner, leaf):
            return name
        name, i = f"{base}_{i}", i + 1


def owner_of(root: torch.nn.Module, target: str) -> tuple[torch.nn.Module, str]:
    """(the submodule that holds a dotted attribute path, the attribute's own name)."""
    path, _, leaf = target.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def set_attr(root: torch.nn.Module, target: str, value) -> None:
    """Replace the parameter, buffer or plain attribute at a dotted path, keeping its kind."""
    owner, leaf = owner_of(root, target)
    if leaf in owner._parameters:
        owner._parameters[leaf] = value
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        setattr(owner, leaf, value)


def with_data(value: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as the same kind of tensor as ``value``: a Parameter stays a Parameter."""
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(data, requires_grad=value.requires_grad)
    return data


def read_transposed(weights: list[torch.fx.Node]) -> bool:
    """Whether a weight's get_attr nodes ``weights`` are read only by MatVecLinear's ``t`` of a
    k x n weight (GPT-2's Conv1D) before ``mv``: its low-precision copy is then stored
    transposed (column-major), so that ``t`` gives the GEMV contiguous rows, and the measured
    costs time the GEMV so (a bf16 768x3072 GEMV from memory over the strided transpose 532-573
    us, over contiguous rows 242-248 us, 2-core AMX Xeon)."""
    users = [u for w in weights for u in w.users]
    return bool(users) and all(
        u.op == "call_function" and u.target is torch.ops.aten.t.default
        and u.meta.get(INSERTED_BY) == "MatVecLinear" and u.users
        and all(r.target is torch.ops.aten.mv.default for r in u.users) for u in users)


def is_conv2d(node: torch.fx.Node, gm) -> bool:
    """A 2-D convolution (module or function): the op the ChannelsLast pass runs NHWC."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), torch.nn.Conv2d)
    if node.op == "call_function" and node.target in (torch.ops.aten.conv2d.default,
                                                      torch.nn.functional.conv2d, torch.conv2d):
        weight = node.args[1] if len(node.args) > 1 else None
        info = weight.meta.get(TENSOR) if isinstance(weight, torch.fx.Node) else None
        return isinstance(info, TensorInfo) and len(info.shape) == 4
    return False


# ops whose first argument is a bias added to the product: the product's left operand is next
_BIAS_FIRST = {"addmm", "_addmm_activation", "baddbmm", "addbmm", "addmv"}


def _arg_shape(value) -> Optional[tuple[int, ...]]:
    return shape_of(value.meta.get(TENSOR)) if isinstance(value, torch.fx.Node) else None


def matmul_dims(node: torch.fx.Node, gm) -> Optional[tuple[int, int, int, int]]:
    """(batch, M, N, K) of a matmul-class node, from recorded shapes. K is the product's reduced
    length: not a bias's last dim (baddbmm's first argument), nor an einsum operand's last dim."""
    out = tensor_infos(node.meta.get(TENSOR))
    ins = [i for a in input_nodes(node) for i in tensor_infos(a.meta.get(TENSOR))]
    if not out or not ins:
        return None
    o = out[0].shape
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, torch.nn.Linear):
            k = mod.in_features
            return 1, math.prod(o[:-1]), o[-1], k
        return None
    info = node.meta.get(OP_CLASS)  # "aten.baddbmm", "torch._VariableFunctionsClass.einsum"
    op = (info.key if info is not None else getattr(node.target, "_opname", None)
          or target_name(node)).rsplit(".", 1)[-1].rstrip("_")
    if op == "einsum":
        dims = _einsum_dims(node)
        if dims is not None:
            return dims
    if op in _BIAS_FIRST:  # (bias, a, b): the product's left operand is args[1]
        a = _arg_shape(node.args[1]) if len(node.args) > 1 else None
        if not a or len(o) == 0:
            return None
        return math.prod(a[:-2]), o[-2] if len(o) >= 2 else 1, o[-1], a[-1]
    a = ins[0].shape
    if len(o) == 0 or len(a) == 0:
        return None
    k = a[-1]
    m = o[-2] if len(o) >= 2 else 1
    return math.prod(o[:-2]) if len(o) > 2 else 1, m, o[-1], k


def _einsum_dims(node: torch.fx.Node) -> Optional[tuple[int, int, int, int]]:
    """(batch, M, N, K) of a two-operand einsum from its equation: K the labels both operands
    have and the output drops, batch those all three have, M (N) the first (second) operand's
    own. None for another operand count or an equation this does not read."""
    eq = node.args[0] if node.args else node.kwargs.get("equation")
    operands = list(node.args[1:] or node.kwargs.get("tensors", ()))
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    shapes = [_arg_shape(a) for a in operands]
    if not isinstance(eq, str) or len(shapes) != 2 or None in shapes:
        return None
    lhs, arrow, rhs = eq.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None

    def labels(term: str, rank: int) -> Optional[list]:
        # an ellipsis stands for the dims left over, numbered from the right as they broadcast
        head, dots, tail = term.partition("...")
        extra = rank - len(head) - len(tail) if dots else 0
        if extra < 0 or (not dots and len(term) != rank):
            return None
        return list(head) + list(range(-extra, 0)) + list(tail)

    ops = [labels(t, len(s)) for t, s in zip(terms, shapes)]
    if None in ops:
        return None
    size: dict = {}
    for labs, shape in zip(ops, shapes):
        for lab, n in zip(labs, shape):
            size[lab] = max(size.get(lab, 1), n)
    if arrow:
        rank = max((-lab for labs in ops for lab in labs if isinstance(lab, int)), default=0)
        output = labels(rhs, len(rhs.replace("...", "")) + (rank if "..." in rhs else 0))
    else:  # implicit output: the broadcast dims, then the letters used once, sorted
        letters = [lab for labs in ops for lab in labs if isinstance(lab, str)]
        output = sorted({lab for labs in ops for lab in labs if isinstance(lab, int)}) + \
            sorted(lab for lab in set(letters) if letters.count(lab) == 1)
    if output is None:
        return None
    a, b, out = set(ops[0]), set(ops[1]), set(output)

    def prod(labs) -> int:
        return math.prod(size[lab] for lab in labs)

    return prod(a & b & out), prod((a - b) & out), prod((b - a) & out), prod((a & b) - out)


def to_device(value, device):
    """Tensors in a nest of tuples, lists and dicts moved to ``device`` (inputs for a run)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def own_autocast(node: torch.fx.Node) -> Optional[torch.dtype]:
    """The low dtype of a model's own enabled ``torch.autocast`` region that torch.export kept as
    one ``wrap_with_autocast`` call (its code computes in that dtype, as the model does), else
    None (a disabled region: float32)."""
    if node.op != "call_function" or getattr(node.target, "__name__", None) != "wrap_with_autocast" \
            or len(node.args) < 3 or node.args[2] is not True:
        return None
    dtype = node.args[1]
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def grad_region(node: torch.fx.Node) -> Optional[bool]:
    """The grad mode of a model's own ``torch.no_grad()`` / ``set_grad_enabled`` region that
    torch.export kept as one ``wrap_with_set_grad_enabled`` call (HF's rotary embedding in
    transformers 5.17), else None."""
    if node.op != "call_function" or not node.args \
            or getattr(node.target, "__name__", None) != "wrap_with_set_grad_enabled":
        return None
    return bool(node.args[0])
