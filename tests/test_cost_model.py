"""Device specs, the roofline estimate, the cost-optimal decision and the Tensor Core lint."""
import dataclasses
import json
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn

import mpgraph
from mpgraph.api import little_converted
from mpgraph.cost.device import (auto_dtype, cpu_flags, measure_cpu, range_dtype, resolve_target,
                            target_names)
from mpgraph.cost.measured import emulated
from mpgraph.cost.roofline import GPU_KERNEL_S
from mpgraph.cost.specs import GPU_SPECS, DeviceSpec
from mpgraph.cost.roofline import GPU_HOST_S, Roofline
from mpgraph.ir.meta import COST, dtype_name

from conftest import SharedInput, casts

H100 = "h100"


def test_device_table_sanity():
    for key, spec in GPU_SPECS.items():
        assert spec.kind == "gpu" and spec.source, key
        assert all(v > 0 for v in spec.peak.values()), key
        assert spec.bandwidth > 0 and spec.sms > 0 and spec.launch > 0, key
        assert spec.peak["fp16"] >= spec.peak["fp32"], key  # Tensor Cores
        if "tf32" in spec.peak:
            assert spec.peak["fp32"] <= spec.peak["tf32"] <= spec.peak["fp16"], key
    assert GPU_SPECS["h200"].bandwidth > GPU_SPECS["h100-sxm"].bandwidth
    assert "bf16" not in GPU_SPECS["t4"].peak and "bf16" not in GPU_SPECS["v100"].peak


def test_named_targets_and_bad_names():
    assert resolve_target("h100") is GPU_SPECS["h100-sxm"]
    assert resolve_target("A100") is GPU_SPECS["a100-80gb"]
    assert resolve_target("cpu").kind == "cpu"
    with pytest.raises(ValueError, match="unknown target 'b200'.*h100"):
        resolve_target("b200")
    assert {"cpu", "h100", "a100", "t4"} <= set(target_names())


def test_cpu_micro_benchmark_times_cpu_float32_whatever_the_caller_s_defaults(monkeypatch,
                                                                             tmp_path):
    """The benchmark is cached for good: a first conversion inside ``with torch.device("meta")``
    cached meta "peaks" (136 TFLOP/s, 55 TB/s) and a default float64 halved the bandwidth. What
    it times is CPU tensors in float32 (or the timed dtype) in any context, and figures no CPU
    has (a poisoned file) are measured again, never cached."""
    from mpgraph.cost import device
    timed = []

    precisions = []

    def best_time(fn, repeats):  # what each timed call computes (one matmul size a dtype)
        timed.append(fn())
        precisions.append(torch.get_float32_matmul_precision())
        return 1.0
    monkeypatch.setattr(device, "_best_time", best_time)
    default, precision = torch.get_default_dtype(), torch.get_float32_matmul_precision()
    try:
        torch.set_default_dtype(torch.float64)
        # ("medium" lets oneDNN run float32 matmuls in bf16: not float32's rate)
        torch.set_float32_matmul_precision("medium")
        with torch.device("meta"):
            data = device._measure_cpu()
        assert torch.get_float32_matmul_precision() == "medium"  # the caller's, put back
    finally:
        torch.set_default_dtype(default)
        torch.set_float32_matmul_precision(precision)
    rates = 3 * device.ROUNDS  # (interleaved rounds, the best of each dtype kept)
    assert precisions[:rates] == ["highest"] * rates
    tensors = [t for r in timed for t in (r if isinstance(r, list) else [r])]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert [t.dtype for t in timed[:rates]] == [torch.float32, torch.bfloat16,
                                                torch.float16] * device.ROUNDS
    assert all(t.dtype == torch.float32 for t in tensors[rates:])
    assert data["bandwidth"] == 2 * 16 * 1024 * 1024 * 4 / 1.0
    # a cache file with a rate no CPU has, or damaged values, is measured again and rewritten
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = device.measure_cpu()
    path = next((tmp_path / "mpgraph").glob("cpu-*.json"))
    threads = torch.get_num_threads()
    torch.set_num_threads(16)  # (meta "ran" at 136 TFLOP/s whatever the thread count)
    try:
        assert not device._plausible({"peak": {"fp32": 1.36e14, "bf16": 1.4e14, "fp16": 1.4e14,
                                               "vector": 1e12}, "bandwidth": 5.5e13,
                                      "launch": 1e-6})
    finally:
        torch.set_num_threads(threads)
    for bad in ({"fp32": 1.36e14, "bf16": 1.4e14, "fp16": 1.4e14, "vector": 1e12},
                {"fp32": "x", "bf16": 1e9, "fp16": 1e9, "vector": 1e9}, None):
        held = json.loads(path.read_text())
        path.write_text(json.dumps({**held, "peak": bad}))
        assert device.measure_cpu().peak == spec.peak
        assert json.loads(path.read_text())["peak"] == spec.peak
    path.write_text(json.dumps({**held, "bandwidth": 0}))
    assert device.measure_cpu().bandwidth == spec.bandwidth
    # a fast CPU's figures are kept (a matrix unit's float32 on one thread: 5 TFLOP/s)
    fast = {"fp32": 5e12, "bf16": 2e13, "fp16": 2e13, "vector": 1e11}
    path.write_text(json.dumps({**held, "peak": fast}))
    assert device.measure_cpu().peak == fast
    # figures no CPU has (a context the benchmark did not pin) are planned with but not cached
    path.unlink()
    monkeypatch.setattr(device, "_best_time", lambda fn, repeats: 1e-9)
    device.measure_cpu()
    assert not path.exists()


