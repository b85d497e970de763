"""Per-node profiling of a converted module: measured time, kernels, Tensor Cores, findings.

``profile(converted, example_inputs)`` runs the graph node by node under a torch.fx Interpreter
that wraps every node in a ``record_function`` range and, on CUDA, an NVTX range, both named
``mpgraph:<node>``, so torch.profiler's events (and Nsight Compute's kernels, see
``mpgraph.tools.ncu``) map back to graph nodes. Each node gets its measured time per run, its kernels
(CUDA kernel names on GPUs; the ATen/oneDNN ops on CPUs, where there are no kernels to name),
whether those kernels run on Tensor Cores (by name: ``KERNEL_RULES``; yes, no or unknown), the
cost model's prediction, and the share of matmul/conv time on Tensor Cores. Interpreting adds Python
overhead per node (a few microseconds): the numbers are for attribution, not a benchmark. Under
Nsight Compute torch.profiler sees no kernels (ncu holds CUPTI): the result then says the kernels
were not observed and makes no finding, rather than reporting 0 us and false findings.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx
from torch.autograd import DeviceType

from mpgraph.ir.graph import (RecordingInterpreter, as_call, flat_inputs, fresh, seeded,
                              state_kept, to_device)
from mpgraph.ir.meta import CAST_COST, dtype_name, is_inserted_cast
from mpgraph.plans.plan import Plan

RANGE_PREFIX = "mpgraph:"

# What a CUDA kernel's name says about where its math runs: (kind, pattern, why), matched against
# the lower-cased name in this order, the first match deciding. Kinds: "cuda_core" (a GEMM on FFMA
# units), "tensor_core" (MMA instructions), "not_gemm" (no matmul at all: elementwise, reductions,
# copies). A name no rule matches is unknown: the plain ``xmma``/``sm80``/``sm90`` prefix says
# which library and GPU, not which units (cuBLAS's FP32 kernels are ``sm80_xmma_gemm_..._ffma``).
_T = r"(?:bf16|tf32|f16|f32|f64|e4m3|e5m2|i8|i32)"  # element types in xmma/cuDNN/CUTLASS names
KERNEL_RULES: tuple[tuple[str, str, str], ...] = (
    ("cuda_core", r"ffma|simt|(?:^|[^a-z0-9])sgemm|gemv|gemmsn",
     "FFMA/SIMT GEMM (volta_sgemm, cudnn implicit_convolve_sgemm, cutlass simt, gemv, gemmSN)"),
    ("tensor_core", r"(?:884|1688|8816|16816|16832)(?:gemm|fprop|dgrad|wgrad)|_tensor\d+x\d+x\d+",
     "MMA instruction shape (h884, s1688, s16816, i8816, _tensor16x8x16)"),
    ("tensor_core", r"[hibd]mma|gmma|tcgen05|tensorop|tensor_?core|tf32",
     "MMA family (hmma, imma, wgmma, tcgen05, CUTLASS tensorop, tf32)"),
    ("tensor_core", rf"(?:^|_){_T}{_T}_(?:bf16|f16|tf32|e4m3|e5m2|i8){_T}_{_T}(?:_|$)",
     "xmma element types AB_<math><acc>_C with half/bf16/tf32/fp8/int8 math"),
    ("cuda_core", rf"(?:^|_){_T}{_T}_f32f32_{_T}(?:_|$)",
     "xmma element types with fp32 math (f32f32_f32f32_f32): FFMA"),
    ("tensor_core", r"nvjet_(?:sm\d+_)?[a-z]*[htbqro][a-z]*_",
     "cuBLAS nvjet whose type tag has fp16 (h), bf16 (t), int8 (b), fp8 (q, r) or fp4 (o): hsh, tst, "
     "qqtst; s is fp32, so a bare sss (sss_tf32 says tf32) does not tell"),
    ("tensor_core", r"flash_fwd|flash_bwd|flash_attn|(?:fmha|flash).*(?:bf16|f16|fp16|half)",
     "FlashAttention / fp16 fused attention (MMA only)"),
    ("not_gemm", r"at::native::|elementwise|reduce_kernel|splitkreduce|softmax"
     r"|(?:layer|batch|group|rms)_?norm|catarray|memcpy|memset|nchwtonhwc|nhwctonchw",
     "not a matmul (PyTorch elementwise/reduction/norm kernels, cuBLAS split-K reduce, copies)"),
)
_KERNEL_RULES = tuple((kind, re.compile(pattern), why) for kind, pattern, why in KERNEL_RULES)
_MATMUL_CLASSES = ("tensor_core",)


def kernel_kind(name: str) -> str:
    """What ``KERNEL_RULES`` say of a kernel name: "tensor_core", "cuda_core", "not_gemm", "unknown"."""
    lowered = name.lower()
    for kind, pattern, _ in _KERNEL_RULES:
        if pattern.search(lowered):
            return kind
    return "unknown"


def is_tensor_core_kernel(name: str) -> Optional[bool]:
    """True/False when a CUDA kernel's name says whether it runs on Tensor Cores, None when it does
    not tell (an nvjet ``sss`` kernel is TF32 or FP32; Triton and generic CUTLASS names hide it).
    Names are a hint; ncu's tensor pipe counters are the proof (mpgraph.tools.ncu)."""
    kind = kernel_kind(name)
    return None if kind == "unknown" else kind == "tensor_core"


