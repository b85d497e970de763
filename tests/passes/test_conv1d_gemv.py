"""GPT-2's Conv1D (``addmm(b, x, W)``, W stored k x n) on one row: MatVecLinear makes it a GEMV
over ``t(W)``, StoreWeights stores W's low-precision copy transposed so that GEMV reads
contiguous rows, the measured costs time it in that layout, and convert_decoder's two graphs
share the weight in it. The bias add is the layer's: the plan treats its parameter as a weight.

Which precision wins depends on the CPU, so these plans come from a cost model the test writes.
"""
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import mpgraph
from conftest import casts
from mpgraph.cost.measured import CostTable, layout, measure, measure_key
from mpgraph.cost.model import CostModel, NodeCost
from mpgraph.frontend.capture import capture
from mpgraph.ir.meta import PRECISION, Kind
from mpgraph.passes.infra import run_passes
from mpgraph.passes.pipeline import prepare_pipeline
from mpgraph.tools.generate import share_tensors

aten = torch.ops.aten
BF16 = torch.bfloat16


class _LowIsFaster(CostModel):
    """A CPU where every low-precision node costs a tenth of float32, casts next to nothing."""
    kind, name, source = Kind.CPU, "test CPU", "a test's costs"

    def node_cost(self, node, gm, low):
        return NodeCost(1.0, 4.0, 2.0, 1e-3, 1e-4)

    def cast_cost(self, node, low):
        return 1e-9, 1e-9


def _graph(model, x):
    gm = capture(model, (x,), export_only=True, observe=True)
    return run_passes(prepare_pipeline((x,), {}, kind=Kind.CPU), gm)


def _mvs(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is aten.mv.default]


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
    mvs = _mvs(gm)
    assert [m.args[0].target for m in mvs] == [aten.t.default] * 2
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    where = layout(gm)
    assert all(" transposed streamed/" in measure_key(m, gm, where) for m in mvs)

    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_LowIsFaster())
    stored = {name: t for name, t in converted.named_parameters()}
    for name, (k, n) in (("fc.weight", (256, 1024)), ("proj.weight", (1024, 256))):
        w = stored[name]
        assert w.dtype == BF16 and w.shape == (k, n) and w.stride() == (1, k)  # column-major
        assert w.t().is_contiguous()
    # the bias adds run in bf16 with the GEMVs: one cast in (the row), one out
    adds = [n for n in converted.graph.nodes if n.target is aten.add.Tensor]
    assert [a.meta[PRECISION].dtype for a in adds] == [BF16, BF16]
    assert stored["fc.bias"].dtype == BF16 and len(casts(converted)) == 2
    with torch.no_grad():
        assert mpgraph.numerics.relative_l2(converted(x), model(x)) < 2e-2
    assert model.fc.weight.dtype == torch.float32 and model.fc.weight.is_contiguous()


def test_the_measurement_times_the_low_gemv_over_contiguous_rows_as_it_will_run():
    torch.manual_seed(0)
    model, x = _GPT2ish().eval(), torch.randn(1, 1, 256)
    gm = _graph(model, x)
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten.mv.default:
                seen.append((args[0].dtype, args[0].is_contiguous()))
            return func(*args, **(kwargs or {}))

    with Spy():  # a table of its own: nothing cached, nothing written
        measure(gm, (x,), {}, CostTable(torch.device("cpu")), (BF16,), budget_s=30)
    assert {c for d, c in seen if d == BF16} == {True}            # the stored transpose
    assert {c for d, c in seen if d == torch.float32} == {False}  # the parameter's strided view


class _ReadTwice(nn.Module):
    """A Conv1D weight also read as it is (here by a reduction): its low copy stays row-major,
    and the measured costs time its GEMV over the strided transpose."""

    def __init__(self):
        super().__init__()
        self.fc = _Conv1D(256, 256)

    def forward(self, x):
        h = nn.functional.layer_norm(x, (int(x.shape[-1]),))
        return self.fc(h) * self.fc.weight.mean(0)


def test_a_weight_also_read_untransposed_stays_row_major():
    torch.manual_seed(0)
    model, x = _ReadTwice().eval(), torch.randn(1, 1, 256)
    gm = _graph(model, x)
    assert [m.args[0].target for m in _mvs(gm)] == [aten.t.default]
    assert " transposed" not in measure_key(_mvs(gm)[0], gm, layout(gm))
    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_LowIsFaster())
    tensors = [*converted.parameters(), *converted.buffers()]
    low = [t for t in tensors if t.dtype == BF16 and t.shape == (256, 256)]
    assert len(low) == 1 and all(t.is_contiguous() for t in tensors)
    with torch.no_grad():
        assert mpgraph.numerics.relative_l2(converted(x), model(x)) < 2e-2


