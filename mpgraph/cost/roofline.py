"""The roofline cost model: a node's FLOPs and bytes against a device's peaks.

time = max(FLOPs / peak[dtype], bytes / bandwidth), from the shapes capture recorded. Matmul-class
ops use the Tensor Core (or AVX512-BF16/AMX) peak of their dtype and, on GPUs, lose what tile and
wave quantization waste; everything else runs at the fp32 vector rate and is usually
bandwidth-bound, where half-size values are what low precision buys. Views cost a dispatch only.
The fp32 baseline uses TF32 where torch allows it for matmuls on a GPU that has it.

The host: each node costs Python and dispatch time whatever its FLOPs. A CPU runs it before the
kernel (time = host + kernel); a GPU in eager mode queues kernels while the host goes on, so a
node costs what is longer, the host's part or the kernel (time = max(host, kernel)): at ordinary
sizes an eager GPU run is host-bound (the H200 measured ~5-10 us a node; BERT-base 1x16 ran
1.17x faster in fp16, where a roofline without the floor promised 3.2x). ``runtime="graphs"``
(CUDA graphs, torch.compile) drops the host part.

A GPU run can calibrate it: ``examples/bench/gpu_check.py`` (or ``write_calibration``) times
matmuls, copies and tiny ops there and writes the efficiencies and the host time per node to a
small JSON file (``CALIBRATION_FORMAT``, below), which a plan for that GPU then reads and says so.
"""
from __future__ import annotations

import json
import math
import operator
import os
import re
import statistics
import time
from typing import Optional

import torch
import torch.fx

from mpgraph.cost.device import VECTOR_FLOPS_PER_ELEMENT, cache_dir, tf32_enabled
from mpgraph.cost.model import CostModel, NodeCost
from mpgraph.cost.specs import DeviceSpec
from mpgraph.ir.graph import input_nodes, is_view, matmul_dims
from mpgraph.ir.meta import OP_CLASS, TENSOR, TENSOR_CORE, Kind, tensor_infos

# host time of one node in eager mode on a GPU, where no calibration file says otherwise: the
# H200 session measured ~5-10 us per graph node (Python, dispatch, launch)
GPU_HOST_S = 7e-6
# what one kernel costs at least when replayed from a CUDA graph (launch inside the graph, a
# tiny kernel's own run): BERT-base 1x16 in fp16 replayed in 0.83 ms on the H200, ~330 kernels,
# most of them tiny (2.5 us each). Without it a 32x128x128 GEMM was priced 23 us in fp32 against
# 1.5 us in fp16, and every small model "15x faster replayed". A calibration file's
# "kernel_floor_s" replaces it.
GPU_KERNEL_S = 2.5e-6
RUNTIMES = ("eager", "graphs")

# Arithmetic per output element of non-matmul ops, by name fragment (transcendentals are dozens of
# vector instructions); anything else counts 1. GELU is what the CPU's vector rate is measured on.
FLOPS_PER_ELEMENT = {"gelu": VECTOR_FLOPS_PER_ELEMENT, "tanh": 20, "erf": 20, "exp": 20, "sigmoid": 20, "silu": 20,
                     "mish": 30, "softplus": 30, "softmax": 25, "log": 20, "pow": 20, "rsqrt": 10,
                     "sqrt": 10, "layer_norm": 10, "group_norm": 10, "rms_norm": 8, "batch_norm": 4,
                     "div": 4}
# CPUs reach their matmul peak only when the reduction dimension is long (AMX/AVX512 tiles)
_CPU_FULL_K = 256
# oneDNN reorders NCHW activations to its blocked layout and back around every CPU convolution:
# about this many plain copies' worth of memory traffic (fitted on ResNet-50's convs here)
_CPU_CONV_LAYOUT = 3.5
_NO_KERNEL_METHODS = {"size", "dim", "numel", "contiguous", "detach"}


