"""The semantics battery: small models whose conversion used to compute something else.

In-place ops on low-precision values, buffer updates an fx trace drops, functional dropout read
from ``self.training``, structured outputs, an in-place -1e9 mask in fp16, a model that writes its
input. Each is converted for an A100 with the rules strategy (every matmul low, so the toy models
exercise the semantics, not the cost model) and run here against float32: the relative L2 error
of the first output, whether the output type and the buffers are the model's, and whether the
caller's example tensor is unchanged. ``tests/test_semantics.py`` asserts the same.

    python examples/semantics_battery.py
"""
from __future__ import annotations

import copy
import warnings
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpgraph
from mpgraph.numerics import relative_l2

D = 256


class InplaceRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.l1(x)
        torch.relu_(h)
        return self.l2(h)


class MaskThenRelu(InplaceRelu):
    def forward(self, x):
        h = self.l1(x)
        h.masked_fill_(x < 0, -1e9)
        h.relu_()
        return self.l2(h)


class InplaceMaskSoftmax(InplaceRelu):
    """An in-place -1e9 mask: fp16 cannot hold it, float32 must (the out-of-place rule)."""

    def forward(self, x):
        h = self.l1(x)
        h.masked_fill_(x < 0, -1e9)
        return self.l2(torch.softmax(h, -1))


class CountingBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(D, D)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.l(x) + self.n


class RunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(D, D)
        self.register_buffer("m", torch.zeros(D))

    def forward(self, x):
        y = self.l(x)
        self.m.mul_(0.9).add_(y.mean(0).detach())
        return y + self.m


class FunctionalDropout(InplaceRelu):
    def forward(self, x):
        return self.l2(F.dropout(self.l1(x), 0.5, self.training))


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(D, D)

    def forward(self, x):
        x.mul_(2)
        return self.l(x)


Pair = namedtuple("Pair", "hidden total")


class NamedTupleOut(WritesItsInput):
    def forward(self, x):
        y = self.l(x)
        return Pair(y, y.sum())


class ModelOutputOut(WritesItsInput):
    def forward(self, x):
        from transformers.modeling_outputs import BaseModelOutput
        return BaseModelOutput(last_hidden_state=self.l(x))


# (model, dtype, converted in training mode): each must come out right within the dtype's TOL
BATTERY = {
    "in-place relu_ on a low value": (InplaceRelu, "bf16", False),
    "masked_fill_ then relu_": (MaskThenRelu, "bf16", False),
    "in-place -1e9 mask in fp16": (InplaceMaskSoftmax, "fp16", False),
    "buffer += 1 (fx drops it)": (CountingBuffer, "bf16", False),
    "buffer mul_().add_()": (RunningMean, "bf16", False),
    "F.dropout(h, p, self.training)": (FunctionalDropout, "bf16", True),
    "model writes its input": (WritesItsInput, "bf16", False),
    "namedtuple output": (NamedTupleOut, "bf16", False),
    "ModelOutput output": (ModelOutputOut, "bf16", False),
}


def first(out):
    """The first output tensor of a model's output structure."""
    return out[0] if isinstance(out, tuple) else out.last_hidden_state if hasattr(
        out, "last_hidden_state") else out


def run(name: str) -> dict:
    """Convert one battery model, run it against float32; what the table prints."""
    make, low, training = BATTERY[name]
    torch.manual_seed(0)
    model = make().train(training)
    x = torch.randn(8, D)
    before = x.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = mpgraph.convert(model, x, dtype=low, target="a100", strategy="rules")
    untouched = torch.equal(x, before)
    gm.eval(), model.eval()
    reference = copy.deepcopy(model)
    a, b = before.clone(), before.clone()
    with torch.no_grad():
        want, got = reference(a), gm(b)
    r, o = first(want).float(), first(got).float()
    buffers = dict(gm.named_buffers())
    return {"route": gm.plan.capture, "error": relative_l2(o, r),
            "low_nodes": len(gm.plan.low_nodes), "summary": gm.plan.summary(),
            "check": gm.plan.check, "same_type": type(got) is type(want),
            "inputs_written_alike": torch.equal(a, b),
            "buffers_same": all(torch.allclose(buffers[k].float(), v.float(), rtol=1e-2, atol=1e-3)
                                for k, v in reference.named_buffers()),
            "input_untouched": untouched,
            "warnings": [str(w.message).split(":")[0][:60] for w in caught],
            "trained_warnings": sum("is in training mode" in str(w.message) for w in caught)}


def main() -> None:
    print("| case | dtype | route | rel. L2 vs fp32 | output type kept | buffers kept | "
          "caller's input unchanged | warnings |")
    print("|---|---|---|---:|---|---|---|---|")
    for name, (_, low, _) in BATTERY.items():
        r = run(name)
        print(f"| {name} | {low} | {r['route']} | {r['error']:.2e} | {r['same_type']} | "
              f"{r['buffers_same']} | {r['input_untouched']} | {'; '.join(r['warnings']) or '-'} |")


if __name__ == "__main__":
    main()
