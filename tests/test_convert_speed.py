"""Conversion does each piece of work once (issue 18), and what it skips it did not need.

Behaviour only, no timings: capture's run on the example inputs is the calibration of that batch
(the same ranges as running it again), the fx route compares with one eager forward, views take
their input's statistics, a meta model's shapes come from torch.export's records, and the checks
that were made cheaper still catch what they caught.
"""
import dataclasses
import logging
import math

import pytest
import torch
import torch.nn as nn

import mpgraph
from mpgraph.numerics import relative_l2
import mpgraph.passes.calibrate as calibrate_module
import mpgraph.passes.propagate_tensor_info as propagate
from mpgraph.ir.meta import CAPTURE, OBSERVED, RANGE, REFERENCE, Reference
from mpgraph.passes import CheckConversion
from mpgraph.passes.calibrate import tensor_stats
from mpgraph.passes.infra import run_passes
from mpgraph.passes.pipeline import prepare_pipeline

from conftest import GPU, MLP, convert_rules


class _Calls:
    """Calls of a submodule, by the conversion stage they happen in (mpgraph.progress)."""

    def __init__(self, module: nn.Module):
        self.stage, self.by_stage = "outside", {}
        self.handle = module.register_forward_hook(lambda *a: self._count())
        self.log = logging.getLogger("mpgraph.progress")
        self.handler = logging.Handler()
        self.handler.emit = self._stage
        self.log.addHandler(self.handler)
        self.level = self.log.level
        self.log.setLevel(logging.INFO)

    def _count(self):
        self.by_stage[self.stage] = self.by_stage.get(self.stage, 0) + 1

    def _stage(self, record):
        self.stage = record.mpgraph_stage if record.mpgraph_seconds is None else "outside"

    def close(self):
        self.handle.remove()
        self.log.removeHandler(self.handler)
        self.log.setLevel(self.level)


def test_fx_capture_runs_the_graph_once_and_the_model_once():
    """The traced graph's recorded run (shapes, statistics, outputs, buffers) is what the eager
    comparison compares with: the model runs once more, not twice."""
    model = MLP().eval()
    calls = _Calls(model.fc1)
    try:
        gm = mpgraph.capture(model, torch.randn(4, 16))
    finally:
        calls.close()
    assert gm.meta[CAPTURE] == "torch.fx.symbolic_trace"
    assert calls.by_stage == {"outside": 2}


def test_calibration_of_the_example_inputs_is_capture_s_run():
    model = MLP().eval()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    calls = _Calls(model.fc1)
    try:
        mpgraph.convert(model, x, dtype="fp16", target=GPU)
        assert calls.by_stage.get("calibrate", 0) == 0
        assert calls.by_stage["capture"] == 2  # the graph's run and the eager comparison
        calls.by_stage.clear()
        mpgraph.convert(model, x, dtype="fp16", target=GPU, calibration=[x, y])
        assert calls.by_stage["calibrate"] == 1  # y only: x is the example capture ran
    finally:
        calls.close()


