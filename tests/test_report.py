"""Reports, saved plans, overrides, diffs and `mpgraph inspect`."""
import copy
import dataclasses
import html
import json
import logging
import math
import os
import re
import shutil
import struct
import subprocess
import warnings
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import GPU, ConvBnReluPool, small_bert, tiny_bert

import mpgraph
from mpgraph.cli import main as cli
from mpgraph.numerics import relative_l2
from mpgraph.cost.specs import DeviceSpec
from mpgraph.tools.report import CAST_COLOUR, group_of

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


class Blocks(nn.Module):
    """Three linear+ReLU blocks: overrides by module glob have an exact, checkable effect."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return torch.softmax(self.head(x), dim=-1)


def _blocks():
    torch.manual_seed(0)
    return Blocks().eval(), torch.randn(16, 64, generator=torch.Generator().manual_seed(1))


def _small_bert():
    return small_bert(), torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))


def test_text_report_matches_the_golden_file():
    model, x = _blocks()  # planned for an A100: the estimates are data, not a measurement
    text = mpgraph.report(mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules"))
    with open(os.path.join(GOLDEN, "blocks_report.txt")) as f:
        assert text == f.read()


def test_report_formats_and_bad_input(tmp_path):
    model, x = _blocks()
    gm = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules")
    dot = mpgraph.report(gm, "dot", tmp_path / "plan.dot")
    assert dot.startswith("digraph plan {") and (tmp_path / "plan.dot").read_text() == dot
    assert dot.count("subgraph cluster_") == 5  # blocks.0, blocks.1, blocks.2, head, top level
    assert dot.count("color=red") == len({(c.value, r) for c in gm.plan.casts for r in c.consumers})
    data = mpgraph.Plan.from_dict(__import__("json").loads(mpgraph.report(gm.plan, "json")))
    assert data.to_dict() == gm.plan.to_dict()
    with pytest.raises(ValueError, match="unknown report format 'pdf'"):
        mpgraph.report(gm, "pdf")
    with pytest.raises(TypeError, match="converted module or a Plan"):
        mpgraph.report(model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mpgraph.report(gm, "html", tmp_path / "missing" / "x.html")
    with pytest.raises(ValueError, match=f"cannot write {re.escape(str(tmp_path))}: it is a "
                                         "directory; name the file to write in it"):
        mpgraph.report(gm, "html", tmp_path)  # (was a raw IsADirectoryError)


def test_saved_plan_round_trip_reproduces_the_converted_module(tmp_path):
    """Blocks of linears, a small BERT, and a CNN whose conv the ChannelsLast pass gives an
    NHWC input (a node it adds again when the plan is applied, not one the plan must match)."""
    torch.manual_seed(0)
    cnn = (ConvBnReluPool().eval(), torch.randn(4, 3, 16, 16))
    for model, x in (_blocks(), _small_bert(), cnn):
        gm = mpgraph.convert(model, x, dtype="bf16", target=GPU, strategy="rules")
        assert gm.plan.low_nodes and gm.plan.casts  # a plan with decisions to reproduce
        gm.plan.save(tmp_path / "plan.json")
        again = mpgraph.convert(model, x, plan=mpgraph.Plan.load(tmp_path / "plan.json"))
        assert again.code == gm.code
        assert [(r.name, r.dtype) for r in again.plan.nodes] == [(r.name, r.dtype) for r in gm.plan.nodes]
        with torch.no_grad():
            a, b = gm(x), again(x)
        a = a.last_hidden_state if hasattr(a, "last_hidden_state") else a
        b = b.last_hidden_state if hasattr(b, "last_hidden_state") else b
        assert torch.equal(a, b)


def test_a_plan_for_this_cpu_applied_here_is_priced_as_when_it_was_made(tmp_path, monkeypatch):
    """A CPU plan carries the CPU's name as its target; applied without target=, that name
    made it "another device": priced by the roofline (estimated 0.02x where 0.2x was measured,
    and the original said bf16 was emulated here: probe pC 7). Whichever CPU runs this, the
    applied plan's figures come from the same cost model as the original's."""
    from mpgraph.cost import measured
    # (the same cached table for both: a machine found quieter than when it measured measures
    # again, test_measured_costs' subject; under load the two had 1e-4 and 1.2e-2 s)
    monkeypatch.setattr(measured, "RELIEF", math.inf)
    model, x = _blocks()
    made = mpgraph.convert(model, x, dtype="bf16", strategy="rules")  # (this machine)
    made.plan.save(tmp_path / "plan.json")
    again = mpgraph.convert(model, x, plan=mpgraph.Plan.load(tmp_path / "plan.json"))
    assert made.plan.estimate["source"].startswith("measured on this CPU")
    assert again.plan.estimate["source"] == made.plan.estimate["source"]
    assert again.plan.estimate["fp32_s"] == made.plan.estimate["fp32_s"]  # (the cached table)


def test_an_edited_plan_is_applied(tmp_path):
    model, x = _blocks()
    gm = mpgraph.convert(model, x, dtype="bf16", target=GPU, strategy="rules")
    data = gm.plan.to_dict()
    for node in data["nodes"]:
        if node["module"] == "blocks.1.0":
            node["dtype"] = "float32"  # the user pins one linear in the JSON
    edited = mpgraph.convert(model, x, plan=mpgraph.Plan.from_dict(data))
    changed = mpgraph.diff(gm, edited).changed
    assert [(c.name, c.dtype_a, c.dtype_b) for c in changed] == [("blocks_1_0", "bfloat16", "float32")]
    # its reason says the edit, not the bf16 decision's reason alone as if it were float32's
    assert edited.plan.node("blocks_1_0").reason.startswith(
        "saved plan: edited to float32 (decided bfloat16: matrix multiply")
    # the loaded file's figures are the plan's before the edit, and its summary says so, once
    # saved again too (probe 42a: it printed the old casts and check as the edited plan's)
    loaded = mpgraph.Plan.from_dict(data)
    assert loaded.edited == {"blocks_1_0": "bfloat16"} and not edited.plan.edited
    first = ("edited by hand: blocks_1_0 bfloat16 -> float32; the casts, weights, estimate and "
             "check below are the plan's before the edit")
    assert loaded.summary().startswith(first) and "edited by hand" not in edited.plan.summary()
    assert mpgraph.Plan.from_dict(loaded.to_dict()).summary().startswith(first)
    # a weight's dtype follows its readers: an edit of it is said, not silently dropped
    weights = gm.plan.to_dict()
    weights["weights"][0]["dtype"] = "float32"
    with pytest.warns(UserWarning, match=rf"weight {re.escape(weights['weights'][0]['name'])}'s "
                      r"dtype was edited to float32, which changes nothing: a weight is stored in "
                      r"the dtype of the nodes that read it \(bfloat16 here\)"):
        assert mpgraph.Plan.from_dict(weights).weights[0].dtype == torch.bfloat16
    # the plan's dtype edited alone contradicts its nodes: the error names both and the way out
    other = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules").plan.to_dict()
    other["dtype"] = "bfloat16"
    with pytest.raises(ValueError, match=r"not a valid plan: dtype is 'bfloat16' but node \w+ is "
                       r"'float16' .* edit the nodes' \"dtype\" too, or convert the model with "
                       r"dtype='bfloat16' instead of this plan"):
        mpgraph.Plan.from_dict(other)


def test_an_edited_plan_pins_a_node_computed_from_parameters_only():
    """A saved plan's dtype is taken with the decision the rules make for it; asking the rules
    put a node computed from parameters alone (w * g) among the stored ones, the plan's float32
    for it was then overwritten, and the edited plan was a PlanMismatchError (review 40)."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64) * 0.1)
            self.g = nn.Parameter(torch.ones(64, 1) * 1.5)
            self.l = nn.Linear(64, 64)

        def forward(self, x):
            return self.l(x @ (self.w * self.g).t())

    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(8, 64)
    gm = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules")
    data = gm.plan.to_dict()
    for node in data["nodes"]:
        if node["name"] in ("mul", "t"):
            node["dtype"] = "float32"
    edited = mpgraph.convert(model, x, plan=mpgraph.Plan.from_dict(data))
    assert edited.plan.node("mul").dtype == edited.plan.node("t").dtype == "float32"
    with torch.no_grad():
        assert relative_l2(edited(x), model(x)) < 5e-3


