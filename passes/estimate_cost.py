"""Roofline time of every node in float32 and in the low dtype, on a target device.

time = max(FLOPs / peak[dtype], bytes / bandwidth) + launch, from the shapes capture recorded.
Matmul-class ops use the Tensor Core (or AVX512-BF16) peak of their dtype and, on GPUs, lose what
tile and wave quantization waste; everything else runs at the fp32 vector rate and is usually
bandwidth-bound, where half-size values are what low precision buys. Views cost a dispatch only.
The fp32 baseline uses TF32 where torch allows it for matmuls on a GPU that has it.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx

from mpgraph.cost.specs import DeviceSpec
from mpgraph.cost.device import VECTOR_FLOPS_PER_ELEMENT, tf32_enabled
from mpgraph.ir.graph import input_nodes, is_view, matmul_dims
from mpgraph.ir.meta import COST, OP_CLASS, TENSOR, tensor_infos
from mpgraph.passes.op_table import TENSOR_CORE
from mpgraph.passes.infra import Pass, PassResult

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


@dataclass(frozen=True)
class NodeCost:
    flops: float
    bytes_fp32: float
    bytes_low: float
    t_fp32: float
    t_low: float


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
        return min(1.0, dims[1][-1] / _CPU_FULL_K) if spec.kind == "cpu" else 1.0
    if dims[0] == "conv":
        return 1.0  # on CPUs the layout reorder dominates instead (see EstimateCost.cost)
    if spec.kind != "gpu":
        return min(1.0, dims[3] / _CPU_FULL_K)
    b, m, n, _ = dims
    t = spec.tile
    tiles = b * math.ceil(m / t) * math.ceil(n / t)
    waves = math.ceil(tiles / spec.sms)
    return (b * m * n) / (waves * spec.sms * t * t)


class EstimateCost(Pass):
    """Analysis: writes ``mpgraph.cost`` (NodeCost) on every call node that touches float32."""
    stage = "decide"
    reads, writes = (OP_CLASS,), (COST,)

    def __init__(self, spec: DeviceSpec, low_dtype: torch.dtype, tf32: Optional[bool] = None):
        self.spec = spec
        self.low = low_dtype
        self.tf32 = tf32_enabled() if tf32 is None else tf32

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

    def cost(self, node, gm) -> NodeCost:
        spec = self.spec
        no_kernel = is_view(node) or node.target in (operator.getitem, getattr) \
            or (node.op == "call_method" and node.target in _NO_KERNEL_METHODS) \
            or not tensor_infos(node.meta.get(TENSOR))
        if no_kernel:
            return NodeCost(0.0, 0.0, 0.0, spec.launch, spec.launch)
        flops, matmul, dims = node_flops(node, gm)
        softmax = 0.0
        if dims is not None and dims[0] == "sdpa":  # the softmax over the score matrix
            q, k = dims[1], dims[2]
            softmax = math.prod(q[:-1]) * k[-2] * FLOPS_PER_ELEMENT["softmax"]
        times = []
        for dtype in (torch.float32, self.low):
            if matmul:
                peak = spec.matmul_peak(dtype, tf32=self.tf32) or spec.elementwise_peak() / 2
                peak *= _quantization(spec, dims)
            else:
                peak = spec.elementwise_peak()
            nbytes = self._bytes(node, gm, dtype)
            compute = flops / peak + softmax / spec.elementwise_peak()
            if spec.kind == "cpu" and dims is not None and dims[0] == "conv" and dtype == torch.float32:
                # NCHW reorders; low-precision convs run channels_last (the ChannelsLast pass)
                compute += _CPU_CONV_LAYOUT * nbytes / spec.bandwidth
            times.append((max(compute, nbytes / spec.bandwidth) + spec.launch, nbytes))
        (t32, b32), (tlow, blow) = times
        return NodeCost(flops, b32, blow, t32, tlow)

    def cast_cost(self, numel: int) -> float:
        """One fp32<->low cast: read one, write the other (6 bytes per element for fp16), a launch."""
        return numel * (4 + self.low.itemsize) / self.spec.bandwidth + self.spec.launch

    def call(self, gm):
        for node in gm.graph.nodes:
            if node.op.startswith("call_"):
                node.meta[COST] = self.cost(node, gm)
        return PassResult(gm, False)


def gm_params(gm, target: str) -> list[torch.Tensor]:
    module = gm.get_submodule(target)
    return list(module.parameters()) + list(module.buffers())