def _ranges(model, args, observe):
    # (ranges at the example's shapes: a static capture, about half the export's time)
    gm = mpgraph.capture(model, args, observe=observe, dynamic=False)
    gm = run_passes(prepare_pipeline(args, {}), gm)
    assert not any(OBSERVED in n.meta for n in gm.graph.nodes)  # taken, not kept
    return {n.name: n.meta.get(RANGE) for n in gm.graph.nodes}, gm.meta[REFERENCE].outputs


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt2"])
def test_ranges_taken_from_capture_are_those_of_a_calibration_run(name, request, token_ids):
    """fx route, export route, and GPT-2, whose written-out tanh GELU is fused after capture:
    the fused node takes the chain's statistics, equal to its own to float32 rounding."""
    if name == "mlp":
        model, args = MLP().eval(), (torch.randn(4, 16),)
    else:
        model, args = request.getfixturevalue(name), (token_ids[0],)
    runs = []
    run = calibrate_module.run_recording
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate_module, "run_recording", lambda *a: runs.append(1) or run(*a))
        taken, taken_out = _ranges(model, args, observe=True)
        assert runs == []  # no calibration run: capture's run was it
        ran, ran_out = _ranges(model, args, observe=False)
    assert runs == [1] and taken.keys() == ran.keys() and any(r is not None for r in taken.values())
    if name != "gpt2":
        assert taken == ran
        assert all(torch.equal(a, b) for a, b in zip(taken_out, ran_out))
        return
    # the fused GELU took the chain's statistics; it and what it feeds compute the same
    # function as the chain, to float32 rounding: the ranges agree to that rounding
    assert sum(n.startswith("gelu") for n in taken) == 2
    for n, r in taken.items():
        assert (r is None) == (ran[n] is None)
        if r is not None:
            assert r.absmax == pytest.approx(ran[n].absmax, rel=1e-4), n
            assert r.min_nonzero == pytest.approx(ran[n].min_nonzero, rel=1e-2), n
            assert r.nonfinite == ran[n].nonfinite == 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(taken_out, ran_out))


def test_a_batch_that_is_not_the_example_is_run(bert, token_ids, monkeypatch):
    """Equal values are not the same inputs: only the very objects capture ran are taken."""
    import mpgraph.passes.calibrate as calibrate
    runs = []
    run = calibrate.run_recording
    monkeypatch.setattr(calibrate, "run_recording", lambda *a: runs.append(1) or run(*a))
    ids = token_ids[0]
    ranges = []
    for batches in ([(ids,)], [(ids.clone(),)]):
        gm = mpgraph.capture(bert, (ids,), observe=True, dynamic=False)  # (only these shapes)
        gm = run_passes(prepare_pipeline((ids,), {}, calibration=batches), gm)
        ranges.append({n.name: n.meta.get(RANGE) for n in gm.graph.nodes})
    assert len(runs) == 1 and ranges[0] == ranges[1]


def _direct_stats(t):
    """tensor_stats the obvious way, in float64."""
    a = t.detach().double().abs().reshape(-1)
    finite = a[torch.isfinite(a)]
    nonzero = finite[finite > 0]
    return (float(finite.max()) if finite.numel() else 0.0,
            float(nonzero.min()) if nonzero.numel() else math.inf,
            int(a.numel() - finite.numel()))


@pytest.mark.parametrize("t", [
    torch.randn(64), torch.rand(64) + 0.1, -torch.rand(64) - 0.1, torch.zeros(8),
    torch.relu(torch.randn(100)), torch.tensor([0.0, -2.0, 0.0, 1e-30]),
    torch.tensor([float("inf"), 1.0, 0.0, -3.0]), torch.tensor([float("nan"), -1e-8, 0.0]),
    torch.randn(6, 5, 4).transpose(0, 2), torch.tensor(-0.5), torch.randn(50).half(),
    torch.relu(torch.randn(50)).bfloat16(), torch.tensor([5.0, 5.0]),
], ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_tensor_stats_is_the_direct_computation(t):
    assert tensor_stats(t) == _direct_stats(t)


def test_views_take_their_input_s_statistics_and_other_ops_are_measured():
    class M(nn.Module):
        def forward(self, x):
            h = x * 3.0
            return h.t().reshape(-1), h[:, :1], h.view(torch.int32)

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    x[0, 5] = 10.0  # the largest value outside the slice h[:, :1]
    gm = mpgraph.capture(M(), (x,))
    gm = run_passes(prepare_pipeline((x,), {}), gm)
    r = {n.name: n.meta.get(RANGE) for n in gm.graph.nodes}
    h = 3.0 * x
    assert r["t"] == r["reshape"] == r["mul"]
    assert r["getitem"].absmax == float(h[:, :1].abs().max()) != r["mul"].absmax
    assert r["view"] is None  # int32 bits: not a float value


def test_value_check_still_names_the_node_where_values_part():
    """The per-node magnitudes are measured only when the check fails, and still name the node."""
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    gm = convert_rules(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)).eval(), x,
                       dtype="bf16")
    with torch.no_grad():
        gm.meta[REFERENCE] = Reference((x,), {}, (gm(x),))
    relu = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "1")
    with gm.graph.inserting_after(relu):
        tripled = gm.graph.call_function(torch.mul, (relu, 3.0))
    tripled.meta.update(relu.meta)
    relu.replace_all_uses_with(tripled, delete_user_cb=lambda user: user is not tripled)
    gm.recompile()
    with pytest.raises(mpgraph.ConversionError, match=rf"values first part at node {tripled.name} "):
        CheckConversion((x,), {})(gm)


