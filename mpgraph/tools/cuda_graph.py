"""A CUDA-graph runtime for static shapes: ``mpgraph.cuda_graph(converted)``.

A converted module at small batch is bound by the host: BERT-base at 1x16 launches hundreds of
small kernels, each costing more CPU time than GPU time. A CUDA graph records those launches once
and replays them with one call (measured by hand on an H200, BERT 1x16: 0.83 ms replayed vs
4.23 ms for ``.half()`` eager). A graph is fixed to its tensors' addresses and shapes, so the
wrapper keeps one graph per input signature, with static input buffers the inputs are copied into.

It is the nearest thing to ``torch.compile(mode="reduce-overhead")``, which also replays CUDA
graphs (cudagraph trees), of the kernels Inductor generates, after compiling the module (and
again when a guard fails). ``cuda_graph`` compiles nothing: it records the module's own eager
kernels (mpgraph's plan as converted), costs a few warm-up runs and one capture per signature,
and says why whenever it runs eagerly instead.

Inference only: a replay has no autograd history, so with autograd on and parameters or inputs
that require grad the wrapper runs the module eagerly (and says so once).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

# why a call ran eagerly: the key counted in stats.fallbacks, and the one-time message
REASONS = {
    "no_cuda": "CUDA is not available here",
    "not_cuda": "the inputs are not all CUDA tensors (CUDA graphs record CUDA work only)",
    "devices": "the input tensors are on several CUDA devices",
    "nested": "called while a CUDA graph capture is already under way (the module runs inside it)",
    "grad": "autograd is on and the module's parameters or inputs require grad: a replay has no "
            "autograd history; call it under torch.no_grad() or torch.inference_mode(), or "
            "freeze the module with .requires_grad_(False)",
    "unhashable": "a non-tensor argument is not hashable, so it cannot be part of a signature",
    "mutates_input": "the module writes into its input tensors in place: a replay would write "
                     "into the wrapper's copies, not into yours",
    "capture_failed": "capture failed (a host sync such as .item(), data-dependent control flow, "
                      "or an op CUDA graphs cannot record)",
}


def signature(args: tuple, kwargs: dict | None = None) -> tuple:
    """The cache key of one call: the pytree structure of (args, kwargs), and per leaf its shape,
    dtype and device (tensors) or its type and value (anything else: Python scalars change what
    the module computes, and a graph records one computation)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    return _key(leaves, spec)


def _key(leaves: list, spec) -> tuple:
    return (spec, tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor)
                        else (type(x), x) for x in leaves))


@dataclasses.dataclass
class GraphStats:
    """What the cache did; ``fallbacks`` counts eager calls by reason (keys of ``REASONS``)."""
    graphs: int = 0           # graphs cached now
    max_graphs: int = 0
    hits: int = 0
    misses: int = 0
    captures: int = 0         # graphs captured (misses that did not fall back)
    evictions: int = 0        # least recently used graphs dropped for a new one
    invalidations: int = 0    # all graphs dropped because the module's tensors moved
    fallbacks: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        falls = ", ".join(f"{k} {v}" for k, v in sorted(self.fallbacks.items())) or "none"
        return (f"{self.graphs} graphs cached (max {self.max_graphs}), {self.hits} hits, "
                f"{self.misses} misses, {self.captures} captures, {self.evictions} evictions, "
                f"{self.invalidations} invalidations; eager fallbacks: {falls}")


class CudaGraphBackend:
    """The CUDA-specific part, kept apart so that tests on a CPU can replace it."""

    def unsupported(self, tensors: list[torch.Tensor]) -> str | None:
        """The reason (a key of REASONS) these inputs cannot be graphed, or None."""
        if not torch.cuda.is_available():
            return "no_cuda"
        devices = {t.device for t in tensors}
        if not devices or any(d.type != "cuda" for d in devices):
            return "not_cuda"
        if len(devices) > 1:
            return "devices"
        if torch.cuda.is_current_stream_capturing():
            return "nested"
        return None

    def warmup(self, fn: Callable[[], Any], device: torch.device, iters: int) -> None:
        """Eager runs on a side stream, as PyTorch's CUDA graph docs do: lazy initialisation
        (cuBLAS workspaces, cuDNN autotuning, allocator growth) must not land in the capture."""
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(iters):
                    fn()
            torch.cuda.current_stream().wait_stream(side)

    def capture(self, fn: Callable[[], Any], device: torch.device) -> tuple[Any, Any]:
        """(graph, fn's outputs as captured). Each graph gets its own memory pool, so that
        dropping it frees its memory and no replay writes into another graph's outputs."""
        with torch.cuda.device(device):
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            pool = torch.cuda.graph_pool_handle()
            try:
                # the outer stream context puts the caller's stream back even when capture_end
                # raises (torch.cuda.graph's own __exit__ skips that when capture_end fails)
                with torch.cuda.stream(side), torch.cuda.graph(graph, pool=pool, stream=side):
                    out = fn()
            except Exception:
                _release_failed_capture(graph, pool)
                _end_generator_capture(device)
                raise
            torch.cuda.current_stream().wait_stream(side)
        return graph, out

    def replay(self, graph: Any, device: torch.device) -> None:
        graph.replay()  # on the capture device's current stream (CUDAGraph.replay guards it)