def test_what_a_saved_plan_decides_asked_for_otherwise_is_refused_not_ignored():
    """plan= with overrides=, another mode= or another dtype= applied the plan and ignored
    the rest (logging that the overrides matched no node; a train conversion asked for came
    back frozen)."""
    model, x = _blocks()
    plan = mpgraph.convert(model, x, dtype="bf16", target=GPU, strategy="rules").plan
    for options, said in (({"overrides": {"blocks.1.*": "fp32"}}, r"overrides=\{'blocks\.1\.\*': "
                                                                  r"'fp32'\} \(edit the saved plan"),
                          ({"mode": "train"}, r"mode='train' \(the plan is for mode='inference'\)"),
                          ({"dtype": "fp16"}, r"dtype='fp16' \(the plan is bfloat16\)"),
                          # (these three were accepted and ignored too, the target relabelled)
                          ({"keep_io_types": False}, r"keep_io_types=False \(the plan keeps"),
                          ({"target": "t4"}, r"target='t4' \(the plan was made for NVIDIA A100")):
        with pytest.raises(ValueError, match=r"a saved plan is applied as it is, with its own "
                                             r"dtype, mode, target and decisions: " + said):
            mpgraph.convert(model, x, plan=plan, **options)
    assert mpgraph.convert(model, x, plan=plan, dtype="bf16", target=GPU,
                           strategy="rules").plan.dtype == torch.bfloat16
    optimal = mpgraph.convert(model, x, dtype="bf16", target=GPU).plan
    with pytest.raises(ValueError, match=r"strategy='rules' \(the plan was made by "
                                         r"strategy='optimal'\)"):
        mpgraph.convert(model, x, plan=optimal, strategy="rules")
    # the other way round too: a training plan applied with mode="inference" came back a
    # training module, without a word (mode's default could not be told from it: probe pA 8)
    trained = mpgraph.convert(model, x, dtype="bf16", target=GPU, strategy="rules",
                              mode="train").plan
    with pytest.raises(ValueError, match=r"mode='inference' \(the plan is for mode='train'\)"):
        mpgraph.convert(model, x, plan=trained, mode="inference")
    again = mpgraph.convert(model, x, plan=trained)  # (mode not given: the plan's)
    assert again.plan.mode == "train" and all(p.requires_grad and p.dtype == torch.float32
                                              for p in again.parameters())


