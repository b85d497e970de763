"""What README's "What is guaranteed" promises, one user scenario each (issue 25): the number the
check reports is the number the user computes, float32-sensitive state stays float32, and what
cannot convert right raises an error that names the construct and the way out."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpgraph
from mpgraph.numerics import output_errors, relative_l2

from conftest import GPU


class ResidualMLP(nn.Module):
    """Its output is the small difference between a block's output and its input."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.b(F.gelu(self.a(x))) - x


def test_the_check_reports_the_relative_l2_the_user_computes_on_the_same_inputs():
    torch.manual_seed(0)
    model, x = ResidualMLP().eval(), torch.randn(8, 64)
    for dtype in ("fp16", "bf16"):
        fast = mpgraph.convert(model, x, dtype=dtype, target=GPU, strategy="rules")
        with torch.no_grad():
            mine = relative_l2(fast(x), model(x))
        # (the check computes an A100 plan as the GPU would: its rounding, float32 arithmetic;
        # this CPU's own fp16/bf16 kernels round the same values within a few percent)
        assert fast.plan.check["error"] == pytest.approx(mine, rel=0.05)
        assert fast.plan.check["outputs"] == [fast.plan.check["error"]]
        assert f"checked: error {fast.plan.check['error']:.2g}" in fast.plan.summary()


def test_the_check_takes_the_worst_output_not_an_average_over_outputs(bert):
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    fast = mpgraph.convert(bert, ids, dtype="fp16", target=GPU, strategy="rules")
    with torch.no_grad():
        out, ref = fast(ids), bert(ids)
    each = [relative_l2(out.last_hidden_state, ref.last_hidden_state),
            relative_l2(out.pooler_output, ref.pooler_output)]
    assert each == output_errors(out, ref)
    assert fast.plan.check["outputs"] == pytest.approx(each, rel=0.05)
    assert each[1] > 3 * each[0]  # the pooler's error: what an average would hide
    assert fast.plan.check["error"] == max(fast.plan.check["outputs"])