def _release_failed_capture(graph: Any, pool: Any) -> None:
    """When a capture fails, torch's capture_end raises before it stops routing allocations to
    the graph's pool: the pool would stay, and every later allocation would test it. End it the
    way torch's cudagraph trees do, unless the capture did end (then the graph frees its pool)."""
    try:
        graph.pool()  # raises unless capture_end succeeded
        return
    except RuntimeError:
        pass
    try:
        device = torch.cuda.current_device()
        torch._C._cuda_endAllocateToPool(device, pool)
        torch._C._cuda_releasePool(device, pool)
    except Exception:  # best effort: private torch calls, absent or changed in some versions
        log.debug("cuda_graph: could not release a failed capture's memory pool", exc_info=True)


def _end_generator_capture(device: torch.device) -> None:
    """A failed capture leaves the device's default CUDA generator capturing: capture_begin puts
    it in capture mode and only a capture_end that succeeds takes it out (torch 2.11's
    CUDAGeneratorState), so every later random op outside a graph (``torch.randn(...,
    device="cuda")``) raised "Offset increment outside graph capture encountered unexpectedly".
    A capture that ends takes it out: one of a single kernel, into a graph dropped at once (its
    pool with it). The generator's offset is untouched: eager random numbers go on as if the
    failed capture had not been tried."""
    try:
        scratch = torch.zeros(1, device=device)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
            scratch.add_(1)  # (of a graph with no kernel torch warns that it is empty)
    except Exception:
        log.warning("cuda_graph: could not take the CUDA random generator of %s out of the "
                    "failed capture's state: random ops there may raise \"Offset increment "
                    "outside graph capture\" (torch.cuda.manual_seed does not reset it)",
                    device, exc_info=True)


def _root_message(e: BaseException) -> str:
    """The first line of the error that started it (capture_end's own error comes last)."""
    while e.__context__ is not None:
        e = e.__context__
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


