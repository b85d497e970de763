"""Measured costs: this machine's own kernels, each distinct op of the graph timed once.

The captured float32 graph runs once on the example inputs; at each node whose op, shapes and
arguments (its key) the table does not hold yet, the op is called again on those very values, in
float32 and in each low dtype this machine runs natively (inputs and weights cast to it), and the
cast of its output to each low dtype and back is timed too. Each variant is timed after a warm-up
call, call by call, until the median of the calls settles (the last calls' median within
``SETTLED`` of the one before) or its time budget is spent: a noisy machine costs more calls, not
a wrong figure. A busy one (other processes on its cores: every call slowed alike, and a parallel
kernel by 10x or more) would settle on a wrong figure: a probe kernel before and after each
measurement marks what was measured busy, and a later conversion on a quieter machine measures it
again (``BUSY``). On a GPU the calls are timed with CUDA events, and a node costs the longer of its
kernel and the host time of the call (eager mode queues kernels). The host time of a call is
part of every figure, so small shapes come out host-bound as they are.

The table is cached on disk by machine: device, instruction set (and any ISA cap in the
environment), thread count and torch version; a second conversion of the same model measures
nothing. ``mpgraph calibrate`` (and ``measure(..., fresh=True)``) measures again. A dtype this
machine emulates (bf16 and fp16 on an AVX2-only CPU run matmuls at ~1% of float32) is not
measured op by op: the micro-benchmark's peaks say it loses everywhere, and the roofline prices it.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import statistics
import time
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.cost.device import cache_dir, cpu_flags, cpu_name, isa_caps
from mpgraph.cost.model import CostModel, NodeCost
from mpgraph.cost.roofline import Roofline, node_flops
from mpgraph.ir.cpu_linear import CpuLinears, call_packed, fits_at, packable, packing_available
from mpgraph.ir.graph import (RecordingInterpreter, fetch_attr, flat_inputs, fresh, is_conv2d,
                              is_inplace, is_view, read_transposed, seeded, state_kept,
                              target_name)
from mpgraph.ir.meta import COST_KEY, TENSOR, Kind, TensorInfo, dtype_name, tensor_infos

log = logging.getLogger(__name__)
progress = logging.getLogger("mpgraph.progress")

TABLE_FORMAT = "mpgraph-cost-table/7"  # 7: bf16 linears timed plain and packed
SETTLED = 0.05          # relative change of the running median at which a timing stops
# a low dtype measured less than this share faster than float32 is taken as no faster: a 64x64
# Linear on one row timed 8.61 us in fp16 against 9.33 in fp32 (quiet) and 16.4 against 22.4
# (loaded), where called in turn 2000 times fp16 is the slower, 7.9 against 7.1 us; 32 of them
# were planned fp16 and estimated 1.32x faster, and ran 0.82x
NOISE = 0.10
VARIANT_BUDGET_S = 0.5  # seconds the variants of one op may take together to settle
MIN_CALLS, MAX_CALLS = 5, 200
SLOW_S = 0.05           # a call this long: a few calls say enough
EMULATED = 0.2          # a low dtype below this share of float32's matmul rate is not measured
# (emulated bf16/fp16 runs at ~1-2% of float32, native at 0.8-4x: 0.2 is far from both, where
# 0.5 was crossed by a busy machine's noise)
STREAM_MIN_BYTES = 256 << 10   # weights this large are timed as read from memory (see Layout)
STREAM_MAX_BYTES = 256 << 20   # the copies a timing cycles through, at most, per timed dtype
MAX_COPIES = 64
_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def machine_key(device: torch.device) -> tuple[str, str]:
    """(a name for the device, the key its measurements are cached under)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} (CUDA {torch.version.cuda})"
    else:
        flags = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16",
                                      "avx512f", "avx2"})
        caps = isa_caps()
        name = (f"CPU {cpu_name()} ({torch.get_num_threads()} threads, "
                f"{' '.join(flags) or 'no vector flags'}{', capped ' + caps if caps else ''})")
    return name, f"{name}|torch {torch.__version__}"


def _read(path: str, key: str) -> dict:
    """What a cache file made for machine ``key`` in this format holds ({} otherwise): its
    ``entries``, the probe's time when each was measured (``probe_at``) and the machine's best
    ``probe_s``."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") == TABLE_FORMAT and data.get("key") == key:
            # a damaged but parseable file ("n/a", NaN, -1): what is not a time is not held, and
            # is measured again (a string failed float() deep in EstimateCost; a negative time
            # left _choose_low no candidate)
            entries = {k: v for k, v in dict(data["entries"]).items()
                       if v is None or _seconds(v, zero=True)}
            probe_at = {k: v for k, v in dict(data.get("probe_at") or {}).items()
                        if _seconds(v)}
            probe = data.get("probe_s")
            return {"entries": entries, "probe_at": probe_at,
                    "probe_s": probe if _seconds(probe) else None}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}


def _seconds(value, zero: bool = False) -> bool:
    """Whether a cached value is a time: a finite number above 0 (or 0, with ``zero``)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and (value > 0 or zero and value == 0))


