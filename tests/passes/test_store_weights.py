import torch
import torch.nn as nn

from mpgraph.ir.meta import INSERTED_BY

from conftest import convert_rules, MLP, casts

convert = convert_rules  # these tests pin the rules, planned for conftest.GPU

BF16 = torch.bfloat16


def test_weights_of_low_nodes_are_stored_low_and_others_stay_fp32(bert, token_ids):
    ids, mask = token_ids
    gm = convert(bert, (ids,), example_kwargs={"attention_mask": mask}, dtype=BF16)
    state = dict(gm.named_parameters())
    assert state["encoder.layer.0.attention.self.query.weight"].dtype == BF16
    assert state["encoder.layer.0.output.dense.bias"].dtype == BF16
    assert state["encoder.layer.0.output.LayerNorm.weight"].dtype == torch.float32
    assert state["embeddings.word_embeddings.weight"].dtype == torch.float32
    # no weight is cast at run time: no inserted cast reads a parameter
    assert all(c.args[0].op != "get_attr" for c in casts(gm))


def test_call_module_weights_converted_in_the_copy_only():
    model = MLP()
    gm = convert(model, torch.randn(2, 16), dtype=BF16)
    assert gm.fc1.weight.dtype == BF16 and gm.fc1.weight is not model.fc1.weight
    assert model.fc1.weight.dtype == torch.float32
    assert isinstance(gm.fc1.weight, nn.Parameter)
    assert {w.name for w in gm.plan.weights} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


class SharedModule(nn.Module):
    """One Linear called twice: once where it can be low, once pinned to fp32 by an override."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + self.lin(x * 2)


def test_module_called_in_both_precisions_gets_a_low_copy():
    model = SharedModule()
    x = torch.randn(2, 8)
    gm = convert(model, x, dtype=BF16, overrides={"lin_1": "fp32"})
    targets = {n.name: n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert targets == {"lin": "lin_bfloat16", "lin_1": "lin"}
    assert gm.lin.weight.dtype == torch.float32 and gm.lin_bfloat16.weight.dtype == BF16
    torch.testing.assert_close(gm(x), model(x), atol=5e-2, rtol=5e-2)


class TiedWeight(nn.Module):
    """A parameter read directly by a matmul (low) and by a sum (fp32)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.matmul(x, self.w) + self.w.sum()


def test_parameter_read_in_both_precisions_keeps_both_copies():
    model = TiedWeight()
    x = torch.randn(2, 8)
    gm = convert(model, x, dtype=BF16)
    getattrs = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    assert set(getattrs) == {"w", "w_bfloat16"}
    assert getattrs["w_bfloat16"].meta[INSERTED_BY] == "StoreWeights"
    assert [u.name for u in getattrs["w_bfloat16"].users] == ["matmul"]
    assert gm.w.dtype == torch.float32 and gm.w_bfloat16.dtype == BF16
    assert [w.shared for w in gm.plan.weights] == [True]
    torch.testing.assert_close(gm(x), model(x), atol=0.1, rtol=2e-2)
