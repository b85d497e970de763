"""The measured cost model (this machine's op times, cached) and the GPU calibration file.

What a plan decides from a measured table must not depend on the CPU the suite lands on, so
the decisions are tested on injected tables: the op keys come from a real measurement here, the
seconds are set by the test. What the measurement itself does (one entry per distinct op and
dtype, a cache that a second conversion reads, variants that cannot run) is tested for its
structure, not for its figures.
"""
import json
import logging
import math
import os
import re
import time

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import mpgraph
from mpgraph import cli
from mpgraph.cost.device import measure_cpu
from mpgraph.numerics import relative_l2
from mpgraph.cost.measured import CostTable, Measured, emulated, time_calls
from mpgraph.cost.roofline import (CALIBRATION_FORMAT, Roofline, measure_calibration,
                                   read_calibration, write_calibration)
from mpgraph.cost.specs import GPU_SPECS

from conftest import MLP, casts, kernels_only

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _mlp():
    torch.manual_seed(0)
    return MLP().eval(), torch.randn(4, 16)


_FP32 = {}  # (the model's repr, the input's shape) -> its measured float32 entries


def _fp32_entries(model, x) -> dict:
    """The op keys of ``model``'s graph with their float32 seconds, measured here (the suite's
    private cache emptied first: the table calibrate returns also holds other tests' ops).
    Measured once per model and shape in this module: the tests inject their own low-precision
    times over them, and each gets a copy."""
    key = (repr(model), tuple(x.shape))
    if key not in _FP32:
        path = CostTable.for_device(torch.device("cpu")).path
        if os.path.exists(path):
            os.remove(path)
        table = mpgraph.calibrate(model, x)
        _FP32[key] = {k: v for k, v in table.entries.items()
                      if k.endswith("|fp32") and v is not None}
    return dict(_FP32[key])


def _injected(fp32: dict, factor: dict, cast_s: float = 1e-9) -> Measured:
    """A Measured model over a table the test writes: each low dtype's time is float32's times
    ``factor[dtype]``; every cast of the MLP's values costs ``cast_s``."""
    entries = dict(fp32)
    for key, seconds in fp32.items():
        for dtype, f in factor.items():
            entries[key[:-len("fp32")] + {BF16: "bf16", FP16: "fp16"}[dtype]] = seconds * f
    for shape in ([4, 16], [4, 32], [4, 8]):
        for short in ("bf16", "fp16"):
            entries[f"cast {shape} fp32->{short}"] = cast_s
            entries[f"cast {shape} {short}->fp32"] = cast_s
    table = CostTable(torch.device("cpu"), entries)  # no path: never written to the cache
    return Measured(table, Roofline(measure_cpu()), tuple(factor))


def test_a_table_where_bf16_is_faster_puts_the_mlp_in_bf16_and_the_estimate_is_its_sum():
    model, x = _mlp()
    fp32 = _fp32_entries(model, x)
    assert len(fp32) == 3  # fc1, act, fc2: each distinct op once
    costs = _injected(fp32, {BF16: 0.01})
    out = mpgraph.convert(model, (x,), costs=costs)
    plan = out.plan
    assert plan.dtype == BF16 and [r.dtype for r in plan.compute_nodes] == ["bfloat16"] * 3
    assert len(casts(out)) == 2  # the input down, the output up
    # the estimate is the table's arithmetic, exactly: 3 ops, and 2 casts at 1 ns
    assert plan.estimate["fp32_s"] == pytest.approx(sum(fp32.values()), rel=1e-12)
    assert plan.estimate["plan_s"] == pytest.approx(0.01 * sum(fp32.values()) + 2e-9, rel=1e-9)
    assert plan.estimate["source"].startswith("measured on this CPU, op by op")
    assert "measured on this CPU" in plan.summary()
    assert torch.allclose(out(x), model(x), rtol=0, atol=5e-2)


def test_a_table_where_low_precision_is_slower_keeps_float32_without_a_cast():
    model, x = _mlp()
    out = mpgraph.convert(model, (x,), costs=_injected(_fp32_entries(model, x), {BF16: 3.0}))
    assert [r.dtype for r in out.plan.compute_nodes] == ["float32"] * 3
    assert casts(out) == [] and torch.equal(out(x), model(x))
    assert out.plan.estimate["plan_s"] == pytest.approx(out.plan.estimate["fp32_s"])


def test_casts_that_cost_more_than_the_saving_keep_float32():
    model, x = _mlp()
    fp32 = _fp32_entries(model, x)
    slowest = max(fp32.values())
    out = mpgraph.convert(model, (x,), costs=_injected(fp32, {BF16: 0.5}, cast_s=10 * slowest))
    assert [r.dtype for r in out.plan.compute_nodes] == ["float32"] * 3 and casts(out) == []


