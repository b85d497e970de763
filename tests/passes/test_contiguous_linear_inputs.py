"""ContiguousLinearInputs: a CPU plan's linear reading a strided activation of 3+ dimensions
reads it contiguous, as the model's own call does with a weight that requires grad."""
import torch
import torch.nn as nn

import mpgraph
from conftest import GPU
from mpgraph.numerics import relative_l2

aten = torch.ops.aten


def _contiguous(gm) -> list:
    return [n for n in gm.graph.nodes if n.target in ("contiguous", aten.contiguous.default)
            and n.meta.get("mpgraph.inserted_by") == "ContiguousLinearInputs"]


class _SeqFirst(nn.Module):
    """A batch-first activation projected sequence-first (nn.MultiheadAttention's own step)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = x.transpose(0, 1)
        return self.q(h) * self.k(h)


def test_a_linear_on_a_transposed_activation_reads_one_contiguous_copy():
    """A converted module's weights are frozen, and ATen's matmul folds a strided input into one
    product only for a weight that requires grad: a 512->1536 layer over a (128, 4, 512) view
    ran 29.4 ms against the model's 10.1, a batch_first TransformerEncoderLayer 0.5-0.8x (pP
    F1). One copy serves both linears; GPU plans keep the graph as it was."""
    torch.manual_seed(0)
    model, x = _SeqFirst().eval(), torch.randn(4, 8, 32)
    converted = mpgraph.convert(model, x, target="cpu")
    assert len(_contiguous(converted)) == 1
    with torch.no_grad():
        # (a plan for this CPU: float32 here, bf16 where it pays on an AMX one)
        assert relative_l2(converted(x), model(x)) < 2e-2
        assert converted(torch.randn(2, 5, 32)).shape == (5, 2, 32)
    assert not _contiguous(mpgraph.convert(model, x, target=GPU))
    assert not _contiguous(mpgraph.convert(model, x, target="cpu", mode="train"))


def test_a_batch_first_encoder_layer_reads_its_projections_input_contiguous():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 8, 32)
    for converted in (mpgraph.convert(layer, x, target="cpu"),
                      mpgraph.convert(nn.Sequential(layer), x, target="cpu")):
        assert len(_contiguous(converted)) >= 1, converted.plan.summary()
        with torch.no_grad():
            assert relative_l2(converted(x), layer(x)) < 2e-2


class _WrittenBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.k = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        y = (x * 1).transpose(0, 1)
        y.add_(self.l(y))  # written between its two linears
        return self.k(y)


def test_a_strided_input_written_in_place_is_copied_for_each_linear_after_the_write():
    """One copy shared by both linears, taken before the write, gave the second the old values
    (1.16 off with check=False, a 'rewrote the graph wrongly' error otherwise: review rL H1)."""
    torch.manual_seed(0)
    model, x = _WrittenBetween().eval(), torch.randn(4, 8, 32)
    converted = mpgraph.convert(model, x, target="cpu")
    assert len(_contiguous(converted)) == 2
    with torch.no_grad():  # (the stale copy was 0.54 off)
        assert relative_l2(converted(x), model(x)) < 2e-2


def test_a_saved_plan_applies_with_the_copies_it_was_made_with():
    """A plan made where the input was contiguous (or before this pass) names no copy: applied
    to a strided input it was a PlanMismatchError, 'node contiguous is not in the plan' (rL M1)."""
    import dataclasses
    torch.manual_seed(0)
    model = _SeqFirst().eval()
    made = mpgraph.convert(model, torch.randn(4, 8, 32), target="cpu")
    assert len(_contiguous(made)) == 1
    again = mpgraph.convert(model, torch.randn(4, 8, 32), target="cpu", plan=made.plan)
    assert len(_contiguous(again)) == 1
    old = dataclasses.replace(made.plan, nodes=[r for r in made.plan.nodes
                                                if r.inserted_by != "ContiguousLinearInputs"])
    applied = mpgraph.convert(model, torch.randn(4, 8, 32), target="cpu", plan=old)
    assert not _contiguous(applied)