# A busy machine (other processes on the cores this one's threads run on) makes a parallel
# kernel wait on its threads: measured while a test suite and three other jobs shared 2 cores,
# a Llama decode step's 2304x768 matrix-vector product took 5.76 ms against 0.31 ms quiet, and
# the cached figure kept its projections in float32 for good. A probe (a parallel
# matrix-vector product, 8 MB: 0.15 ms quiet here, 2.8-5 ms beside one other process running
# 2-thread kernels; a 512x512 one runs on one thread and does not see it; the fastest of 15
# calls) before and after each measurement is kept with
# what it measured: an entry whose probe ran BUSY times the best this machine has shown (then or
# since) or more was measured busy, and a conversion that finds the machine RELIEF times quieter
# than that measures it again.
BUSY = 2.0
RELIEF = 1.5
_PROBE: dict = {}


def probe_s(device: torch.device) -> Optional[float]:
    """Seconds of the probe kernel here now (the fastest of 15 calls); None off the CPU."""
    if device.type != "cpu":
        return None
    from torch.utils._python_dispatch import _disable_current_modes
    with torch.no_grad(), _disable_current_modes(), torch.device("cpu"):  # (not the caller's
        if "w" not in _PROBE:                         # modes, nor its default device)
            g = torch.Generator().manual_seed(0)
            _PROBE["w"] = torch.randn(2048, 1024, generator=g, dtype=torch.float32)
            _PROBE["x"] = torch.randn(1024, generator=g, dtype=torch.float32)
        w, x = _PROBE["w"], _PROBE["x"]
        torch.mv(w, x)
        best = math.inf
        for _ in range(15):
            t = time.perf_counter()
            torch.mv(w, x)
            best = min(best, time.perf_counter() - t)
    return best


class CostTable:
    """Seconds by key, for one machine; read from and written to a JSON file."""

    def __init__(self, device: torch.device, entries: Optional[dict] = None,
                 path: Optional[str] = None, probe_at: Optional[dict] = None,
                 probe: Optional[float] = None):
        self.device = torch.device(device)
        self.name, self.key = machine_key(self.device)
        self.entries: dict[str, Optional[float]] = dict(entries or {})
        self.path = path
        self.measured_now = 0  # entries this process measured (not from the cache)
        self.probe_at: dict[str, float] = dict(probe_at or {})  # entry -> the probe then
        self.probe_s = probe  # the fastest probe (``probe_s``) this machine has shown

    @property
    def busy(self) -> dict[str, float]:
        """The entries measured on a busy machine: how many times its best the probe ran."""
        best = self.probe_s
        return {e: p / best for e, p in self.probe_at.items()
                if best and p >= BUSY * best} if best else {}

    @classmethod
    def for_device(cls, device: torch.device, fresh: bool = False) -> "CostTable":
        """This machine's table from the cache (empty when ``fresh`` or none is there)."""
        device = torch.device(device)
        _, key = machine_key(device)
        # one file per machine and format: another mpgraph version on this machine keeps its own
        name = hashlib.sha1(f"{key}|{TABLE_FORMAT}".encode()).hexdigest()[:12]
        path = os.path.join(cache_dir(), f"costs-{name}.json")
        held = _read(path, key)
        if fresh:
            return cls(device, path=path, probe=held.get("probe_s"))
        return cls(device, held.get("entries"), path, held.get("probe_at"), held.get("probe_s"))

    def save(self) -> None:
        """Into the cache file, over what it holds (the entries of other models and of other
        processes measuring beside this one are kept; these replace theirs)."""
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            held = _read(self.path, self.key)
            probe_at = {k: v for k, v in held.get("probe_at", {}).items() if k not in self.entries}
            probes = [p for p in (held.get("probe_s"), self.probe_s) if p]
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"format": TABLE_FORMAT, "key": self.key, "device": self.name,
                           "entries": {**held.get("entries", {}), **self.entries},
                           "probe_at": {**probe_at, **self.probe_at},
                           "probe_s": min(probes) if probes else None}, f)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home is no reason to fail
            log.info("could not cache the measured costs: %s", e)

    def format(self, limit: int = 40) -> str:
        """The table as text: the slowest entries first (what ``mpgraph calibrate`` prints)."""
        rows = sorted(((v, k) for k, v in self.entries.items() if v is not None), reverse=True)
        lines = [f"measured costs on {self.name}: {len(self.entries)} entries"
                 + (f" ({self.measured_now} measured now)" if self.measured_now else "")]
        for seconds, key in rows[:limit]:
            lines.append(f"  {seconds * 1e6:>12.1f} us  {key[:150]}")
        if len(rows) > limit:
            lines.append(f"  ... and {len(rows) - limit} more")
        return "\n".join(lines)