def test_meta_model_shapes_from_torch_export_are_those_of_a_run(monkeypatch):
    from transformers import LlamaConfig, LlamaModel
    # (one decoder layer: its shapes are those of every layer)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                      use_cache=False)
    with torch.device("meta"):
        model = LlamaModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16), device="meta")
    records = mpgraph.plan(model, ids, dtype="fp16", target="h100")
    monkeypatch.setattr(propagate, "_from_export", lambda gm, inputs: None)
    ran = mpgraph.plan(model, ids, dtype="fp16", target="h100")
    assert [(r.name, r.target, r.shape, r.dtype) for r in records.nodes] == \
        [(r.name, r.target, r.shape, r.dtype) for r in ran.nodes]


def test_load_with_types_is_the_in_memory_inference(tmp_path):
    onnx = pytest.importorskip("onnx")
    import onnx_ir as ir
    from mpgraph.tools.onnx_check import load_with_types
    path = str(tmp_path / "m.onnx")
    mpgraph.export_onnx(MLP().eval(), (torch.randn(4, 16),), path, validate=False)
    file_to_file = load_with_types(path)
    in_memory = ir.from_proto(onnx.shape_inference.infer_shapes(
        onnx.load(path, load_external_data=False), data_prop=True))

    def types(model):
        return [(v.name, v.dtype, str(v.shape)) for node in model.graph for v in node.outputs]

    assert types(file_to_file) == types(in_memory) and types(in_memory)
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # its scratch file is gone


def test_static_capture_takes_only_the_example_shape_and_says_so(bert, token_ids):
    """dynamic=False: torch.export at the example's shapes (about half the export time), the
    same values; another shape is refused by export's own input guard, which the static module
    keeps, not by some op deep inside; the default module takes the other shape."""
    ids = token_ids[0]
    dynamic = mpgraph.convert(bert, ids, dtype="fp16", target=GPU)
    static = mpgraph.convert(bert, ids, dtype="fp16", target=GPU, dynamic=False)
    sizes = lambda gm: [n for n in gm.graph.nodes if "sym_size" in str(n.target)]  # noqa: E731
    assert sizes(dynamic) and not sizes(static)
    assert static.plan.capture == "torch.export at the example's shapes"
    assert dynamic.plan.capture == "torch.export"
    assert "captured with torch.export at the example's shapes" in static.plan.summary()
    import copy
    import warnings
    with warnings.catch_warnings():  # torch's pytree deprecation noise stays off the screen
        warnings.simplefilter("error", FutureWarning)
        copy.deepcopy(dynamic)
    with torch.no_grad():
        torch.testing.assert_close(static(ids).last_hidden_state, dynamic(ids).last_hidden_state)
        shorter = ids[:, :7]
        assert dynamic(shorter).last_hidden_state.shape == (2, 7, 64)
        with pytest.raises(mpgraph.InputMismatchError, match=r"captured under: .*size\(\)\[1\] "
                           r"== 12\. It was converted with dynamic=False, for the example's "
                           r"shapes only: convert with dynamic=True"):
            static(shorter)