@pytest.mark.parametrize("factor, low", [(0.93, False), (0.7, True)])
def test_a_gain_within_the_timings_noise_is_no_gain(factor, low):
    """Tiny ops time within a few percent of each other in any dtype, and which comes out ahead
    is noise (fp16 8.61 against fp32 9.33 us here, where fp16 is the slower when called 2000
    times): a low dtype less than 10% faster is taken as no faster, so casts keep it float32."""
    model, x = _mlp()
    out = mpgraph.convert(model, (x,), costs=_injected(_fp32_entries(model, x), {FP16: factor}))
    dtypes = {r.dtype for r in out.plan.compute_nodes}
    assert dtypes == ({"float16"} if low else {"float32"})
    if not low:
        assert out.plan.estimate["plan_s"] == pytest.approx(out.plan.estimate["fp32_s"])


@pytest.mark.parametrize("fast, slow", [(FP16, BF16), (BF16, FP16)])
def test_the_default_dtype_is_the_one_the_table_says_is_fastest(fast, slow):
    model, x = _mlp()
    costs = _injected(_fp32_entries(model, x), {fast: 0.01, slow: 0.5})
    plan = mpgraph.convert(model, (x,), costs=costs).plan
    assert plan.dtype == fast
    est = plan.dtype_choice["estimates_s"]
    assert set(est) == {"float16", "bfloat16"} and est[str(fast).split(".")[1]] < \
        est[str(slow).split(".")[1]]
    assert "chosen by the cost model" in plan.summary()


def test_a_named_dtype_is_used_where_the_table_says_it_pays():
    model, x = _mlp()
    costs = _injected(_fp32_entries(model, x), {FP16: 3.0, BF16: 0.01})
    with pytest.warns(UserWarning, match="dtype=float16 converted 0 of 2 matmul/conv nodes"):
        plan = mpgraph.convert(model, (x,), dtype=FP16, costs=costs).plan
    assert plan.dtype == FP16 and {r.dtype for r in plan.compute_nodes} == {"float32"}


@pytest.mark.this_cpu
def test_measurement_covers_each_op_in_each_native_dtype_and_a_second_conversion_reads_the_cache(
        caplog, monkeypatch):
    torch.manual_seed(0)
    # two identical layers: one op key, measured once
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU()).eval()
    x = torch.randn(3, 16)  # a shape no other test measures
    table = mpgraph.calibrate(model, x)
    spec = measure_cpu()
    native = [s for d, s in ((FP16, "fp16"), (BF16, "bf16")) if not emulated(d, spec)]
    mine = {k for k in table.entries if "[3, 16]" in k}
    linear = [k for k in mine if k.startswith("call_module") and "Linear" in k]
    # (no 'bf16 packed' variant: 3x16x16 is below the size a packed linear runs at, SMALL)
    assert sorted(k.rsplit("|", 1)[1] for k in linear) == sorted(["fp32"] + native)
    assert all(table.entries[k] > 0 for k in linear)
    # the casts of the values, both ways, for each native low dtype
    assert {k for k in mine if k.startswith("cast")} == \
        {f"cast [3, 16] {a}->{b}" for s in native for a, b in (("fp32", s), (s, "fp32"))}
    # the cache holds it: converting again measures nothing, nor runs the graph to find that out
    from mpgraph.cost import measured

    def no_run(*a, **k):
        raise AssertionError("a fully cached table ran the graph")

    monkeypatch.setattr(measured._Timer, "run", no_run)
    # (the cache alone: a machine found quieter than when it measured would measure again,
    # which test_costs_measured_on_a_busy_machine_... tests; a loaded machine did here)
    monkeypatch.setattr(measured, "RELIEF", math.inf)
    with caplog.at_level(logging.INFO, logger="mpgraph"):
        plan = mpgraph.convert(model, (x,)).plan
    assert not [r for r in caplog.records if r.getMessage().startswith("measured ")]
    assert "(4 of 4 nodes)" in plan.estimate["source"]
    with open(table.path) as f:
        saved = json.load(f)
    assert saved["format"] == "mpgraph-cost-table/7" and saved["key"] == table.key
    assert "torch " + torch.__version__ in table.key and "threads" in table.key


def test_time_calls_interleaves_settles_and_marks_a_variant_that_cannot_run():
    def fail():
        raise RuntimeError("no kernel for this dtype")

    start = time.perf_counter()
    fast, slow, broken = time_calls([lambda: None, lambda: time.sleep(0.002), fail],
                                    torch.device("cpu"))
    assert broken is None and fast < slow and slow >= 0.002
    assert time.perf_counter() - start < 2.0  # bounded by the budget, not MAX_CALLS