def _arg_key(a) -> str:
    if isinstance(a, torch.fx.Node):
        infos = tensor_infos(a.meta.get(TENSOR))
        return ",".join(f"{list(i.shape)}{_SHORT.get(i.dtype, dtype_name(i.dtype))}"
                        for i in infos) or "value"
    text = repr(a)
    return text if len(text) <= 80 else text[:77] + "..."


def op_key(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    """What decides an op's time: the op, its tensors' shapes and dtypes, its other arguments
    (and a module's own description and parameter shapes)."""
    parts = [node.op]
    if node.op == "call_module":  # by what the module is, not where: twelve equal layers, one key
        module = gm.get_submodule(node.target)
        parts.append(repr(module).replace("\n", " "))
        parts += [f"{n}{list(p.shape)}" for n, p in module.named_parameters()]
    else:
        parts.append(target_name(node))
    parts.append(str(pytree.tree_map(_arg_key, (list(node.args), dict(node.kwargs)))))
    return " ".join(parts)


def _clock(device: torch.device) -> Callable[[Callable], float]:
    """A function timing one call: host seconds on a CPU; on a GPU the longer of the host time
    and the kernel time between CUDA events (eager mode queues kernels behind the host)."""
    if device.type != "cuda":
        def one(fn):
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        return one

    def one_cuda(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        start.record()
        fn()
        end.record()
        host = time.perf_counter() - t
        torch.cuda.synchronize(device)
        return max(host, start.elapsed_time(end) / 1e3)
    return one_cuda


def time_calls(fns: list, device: torch.device, prepares: Optional[list] = None,
               budget: float = VARIANT_BUDGET_S) -> list[Optional[float]]:
    """Median seconds of each ``fns[i]()``, the calls interleaved (one of each in turn, after a
    warm-up call of each) so that a machine that slows down or speeds up midway (a shared CPU:
    2.2 and 5.5 ms for the same call a few calls apart) moves every variant alike; rounds are
    added until every median settles (``SETTLED``) or ``budget`` seconds are spent.
    ``prepares[i]()`` runs before each call of ``fns[i]``, untimed. A variant that raises is
    None (an op that cannot run in that dtype here)."""
    clock = _clock(device)
    prepares = prepares or [None] * len(fns)
    alive = []
    spent = 0.0
    for i, (fn, prepare) in enumerate(zip(fns, prepares)):
        try:
            if prepare:
                prepare()
            spent += clock(fn)  # warm-up (allocations, oneDNN primitive creation)
            alive.append(i)
        except Exception as e:  # noqa: BLE001 - reported as None
            log.debug("variant %d cannot run: %s", i, e)
    times: dict[int, list[float]] = {i: [] for i in alive}
    previous: dict[int, float] = {}
    rounds = 0
    while alive and rounds < MAX_CALLS:
        rounds += 1
        for i in alive:
            if prepares[i]:
                prepares[i]()
            t = clock(fns[i])
            times[i].append(t)
            spent += t
        if rounds >= 2 and max(times[i][-1] for i in alive) > SLOW_S:
            break
        if rounds >= MIN_CALLS:
            medians = {i: statistics.median(times[i]) for i in alive}
            settled = all(i in previous and abs(medians[i] - previous[i]) <= SETTLED * previous[i]
                          for i in alive)
            if settled or spent > budget:
                break
            previous = medians
    return [statistics.median(times[i]) if i in times and times[i] else None
            for i in range(len(fns))]


def nhwc_values(gm: torch.fx.GraphModule) -> set:
    """The 4-D values a low-precision plan holds channels_last: 2-D convolutions' outputs (the
    ChannelsLast pass) and the 4-D outputs of ops reading one (batch norm, ReLU, pooling and
    adds keep the layout), from the graph's recorded shapes."""
    out: set = set()
    for n in gm.graph.nodes:
        info = n.meta.get(TENSOR)
        if n.op.startswith("call_") and (is_conv2d(n, gm) or (
                isinstance(info, TensorInfo) and len(info.shape) == 4
                and any(a in out for a in n.all_input_nodes))):
            out.add(n)
    return out


def weight_of(a) -> Optional[torch.fx.Node]:
    """The get_attr node an argument is, whole (through views keeping every element: a
    transposed weight; not a row picked from a table), else None."""
    while isinstance(a, torch.fx.Node):
        if a.op == "get_attr":
            return a
        if not (is_view(a) and a.all_input_nodes):
            return None
        source = a.all_input_nodes[0]
        mine, theirs = (getattr(v.meta.get(TENSOR), "numel", None) for v in (a, source))
        if mine is None or mine != theirs:  # a view onto some of the elements: a row, a slice
            return None
        a = source
    return None


_GATHERS = ("embedding", "embedding_bag", "index_select", "index", "gather", "take")


def _tensors_read(n: torch.fx.Node, gm) -> list[torch.Tensor]:
    """The weights (parameters, buffers, constants) a node reads whole, as its own arguments
    (what a timing can give it copies of): not a gather's table (an embedding reads a few rows
    of it), nor a view's (it reads nothing)."""
    if n.op == "call_module":
        module = gm.get_submodule(n.target)
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            return []
        return list(module.parameters()) + list(module.buffers())
    t = n.target
    if is_view(n) or (t if isinstance(t, str)
                      else getattr(t, "_opname", getattr(t, "__name__", ""))) in _GATHERS:
        return []
    out = []
    for a in (*n.args, *n.kwargs.values()):
        w = weight_of(a)
        value = fetch_attr(gm, w.target) if w is not None else None
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Layout(NamedTuple):
    """How a node's arguments sit in memory when the converted graph runs: ``nhwc``, the values
    held channels_last (``nhwc_values``); ``streamed``, for each node reading weights of at
    least ``STREAM_MIN_BYTES`` in a graph with other weights, the number of distinct copies its
    timing cycles through: the graph's weights over its own, rounded (at least 2, at most
    ``MAX_COPIES``; and ``STREAM_MAX_BYTES`` of copies per timed dtype). A forward reads each
    weight once, after the other weights: from memory, not from the cache a call repeated on
    the same weight keeps it in. Timed hot, a 768x768 float32 matrix-vector product took 27 us
    and a bf16 one 40 us; read once in turn, as a decoder's step reads them, 83 and 75 us
    (2-core Xeon): the cache made float32 look faster where it reads twice the bytes."""
    nhwc: set
    streamed: dict


def layout(gm: torch.fx.GraphModule) -> Layout:
    seen, total, read = set(), 0, {}
    for n in gm.graph.nodes:
        if n.op.startswith("call_"):
            read[n] = _tensors_read(n, gm)
            for t in read[n]:
                if id(t) not in seen:
                    seen.add(id(t))
                    total += _bytes(t)
    streamed = {}
    for n, tensors in read.items():
        size = sum(_bytes(t) for t in {id(t): t for t in tensors}.values())
        if size >= STREAM_MIN_BYTES and total > size and not is_inplace(n, gm):
            streamed[n] = min(MAX_COPIES, max(2, round(total / size)))
    return Layout(nhwc_values(gm), streamed)


def reads_nhwc(n: torch.fx.Node, gm, nhwc: set) -> bool:
    """Whether a low-precision ``n`` reads a channels_last value (a conv's input is made so)."""
    return is_conv2d(n, gm) or any(a in nhwc for a in n.all_input_nodes)


def _transposed_weight(a) -> bool:
    """Whether ``a`` is the transpose of a weight whose low-precision copy StoreWeights stores
    transposed (``read_transposed``): in float32 a strided view of the parameter, in the low
    dtype contiguous rows of the stored copy."""
    return isinstance(a, torch.fx.Node) and a.op == "call_function" \
        and a.target is torch.ops.aten.t.default and isinstance(a.args[0], torch.fx.Node) \
        and a.args[0].op == "get_attr" and read_transposed([a.args[0]])


def _as_stored(value, a):
    """A low-precision argument as the converted graph holds it (``_transposed_weight``)."""
    return value.contiguous() if isinstance(value, torch.Tensor) and _transposed_weight(a) \
        else value


def measure_key(n: torch.fx.Node, gm, where: Layout) -> str:
    """The op key, marked where the low-precision variants read channels_last values, where
    they read a weight stored transposed and where the node's weights are read from memory (the
    same op in another layout, or on a weight the cache holds, is another entry)."""
    return (op_key(n, gm) + (" nhwc" if reads_nhwc(n, gm, where.nhwc) else "")
            + (" transposed" if any(_transposed_weight(a) for a in n.args) else "")
            + (f" streamed/{where.streamed[n]}" if n in where.streamed else ""))


def _cast(value, dtype: torch.dtype, nhwc: bool = False):
    """Float32 tensors in a nest cast to ``dtype``; with ``nhwc`` the 4-D ones channels_last, as
    the ChannelsLast pass runs a low-precision convolution and the layers after it (an NCHW bf16
    conv times 1.3-1.5x slower). Other values keep their strides: attention's 4-D inputs made
    channels_last timed bf16 attention 2x slower than it runs in the converted graph."""
    def one(v):
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            return v
        return v.to(dtype, memory_format=torch.channels_last) if nhwc and v.dim() == 4 \
            else v.to(dtype)
    return pytree.tree_map(one, value)


class _Timer(RecordingInterpreter):
    """Runs the float32 graph on real values and times each node's unmeasured variants, each
    under its key (``measure_key``), its arguments in the layout ``where`` gives them: values
    channels_last where the plan holds them so, weights read from memory where streamed."""

    def __init__(self, gm, table: CostTable, lows: tuple, deadline: float, keys: dict,
                 where: Layout, packs: bool = False):
        super().__init__(gm, lambda node, value: None)
        self.table, self.lows, self.deadline = table, lows, deadline
        self.keys, self.where, self.packs = keys, where, packs
        self.done = 0

    def _copies(self, n, args, kwargs, module):
        """The argument sets (and modules) a streamed node's timing cycles through: its weights
        copied, so that each call reads a weight the calls before did not bring into cache."""
        wanted = self.where.streamed.get(n, 1)
        if module is not None:
            size = sum(_bytes(t) for t in (*module.parameters(), *module.buffers()))
        else:
            pairs = (*zip(args, n.args), *((kwargs[k], n.kwargs[k]) for k in kwargs))
            size = sum(_bytes(v) for v, a in pairs
                       if isinstance(v, torch.Tensor) and weight_of(a) is not None)
        count = max(1, min(wanted, STREAM_MAX_BYTES // max(size, 1)))
        if module is not None:  # (deep-copyable: capture copied the model it belongs to)
            return [(module, args, kwargs)] + [(copy.deepcopy(module), args, kwargs)
                                               for _ in range(count - 1)]

        def copied(v, a):
            return v.clone() if isinstance(v, torch.Tensor) and weight_of(a) is not None else v
        return [(None, args, kwargs)] + [
            (None, tuple(copied(v, a) for v, a in zip(args, n.args)),
             {k: copied(v, n.kwargs[k]) for k, v in kwargs.items()}) for _ in range(count - 1)]

    def _call(self, n, args, kwargs, dtype, packed: bool = False):
        """(the op's call in ``dtype``, what to run before each call or None); ``packed``: a bf16
        linear over its weight packed once (PackCpuLinears)."""
        if dtype != torch.float32:  # each argument in the layout the converted graph gives it
            conv = is_conv2d(n, self.module)

            def nhwc(arg) -> bool:
                return conv or (isinstance(arg, torch.fx.Node) and arg in self.where.nhwc)
            args = tuple(_as_stored(_cast(v, dtype, nhwc(a)), a) for v, a in zip(args, n.args))
            kwargs = {k: _cast(v, dtype, nhwc(n.kwargs[k])) for k, v in kwargs.items()}
        module = None
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            if dtype != torch.float32:
                module = copy.deepcopy(module).to(dtype)
                if isinstance(module, torch.nn.Conv2d):
                    module.to(memory_format=torch.channels_last)
        if is_inplace(n, self.module) and args and isinstance(args[0], torch.Tensor):
            original, rest = args[0], args[1:]  # each call writes into a fresh copy
            call = [None]

            def prepare():
                fresh_args = (original.clone(), *rest)
                call[0] = (lambda: getattr(fresh_args[0], n.target)(*fresh_args[1:], **kwargs)
                           if n.op == "call_method" else n.target(*fresh_args, **kwargs))
            return (lambda: call[0]()), prepare
        sets = self._copies(n, args, kwargs, module) if n in self.where.streamed \
            else [(module, args, kwargs)]
        turn = [len(sets) - 1]
        # over its weight packed once (PackCpuLinears): each copy of a streamed weight packed
        # before the timing
        kind = packable(n, self.module) if packed else None
        linears = CpuLinears() if kind is not None else None

        def call():
            module, args, kwargs = sets[turn[0]]
            if linears is not None:
                return call_packed(linears, kind, module, args)
            if n.op == "call_module":
                return module(*args, **kwargs)
            if n.op == "call_method":
                return getattr(args[0], n.target)(*args[1:], **kwargs)
            return n.target(*args, **kwargs)

        def advance():
            turn[0] = (turn[0] + 1) % len(sets)
        if linears is not None:
            for _ in sets:
                advance()
                call()
        return call, (advance if len(sets) > 1 else None)

    def run_node(self, n):
        result = super().run_node(n)
        if not n.op.startswith("call_") or time.perf_counter() > self.deadline:
            return result
        key = self.keys[n]
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        entries, fns, prepares = [], [], []
        variants = [(dtype, False) for dtype in (torch.float32,) + self.lows]
        if self.packs and torch.bfloat16 in self.lows and _packs(n, self.module):
            variants.append((torch.bfloat16, True))
        for dtype, packed in variants:
            entry = f"{key}|{_SHORT[dtype]}{PACKED_SUFFIX if packed else ''}"
            if entry not in self.table.entries:
                try:
                    fn, prepare = self._call(n, args, kwargs, dtype, packed)
                except Exception as e:  # noqa: BLE001 - a module that cannot take the dtype
                    log.debug("%s in %s: %s", n.name, dtype, e)
                    self.table.entries[entry] = None
                    continue
                entries.append(entry)
                fns.append(fn)
                prepares.append(prepare)
        if isinstance(result, torch.Tensor) and result.dtype == torch.float32 and result.numel():
            for dtype in self.lows:
                down = f"cast {list(result.shape)} fp32->{_SHORT[dtype]}"
                if down not in self.table.entries and down not in entries:
                    low = result.to(dtype)
                    entries += [down, f"cast {list(result.shape)} {_SHORT[dtype]}->fp32"]
                    fns += [lambda d=dtype: result.to(d), lambda v=low: v.to(torch.float32)]
                    prepares += [None, None]
        if fns:
            for entry, seconds in zip(entries, time_calls(fns, self.table.device, prepares)):
                self.table.entries[entry] = seconds
            self.table.measured_now += len(fns)
        self.done += 1
        if self.done % 100 == 0:
            progress.info("measure: %d nodes", self.done,
                          extra={"mpgraph_stage": f"measure ({self.done} nodes)",
                                 "mpgraph_seconds": None})
        return result


PACKED_SUFFIX = " packed"  # a bf16 linear's entry timed over its weight packed once


def _packs(n: torch.fx.Node, gm) -> bool:
    """Whether a bf16 ``n`` may run packed on this machine (PackCpuLinears) at the example's
    shapes: then it is timed both ways, and the plan packs it only where packed was faster."""
    return packing_available() and fits_at(n, gm)


# the x86 instructions that run a low dtype's matmuls natively: without any, torch emulates it
# (~1% of float32's rate). Said by the flags, not only by the measured rates: on a busy machine
# float32's own rate falls (from 112 to ~1.5 GFLOP/s under two other processes on 2 cores), the
# ratio passed the bar, and a plan put a gelu in bf16, "116x float32" (float32's gelu, a parallel
# kernel, waited 15 ms a call for a core)
_NATIVE = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}


def emulated(dtype: torch.dtype, spec) -> bool:
    """Whether this machine runs ``dtype``'s matmuls at a fraction of float32's (emulated)."""
    flags = cpu_flags()
    if "avx2" in flags and not isa_caps() and not flags & _NATIVE.get(dtype, set()):
        return True
    rate = spec.matmul_peak(dtype)
    return rate is None or rate < EMULATED * spec.peak["fp32"]


def _wanted(gm: torch.fx.GraphModule, lows: tuple, where: Layout,
            packs: bool = False) -> tuple[dict, list]:
    """Each call node's key and the entries a measurement of ``gm`` would write, from the
    graph's tensor facts alone (what _Timer writes from the values it runs)."""
    keys, wanted = {}, []
    for n in gm.graph.nodes:
        if not n.op.startswith("call_"):
            continue
        keys[n] = key = measure_key(n, gm, where)
        wanted += [f"{key}|{_SHORT[dtype]}" for dtype in (torch.float32,) + lows]
        if packs and torch.bfloat16 in lows and _packs(n, gm):
            wanted.append(f"{key}|bf16{PACKED_SUFFIX}")
        info = n.meta.get(TENSOR)
        if isinstance(info, TensorInfo) and info.dtype == torch.float32 and info.numel:
            wanted += [f"cast {list(info.shape)} {a}->{b}" for d in lows
                       for a, b in (("fp32", _SHORT[d]), (_SHORT[d], "fp32"))]
    return keys, wanted


def measure(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, table: CostTable,
            lows: tuple, budget_s: float = 120.0, packs: bool = False) -> dict[torch.fx.Node, str]:
    """Time every distinct op of ``gm`` on these inputs in float32 and in ``lows`` (and the casts
    of its outputs) into ``table``; returns each node's key. Ops measured before (the table's
    cache) are not measured again; ``budget_s`` bounds the whole (the rest then costs what the
    roofline says)."""
    where = layout(gm)
    packs = packs and table.device.type == "cpu"  # (an inference plan for this CPU)
    keys, wanted = _wanted(gm, tuple(lows), where, packs)
    for node, key in keys.items():  # (a deep copy of the graph, the tolerance search's, keeps
        node.meta[COST_KEY] = key   # them: its rewritten nodes would key otherwise)
    best = table.probe_s
    before = _probe(table)  # (~2 ms: also when all is cached, where it may find a new best)
    busy = table.busy
    again = [e for e in wanted if e in busy and before is not None
             and table.probe_at[e] > RELIEF * before]
    for entry in again:  # measured busier than the machine is now: measured again
        table.entries.pop(entry, None)
        table.probe_at.pop(entry, None)
    if all(entry in table.entries for entry in wanted):
        if table.probe_s != best:
            table.save()  # (a new best: entries measured busier than it are found next time)
        return keys  # all cached: no need to run the graph
    known = set(table.entries)
    timer = _Timer(gm, table, tuple(lows), time.perf_counter() + budget_s, keys, where, packs)
    flat = fresh(flat_inputs(gm, args, kwargs))
    with torch.no_grad(), seeded(), state_kept(gm):
        timer.run(*flat, enable_io_processing=False)
    after = _probe(table)
    new = [e for e in table.entries if e not in known]
    seen = max((p for p in (before, after) if p is not None), default=None)
    if seen is not None:
        table.probe_at.update({e: seen for e in new})
    ratio = seen / table.probe_s if seen and table.probe_s else 1.0
    if ratio >= BUSY:
        log.warning("measured %d op costs while this machine was busy (a reference kernel ran "
                    "%.1fx slower than its best here): the plan rests on them, and a conversion "
                    "on a quieter machine measures them again", len(new), ratio)
    if table.measured_now:
        table.save()
    return keys


def _probe(table: CostTable) -> Optional[float]:
    """The probe's seconds now (None off the CPU); the best this machine has shown is kept in
    the table."""
    now = probe_s(table.device)
    if now is not None:
        table.probe_s = min(now, table.probe_s or now)
    return now


class Measured(CostModel):
    """Costs from a ``CostTable`` of this machine; a node the table does not hold (not measured,
    or an op that could not run alone) costs what ``fallback`` (the roofline) says."""

    def __init__(self, table: CostTable, fallback: Roofline, lows: tuple,
                 keys: Optional[dict] = None, packs: bool = False):
        self.table, self.fallback = table, fallback
        self.packs = packs  # an inference plan for this CPU: bf16 linears may run packed
        self.keys = dict(keys or {})  # node -> op key (measure's); others keyed when asked
        self.kind = Kind.GPU if table.device.type == "cuda" else Kind.CPU
        self.name = table.name
        self.lows = tuple(lows)
        held = sum(1 for k in self.keys.values() if table.entries.get(f"{k}|fp32") is not None)
        self.source = (f"measured on this {self.kind.name}, op by op"
                       + (f" ({held} of {len(self.keys)} nodes)" if self.keys else "")
                       + f": {table.name}")

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 or dtype in self.lows  # (the others are emulated here)

    def _key(self, node, gm) -> str:
        """A node measure did not key (a copy of the graph's): keyed as measure keys them."""
        if getattr(self, "_layout", (None,))[0] is not gm:
            self._layout = (gm, layout(gm))
        return measure_key(node, gm, self._layout[1])

    def _get(self, key: Optional[str], dtype: torch.dtype) -> Optional[float]:
        if key is None:
            return None
        value = self.table.entries.get(f"{key}|{_SHORT[dtype]}")
        return None if value is None else float(value)

    def _key_of(self, node, gm) -> str:
        return self.keys.get(node) or node.meta.get(COST_KEY) or self._key(node, gm)

    def node_cost(self, node, gm, low) -> NodeCost:
        guess = self.fallback.node_cost(node, gm, low)
        key = self._key_of(node, gm)
        t32 = self._get(key, torch.float32)
        if t32 is None:
            return guess
        if low not in self.lows:  # emulated here: never faster
            return NodeCost(guess.flops, guess.bytes_fp32, guess.bytes_low, t32, math.inf)
        tlow = self._get(key, low)
        packed = self.packed_s(node, gm) if low == torch.bfloat16 and self.packed_faster(node, gm) \
            else None
        if packed is not None:
            tlow = packed  # (PackCpuLinears runs it packed: packed_faster)
        if tlow is None:  # an op that could not run alone in this dtype: the roofline's ratio
            tlow = t32 * guess.t_low / guess.t_fp32 if guess.t_fp32 else math.inf
        elif t32 * (1 - NOISE) < tlow < t32:  # a gain the timing cannot tell from noise: a tie
            tlow = t32
        return NodeCost(guess.flops, guess.bytes_fp32, guess.bytes_low, t32, tlow)

    def packed_s(self, node, gm) -> Optional[float]:
        """Seconds of a bf16 linear over its weight packed once, where measured (and the plan
        packs: inference on this CPU)."""
        if not self.packs:
            return None
        value = self.table.entries.get(f"{self._key_of(node, gm)}|bf16{PACKED_SUFFIX}")
        return None if value is None else float(value)

    def packed_faster(self, node, gm) -> bool:
        """Whether this machine ran the bf16 linear faster over its packed weight than ATen's
        own bf16 linear (which packs it on each call): oneDNN's packed kernel is 1.2-1.4x faster
        at most sizes here and 0.71x at 512 rows of a 2048->768 layer."""
        packed = self.packed_s(node, gm)
        plain = self._get(self._key_of(node, gm), torch.bfloat16)
        return packed is not None and (plain is None or packed < plain * (1 - NOISE))

    def cast_cost(self, node, low) -> tuple[float, float]:
        info = node.meta.get(TENSOR)
        if isinstance(info, TensorInfo) and low in self.lows:
            down = self.table.entries.get(f"cast {list(info.shape)} fp32->{_SHORT[low]}")
            up = self.table.entries.get(f"cast {list(info.shape)} {_SHORT[low]}->fp32")
            if down is not None and up is not None:
                return float(down), float(up)
        return self.fallback.cast_cost(node, low)

    def one_row_mv_pays(self, layers: list) -> bool:
        """MatVecLinear's question (``one_row_mv_pays``), in float32 and this machine's native
        low dtypes, from this table."""
        return one_row_mv_pays(self.table, layers, (torch.float32,) + self.lows)


ONE_ROW_COPIES_BYTES = 64 << 20  # the weight copies a one-row linear's timing cycles through


def _one_row_forms(k: int, n: int, bias: bool, transposed: bool, dtype: torch.dtype):
    """(ATen's call, MatVecLinear's) of a linear on one row in ``dtype``, each cycling through
    copies of its weight where it is large (read from memory, as a forward reads it): ``linear``
    (``addmm``/``mm`` over a k x n weight where ``transposed``) against ``mv`` over the weight's
    rows, the bias added after, the row viewed in and out. A k x n weight's low-precision copy is
    stored transposed (StoreWeights); its float32 one is read through ``t()``."""
    size = k * n * torch.finfo(dtype).bits // 8
    count = max(1, min(MAX_COPIES, ONE_ROW_COPIES_BYTES // size)) if size >= STREAM_MIN_BYTES \
        else 1
    weights = [torch.randn(k, n) if transposed else torch.randn(n, k) for _ in range(count)]
    weights = [w.to(dtype) for w in weights]
    rows = [w.t() if dtype == torch.float32 else w.t().contiguous() for w in weights] \
        if transposed else weights
    b = torch.randn(n).to(dtype) if bias else None
    x = torch.randn(1, k).to(dtype)
    turn = [0]

    def advance():
        turn[0] = (turn[0] + 1) % count

    def aten_form():
        w = weights[turn[0]]
        if not transposed:
            return torch.nn.functional.linear(x, w, b)
        return torch.addmm(b, x, w) if bias else torch.mm(x, w)

    def mv_form():
        y = torch.mv(rows[turn[0]], x.view(k))
        return (y + b if bias else y).view(1, n)
    return (aten_form, mv_form), (advance if count > 1 else None)


def one_row_mv_pays(table: CostTable, layers: list, dtypes: tuple) -> bool:
    """Whether MatVecLinear's ``mv`` runs a graph's linears on one row faster on this machine
    than ATen's ``linear``: their times summed over ``layers`` ((k, n, bias, transposed) of each
    layer, repeats counted) and ``dtypes`` (those the plan may compute them in), each form timed
    once into ``table``. Measured, not assumed: on a 2-core AMX Xeon a 768x2048 float32 layer
    took 300 us as ``linear`` and 224 as ``mv``; on an AVX2-only EPYC the two tie from 512 wide
    up and ``mv`` is slower below (64 wide 7.3 against 5.2 us, 3 layers of 256 1.45x slower in a
    batch-1 plan): the nodes it adds cost more host time than its kernel saves."""
    sums = [0.0, 0.0]
    for k, n, bias, transposed in layers:
        for dtype in dtypes:
            key = (f"one-row linear {k}->{n}{' +bias' if bias else ''}"
                   f"{' (k x n weight)' if transposed else ''}|{_SHORT[dtype]}")
            entries = [f"{key} linear", f"{key} mv"]
            if any(e not in table.entries for e in entries):
                fns, advance = _one_row_forms(k, n, bias, transposed, dtype)
                for entry, seconds in zip(entries, time_calls(list(fns), table.device,
                                                              [advance, advance])):
                    table.entries[entry] = seconds
                table.measured_now += 2
            times = [table.entries.get(e) for e in entries]
            if None not in times:
                sums = [s + float(t) for s, t in zip(sums, times)]
    return sums[1] < sums[0]


def flops_of(node, gm) -> float:
    """FLOPs of a node (the roofline's count): what reports show beside a measured time."""
    return node_flops(node, gm)[0]