class _NoGraph(Exception):
    """This signature gets no graph: ``reason`` is a key of REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclasses.dataclass
class _Entry:
    graph: Any
    device: torch.device
    inputs: list          # static input buffers, in tensor-leaf order
    outputs: list         # the graph's output leaves (tensors are overwritten by each replay)
    out_spec: Any


class GraphedModule(torch.nn.Module):
    """``module`` replayed from CUDA graphs, one per input signature; see ``cuda_graph``."""

    def __init__(self, module: torch.nn.Module, *, max_graphs: int = 8,
                 static_outputs: bool = False, warmup: int = 3,
                 backend: CudaGraphBackend | None = None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"cuda_graph wraps a torch.nn.Module, not {type(module).__name__}")
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be at least 1 (lazy CUDA initialisation must not be "
                             f"captured), got {warmup!r}")
        self.module = module
        self.max_graphs, self.static_outputs, self.warmup = max_graphs, static_outputs, warmup
        self.backend = backend or CudaGraphBackend()
        self.reset()

    @property
    def plan(self):
        """The converted module's plan."""
        return self.module.plan

    def reset(self) -> None:
        """Drop every graph and forget failed signatures, counters and messages given."""
        self._graphs: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._failed: dict[tuple, str] = {}  # signatures that get no graph, and why
        self._warned: set[str] = set()
        self._state: list[torch.Tensor] | None = None  # the module's tensors the graphs read
        self._ptrs: list[int] = []
        self.stats = GraphStats(max_graphs=self.max_graphs)

    def _apply(self, fn, *args, **kwargs):
        # .to(), .half(), .cuda() on the wrapper move the tensors the graphs read
        out = super()._apply(fn, *args, **kwargs)
        self._drop_graphs()
        return out

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._failed.clear()
        self._state = None
        self.stats.graphs = 0

    def _check_state(self) -> None:
        """Graphs read parameters and buffers at the addresses they had at capture: when the
        module's tensors moved (``fast.half()``, ``p.data = ...``), drop the graphs. (A list of
        the tensors, not a walk over the module: that walk costs 0.4 ms on BERT-base.)"""
        if self._state is not None and self._graphs and \
                [t.data_ptr() for t in self._state] != self._ptrs:
            log.info("cuda_graph: the module's parameters or buffers moved; dropping %d graphs",
                     len(self._graphs))
            self.stats.invalidations += 1
            self._drop_graphs()
        if self._state is None:
            self._state = [*self.module.parameters(), *self.module.buffers()]
            self._ptrs = [t.data_ptr() for t in self._state]

    def _eager(self, reason: str, args: tuple, kwargs: dict, detail: str = ""):
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("cuda_graph: running %s eagerly: %s%s (counted in .stats.fallbacks[%r]; "
                        "this message is given once)", type(self.module).__name__,
                        REASONS[reason], detail, reason)
        return self.module(*args, **kwargs)

    def forward(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        reason = self.backend.unsupported(tensors)
        if reason:
            return self._eager(reason, args, kwargs)
        self._check_state()
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors + self._state):
            return self._eager("grad", args, kwargs)
        key = _key(leaves, spec)
        try:
            entry = self._graphs.get(key)
        except TypeError:
            return self._eager("unhashable", args, kwargs)
        if entry is not None:
            self.stats.hits += 1
            self._graphs.move_to_end(key)
        elif key in self._failed:
            return self._eager(self._failed[key], args, kwargs)
        else:
            self.stats.misses += 1
            try:
                entry = self._capture(key, leaves, spec, tensors)
            except _NoGraph as e:
                self._failed[key] = e.reason
                return self._eager(e.reason, args, kwargs, e.detail)
        for buf, t in zip(entry.inputs, tensors):
            buf.copy_(t)
        self.backend.replay(entry.graph, entry.device)
        outs = entry.outputs if self.static_outputs else [
            o.clone() if isinstance(o, torch.Tensor) else o for o in entry.outputs]
        return pytree.tree_unflatten(outs, entry.out_spec)

    def _capture(self, key: tuple, leaves: list, spec, tensors: list) -> _Entry:
        """A new entry for this signature; _NoGraph when it cannot have one."""
        if not self._graphs:  # nothing captured reads the module yet: see it afresh
            self._state = None
            self._check_state()
        device = tensors[0].device if tensors else None
        with torch.inference_mode(False), torch.no_grad():
            inputs = [t.detach().clone() for t in tensors]
            it = iter(inputs)
            static = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
            s_args, s_kwargs = pytree.tree_unflatten(static, spec)

            def run():
                return self.module(*s_args, **s_kwargs)

            versions = [b._version for b in inputs]
            self.backend.warmup(run, device, self.warmup)  # the module's own errors raise here
            if [b._version for b in inputs] != versions:
                raise _NoGraph("mutates_input")
            try:
                graph, out = self.backend.capture(run, device)
            except Exception as e:  # warm-up ran it eagerly: what fails now is the capture
                log.debug("cuda_graph: capture failed for %s", key, exc_info=True)
                raise _NoGraph("capture_failed", f": {_root_message(e)}") from e
        outputs, out_spec = pytree.tree_flatten(out)
        if len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)  # the least recently used; its graph and buffers go
            self.stats.evictions += 1
        self._graphs[key] = _Entry(graph, device, inputs, outputs, out_spec)
        self.stats.captures += 1
        self.stats.graphs = len(self._graphs)
        return self._graphs[key]


def cuda_graph(module: torch.nn.Module, *, max_graphs: int = 8, static_outputs: bool = False,
               warmup: int = 3) -> GraphedModule:
    """Replay ``module`` (a converted GraphModule, or any module) from CUDA graphs.

    Each call's signature (argument structure; per tensor its shape, dtype and device; every
    other argument's value) selects a graph: on a miss the inputs are copied into static
    buffers, the module runs ``warmup`` times on a side stream and is captured under
    ``torch.no_grad()``; every call copies its inputs into that signature's buffers and replays.
    At most ``max_graphs`` graphs are kept, least recently used evicted (each holds its own
    buffers and activation memory, about one forward's peak). ``.stats`` counts graphs, hits,
    misses, captures, evictions and eager fallbacks by reason; ``.reset()`` drops everything.

    Outputs are fresh tensors: one device copy per output per call. ``static_outputs=True``
    returns the graph's own output tensors instead (no copy), which the next call with the same
    signature overwrites in place: copy (``.clone()``) what you keep beyond that call.

    The module runs eagerly instead, with a one-time warning per reason, where a graph could not
    give the eager answer: CPU inputs or no CUDA, autograd needed, a module that writes into its
    inputs, or a capture that fails (``.item()``, data-dependent control flow, host syncs); a
    signature whose capture failed is not tried again. Not captured, so not detected: Python-side
    decisions that do not depend on the signature, and asynchronous copies from host memory
    inside ``forward``; a converted module's fx graph has neither. Replacing the module's
    parameters with new tensor objects needs ``.reset()``; moving them (``.half()``, ``.to()``)
    is detected.
    """
    return GraphedModule(module, max_graphs=max_graphs, static_outputs=static_outputs,
                         warmup=warmup)
