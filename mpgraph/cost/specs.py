"""Device specs as data: dense peaks per dtype, memory bandwidth, SM count, launch overhead.

Peaks are dense (no 2:4 sparsity) in FLOP/s; ``None`` means the hardware has no fast path for
that dtype. GPU numbers come from NVIDIA's datasheets and its "GPU Performance Background" guide
(the datasheet each figure is from is in the comment on its entry). CPU
specs are measured on the machine (``mpgraph.cost.device.measure_cpu``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from mpgraph.ir.meta import Kind

T = 1e12
G = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: Kind                         # Kind.GPU or Kind.CPU
    peak: dict = field(hash=False)     # "fp32" (CUDA cores), "tf32", "fp16", "bf16", "fp8" -> FLOP/s
    bandwidth: float                   # bytes/s
    sms: int                           # streaming multiprocessors (CPU: cores)
    launch: float                      # seconds of overhead per kernel/op in eager mode
    tile: int = 128                    # GEMM output tile edge for quantization (GPUs)
    source: str = ""

    def matmul_peak(self, dtype: torch.dtype, tf32: bool = False) -> Optional[float]:
        """FLOP/s of a matmul in ``dtype`` (fp32 uses TF32 Tensor Cores when allowed and present)."""
        if dtype == torch.float32:
            return self.peak.get("tf32") if tf32 and self.peak.get("tf32") else self.peak["fp32"]
        key = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype)
        return self.peak.get(key) if key else None

    def elementwise_peak(self) -> float:
        """Non-matmul arithmetic, in any dtype (fp16/bf16 elementwise kernels compute in float32):
        the CUDA cores' fp32 rate on GPUs; on CPUs the measured rate of vector math
        (``peak["vector"]``, far below the AMX/AVX512 matmul peak)."""
        return self.peak.get("vector", self.peak["fp32"])


# Each entry: datasheet figures, dense. Launch overhead: ~5 us per eager op on GPUs (CUDA launch
# plus PyTorch dispatch), measured on CPUs.
GPU_SPECS: dict[str, DeviceSpec] = {
    # NVIDIA V100 SXM2 datasheet: 15.7 TFLOPS fp32, 125 TFLOPS fp16 Tensor Core, 900 GB/s, 80 SMs
    "v100": DeviceSpec("NVIDIA V100 SXM2", Kind.GPU, {"fp32": 15.7 * T, "fp16": 125 * T},
                       900 * G, 80, 5e-6, source="V100 datasheet; GPU Performance Background"),
    # NVIDIA T4 datasheet: 8.1 TFLOPS fp32, 65 TFLOPS fp16 Tensor Core, 320 GB/s, 40 SMs
    "t4": DeviceSpec("NVIDIA T4", Kind.GPU, {"fp32": 8.1 * T, "fp16": 65 * T}, 320 * G, 40, 5e-6,
                     source="T4 datasheet"),
    # NVIDIA A10 datasheet: 31.2 fp32, 62.5 tf32, 125 fp16/bf16 (dense), 600 GB/s, 72 SMs
    "a10": DeviceSpec("NVIDIA A10", Kind.GPU, {"fp32": 31.2 * T, "tf32": 62.5 * T, "fp16": 125 * T,
                                           "bf16": 125 * T}, 600 * G, 72, 5e-6,
                      source="A10 datasheet (sparse figures halved)"),
    # NVIDIA L4 datasheet: 30.3 fp32, 60 tf32, 121 fp16/bf16, 242.5 fp8 (dense), 300 GB/s, 58 SMs
    "l4": DeviceSpec("NVIDIA L4", Kind.GPU, {"fp32": 30.3 * T, "tf32": 60 * T, "fp16": 121 * T,
                                         "bf16": 121 * T, "fp8": 242.5 * T}, 300 * G, 58, 5e-6,
                     source="L4 datasheet (sparse figures halved)"),
    # NVIDIA A100 datasheet: 19.5 fp32, 156 tf32, 312 fp16/bf16; 40 GB 1555 GB/s, 108 SMs
    "a100-40gb": DeviceSpec("NVIDIA A100 40GB SXM", Kind.GPU, {"fp32": 19.5 * T, "tf32": 156 * T,
                                                           "fp16": 312 * T, "bf16": 312 * T},
                            1555 * G, 108, 5e-6, source="A100 datasheet; GPU Performance Background"),
    # same compute, 80 GB HBM2e at 2039 GB/s
    "a100-80gb": DeviceSpec("NVIDIA A100 80GB SXM", Kind.GPU, {"fp32": 19.5 * T, "tf32": 156 * T,
                                                           "fp16": 312 * T, "bf16": 312 * T},
                            2039 * G, 108, 5e-6, source="A100 datasheet"),
    # NVIDIA H100 datasheet (SXM): 67 fp32, 494.7 tf32, 989.4 fp16/bf16, 1979 fp8, 3.35 TB/s, 132 SMs
    "h100-sxm": DeviceSpec("NVIDIA H100 SXM", Kind.GPU, {"fp32": 67 * T, "tf32": 494.7 * T,
                                                     "fp16": 989.4 * T, "bf16": 989.4 * T,
                                                     "fp8": 1979 * T}, 3350 * G, 132, 5e-6,
                           source="H100 datasheet (sparse figures halved)"),
    # NVIDIA H100 datasheet (PCIe): 51 fp32, 378 tf32, 756 fp16/bf16, 1513 fp8, 2.0 TB/s, 114 SMs
    "h100-pcie": DeviceSpec("NVIDIA H100 PCIe", Kind.GPU, {"fp32": 51 * T, "tf32": 378 * T,
                                                       "fp16": 756 * T, "bf16": 756 * T,
                                                       "fp8": 1513 * T}, 2000 * G, 114, 5e-6,
                            source="H100 datasheet (sparse figures halved)"),
    # NVIDIA H200 datasheet: H100 SXM compute, 4.8 TB/s HBM3e, 132 SMs
    "h200": DeviceSpec("NVIDIA H200 SXM", Kind.GPU, {"fp32": 67 * T, "tf32": 494.7 * T,
                                                 "fp16": 989.4 * T, "bf16": 989.4 * T,
                                                 "fp8": 1979 * T}, 4800 * G, 132, 5e-6,
                       source="H200 datasheet"),
}
ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb"}