def node_tensor_core(kernels) -> Optional[bool]:
    """A matmul/conv node's verdict from its kernels: False when a CUDA-core GEMM ran (or only
    non-matmul kernels), True when a Tensor Core kernel ran, else None: unknown is not counted as
    Tensor Core use."""
    kinds = {kernel_kind(k) for k in kernels}
    if "cuda_core" in kinds or (kinds and kinds <= {"not_gemm"}):
        return False
    return True if "tensor_core" in kinds else None


@dataclass
class NodeProfile:
    name: str
    op_class: str
    dtype: Optional[str]
    time_s: Optional[float]           # measured per run (median); None when its kernels were not seen
    kernels: tuple[str, ...]          # CUDA kernels, or ATen ops on a CPU
    tensor_core: Optional[bool]       # None: a CPU, or kernel names that do not tell
    predicted_s: Optional[float]      # the cost model's estimate in its planned dtype
    finding: str = ""                 # "eligible but not on Tensor Cores: ..." and the like


NOT_OBSERVED = ("kernels not observed: torch.profiler saw no CUDA kernel in this run (CUPTI was not its "
                "own: Nsight Compute holds it), so no times, no Tensor Core attribution and no findings; "
                "under ncu its report has the kernels (mpgraph profile --ncu-csv FILE)")


