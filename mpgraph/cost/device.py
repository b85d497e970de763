"""Which device we plan for: detection, named targets, and a measured spec for CPUs.

``resolve_target(None)`` is the machine we run on (the CUDA GPU torch sees, else this CPU);
a name (``"h100"``, ``"a100"``, ``"t4"``, ``"cpu"``, any key of ``GPU_SPECS``) plans for another
one, so a CPU-only machine can plan for the GPU it deploys to. CPU peaks are measured by a short
micro-benchmark and cached on disk (``~/.cache/mpgraph``), keyed by CPU, flags, threads and torch.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
from typing import Optional, Union

import torch

from mpgraph.cost.specs import ALIASES, GPU_SPECS, DeviceSpec
from mpgraph.ir.meta import Kind

log = logging.getLogger(__name__)
# GELU counted as this many FLOPs per element when measuring the CPU's vector-math rate; the cost
# model counts transcendental ops the same way (estimate_cost.FLOPS_PER_ELEMENT)
VECTOR_FLOPS_PER_ELEMENT = 20
_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16", "avx512f", "avx2")
_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpgraph")


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _matmul_rate(dtype: torch.dtype, largest: int = 1024, enough_s: float = 0.02) -> float:
    """FLOP/s of an n x n matmul, n doubled from 128 up to ``largest`` while one run is shorter
    than ``enough_s``: big enough to reach the fast kernels' rate, short where the dtype is
    emulated (bf16 on an AVX2-only CPU runs at ~1% of fp32: 1024^3 would take a second a run)."""
    n = 128
    while True:
        g = torch.Generator().manual_seed(0)  # (not the caller's stream: convert keeps it)
        a, b = (torch.randn(n, n, generator=g, dtype=torch.float32).to(dtype) for _ in range(2))
        t = _best_time(lambda: torch.mm(a, b), 3)
        if n >= largest or t >= enough_s:
            return 2.0 * n ** 3 / t
        n *= 2


ROUNDS = 3  # interleaved rounds of the matmul rates (the best of each dtype's is kept)


def _measure_cpu() -> dict:
    """Matmul FLOP/s per dtype (the best of ROUNDS interleaved rounds), memory bandwidth and
    per-op overhead, in a few seconds (once per machine: cached).
    Every tensor is a float32 (or the timed dtype) CPU tensor whatever the caller's context: a
    first conversion inside ``with torch.device("meta")`` timed meta "kernels" (136 TFLOP/s,
    55 TB/s) and a default float64 halved the bandwidth, and the result is cached for good."""
    from torch.utils._python_dispatch import _disable_current_modes
    peak = {}
    cpu, fp32 = torch.device("cpu"), torch.float32
    # (float32 as float32: "medium"/"high" let oneDNN run float32 matmuls in bf16, and the cache
    # key does not hold the setting)
    precision = torch.get_float32_matmul_precision()
    with torch.no_grad(), _disable_current_modes(), torch.device("cpu"), \
            torch.autocast("cpu", enabled=False):
        try:
            torch.set_float32_matmul_precision("highest")
            # interleaved, the best of ROUNDS each: a busy machine slowed whichever dtype it
            # timed while busy (fp32 134 then 392 GFLOP/s minutes apart), and an AVX2 CPU's
            # emulated bf16 (1.2% of fp32 here) passed for native at 0.53 of a slowed fp32,
            # so the default planned 180 of GPT-2's nodes in bf16 there
            for _ in range(ROUNDS):
                for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                                   ("fp16", torch.float16)):
                    peak[key] = max(peak.get(key, 0.0), _matmul_rate(dtype))
        finally:
            torch.set_float32_matmul_precision(precision)
        x = torch.empty(16 * 1024 * 1024, device=cpu, dtype=fp32)  # 64 MB
        y = torch.empty_like(x)
        t = _best_time(lambda: y.copy_(x), 5)
        bandwidth = 2 * x.numel() * x.element_size() / t
        z = torch.randn(4 * 1024 * 1024, generator=torch.Generator().manual_seed(0), dtype=fp32)
        t = _best_time(lambda: torch.nn.functional.gelu(z), 3)
        peak["vector"] = VECTOR_FLOPS_PER_ELEMENT * z.numel() / t
        small = torch.ones(8, device=cpu, dtype=fp32)
        t = _best_time(lambda: [torch.add(small, small) for _ in range(200)], 3)
        launch = t / 200
    return {"peak": peak, "bandwidth": bandwidth, "launch": launch}


# no CPU core runs float32 matmuls at 10 TFLOP/s (an AVX-512 core at 4 GHz peaks at 0.26, an
# Apple M-series core's matrix unit at about 2): a figure above this per thread was not timed
# on this CPU (meta tensors "ran" at 136 TFLOP/s on 2 threads)
MAX_FP32_PER_THREAD = 1e13
MAX_FP32 = 5e13  # (and no CPU at 50 TFLOP/s of float32 whatever its threads)


def _plausible(data) -> bool:
    """Whether cached or measured CPU figures can be planned with: positive finite numbers (a
    damaged file held strings, zeros, {}), and a float32 rate a CPU can have."""
    def positive(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
    peak = data.get("peak") if isinstance(data, dict) else None
    return (isinstance(peak, dict)
            and all(positive(peak.get(k)) for k in ("fp32", "bf16", "fp16", "vector"))
            and positive(data.get("bandwidth")) and positive(data.get("launch"))
            and peak["fp32"] <= min(MAX_FP32_PER_THREAD * torch.get_num_threads(), MAX_FP32))


def isa_caps() -> str:
    """The instruction-set caps in the environment (ONEDNN_MAX_CPU_ISA=AVX2 makes an
    AVX512-BF16 machine run bf16 like an AVX2 one): a capped run is another CPU to measure."""
    return ",".join(f"{k}={os.environ[k]}" for k in _ISA_CAPS if os.environ.get(k))


def measure_cpu(cache: bool = True, fresh: bool = False) -> DeviceSpec:
    """This CPU as a DeviceSpec, from a micro-benchmark (cached on disk; ``fresh``: measured
    again over what the cache holds, as ``mpgraph calibrate`` does)."""
    flags = sorted(cpu_flags() & set(_CPU_FLAGS))
    caps = isa_caps()
    key = f"v2|{cpu_name()}|{','.join(flags)}|{caps}|{torch.get_num_threads()}|{torch.__version__}"
    path = os.path.join(cache_dir(), f"cpu-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json")
    data = None
    if cache and not fresh and os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        if data is not None and not _plausible(data):
            log.info("%s holds no plausible CPU measurement: measuring again", path)
            data = None
    if data is None:
        data = _measure_cpu()
        data["key"] = key
        if not _plausible(data):
            log.warning("this CPU's micro-benchmark gave implausible figures (%s): not cached",
                        data)
        elif cache:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    json.dump(data, f)
            except OSError as e:  # a read-only home is no reason to fail
                log.info("could not cache the CPU measurement: %s", e)
    return DeviceSpec(f"CPU {cpu_name()} ({torch.get_num_threads()} threads)", Kind.CPU,
                      dict(data["peak"]), data["bandwidth"], torch.get_num_threads(),
                      data["launch"], tile=1,
                      source=f"measured on this CPU, flags {' '.join(flags) or '-'}"
                             + (f", capped by {caps}" if caps else ""))


def _gpu_spec(index: int = 0) -> DeviceSpec:
    props = torch.cuda.get_device_properties(index)
    name = props.name.upper()
    mem_gb = props.total_memory / 2**30
    if "H200" in name:
        key = "h200"
    elif "H100" in name or "H800" in name:
        key = "h100-pcie" if "PCIE" in name else "h100-sxm"
    elif "A100" in name or "A800" in name:
        key = "a100-80gb" if mem_gb > 45 else "a100-40gb"
    elif "L4" in name:
        key = "l4"
    elif "A10" in name:
        key = "a10"
    elif "T4" in name:
        key = "t4"
    elif "V100" in name:
        key = "v100"
    else:  # closest known architecture by compute capability
        key = {7: "v100", 8: "a100-80gb", 9: "h100-sxm"}.get(props.major, "a100-80gb")
        if (props.major, props.minor) == (7, 5):
            key = "t4"
        log.warning("GPU %s is not in the spec table; planning with %s's figures", props.name, key)
    return GPU_SPECS[key]


def resolve_target(target: Union[None, str, DeviceSpec] = None) -> DeviceSpec:
    """A DeviceSpec from None (this machine), a name, or a spec."""
    if isinstance(target, DeviceSpec):
        return target
    if target is None:
        return _gpu_spec() if torch.cuda.is_available() else measure_cpu()
    name = str(target).lower().replace("_", "-")
    if name == "cpu":
        return measure_cpu()
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("target='cuda' but torch sees no GPU; name one: " + ", ".join(target_names()))
        return _gpu_spec()
    name = ALIASES.get(name, name)
    by_title = {spec.name.lower(): key for key, spec in GPU_SPECS.items()}  # a plan's target
    if name.startswith("cpu "):
        return measure_cpu()
    name = by_title.get(name, name)
    if name not in GPU_SPECS:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(target_names())}")
    return GPU_SPECS[name]


def target_names() -> list[str]:
    return ["cpu", "cuda"] + sorted(set(GPU_SPECS) | set(ALIASES))


def auto_dtype(spec: DeviceSpec) -> tuple[Optional[torch.dtype], str]:
    """The low dtype worth using on ``spec`` (None: keep float32), with the reason in words."""
    fp32 = spec.peak["fp32"]
    bf16, fp16 = spec.peak.get("bf16"), spec.peak.get("fp16")
    if spec.kind == Kind.GPU:
        if bf16 and fp16 and fp16 >= bf16:
            return torch.float16, (f"{spec.name} runs fp16 and bf16 Tensor Cores at the same rate: "
                                   "fp16 (3 more mantissa bits), bf16 where fp16's range does not "
                                   "hold")
        if bf16:
            return torch.bfloat16, f"{spec.name} has bf16 Tensor Cores: bf16 keeps fp32's range"
        return torch.float16, f"{spec.name} has fp16 Tensor Cores but no bf16"
    if bf16 and bf16 > 1.2 * fp32:
        return torch.bfloat16, (f"this CPU runs bf16 matmul at {bf16 / fp32:.1f}x fp32, fp16 at "
                                f"{(fp16 or 0) / fp32:.2f}x ({spec.source})")
    if fp16 and fp16 > 1.2 * fp32:
        return torch.float16, f"this CPU runs fp16 matmul at {fp16 / fp32:.1f}x fp32"
    return None, (f"low precision is slower than float32 on this CPU (bf16 {(bf16 or 0) / fp32:.2f}x, "
                  f"fp16 {(fp16 or 0) / fp32:.2f}x fp32 matmul): kept float32")


def range_dtype(spec: DeviceSpec, low: torch.dtype) -> Optional[torch.dtype]:
    """bf16 for the nodes fp16's range keeps out of fp16, on a GPU that runs both (dtype="auto")."""
    if spec.kind == Kind.GPU and low == torch.float16 and spec.peak.get("bf16"):
        return torch.bfloat16
    return None


def tf32_enabled() -> bool:
    """Whether torch runs float32 matmuls as TF32 on GPUs that have it (the fp32 baseline)."""
    return torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"