def test_calibration_file_round_trip_and_a_plan_for_that_gpu_says_it_read_it(tmp_path, monkeypatch):
    """What gpu_check.py and `mpgraph calibrate --gpu` write on a GPU, written here from CPU
    timings (the format and the plumbing; the figures are the CPU's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = GPU_SPECS["a100-80gb"]
    data = measure_calibration(spec, "cpu", size=64)
    assert data["format"] == CALIBRATION_FORMAT and data["device"] == spec.name
    assert 0 < data["host_per_node_s"] < 1e-3
    assert set(data["efficiency"]) >= {"fp32", "fp16", "bf16", "bandwidth", "elementwise"}
    assert all(0 < v <= 1 for v in data["efficiency"].values())
    data["host_per_node_s"] = 2.5e-5  # a host 25 us a node: the plan must price that
    path = write_calibration(spec, data)
    assert path.startswith(str(tmp_path)) and read_calibration(spec) == data
    model, x = _mlp()
    plan = mpgraph.convert(model, (x,), target="a100").plan
    assert plan.estimate["source"].startswith(f"roofline for {spec.name}, calibrated on "
                                              f"{spec.name}") and "host floor 25 us" in plan.estimate["source"]
    assert all(r.t_fp32 >= 2.5e-5 for r in plan.compute_nodes)
    # a file that is not one is an error naming it
    (tmp_path / "bad.json").write_text("{\"format\": \"something else\"}")
    with pytest.raises(ValueError, match="bad.json is not a calibration file"):
        read_calibration(spec, str(tmp_path / "bad.json"))


def test_a_calibration_file_with_bad_values_is_an_error_naming_the_file_and_field(tmp_path,
                                                                                   monkeypatch):
    """An efficiency of 0 failed deep in EstimateCost (ZeroDivisionError), a null one or a
    string host with an AttributeError/TypeError; a negative host (estimated 13.16x, 5.36x with
    the valid file) and percentages (60 for 0.6) were used silently."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = GPU_SPECS["a100-80gb"]
    good = {"format": CALIBRATION_FORMAT, "device": spec.name, "host_per_node_s": 6e-6,
            "efficiency": {"fp32": 0.6, "fp16": 0.5, "bf16": 0.5, "bandwidth": 0.8,
                           "elementwise": 0.4}}
    model, x = _mlp()
    write_calibration(spec, good)
    mpgraph.convert(model, (x,), target="a100")
    for change, said in (({"efficiency": {**good["efficiency"], "fp16": 0}}, "efficiency 'fp16'"),
                         ({"efficiency": {**good["efficiency"], "fp32": 60}}, "efficiency 'fp32'"),
                         ({"efficiency": None}, "efficiency must be an object"),
                         ({"host_per_node_s": None}, "host_per_node_s"),
                         ({"host_per_node_s": "6e-6"}, "host_per_node_s"),
                         ({"host_per_node_s": -1e-3}, "host_per_node_s"),
                         ({"kernel_floor_s": -1e-6}, "kernel_floor_s")):
        path = write_calibration(spec, {**good, **change})
        with pytest.raises(ValueError, match=re.escape(f"{path} is not a valid calibration file: "
                                                       f"{said}")):
            mpgraph.convert(model, (x,), target="a100")
    data = dict(good)
    del data["host_per_node_s"]
    write_calibration(spec, data)
    with pytest.raises(ValueError, match="host_per_node_s must be seconds, 0 or more, got None"):
        mpgraph.convert(model, (x,), target="a100")


def test_an_uncalibrated_gpu_plan_says_so_and_replayed_drops_the_host_floor():
    model, x = _mlp()
    eager = mpgraph.convert(model, (x,), target="h100", dtype=FP16).plan
    graphs = mpgraph.convert(model, (x,), target="h100", dtype=FP16, runtime="graphs").plan
    assert "uncalibrated, eager (host floor 7 us a node)" in eager.estimate["source"]
    assert "replayed or compiled (no host time; 2.5 us a kernel at least)" in \
        graphs.estimate["source"]
    assert graphs.estimate["fp32_s"] < eager.estimate["fp32_s"]
    assert all(r.t_fp32 >= 7e-6 for r in eager.compute_nodes)


