"""Per-node profiling of a converted module: measured time, kernels, Tensor Cores, findings.

``profile(converted, example_inputs)`` runs the graph node by node under a torch.fx Interpreter
that wraps every node in a ``record_function`` range and, on CUDA, an NVTX range, both named
``mpgraph:<node>``, so torch.profiler's events (and Nsight Compute's kernels, see
``mpgraph.tools.ncu``) map back to graph nodes. Each node gets its measured time per run, its kernels
(CUDA kernel names on GPUs; the ATen/oneDNN ops on CPUs, where there are no kernels to name),
whether those kernels run on Tensor Cores (recognised by name: ``TENSOR_CORE_KERNELS``), the cost
model's prediction, and the share of matmul/conv time on Tensor Cores. Interpreting adds Python
overhead per node (a few microseconds): the numbers are for attribution, not a benchmark.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx

from mpgraph.ir.graph import as_call, flat_inputs, to_device
from mpgraph.ir.meta import INSERTED_BY, dtype_name
from mpgraph.plans.plan import Plan

RANGE_PREFIX = "mpgraph:"

# CUDA kernel names that run on Tensor Cores. The PyTorch TensorBoard plugin's list (h884, s884,
# h1688, s1688, hmma, i8816, 16816, xmma_gemm, xmma_implicit_gemm, c1688, ...) misses CUTLASS
# tensorop kernels, Hopper's sm90 xmma/gmma kernels and cuBLAS's nvjet kernels: all here.
TENSOR_CORE_KERNELS = re.compile(
    r"(h884|s884|h1688|s1688|c1688|i8816|i16832|h16816|s16816|bf16816|16816|hmma|imma|gmma|wgmma"
    r"|xmma|tensorop|nvjet|sm80_xmma|sm90_xmma|sm90_gemm|_tc_|tensor_core|cutlass_80_tensorop"
    r"|flash_fwd|flash_bwd|fmha|tensorcore)", re.IGNORECASE)
# CUDA-core GEMMs (FFMA): volta_sgemm_..., cutlass_80_simt_sgemm_..., gemv kernels.
SIMT_KERNELS = re.compile(r"simt|(^|_)[sdcz]gemm(_|$)|gemv", re.IGNORECASE)
_MATMUL_CLASSES = ("tensor_core",)


def is_tensor_core_kernel(name: str) -> bool:
    """True when a CUDA kernel's name says it runs on Tensor Cores (names, not counters: ncu's
    tensor pipe metrics are the proof, see mpgraph.tools.ncu)."""
    return bool(TENSOR_CORE_KERNELS.search(name)) and not SIMT_KERNELS.search(name)


@dataclass
class NodeProfile:
    name: str
    op_class: str
    dtype: Optional[str]
    time_s: float                     # measured per run (median over iterations)
    kernels: tuple[str, ...]          # CUDA kernels, or ATen ops on a CPU
    tensor_core: Optional[bool]       # None on CPUs: no kernel names to tell
    predicted_s: Optional[float]      # the cost model's estimate in its planned dtype
    finding: str = ""                 # "eligible but not on Tensor Cores: ..." and the like


@dataclass
class ProfileResult:
    device: str
    iters: int
    nodes: list[NodeProfile] = field(default_factory=list)

    def node(self, name: str) -> NodeProfile:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in the profile")

    @property
    def tensor_core_share(self) -> Optional[float]:
        """Share of matmul/conv time spent in Tensor Core kernels (None on CPUs)."""
        mm = [n for n in self.nodes if n.op_class in _MATMUL_CLASSES and n.tensor_core is not None]
        total = sum(n.time_s for n in mm)
        if not mm or total == 0:
            return None
        return sum(n.time_s for n in mm if n.tensor_core) / total

    @property
    def findings(self) -> list[NodeProfile]:
        return [n for n in self.nodes if n.finding]

    def table(self) -> str:
        rows = [f"profile on {self.device}, {self.iters} runs: per node, measured vs predicted",
                f"{'node':<28} {'class':<13} {'dtype':<9} {'measured us':>11} {'predicted us':>12}  "
                f"{'TC':<3} kernels"]
        for n in self.nodes:
            tc = "-" if n.tensor_core is None else ("yes" if n.tensor_core else "no")
            pred = f"{n.predicted_s * 1e6:.3g}" if n.predicted_s is not None else "-"
            rows.append(f"{n.name[:28]:<28} {n.op_class:<13} {n.dtype or '-':<9} "
                        f"{n.time_s * 1e6:>11.3g} {pred:>12}  {tc:<3} {', '.join(n.kernels[:3])}")
        share = self.tensor_core_share
        rows.append(f"total measured {sum(n.time_s for n in self.nodes) * 1e3:.3g} ms; "
                    + (f"{share:.1%} of matmul/conv time on Tensor Cores" if share is not None
                       else "Tensor Core use not observable on this device"))
        rows += [f"finding: {n.name}: {n.finding}" for n in self.findings]
        return "\n".join(rows)


class _RangeInterpreter(torch.fx.Interpreter):
    """Runs each node inside ranges named after it: record_function, and NVTX on CUDA."""

    def __init__(self, gm, nvtx: bool):
        super().__init__(gm)
        self.nvtx = nvtx

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("placeholder", "output", "get_attr"):
            return super().run_node(n)
        label = RANGE_PREFIX + n.name
        if self.nvtx:
            torch.cuda.nvtx.range_push(label)
        try:
            with torch.profiler.record_function(label):
                return super().run_node(n)
        finally:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()


def run_with_ranges(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, nvtx: bool = False):
    """One run of ``gm`` with every node in an ``mpgraph:<node>`` range (what ncu filters on)."""
    with torch.no_grad():
        return _RangeInterpreter(gm, nvtx).run(*flat_inputs(gm, args, kwargs),
                                               enable_io_processing=False)


def _finding(record, tensor_core: Optional[bool], plan: Plan) -> str:
    """Why an eligible matmul/conv is not on Tensor Cores, when it is not."""
    if record.op_class != "tensor_core" or tensor_core is not False:
        return ""
    if record.dtype == "float32":
        return f"eligible but not on Tensor Cores: it runs in float32 ({record.reason})"
    if record.tensor_core.startswith("eligible but misaligned"):
        return f"eligible but not on Tensor Cores: {record.tensor_core}"
    if "conv" in (record.kind or record.target).lower():
        return ("eligible but not on Tensor Cores: in low precision and aligned; cuDNN's heuristics "
                "picked a non-Tensor-Core algorithm (NCHW layout? try torch.backends.cudnn.benchmark)")
    return "eligible but not on Tensor Cores: in low precision and aligned; see the kernel names"


def profile(converted: torch.fx.GraphModule, example_inputs: Any = None, *,
            example_kwargs: Optional[dict] = None, device: Optional[str] = None,
            iters: int = 5, warmup: int = 2) -> ProfileResult:
    """Profile a converted module node by node on ``device`` (default: where its weights are)."""
    plan = getattr(converted, "plan", None)
    if not isinstance(plan, Plan):
        raise TypeError("profile expects a module returned by mpgraph.convert (it carries .plan)")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    args, kwargs = as_call(example_inputs, example_kwargs)
    here = next((p.device for p in converted.parameters()), torch.device("cpu"))
    dev = torch.device(device) if device is not None else here
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no GPU")
    gm = converted if dev == here else copy.deepcopy(converted).to(dev)
    args, kwargs = to_device(args, dev), to_device(kwargs, dev)
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        run_with_ranges(gm, args, kwargs)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            run_with_ranges(gm, args, kwargs, nvtx=cuda)
        if cuda:
            torch.cuda.synchronize()
    return _attribute(prof.events(), plan, gm, iters, str(dev), cuda)


def _descendants(event):
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def _attribute(events, plan: Plan, gm, iters: int, device: str, cuda: bool) -> ProfileResult:
    times: dict[str, list[float]] = {}
    kernels: dict[str, dict[str, float]] = {}
    for e in events:
        if not e.name.startswith(RANGE_PREFIX):
            continue
        name = e.name[len(RANGE_PREFIX):]
        found = kernels.setdefault(name, {})
        if cuda:
            device_s = 0.0
            for d in [e, *_descendants(e)]:
                for k in getattr(d, "kernels", []):
                    found[k.name] = found.get(k.name, 0.0) + k.duration / 1e6
                    device_s += k.duration / 1e6
            times.setdefault(name, []).append(device_s)
        else:
            for d in _descendants(e):  # ATen/oneDNN ops by their own (self) time
                found[d.name] = found.get(d.name, 0.0) + d.self_cpu_time_total / 1e6
            times.setdefault(name, []).append(e.cpu_time_total / 1e6)
    result = ProfileResult(device, iters)
    casts = {n.name for n in gm.graph.nodes if n.meta.get(INSERTED_BY) == "InsertCasts"}
    for node in gm.graph.nodes:
        if node.name not in times:
            continue
        measured = sorted(times[node.name])[len(times[node.name]) // 2]
        names = tuple(sorted(kernels.get(node.name, {}), key=lambda k: -kernels[node.name][k]))
        if node.name in casts:
            result.nodes.append(NodeProfile(node.name, "cast", dtype_name(node.args[1]),
                                            measured, names, None, None))
            continue
        try:
            record = plan.node(node.name)
        except KeyError:
            continue
        tc = None
        if cuda and record.op_class == "tensor_core":
            tc = any(is_tensor_core_kernel(k) for k in names) if names else False
        predicted = record.t_fp32 if record.dtype == "float32" else record.t_low
        result.nodes.append(NodeProfile(record.name, record.op_class, record.dtype, measured, names, tc,
                                        predicted, _finding(record, tc, plan)))
    return result
