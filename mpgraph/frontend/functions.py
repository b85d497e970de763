"""Custom ``torch.autograd.Function``s captured as one op each, so that they keep their backward.

torch.export (either mode) traces a custom Function's ``forward`` into ATen ops and drops its
``backward``: a straight-through estimator (round forward, identity backward) captured that way
trains with zero gradients. While a graph is captured (either tracer, any mode: an inference module still
gives gradients to its inputs, for saliency maps and attacks), ``Function.apply`` of a user's
Function (one not defined in torch) becomes a call of an op registered for it here
(``mpgraph_fn::<name>_<n>``): its forward runs the Function's own forward, and its backward
reruns the Function on the saved inputs and asks autograd for the gradients, so the Function's
own ``backward`` is what computes them (one forward recomputed per backward, as activation
checkpointing does). A Function whose call this cannot express (keyword arguments, arguments
other than tensors and Python scalars, outputs other than one tensor) is a CaptureError naming
it in training, never a silent loss of its backward; in an inference capture its forward is
traced as before, and a warning says the backward is not kept.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading

import torch
from torch.autograd.function import Function

from mpgraph.errors import CaptureError

log = logging.getLogger(__name__)

_NAMESPACE = "mpgraph_fn"
_LIB = None
_OPS: dict = {}              # (Function class, argument kinds) -> the op standing for its calls
_COUNTER = itertools.count()
_REGISTRY_LOCK = threading.Lock()
_capturing = threading.local()  # set in the thread that captures a training graph
_original_apply = Function.__dict__["apply"].__func__
_KINDS = {torch.Tensor: "Tensor", bool: "bool", int: "int", float: "float"}


def _kind(value) -> str | None:
    if isinstance(value, torch.fx.Proxy):  # symbolic_trace's stand-in for a tensor
        return "Tensor"
    for t, name in _KINDS.items():
        if isinstance(value, t) and not (t is int and isinstance(value, bool)):
            return name
    return None


def _is_users(cls) -> bool:
    """A Function the user wrote (torch's own, and its libraries', keep torch's tracing)."""
    return not cls.__module__.startswith(("torch.", "torch", "transformers."))


def _patched_apply(cls, *args, **kwargs):
    mode = getattr(_capturing, "mode", None)
    if mode is not None and _is_users(cls):
        op = _op_for(cls, args, kwargs, strict=mode == "train")
        if op is not None:
            return op(*args)
    return _original_apply(cls, *args, **kwargs)


def _op_for(cls, args: tuple, kwargs: dict, strict: bool):
    """The op standing for ``cls``'s calls with arguments of these kinds; None (an inference
    capture) or a CaptureError (training) where the call is not one mpgraph can express."""
    kinds = tuple(_kind(a) for a in args)
    if kwargs or None in kinds or "Tensor" not in kinds:
        why = (f"{cls.__qualname__}.apply is called with arguments mpgraph cannot keep as one op "
               "(keyword arguments, or values other than tensors and Python scalars)")
        if not strict:  # the forward's values are right either way; gradients through it are not
            log.warning("%s: its forward is traced into the graph and its backward is lost "
                        "(gradients taken through the converted module differ there)", why)
            return None
        raise CaptureError({"custom autograd.Function": (
            f"{why}: its backward would be lost in training. Call it with positional tensors "
            "and scalars, or keep it out of the converted graph (convert the parts around it)")})
    key = (cls, kinds)
    with _REGISTRY_LOCK:
        if key not in _OPS:
            _OPS[key] = _register(cls, kinds)
    return _OPS[key]


def _register(cls, kinds: tuple):
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(_NAMESPACE, "FRAGMENT")
    name = f"{''.join(c if c.isalnum() else '_' for c in cls.__name__)}_{next(_COUNTER)}"
    params = ", ".join(f"{k} a{i}" for i, k in enumerate(kinds))
    _LIB.define(f"{name}({params}) -> Tensor")
    qualified = f"{_NAMESPACE}::{name}"

    def forward(*args):
        with torch.no_grad():
            out = _original_apply(cls, *args)
        if not isinstance(out, torch.Tensor):
            raise CaptureError({"custom autograd.Function": (
                f"{cls.__qualname__}.forward returns {type(out).__name__}, not one tensor: "
                "mpgraph keeps Functions with one tensor output as one op (its backward would "
                "be lost in training otherwise); keep it out of the converted graph")})
        # an op's output never aliases its inputs (a Function returning x.view_as(x))
        if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr()
               == out.untyped_storage().data_ptr() for a in args):
            out = out.clone()
        return out

    def fake(*args):  # shapes and dtypes: the Function's forward on fake tensors
        with torch.no_grad():
            out = _original_apply(cls, *args)
        return torch.empty_like(out) if isinstance(out, torch.Tensor) else forward(*args)

    def setup_context(ctx, inputs, output):
        ctx.inputs = inputs
        ctx.save_for_backward(*[a for a in inputs if isinstance(a, torch.Tensor)])

    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        args = [next(saved).detach().requires_grad_(a.is_floating_point())
                if isinstance(a, torch.Tensor) else a for a in ctx.inputs]
        wanted = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        with torch.enable_grad():
            out = _original_apply(cls, *args)
            grads = torch.autograd.grad(out, wanted, grad, allow_unused=True)
        found = iter(grads)
        return tuple(next(found) if isinstance(a, torch.Tensor) and a.requires_grad else None
                     for a in args)

    _LIB.impl(name, forward, "CompositeExplicitAutograd")
    torch.library.register_fake(qualified, fake, lib=_LIB)
    torch.library.register_autograd(qualified, backward, setup_context=setup_context, lib=_LIB)
    return getattr(getattr(torch.ops, _NAMESPACE), name).default


_patches = 0  # captures inside opaque_functions, in any thread (Function.apply patched while > 0)


@contextlib.contextmanager
def opaque_functions(mode: str = "train"):
    """Inside it, a user's autograd.Function called in this thread is one op (see above); in
    other threads, meanwhile, Function.apply does what it always does. ``mode``: "train" (a
    call that cannot be one op is a CaptureError) or "inference" (it is traced as before, said)."""
    global _patches
    before = getattr(_capturing, "mode", None)
    with _REGISTRY_LOCK:
        if _patches == 0:
            Function.apply = classmethod(_patched_apply)
        _patches += 1
    _capturing.mode = mode
    try:
        yield
    finally:
        _capturing.mode = before
        with _REGISTRY_LOCK:
            _patches -= 1
            if _patches == 0:
                Function.apply = classmethod(_original_apply)