def test_cli_calibrate_prints_the_table_and_where_it_is_cached(tmp_path, capsys):
    path = CostTable.for_device(torch.device("cpu")).path  # the table prints the slowest 40:
    if os.path.exists(path):                               # not other tests' ops
        os.remove(path)
    factory = tmp_path / "mlp.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n    torch.manual_seed(0)\n"
                       "    return nn.Sequential(nn.Linear(24, 24)), torch.randn(5, 24)\n")
    assert cli.main(["calibrate", f"{factory}:build"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"measured costs on CPU .*: \d+ entries", out), out
    assert "Linear(in_features=24, out_features=24, bias=True)" in out
    assert re.search(r"measured \d+ op variants in [\d.]+ s; cached in .*costs-\w+\.json", out)
    assert cli.main(["calibrate"]) == 2
    assert "calibrate needs a factory" in capsys.readouterr().err
    # (--rows -1 printed all but one row and "... and 4 more" of a 3-entry table)
    with pytest.raises(SystemExit):
        cli.main(["calibrate", f"{factory}:build", "--rows", "-1"])
    assert "--rows: expected a count of 1 or more, got -1" in capsys.readouterr().err



class _ConvAndAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.qkv = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(16, 48)

    def forward(self, img, seq):
        y = torch.relu(self.bn(self.conv(img)))
        q, k, v = self.qkv(seq).view(2, 10, 3, 4, 4).permute(2, 0, 3, 1, 4)  # each (2, 4, 10, 4)
        return y.mean((2, 3)), torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_low_precision_variants_are_timed_in_the_layout_the_converted_graph_has(monkeypatch):
    """A 2-D conv and the layers after it run channels_last in a low-precision plan (the
    ChannelsLast pass), so they are timed so; attention's 4-D inputs keep their strides (timed
    channels_last, bf16 attention measured 2x slower than it runs, and stayed float32)."""
    from mpgraph.cost import measured
    seen = []
    real = measured._cast

    def spy(value, dtype, nhwc=False):
        out = real(value, dtype, nhwc)
        seen.extend((tuple(t.shape), nhwc, t.is_contiguous(memory_format=torch.channels_last)
                     and not t.is_contiguous()) for t in torch.utils._pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.dim() == 4)
        return out

    monkeypatch.setattr(measured, "_cast", spy)
    monkeypatch.setattr(mpgraph.api, "emulated", lambda dtype, spec: False)  # any CPU: time bf16
    path = CostTable.for_device(torch.device("cpu")).path
    if os.path.exists(path):
        os.remove(path)
    table = mpgraph.calibrate(_ConvAndAttention().eval(),
                              (torch.randn(2, 3, 8, 8), torch.randn(2, 10, 16)))
    by_shape = {}
    for shape, nhwc, channels_last in seen:
        by_shape.setdefault(shape, set()).add((nhwc, channels_last))
    assert by_shape[(2, 3, 8, 8)] == {(True, True)}   # the conv's input
    assert by_shape[(2, 8, 8, 8)] == {(True, True)}   # batch norm, ReLU and the mean after it
    assert by_shape[(2, 4, 10, 4)] == {(False, False)}, by_shape  # q, k, v: strides kept
    # the layout is part of the key: the same op on the same shapes in NCHW is another entry
    keys = {k.rsplit("|", 1)[0] for k in table.entries if "|" in k}
    assert any("mean" in k and k.endswith(" nhwc") for k in keys)
    assert any("scaled_dot_product_attention" in k and not k.endswith(" nhwc") for k in keys)


class _Stack(nn.Module):
    """Four 512x512 layers (1 MiB each in float32), two nn.Linear and two functional (their
    weights get_attr nodes, one read transposed through a view), a small head, an embedding
    (a gather: reads a row of its table) and two weights read through a list (cat)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)
        self.w1 = nn.Parameter(torch.randn(512, 512) / 23)
        self.w2 = nn.Parameter(torch.randn(512, 512) / 23)
        self.head = nn.Linear(512, 4)
        self.emb = nn.Embedding(1000, 512)
        self.u, self.v = nn.Parameter(torch.randn(4, 512)), nn.Parameter(torch.randn(4, 512))

    def forward(self, x, ids):
        x = self.b(self.a(x)) + self.emb(ids)
        x = torch.nn.functional.linear(x, self.w1)
        return self.head(x @ self.w2.t()) + (x @ torch.cat([self.u, self.v]).t()).sum()


def _streamed_run(model, args, monkeypatch):
    """(the measured table's keys, the storages each op read a 512x512 float32 tensor from)."""
    from mpgraph.cost import measured
    path = CostTable.for_device(torch.device("cpu")).path
    if os.path.exists(path):
        os.remove(path)
    read = {}

    class Spy(TorchDispatchMode):  # which copy of a 512x512 float32 weight each kernel reads
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for a in args:
                if isinstance(a, torch.Tensor) and a.shape in ((512, 512), (512, 512)[::-1]) \
                        and a.dtype == torch.float32:
                    read.setdefault(str(func), set()).add(a.untyped_storage().data_ptr())
            return func(*args, **(kwargs or {}))

    real = measured.time_calls

    def spied(fns, device, prepares=None, budget=measured.VARIANT_BUDGET_S):
        with Spy():
            return real(fns, device, prepares, budget)

    monkeypatch.setattr(measured, "time_calls", spied)
    monkeypatch.setattr(mpgraph.api, "emulated", lambda dtype, spec: False)
    table = mpgraph.calibrate(model, args)
    return {k.rsplit("|", 1)[0] for k in table.entries if "|" in k}, read


def test_weights_are_timed_as_read_from_memory_when_the_graph_has_more_than_one(monkeypatch):
    """A forward reads each weight once, after all the others: timed repeatedly on the same
    weight, a matrix-vector product reads it from cache (a 768x768 float32 one 27 us where it
    runs in 83 us; bf16 40 vs 75 us: float32 looked faster). A streamed node's calls cycle
    through copies of its weights, as many as the graph's weights over its own, and the count
    is part of the key; a gather (reads a few rows), a node given its weights in a list, and a
    graph with one weight are timed as they are."""
    from mpgraph.cost import measured
    model = _Stack().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # the weights read whole as arguments (not the embedding's table nor u, v): 4 of 512x512,
    # 2 biases, the head; 4.0 times one 512x512 weight, 4.0 times an nn.Linear's
    copies = round((4 * 512 * 512 + 2 * 512 + 4 * 512 + 4) / (512 * 512))
    assert copies == 4
    # two nn.Linear modules (one key, each call on copies of the module), F.linear and the
    # matmul through the transposed view; not the view itself, the embedding, the bias adds,
    # the small head, nor the cat's matmul
    for rows in (1, 4):
        keys, read = _streamed_run(model, (torch.randn(1, rows, 512), torch.tensor([[3] * rows])),
                                   monkeypatch)
        streamed = sorted(k for k in keys if " streamed/" in k)
        assert [k.split(" (")[0].split("(")[0] for k in streamed] == \
            ["call_function linear", "call_function matmul", "call_module Linear"], streamed
        assert all(k.endswith(f" streamed/{copies}") for k in streamed), streamed
        # addmm is the modules' alone (F.linear has no bias: mm): their copies counted
        assert len(read["aten.addmm.default"]) >= copies and len(read["aten.mm.default"]) >= copies, \
            {k: len(v) for k, v in read.items()}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())

    single = nn.Linear(512, 512).eval()  # one weight: repeated calls read it as the model does
    assert measured.layout(torch.fx.symbolic_trace(single)).streamed == {}


def _tiny_mlp():
    """The MLP without biases on inputs of ~1e-7 (quantities in SI units): every value lies in
    fp16's subnormal range, where it keeps a few bits; bf16 has float32's range."""
    model, x = _mlp()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.bias.zero_()
    return model, x * 1e-7


def test_an_automatic_fp16_that_fails_the_check_falls_back_to_bf16_and_says_why():
    model, x = _tiny_mlp()
    costs = _injected(_fp32_entries(model, x), {FP16: 0.01, BF16: 0.5})  # fp16 the fastest
    for out in (mpgraph.convert(model, (x,), costs=costs),      # this CPU's (injected) table
                mpgraph.convert(model, (x,), target="a100", costs=kernels_only())):  # GPU: fp16
        plan = out.plan
        assert plan.dtype == BF16 and plan.low_nodes
        assert re.search(r"; bfloat16 because float16's plan failed the value check \(error "
                         r"[0-9.e-]+, more than its bound 0\.0156\) \(the cost model estimated "
                         r"float16 [0-9.e-]+ ms, bfloat16 [0-9.e-]+ ms\)", plan.summary())
        assert 0.03 < float(re.search(r"error ([0-9.e-]+),", plan.dtype_choice["fallback"])[1])
        with torch.no_grad():
            assert relative_l2(out(x), model(x)) < 1e-2 and plan.check["error"] < 1e-2
    assert mpgraph.Plan.from_dict(plan.to_dict()).dtype_choice["fallback"] == \
        plan.dtype_choice["fallback"]
    # calibration batches from a generator: read again by the fallback (it was empty then)
    out = mpgraph.convert(model, (x,), costs=costs, calibration=(b for b in (x, 2 * x)))
    assert out.plan.dtype == BF16 and out.plan.calibration_batches == 2


class _Cancelling(nn.Module):
    """Values near 100, then centred: a loss of precision (fp16 0.029 off), not of range."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.l1(x) + 100
        return self.l2((h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True) + 1e-5).sqrt())


def test_an_automatic_fp16_whose_bf16_fallback_fails_too_reports_the_fp16_plan(caplog):
    """bf16 (8x coarser) cannot mend a precision loss: it failed at 0.24 and the error was about
    a bfloat16 plan the user never asked for. The float16 plan's error is the one raised."""
    torch.manual_seed(0)
    model, x = _Cancelling().eval(), torch.randn(2, 16, 32)
    with pytest.raises(mpgraph.ValueCheckError, match=r"differs from float32 by 0\.0\d+ .*more "
                                                      r"than a float16 plan should \(0\.0156\)"):
        mpgraph.convert(model, (x,), target="a100", strategy="rules", costs=kernels_only())
    assert "bfloat16 failed the value check too (error 0.2" in caplog.text


def test_a_named_fp16_that_fails_the_check_is_an_error_that_names_bf16():
    model, x = _tiny_mlp()
    with pytest.raises(mpgraph.ConversionError, match=r"differs from float32 by .* more than a "
                       r"float16 plan should \(0\.0156\).*; or convert in bfloat16, float32's "
                       r"range: dtype='bf16'\)"):
        mpgraph.convert(model, (x,), dtype="fp16", target="a100", costs=kernels_only())


def test_calibrate_returns_the_model_s_own_table_and_keeps_the_others_in_the_cache():
    """`mpgraph calibrate FILE:factory` printed the whole machine cache (733 entries of other
    models, slowest first), not the model it measured."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(24, 40), nn.ReLU()).eval()
    second = nn.Sequential(nn.Linear(40, 24)).eval()
    a = mpgraph.calibrate(first, torch.randn(5, 24))   # shapes no other test measures
    b = mpgraph.calibrate(second, torch.randn(5, 40))
    assert a.entries and b.entries and a.path == b.path
    assert all("[5, 40]" in k for k in b.entries if not k.startswith("cast"))
    assert not set(a.entries) & {k for k in b.entries if not k.startswith("cast")}
    assert b.format().startswith(f"measured costs on {b.name}: {len(b.entries)} entries")
    cached = CostTable.for_device(torch.device("cpu")).entries
    assert set(a.entries) | set(b.entries) <= set(cached)


def test_an_all_float32_plan_kept_by_its_casts_does_not_say_no_node_is_faster():
    """A Linear 100 us in float32 and 20 us in bf16, each cast 50 us: the plan is float32, and
    the summary said 'no node is faster in bfloat16 than in float32'."""
    model, x = nn.Sequential(nn.Linear(64, 64)).eval(), torch.randn(8, 64)
    key = ("call_module Linear(in_features=64, out_features=64, bias=True) weight[64, 64] "
           "bias[64] (['[8, 64]fp32'], {})")
    entries = {f"{key}|fp32": 100e-6, f"{key}|bf16": 20e-6,
               "cast [8, 64] fp32->bf16": 50e-6, "cast [8, 64] bf16->fp32": 50e-6}
    costs = Measured(CostTable(torch.device("cpu"), entries), Roofline(measure_cpu()), (BF16,))
    plan = mpgraph.convert(model, (x,), costs=costs).plan
    assert plan.low_nodes == [] and plan.node("_0").t_low < plan.node("_0").t_fp32
    assert plan.kept_fp32.startswith(f"no placement in bfloat16 beats float32 on {costs.name} "
                                     "once its casts are counted (1 node is faster alone in "
                                     "bfloat16; measured on this CPU")
    assert "no node is faster" not in plan.summary()
    costs.table.entries[f"{key}|bf16"] = 200e-6  # slower alone too: then no node is faster
    plan = mpgraph.convert(model, (x,), costs=costs).plan
    assert plan.kept_fp32.startswith("no node is faster in bfloat16 than in float32")


def test_a_cache_file_with_values_that_are_not_times_is_measured_again(tmp_path, monkeypatch):
    """A parseable but damaged cost table ('n/a' entries, NaN, negative times, a string probe)
    failed convert deep inside (float() in EstimateCost, '<' between str and float, min() of
    an empty sequence): what is not a time is not held, and is measured again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(12, 20), nn.ReLU()).eval(), torch.randn(3, 12)
    table = mpgraph.calibrate(model, x)
    held = json.loads(open(table.path).read())
    keys = sorted(k for k, v in held["entries"].items() if v is not None)
    bad = ["n/a", float("nan"), -1e-4, float("inf"), True, [1]]
    damaged = {**held, "entries": {k: bad[i % len(bad)] for i, k in enumerate(keys)},
               "probe_s": "0.0001", "probe_at": {k: "1" for k in keys}}
    with open(table.path, "w") as f:
        json.dump(damaged, f)
    read = CostTable.for_device(torch.device("cpu"))
    assert read.entries == {} and read.probe_at == {} and read.probe_s is None
    mpgraph.convert(model, (x,))  # measured again, and written back
    entries = json.loads(open(table.path).read())["entries"]
    assert all(isinstance(entries[k], float) and entries[k] >= 0 for k in keys)


