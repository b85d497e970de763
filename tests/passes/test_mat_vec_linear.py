"""MatVecLinear: a linear layer on one row becomes ``mv`` for CPU plans (a decoder's step at
batch 1 reaches the GEMV kernels), with the values ``linear`` gives; nothing else changes."""
import torch
import torch.nn as nn
import transformers

import mpgraph
from conftest import GPU
from mpgraph.frontend.capture import capture
from mpgraph.ir.meta import Kind
from mpgraph.passes.infra import run_passes
from mpgraph.passes.pipeline import prepare_pipeline

aten = torch.ops.aten


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_module")]


def _prepared(model, x, kind, export_only=False):
    gm = capture(model, (x,), export_only=export_only, observe=True)
    return run_passes(prepare_pipeline((x,), {}, kind=kind), gm)


def test_one_row_linears_become_mv_on_cpu_in_an_export_graph_with_linear_s_values():
    torch.manual_seed(0)
    model = _Head().eval()
    x = torch.randn(1, 1, 64)
    gm = _prepared(model, x, Kind.CPU, export_only=True)
    ops = _ops(gm)
    assert ops.count(aten.mv.default) == 2 and aten.linear.default not in ops
    assert ops.count(aten.add.Tensor) == 1  # a's bias, added after the product
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-6, atol=1e-6)


def test_a_symbolic_trace_graph_runs_any_shape_so_its_linears_stay():
    """torch.fx's graph is not tied to the example's shapes: fixing its row count at the batch-1
    example's made the converted module fail on 4 rows and return (1, 8) for an input of (64,)."""
    torch.manual_seed(0)
    model = _Head().eval()
    converted = mpgraph.convert(model, torch.randn(1, 64), target="cpu", dtype="bf16",
                                strategy="rules")
    assert "symbolic_trace" in converted.plan.summary()
    assert aten.mv.default not in _ops(converted)
    with torch.no_grad():
        for x in (torch.randn(4, 64), torch.randn(64)):
            out = converted(x)
            assert out.shape == model(x).shape
            assert mpgraph.numerics.relative_l2(out, model(x)) < 2e-2


def test_rows_other_than_one_and_gpu_plans_keep_linear():
    torch.manual_seed(0)
    model = _Head().eval()
    assert aten.mv.default not in _ops(_prepared(model, torch.randn(2, 64), Kind.CPU))
    assert aten.mv.default not in _ops(_prepared(model, torch.randn(1, 64), Kind.GPU))
    converted = mpgraph.convert(model, torch.randn(1, 64), dtype="fp16", target=GPU)
    assert aten.mv.default not in _ops(converted)  # a GPU plan: cuBLAS either way, fewer nodes


def _timed(mv_us: float, linear_us: float, layers=((64, 64), (64, 2))):
    """This CPU's costs, measured as given: each one-row linear (with a bias) taking
    ``linear_us`` as ATen's linear and ``mv_us`` as MatVecLinear's mv, in float32."""
    from mpgraph.cost.device import resolve_target
    from mpgraph.cost.measured import CostTable, Measured
    from mpgraph.cost.roofline import Roofline
    entries = {}
    for k, n in layers:
        entries[f"one-row linear {k}->{n} +bias|fp32 linear"] = linear_us * 1e-6
        entries[f"one-row linear {k}->{n} +bias|fp32 mv"] = mv_us * 1e-6
    table = CostTable(torch.device("cpu"), entries)
    return Measured(table, Roofline(resolve_target("cpu")), lows=()), table