@dataclass
class ProfileResult:
    device: str
    iters: int
    nodes: list[NodeProfile] = field(default_factory=list)       # nodes with a measurement
    kernels_observed: bool = True     # False: a CUDA run in which the profiler saw no kernel at all
    unobserved: list[NodeProfile] = field(default_factory=list)  # time None: no kernels seen for them

    def node(self, name: str) -> NodeProfile:
        for n in self.nodes + self.unobserved:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in the profile")

    def _matmul_times(self) -> tuple[float, float, float]:
        """(on Tensor Core kernels, on kernels whose names do not tell, all) matmul/conv time."""
        mm = [n for n in self.nodes if n.op_class in _MATMUL_CLASSES]
        return (sum(n.time_s for n in mm if n.tensor_core),
                sum(n.time_s for n in mm if n.tensor_core is None), sum(n.time_s for n in mm))

    @property
    def tensor_core_share(self) -> Optional[float]:
        """Share of matmul/conv time in kernels known by name to run on Tensor Cores (unknown
        kernels count against it); None on CPUs, or when no kernel's name tells."""
        tc, unknown, total = self._matmul_times()
        if total == 0 or unknown == total:
            return None
        return tc / total

    @property
    def findings(self) -> list[NodeProfile]:
        return [n for n in self.nodes if n.finding]

    def table(self) -> str:
        rows = [f"profile on {self.device}, {self.iters} runs: per node, measured vs predicted"]
        if not self.kernels_observed:
            return "\n".join(rows + [NOT_OBSERVED])
        rows.append(f"{'node':<28} {'class':<13} {'dtype':<9} {'measured us':>11} {'predicted us':>12}  "
                    f"{'TC':<3} kernels")
        cuda = self.device.startswith("cuda")
        for n in self.nodes + self.unobserved:
            if n.tensor_core is not None:
                tc = "yes" if n.tensor_core else "no"
            else:  # "?": a GPU matmul whose kernel names do not tell
                tc = "?" if cuda and n.op_class in _MATMUL_CLASSES and n.time_s is not None else "-"
            pred = f"{n.predicted_s * 1e6:.3g}" if n.predicted_s is not None else "-"
            measured = f"{n.time_s * 1e6:.3g}" if n.time_s is not None else "-"
            rows.append(f"{n.name[:28]:<28} {n.op_class:<13} {n.dtype or '-':<9} "
                        f"{measured:>11} {pred:>12}  {tc:<3} {', '.join(n.kernels[:3])}")
        share = self.tensor_core_share
        _, unknown, total = self._matmul_times()
        if share is not None:
            use = f"{share:.1%} of matmul/conv time on Tensor Core kernels" + (
                f" ({unknown / total:.1%} on kernels whose names do not tell: ?)" if unknown else "")
        else:
            use = ("Tensor Core use unknown: no matmul/conv kernel name tells" if cuda and total
                   else "Tensor Core use not observable on this device")
        rows.append(f"total measured {sum(n.time_s for n in self.nodes) * 1e3:.3g} ms; {use}")
        if self.unobserved:
            rows.append(f"not observed: no kernels seen for {', '.join(n.name for n in self.unobserved)}"
                        " (measured -): no time and no finding for them")
        rows += [f"finding: {n.name}: {n.finding}" for n in self.findings]
        return "\n".join(rows)


class _RangeInterpreter(RecordingInterpreter):
    """Runs each node inside ranges named after it: record_function, and NVTX on CUDA; each
    node's kernels are the module's own (a packed bf16 linear runs packed: RecordingInterpreter;
    its dropout in its own dtype, not the check's float32 draw)."""
    masks_in_float32 = False

    def __init__(self, gm, nvtx: bool):
        super().__init__(gm, lambda node, value: None)
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


def _finding(record, tensor_core: Optional[bool], kernels: tuple[str, ...]) -> str:
    """Why an eligible matmul/conv is not on Tensor Cores, when its kernels say it is not."""
    if record.op_class != "tensor_core" or tensor_core is not False:
        return ""
    if record.dtype == "float32":
        return f"eligible but not on Tensor Cores: it runs in float32 ({record.reason})"
    if record.tensor_core.startswith("eligible but misaligned"):
        return f"eligible but not on Tensor Cores: {record.tensor_core}"
    if record.tensor_core.startswith("not on Tensor Cores"):
        return record.tensor_core  # the lint's reason (a depthwise conv): no setting moves it
    if "conv" in (record.kind or record.target).lower():
        return ("eligible but not on Tensor Cores: in low precision and aligned; cuDNN's heuristics "
                "picked a non-Tensor-Core algorithm (NCHW layout? try torch.backends.cudnn.benchmark)")
    simt = [k for k in kernels if kernel_kind(k) == "cuda_core"]
    return ("eligible but not on Tensor Cores: in low precision and aligned; "
            + (f"{simt[0]} is a CUDA-core (FFMA) GEMM" if simt else "no matmul kernel ran"))