def test_a_cost_model_that_prices_a_node_at_nan_or_a_negative_time_is_named():
    """A user cost model (costs=) returning NaN printed 'estimated nanx float32 speed'; a
    negative time failed with 'min() arg is an empty sequence'; a bare CostModel() with a
    NotImplementedError that said nothing."""
    from mpgraph.cost.model import CostModel, NodeCost

    class Odd(CostModel):
        name, source = "odd CPU", "the test"

        def __init__(self, t32, tlow, cast=1e-6):
            self.times, self.cast = (t32, tlow), cast

        def node_cost(self, node, gm, low):
            return NodeCost(1.0, 1.0, 1.0, *self.times)

        def cast_cost(self, node, low):
            return self.cast, self.cast

    model, x = nn.Sequential(nn.Linear(8, 8)).eval(), torch.randn(2, 8)
    for costs, said in ((Odd(math.nan, 1e-5), "t_fp32=nan"), (Odd(1e-4, -5e-6), "t_low=-5e-06"),
                        (Odd(1e-4, 1e-5, math.nan), "down=nan, up=nan")):
        with pytest.raises(mpgraph.PassError, match=r"the cost model Odd \(odd CPU\)\.(node|cast)"
                           rf"_cost priced \w+ at {said}: a cost is seconds, 0 or more"):
            mpgraph.convert(model, (x,), costs=costs)
    with pytest.raises(mpgraph.PassError, match="CostModel does not implement node_cost"):
        mpgraph.convert(model, (x,), costs=CostModel())
    mpgraph.convert(model, (x,), costs=Odd(1e-4, math.inf, math.inf))  # inf: never worth it