def test_cli_static_flag_captures_at_the_example_s_shapes(tmp_path, capsys):
    from mpgraph import cli
    factory = tmp_path / "tiny_bert.py"
    factory.write_text(
        "import torch\nfrom transformers import BertConfig, BertModel\n"
        "def build():\n    torch.manual_seed(0)\n"
        "    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,\n"
        "                     intermediate_size=64, vocab_size=100)\n"
        "    return BertModel(cfg).eval(), torch.randint(0, 100, (2, 8))\n")
    json_path = tmp_path / "plan.json"
    assert cli.main(["inspect", f"{factory}:build", "--dtype", "fp16", "--target", "a100",
                     "--static", "--json", str(json_path)]) == 0
    assert mpgraph.Plan.load(str(json_path)).capture == "torch.export at the example's shapes"


def test_value_check_of_a_simulated_plan_is_bounded_by_size_and_can_be_forced(monkeypatch):
    """A plan for another device: dtypes always proven (fake tensors); values simulated up to
    SIMULATED_VALUES_MAX_FLOPS per batch, reported as not checked above it, check="values"
    always, check="dtypes" never. A real run (the plan is for this machine) always checks."""
    import mpgraph.passes.check_conversion as check_conversion
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
    x = torch.randn(8, 64)
    small = convert_rules(model, x, dtype="fp16")  # 8x64x64x2x2 = 131 kFLOP: simulated
    assert small.plan.check["error"] <= small.plan.check["bound"]
    monkeypatch.setattr(check_conversion, "SIMULATED_VALUES_MAX_FLOPS", 1e5)  # now it is "large"
    large = convert_rules(model, x, dtype="fp16")
    assert large.plan.check["error"] is None and large.plan.check["bound"] == pytest.approx(2**-6)
    assert "0 GFLOP (check='values', or the CLI's --check values, runs it)" in \
        large.plan.check["skipped"]
    assert "dtypes checked, values not checked: the plan is for another device" in \
        large.plan.summary()
    forced = convert_rules(model, x, dtype="fp16", check="values")
    assert forced.plan.check["error"] == small.plan.check["error"]
    assert convert_rules(model, x, dtype="fp16", check="dtypes").plan.check["skipped"] == \
        "values not checked (check='dtypes')"
    assert convert_rules(model, x, dtype="fp16", check=False).plan.check is None
    here = mpgraph.convert(model, x, dtype="bf16", target="cpu", strategy="rules")
    assert here.plan.low_nodes and here.plan.check["error"] is not None  # a real run: checked
    with pytest.raises(ValueError, match="check must be one of"):
        mpgraph.convert(model, x, check="sometimes")


def test_the_dtype_check_still_catches_a_dtype_the_plan_did_not_give_when_values_are_not_run(
        monkeypatch):
    """Skipping the simulated values leaves the dtype proof: a node producing another dtype than
    planned is still an error."""
    import mpgraph.passes.check_conversion as check_conversion
    from mpgraph.ir.meta import PRECISION
    monkeypatch.setattr(check_conversion, "SIMULATED_VALUES_MAX_FLOPS", 0.0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
    x = torch.randn(8, 64)
    gm = convert_rules(model, x, dtype="fp16", check=False)
    relu = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "1")
    assert relu.meta[PRECISION].dtype == torch.float16
    relu.meta[PRECISION] = dataclasses.replace(relu.meta[PRECISION], dtype=torch.float32)
    with pytest.raises(mpgraph.ConversionError, match="does not match its plan"):
        CheckConversion((x,), {}, simulate=True)(gm)


