"""Tensor Core eligibility of every matmul and convolution, with the padding that would fix it.

fp16/bf16 Tensor Cores want GEMM dimensions M, N, K (and a conv's in/out channels, per group)
in multiples of 16 bytes: 8 elements; TF32 wants 4. cuBLAS >= 11 still runs misaligned shapes,
but off the fast path (NVIDIA's "Matrix Multiplication Background", Table 1). For each
matmul-class node this records its dimensions, which of them miss the multiple and the padded
sizes. It promises no speed-up: the roofline prices a misaligned GEMM on the Tensor Cores as an
aligned one (the slower path's rate is a kernel's, not a documented figure), so a gain the hint
stated would not show in the plan's estimate after the padding (a hint once said "4.16x the
whole plan" where the padded plan's estimate did not move). A node the host's per-node time
bounds, misaligned or padded, gains nothing, and the hint says so. A CPU plan gets no finding
(Tensor Cores are a GPU's).

Some nodes are "not on Tensor Cores", where no padding would help: a depthwise conv, or a grouped
one with fewer channels per group than the multiple (cuDNN runs them on CUDA cores; padding a
group of 2 to 8 is 16x the work), and a dtype the GPU has no Tensor Cores for (bf16 on a T4 or
V100; nor is float32 held to TF32's multiple there). A conv reads the same whether captured as a
module call (fx) or an aten call (export), and names its channels as the layer does (a
ConvTranspose's weight is [in, out/groups, ...]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from mpgraph.cost.specs import DeviceSpec
from mpgraph.ir.meta import (COST, OP_CLASS, PRECISION, TENSOR, TC_FINDING, Kind, dtype_name,
                             shape_of)
from mpgraph.passes.op_table import TENSOR_CORE
from mpgraph.passes.infra import Pass, PassResult

from mpgraph.cost.device import tf32_enabled
from mpgraph.ir.graph import matmul_dims


@dataclass(frozen=True)
class TensorCoreFinding:
    dims: dict = field(hash=False)       # e.g. {"M": 128, "N": 4095, "K": 1023}
    multiple: int
    padding: dict = field(hash=False)    # misaligned dims -> padded size
    gain: Optional[float]                # estimated speed-up from padding (None: not priced)
    text: str


def _conv_channels(node, gm) -> Optional[tuple[int, int, int]]:
    """(in_channels, out_channels, groups) of a convolution in the layer's own terms, the same
    for a module call (fx) and a function or aten call (torch.export). A transposed conv's
    weight is [in, out/groups, ...], a conv's [out, in/groups, ...]: the input and output
    tensors' channels say which, and the weight the groups."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if not isinstance(mod, torch.nn.modules.conv._ConvNd):
            return None
        return mod.in_channels, mod.out_channels, mod.groups
    x, w = (shape_of(a.meta.get(TENSOR)) if isinstance(a, torch.fx.Node) else None
            for a in (node.args + (None, None))[:2])
    y = shape_of(node.meta.get(TENSOR))
    if not (x and w and y) or len(w) < 3:
        return None
    if "conv_tbc" in str(node.target):
        return x[-1], y[-1], 1  # time-batch-channel layout: weight [width, in, out]
    dim = 0 if len(x) == len(w) - 1 else 1  # an unbatched input has no batch dim
    cin, cout = x[dim], y[dim]
    if not w[1]:
        return None
    groups = (cin if w[0] == cout else cout) // w[1]
    return cin, cout, max(groups, 1)


def _few_per_group(per: dict, groups: int, multiple: int, how: str) -> str:
    """A grouped conv with fewer channels per group than the multiple: cuDNN runs it on CUDA
    cores, and padding is no fix (a depthwise conv stays off Tensor Cores; a grouped one would
    do the padded groups' work, a multiple of its own)."""
    cin, cout = per["in_channels"], per["out_channels"]
    shape = (f"{cin} input and {cout} output channel{'s' if cout > 1 else ''} per group, "
             f"groups={groups}")
    if cin == 1:
        return (f"not on Tensor Cores: a depthwise conv ({shape}) runs on CUDA cores, padded or "
                f"not ({how} channels per group)")
    work = math.prod(math.ceil(v / multiple) * multiple for v in per.values()) / (cin * cout)
    return (f"not on Tensor Cores: a grouped conv ({shape}) runs on CUDA cores ({how} channels "
            f"per group; padding each group to that would be {work:.3g}x the work: no padding "
            "is suggested)")