def test_calibrate_measures_this_cpu_s_micro_benchmark_again(tmp_path, monkeypatch):
    """A CPU spec cached once (a first conversion under a default meta device cached 136 TFLOP/s)
    was never measured again: calibrate re-measured the cost table only."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    planted = {"fp32": 1.25e9, "bf16": 1.25e9, "fp16": 1.25e9, "vector": 1.25e9}
    measure_cpu()
    path = next((tmp_path / "mpgraph").glob("cpu-*.json"))
    path.write_text(json.dumps({**json.loads(path.read_text()), "peak": planted}))
    assert measure_cpu().peak == planted  # (plausible: used as it is)
    mpgraph.calibrate(nn.Sequential(nn.Linear(12, 20)).eval(), torch.randn(3, 12))
    assert json.loads(path.read_text())["peak"] != planted
    assert measure_cpu().peak != planted


def test_calibrate_says_what_it_expects_of_its_arguments():
    """A non-Module model failed with AttributeError: 'str' object has no attribute 'forward'
    (a traceback from `mpgraph calibrate FILE:factory`); budget_s='5' with a bare TypeError."""
    for model in ("model", lambda x: x * 2):
        with pytest.raises(TypeError, match="calibrate expects a torch.nn.Module, got "
                           f"{type(model).__name__}"):
            mpgraph.calibrate(model, torch.randn(2, 4))
    with pytest.raises(TypeError, match="budget_s must be a number of seconds, got str '5'"):
        mpgraph.calibrate(nn.Linear(4, 4), torch.randn(2, 4), budget_s="5")


def test_calibrate_refuses_a_budget_that_is_not_a_positive_time():
    """budget_s=0 or -1 measured nothing (an empty table, the old cache entries kept, nothing
    said); budget_s=nan measured everything (no comparison with NaN ever stopped it)."""
    for budget in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="budget_s must be a positive number of seconds "
                           rf".*got {budget!r}"):
            mpgraph.calibrate(nn.Linear(4, 4), torch.randn(2, 4), budget_s=budget)


def test_calibrate_refuses_a_model_or_inputs_without_values():
    """calibrate on a meta-device model timed meta kernels and cached them under this CPU's keys:
    a later real conversion of those shapes priced its GELU at 530.7 us (25.0 us real)."""
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(24, 36), nn.GELU()).eval()
    real = nn.Sequential(nn.Linear(24, 36), nn.GELU()).eval()
    before = CostTable.for_device(torch.device("cpu")).entries
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = torch.randn(3, 24)
    for model, x in ((meta, torch.randn(3, 24)), (meta, torch.randn(3, 24, device="meta")),
                     (real, torch.randn(3, 24, device="meta")), (real, fake)):
        with pytest.raises(ValueError, match="calibrate times this machine's kernels on real "
                           "values.*meta device.*load its weights and pass real inputs"):
            mpgraph.calibrate(model, x)
    assert CostTable.for_device(torch.device("cpu")).entries == before


def test_costs_measured_on_a_busy_machine_are_measured_again_when_it_is_quieter(monkeypatch,
                                                                                caplog):
    """Measured while a test suite and other jobs shared the 2 cores, a decode step's 2304x768
    matrix-vector product was cached at 5.76 ms (0.31 ms quiet), and kept the plan's projections
    in float32 for good. A probe kernel says how busy the machine was when each was measured."""
    from mpgraph.cost import measured
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 36), nn.ReLU()).eval()
    x = torch.randn(7, 20)  # shapes no other test measures
    table = CostTable(torch.device("cpu"), probe=1e-5)
    monkeypatch.setattr(measured, "probe_s", lambda device: 8e-5)  # 8x slower than its best
    caplog.set_level("WARNING", logger="mpgraph")
    gm = mpgraph.capture(model, x)
    measured.measure(gm, (x,), {}, table, (BF16,))
    mine = [k for k in table.entries if "[7, 20]" in k or "[7, 36]" in k]
    assert mine and all(table.busy[k] == pytest.approx(8.0) for k in mine)
    assert "while this machine was busy (a reference kernel ran 8.0x slower than its best" \
        in caplog.text
    for k in mine:
        table.entries[k] = 1.0  # (what a busy machine's figure would be: absurd)
    monkeypatch.setattr(measured, "probe_s", lambda device: 6e-5)  # not RELIEF times quieter
    measured.measure(gm, (x,), {}, table, (BF16,))
    assert all(table.entries[k] == 1.0 for k in mine)  # kept
    monkeypatch.setattr(measured, "probe_s", lambda device: 1e-5)  # quiet again
    measured.measure(gm, (x,), {}, table, (BF16,))
    assert all(table.entries[k] is None or table.entries[k] < 1.0 for k in mine)
    assert not any(k in table.busy for k in mine)
    # the first measurement on a machine busy from the start: found when it shows a better best
    first = CostTable(torch.device("cpu"))
    monkeypatch.setattr(measured, "probe_s", lambda device: 8e-5)
    measured.measure(gm, (x,), {}, first, (BF16,))
    assert not first.busy and first.probe_s == 8e-5
    monkeypatch.setattr(measured, "probe_s", lambda device: 1e-5)
    for k in mine:
        first.entries[k] = 1.0
    measured.measure(gm, (x,), {}, first, (BF16,))
    assert all(first.entries[k] is None or first.entries[k] < 1.0 for k in mine)


class _CacheWrite(nn.Module):
    """A KV cache as users write one: a buffer the forward writes by ``index_copy_``."""

    def __init__(self):
        super().__init__()
        self.k = nn.Linear(64, 64)
        self.register_buffer("cache", torch.zeros(1, 16, 64))

    def forward(self, x, pos):
        self.cache.index_copy_(1, pos, self.k(x))
        return self.cache.sum(1)


def test_a_cache_named_low_on_a_cpu_that_emulates_the_dtype_converts(monkeypatch):
    """bf16 named on a CPU that emulates it (its costs inf, never timed): the solver's hard
    constraints took the inf too, the cache fixed to bf16 came out float32 from its writer's
    side, and the check failed inside index_copy_ (the README's decoder with dtype='bf16')."""
    monkeypatch.setattr(mpgraph.api, "emulated", lambda dtype, spec: True)  # as an AVX2 CPU
    torch.manual_seed(0)
    model, x, pos = _CacheWrite().eval(), torch.randn(1, 1, 64), torch.tensor([3])
    fast = mpgraph.convert(model, (x, pos), dtype=BF16)
    assert [r.dtype for r in fast.plan.nodes if "index_copy" in r.kind] == ["bfloat16"]
    assert not model.cache.any()  # the model's own cache is untouched by the conversion
    with torch.no_grad():
        out, ref = fast(x, pos), model(x, pos)
    assert out.dtype == FP32 and relative_l2(out, ref) < 1e-2


def test_a_first_conversion_on_a_machine_keeps_the_callers_random_stream(tmp_path, monkeypatch):
    """The device's first measurement drew its matrices from torch's global generator: a
    machine's first convert (a fresh cache) advanced the caller's stream, the next did not."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, x = _mlp()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    measure_cpu(fresh=True)
    measure_calibration(GPU_SPECS["a100-80gb"], "cpu", size=64)
    mpgraph.convert(model, (x,))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("flags, caps, want", [
    ({"avx2"}, "", {FP16: True, BF16: True}),                      # AVX2 only: both emulated
    ({"avx2", "avx512f", "avx512_bf16"}, "", {FP16: True, BF16: False}),
    ({"avx2", "amx_bf16", "avx512_fp16"}, "", {FP16: False, BF16: False}),
    ({"avx2"}, "ONEDNN_MAX_CPU_ISA=AVX2", {FP16: False, BF16: False}),  # capped: the rates say
    (set(), "", {FP16: False, BF16: False}),                       # no x86 flags: the rates say
])
def test_a_dtype_the_cpu_has_no_instructions_for_is_emulated_whatever_the_rates(
        flags, caps, want, monkeypatch):
    # on a busy 2-core AVX2 machine float32's measured rate fell near bf16's emulated one: bf16
    # passed as native, was timed, and a plan put a gelu in bf16 ("estimated 116x float32":
    # float32's gelu, a parallel kernel, had waited 15 ms a call for a core)
    from mpgraph.cost import measured
    from mpgraph.cost.specs import DeviceSpec
    from mpgraph.ir.meta import Kind
    monkeypatch.setattr(measured, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(measured, "isa_caps", lambda: caps)
    busy = DeviceSpec("CPU", Kind.CPU, {"fp32": 1.5e9, "fp16": 1.3e9, "bf16": 1.4e9}, 4e10, 2,
                      4e-6)  # rates alike: the ratio alone calls both native
    assert {d: emulated(d, busy) for d in (FP16, BF16)} == want


def test_an_h200_plan_reads_the_calibration_a_gpu_session_shipped_unless_the_user_has_one():
    """The H200 this project measured (examples/bench/gpu_check.py) spent 13.6 us of host time a
    node, where the uncalibrated floor says 7: plans for it made anywhere read that file; one in
    the user's cache (written on their own H200) comes first."""
    from mpgraph.cost.device import resolve_target
    from mpgraph.cost.roofline import calibration_path, read_calibration, write_calibration
    spec = resolve_target("h200")
    assert not os.path.exists(calibration_path(spec))  # (the tests' own cache)
    model, x = _mlp()
    plan = mpgraph.convert(model, (x,), target="h200", dtype=FP16).plan
    assert "calibrated on NVIDIA H200 SXM (2026-12-04, torch 2.11.0+cu130), eager (host floor " \
           "13.6 us a node)" in plan.estimate["source"]
    mine = {**read_calibration(spec), "host_per_node_s": 9e-6, "written": "mine"}
    write_calibration(spec, mine)
    try:
        plan = mpgraph.convert(model, (x,), target="h200", dtype=FP16).plan
        assert "(mine), eager (host floor 9 us a node)" in plan.estimate["source"]
    finally:
        os.remove(calibration_path(spec))