class _BakedDropout(nn.Module):
    """Dropout hard-coded on (F.dropout(h, 0.5, True)) in a model in eval mode; int(x.shape)
    sends it down the torch.export route, which bakes the flag in."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        n = int(x.shape[-1])
        return self.l2(nn.functional.dropout(self.l1(x), 0.5, True)) * (n / 64)


class _FlagDropout(_BakedDropout):
    """Dropout that follows the model's flag (F.dropout(h, 0.5, self.training)), down the
    torch.export route, which bakes the flag in: FollowTrainingFlag makes it follow again."""

    def forward(self, x):
        n = int(x.shape[-1])
        return self.l2(nn.functional.dropout(self.l1(x), 0.5, self.training)) * (n / 64)


class _WritesThenViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(64, 64)

    def forward(self, x):
        h = self.l1(x)
        h.mul_(1e5)  # in place, then viewed: the view holds the written values
        return h.view(-1).sum()


class _ListInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, xs):
        return self.l(xs[0]) + self.l(xs[1])


def test_what_capture_s_run_cannot_stand_for_is_run_again():
    """(review of issue 18) A graph whose values a later pass changes (baked train-mode dropout
    made to follow eval), a view of a value written in place after capture measured it, and
    inputs given as a list of tensors: each measured as it is, never a stale figure."""
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    model = _FlagDropout().eval()  # mode="train" captures it training; the module evaluates
    gm = mpgraph.convert(model, x, dtype="bf16", target="cpu", strategy="rules", mode="train")
    with torch.no_grad():
        want = model.l2(model.l1(x))
        assert relative_l2(gm(x), want) < 0.01
    r = {n.name: n.meta.get(RANGE) for n in
         run_passes(prepare_pipeline((x,), {}), mpgraph.capture(_WritesThenViews().eval(), x,
                                                                 observe=True)).graph.nodes}
    view = next(v for k, v in r.items() if k.startswith("view"))
    assert view.absmax > 1e4  # after the write (was the value before it: ~2)
    xs = [torch.randn(4, 16), torch.randn(4, 16)]
    batches = [([torch.randn(4, 16), torch.randn(4, 16)],) for _ in range(2)]
    listed = mpgraph.convert(_ListInput().eval(), (xs,), dtype="fp16", target=GPU,
                             calibration=batches)
    assert listed.plan.calibration_batches == 2
    assert math.copysign(1.0, tensor_stats(torch.zeros(8))[0]) == 1.0  # no -0.0 absmax


def test_a_plan_moves_between_static_and_dynamic_captures(tmp_path):
    """export's input guard (static: the example's shapes; dynamic: the model's own conditions)
    is no node a plan must match."""
    torch.manual_seed(0)
    model, x = _BakedDropout().eval(), torch.randn(8, 64)
    for made, applied in ((True, False), (False, True)):
        plan = mpgraph.convert(model, x, dtype="fp16", target=GPU, dynamic=made,
                               strategy="rules").plan
        assert any(r.target == "_guards_fn" for r in plan.nodes)
        path = tmp_path / f"{made}.json"
        plan.save(str(path))
        again = mpgraph.convert(model, x, plan=mpgraph.Plan.load(str(path)), dynamic=applied)
        assert [r.name for r in again.plan.low_nodes] == [r.name for r in plan.low_nodes]
        assert again.plan.low_nodes


def test_convert_regenerates_the_converted_code_once_and_plan_not_at_all(monkeypatch):
    """The pipelines read graphs, not code: convert regenerates the converted module's code once
    at the end (was after every rewriting pass), plan (which drops the module) not at all."""
    import mpgraph.passes.infra as infra
    from mpgraph.ir.modules import ConvertedModule
    calls = []
    recompile = ConvertedModule.recompile
    monkeypatch.setattr(ConvertedModule, "recompile", lambda self: calls.append(1) or recompile(self))
    torch.manual_seed(0)
    model, x = _FlagDropout().eval(), torch.randn(8, 64)  # the export route: a ConvertedModule
    mpgraph.plan(model, x, dtype="fp16", target=GPU)
    planned = len(calls)
    calls.clear()
    gm = mpgraph.convert(model, x, dtype="fp16", target=GPU)
    assert len(calls) == planned + 1 and infra._pending.modules is None
    with torch.no_grad():  # and that code is the converted graph's
        want = model.l2(model.l1(x))
        assert relative_l2(gm(x), want) < 1e-2