def _conv_flops(node: torch.fx.Node, gm) -> Optional[float]:
    out = tensor_infos(node.meta.get(TENSOR))
    weight = None
    if node.op == "call_module":
        weight = getattr(gm.get_submodule(node.target), "weight", None)
        shape = tuple(weight.shape) if weight is not None else None
    else:
        w = node.args[1] if len(node.args) > 1 else None
        infos = tensor_infos(w.meta.get(TENSOR)) if isinstance(w, torch.fx.Node) else []
        shape = infos[0].shape if infos else None
    if not out or shape is None:
        return None
    transposed = "transpose" in str(node.target).lower() or (
        node.op == "call_module" and "Transpose" in type(gm.get_submodule(node.target)).__name__)
    if transposed:
        inp = tensor_infos(input_nodes(node)[0].meta.get(TENSOR))
        return 2.0 * inp[0].numel * math.prod(shape[1:]) if inp else None
    return 2.0 * out[0].numel * math.prod(shape[1:])


def _conv_reduction(node: torch.fx.Node, gm) -> int:
    """Cin/groups x kernel: the reduction length of a convolution's implicit GEMM."""
    if node.op == "call_module":
        w = getattr(gm.get_submodule(node.target), "weight", None)
        return math.prod(w.shape[1:]) if w is not None else _CPU_FULL_K
    w = node.args[1] if len(node.args) > 1 else None
    infos = tensor_infos(w.meta.get(TENSOR)) if isinstance(w, torch.fx.Node) else []
    return math.prod(infos[0].shape[1:]) if infos else _CPU_FULL_K


def _sdpa_shapes(node: torch.fx.Node):
    q = tensor_infos(node.args[0].meta.get(TENSOR)) if isinstance(node.args[0], torch.fx.Node) else []
    k = tensor_infos(node.args[1].meta.get(TENSOR)) if isinstance(node.args[1], torch.fx.Node) else []
    return (q[0].shape, k[0].shape) if q and k else None


def _per_element(node: torch.fx.Node, gm) -> int:
    name = (type(gm.get_submodule(node.target)).__name__ if node.op == "call_module"
            else str(getattr(node.target, "__name__", node.target))).lower()
    return max((f for key, f in FLOPS_PER_ELEMENT.items() if key.replace("_", "") in name.replace("_", "")),
               default=1)


def node_flops(node: torch.fx.Node, gm) -> tuple[float, bool, Optional[tuple]]:
    """(FLOPs, is matmul-class, GEMM dims for quantization or None)."""
    op_class = node.meta[OP_CLASS].op_class
    out = tensor_infos(node.meta.get(TENSOR))
    elementwise = float(sum(i.numel for i in out) or
                        sum(i.numel for a in input_nodes(node) for i in tensor_infos(a.meta.get(TENSOR))))
    if op_class != TENSOR_CORE:
        return elementwise * _per_element(node, gm), False, None
    target = str(node.target).lower()
    kind = type(gm.get_submodule(node.target)).__name__.lower() if node.op == "call_module" else target
    if "conv" in kind:
        f = _conv_flops(node, gm)
        return (f if f is not None else elementwise), True, ("conv", _conv_reduction(node, gm))
    if "scaled_dot_product" in kind:
        shapes = _sdpa_shapes(node)
        if shapes is None:
            return elementwise, True, None
        q, k = shapes
        # QK^T and PV: batched GEMMs whose reduction dims are the head size and the key length
        return 4.0 * math.prod(q) * k[-2], True, ("sdpa", q, k)
    if "multiheadattention" in kind:
        x = out[0] if out else None
        return (8.0 * x.numel * x.shape[-1] if x else elementwise), True, None
    dims = matmul_dims(node, gm)
    if dims is None:
        return elementwise, True, None
    b, m, n, k = dims
    return 2.0 * b * m * n * k, True, dims