def check_device(device, given: Optional[str] = None) -> torch.device:
    """The device to profile on: cpu or cuda; a ValueError names another (torch's own refusal
    of an unknown type is a RuntimeError from deep inside it) or cuda where torch sees no GPU.
    ``given``: how the caller names the option (the CLI's ``--device tpu``)."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{given or f'device={device!r}'}: profile runs on cpu or cuda (cuda:N)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but torch sees no GPU")
    return dev


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
    dev = check_device(device) if device is not None else here
    gm = converted if dev == here else copy.deepcopy(converted).to(dev)
    args, kwargs = to_device(args, dev), to_device(kwargs, dev)
    cuda = dev.type == "cuda"
    # each run on its own copy of the inputs, and the module's buffers put back afterwards: a
    # forward that writes its input (x.mul_(2)) or a counter left the caller's x 2**7 times
    # itself and the counter 7 on (probe pC 1), as conversion's own runs never do; the random
    # numbers it draws (dropout, rand_like) from conversion's own seed, not the caller's stream
    with state_kept(gm), seeded():
        for _ in range(warmup):
            run_with_ranges(gm, *fresh((args, kwargs)))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(iters):  # (the copy outside every node's range: not attributed)
                run_with_ranges(gm, *fresh((args, kwargs)), nvtx=cuda)
            if cuda:
                torch.cuda.synchronize()
    return attribute(prof.events(), plan, gm, iters, str(dev), cuda)


def _descendants(event):
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def _kernel_activity(event) -> bool:
    """Whether a profiler event is, or carries, a CUDA kernel (what CUPTI gives torch.profiler)."""
    return bool(getattr(event, "kernels", None)) or getattr(event, "device_type", None) == DeviceType.CUDA


def attribute(events, plan: Plan, gm, iters: int, device: str, cuda: bool) -> ProfileResult:
    """Per-node times and kernels from torch.profiler events (FunctionEvents) of ``iters`` runs of
    ``gm`` under ``run_with_ranges``: profile's second half, apart so that events recorded
    elsewhere (or made up in a test) can be attributed. On CUDA, a run without any kernel event
    (Nsight Compute holds CUPTI, so torch.profiler gets none) and a matmul/conv node without
    kernels are not observed: no time (not 0), no Tensor Core verdict, no finding."""
    events = list(events)
    observed = not cuda or any(_kernel_activity(e) for e in events)
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
    result = ProfileResult(device, iters, kernels_observed=observed)
    casts = {n.name for n in gm.graph.nodes if is_inserted_cast(n)}
    for node in gm.graph.nodes:
        if node.name not in times:
            continue
        measured = sorted(times[node.name])[len(times[node.name]) // 2] if observed else None
        names = tuple(sorted(kernels.get(node.name, {}), key=lambda k: -kernels[node.name][k]))
        if node.name in casts:  # predicted: what the plan's estimate charged for this cast
            charged = getattr(node.args[0], "meta", {}).get(CAST_COST)
            down = node.args[1] in (torch.float16, torch.bfloat16)
            predicted = None if charged is None else charged[0 if down else 1]
            cast = NodeProfile(node.name, "cast", dtype_name(node.args[1]), measured, names, None,
                               predicted)
            (result.nodes if observed else result.unobserved).append(cast)
            continue
        try:
            record = plan.node(node.name)
        except KeyError:
            continue
        # (a node with no float value, dtype None, runs as captured: its float32 time)
        predicted = record.t_low if record.dtype in ("float16", "bfloat16") else record.t_fp32
        matmul = record.op_class == "tensor_core"
        if not observed or (cuda and matmul and not names):
            result.unobserved.append(NodeProfile(record.name, record.op_class, record.dtype, None,
                                                 names, None, predicted))
            continue
        tc = node_tensor_core(names) if cuda and matmul else None
        result.nodes.append(NodeProfile(record.name, record.op_class, record.dtype, measured, names, tc,
                                        predicted, _finding(record, tc, names)))
    return result
