"""Numeric safety: overflow traps where a plain .half() breaks, calibration, tolerance search."""
import math

import pytest
import torch
import torch.nn as nn
from conftest import GPU, convert_rules, small_bert

import mpgraph
from mpgraph.tolerance import output_error
from traps import TRAPS, HugeBeforeLayerNorm, MaskedAttention, TinyEpsNorm, build, constant_rows, \
    mask_inputs

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def _seeded(cls, *args):
    torch.manual_seed(0)
    return cls(*args).eval()


def _half_error(model, inputs):
    """(finite?, relative error) of the plain .half() model against float32."""
    with torch.no_grad():
        ref = model(*inputs)
        half = model.half()(*[i.half() for i in inputs]).float()
    model.float()
    finite = bool(torch.isfinite(half).all())
    return finite, float((half - ref).norm() / ref.norm()) if finite else math.inf


@pytest.mark.parametrize("name", list(TRAPS))
def test_overflow_trap_half_breaks_mpgraph_fp16_stays_finite_and_close(name):
    model, inputs = build(name)
    finite, half_err = _half_error(model, inputs)
    assert not finite or half_err > 0.5, f"{name}: .half() survives ({half_err:.3g}); not a trap"
    # fp16 is for GPUs; the rules put every matmul low whatever its size (the cost model keeps
    # these toy matmuls fp32), so what stays fp32 here is the safety rules' doing
    gm = mpgraph.convert(model, inputs, dtype=FP16, target="a100", strategy="rules")
    with torch.no_grad():
        ref, out = model(*inputs), gm(*inputs)
    assert out.dtype == FP32 and torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < 1e-2
    # the safety findings are in the plan, with their evidence, and the matmuls that can stay
    # fp16 do
    assert gm.plan.safety_nodes, gm.plan.summary()
    assert any(r.dtype == "float16" for r in gm.plan.nodes if r.op_class == "tensor_core")


def _convert16(model, inputs, **kw):
    return mpgraph.convert(model, inputs, dtype=FP16, target="a100", strategy="rules", **kw)


def test_range_rule_pins_the_overflowing_matmul_with_its_evidence_and_keeps_the_next_fp16():
    model = _seeded(HugeBeforeLayerNorm)
    plan = _convert16(model, (10 * torch.randn(4, 16),)).plan
    up = plan.node("up")
    assert up.dtype == "float32" and up.absmax > 65504
    assert any(f.startswith("range: output up absmax") and "> limit 3.28e+04" in f
               and "on 1/1 batches" in f for f in up.safety), up.safety
    assert plan.node("down").dtype == "float16"  # after the LayerNorm, values are small again


def test_constant_rules_name_the_mask_and_the_eps():
    plan = _convert16(_seeded(MaskedAttention), mask_inputs()).plan
    assert any("constant -1e+09 overflows float16" in f for r in plan.nodes for f in r.safety)
    plan = _convert16(_seeded(TinyEpsNorm), constant_rows()).plan
    eps = [r for r in plan.nodes if any("constant 1e-12 underflows float16 to 0" in f for f in r.safety)]
    assert [r.dtype for r in eps] == ["float32"]


def test_constants_are_not_findings_in_bf16_which_has_fp32_range():
    gm = convert_rules(_seeded(MaskedAttention), mask_inputs(), dtype=BF16)
    assert not any(r.safety for r in gm.plan.nodes)


def test_calibration_with_one_outlier_batch_pins_the_node_and_counts_the_batches():
    model = _seeded(HugeBeforeLayerNorm)
    normal = [0.01 * torch.randn(4, 16) for _ in range(3)]  # up's output ~1e2: fits fp16
    plan = _convert16(model, normal[0], calibration=normal).plan
    assert plan.node("up").dtype == "float16" and plan.calibration_batches == 3
    batches = normal + [10 * torch.randn(4, 16)]              # one outlier batch
    gm = _convert16(model, normal[0], calibration=batches)
    up = gm.plan.node("up")
    assert up.dtype == "float32" and any("on 1/4 batches" in f for f in up.safety)
    with torch.no_grad():
        out, ref = gm(batches[-1]), model(batches[-1])
    assert torch.isfinite(out).all() and float((out - ref).norm() / ref.norm()) < 1e-2


def test_calibration_accepts_generators_tuples_and_dicts():
    model = _seeded(MaskedAttention)
    x, mask = mask_inputs()
    gm = _convert16(model, (x, mask), calibration=((x * s, mask) for s in (1, 2)))
    assert gm.plan.calibration_batches == 2
    gm = _convert16(model, (x, mask), calibration=[{"x": x, "mask": mask}])
    assert gm.plan.calibration_batches == 1