def _quantization(spec: DeviceSpec, dims: Optional[tuple]) -> float:
    """Fraction of the matmul peak a problem can use: tile and wave quantization on GPUs, the
    reduction length of GEMMs and attention on CPUs."""
    if dims is None:
        return 1.0
    if dims[0] == "sdpa":
        return min(1.0, dims[1][-1] / _CPU_FULL_K) if spec.kind == Kind.CPU else 1.0
    if dims[0] == "conv":
        return 1.0  # on CPUs the layout reorder dominates instead (see EstimateCost.cost)
    if spec.kind != Kind.GPU:
        return min(1.0, dims[3] / _CPU_FULL_K)
    b, m, n, _ = dims
    t = spec.tile
    tiles = b * math.ceil(m / t) * math.ceil(n / t)
    if tiles == 0:
        return 1.0  # an empty GEMM (a zero-size batch or sequence): no tiles to waste
    waves = math.ceil(tiles / spec.sms)
    return (b * m * n) / (waves * spec.sms * t * t)


class Roofline(CostModel):
    """The roofline model of ``spec`` (see the module docstring); ``calibration``: the contents
    of a GPU calibration file (``read_calibration``), applied to the peaks and the host floor."""

    def __init__(self, spec: DeviceSpec, tf32: Optional[bool] = None,
                 calibration: Optional[dict] = None, runtime: str = "eager",
                 kernel_floor: Optional[float] = None):
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
        self.spec, self.kind, self.name = spec, spec.kind, spec.name
        self.tf32 = tf32_enabled() if tf32 is None else tf32
        self.calibration = calibration or {}
        self.runtime = runtime
        self.host = self.calibration.get("host_per_node_s", GPU_HOST_S if spec.kind == Kind.GPU
                                         else spec.launch)
        self.kernel_floor = kernel_floor if kernel_floor is not None else \
            self.calibration.get("kernel_floor_s", GPU_KERNEL_S)
        if spec.kind == Kind.GPU:
            where = (f"calibrated on {self.calibration.get('device', spec.name)} "
                     f"({self.calibration.get('written', 'a GPU run')})" if calibration
                     else "uncalibrated")
            self.source = (f"roofline for {spec.name}, {where}, "
                           + ("eager (host floor "
                              f"{self.host * 1e6:.3g} us a node)" if runtime == "eager"
                              else "replayed or compiled (no host time; "
                              f"{self.kernel_floor * 1e6:.3g} us a kernel at least)"))
        else:
            self.source = f"roofline for {spec.name} ({spec.source})"

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether the device has the dtype at all: a GPU's Tensor Cores for it; a CPU's
        matmuls at no less than half of float32's rate (an AVX2-only CPU emulates bf16 and fp16
        at ~1%: nothing is faster there, however few bytes it moves)."""
        peak = self.spec.matmul_peak(dtype)
        if dtype == torch.float32:
            return True
        if self.kind == Kind.CPU:
            return peak is not None and peak >= 0.5 * self.spec.peak["fp32"]
        return peak is not None

    def _efficiency(self, key: str) -> float:
        return float(self.calibration.get("efficiency", {}).get(key, 1.0))

    def _bytes(self, node, gm, dtype) -> float:
        total = 0.0
        for info in [i for a in input_nodes(node) for i in tensor_infos(a.meta.get(TENSOR))] \
                + tensor_infos(node.meta.get(TENSOR)):
            size = dtype.itemsize if info.dtype == torch.float32 else info.dtype.itemsize
            total += info.numel * size
        if node.op == "call_module":
            for p in gm_params(gm, node.target):
                total += p.numel() * (dtype.itemsize if p.dtype == torch.float32 else p.element_size())
        return total

    def _with_host(self, kernel: float) -> float:
        if self.kind != Kind.GPU:
            return kernel + self.host  # a CPU dispatches, then computes
        return max(kernel, self.host if self.runtime == "eager" else self.kernel_floor)

    def node_cost(self, node, gm, low) -> NodeCost:
        spec = self.spec
        no_kernel = is_view(node) or node.target in (operator.getitem, getattr) \
            or (node.op == "call_method" and node.target in _NO_KERNEL_METHODS) \
            or not tensor_infos(node.meta.get(TENSOR))
        if no_kernel:
            host = self.host if self.runtime == "eager" or self.kind != Kind.GPU else 0.0
            return NodeCost(0.0, 0.0, 0.0, host, host)
        flops, matmul, dims = node_flops(node, gm)
        softmax = 0.0
        if dims is not None and dims[0] == "sdpa":  # the softmax over the score matrix
            q, k = dims[1], dims[2]
            softmax = math.prod(q[:-1]) * k[-2] * FLOPS_PER_ELEMENT["softmax"]
        bandwidth = spec.bandwidth * self._efficiency("bandwidth")
        vector = spec.elementwise_peak() * self._efficiency("elementwise")
        times = []
        for dtype in (torch.float32, low):
            if matmul:
                key = "tf32" if dtype == torch.float32 and self.tf32 and spec.peak.get("tf32") \
                    else {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
                peak = spec.matmul_peak(dtype, tf32=self.tf32) or spec.elementwise_peak() / 2
                peak *= _quantization(spec, dims) * self._efficiency(key)
            else:
                peak = vector
            nbytes = self._bytes(node, gm, dtype)
            # an empty problem (zero-size dimension) costs only its launch; its peak may be 0
            compute = (flops / peak if flops else 0.0) + softmax / vector
            if spec.kind == Kind.CPU and dims is not None and dims[0] == "conv" and dtype == torch.float32:
                # NCHW reorders; low-precision convs run channels_last (the ChannelsLast pass)
                compute += _CPU_CONV_LAYOUT * nbytes / bandwidth
            times.append((self._with_host(max(compute, nbytes / bandwidth)), nbytes))
        (t32, b32), (tlow, blow) = times
        return NodeCost(flops, b32, blow, t32, tlow)

    def cast_cost(self, node, low) -> tuple[float, float]:
        info = tensor_infos(node.meta.get(TENSOR))
        t = self.cast_seconds(info[0].numel if info else 0, low)
        return t, t

    def cast_seconds(self, numel: int, low: torch.dtype) -> float:
        """One fp32<->low cast of ``numel`` values: read one, write the other (6 bytes an element
        for fp16), and the host's part."""
        return self._with_host(numel * (4 + low.itemsize)
                               / (self.spec.bandwidth * self._efficiency("bandwidth")))


