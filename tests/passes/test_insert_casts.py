import torch
import torch.nn as nn

from mpgraph.ir.meta import INSERTED_BY
from mpgraph.numerics import relative_l2
from mpgraph.passes import InsertCasts

from conftest import convert_rules, MLP, ConvBnReluPool, SharedInput, casts

convert = convert_rules  # these tests pin the rules, planned for conftest.GPU

BF16, FP16 = torch.bfloat16, torch.float16


def _casts(gm):
    return [(c.args[0].name, c.args[1]) for c in casts(gm)]


def test_mlp_needs_exactly_the_io_casts():
    gm = convert(MLP(), torch.randn(4, 16), dtype=FP16)
    assert _casts(gm) == [("x", FP16), ("fc2", torch.float32)]


def test_conv_bn_relu_pool_cast_placement():
    # eval-mode batch norm is a per-channel affine map: the whole net runs low, casts only at I/O
    gm = convert(ConvBnReluPool().eval(), torch.randn(2, 3, 16, 16), dtype=BF16)
    assert _casts(gm) == [("x", BF16), ("fc", torch.float32)]
    assert gm.plan.node("bn").dtype == "bfloat16" and gm.plan.node("bn").op_class == "follow"
    # in training mode it accumulates batch statistics in fp32 inside, with fp32 parameters and
    # running statistics, reading and writing bf16 (Apex O2's keep_batchnorm_fp32): no casts
    model = ConvBnReluPool().train()
    gm = convert(model, torch.randn(2, 3, 16, 16), dtype=BF16)
    assert _casts(gm) == [("x", BF16), ("fc", torch.float32)]
    bn = gm.plan.node("bn")
    assert bn.dtype == "bfloat16" and bn.op_class == "fp32_compute" and "float32 inside" in bn.reason
    assert gm.bn.weight.dtype == gm.bn.running_mean.dtype == torch.float32
    x = torch.randn(2, 3, 16, 16)
    before = gm.bn.running_mean.clone()
    reference = model(x)
    out = gm(x)
    assert not torch.equal(before, gm.bn.running_mean)  # statistics updated, in float32
    assert torch.allclose(gm.bn.running_mean, model.bn.running_mean, atol=1e-2)
    assert relative_l2(out, reference) < 2e-2


def test_one_cast_per_value_shared_by_all_readers():
    gm = convert(SharedInput(), torch.randn(3, 8), dtype=FP16)
    [x_cast, out_cast] = casts(gm)
    assert x_cast.args[0].name == "x"
    assert sorted(u.name for u in x_cast.users) == ["k", "q", "v"]
    assert out_cast.args[0].name == "add_1"


def test_no_cast_when_nothing_goes_low():
    model = nn.Sequential(nn.LayerNorm(8), nn.Softmax(-1))
    gm = convert(model, torch.randn(2, 8), dtype=FP16)
    assert casts(gm) == [] and gm.plan.casts == []


def test_second_run_changes_nothing():
    gm = convert(ConvBnReluPool().eval(), torch.randn(2, 3, 16, 16), dtype=BF16)
    code = gm.code
    result = InsertCasts()(gm)
    assert result.modified is False and gm.code == code


def test_casts_record_their_pass_and_keep_io_types_false_leaves_outputs_low():
    gm = convert(MLP(), torch.randn(4, 16), dtype=BF16, keep_io_types=False)
    assert all(c.meta[INSERTED_BY] == "InsertCasts" for c in casts(gm))
    assert _casts(gm) == [("x", BF16)]
    assert gm(torch.randn(4, 16)).dtype == BF16


class MutatedAfterRead(nn.Module):
    """x is read in fp32 by a linear, then written in place (through a view, so Functionalize
    leaves the write as it is), then read again."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = x * 1.0
        first = self.a(x)
        x.t().mul_(2.0)
        return first + self.b(x)


def test_values_written_in_place_get_a_fresh_cast_per_reader():
    model = MutatedAfterRead().eval()
    x = torch.randn(3, 4)
    gm = convert(model, x, dtype=BF16)
    to_low = [c for c in casts(gm) if c.args[0].name == "mul" and c.args[1] == BF16]
    assert len(to_low) == 2  # shared would read the value before mul_ wrote it
    torch.testing.assert_close(gm(x.clone()), model(x.clone()), atol=5e-2, rtol=5e-2)
