import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpgraph
from mpgraph.passes import FuseTanhGelu

from conftest import convert_rules, casts, rel_err

convert = convert_rules  # these tests pin the rules, planned for conftest.GPU


class GeluNew(nn.Module):
    """GPT-2's written-out GELU between two matmuls."""

    def __init__(self, c1=math.sqrt(2.0 / math.pi), c2=0.044715, leak=False):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.c1, self.c2, self.leak = c1, c2, leak

    def forward(self, x):
        h = self.up(x)
        cube = torch.pow(h, 3.0)
        g = 0.5 * h * (1.0 + torch.tanh(self.c1 * (h + self.c2 * cube)))
        out = self.down(g)
        return out + cube.sum() if self.leak else out


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_fuses_the_symbolic_graph_and_keeps_the_function():
    model, x = GeluNew().eval(), torch.randn(4, 8)
    gm = mpgraph.capture(model, x)
    assert FuseTanhGelu()(gm).modified is True
    assert F.gelu in _targets(gm) and torch.tanh not in _targets(gm) and torch.pow not in _targets(gm)
    gm.graph.lint()
    torch.testing.assert_close(gm(x), model(x), atol=1e-6, rtol=1e-5)
    assert FuseTanhGelu()(gm).modified is False  # idempotent


def test_fused_gelu_runs_low_in_fp16_with_only_io_casts():
    model, x = GeluNew().eval(), torch.randn(4, 8)
    gm = convert(model, x, dtype=torch.float16)
    assert len(casts(gm)) == 2
    gelu = next(r for r in gm.plan.nodes if r.target == "gelu")
    assert gelu.dtype == "float16" and gelu.op_class == "follow"
    assert rel_err(gm(x), model(x)) < 4e-3


def test_fuses_gpt2_at_aten_level(gpt2, token_ids):
    ids, mask = token_ids
    gm = mpgraph.capture(gpt2, (ids,), {"attention_mask": mask})
    FuseTanhGelu()(gm)
    targets = _targets(gm)
    assert targets.count(torch.ops.aten.gelu.default) == gpt2.config.n_layer
    assert torch.ops.aten.tanh.default not in targets
    torch.testing.assert_close(gm(ids, attention_mask=mask).last_hidden_state,
                               gpt2(ids, attention_mask=mask).last_hidden_state, atol=1e-5, rtol=1e-4)


def test_near_misses_are_left_alone():
    x = torch.randn(4, 8)
    for model in (GeluNew(c1=0.8), GeluNew(c2=0.05), GeluNew(leak=True)):  # other constants; x**3 reused
        gm = mpgraph.capture(model.eval(), x)
        assert FuseTanhGelu()(gm).modified is False
        assert torch.tanh in _targets(gm)