def gm_params(gm, target: str) -> list[torch.Tensor]:
    module = gm.get_submodule(target)
    return list(module.parameters()) + list(module.buffers())


# -- GPU calibration files ----------------------------------------------------------------------
# One JSON object a file, in ``<cache>/mpgraph/gpu-calibration/<device>.json``:
#   {"format": CALIBRATION_FORMAT, "device": "NVIDIA H200", "written": "2026-12-01, torch 2.13",
#    "host_per_node_s": 6.1e-06,          # seconds a tiny op costs in eager mode
#    "kernel_floor_s": 2.5e-06,           # optional: a tiny kernel replayed from a CUDA graph
#    "efficiency": {"fp32": 0.61, "tf32": 0.55, "fp16": 0.52, "bf16": 0.52,   # of the matmul peak
#                   "bandwidth": 0.83, "elementwise": 0.4},                   # of bandwidth, vector
#    "points": [...]}                     # the measurements behind them (name, seconds, units)
CALIBRATION_FORMAT = "mpgraph-gpu-calibration/1"


def calibration_path(spec: DeviceSpec) -> str:
    return os.path.join(cache_dir(), "gpu-calibration", f"{_slug(spec)}.json")


def _slug(spec: DeviceSpec) -> str:
    return re.sub(r"[^a-z0-9]+", "-", spec.name.lower()).strip("-")


# the files GPU sessions of this project wrote (gpu_check.py), read where the user's cache has
# none: an H200 measured 13.6 us of host time a node where the uncalibrated floor says 7
SHIPPED_CALIBRATION = os.path.join(os.path.dirname(__file__), "calibration")