def test_a_plan_made_in_training_mode_applied_in_eval_mode_says_so():
    """The mismatch listed nodes (dropout, contiguous) without the cause: the model's mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 64))
    x = torch.randn(16, 64)
    with pytest.warns(UserWarning, match="is in training mode"):
        plan = mpgraph.convert(model.train(), x, dtype="bf16", target=GPU).plan  # (dropout kept)
    with pytest.raises(mpgraph.PlanMismatchError, match=r"the plan was made from the model in "
                                                        r"training mode .*\(model\.train\(\)\)"):
        mpgraph.convert(model.eval(), x, plan=plan)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_plan_applied_to_the_model_in_another_dtype_says_so_once(dtype):
    # before: a line per node, "fc1: the plan says float16, the conversion gave None (no float32
    # tensors)", never naming the model's dtype nor model.float() (probe pC 11)
    model, x = _blocks()
    plan = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules").plan
    other = copy.deepcopy(model).to(dtype)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(mpgraph.PlanMismatchError) as err:
            mpgraph.convert(other, x.to(dtype), plan=plan)
    lines = err.value.mismatches
    assert lines[0] == (f"Blocks computes in {str(dtype)[6:]}, not float32: the plan decides its "
                        "float32 nodes, and those nodes have none here. Apply it to the model in "
                        "float32: mpgraph.convert(model.float(), inputs, plan=plan), with float32 "
                        "inputs")
    assert sum("computes in" in line for line in lines) == 1
    assert len(lines) == 1 + len(plan.compute_nodes)  # (then each node, as before)
    assert not [w for w in said if "computes in" in str(w.message)]  # (the error says it)
    again = mpgraph.convert(other.float(), x, plan=plan)  # the way out applies it
    assert [(r.name, r.dtype) for r in again.plan.nodes] == [(r.name, r.dtype) for r in plan.nodes]

def test_a_plan_for_another_model_is_a_clear_error():
    model, x = _blocks()
    plan = mpgraph.convert(model, x, dtype="bf16", target=GPU).plan
    with pytest.raises(mpgraph.PlanMismatchError) as err:
        mpgraph.convert(model, torch.randn(4, 64), plan=plan)  # other shapes
    assert "shape (4, 64), the plan has (16, 64)" in str(err.value)
    assert "a plan is made for the shapes of the inputs it was made with" in str(err.value)
    bert, ids = _small_bert()
    with pytest.raises(mpgraph.PlanMismatchError, match="is not in the plan"):
        mpgraph.convert(bert, ids, plan=plan, dynamic=False)  # (refused: a static capture)
    with pytest.raises(ValueError, match="not an mpgraph plan"):
        mpgraph.Plan.from_dict({"nodes": []})
    with pytest.raises(FileNotFoundError, match="no plan file"):
        mpgraph.Plan.load("/nonexistent/plan.json")


def test_override_by_module_glob_changes_exactly_the_matched_nodes():
    model, x = _blocks()
    base = mpgraph.convert(model, x, dtype="bf16", strategy="rules", target=GPU)
    pinned = mpgraph.convert(model, x, dtype="bf16", strategy="rules",
                             overrides={"blocks.1.*": "fp32"}, target=GPU)
    changed = {c.name for c in mpgraph.diff(base, pinned).changed}
    matched = {r.name for r in base.plan.compute_nodes if r.module.startswith("blocks.1.")}
    assert changed == matched == {"blocks_1_0", "blocks_1_1"}
    for name in matched:
        assert pinned.plan.node(name).reason == "user override ('blocks.1.*')"


def test_override_by_op_and_by_class_and_precedence():
    model, x = _blocks()
    gm = mpgraph.convert(model, x, dtype="bf16", strategy="rules", target=GPU,
                         overrides={"op:nn.ReLU": "fp32"})
    relus = [r for r in gm.plan.compute_nodes if r.module.endswith(".1")]
    assert len(relus) == 3 and all(r.dtype == "float32" for r in relus)
    gm = mpgraph.convert(model, x, dtype="bf16", strategy="rules",
                         overrides={"class:tensor_core": "fp32", "blocks.2.0": "bf16"}, target=GPU)
    assert gm.plan.node("blocks_0_0").dtype == gm.plan.node("head").dtype == "float32"
    assert gm.plan.node("blocks_2_0").dtype == "bfloat16"  # a module path beats an op class


def test_an_op_override_by_the_op_table_s_name_matches_under_either_capture():
    """'op:' matched the op as captured: nn.ReLU under torch.fx, aten.relu under torch.export;
    'op:relu' (and the ONNX hint's 'op:*max_pool*' for nn.MaxPool2d) matched nothing under
    torch.fx. The op table's name of the op matches under both."""
    model, x = _blocks()
    for capture in ({}, {"mode": "train"}):  # (training captures with torch.export)
        gm = mpgraph.convert(model, x, dtype="bf16", strategy="rules", target=GPU,
                             overrides={"op:relu": "fp32"}, **capture)
        relus = [r for r in gm.plan.compute_nodes if r.module.endswith(".1")]
        assert len(relus) == 3 and all(r.dtype == "float32" for r in relus), gm.plan.capture
    # and by the module class, as README's "op:nn.Linear": it matched nothing under torch.export
    # (the aten.linear inside an nn.Linear: probe pC 9)
    for capture in ({}, {"mode": "train"}):
        gm = mpgraph.convert(model, x, dtype="bf16", strategy="rules", target=GPU,
                             overrides={"op:nn.Linear": "fp32"}, **capture)
        linears = [r for r in gm.plan.compute_nodes if r.op_class == "tensor_core"]
        assert len(linears) == 4 and all(r.dtype == "float32" for r in linears), gm.plan.capture


class GeluMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(F.gelu(self.fc(torch.matmul(x, self.w))))


def test_an_aten_op_override_matches_the_op_under_torch_fx_too(caplog):
    """README's 'op:aten.gelu*' matched nothing in a graph mpgraph captured with torch.fx (the
    capture it picks, not the user), and the warning said no such node was there (probe pM 2):
    an 'op:aten.<name>' key now means the op torch.export would record for the call."""
    torch.manual_seed(0)
    model, x = GeluMatmul().eval(), torch.randn(8, 64)
    for key, node in [("op:aten.gelu*", "gelu"), ("op:aten.matmul", "matmul"),
                      ("op:aten.linear", "fc"), ("op:aten.relu", "relu")]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mpgraph"):
            gm = mpgraph.convert(model, x, dtype="bf16", strategy="rules", target=GPU,
                                 overrides={key: "fp32"})
        assert gm.plan.capture == "torch.fx.symbolic_trace"
        assert gm.plan.node(node).dtype == "float32", key
        assert gm.plan.node(node).reason == f"user override ({key!r})"
        assert "matched no node" not in caplog.text
    # a key naming no op of the graph still warns, and lists the names that would match
    with caplog.at_level(logging.WARNING, logger="mpgraph"):
        mpgraph.convert(model, x, dtype="bf16", strategy="rules", target=GPU,
                        overrides={"op:aten.mm": "fp32"})
    assert "override 'op:aten.mm' matched no node" in caplog.text
    assert "the graph's ops, by the names an 'op:' key takes under either capture: gelu, " \
           "linear, matmul, relu" in caplog.text


class SharedBlock(nn.Module):
    """A block applied twice, the second time by an alias (self.shared = self.blocks[1]); the
    forward reads x.shape[0] where ``export`` asks, which only torch.export traces."""

    def __init__(self, export: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2))
        self.shared, self.head, self.export = self.blocks[1], nn.Linear(64, 8), export
        self.act = self.blocks[0][1]  # (a parameterless one: torch.export's graph does not hold it)

    def forward(self, x):
        if self.export and x.shape[0] == 1:
            x = x * 2
        for b in self.blocks:
            x = b(x)
        return self.act(self.head(self.shared(x)))