def test_a_cpu_conversion_of_a_batch_1_classifier_head_runs_mv_where_measured_faster():
    """MatVecLinear rewrites where this machine timed mv faster (an AMX Xeon: 768x2048 float32
    224 against 300 us), and keeps linear where it did not (an AVX2-only EPYC: a 64-wide layer
    7.3 against 5.2 us, three 256-wide ones 1.45x slower in a batch-1 plan, pL F9): before,
    it rewrote wherever a graph held one row, measured or not."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=100)).eval()
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        want = model(ids).logits
    # (the first capture dynamic, whose encoder rows are symbolic and not taken for one row; the
    # second static, called at the example's shape only, its plan applied as it was made)
    for mv_us, linear_us, count, dynamic in ((4.0, 5.0, 2, True), (7.3, 5.2, 0, False)):
        costs, table = _timed(mv_us, linear_us)
        converted = mpgraph.convert(model, ids, target="cpu", costs=costs, dynamic=dynamic)
        assert table.measured_now == 0  # (the table's figures decided, nothing timed)
        # the pooler's and the classifier's one-row linears (the rows of the encoder's are 12)
        ops = _ops(converted)
        assert ops.count(aten.mv.default) == count
        assert ops.count(aten.linear.default) == 14 - count
        with torch.no_grad():
            assert mpgraph.numerics.relative_l2(converted(ids).logits, want) < 1e-5
    # a plan saved without mv applies as it was made, where mv would be faster
    costs, _ = _timed(4.0, 5.0)
    applied = mpgraph.convert(model, ids, target="cpu", costs=costs, plan=converted.plan)
    assert aten.mv.default not in _ops(applied)


def test_the_one_row_question_sums_the_graph_s_layers_and_dtypes_and_times_what_it_lacks():
    from mpgraph.cost.measured import CostTable, one_row_mv_pays
    entries = {"one-row linear 8->8|fp32 linear": 5e-6, "one-row linear 8->8|fp32 mv": 4e-6,
               "one-row linear 8->4 +bias|fp32 linear": 3e-6,
               "one-row linear 8->4 +bias|fp32 mv": 5e-6}
    table = CostTable(torch.device("cpu"), dict(entries))
    one = (8, 8, False, False)
    other = (8, 4, True, False)
    assert one_row_mv_pays(table, [one], (torch.float32,))
    assert not one_row_mv_pays(table, [one, other], (torch.float32,))  # 9 us against 8
    assert one_row_mv_pays(table, [one, one, one, other], (torch.float32,))  # 17 against 18
    assert table.measured_now == 0
    # a GPT-2 Conv1D (k x n weight) in bf16, not in the table: both forms timed once, kept
    assert isinstance(one_row_mv_pays(table, [(16, 8, True, True)], (torch.bfloat16,)), bool)
    timed = {k: v for k, v in table.entries.items() if k not in entries}
    assert sorted(timed) == ["one-row linear 16->8 +bias (k x n weight)|bf16 linear",
                             "one-row linear 16->8 +bias (k x n weight)|bf16 mv"]
    assert all(v > 0 for v in timed.values()) and table.measured_now == 2


def test_without_a_bias_the_capture_run_s_statistics_carry_over():
    """Calibrate takes capture's example run when every node has its statistics: the rewrite
    gives its nodes (and an nn.Linear's parameters, read now by get_attr) theirs, so the graph
    is not run again (with a bias it is: the product before the bias was never observed)."""
    from mpgraph.ir.meta import OBSERVED
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(1, 64)
    gm = capture(model.eval(), (x,), export_only=True, observe=True)
    from mpgraph.passes import MatVecLinear, PruneForInference
    gm = run_passes([PruneForInference(), MatVecLinear()], gm)
    assert _ops(gm).count(aten.mv.default) == 2
    assert all(OBSERVED in n.meta for n in gm.graph.nodes), \
        [n.name for n in gm.graph.nodes if OBSERVED not in n.meta]


class _QKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        # float32 (numeric safety): each linear casts it. int() of a size: torch.fx cannot trace
        # it, torch.export can (and fixes the batch-1 row count MatVecLinear needs)
        h = nn.functional.layer_norm(x, (int(x.shape[-1]),))
        return self.q(h) * torch.sigmoid(self.k(h)) + self.v(h)


def test_linears_reading_one_row_share_its_view_and_its_cast():
    """q, k and v read the same row: one view of it, so a low-precision plan casts it once
    (three views of a float32 value were three casts), and the three GEMVs on it are one over
    their stacked weights (FuseSiblingGemv)."""
    from conftest import casts
    torch.manual_seed(0)
    model = _QKV().eval()
    x = torch.randn(1, 64)
    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", strategy="rules")
    mvs = [n for n in converted.graph.nodes if n.target is aten.mv.default]
    assert len(mvs) == 1 and mvs[0].args[0].meta["mpgraph.tensor"].shape == (192, 64)
    assert [c.args[0].target for c in casts(converted)].count(aten.view.default) == 1
    assert "torch.export" in converted.plan.summary()
    with torch.no_grad():
        assert mpgraph.numerics.relative_l2(converted(x), model(x)) < 2e-2


class _TwoOfOneRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = torch.tanh(x)
        return self.q(h) + self.k(h)


def test_a_row_written_in_place_between_its_linears_is_viewed_for_each():
    """One shared view of the row, cast once before the first linear, would give the second
    linear the values from before an in-place write between them. torch.export's graphs write
    nothing in place there, so the write is put into the graph here, as a rewrite could."""
    from mpgraph.passes import MatVecLinear
    torch.manual_seed(0)
    x = torch.randn(1, 64)
    gm = capture(_TwoOfOneRow().eval(), (x,), export_only=True, observe=True)
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    h = linears[0].args[0]
    assert linears[1].args[0] is h
    with gm.graph.inserting_before(linears[1]):
        write = gm.graph.call_function(aten.mul_.Tensor, (h, 2.0))
    write.meta.update(h.meta)
    gm.recompile()
    with torch.no_grad():
        expected = gm(x)
    gm = MatVecLinear()(gm).graph_module
    mvs = [n for n in gm.graph.nodes if n.target is aten.mv.default]
    assert len(mvs) == 2 and mvs[0].args[1] is not mvs[1].args[1]  # a view each, after the write
    with torch.no_grad():
        torch.testing.assert_close(gm(x), expected)