def read_calibration(spec: DeviceSpec, path: Optional[str] = None) -> Optional[dict]:
    """The calibration file of ``spec`` (or ``path``): the user's cache's, else the one shipped
    with mpgraph for that GPU; None where there is none; a file that is not one is a ValueError
    naming it."""
    if path is None:
        path = calibration_path(spec)
        shipped = os.path.join(SHIPPED_CALIBRATION, f"{_slug(spec)}.json")
        if not os.path.exists(path) and os.path.exists(shipped):
            path = shipped
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a calibration file: {e}") from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{path} is not a calibration file ({CALIBRATION_FORMAT!r} expected)")
    # what the roofline divides and multiplies by: a zero efficiency failed deep in a pass
    # (ZeroDivisionError), a string host with a bare TypeError, and a negative host (estimated
    # 13.16x, not 5.36x) or percentages (every node at the host floor) were used as they were
    efficiency = data.get("efficiency")
    bad = None
    if not _number(data.get("host_per_node_s")) or data["host_per_node_s"] < 0:
        bad = f"host_per_node_s must be seconds, 0 or more, got {data.get('host_per_node_s')!r}"
    elif "kernel_floor_s" in data and (not _number(data["kernel_floor_s"])
                                       or data["kernel_floor_s"] < 0):
        bad = f"kernel_floor_s must be seconds, 0 or more, got {data['kernel_floor_s']!r}"
    elif not isinstance(efficiency, dict):
        bad = f"efficiency must be an object of shares of the peaks, got {efficiency!r}"
    else:
        bad = next((f"efficiency {k!r} must be a share of the peak in (0, 1], got {v!r}"
                    for k, v in efficiency.items() if not _number(v) or not 0 < v <= 1), None)
    if bad:
        raise ValueError(f"{path} is not a valid calibration file: {bad} (delete it, or write "
                         "it again on that GPU: mpgraph calibrate --gpu)")
    return data


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _timed(fn, device: torch.device, repeats: int = 20) -> float:
    """Median seconds of ``fn()`` on ``device`` (CUDA events on a GPU), after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_calibration(spec: DeviceSpec, device: str = "cuda", size: int = 4096) -> dict:
    """Time what the roofline rests on, on ``device``: a ``size``-square matmul per dtype, a
    large copy, GELU over a large vector, and a loop of tiny ops in eager mode (the host time a
    node costs). Returns the calibration data (efficiencies against ``spec``'s peaks)."""
    dev = torch.device(device)
    points, efficiency = [], {}
    with torch.no_grad():
        for key, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
            peak = spec.matmul_peak(dtype)
            if peak is None:
                continue
            g = torch.Generator(device=dev).manual_seed(0)  # (not the caller's stream)
            a = torch.randn(size, size, device=dev, generator=g).to(dtype)
            b = torch.randn(size, size, device=dev, generator=g).to(dtype)
            t = _timed(lambda: torch.mm(a, b), dev)
            points.append({"name": f"matmul {size} {key}", "seconds": t})
            efficiency[key] = min(1.0, 2.0 * size ** 3 / t / peak)
        # 256 MB at the default size; a smaller size (a smoke run) copies less in proportion
        # (21 copies and GELUs of 256 MB were ~7 s of a CPU run at size 64)
        x = torch.empty(min(64 * 1024 * 1024, 4 * size * size), device=dev)
        y = torch.empty_like(x)
        t = _timed(lambda: y.copy_(x), dev)
        points.append({"name": f"copy {x.numel() * 4 / 2 ** 20:g} MB", "seconds": t})
        efficiency["bandwidth"] = min(1.0, 2 * x.numel() * 4 / t / spec.bandwidth)
        t = _timed(lambda: torch.nn.functional.gelu(x), dev)
        efficiency["elementwise"] = min(1.0, VECTOR_FLOPS_PER_ELEMENT * x.numel() / t
                                        / spec.elementwise_peak())
        small = torch.ones(8, device=dev)

        def tiny():
            for _ in range(100):
                torch.add(small, small)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        host = _timed(tiny, torch.device("cpu"), repeats=10) / 100
        points.append({"name": "100 tiny adds, eager", "seconds": host * 100})
    return {"format": CALIBRATION_FORMAT, "device": spec.name,
            "written": f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}",
            "host_per_node_s": host, "efficiency": efficiency, "points": points}


def write_calibration(spec: DeviceSpec, data: dict, path: Optional[str] = None) -> str:
    """Write calibration ``data`` where plans for ``spec`` read it; returns the path."""
    path = path or calibration_path(spec)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path
