"""bfloat16 linear layers on a CPU with their weights packed once, as torch.compile's freezing
does, instead of on every call.

ATen's bf16 ``linear``/``addmm`` on a CPU reach oneDNN's matmul with the weight in its plain
layout, and the kernel copies it into its blocked layout on every call. oneDNN's linear over a
weight reordered once (``mkldnn._reorder_linear_weight``, ``mkldnn._linear_pointwise``) skips
that copy. On a 2-core AMX Xeon (bf16, interleaved medians): 16 rows of a 768x768 layer
0.074 -> 0.042 ms, 768x3072 0.255 -> 0.168 ms, a 1024^3 layer 2.50 -> 2.16 ms, 1024 rows of
768x3072 8.45 -> 6.97 ms; the results the same bits on contiguous inputs. float32 and float16
gain nothing measurable there (float32 loses at one row), so only bf16 is packed.

The graph keeps its ``aten.linear`` (what plans, reports, exports and ``torch.compile`` read):
PackCpuLinears marks the nodes, the converted module's generated code calls
``self.cpu_linears`` for them, and the conversion's own check runs them the same way, so the
error it reports is the error of the kernels the module runs. A call takes ATen's own op
wherever the packed one would not be the same thing: autograd recording, any tracer
(torch.compile, torch.export, fx, jit, a dispatch mode such as FakeTensorMode), another device
or dtype, a tensor subclass, an inference-mode weight. A weight is packed again on the first
call after it is replaced or written in place (``load_state_dict``, ``param.copy_()``, an
optimizer step: its version counter moves); a write through ``param.data`` is not seen by
autograd's version counter, and so not here either: call ``module.cpu_linears.clear()`` after
one. The packed copies cost the memory of the bf16 weights once more; modules holding the same
weight tensor (``convert_decoder``'s two graphs) share its pack.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.fx
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mpgraph.ir.meta import TENSOR, TensorInfo

aten = torch.ops.aten
_LINEARS = (aten.linear.default, torch._C._nn.linear, torch.nn.functional.linear)
_ADDMMS = (aten.addmm.default, torch.addmm)


def packing_available() -> bool:
    """Whether this machine's oneDNN runs bf16 natively (AVX512-BF16 or AMX)."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # (a torch built without oneDNN)
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (n x k) in oneDNN's blocked layout for its linear kernel."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _run(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packable(node: torch.fx.Node, root: torch.nn.Module) -> Optional[str]:
    """"linear", "addmm" or "module" for a node that multiplies by a stored 2-D weight the way
    the packed call does (``linear(x, W, b)``, GPT-2's ``addmm(b, x, W)`` with 2-D ``x``, an
    ``nn.Linear`` itself), each argument a node; else None."""
    if node.kwargs or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    if node.op == "call_module":
        mod = root.get_submodule(node.target) if isinstance(node.target, str) else None
        return "module" if type(mod) is torch.nn.Linear and len(node.args) == 1 else None
    if node.op != "call_function":
        return None
    if node.target in _LINEARS and len(node.args) in (2, 3):
        weight = node.args[1]
    elif node.target in _ADDMMS and len(node.args) == 3:
        weight = node.args[2]
    else:
        return None
    return _kind(node) if weight.op == "get_attr" else None


SMALL = 4096  # rows * n * k at or below which ATen's own small GEMM is faster (it keeps such
# products off oneDNN too): a packed call costs ~20 us more on a 16x16 layer


