"""The demo's models (defined here, nothing downloaded) and the measurement it prints."""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mpgraph.api import convert
from mpgraph.numerics import relative_l2
from mpgraph.cost.specs import GPU_SPECS
from mpgraph.plans.plan import Plan

# planned for when this machine is not faster in low precision: the demo still converts for real
STAND_IN_GPU = "a100-80gb"


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        probs = F.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A pre-norm transformer encoder over float features, written out so fx can trace it."""

    def __init__(self, dim: int = 384, heads: int = 6, layers: int = 4):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.blocks(x))


class SmallCNN(nn.Module):
    """conv-bn-relu-pool stages and a linear head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        chans = [3, 64, 128, 256]
        layers = []
        for cin, cout in zip(chans, chans[1:]):
            layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(chans[-1], classes)

    def forward(self, x):
        x = self.features(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build(name: str, batch: Optional[int] = None) -> tuple[nn.Module, torch.Tensor]:
    """One of the demo models, in eval mode, with an example input (``batch`` rows of it)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "transformer":
        return TinyTransformer().eval(), torch.randn(batch or 8, 128, 384, generator=g)
    if name == "cnn":
        model = SmallCNN().eval()
        for m in model.modules():  # non-trivial statistics, as a trained net has
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
        return model, torch.randn(batch or 16, 3, 64, 64, generator=g)
    raise ValueError(f"unknown demo model {name!r}; choose 'transformer' or 'cnn'")


@dataclass
class DemoResult:
    name: str
    dtype: torch.dtype
    dtype_reason: str
    device: str
    target: str                        # the device the plan is for
    summary: str
    casts: str
    rel_err: float
    fp32_ms: Optional[float]           # None when the plan is for another device than this one
    mpgraph_ms: Optional[float]
    estimated: Optional[float] = None  # the plan's estimated speed-up over float32
    plan: Optional[Plan] = None        # (the command line heads its output by what it holds)

    @property
    def speedup(self) -> Optional[float]:
        return self.fp32_ms / self.mpgraph_ms if self.fp32_ms and self.mpgraph_ms else None


def _time(fn, x, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def run(name: str, dtype: Optional[torch.dtype] = None, rounds: int = 10,
        device: Optional[str] = None) -> DemoResult:
    """Convert a demo model for this machine, check it against fp32 and time both, interleaved.

    The plan's dtype and its nodes' precisions come from this machine's measured op times (or
    ``dtype``). Where no node is faster in low precision here (a CPU without fast bf16), the
    demo plans for a GPU instead (fp16 on an A100, as replayed from CUDA graphs), runs that plan
    here for its numbers (error, casts) on a smaller batch, and times nothing: the speed of a
    GPU plan is a question for the GPU."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, x = build(name)
    model, x = model.to(dev), x.to(dev)
    converted = convert(copy.deepcopy(model), x, dtype=dtype, target=None)
    plan = converted.plan
    if dtype is not None:
        reason = "chosen on the command line"
    elif plan.dtype_choice:
        reason = "the fastest here by the cost model: " + ", ".join(
            f"{k} {v * 1e3:.3g} ms" for k, v in plan.dtype_choice["estimates_s"].items())
    else:
        reason = ""
    here = bool(plan.low_nodes) or dtype is not None
    if not here:  # nothing pays here: the plan for a GPU, run here for its numbers
        reason = (f"{plan.kept_fp32}; planned for an {GPU_SPECS[STAND_IN_GPU].name} instead "
                  "(fp16, replayed from CUDA graphs) and run here for its numbers, on batch 2")
        model, x = build(name, 2)
        model, x = model.to(dev), x.to(dev)
        # calibrated on a few batches, as fp16 plans should be (on the example alone every
        # conversion warned, and the demo printed that warning twice)
        g = torch.Generator().manual_seed(1)
        batches = [x] + [torch.randn(x.shape, generator=g).to(dev) for _ in range(3)]
        converted = convert(copy.deepcopy(model), x, dtype=torch.float16, target=STAND_IN_GPU,
                            runtime="graphs", calibration=batches)
        plan = converted.plan
    with torch.no_grad():
        ref = model(x)
        out = converted(x)
        rel = relative_l2(out, ref)
        t32, tlow = [], []
        if here:
            model(x), converted(x)  # warm-up
            for _ in range(rounds):
                t32 += _time(model, x, 1)
                tlow += _time(converted, x, 1)
    estimated = plan.estimate["fp32_s"] / plan.estimate["plan_s"] \
        if plan.estimate.get("plan_s") else None
    return DemoResult(name, plan.dtype, reason, str(dev), plan.target, plan.summary(),
                      plan.format_casts(), rel,
                      statistics.median(t32) * 1e3 if t32 else None,
                      statistics.median(tlow) * 1e3 if tlow else None, estimated, plan)