def test_an_override_by_a_submodule_s_alias_covers_the_module_as_its_path_does(caplog):
    """overrides={"shared": "fp32"} for self.shared = self.blocks[1] matched no node under
    torch.fx (the graph names the module blocks.1) and only the alias's call under torch.export,
    where "blocks.1" missed that call (probe pM 6). Either name is the module: both calls."""
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    # the modules of the nodes each key pins: each module is called twice, and torch.export
    # records the alias's call under the alias
    block = {False: ["blocks.1.0", "blocks.1.0", "blocks.1.1", "blocks.1.1"],
             True: ["blocks.1.0", "blocks.1.1", "shared.0", "shared.1"]}
    fc = {False: ["blocks.1.0", "blocks.1.0"], True: ["blocks.1.0", "shared.0"]}
    act = {False: ["blocks.0.1", "blocks.0.1"], True: ["act", "blocks.0.1"]}
    for export, capture in [(False, "torch.fx.symbolic_trace"), (True, "torch.export")]:
        model = SharedBlock(export).eval()
        for key, modules in [("shared", block), ("blocks.1", block), ("shared.0", fc),
                             ("blocks.1.0", fc), ("act", act), ("blocks.0.1", act)]:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="mpgraph"):
                gm = mpgraph.convert(model, x, dtype="bf16", strategy="rules", target=GPU,
                                     overrides={key: "fp32"})
            assert gm.plan.capture == capture
            named = [r for r in gm.plan.compute_nodes if r.reason == f"user override ({key!r})"]
            assert sorted(r.module for r in named) == modules[export], (capture, key)
            assert all(r.dtype == "float32" for r in named)
            assert "matched no node" not in caplog.text


