"""SplitMatVec and the kernels behind it: a low-precision GEMV runs as ``split_mv`` where the
measured costs timed that faster, with ``mv``'s values; GPT-2's Conv1D (``addmm`` on one row)
becomes a GEMV over its weight stored transposed.

Which kernel is faster depends on the CPU, so the decisions are tested on cost models the test
writes (a table's entries, or a model that says the split is faster); what the measurement
does (which variants it times, in which layout) is tested for its structure, not its figures.
"""
import pytest
import torch
import torch.nn as nn

import mpgraph
from conftest import casts
from mpgraph.cost.device import measure_cpu
from mpgraph.cost.measured import CostTable, Measured, layout, measure, measure_key
from mpgraph.cost.model import CostModel, NodeCost
from mpgraph.cost.roofline import Roofline
from mpgraph.frontend.capture import capture
from mpgraph.ir.kernels import mv_splits, split_mv
from mpgraph.ir.meta import Kind
from mpgraph.passes import ClassifyOps
from mpgraph.passes.infra import run_passes
from mpgraph.passes.pipeline import prepare_pipeline
from mpgraph.tools.generate import share_tensors

aten = torch.ops.aten
BF16 = torch.bfloat16


@pytest.mark.parametrize("rows", [1024, 1000, 50257 // 16])
def test_split_mv_gives_mv_s_values(rows):
    torch.manual_seed(0)
    w, x = torch.randn(rows, 96), torch.randn(96)
    for parts in (4, 8, 16):
        block = rows // parts
        got = split_mv(w, x, parts, block, rows % parts != 0)
        torch.testing.assert_close(got, torch.mv(w, x), rtol=1e-5, atol=1e-5)
        low = split_mv(w.to(BF16), x.to(BF16), parts, block, rows % parts != 0)
        assert low.dtype == BF16 and low.shape == (rows,)
        assert mpgraph.numerics.relative_l2(low, torch.mv(w, x)) < 1e-2


def test_the_splits_of_a_weight_keep_blocks_of_64_rows_and_say_where_rows_are_left():
    assert mv_splits(32000) == {"split/4": (4, 8000, False), "split/8": (8, 4000, False),
                                "split/16": (16, 2000, False)}
    assert mv_splits(50257)["split/16"] == (16, 3141, True)
    assert mv_splits(500) == {"split/4": (4, 125, False)}  # 8 blocks would be 62 rows
    assert mv_splits(255) == {}


class _Decoderish(nn.Module):
    """Two one-row projections and a vocabulary head, as a decoder's step at batch 1 reads
    them; int() of a size keeps torch.fx out (torch.export fixes the row count)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(256, 512), nn.Linear(512, 256, bias=False)
        self.head = nn.Linear(256, 1000, bias=False)

    def forward(self, x):
        h = nn.functional.layer_norm(x, (int(x.shape[-1]),))
        return self.head(self.down(torch.relu(self.up(h))))


class _SplitFaster(CostModel):
    """A CPU where every low-precision node costs a tenth of float32 and each GEMV's 4-block
    split is the faster kernel (``kernel=""``: mv itself is)."""
    kind, name, source = Kind.CPU, "test CPU", "a test's costs"

    def __init__(self, kernel="split/4"):
        self.kernel = kernel

    def node_cost(self, node, gm, low):
        mv = node.op == "call_function" and node.target is aten.mv.default
        return NodeCost(1.0, 4.0, 2.0, 1e-3, 1e-4, self.kernel if mv else "")

    def cast_cost(self, node, low):
        return 1e-9, 1e-9


def _kernels(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.target in (aten.mv.default, split_mv)]


def test_a_plan_whose_costs_say_the_split_is_faster_runs_it_with_the_values_of_mv():
    torch.manual_seed(0)
    model, x = _Decoderish().eval(), torch.randn(1, 1, 256)
    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_SplitFaster())
    # up (512 rows), down (256), head (1000): blocks of 64 rows at least for 4 parts
    assert _kernels(converted) == [split_mv, split_mv, split_mv]
    plain = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_SplitFaster(""))
    assert _kernels(plain) == [aten.mv.default] * 3
    with torch.no_grad():
        ref, got = model(x), converted(x)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert mpgraph.numerics.relative_l2(got, ref) < 2e-2
        assert mpgraph.numerics.relative_l2(got, plain(x)) < 1e-2
    assert len(casts(converted)) == len(casts(plain))  # the same plan, another kernel


def test_a_gemv_the_plan_keeps_float32_is_not_split():
    torch.manual_seed(0)
    model, x = _Decoderish().eval(), torch.randn(1, 1, 256)
    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_SplitFaster(),
                                overrides={"head": "fp32"})
    assert _kernels(converted) == [split_mv, split_mv, aten.mv.default]


def _graph(model, x):
    gm = capture(model, (x,), export_only=True, observe=True)
    return run_passes(prepare_pipeline((x,), {}, kind=Kind.CPU), gm)


def test_the_measured_model_picks_the_fastest_kernel_its_table_holds():
    torch.manual_seed(0)
    model, x = _Decoderish().eval(), torch.randn(1, 1, 256)
    gm = run_passes([ClassifyOps(BF16)], _graph(model, x))  # (the roofline behind reads it)
    where = layout(gm)
    head = [n for n in gm.graph.nodes if n.target is aten.mv.default][-1]
    key = measure_key(head, gm, where)
    assert key.endswith("streamed/2")  # its weight is read from memory: the others are there
    entries = {f"{key}|fp32": 4e-3, f"{key}|bf16": 3e-3, f"{key}|bf16 split/4": 2e-3,
               f"{key}|bf16 split/8": 1e-3}
    costs = Measured(CostTable(torch.device("cpu"), entries), Roofline(measure_cpu()), (BF16,))
    cost = costs.node_cost(head, gm, BF16)
    assert (cost.t_fp32, cost.t_low, cost.kernel_low) == (4e-3, 1e-3, "split/8")
    costs.table.entries[f"{key}|bf16"] = 0.5e-3  # mv itself faster: no other kernel
    cost = costs.node_cost(head, gm, BF16)
    assert (cost.t_low, cost.kernel_low) == (0.5e-3, "")


def test_measurement_times_each_split_in_each_low_dtype_beside_mv():
    torch.manual_seed(0)
    model, x = _Decoderish().eval(), torch.randn(1, 1, 256)
    gm = _graph(model, x)
    table = CostTable(torch.device("cpu"))  # no path: nothing cached, nothing written
    keys = measure(gm, (x,), {}, table, (BF16,), budget_s=60)
    head = [n for n in gm.graph.nodes if n.target is aten.mv.default][-1]
    up, down, head = [n for n in gm.graph.nodes if n.target is aten.mv.default]
    for node, splits in ((up, ["split/4", "split/8"]), (down, ["split/4"]),  # 64 rows a block
                         (head, ["split/4", "split/8"])):
        mine = sorted(k.rsplit("|", 1)[1] for k in table.entries if k.startswith(keys[node] + "|"))
        assert mine == sorted(["bf16", "fp32"] + [f"bf16 {s}" for s in splits]), node.name
        assert all(table.entries[f"{keys[node]}|{s}"] > 0 for s in mine)


class _Conv1D(nn.Module):
    """GPT-2's projection: ``addmm(bias, x, W)`` with W stored k x n."""

    def __init__(self, k, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) * 0.05)
        self.bias = nn.Parameter(torch.randn(n) * 0.05)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.weight.shape[1])


