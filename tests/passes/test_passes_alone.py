"""Passes run on their own, on small hand-made graphs, without going through ``convert``; and the
pass infrastructure's contract (error wrapping, stages)."""
import logging
import math

import pytest
import torch
import torch.fx
import torch.nn as nn

import mpgraph
from mpgraph.cost.specs import GPU_SPECS
from mpgraph.ir.graph import Call
from mpgraph.ir.meta import PRECISION, RANGE, TENSOR, TC_FINDING, Decision, TensorInfo
from mpgraph.passes import (Calibrate, ClassifyOps, Functionalize, FuseTanhGelu, LintTensorCores,
                            PropagateTensorInfo, PruneForInference)
from mpgraph.passes.infra import Pass, PassResult, run_passes


def _traced(module, *inputs):
    gm = torch.fx.symbolic_trace(module)
    PropagateTensorInfo(inputs)(gm)
    return gm


class _Boom(Pass):
    def call(self, gm):
        raise RuntimeError("kaput")


class _Quiet(Pass):
    stage = "decide"

    def call(self, gm):
        return PassResult(gm, False)


def test_run_passes_wraps_an_unexpected_error_with_the_pass_and_what_ran_before(caplog):
    gm = _traced(nn.Linear(4, 4), torch.randn(2, 4))
    with caplog.at_level(logging.INFO, logger="mpgraph.progress"):
        with pytest.raises(mpgraph.PassError) as info:
            run_passes([_Quiet(), _Boom()], gm)
    assert info.value.pass_name == "_Boom" and info.value.ran_before == ["_Quiet"]
    assert str(info.value).startswith("pass _Boom failed: RuntimeError: kaput")
    # each stage is reported when it starts and when it ends (the last one even when it fails)
    stages = [(r.mpgraph_stage, r.mpgraph_seconds is None) for r in caplog.records]
    assert stages == [("decide", True), ("decide", False), ("plan", True), ("plan", False)]


def test_the_infrastructure_holds_passes_to_what_they_declare():
    gm = _traced(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4))
    # a pass that reads a key nobody wrote yet: the error names the pass that writes it
    with pytest.raises(mpgraph.PassError, match=r"needs mpgraph.op_class on every node: run "
                                                r"ClassifyOps first"):
        LintTensorCores(GPU_SPECS["a100-80gb"])(gm)

    class Sneaky(Pass):  # an analysis pass (rewrites = False) that changes the graph
        def call(self, gm):
            node = next(n for n in gm.graph.nodes if n.op == "call_module")
            with gm.graph.inserting_after(node):
                gm.graph.call_function(torch.relu, (node,))
            return PassResult(gm, True)

    with pytest.raises(mpgraph.PassError, match="declares rewrites = False"):
        Sneaky()(gm)

    class Rewrite(Pass):  # a rewriting pass edits; the infrastructure lints and recompiles
        rewrites = True

        def call(self, gm):
            node = next(n for n in gm.graph.nodes if n.op == "call_module")
            with gm.graph.inserting_after(node):
                relu = gm.graph.call_function(torch.relu, (node,))
            node.replace_all_uses_with(relu, delete_user_cb=lambda user: user is not relu)
            return PassResult(gm, True)

    fresh = _traced(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4))
    Rewrite()(fresh)
    assert "torch.relu" in fresh.code and (fresh(torch.randn(2, 4)) >= 0).all()


def test_a_pass_that_returns_no_result_is_an_error():
    class Wrong(Pass):
        def call(self, gm):
            return gm

    with pytest.raises(mpgraph.PassError, match="returned .*, not PassResult"):
        run_passes([Wrong()], _traced(nn.Linear(4, 4), torch.randn(2, 4)))


def test_functionalize_alone_rewrites_private_in_place_ops_and_leaves_the_rest():
    class M(nn.Module):
        def forward(self, x, y):
            h = x * 2
            h.relu_()                 # private: rewritten
            y.add_(1)                 # a graph input: the caller sees the write
            v = h.view(-1)
            h.mul_(3)                 # h has a view: stays in place
            return h + v.sum()

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = _traced(M(), x, y)
    first = Functionalize()(gm)
    assert first.modified
    methods = [n.target for n in gm.graph.nodes if n.op == "call_method"]
    assert methods == ["relu", "add_", "view", "mul_", "sum"]
    again = Functionalize()(gm)  # idempotent
    assert not again.modified
    a, b = y.clone(), y.clone()
    torch.testing.assert_close(gm(x, a), M()(x, b))
    assert torch.equal(a, b)