def test_override_that_matches_nothing_is_a_warning_naming_it(caplog):
    model, x = _blocks()
    with caplog.at_level(logging.WARNING, logger="mpgraph"):
        mpgraph.convert(model, x, dtype="bf16", overrides={"encoder.layr.*": "fp32"}, target=GPU)
    assert any("'encoder.layr.*' matched no node" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16"):
        mpgraph.convert(model, x, dtype="bf16", overrides={"head": "int8"}, target=GPU)


def test_override_that_matches_nothing_is_warned_once_per_convert(caplog):
    """The dtype left to the cost model, the decisions run once per candidate (float16 and
    bfloat16 on an A100) and then for the plan: the warning came three times."""
    model, x = _blocks()
    with caplog.at_level(logging.WARNING, logger="mpgraph"):
        mpgraph.convert(model, x, overrides={"encoder.layr.*": "fp32"}, target=GPU)
    assert [r.getMessage() for r in caplog.records].count(
        "override 'encoder.layr.*' matched no node that decides a precision (keys: node names, "
        "'node:<name>', module paths or globs, 'op:<glob>', 'class:<op class>')") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mpgraph"):  # another convert: warned again
        mpgraph.convert(model, x, overrides={"encoder.layr.*": "fp32"}, target=GPU)
    assert sum("'encoder.layr.*' matched no node" in r.getMessage() for r in caplog.records) == 1


class PoolRelu(nn.Module):
    def forward(self, x):
        x = F.max_pool2d(torch.relu(x), 2)
        return F.max_pool2d(torch.sigmoid(x), 2)


def test_report_names_ops_as_the_model_calls_them_not_their_wrappers():
    """torch.relu read torch._VariableFunctions (its C binding, cut at 24 characters) and
    F.max_pool2d F.boolean_dispatch.<loca (the wrapper boolean_dispatch makes)."""
    gm = mpgraph.convert(PoolRelu(), torch.randn(2, 8, 16, 16), dtype="fp16", target=GPU,
                         strategy="rules")
    text = mpgraph.report(gm)
    rows = [line.split() for line in text.splitlines()]
    ops = {row[0]: row[1] for row in rows
           if row and row[0] in ("relu", "max_pool2d", "sigmoid", "max_pool2d_1")}
    assert ops == {"relu": "torch.relu", "max_pool2d": "F.max_pool2d", "sigmoid": "torch.sigmoid",
                   "max_pool2d_1": "F.max_pool2d"}, text
    for fmt in ("text", "html", "dot"):
        shown = mpgraph.report(gm, fmt)
        assert "_VariableFunctions" not in shown and "boolean_dispatch" not in shown, fmt


def test_diff_of_two_targets_lists_every_changed_node():
    bert, ids = _small_bert()
    # a T4 run eagerly (host-bound at this size: little pays for its casts) against an A100
    # replayed from CUDA graphs (kernel time only: every matmul pays)
    # (plans compared at the example's shapes: static captures)
    # (the plans' dtypes are the point, not the value check's figures: check="dtypes")
    t4 = mpgraph.convert(bert, ids, dtype="fp16", target="t4", dynamic=False, check="dtypes")
    a100 = mpgraph.convert(bert, ids, dtype="fp16", target=GPU, runtime="graphs", dynamic=False,
                           check="dtypes")
    d = mpgraph.diff(t4, a100)
    changed = {c.name for c in d.changed}
    assert len(changed) > 10 and "linear_12" in changed, str(d)
    for r in t4.plan.compute_nodes:
        other = a100.plan.node(r.name).dtype
        assert (r.dtype != other) == (r.name in changed)
    assert str(d).startswith("A: float16 on NVIDIA T4 (optimal)")


def test_summary_says_the_dtype_choice_s_estimates_came_before_the_tolerance_pins():
    """With tolerance= and the dtype left to the cost model, the summary said "estimated 4.00x
    ...; float16 chosen by the cost model (estimated float16 0.0274 ms, bfloat16 0.0274 ms)"
    beside a plan of 0.0710 ms: the choice's figures are of the plans before the pins."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256),
                      nn.Linear(256, 256)).eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(64, 256, generator=g) for _ in range(3)]
    # (all float16: error 6.2e-4; the search pins a matmul to meet 5e-4)
    plan = mpgraph.convert(m, batches[0], target=GPU, runtime="graphs", calibration=batches,
                           tolerance=5e-4, dynamic=False).plan  # (never called: static capture)
    assert plan.tolerance["pinned"] and plan.low_nodes
    chosen = plan.dtype_choice["estimates_s"]
    assert plan.estimate["plan_s"] > chosen["float16"] * 1.5
    figures = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in chosen.items())
    said = f"chosen by the cost model (estimated before the tolerance search's pins: {figures})"
    assert said in plan.summary()
    unpinned = dataclasses.replace(plan, tolerance={**plan.tolerance, "pinned": []})
    assert f"chosen by the cost model (estimated {figures})" in unpinned.summary()


def test_a_gpu_s_float16_taken_by_rule_is_not_said_to_be_the_cost_model_s_choice():
    """A GPU plan takes float16 (bf16 beside it where fp16's range keeps a node out) whatever
    the estimates, whose comparison prices those nodes as float32; the summary said "float16
    chosen by the cost model (estimated float16 0.102 ms, bfloat16 0.049 ms)" (probe pC 6).
    Where fp16 is also the estimate's choice, it says so as before."""
    class Wide(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)
            self.ln, self.scale = nn.LayerNorm(256), scale

        def forward(self, x):
            return self.c(self.ln(self.b(self.a(x) * self.scale)))

    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    for scale, by_rule in ((60000.0, True), (1.0, False)):  # (beyond fp16's range, within it)
        torch.manual_seed(0)
        plan = mpgraph.convert(Wide(scale).eval(), x, target=GPU).plan
        estimates = plan.dtype_choice["estimates_s"]
        assert plan.dtype == torch.float16
        assert (estimates["float16"] > 1.02 * estimates["bfloat16"]) == by_rule, estimates
        figures = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in estimates.items())
        said = (f"float16 as on every GPU, not the estimate's choice ({figures}): its Tensor "
                "Cores run fp16 at bf16's rate" if by_rule else
                f"float16 chosen by the cost model (estimated {figures})")
        assert said in plan.summary()
        assert ("chosen by the cost model" in plan.summary()) != by_rule


def test_diff_heads_a_plan_that_converted_nothing_float32_as_the_report_does():
    """A plan keeps its low dtype where it converted nothing: diff headed such a plan
    "A: bfloat16 on ..." where the report said "mpgraph plan: float32 on ..."."""
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
    x = torch.randn(8, 64)
    kept = mpgraph.convert(m, x, dtype="bf16", target=GPU, overrides={"*": "fp32"})
    low = mpgraph.convert(m, x, dtype="fp16", target=GPU, strategy="rules")
    assert not kept.plan.low_nodes and kept.plan.dtype == torch.bfloat16
    assert mpgraph.report(kept).startswith("mpgraph plan: float32 on ")
    assert str(mpgraph.diff(kept, low)).splitlines()[:2] == [
        f"A: float32 on {kept.plan.target} (optimal)", f"B: float16 on {low.plan.target} (rules)"]


@pytest.fixture(scope="module")
def bert_a100():
    """The small BERT (captured with torch.export) planned in float16 for an A100."""
    bert, ids = _small_bert()
    # (its reports only, never called at other shapes: a static capture)
    return mpgraph.convert(bert, ids, dtype="fp16", target=GPU, runtime="graphs", dynamic=False)


def _html_sections(page: str) -> list[tuple[str, int, bool]]:
    """(title, cast count, open) of each module section of an HTML report, in page order."""
    return [(title, int(n), bool(is_open)) for n, is_open, title in re.findall(
        r'<details id="s\d+" class="section[^"]*" data-casts="(\d+)"( open)?><summary>(.*?) — ', page)]


def test_html_report_opens_the_sections_with_casts_and_groups_dropout_by_module(bert_a100):
    gm, plan = bert_a100, bert_a100.plan
    assert plan.capture == "torch.export at the example's shapes"
    # an inference conversion of a model in eval mode keeps no dropout (PruneForInference)
    assert not [r for r in plan.nodes if "dropout" in r.name]
    # in training mode FollowTrainingFlag's dropout_N_mode modules stay, listed under the
    # module they stand for
    bert, ids = _small_bert()
    with pytest.warns(UserWarning, match="in training mode"):
        trained = mpgraph.convert(bert.train(), ids, dtype="fp16", target=GPU,
                                  dynamic=False)  # (its report only: a static capture)
    nodes = {n["name"]: n for n in json.loads(mpgraph.report(trained, "json"))["nodes"]}
    dropouts = {name for name in nodes if re.fullmatch(r"dropout(_\d+)?_mode", name)}
    assert dropouts == {"dropout_mode"} | {f"dropout_{i}_mode" for i in range(1, 5)}
    assert nodes["dropout_mode"]["module"] == "embeddings.dropout"
    for name in sorted(dropouts - {"dropout_mode"}):
        assert re.fullmatch(r"encoder\.layer\.[01]\.(attention\.output|output)\.dropout",
                            nodes[name]["module"]), (name, nodes[name]["module"])
    page = mpgraph.report(gm, "html")
    sections = _html_sections(page)
    assert [t for t, _, _ in sections] == ["(top level)", "embeddings", "encoder.layer.0",
                                           "encoder.layer.1", "pooler"]  # no one-node dropout sections
    read_in: dict = {}  # section -> the casts its nodes read, from the plan
    for c in plan.casts:
        for reader in c.consumers:
            read_in.setdefault(group_of(plan.node(reader)), set()).add(c.name)
    for title, n, is_open in sections:
        assert n == len(read_in.get(title, ())), title
        assert is_open == (n > 0), f"{title}: {n} casts, open={is_open}"  # casts open, the rest folded
    assert sum(n for _, n, _ in sections) == len(plan.casts) == 10
    assert "encoder.layer.0 — <span class=\"badge\">4 casts</span>" in page
    # every edge is an arrow; each cast on an edge is a thick red arrow labelled with its direction
    edges = re.findall(r"<path d=\"M[^>]*stroke=[^>]*>", page)  # not the arrowheads
    assert edges and all("marker-end=\"url(#" in e for e in edges)
    red = [e for e in edges if f'stroke="{CAST_COLOUR}"' in e]
    drawn_readers = sum(len(c.consumers) for c in plan.casts)
    assert len(red) == drawn_readers + 1  # each (cast, reader) edge, and the legend's sample
    assert page.count("f32\u2192f16") >= 5 and page.count("f16\u2192f32") >= 5
    # drawings scale down to the page width
    svgs = re.findall(r'<svg xmlns="http://www.w3.org/2000/svg" class="graph"[^>]*>', page)
    assert len(svgs) == len(sections) and all("viewBox=" in s for s in svgs)
    assert "svg.graph{display:block;max-width:100%;height:auto" in page
    # the cast colour is used for casts only: no other style names it
    assert CAST_COLOUR not in page.split("<body>")[0]


def _png_pixels(path):
    """(width, height, rows) of an 8-bit RGB/RGBA PNG, decoded here (no Pillow): rows[y] holds the
    row's pixels as RGB bytes."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert depth == 8 and colour in (2, 6)
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line) if bpp == 3 else bytes(v for i, v in enumerate(line) if i % 4 != 3))
        prev = line
    return width, height, rows


def _cast_red(rows) -> torch.Tensor:
    """A (height, width) mask of the pixels drawn in the cast colour (#e00000, antialiased edges
    excluded): nothing else on the page is that red."""
    rgb = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).view(len(rows), -1, 3).int()
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return (r >= 190) & (g <= 60) & (b <= 60)


_CHROMIUM = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run"]
# measures the page after layout and leaves the numbers on <body> for --dump-dom
_GEOMETRY = """<script>(function(){var d=document.documentElement,out={w:innerWidth,
scroll_w:d.scrollWidth,sections:[],right:0};
document.querySelectorAll('details.section').forEach(function(s){var r=s.getBoundingClientRect();
out.sections.push({title:s.querySelector('summary').textContent,top:r.top,bottom:r.bottom,
left:r.left,right:r.right,casts:+s.dataset.casts,open:s.open});});
document.querySelectorAll('svg,table').forEach(function(e){
out.right=Math.max(out.right,e.getBoundingClientRect().right);});
document.body.setAttribute('data-geometry',JSON.stringify(out));})();</script>"""


def test_html_report_of_bert_renders_in_headless_chromium(tmp_path, request):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium)")
    width, height = 1400, 1800
    gm = request.getfixturevalue("bert_a100")  # after the skip: no conversion without a browser
    page = tmp_path / "bert.html"
    text = mpgraph.report(gm, "html", page)
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no network
    assert "https://" not in text

    def chromium(*args) -> str:
        return subprocess.run([browser, *_CHROMIUM, f"--user-data-dir={tmp_path / 'profile'}",
                               f"--window-size={width},{height}", *args],
                              check=True, capture_output=True, text=True, timeout=120).stdout

    measured = tmp_path / "measured.html"
    measured.write_text(text.replace("</body>", _GEOMETRY + "</body>"), encoding="utf-8")
    dom = chromium("--dump-dom", measured.as_uri())
    geometry = json.loads(html.unescape(re.search(r'data-geometry="([^"]*)"', dom).group(1)))
    assert geometry["w"] == width
    assert geometry["scroll_w"] <= width and geometry["right"] <= width  # nothing wider than the page

    shot = tmp_path / "bert.png"
    chromium(f"--screenshot={shot}", page.as_uri())
    w, h, rows = _png_pixels(shot)
    assert (w, h) == (width, height)
    assert len({row[i:i + 3] for row in rows[::8] for i in range(0, w * 3, 24)}) >= 8  # not blank
    red = _cast_red(rows)
    sections = geometry["sections"]
    first = min(s["top"] for s in sections)
    seen = {}  # section title -> red pixels of it on the first screen
    for s in sections:
        box = red[max(0, int(s["top"])):max(0, min(h, int(s["bottom"]))),
                  max(0, int(s["left"])):min(w, int(s["right"]))]
        seen[s["title"]] = int(box.sum())
        if not s["casts"]:
            assert not s["open"] and seen[s["title"]] == 0, s  # folded, no red
    on_screen = [s["title"] for s in sections if s["casts"] and s["top"] < height - 100]
    assert len(on_screen) >= 2, seen  # several sections with casts start on the first screen ...
    assert all(seen[t] >= 40 for t in on_screen), seen  # ... and each shows its casts there
    # the red above the sections is the summary's legend only; nothing red elsewhere
    outside = int(red.sum()) - sum(seen.values())
    assert 0 < int(red[:int(first)].sum()) == outside < 400, outside


def test_cli_inspect_writes_every_format(tmp_path, capsys):
    factory = tmp_path / "factory.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n"
                       "    torch.manual_seed(0)\n"
                       "    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), "
                       "torch.randn(16, 64)\n")
    html_path, json_path, dot_path = tmp_path / "p.html", tmp_path / "p.json", tmp_path / "p.dot"
    assert cli(["inspect", f"{factory}:build", "--dtype", "fp16", "--target", "a100", "--html",
                str(html_path), "--json", str(json_path), "--dot", str(dot_path)]) == 0
    out = capsys.readouterr().out
    assert "== totals ==" in out and f"wrote {html_path}" in out
    assert mpgraph.Plan.load(json_path).dtype == torch.float16
    assert html_path.read_text().startswith("<!DOCTYPE html>")
    assert cli(["inspect", f"{factory}:build", "--html", str(tmp_path / "no" / "x.html")]) == 2


def test_a_plan_the_overrides_keep_float32_says_so_not_that_nothing_is_faster():
    """overrides={"*": "fp32"} gave "kept float32: no node is faster in float16 or bfloat16 than
    in float32", a false reason beside each node's own ("user override ('*')")."""
    model, x = _blocks()
    plan = mpgraph.convert(model, x, target=GPU, overrides={"*": "fp32"}).plan
    assert "kept float32: the overrides keep every matmul/conv in float32 ('*')" in plan.summary()
    assert "no node is faster" not in plan.summary()


def test_a_plan_whose_low_dtype_was_never_timed_says_so_in_strict_json(tmp_path):
    """A low dtype this CPU emulates is not timed (inf seconds): the summary printed 'estimated
    0.00x float32 speed' and the JSON report held the token Infinity, which strict readers
    (JavaScript's JSON.parse) refuse (probe 43b)."""
    model, x = _blocks()
    gm = mpgraph.convert(model, x, dtype="bf16", target=GPU, strategy="rules")
    record = gm.plan.nodes[1]
    plan = dataclasses.replace(
        gm.plan, estimate={**gm.plan.estimate, "plan_s": math.inf},
        nodes=[dataclasses.replace(r, t_low=math.inf) if r is record else r for r in gm.plan.nodes])
    text = plan.summary()
    assert "0.00x" not in text and "no speed estimate: bfloat16 is emulated on this" in text
    assert mpgraph.report(plan).splitlines()[-1].startswith("estimated speed-up: not estimated")
    data = json.loads(mpgraph.report(plan, "json"), parse_constant=lambda c: pytest.fail(c))
    assert data["estimate"]["plan_s"] is None and data["nodes"][1]["t_low"] is None
    assert "no speed estimate" in mpgraph.Plan.from_dict(data).summary()


def test_a_plan_that_converted_nothing_is_headed_float32():
    """'mpgraph plan: bfloat16 on CPU ...' headed an all-float32 plan (probe 43b)."""
    model, x = _blocks()
    slow = DeviceSpec("old CPU", "cpu", {"fp32": 100e9, "bf16": 1e9, "fp16": 1e9},
                              20e9, 4, 1e-6)
    gm = mpgraph.convert(model, x, target=slow)
    assert not gm.plan.low_nodes
    assert mpgraph.report(gm).startswith("mpgraph plan: float32 on old CPU")
    assert "<h1>mpgraph plan: float32 on old CPU</h1>" in mpgraph.report(gm, "html")


class _Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        if x.shape[1] > 4:  # a branch on a shape: captured by torch.export, as HF models are
            x = x * 1.0
        return x + self.fc2(F.gelu(self.fc1(x)))


class _Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(layers))
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _stack(layers=2):
    torch.manual_seed(0)
    return _Stack(layers).eval(), torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))


