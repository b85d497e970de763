"""Overflow traps: small models where a plain ``.half()`` gives inf/NaN or silently wrong output.

Each is a pattern users report against AMP tools: activations of ~1e5 before a LayerNorm, a -1e9
additive attention mask (with an empty, fully padded sequence), RMSNorm's ``x.pow(2).mean(-1)`` on
large activations, ``exp`` of large logits, and eps=1e-12 over constant (padding) rows. Used by
the tests and by ``examples/bench/bench_numerics.py``.
"""
import torch
import torch.nn as nn


class HugeBeforeLayerNorm(nn.Module):
    """Activations of ~1e5 (large weights, not a constant) feeding a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)
        with torch.no_grad():
            self.up.weight.mul_(2e4)  # absmax ~5e3: the weights fit fp16, their products don't

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


class MaskedAttention(nn.Module):
    """Scores plus (1 - mask) * -1e9, as BERT-era code builds its additive mask."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / 4.0
        scores = scores + (1.0 - mask[:, None, :]) * -1e9
        return self.out(torch.softmax(scores, dim=-1) @ v)


class RMSNormLarge(nn.Module):
    """RMSNorm written out, x.pow(2).mean(-1), on activations of a few hundred."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 8)
        self.weight = nn.Parameter(torch.ones(32))
        with torch.no_grad():
            self.up.weight.mul_(300)

    def forward(self, x):
        h = self.up(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.down(h)


class ExpOfLargeLogits(nn.Module):
    """A written-out softmax without max subtraction on logits of ~15: exp overflows fp16."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)
        with torch.no_grad():
            self.lin.weight.mul_(10)
            self.lin.bias.fill_(12.0)

    def forward(self, x):
        p = torch.exp(self.lin(x))
        return p / p.sum(-1, keepdim=True)


class TinyEpsNorm(nn.Module):
    """A hand-written LayerNorm with eps=1e-12 (BERT's) over rows that can be constant."""

    def __init__(self):
        super().__init__()
        self.lin, self.down = nn.Linear(16, 32), nn.Linear(32, 8)
        with torch.no_grad():
            self.lin.bias.fill_(0.5)  # an all-zero input row gives a constant row h

    def forward(self, x):
        h = self.lin(x)
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True)
        return self.down((h - mu) / torch.sqrt(var + 1e-12))


def mask_inputs():
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(3, 6)
    mask[0, 4:] = 0  # padding
    mask[2] = 0      # an empty (fully padded) sequence: every score of its rows is masked
    return torch.randn(3, 6, 16, generator=g), mask


def constant_rows():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, generator=g)
    x[3] = 0  # a padding row
    return (x,)


def randn(*shape, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# name -> (model class, inputs as a tuple of arguments); build the model under manual_seed(0)
TRAPS = {
    "activations 1e5 before LayerNorm": (HugeBeforeLayerNorm, lambda: (randn(4, 16, scale=10),)),
    "-1e9 attention mask": (MaskedAttention, mask_inputs),
    "RMSNorm pow(2).mean on large values": (RMSNormLarge, lambda: (randn(4, 16),)),
    "exp of large logits": (ExpOfLargeLogits, lambda: (randn(4, 16),)),
    "eps 1e-12 over constant rows": (TinyEpsNorm, constant_rows),
}


def build(name: str):
    """(model in eval mode, its inputs) for one trap."""
    cls, make = TRAPS[name]
    torch.manual_seed(0)
    return cls().eval(), make()