class _GPT2ish(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = _Conv1D(256, 1024), _Conv1D(1024, 256)

    def forward(self, x):
        h = nn.functional.layer_norm(x, (int(x.shape[-1]),))
        return self.proj(torch.relu(self.fc(h)))


def test_a_one_row_conv1d_is_a_gemv_over_its_weight_stored_transposed():
    torch.manual_seed(0)
    model, x = _GPT2ish().eval(), torch.randn(1, 1, 256)
    gm = _graph(model, x)
    assert aten.addmm.default not in [n.target for n in gm.graph.nodes]
    mvs = [n for n in gm.graph.nodes if n.target is aten.mv.default]
    assert [m.args[0].target for m in mvs] == [aten.t.default] * 2
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    where = layout(gm)
    assert all(" transposed streamed/" in measure_key(m, gm, where) for m in mvs)

    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_SplitFaster())
    stored = {name: t for name, t in converted.named_parameters()}
    for name, (k, n) in (("fc.weight", (256, 1024)), ("proj.weight", (1024, 256))):
        w = stored[name]
        assert w.dtype == BF16 and w.shape == (k, n) and w.stride() == (1, k)  # column-major
        assert w.t().is_contiguous()
    assert _kernels(converted) == [split_mv, split_mv]
    with torch.no_grad():
        assert mpgraph.numerics.relative_l2(converted(x), model(x)) < 2e-2
    assert model.fc.weight.dtype == torch.float32 and model.fc.weight.is_contiguous()


class _ReadTwice(nn.Module):
    """A Conv1D weight also read as it is (here by a reduction): kept row-major, so its
    transpose is strided and the GEMV reads it as it is, unsplit."""

    def __init__(self):
        super().__init__()
        self.fc = _Conv1D(256, 256)

    def forward(self, x):
        h = nn.functional.layer_norm(x, (int(x.shape[-1]),))
        return self.fc(h) * self.fc.weight.mean(0)


def test_a_weight_also_read_untransposed_stays_row_major_and_its_gemv_stays_mv():
    torch.manual_seed(0)
    model, x = _ReadTwice().eval(), torch.randn(1, 1, 256)
    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_SplitFaster())
    assert _kernels(converted) == [aten.mv.default]
    assert all(t.is_contiguous() for t in converted.parameters())
    with torch.no_grad():
        assert mpgraph.numerics.relative_l2(converted(x), model(x)) < 2e-2


def test_sharing_between_graphs_that_store_a_weight_in_two_layouts_takes_the_decode_s():
    """The decode graph stores a Conv1D weight transposed for its GEMV, the prefill graph (many
    rows: addmm) as it is: one copy is kept, in the layout the per-token graph reads."""
    torch.manual_seed(0)
    model = _GPT2ish().eval()
    prefill = mpgraph.convert(model, torch.randn(1, 8, 256), target="cpu", dtype="bf16",
                              costs=_SplitFaster())
    decode = mpgraph.convert(model, torch.randn(1, 1, 256), target="cpu", dtype="bf16",
                             costs=_SplitFaster())
    assert prefill.fc.weight.stride() == (1024, 1) and decode.fc.weight.stride() == (1, 256)
    sharing = share_tensors(prefill, decode)
    assert sharing.unshared == [] and prefill.fc.weight is decode.fc.weight
    assert decode.fc.weight.stride() == (1, 256)
    with torch.no_grad():
        for gm, x in ((prefill, torch.randn(1, 8, 256)), (decode, torch.randn(1, 1, 256))):
            assert mpgraph.numerics.relative_l2(gm(x), model(x)) < 2e-2