def test_override_by_module_path_covers_its_submodules_and_the_deeper_key_wins():
    # before: {"layers.0": "fp32"} pinned only the gelu and add called in layers.0 itself; its
    # Linears layers.0.fc1/fc2 stayed float16 without a word
    model, x = _stack()
    gm = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules",
                         overrides={"layers.0": "fp32", "layers.0.fc2": "low"})
    under = {r.name: r for r in gm.plan.compute_nodes
             if r.module == "layers.0" or r.module.startswith("layers.0.")}
    fc1 = [r for r in under.values() if r.module == "layers.0.fc1"]
    fc2 = [r for r in under.values() if r.module == "layers.0.fc2"]
    assert fc1 and all(r.dtype == "float32" and r.reason == "user override ('layers.0')"
                       for r in fc1)
    assert fc2 and all(r.dtype == "float16" and r.reason == "user override ('layers.0.fc2')"
                       for r in fc2)
    assert [r.dtype for r in gm.plan.compute_nodes if r.module == "layers.1.fc1"] == ["float16"]


def test_override_naming_a_module_and_a_node_applies_to_the_module_and_says_so(caplog):
    # torch.export names the first aten.linear "linear": a key meant for the module `linear`
    # also pinned the node of that name (module proj), silently
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.linear = nn.Linear(64, 128), nn.Linear(128, 64)

        def forward(self, x):
            h = F.gelu(self.proj(x))
            if x.shape[1] > 4:
                h = h * 0.5
            return self.linear(h)

    torch.manual_seed(0)
    model, x = Head().eval(), torch.randn(2, 8, 64)
    with caplog.at_level(logging.WARNING, logger="mpgraph"):
        gm = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules",
                             overrides={"linear": "fp32"})
    by_module = {r.module: r for r in gm.plan.compute_nodes if r.op_class == "tensor_core"}
    assert by_module["proj"].name == "linear" and by_module["proj"].dtype == "float16"
    assert by_module["linear"].dtype == "float32"
    assert any("override 'linear' is a module path and also the name of node 'linear' (of "
               "module 'proj')" in r.getMessage() and "'node:linear' is the node" in r.getMessage()
               for r in caplog.records)
    gm = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules",
                         overrides={"node:linear": "fp32"})
    by_module = {r.module: r for r in gm.plan.compute_nodes if r.op_class == "tensor_core"}
    assert by_module["proj"].dtype == "float32" and by_module["linear"].dtype == "float16"


