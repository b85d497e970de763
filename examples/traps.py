"""Overflow traps: small models where a plain ``.half()`` gives inf/NaN or silently wrong output.

Each is a pattern users report against AMP tools: activations of ~1e5 before a LayerNorm, a -1e9
additive attention mask (with an empty, fully padded sequence), RMSNorm's ``x.pow(2).mean(-1)`` on
large activations, ``exp`` of large logits, and eps=1e-12 over constant (padding) rows. Used by
the tests and by ``examples/bench/bench_numerics.py``.

``UNDERFLOW_TRAPS`` are the other end of fp16's range: probabilities below its smallest subnormal
(6e-8) round to 0, and ``log``, a division or ``rsqrt`` of that 0 is inf/NaN where float32 is
finite (used by tests/test_numeric_safety.py; not in the benchmark table).
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


class _Logits(nn.Module):
    """A linear head with logits in the tens: probabilities far below fp16's 6e-8 (1e-21 for
    sigmoid, 1e-39 for a softmax over 1000 classes, on the trap inputs)."""

    def __init__(self, classes: int):
        super().__init__()
        self.head = nn.Linear(16, classes)
        with torch.no_grad():
            self.head.weight.mul_(20)


class SoftmaxThenLog(_Logits):
    """softmax over 1000 classes, then log: what users write instead of log_softmax."""

    def __init__(self):
        super().__init__(1000)

    def forward(self, x):
        return torch.log(torch.softmax(self.head(x), dim=-1))


class SigmoidThenLog(_Logits):
    """Multi-label log-likelihood written out: log(sigmoid(z)); sigmoid computes in fp16."""

    def __init__(self):
        super().__init__(64)

    def forward(self, x):
        return torch.log(torch.sigmoid(self.head(x)))


class WrittenSoftmaxThenLog(_Logits):
    """A written-out softmax (max subtracted, so exp stays <= 1 and runs in fp16), then log."""

    def __init__(self):
        super().__init__(1000)

    def forward(self, x):
        z = self.head(x)
        e = torch.exp(z - z.amax(-1, keepdim=True))
        return torch.log(e / e.sum(-1, keepdim=True))


class ProbabilityRatio(nn.Module):
    """An importance weight p / q of two sigmoid probabilities, both down to ~1e-10."""

    def __init__(self):
        super().__init__()
        self.p, self.q = nn.Linear(16, 32), nn.Linear(16, 32)
        with torch.no_grad():
            self.q.weight.copy_(self.p.weight)
            self.q.weight.add_(0.05 * torch.randn(32, 16))
            self.p.bias.fill_(-20.0)
            self.q.bias.fill_(-20.0)

    def forward(self, x):
        return torch.sigmoid(self.p(x)) / torch.sigmoid(self.q(x))


class InversePropensity(nn.Module):
    """Inverse-propensity weights 1/sqrt(p) of probabilities down to ~1e-9 (rsqrt stays under
    fp16's max, so calibration proves it and it would run in fp16), scaling a value head."""

    def __init__(self, op: str = "rsqrt"):
        super().__init__()
        self.op = op
        self.prop, self.value = nn.Linear(16, 32), nn.Linear(16, 32)
        with torch.no_grad():
            self.prop.bias.fill_(-18.0)

    def forward(self, x):
        p = torch.sigmoid(self.prop(x))
        w = {"rsqrt": torch.rsqrt, "reciprocal": lambda t: torch.reciprocal(torch.sqrt(t)),
             "pow": lambda t: t ** -0.5}[self.op](p)
        return self.value(x) * w


class TinyActivationRMS(nn.Module):
    """An RMS scale of activations of ~1e-4 (inputs in small units): their squares, ~1e-8, round
    to 0 in fp16 before the mean, and rsqrt(0) = inf."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 8)
        with torch.no_grad():
            self.up.bias.zero_()

    def forward(self, x):
        h = self.up(x)
        return self.down(h) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))


# name -> (model class, inputs): float32 is finite, fp16 rounds a value to 0 before an op that
# cannot take a 0
UNDERFLOW_TRAPS = {
    "softmax then log": (SoftmaxThenLog, lambda: (randn(4, 16),)),
    "sigmoid then log": (SigmoidThenLog, lambda: (randn(4, 16),)),
    "written-out softmax then log": (WrittenSoftmaxThenLog, lambda: (randn(4, 16),)),
    "ratio of two tiny probabilities": (ProbabilityRatio, lambda: (randn(4, 16),)),
    "rsqrt of a tiny probability": (InversePropensity, lambda: (randn(4, 16),)),
    "RMS of tiny activations": (TinyActivationRMS, lambda: (randn(4, 16, scale=1e-4),)),
}


def build(name: str):
    """(model in eval mode, its inputs) for one trap (overflow or underflow)."""
    cls, make = {**TRAPS, **UNDERFLOW_TRAPS}[name]
    torch.manual_seed(0)
    return cls().eval(), make()