def _eager(x, weight, bias) -> bool:
    """Whether this is a plain eager call on CPU bf16 tensors that records no derivative and
    that no user mode or transform wants to see as ``linear`` (~1 us: every call asks)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() \
            or _get_current_dispatch_mode() is not None \
            or torch.is_autocast_enabled("cpu") or not torch._C._get_mkldnn_enabled() \
            or torch._C._is_torch_function_mode_enabled() \
            or torch._C._functorch.peek_interpreter_stack() is not None \
            or forward_ad._current_level >= 0:  # (vmap, jvp, dual tensors: no rule for mkldnn)
        return False
    grad = torch.is_grad_enabled()
    for t in (x, weight, bias):
        if t is None:
            continue
        if (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter) \
                or t.dtype is not torch.bfloat16 or not t.is_cpu or (grad and t.requires_grad):
            return False
    return True


def _fits(x: torch.Tensor, weight: torch.Tensor, bias, transposed: bool) -> bool:
    """Whether oneDNN's linear computes what ATen's would here: a 2-D weight whose k is x's
    last dimension, a bias of exactly (n,) and contiguous (ATen broadcasts others, oneDNN reads
    them as (n,)), and a product above SMALL."""
    if weight.dim() != 2 or x.dim() < 1:
        return False
    n, k = (weight.size(1), weight.size(0)) if transposed else (weight.size(0), weight.size(1))
    if x.size(-1) != k or x.numel() * n <= SMALL:
        return False
    return bias is None or (bias.dim() == 1 and bias.size(0) == n and bias.is_contiguous())


def _plain_call(mod: torch.nn.Module) -> bool:
    """Whether calling ``mod`` runs its class's forward and nothing else (no hooks of its own or
    global ones, no forward set on the instance): what ``nn.Module._call_impl`` tests too."""
    from torch.nn.modules import module as m
    return not (mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                or mod._backward_pre_hooks or m._global_forward_hooks
                or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks or "forward" in mod.__dict__)


# the packs of every weight in the process, by (id(weight), transposed): (a weak reference to
# the weight, its version, its address, the pack). Shared by the modules holding the same tensor
# (convert_decoder's prefill and decode graphs); an entry goes when its weight is freed.
_PACKS: dict = {}


def _forget(key):
    def drop(ref):
        found = _PACKS.get(key)
        if found is not None and found[0] is ref:
            _PACKS.pop(key, None)
    return drop


def packed_weight(weight: torch.Tensor, transposed: bool = False) -> Optional[torch.Tensor]:
    """``weight`` (``transposed``: its transpose) packed, from the store while the weight is the
    same tensor at the same version and address, else packed now; None for a weight that cannot
    be followed (an inference tensor has no version counter; one in shared memory, which other
    processes write)."""
    if weight.is_inference() or weight.dim() != 2:
        return None
    key = (id(weight), transposed)
    found = _PACKS.get(key)
    if found is not None and found[0]() is weight and found[1] == weight._version \
            and found[2] == weight.data_ptr():
        return found[3]
    # the version and address the pack is made from, read before it is made: a write while it
    # is made (load_state_dict in another thread) leaves the store behind, so the next call
    # packs again (read after, the pack of the old values passed for current, for good)
    version, address = weight._version, weight.data_ptr()
    with torch.no_grad():
        w = weight.detach()
        # in shared memory (share_memory(): its address moved, so this is a miss), another
        # process's writes move no version counter here: ATen's op, which reads it on each call
        packed = None if weight.is_shared() else _pack(w.t() if transposed else w)
    # (w keeps the storage packed from alive: a tensor given new .data twice cannot have its
    # new storage at the old address, which would pass for the same weight)
    _PACKS[key] = (weakref.ref(weight, _forget(key)), version, address, packed, w)
    return packed


class CpuLinears:
    """What a converted module's code calls for the linears PackCpuLinears marked; each call
    checks that its weight's pack is current (~1 us)."""

    def clear(self) -> None:
        """Drops the packed weights (every module's: each is packed again on its next call),
        after a write through ``.data``, which no version counter sees. A device move
        (``.to()``) calls it too, so no host copy outlives the weights it was made from."""
        _PACKS.clear()

    def __copy__(self):  # (the packs live in the store, by weight: a copy holds nothing)
        return CpuLinears()

    def __deepcopy__(self, memo):
        return CpuLinears()

    def linear(self, x, weight, bias=None):
        if _fits(x, weight, bias, False) and _eager(x, weight, bias):
            packed = packed_weight(weight)
            if packed is not None:
                return _run(x, packed, bias)
        return torch.nn.functional.linear(x, weight, bias)

    def addmm(self, bias, x, weight):
        """``addmm(bias, x, weight)``: ``weight`` is k x n (GPT-2's Conv1D)."""
        if x.dim() == 2 and _fits(x, weight, bias, True) and _eager(x, weight, bias):
            packed = packed_weight(weight, transposed=True)
            if packed is not None:
                return _run(x, packed, bias)
        return torch.addmm(bias, x, weight)

    def module(self, mod: torch.nn.Module, x):
        """An ``nn.Linear`` called (another module swapped in runs as it is)."""
        if type(mod) is torch.nn.Linear and _plain_call(mod):
            return self.linear(x, mod.weight, mod.bias)
        return mod(x)


def cpu_linears_of(root: torch.nn.Module) -> CpuLinears:
    """``root``'s CpuLinears, made on first use (kept in its ``__dict__``)."""
    found = root.__dict__.get("_cpu_linears")
    if found is None:
        found = root.__dict__["_cpu_linears"] = CpuLinears()
    return found


def call_packed(linears: CpuLinears, kind: str, module: Optional[torch.nn.Module], args: tuple):
    """The ``kind`` call (``_kind``) of ``linears`` on ``args``; ``module``: the ``nn.Linear`` a
    "module" call runs."""
    if kind == "module":
        return linears.module(module, *args)
    return getattr(linears, kind)(*args)


def run_packed(root: torch.nn.Module, node: torch.fx.Node, args: tuple):
    """A node PackCpuLinears marked, run as the converted module's code runs it."""
    kind = _kind(node)
    module = root.get_submodule(node.target) if kind == "module" else None
    return call_packed(cpu_linears_of(root), kind, module, args)


def packed_code(node: torch.fx.Node, module_expr: Optional[str] = None) -> str:
    """The generated code's call for a marked node (``module_expr``: how the code reads an
    ``nn.Linear``'s module)."""
    names = ", ".join(a.name for a in node.args)
    if node.op == "call_module":
        return f"self.cpu_linears.module({module_expr}, {names})"
    return f"self.cpu_linears.{_kind(node)}({names})"


def _kind(node: torch.fx.Node) -> str:
    """The CpuLinears method a marked node calls, from the node alone (not from the module it
    calls now: another module swapped in runs as it is, through ``module``)."""
    if node.op == "call_module":
        return "module"
    return "linear" if node.target in _LINEARS else "addmm"


def fits_at(node: torch.fx.Node, root: torch.nn.Module) -> bool:
    """Whether a packable node, at the shapes its graph records (the example's), would run
    packed (``_fits`` on meta tensors of those shapes): what the cost table times packed."""
    kind = packable(node, root)
    if kind == "module":
        mod = root.get_submodule(node.target)
        infos = [node.args[0].meta.get(TENSOR), mod.weight, mod.bias]
    elif kind is not None:
        infos = [a.meta.get(TENSOR) for a in node.args]
        if kind == "addmm":  # addmm(bias, x, weight)
            infos = [infos[1], infos[2], infos[0]]
    else:
        return False
    if not all(isinstance(i, (TensorInfo, torch.Tensor)) for i in infos[:2]):
        return False
    x, weight, bias = (None if i is None else torch.empty(tuple(i.shape), device="meta")
                       for i in (infos + [None])[:3])
    return (kind != "addmm" or x.dim() == 2) and _fits(x, weight, bias, kind == "addmm")