class _SwiGLU(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        a, b = self.up(x).chunk(2, -1)
        return self.down(F.silu(a) * b)


def _edited_plan(model, x, tmp_path, node: str, dtype: str) -> "mpgraph.Plan":
    """The model's fp16 rules plan for an A100, saved, one node's dtype edited, loaded."""
    path = str(tmp_path / "plan.json")
    mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules").plan.save(path)
    saved = json.load(open(path))
    for n in saved["nodes"]:
        if n["name"] == node:
            n["dtype"] = dtype
    json.dump(saved, open(path, "w"))
    return mpgraph.Plan.load(path)


def test_an_item_of_a_multi_output_op_takes_its_dtype_under_overrides_and_edited_plans(
        caplog, tmp_path):
    # before: an item decided apart from its op (an override, or a saved plan whose chunk was
    # edited to float32) was a ConversionError "getitem: produced torch.float32, plan says
    # torch.float16"
    torch.manual_seed(0)
    model, x = _SwiGLU().eval(), torch.randn(4, 16, 64)
    ref = model(x)
    with caplog.at_level(logging.WARNING, logger="mpgraph"):
        gm = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules",
                             overrides={"chunk": "fp32", "getitem": "low"})
    assert [gm.plan.node(n).dtype for n in ("chunk", "getitem", "getitem_1")] == ["float32"] * 3
    assert any("getitem: user override ('getitem') to float16 not applied: an item of chunk "
               "comes out in its dtype (float32); decide chunk" in r.getMessage()
               for r in caplog.records)
    assert relative_l2(gm(x), ref) < 4e-3
    edited = mpgraph.convert(model, x, plan=_edited_plan(model, x, tmp_path, "chunk", "float32"))
    assert [edited.plan.node(n).dtype for n in ("chunk", "getitem", "getitem_1", "silu")] \
        == ["float32", "float32", "float32", "float16"]
    assert relative_l2(edited(x), ref) < 4e-3


def test_diff_of_two_versions_of_a_model_pairs_nodes_by_module_not_by_name():
    # torch.export names nodes by op counter: with a layer more, the head's linear_4 is
    # linear_6, and linear_4 is layers.2.fc1. Paired by name the diff said "0 nodes changed
    # precision" where the head went float16 -> float32
    (two, x), (three, _) = _stack(2), _stack(3)
    a = mpgraph.convert(two, x, dtype="fp16", target=GPU, strategy="rules").plan
    b = mpgraph.convert(three, x, dtype="fp16", target=GPU, strategy="rules",
                        overrides={"head": "fp32"}).plan
    d = mpgraph.diff(a, b)
    assert [(c.name, c.name_b, c.dtype_a, c.dtype_b) for c in d.changed] \
        == [("linear_4", "linear_6", "float16", "float32")]
    assert "linear_4 (B: linear_6) [head]: float16 -> float32" in str(d)
    assert sorted(d.only_b) == sorted(r.name for r in b.compute_nodes
                                      if r.module.startswith("layers.2"))
    assert d.only_a == []


