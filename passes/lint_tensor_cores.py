"""Tensor Core eligibility of every matmul and convolution, with the padding that would fix it.

fp16/bf16 Tensor Cores want GEMM dimensions M, N, K (and conv channels C, K) in multiples of 16
bytes: 8 elements; TF32 wants 4. cuBLAS >= 11 still runs misaligned shapes, but off the fast path
(NVIDIA's "Matrix Multiplication Background", Table 1). For each matmul-class node this records
its dimensions, which of them miss the multiple and the padded sizes. It promises no speed-up:
the roofline prices a misaligned GEMM on the Tensor Cores as an aligned one (the slower path's
rate is a kernel's, not a documented figure), so a gain the hint stated would not show in the
plan's estimate after the padding (a hint once said "4.16x the whole plan" where the padded
plan's estimate did not move). A node the host's per-node time bounds, misaligned or padded,
gains nothing, and the hint says so. A CPU plan gets no finding (Tensor Cores are a GPU's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from mpgraph.cost.specs import DeviceSpec
from mpgraph.ir.meta import (COST, OP_CLASS, PRECISION, TENSOR, TC_FINDING, Kind,
                             TensorInfo, dtype_name)
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


def _gemm_dims(node, gm) -> Optional[dict]:
    kind = type(gm.get_submodule(node.target)).__name__ if node.op == "call_module" else str(node.target)
    if "conv" in kind.lower():
        if node.op == "call_module":
            w = gm.get_submodule(node.target).weight
            shape = tuple(w.shape)
            groups = gm.get_submodule(node.target).groups
        else:
            arg = node.args[1] if len(node.args) > 1 else None
            info = arg.meta.get(TENSOR) if isinstance(arg, torch.fx.Node) else None
            if not isinstance(info, TensorInfo):
                return None
            shape, groups = info.shape, 1
        return {"C": shape[1] * groups, "K": shape[0]}
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
            multiple, how = 8, f"{dtype_name(dtype)} Tensor Cores want multiples of 8"
        elif dtype == torch.float32 and self.tf32:
            multiple, how = 4, "TF32 Tensor Cores want multiples of 4"
        else:
            return None
        dims = _gemm_dims(node, gm)
        if not dims or not math.prod(dims.values()):
            return None  # none, or an empty GEMM (a zero-size dimension): nothing to pad
        padding = {k: math.ceil(v / multiple) * multiple for k, v in dims.items() if v % multiple}
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