@pytest.mark.this_cpu
def test_cpu_measurement_here_and_the_dtype_the_plan_picks_from_it():
    """About this machine, whatever CPU the suite lands on (AVX2 only: bf16 ~1% of fp32;
    AVX512-BF16/AMX: several times fp32): the default dtype is picked from this CPU's own
    measured op times, a low node is one measured faster than float32 with its casts, and a
    dtype this CPU emulates is never chosen for a node."""
    spec = measure_cpu()
    assert spec.kind == "cpu" and spec.source.startswith("measured")
    fp32, bf16, fp16 = spec.peak["fp32"], spec.peak["bf16"], spec.peak["fp16"]
    assert min(fp32, bf16, fp16, spec.peak["vector"], spec.bandwidth, spec.launch) > 0
    gm = mpgraph.convert(nn.Sequential(nn.Linear(512, 512)), torch.randn(512, 512))
    plan = gm.plan
    assert plan.estimate["source"].startswith("measured on this CPU, op by op")
    # each low dtype this CPU runs natively was estimated; none where it emulates both (an
    # AVX2-only CPU, or ONEDNN_MAX_CPU_ISA=AVX2), and then the plan says so
    native = {dtype_name(d) for d in (torch.float16, torch.bfloat16) if not emulated(d, spec)}
    assert set(plan.dtype_choice["estimates_s"]) == native
    if not native:
        assert "it emulates both" in plan.kept_fp32
    rec = plan.node("_0")
    if rec.dtype == "float32":
        assert plan.kept_fp32.startswith(("no node is faster in float16 or bfloat16",
                                          "no placement in "))  # (faster alone: the casts)
    else:
        assert rec.dtype == dtype_name(plan.dtype) and rec.t_low < rec.t_fp32
    if not cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        assert rec.dtype == "float32"  # no bf16 instructions: emulated, never faster


def test_auto_dtype_per_target():
    assert auto_dtype(GPU_SPECS["t4"])[0] == torch.float16
    assert auto_dtype(GPU_SPECS["v100"])[0] == torch.float16
    # Ampere and later run fp16 and bf16 alike: fp16, with bf16 where fp16's range fails
    for name in ("a100-80gb", "h100-sxm", "h200", "l4"):
        assert auto_dtype(GPU_SPECS[name])[0] == torch.float16
        assert range_dtype(GPU_SPECS[name], torch.float16) == torch.bfloat16
    assert range_dtype(GPU_SPECS["t4"], torch.float16) is None  # no bf16 on Turing
    slow = DeviceSpec("old CPU", "cpu", {"fp32": 100e9, "bf16": 20e9, "fp16": 1e9}, 20e9, 4, 1e-6)
    assert auto_dtype(slow)[0] is None


def test_auto_keeps_fp32_where_low_precision_is_slower_and_says_so():
    slow = DeviceSpec("old CPU", "cpu", {"fp32": 100e9, "bf16": 20e9, "fp16": 1e9}, 20e9, 4, 1e-6)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    gm = mpgraph.convert(model, torch.randn(32, 64), dtype="auto", target=slow)
    assert gm.plan.low_nodes == [] and gm.plan.casts == []
    assert "kept float32: no node is faster in float16 or bfloat16 than in float32 on old CPU" \
        in gm.plan.summary()
    gm = mpgraph.convert(model, torch.randn(32, 64), dtype="auto", target="t4", strategy="rules")
    assert gm.plan.dtype == torch.float16