def test_summary_counts_a_node_edited_to_the_other_low_dtype_as_an_edit(tmp_path):
    # before: "1 nodes in bfloat16 where float16 overflows" for a node the user edited
    model, x = _blocks()
    edited = _edited_plan(model, x, tmp_path, "head", "bfloat16")
    summary = mpgraph.convert(model, x, plan=edited).plan.summary()
    assert "1 nodes in bfloat16 by overrides or edits" in summary
    assert "overflows" not in summary


def test_a_plan_file_with_a_node_twice_or_a_dtype_edited_to_null_is_refused(tmp_path):
    # before: a node twice loaded and failed later as "the plan says float16, the conversion
    # gave float32"; a dtype edited to null was shown as an edit and then decided anew, silently
    model, x = _blocks()
    path = str(tmp_path / "plan.json")
    mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules").plan.save(path)
    saved = json.load(open(path))
    head = next(n for n in saved["nodes"] if n["name"] == "head")
    json.dump({**saved, "nodes": saved["nodes"] + [dict(head, dtype="float32")]}, open(path, "w"))
    with pytest.raises(ValueError, match=r"is not a valid plan: node head has 2 records"):
        mpgraph.Plan.load(path)
    json.dump({**saved, "nodes": [dict(n, dtype=None) if n["name"] == "head" else n
                                  for n in saved["nodes"]]}, open(path, "w"))
    with pytest.raises(ValueError, match=r"node head: dtype edited to null from 'float16'"):
        mpgraph.Plan.load(path)


def test_an_edit_of_an_input_output_or_parameter_record_is_refused(tmp_path):
    # before: "edited by hand: x float32 -> float16, output None -> float16" on load, then
    # applied without them, silently (float32 in, float32 out: probe pC 8)
    model, x = _blocks()
    saved = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules").plan.to_dict()
    for name, was, why in (
            ("x", "'float32'", "a graph input is taken in the dtype it is given"),
            ("output", "None", "the graph output returns what its nodes compute")):
        data = {**saved, "nodes": [dict(n, dtype="float16") if n["name"] == name else n
                                   for n in saved["nodes"]]}
        with pytest.raises(ValueError, match=(
                rf"not a valid plan: node {name}: dtype edited to 'float16' from {was}, but "
                rf"{why}.* a plan does not decide it. Convert without plan= and with "
                r"keep_io_types=False for outputs in the low dtype")):
            mpgraph.Plan.from_dict(data)
    train = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules",
                            mode="train").plan.to_dict()
    weight = next(n for n in train["nodes"] if n["op"] == "get_attr")
    weight["dtype"] = "float16"
    with pytest.raises(ValueError, match=rf"node {weight['name']}: dtype edited to 'float16' from "
                       r"'float32', but a parameter or buffer is stored in the dtype of the nodes "
                       r"that read it: a plan does not decide it. Edit the \"dtype\" of the nodes "
                       r"that read it instead"):
        mpgraph.Plan.from_dict(train)


def _html_counts(plan) -> list[tuple[str, int, int]]:
    """(title, nodes, low nodes) of each section of the plan's HTML report."""
    return [(html.unescape(title), int(n), int(low)) for title, n, low in re.findall(
        r"<summary>(.*?) — .*?· (\d+) nodes?, (\d+) low</span></summary>",
        mpgraph.report(plan, "html"))]


def test_html_sections_count_the_nodes_the_text_report_counts():
    # before: "(top level) — 1 cast · 3 nodes, 1 low" counting the input and the output, where
    # the text report says "(top level): 1 nodes, 1 low" (probe pC 10)
    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 10)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    two = mpgraph.convert(TwoLayers().eval(), torch.randn(32, 64), dtype="fp16", target=GPU).plan
    assert _html_counts(two) == [("(top level)", 1, 1), ("fc1, fc2", 2, 2)]
    blocks = mpgraph.convert(*_blocks(), dtype="fp16", target=GPU, strategy="rules").plan
    counts = _html_counts(blocks)
    assert sum(n for _, n, _ in counts) == len(blocks.compute_nodes) == \
        sum(int(n) for n in re.findall(r"^== .*: (\d+) nodes", mpgraph.report(blocks), re.M))
    assert sum(low for _, _, low in counts) == len(blocks.low_nodes)


def test_the_summary_counts_one_node_in_the_singular():
    """"1 nodes of unknown ops kept in float32 (bucketize)", "1 float32 nodes with ..."."""
    class Buckets(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)
            self.register_buffer("edges", torch.linspace(-1, 1, 10))
            self.register_buffer("bias", torch.randn(4, 8, 8))

        def forward(self, x):
            h = self.fc(x)
            scores = torch.baddbmm(self.bias, h, h.transpose(1, 2), alpha=0.1).softmax(-1)
            return torch.bucketize(h, self.edges), scores

    torch.manual_seed(0)
    summary = mpgraph.convert(Buckets().eval(), torch.randn(4, 8, 32), target=GPU,
                              strategy="rules").plan.summary()
    assert "; 1 node of unknown op kept in float32 (" in summary
    assert "; 1 float32 node with numeric-safety findings (calibrated on 1 batch)" in summary


def test_a_plan_saved_from_a_static_capture_applies_with_its_capture(token_ids, tmp_path):
    # was: a PlanMismatchError listing nodes ("node add_4: shape (16,), the plan has (2, 16,
    # 32)") that never named dynamic; the plan says how it was captured, and that is applied
    bert = tiny_bert(layers=1)  # (the bert fixture's model, one layer: depth is not the point)
    ids, _ = token_ids
    fast = mpgraph.convert(bert, (ids,), dtype="fp16", target="a100", dynamic=False)
    assert fast.plan.capture == "torch.export at the example's shapes"
    fast.plan.save(tmp_path / "plan.json")
    plan = mpgraph.Plan.load(tmp_path / "plan.json")
    again = mpgraph.convert(bert, (ids,), plan=plan)
    assert again.plan.capture == fast.plan.capture
    assert [r.dtype for r in again.plan.nodes] == [r.dtype for r in fast.plan.nodes]
    with pytest.raises(mpgraph.PlanMismatchError, match=r"the plan was made with dynamic=False "
                                                        r"\(torch.export at the example's shapes\) "
                                                        r"and this conversion captured with "
                                                        r"dynamic=True: leave dynamic out, or "
                                                        r"pass dynamic=False"):
        mpgraph.convert(bert, (ids,), plan=plan, dynamic=True)