def test_fuse_tanh_gelu_alone_fuses_two_chains_and_is_idempotent():
    def gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    class Two(nn.Module):
        def forward(self, x):
            return gelu(x) + gelu(2 * x)

    x = torch.randn(4, 8)
    gm = _traced(Two(), x)
    assert FuseTanhGelu()(gm).modified
    fused = [n for n in gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "") == "gelu"]
    assert len(fused) == 2 and not FuseTanhGelu()(gm).modified
    torch.testing.assert_close(gm(x), Two()(x))


def test_prune_alone_drops_eval_dropout_but_not_in_training_mode():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.ReLU()).eval()
    gm = _traced(model, torch.randn(2, 4))
    gm.training = False
    assert PruneForInference()(gm).modified
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "2"]
    train = _traced(model, torch.randn(2, 4))
    train.training = True
    assert not PruneForInference()(train).modified


def test_calibrate_alone_records_inf_and_nan_without_letting_them_into_the_ranges():
    class M(nn.Module):
        def forward(self, x):
            return torch.log(x)  # log of 0 is -inf, of a negative is NaN

    x = torch.tensor([[0.0, -1.0, 2.0, 1e-3]])
    gm = _traced(M(), x)
    Calibrate([Call((x,), {})])(gm)
    log_node = next(n for n in gm.graph.nodes if n.op == "call_function")
    r = log_node.meta[RANGE]
    assert r.nonfinite == 2  # -inf and NaN are counted ...
    assert r.absmax == pytest.approx(abs(math.log(1e-3))) and math.isfinite(r.absmax)  # ... not ranges
    assert r.min_nonzero == pytest.approx(math.log(2.0))
    assert gm.meta[RANGE] == 1


def test_lint_tensor_cores_alone_checks_fp32_matmuls_against_tf32_only_when_tf32_is_on():
    gm = _traced(nn.Sequential(nn.Linear(30, 64)), torch.randn(8, 30))
    ClassifyOps(torch.float16)(gm)
    linear = next(n for n in gm.graph.nodes if n.op == "call_module")
    linear.meta[PRECISION] = Decision(torch.float32, "kept float32")
    LintTensorCores(GPU_SPECS["a100-80gb"], tf32=True)(gm)
    finding = linear.meta[TC_FINDING]
    assert finding.multiple == 4 and "TF32 Tensor Cores want multiples of 4" in finding.text
    assert "K 30->32" in finding.text
    del linear.meta[TC_FINDING]
    LintTensorCores(GPU_SPECS["a100-80gb"], tf32=False)(gm)
    assert TC_FINDING not in linear.meta  # float32 on CUDA cores: nothing to align


def test_plan_diff_lists_nodes_only_one_plan_has():
    a = mpgraph.convert(nn.Sequential(nn.Linear(16, 16), nn.ReLU()).eval(), torch.randn(4, 16),
                        dtype="fp16", target="a100", strategy="rules").plan
    b = mpgraph.convert(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval(),
                        torch.randn(4, 16), dtype="fp16", target="a100", strategy="rules").plan
    d = mpgraph.diff(a, b)
    assert d.only_a == [] and d.only_b == ["_2"] and not d.changed
    assert "only in B: _2" in str(d)
    assert mpgraph.diff(b, a).only_a == ["_2"]


def test_tensor_info_of_multi_output_nodes_is_a_tuple():
    class M(nn.Module):
        def forward(self, x):
            a, b = x.chunk(2, dim=-1)
            return a * b

    gm = _traced(M(), torch.randn(2, 8))
    chunk = next(n for n in gm.graph.nodes if n.target == "chunk")
    assert chunk.meta[TENSOR] == (TensorInfo((2, 4), torch.float32),) * 2