@pytest.mark.parametrize("calibration, message", [
    ([], "calibration is empty"),
    ([torch.randn(4, 7)], "failed after node"),             # wrong feature size
    ([torch.randn(4, 2, 16)], "does not fit the example input"),  # wrong rank
    ([torch.randn(4, 16).double()], "does not fit the example input"),
    (torch.randn(4, 16), "iterable of batches"),              # one batch, not an iterable of them
])
def test_bad_calibration_is_a_clear_error(calibration, message):
    with pytest.raises(mpgraph.CalibrationError, match=message):
        _convert16(_seeded(HugeBeforeLayerNorm), torch.randn(4, 16), calibration=calibration)


@pytest.mark.parametrize("tolerance", [0, -1e-3, float("nan"), "1e-3", True])
def test_tolerance_must_be_positive(tolerance):
    with pytest.raises(ValueError, match="tolerance must be a positive number"):
        mpgraph.convert(_seeded(HugeBeforeLayerNorm), torch.randn(4, 16), dtype=BF16,
                        tolerance=tolerance, target=GPU)


def test_tolerance_that_float32_itself_misses_is_a_clear_error():
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)).train()  # two runs never agree
    with pytest.raises(mpgraph.ToleranceError, match="cannot be met even in float32"):
        mpgraph.convert(model, torch.randn(4, 16), dtype=BF16, tolerance=1e-3, target=GPU)


def _small_bert():
    model = small_bert()
    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randint(0, 512, (2, 24), generator=g),
                "attention_mask": torch.ones(2, 24, dtype=torch.long)} for _ in range(3)]
    return model, batches


def _error(gm, model, batches):
    with torch.no_grad():
        return output_error([gm(**b) for b in batches], [model(**b) for b in batches])


# The bars (1e-3 fp16, 5e-3 bf16), and tolerances tighter than the default plan's error
# (about 2.4e-5 fp16 and 2e-4 bf16 on this random-weight BERT), which force the search to pin.
@pytest.mark.parametrize("dtype, tolerance, target, must_pin", [
    (FP16, 1e-3, "a100", False), (FP16, 1e-5, "a100", True),
    (BF16, 5e-3, "a100", False), (BF16, 5e-5, "a100", True)])
def test_tolerance_search_on_small_bert_meets_the_bar_and_reports_pins(dtype, tolerance, target,
                                                                       must_pin):
    model, batches = _small_bert()
    first = mpgraph.convert(model, example_kwargs=batches[0], dtype=dtype, target=target,
                            strategy="rules")
    start = _error(first, model, batches)
    assert (start > tolerance) == must_pin, start
    gm = mpgraph.convert(model, example_kwargs=batches[0], dtype=dtype, target=target,
                         strategy="rules", calibration=batches, tolerance=tolerance)
    report = gm.plan.tolerance
    measured = _error(gm, model, batches)
    assert measured <= tolerance and report["error"] == pytest.approx(measured, rel=1e-6)
    if start > tolerance:  # the search had work to do: it pinned nodes and says which
        assert report["pinned"] and report["rounds"] >= 1
        for name, added in report["pinned"]:
            assert gm.plan.node(name).dtype == "float32" and added >= 0
    else:
        assert not report["pinned"] and len(gm.plan.low_nodes) == len(first.plan.low_nodes)


def test_auto_on_a100_uses_bf16_where_fp16_overflows_and_fp16_elsewhere(tmp_path):
    model, inputs = build("activations 1e5 before LayerNorm")
    gm = mpgraph.convert(model, inputs, dtype="auto", target="a100", strategy="rules")
    plan = gm.plan
    assert plan.dtype == FP16
    assert [(r.name, r.dtype) for r in plan.range_nodes] == [("up", "bfloat16")]
    assert "bfloat16 has the range" in plan.node("up").reason
    assert plan.node("down").dtype == "float16" and plan.node("norm").dtype == "float32"
    stored = {w.name: w.dtype for w in plan.weights}
    assert stored == {"up.weight": BF16, "up.bias": BF16, "down.weight": FP16, "down.bias": FP16}
    assert "1 nodes in bfloat16 where float16 overflows" in plan.summary()
    with torch.no_grad():
        out, ref = gm(*inputs), model(*inputs)
    assert torch.isfinite(out).all() and float((out - ref).norm() / ref.norm()) < 1e-2
    # ONNX export takes one low dtype: a mixed plan is refused with the way out
    with pytest.raises(mpgraph.ExportError, match="convert with dtype='fp16' or 'bf16'"):
        mpgraph.export_onnx(gm, inputs, str(tmp_path / "x.onnx"))
    assert not list(tmp_path.iterdir())


def test_auto_bf16_region_that_misses_the_tolerance_goes_back_to_fp32():
    model, inputs = build("exp of large logits")  # exp of ~15 in bf16: 1.3e-2 off
    loose = mpgraph.convert(model, inputs, dtype="auto", target="a100", strategy="rules")
    assert loose.plan.node("exp").dtype == "bfloat16"
    tight = mpgraph.convert(model, inputs, dtype="auto", target="a100", strategy="rules",
                            tolerance=1e-3)
    assert tight.plan.node("exp").dtype == "float32"
    assert "exp" in dict(tight.plan.tolerance["pinned"]) and tight.plan.tolerance["error"] <= 1e-3
