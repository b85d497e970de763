"""What the machine we run on can do in low precision (the cost-model issue grows this into specs)."""
from __future__ import annotations

import functools
import platform

import torch


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


def default_low_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The low dtype worth using on ``device``, with the reason in words."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if major >= 7:
            return torch.float16, f"{name} (sm_{major}{minor}) has fp16 Tensor Cores"
        return torch.float16, f"{name} (sm_{major}{minor}) has no Tensor Cores; fp16 halves memory"
    flags = cpu_flags()
    cpu = platform.machine()
    if "avx512_fp16" in flags or "amx_fp16" in flags:
        return torch.float16, f"this {cpu} CPU has native fp16 arithmetic (avx512_fp16/amx_fp16)"
    fast_bf16 = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if fast_bf16:
        return torch.bfloat16, (f"this {cpu} CPU has {'/'.join(fast_bf16)} but no fast fp16 "
                                "(fp16 matmul falls back to slow code), so bfloat16")
    return torch.bfloat16, (f"this {cpu} CPU has neither fast fp16 nor bf16 instructions: "
                            "bfloat16 for its range, expect little speed-up")
