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

from .api import convert
from .device import default_low_dtype


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


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """One of the demo models, in eval mode, with an example input."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "transformer":
        return TinyTransformer().eval(), torch.randn(8, 128, 384, generator=g)
    if name == "cnn":
        model = SmallCNN().eval()
        for m in model.modules():  # non-trivial statistics, as a trained net has
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
        return model, torch.randn(16, 3, 64, 64, generator=g)
    raise ValueError(f"unknown demo model {name!r}; choose 'transformer' or 'cnn'")


@dataclass
class DemoResult:
    name: str
    dtype: torch.dtype
    dtype_reason: str
    device: str
    summary: str
    casts: str
    rel_err: float
    fp32_ms: float
    mpgraph_ms: float

    @property
    def speedup(self) -> float:
        return self.fp32_ms / self.mpgraph_ms


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
    """Convert a demo model, check it against fp32 and time both, interleaved."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    auto_dtype, reason = default_low_dtype(dev)
    if dtype is None:
        dtype = auto_dtype
    else:
        reason = "chosen on the command line"
    model, x = build(name)
    model, x = model.to(dev), x.to(dev)
    converted = convert(copy.deepcopy(model), x, dtype=dtype)
    with torch.no_grad():
        ref = model(x)
        out = converted(x)
        rel = float((out.float() - ref).norm() / ref.norm())
        model(x), converted(x)  # warm-up
        t32, tlow = [], []
        for _ in range(rounds):
            t32 += _time(model, x, 1)
            tlow += _time(converted, x, 1)
    return DemoResult(name, dtype, reason, str(dev), converted.plan.summary(),
                      converted.plan.format_casts(), rel, statistics.median(t32) * 1e3,
                      statistics.median(tlow) * 1e3)