def _gemm_dims(node, gm) -> Optional[dict]:
    kind = type(gm.get_submodule(node.target)).__name__ if node.op == "call_module" else str(node.target)
    if "conv" in kind.lower():
        channels = _conv_channels(node, gm)
        if channels is None:
            return None
        cin, cout, groups = channels
        return {"in_channels": cin, "out_channels": cout, "groups": groups}
    if "scaled_dot_product" in kind or "multihead" in kind.lower():
        return None
    dims = matmul_dims(node, gm)
    if dims is None:
        return None
    _, m, n, k = dims
    return {"M": m, "N": n, "K": k}


class LintTensorCores(Pass):
    """Analysis: writes ``mpgraph.tensor_core`` on matmul-class nodes (after the dtype decision)."""
    stage = "decide"
    reads, writes = (OP_CLASS, PRECISION), (TC_FINDING,)

    def __init__(self, spec: DeviceSpec, costs=None, tf32: Optional[bool] = None):
        self.spec = spec
        self.tf32 = tf32_enabled() if tf32 is None else tf32
        # the host time a node costs in eager mode (the plan's cost model: 0 when it prices
        # replayed or compiled runs)
        self.host = getattr(costs, "host", 0.0) if getattr(costs, "runtime", "eager") == "eager" \
            else 0.0

    def call(self, gm):
        if self.spec.kind != Kind.GPU:
            return PassResult(gm, False)  # Tensor Cores are a GPU's: a CPU plan has no finding
        for node in gm.graph.nodes:
            if node.op.startswith("call_") and node.meta.get(OP_CLASS) \
                    and node.meta[OP_CLASS].op_class == TENSOR_CORE:
                finding = self.finding(node, gm)
                if finding is not None:
                    node.meta[TC_FINDING] = finding
        return PassResult(gm, False)

    def finding(self, node, gm) -> Optional[TensorCoreFinding]:
        decision = node.meta.get(PRECISION)
        dtype = decision.dtype if decision is not None else None
        if dtype in (torch.float16, torch.bfloat16):
            if self.spec.matmul_peak(dtype) is None:  # (a T4 or V100 and bf16): no verdict to align
                other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
                out = (f"; dtype='{'fp16' if other == torch.float16 else 'bf16'}' runs on them"
                       if self.spec.matmul_peak(other) else "")
                return TensorCoreFinding({}, 0, {}, None, (
                    f"not on Tensor Cores: {self.spec.name} has no {dtype_name(dtype)} Tensor "
                    f"Cores, its CUDA cores run it{out}"))
            multiple, how = 8, f"{dtype_name(dtype)} Tensor Cores want multiples of 8"
        elif dtype == torch.float32 and self.tf32 and self.spec.peak.get("tf32"):
            multiple, how = 4, "TF32 Tensor Cores want multiples of 4"
        else:
            return None
        dims = _gemm_dims(node, gm)
        if not dims or not math.prod(dims.values()):
            return None  # none, or an empty GEMM (a zero-size dimension): nothing to pad
        groups = dims.pop("groups", 1)  # a conv's channels align per group
        per = {k: v // groups for k, v in dims.items()}
        if groups > 1 and min(per.values()) < multiple:
            return TensorCoreFinding(dims, multiple, {}, None,
                                     _few_per_group(per, groups, multiple, how))
        padding = {k: math.ceil(per[k] / multiple) * multiple * groups
                   for k in dims if per[k] % multiple}
        if groups > 1:
            what = ", ".join(f"{per[k]}->{v // groups}" for k, v in padding.items()) or \
                f"{per['in_channels']} in, {per['out_channels']} out"
            how = f"{what} channels per group, groups={groups}; {how}"
        if not padding:
            return TensorCoreFinding(dims, multiple, {}, None, f"aligned ({how})")
        pads = ", ".join(f"{k} {dims[k]}->{v}" for k, v in padding.items())
        text = f"eligible but misaligned: pad {pads} ({how})"
        cost = node.meta.get(COST)
        padded = math.prod(padding.get(k, v) for k, v in dims.items()) / math.prod(dims.values())
        now = None if cost is None else (cost.t_fp32 if dtype == torch.float32 else cost.t_low)
        if now is not None and self.host and now <= self.host and \
                cost.flops * padded / (self.spec.matmul_peak(dtype, tf32=self.tf32) or
                                       self.spec.peak["fp32"]) <= self.host:
            text += (f"; no time saved at this size on {self.spec.name} (the node costs the "
                     f"host's {self.host * 1e6:.3g} us either way)")
        else:  # (no number the plan's own estimate would not show after the padding)
            text += ("; cuBLAS >= 11 still runs it on Tensor Cores, off their fastest path, by an "
                     "amount the plan's cost model does not price: no gain is estimated (time "
                     "the padded layer on the GPU: mpgraph.profile)")
        return TensorCoreFinding(dims, multiple, padding, None, text)