def test_sharing_between_graphs_that_store_a_weight_in_two_layouts_takes_the_decode_s():
    """The decode graph stores a Conv1D weight transposed for its GEMV, the prefill graph (many
    rows: addmm) as it is: one copy is kept, in the layout the per-token graph reads."""
    torch.manual_seed(0)
    model = _GPT2ish().eval()
    prefill = mpgraph.convert(model, torch.randn(1, 8, 256), target="cpu", dtype="bf16",
                              costs=_LowIsFaster())
    decode = mpgraph.convert(model, torch.randn(1, 1, 256), target="cpu", dtype="bf16",
                             costs=_LowIsFaster())
    assert prefill.fc.weight.stride() == (1024, 1) and decode.fc.weight.stride() == (1, 256)
    sharing = share_tensors(prefill, decode)
    assert sharing.unshared == [] and prefill.fc.weight is decode.fc.weight
    assert decode.fc.weight.stride() == (1, 256)
    with torch.no_grad():
        for gm, x in ((prefill, torch.randn(1, 8, 256)), (decode, torch.randn(1, 1, 256))):
            assert mpgraph.numerics.relative_l2(gm(x), model(x)) < 2e-2


class _TransposedByTheModel(nn.Module):
    """``x @ W.t()`` written out: the GEMV reads W's rows as they are, with no t(t(W))."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(512, 256) * 0.05)

    def forward(self, x):
        h = nn.functional.layer_norm(x, (int(x.shape[-1]),))
        return torch.mm(h.view(-1, 256), self.weight.t()).view(1, 1, 512)


def test_a_weight_the_model_transposes_itself_is_read_row_major_as_stored():
    torch.manual_seed(0)
    model, x = _TransposedByTheModel().eval(), torch.randn(1, 1, 256)
    gm = _graph(model, x)
    (mv,) = _mvs(gm)
    assert mv.args[0].op == "get_attr" and " transposed" not in measure_key(mv, gm, layout(gm))
    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_LowIsFaster())
    assert converted.weight.dtype == BF16 and converted.weight.is_contiguous()
    with torch.no_grad():
        assert mpgraph.numerics.relative_l2(converted(x), model(x)) < 2e-2


def test_the_state_dict_holds_the_module_s_tensors_and_loads_back_into_the_planned_layout(
        tmp_path):
    """state_dict() gives the tensors as stored (views, as torch's does: writing into an entry
    writes the module); safetensors saves contiguous tensors only, so they are made so first."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    model, x = _GPT2ish().eval(), torch.randn(1, 1, 256)
    converted = mpgraph.convert(model, x, target="cpu", dtype="bf16", costs=_LowIsFaster())
    with torch.no_grad():
        expected = converted(x)
    state = converted.state_dict()
    assert state["fc.weight"].data_ptr() == converted.fc.weight.data_ptr()
    assert state["fc.weight"].stride() == (1, 256)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    assert torch.equal(loaded["fc.weight"], converted.fc.weight)
    converted.load_state_dict(loaded)  # copied into the planned tensors
    assert converted.fc.weight.stride() == (1, 256)
    fresh = {k: v.float() for k, v in model.state_dict().items()}
    converted.load_state_dict(fresh, assign=True)  # assigned, then back to the plan's
    assert converted.fc.weight.dtype == BF16 and converted.fc.weight.stride() == (1, 256)
    with torch.no_grad():
        torch.testing.assert_close(converted(x), expected)


class _ViewsItsWeight(nn.Module):
    """A prefill-side reader that takes the weight's memory as laid out (a flattening view)."""

    def __init__(self):
        super().__init__()
        self.fc = _Conv1D(256, 1024)

    def forward(self, x):
        return self.fc(x) * self.fc.weight.reshape(-1)[:1024]


def test_a_weight_the_prefill_graph_reads_as_laid_out_is_not_shared_across_layouts():
    torch.manual_seed(0)
    prefill = mpgraph.convert(_ViewsItsWeight().eval(), torch.randn(1, 8, 256), target="cpu",
                              dtype="bf16", costs=_LowIsFaster())
    model = _GPT2ish().eval()
    model.fc = prefill_model_fc = _Conv1D(256, 1024)  # the same names, read by a GEMV only
    decode = mpgraph.convert(model, torch.randn(1, 1, 256), target="cpu", dtype="bf16",
                             costs=_LowIsFaster())
    del prefill_model_fc
    assert prefill.fc.weight.stride() == (1024, 1) and decode.fc.weight.stride() == (1, 256)
    sharing = share_tensors(prefill, decode)
    assert "fc.weight" in dict(sharing.unshared)
    assert "which one of its ops reads as laid out" in dict(sharing.unshared)["fc.weight"]
    assert prefill.fc.weight.stride() == (1024, 1) and decode.fc.weight.stride() == (1, 256)