SLOW_CPU = DeviceSpec("AVX2-only CPU", "cpu", {"fp32": 89e9, "bf16": 0.97e9, "fp16": 0.9e9},
                     20e9, 2, 2e-6, tile=1, source="measured on this CPU, flags avx2")


def test_explicit_dtype_that_converts_little_says_why_once_with_the_way_out():
    """On a CPU whose fp16 matmuls run at 1% of fp32 (the AVX2-only machines: figures from
    mpgraph's own measurement there), dtype=float16 keeps every matmul float32: a UserWarning and
    the summary's first line say so, why, and what to do instead."""
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x = torch.randn(64, 256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = mpgraph.convert(model, x, dtype=torch.float16, target=SLOW_CPU)
    ours = [w for w in caught if "matmul/conv nodes" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is UserWarning
    text = str(ours[0].message)
    assert text.startswith("dtype=float16 converted 0 of 2 matmul/conv nodes (0% of their FLOPs) "
                           "for AVX2-only CPU")
    assert ("2 are not faster in float16 there: estimated by the roofline at their sizes; this "
            "CPU's peak float16 matmul rate is 0.01x float32's (large matrices") in text
    # priced by this CPU's own timings, or not timed at all where it emulates the dtype (inf):
    # the sentence says which (it said 'measured' of both, and of the roofline's figures)
    measured = dataclasses.replace(gm.plan, estimate={**gm.plan.estimate,
                                                      "source": "measured on this CPU, op by op"})
    assert "not faster in float16 there: measured at their sizes; this CPU's peak" \
        in little_converted(measured, SLOW_CPU)
    emulated = dataclasses.replace(measured, nodes=[
        dataclasses.replace(r, t_low=math.inf) if r.op_class == "tensor_core" else r
        for r in measured.nodes])
    assert "not faster in float16 there: this CPU emulates float16, not timed; this CPU's peak" \
        in little_converted(emulated, SLOW_CPU)
    # 'though' contrasts a peak that promises a gain with sizes that did not get it (an AMX CPU's
    # small matmuls); above, where the low peak is the slower one, the sentence is no contrast
    amx = DeviceSpec("AMX CPU", "cpu", {"fp32": 390e9, "bf16": 1600e9, "fp16": 1560e9}, 20e9, 2,
                     2e-6, tile=1, source="measured on this CPU, flags amx_fp16")
    assert ("2 are not faster in float16 there: measured at their sizes, though this CPU's peak "
            "float16 matmul rate is 4.00x float32's (large matrices") in little_converted(measured, amx)
    assert "target='h100'" in text and "strategy='rules'" in text
    assert gm.plan.warning == text and gm.plan.low_nodes == []
    assert gm.plan.summary().splitlines()[0] == f"warning: {text}"
    assert mpgraph.Plan.from_dict(gm.plan.to_dict()).warning == text
    # the ways out it names: a GPU target, or the rules; and dtype="auto" explains itself instead
    for options in ({"target": "h100"}, {"target": SLOW_CPU, "strategy": "rules"},
                    {"target": SLOW_CPU, "dtype": "auto"}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gm = mpgraph.convert(model, x, **{"dtype": torch.float16, **options})
        assert not [w for w in caught if "matmul/conv nodes" in str(w.message)], options
        assert gm.plan.warning is None
    assert gm.plan.kept_fp32 and "kept float32" in gm.plan.summary()


def _three_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 64)).eval(), torch.randn(8, 64)


def _little(**options) -> tuple:
    model, x = _three_linears()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = mpgraph.convert(model, (x,), dtype="fp16", target="a100", **options).plan
    said = [str(w.message) for w in caught if "matmul/conv nodes" in str(w.message)]
    assert said == ([plan.warning] if plan.warning else [])
    return said, plan


def test_converting_little_names_what_the_overrides_keep_apart_from_what_cost_kept():
    """Before: "converted 0 of 3 ...: 1 are too small to pay for their casts. To put every
    matmul/conv in float16 whatever it costs there, strategy='rules'", the 2 the user's
    overrides kept float32 unmentioned and blamed on cost."""
    said, plan = _little(overrides={"2": "fp32", "4": "fp32"})
    assert said == ["dtype=float16 converted 0 of 3 matmul/conv nodes (0% of their FLOPs) for "
                    "NVIDIA A100 80GB SXM: your overrides keep 2 float32 (_2, _4); of the other "
                    "1, 1 are too small to pay for their casts. To put the 1 the cost model kept "
                    "in float16 whatever it costs there, strategy='rules'."]
    # half the rest converted: nothing to warn of (before: "converted 1 of 3 ... (25% of their
    # FLOPs)", the share counting the FLOPs the override kept)
    said, plan = _little(overrides={"2": "fp32"})
    assert said == [] and plan.node("_4").dtype == "float16"


def test_converting_little_names_the_tolerance_pins_and_points_to_a_looser_tolerance():
    """Before: the warning blamed cost for the search's pins ("... too small to pay for their
    casts") and named strategy='rules' alone as the way out."""
    _, plan = _little(overrides={"2": "fp32", "4": "fp32"})  # _0 kept float32 by its casts
    said = "pinned to float32 by the tolerance search (attributed error 2e-04)"
    pinned = dataclasses.replace(plan, tolerance={"tolerance": 1e-7, "pinned": []}, nodes=[
        dataclasses.replace(r, reason=said) if r.name in ("_2", "_4") else r
        for r in plan.nodes])
    assert little_converted(pinned, GPU_SPECS["a100-80gb"]) == (
        "dtype=float16 converted 0 of 3 matmul/conv nodes (0% of their FLOPs) for NVIDIA A100 "
        "80GB SXM: the tolerance search pinned 2 to float32 (_2, _4); of the other 1, 1 are too "
        "small to pay for their casts. To put the 1 the cost model kept in float16 whatever it "
        "costs there, strategy='rules'; a looser tolerance than 1e-07 pins fewer.")
    # the search's own pins, as convert words them (which and how many: its attribution's)
    said, plan = _little(tolerance=1e-7)
    pins = [r.name for r in plan.compute_nodes if r.op_class == "tensor_core"
            and r.reason.startswith("pinned to float32 by the tolerance search")]
    assert pins and sorted(pins) == sorted(name for name, _ in plan.tolerance["pinned"])
    assert said or len(pins) == 3  # (a warning where a matmul is left to the cost model)
    for text in said:
        assert f"the tolerance search pinned {len(pins)} to float32 ({', '.join(pins)}); " \
               f"of the other {3 - len(pins)}, " in text and "every matmul/conv" not in text


def _sandwich(n):
    return nn.Sequential(nn.LayerNorm(n), nn.Linear(n, n), nn.LayerNorm(n)).eval()


def test_bf16_for_a_gpu_without_bf16_tensor_cores_says_so_and_points_to_fp16():
    """dtype='bf16' for a T4 or V100 said '1 are not faster in bfloat16 there' and pointed to
    strategy='rules' (forcing bf16 on a GPU that has no bf16 Tensor Cores)."""
    model = nn.Sequential(nn.Linear(256, 256)).eval()
    for target, name in (("t4", "NVIDIA T4"), ("v100", "NVIDIA V100")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = mpgraph.convert(model, (torch.randn(64, 256),), target=target, dtype="bf16").plan
        text = plan.warning
        assert [str(w.message) for w in caught if "matmul/conv nodes" in str(w.message)] == [text]
        assert re.search(f"1 are not faster in bfloat16 there: {name}[^:]* has no bfloat16 "
                         "Tensor Cores. Use dtype='fp16', which its Tensor Cores run.$", text)
        assert "strategy='rules'" not in text


def test_small_matmul_stays_fp32_and_large_goes_fp16_on_h100():
    small = mpgraph.convert(_sandwich(8), torch.randn(8, 8), dtype="fp16", target=H100)
    rec = small.plan.node("_1")
    assert rec.dtype == "float32" and small.plan.casts == []
    assert rec.t_low == rec.t_fp32 == 7e-6  # eager: the host's time either way
    graphs = mpgraph.convert(_sandwich(8), torch.randn(8, 8), dtype="fp16", target=H100,
                             runtime="graphs")  # replayed: the kernel's time only
    rec = graphs.plan.node("_1")
    assert rec.t_low == rec.t_fp32 == GPU_KERNEL_S  # replayed: a kernel's least time either way
    big = mpgraph.convert(_sandwich(4096), torch.randn(256, 4096), dtype="fp16", target=H100,
                          check=False)  # fp16 matmuls are very slow on this CPU: plan only
    rec = big.plan.node("_1")
    assert rec.dtype == "float16" and rec.t_low < rec.t_fp32 / 5
    assert len(big.plan.casts) == 2


def test_isolated_relu_between_fp32_ops_is_never_wrapped_in_casts():
    model = nn.Sequential(nn.LayerNorm(512), nn.ReLU(), nn.LayerNorm(512)).eval()
    for target in (H100, "cpu", "t4"):
        gm = mpgraph.convert(model, torch.randn(64, 512), dtype="fp16", target=target, check=False)
        assert gm.plan.node("_1").dtype == "float32" and gm.plan.casts == [], target


def test_shared_value_read_by_three_low_matmuls_gets_one_cast():
    class Wide(SharedInput):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 2048)

    gm = mpgraph.convert(Wide().eval(), torch.randn(512, 2048), dtype="fp16", target=H100, check=False)
    assert {gm.plan.node(n).dtype for n in ("q", "k", "v")} == {"float16"}
    x_casts = [c for c in casts(gm) if c.args[0].name == "x"]
    assert len(x_casts) == 1 and len(x_casts[0].users) == 3


def test_misaligned_linear_is_flagged_with_its_padding():
    gm = mpgraph.convert(nn.Sequential(nn.Linear(1023, 4095)), torch.randn(2048, 1023),
                         dtype="fp16", target=H100, check=False)
    finding = gm.plan.node("_0").tensor_core
    assert finding.startswith("eligible but misaligned")
    assert "N 4095->4096" in finding and "K 1023->1024" in finding
    # no gain promised that the plan's own estimate would not show after the padding (it said
    # "4.16x the whole plan" where the padded plan's estimate did not move)
    assert "no gain is estimated" in finding and "x the whole plan" not in finding
    padded = mpgraph.convert(nn.Sequential(nn.Linear(1024, 4096)), torch.randn(2048, 1024),
                             dtype="fp16", target=H100, check=False)
    assert padded.plan.estimate["plan_s"] == pytest.approx(gm.plan.estimate["plan_s"], rel=0.02)
    tiny = mpgraph.convert(nn.Sequential(nn.Linear(30, 30)), torch.randn(4, 30), dtype="fp16",
                           target=H100, strategy="rules", check=False)
    assert "no time saved at this size on NVIDIA H100 SXM (the node costs the host's 7 us" \
        in tiny.plan.node("_0").tensor_core  # (was "est. 8.0x faster": M 4->8)
    assert "1 matmul misaligned for Tensor Cores" in gm.plan.summary()
    aligned = mpgraph.convert(nn.Sequential(nn.Linear(1024, 4096)), torch.randn(64, 1024),
                              dtype="fp16", target=H100, check=False)
    assert aligned.plan.node("_0").tensor_core.startswith("aligned")


def test_matmul_dims_take_k_from_the_product_not_a_bias_nor_a_last_dim():
    """K was the first tensor argument's last dim: baddbmm/addbmm's bias (K=12 linted 'aligned',
    FLOPs from K=16) and an einsum operand whose contracted dim is not last ('pad K 12->16' for a
    K of 16)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(4, 16, 16))
            self.bias2 = nn.Parameter(torch.zeros(16, 16))

        def forward(self, q):                                    # q [4, 16, 12]
            sc = torch.baddbmm(self.bias, q, q.transpose(1, 2))  # M=16 N=16 K=12, 4 GEMMs
            acc = torch.addbmm(self.bias2, q, q.transpose(1, 2))  # the same 4, summed
            g = torch.einsum("bki,bkj->bij", q, q)                # M=12 N=12 K=16
            e = torch.einsum("...ki,...kj->...ij", q, q)          # the same, by an ellipsis
            return sc.sum() + acc.sum() + g.sum() + e.sum()

    plan = mpgraph.convert(M().eval(), (torch.randn(4, 16, 12),), dtype="fp16", target="a100",
                           strategy="rules", check=False).plan
    for name in ("baddbmm", "addbmm"):
        r = plan.node(name)
        assert r.tensor_core.startswith("eligible but misaligned: pad K 12->16 ("), name
        assert r.flops == 2 * 4 * 16 * 16 * 12, name
    for name in ("einsum", "einsum_1"):
        r = plan.node(name)
        assert r.tensor_core.startswith("eligible but misaligned: pad M 12->16, N 12->16 ("), name
        assert r.flops == 2 * 4 * 12 * 12 * 16, name


class _Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.up3 = nn.ConvTranspose2d(64, 3, 4, stride=2, padding=1)  # out_channels misaligned
        self.dn3 = nn.ConvTranspose2d(3, 48, 3, padding=1)            # in_channels misaligned
        self.g12 = nn.Conv2d(48, 48, 3, padding=1, groups=4)          # 12 channels per group
        self.dw = nn.Conv2d(48, 48, 3, padding=1, groups=48)          # depthwise
        self.gc = nn.Conv2d(48, 64, 3, padding=1, groups=16)          # 3 in, 4 out per group
        self.w = nn.Parameter(torch.randn(64, 2, 3, 3) * 0.1)         # 2 per group, functional
        self.g8 = nn.Conv2d(64, 64, 1, groups=8)                      # 8 per group: aligned

    def forward(self, x):
        h = self.dw(self.g12(self.dn3(self.up3(x))))
        return self.g8(nn.functional.conv2d(self.gc(h), self.w, padding=1, groups=32))


def test_conv_lint_reads_groups_and_transposed_channels_alike_under_fx_and_export():
    """Grouped and depthwise module convs were 'aligned' (C counted all the input channels), the
    same conv written as F.conv2d or captured by torch.export 'pad C 1->8' (per group, groups
    dropped), and a ConvTranspose named its out channels C ('pad C 3->8' made a user pad
    in_channels=64). A conv with under 8 channels per group runs on CUDA cores: no padding."""
    texts = {}
    for mode in ("inference", "train"):  # symbolic_trace (module calls) and torch.export (aten)
        plan = mpgraph.convert(_Convs(), (torch.randn(2, 64, 4, 4),), dtype="fp16",
                               target="a100", strategy="rules", mode=mode, check=False).plan
        assert plan.capture.startswith("torch.export" if mode == "train" else "torch.fx")
        convs = [r for r in plan.compute_nodes if r.op_class == "tensor_core"]
        texts[mode] = [r.tensor_core.split("; no time saved")[0] for r in convs]
        summary = plan.summary()
        assert "; 3 matmuls misaligned for Tensor Cores; 3 matmuls not on Tensor Cores" in summary
    assert texts["inference"] == texts["train"]
    up3, dn3, g12, dw, gc, conv2d, g8 = texts["train"]
    assert up3 == ("eligible but misaligned: pad out_channels 3->8 (float16 Tensor Cores want "
                   "multiples of 8)")
    assert dn3 == ("eligible but misaligned: pad in_channels 3->8 (float16 Tensor Cores want "
                   "multiples of 8)")
    assert g12.startswith("eligible but misaligned: pad in_channels 48->64, out_channels 48->64 "
                          "(12->16, 12->16 channels per group, groups=4; float16 Tensor Cores")
    assert dw == ("not on Tensor Cores: a depthwise conv (1 input and 1 output channel per group, "
                  "groups=48) runs on CUDA cores, padded or not (float16 Tensor Cores want "
                  "multiples of 8 channels per group)")
    assert gc.startswith("not on Tensor Cores: a grouped conv (3 input and 4 output channels per "
                         "group, groups=16) runs on CUDA cores") and "pad " not in gc
    assert conv2d.startswith("not on Tensor Cores: a grouped conv (2 input and 2 output channels "
                             "per group, groups=32) runs on CUDA cores (float16 Tensor Cores want "
                             "multiples of 8 channels per group; padding each group to that "
                             "would be 16x the work: no padding is suggested)")
    assert g8 == ("aligned (8 in, 8 out channels per group, groups=8; float16 Tensor Cores want "
                  "multiples of 8)")


def test_a_conv_off_tensor_cores_is_reported_and_profiled_as_the_lint_says():
    """A depthwise conv whose kernels ran off Tensor Cores got the advice for an aligned conv
    (cuDNN's heuristics, NCHW layout, cudnn.benchmark), which cannot help; the text report
    left its finding out."""
    from mpgraph.tools.profiling import _finding
    gm = mpgraph.convert(nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, groups=64)),
                         (torch.randn(2, 64, 8, 8),), dtype="fp16", target="a100",
                         strategy="rules", check=False)
    record = gm.plan.node("_0")
    assert record.tensor_core.startswith("not on Tensor Cores: a depthwise conv")
    assert _finding(record, False, ("conv_depthwise2d_forward_kernel",)) == record.tensor_core
    assert f"tensor cores: {record.tensor_core}" in mpgraph.report(gm)


def test_no_tensor_core_verdict_for_a_dtype_the_gpu_has_no_tensor_cores_for():
    """bf16 on a T4 or V100 was 'aligned (bfloat16 Tensor Cores want multiples of 8)'; float32
    with TF32 allowed was held to 'TF32 Tensor Cores want multiples of 4' there too."""
    from mpgraph.passes import LintTensorCores
    from mpgraph.ir.meta import TC_FINDING
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()
    for target, name in (("t4", "NVIDIA T4"), ("v100", "NVIDIA V100 SXM2")):
        plan = mpgraph.convert(model, (torch.randn(64, 256),), dtype="bf16", target=target,
                               strategy="rules", check=False).plan
        for r in plan.compute_nodes:
            if r.op_class == "tensor_core":
                assert r.dtype == "bfloat16" and r.tensor_core == (
                    f"not on Tensor Cores: {name} has no bfloat16 Tensor Cores, its CUDA cores "
                    "run it; dtype='fp16' runs on them")
        assert "; 2 matmuls not on Tensor Cores" in plan.summary()
        fp16 = mpgraph.convert(model, (torch.randn(64, 256),), dtype="fp16", target=target,
                               strategy="rules", check=False).plan
        assert fp16.node("_0").tensor_core.startswith("aligned (float16")
        gm = mpgraph.convert(model, (torch.randn(64, 256),), target=target, check=False,
                             overrides={"class:tensor_core": "fp32"})
        assert gm.plan.node("_0").dtype == "float32"
        node = next(n for n in gm.graph.nodes if n.name == "_0")
        node.meta.pop(TC_FINDING, None)
        LintTensorCores(resolve_target(target), tf32=True)(gm)
        assert TC_FINDING not in node.meta  # no TF32 there: float32 runs on CUDA cores
    gm = mpgraph.convert(model, (torch.randn(64, 256),), target="a100", check=False,
                         overrides={"class:tensor_core": "fp32"})
    LintTensorCores(resolve_target("a100"), tf32=True)(gm)
    assert next(n for n in gm.graph.nodes if n.name == "_0").meta[TC_FINDING].multiple == 4


def test_roofline_numbers_for_a_linear_and_a_cast():
    gm = mpgraph.convert(_sandwich(1024), torch.randn(512, 1024), dtype="fp16", target=H100,
                         check=False)
    node = next(n for n in gm.graph.nodes if n.name == "_1")
    cost = node.meta[COST]
    assert cost.flops == 2 * 512 * 1024 * 1024
    spec = GPU_SPECS["h100-sxm"]
    # 512x1024 output = 4x8 = 32 tiles of 128x128 on 132 SMs: one wave, 32/132 of the GPU busy
    quantization = (512 * 1024) / (1 * 132 * 128 * 128)
    compute = cost.flops / (spec.peak["fp16"] * quantization)
    memory = cost.bytes_low / spec.bandwidth
    assert cost.bytes_low == 2 * (512 * 1024 + 1024 * 1024 + 1024 + 512 * 1024)  # x, W, b, y in fp16
    # an eager GPU run: the kernel or the host's part per node, whichever is longer
    assert cost.t_low == pytest.approx(max(compute, memory, GPU_HOST_S), rel=0.05)
    rec = gm.plan.node("_1")
    assert rec.t_fp32 == cost.t_fp32 and rec.t_low == cost.t_low


@pytest.mark.parametrize("shape", [(0, 64), (4, 0, 64)], ids=["batch0", "length0"])
def test_a_zero_size_example_costs_only_launches_on_a_gpu(shape):
    # an empty GEMM has no tiles: the wave quantization, and the Tensor Core padding ratio,
    # divided by zero (PassError: ZeroDivisionError) for a batch-0 or zero-length example
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 12)).eval()
    for strategy in ("rules", "optimal"):
        gm = mpgraph.convert(model, torch.randn(*shape), dtype="fp16", target=H100,
                             strategy=strategy, check=False)
        for n in gm.graph.nodes:
            if n.meta.get(COST) is not None and n.meta[COST].flops == 0:
                assert n.meta[COST].t_low == pytest.approx(GPU_HOST_S)
        assert gm(torch.randn(3, 64)).shape == (3, 12)
    # an empty reduction (K = 0) with misaligned M, N: no Tensor Core finding to divide
    class Empty(nn.Module):
        def forward(self, a, b):
            return a @ b
    mpgraph.convert(Empty(), (torch.randn(5, 0), torch.randn(0, 3)), dtype="fp16",
                    target=H100, strategy="rules", check=False)


def test_cost_optimal_is_never_estimated_slower_than_the_rules(bert, token_ids):
    ids, mask = token_ids
    for target in (SLOW_CPU, H100, "t4"):  # (roofline targets: the same on any CPU)
        # (plans read at the example's shape alone: static captures; their estimates are the
        # point, not the value check's figures: check="dtypes", 2.0 -> 1.6 s of CPU each)
        opt = mpgraph.convert(bert, (ids,), example_kwargs={"attention_mask": mask}, dtype="fp16",
                              target=target, dynamic=False, check="dtypes")
        rules_plan = mpgraph.convert(bert, (ids,), example_kwargs={"attention_mask": mask},
                                     dtype="fp16", target=target, strategy="rules",
                                     dynamic=False, check="dtypes").plan
        # the rules' plan priced with the same model
        rule_time = sum(r.t_low if r.dtype == "float16" else r.t_fp32
                        for r in rules_plan.nodes if r.t_fp32 is not None)
        assert opt.plan.estimate["plan_s"] <= rule_time * (1 + 1e-9) + _cast_time(rules_plan, target)
        low_in_opt = {r.name for r in opt.plan.low_nodes}
        assert low_in_opt <= {r.name for r in rules_plan.low_nodes}  # never less precise


def _cast_time(plan, target):
    model = Roofline(resolve_target(target))
    return sum(model.cast_seconds(c.numel, torch.float16) for c in plan.casts)


class _RangeKeepsOneLayerOutOfFp16(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(256, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 256)

    def forward(self, x):
        h = self.a(x) * 3e4  # fp16 would overflow in b: b runs in bf16 beside fp16
        return self.c(self.b(torch.relu(h)) * 1e-4)


def test_an_automatic_gpu_plan_prices_its_bf16_nodes_as_built():
    # was: the cut's stand-in, b at its float32 time and without its casts: 253 us, "1.73x",
    # where the plan built (b in bf16, its two casts) is 93 us, 4.7x
    torch.manual_seed(0)
    model, x = _RangeKeepsOneLayerOutOfFp16().eval(), torch.randn(64, 256)
    optimal = mpgraph.convert(model, (x,), target="a100").plan
    rules = mpgraph.convert(model, (x,), target="a100", strategy="rules").plan
    assert optimal.node("b").dtype == "bfloat16"
    assert [(r.name, r.dtype) for r in optimal.compute_nodes] == \
        [(r.name, r.dtype) for r in rules.compute_nodes]
    assert optimal.estimate["plan_s"] == pytest.approx(rules.estimate["plan_s"], rel=1e-9)
    assert optimal.estimate["plan_s"] < optimal.estimate["fp32_s"] / 4


class _FinfoMask(nn.Module):
    """``torch.finfo(sc.dtype)``: no symbolic trace gets through it, torch.export captures."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, mask):
        sc = self.q(x) @ x.transpose(-1, -2)
        sc = sc + (1.0 - mask[:, None, :]) * torch.finfo(sc.dtype).min
        return self.o(sc.softmax(-1) @ x)


@pytest.mark.parametrize("strategy", ["rules", "optimal"])
def test_export_s_input_guard_is_not_counted_or_priced_as_a_model_node(strategy):
    """Probe pN F8: torch.export's ``_guards_fn`` (a check of the inputs' shapes) was a plan node
    like the model's ops: "converted 4/13 nodes" counted it, its reason read "reads a float32
    input: stays float32" and its 7 us went into the estimate's totals."""
    torch.manual_seed(0)
    x, mask = torch.randn(2, 8, 16), torch.ones(2, 8)
    plan = mpgraph.convert(_FinfoMask().eval(), (x, mask), target="a100", strategy=strategy).plan
    assert plan.capture.startswith("torch.export")
    guard = plan.node("_guards_fn")
    assert (guard.dtype, guard.t_fp32, guard.t_low) == (None, None, None)
    assert guard.reason.startswith("torch.export's input guard")
    model_ops = [r.name for r in plan.compute_nodes]
    assert "_guards_fn" not in model_ops and len(model_ops) == 12, model_ops
    assert "/12 nodes" in plan.summary() or "all 12 nodes" in plan.summary()
    priced = sum(r.t_fp32 for r in plan.nodes if r.t_fp32 is not None)
    assert plan.estimate["fp32_s"] == pytest.approx(priced)
