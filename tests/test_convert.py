"""End to end: convert real and hand-written architectures, check numbers, dtypes, structure."""
import re

import pytest
import torch
import torch.nn as nn

import mpgraph
from mpgraph.ir.meta import PRECISION, TENSOR

from conftest import (GPU, convert_rules, LOW_DTYPES, TOL, ConvBnReluPool, MLP, SoftmaxAttention, casts, rel_err,
                      round_trips)

convert = convert_rules  # these tests pin the rules, planned for conftest.GPU


def _tel():
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()


SMALL = {
    "mlp": (lambda: MLP().eval(), lambda: (torch.randn(4, 16),)),
    "cnn": (lambda: ConvBnReluPool().eval(), lambda: (torch.randn(2, 3, 16, 16),)),
    "attention": (lambda: SoftmaxAttention().eval(), lambda: (torch.randn(2, 6, 16),)),
    "transformer_encoder_layer": (_tel, lambda: (torch.randn(2, 10, 32),)),
}
FP32_CLASSES = ("fp32_compute", "fp32_only", "unknown")


def _outputs(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    if hasattr(value, "to_tuple"):
        return _outputs(value.to_tuple())
    return []


def _check_invariants(gm, low):
    gm.graph.lint()
    assert round_trips(gm) == []
    for record in gm.plan.compute_nodes:
        if record.op_class in FP32_CLASSES:
            assert record.dtype == "float32", record
        for word in ("softmax", "layer_norm", "sum", "mean"):
            if word in record.target and record.op_class != "cast":
                assert record.dtype == "float32", record
    # at most one cast per (value, dtype): none of these graphs writes in place
    keys = [(c.args[0].name, c.args[1]) for c in casts(gm)]
    assert len(keys) == len(set(keys))


def _check_every_edge(gm, args, kwargs=None):
    """Run the converted graph and compare each node's real dtype with its plan entry."""
    real = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            real[n] = out
            return out

    from mpgraph.ir.graph import flat_inputs
    with torch.no_grad():
        Rec(gm).run(*flat_inputs(gm, args, kwargs or {}), enable_io_processing=False)
    checked = 0
    for n, out in real.items():
        d, info = n.meta[PRECISION], n.meta[TENSOR]
        if isinstance(out, torch.Tensor) and getattr(info, "dtype", None) in (torch.float32, d.dtype) \
                and d.dtype is not None:
            assert out.dtype == d.dtype, n.format_node()
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(SMALL))
def test_small_models(name, low):
    build, inputs = SMALL[name]
    model, args = build(), inputs()
    # (called at the example's shapes only: a static capture where the model takes the
    # torch.export route; test_huggingface_models below checks a dynamic one at other shapes)
    gm = convert(model, args, dtype=low, dynamic=False)
    with torch.no_grad():
        ref, out = model(*args), gm(*args)
    for r, o in zip(_outputs(ref), _outputs(out)):
        assert o.dtype == r.dtype  # keep_io_types
        assert rel_err(o, r) < TOL[low]
    assert gm.plan.low_nodes, "something must run in low precision"
    _check_invariants(gm, low)
    _check_every_edge(gm, args)


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_huggingface_models(arch, low, request, token_ids):
    model = request.getfixturevalue(arch)
    ids, mask = token_ids
    gm = convert(model, (ids,), example_kwargs={"attention_mask": mask}, dtype=low)
    assert gm.plan.capture == "torch.export"
    with torch.no_grad():
        ref = model(ids, attention_mask=mask)
        out = gm(ids, attention_mask=mask)
    assert type(out) is type(ref)
    assert out.last_hidden_state.dtype == torch.float32
    assert rel_err(out.last_hidden_state, ref.last_hidden_state) < TOL[low]
    _check_invariants(gm, low)
    _check_every_edge(gm, (ids,), {"attention_mask": mask})
    # an fp32 residual stream costs 4 casts per layer (LayerNorm out down, residual branch up,
    # twice); BERT's pooler adds 2; GPT-2's written-out GELU is fused into one gelu op
    layers = model.config.num_hidden_layers
    expected = {"bert": 4 * layers + 2, "gpt2": 4 * layers}
    assert len(gm.plan.casts) == expected[arch], gm.plan.format_casts()
    if arch == "gpt2":
        fused = [r for r in gm.plan.nodes if r.target == "aten.gelu.default"]
        assert len(fused) == layers and all(r.dtype == str(low)[6:] for r in fused)
    # the shapes were not frozen at capture
    ids2 = torch.randint(0, 100, (3, 7))
    with torch.no_grad():
        out2 = gm(ids2, attention_mask=torch.ones(3, 7, dtype=torch.long))
        ref2 = model(ids2, attention_mask=torch.ones(3, 7, dtype=torch.long))
    assert rel_err(out2.last_hidden_state, ref2.last_hidden_state) < TOL[low]


def test_state_dict_of_every_small_model_is_bit_identical_afterwards():
    for name, (build, inputs) in SMALL.items():
        model = build()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        convert(model, inputs(), dtype=torch.float16, dynamic=False)  # (never called: static)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype
                   for k in before), name


def test_result_runs_under_torch_compile():
    model, x = MLP().eval(), torch.randn(4, 16)
    gm = convert(model, x, dtype=torch.bfloat16)
    compiled = torch.compile(gm, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), gm(x))


def test_summary_reads_like_the_spec():
    gm = convert(SoftmaxAttention(), torch.randn(2, 6, 16), dtype=torch.bfloat16)
    s = gm.plan.summary()
    assert s.startswith(f"converted {len(gm.plan.low_nodes)}/{len(gm.plan.compute_nodes)} nodes "
                        f"to bfloat16 with {len(gm.plan.casts)} casts")
    d = gm.plan.to_dict()
    assert d["dtype"] == "bfloat16" and len(d["nodes"]) == len(gm.plan.nodes)
    assert {r["name"] for r in d["nodes"]} >= {"softmax", "qkv"}


@pytest.mark.parametrize("bad", [torch.int8, torch.float32, "fp8", torch.float64])
def test_bad_dtype_is_a_value_error(bad):
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        convert(MLP(), torch.randn(2, 16), dtype=bad)


def test_non_module_is_a_type_error():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        convert(lambda x: x * 2, torch.randn(2))


def test_missing_example_inputs_is_a_value_error():
    with pytest.raises(ValueError, match="needs example_inputs"):
        convert(MLP())


def test_inputs_that_do_not_fit_the_model_are_a_capture_error():
    with pytest.raises(mpgraph.CaptureError, match="mat1 and mat2|shapes cannot be multiplied"):
        convert(MLP(), torch.randn(2, 5))


def test_unknown_ops_stay_fp32_and_are_listed():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.special.erfcx(self.lin(x))

    gm = convert(Custom(), torch.randn(2, 4), dtype=torch.float16)
    rec = gm.plan.node("erfcx" if any(r.name == "erfcx" for r in gm.plan.nodes) else "special_erfcx")
    assert rec.op_class == "unknown" and rec.dtype == "float32"
    assert "; 1 node of unknown op kept in float32 (" in gm.plan.summary()


def test_a_model_on_the_meta_device_is_planned_without_weights():
    """Planning only needs shapes: a model built on the meta device converts (every pass runs on
    meta tensors), allocates no parameter memory, and plans like the materialised model."""
    import mpgraph
    from conftest import MLP

    torch.manual_seed(0)
    real = MLP()
    with torch.device("meta"):
        meta = MLP()
    x = torch.randn(4, 16)
    planned = mpgraph.convert(meta, x.to("meta"), dtype=torch.bfloat16, target="h100", strategy="rules")
    assert all(p.device.type == "meta" for p in planned.parameters())
    direct = mpgraph.convert(real, x, dtype=torch.bfloat16, target="h100", strategy="rules")
    assert [(r.name, r.dtype) for r in planned.plan.nodes] == [(r.name, r.dtype) for r in direct.plan.nodes]
    assert planned.plan.calibration_batches == 0 and all(r.absmax is None for r in planned.plan.nodes)


def test_converted_code_reads_weights_from_the_dicts_that_hold_them():
    """Each parameter and buffer is read as self._modules[..]._parameters[..] and each leaf
    module called as self._modules[..](..) (no chain of nn.Module.__getattr__ calls: host
    time per call), and the reads follow every way the
    weights are replaced afterwards: load_state_dict, setattr of a new Parameter, a buffer
    swapped for a new tensor (what .to() does to buffers), a deepcopy."""
    import copy

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
            self.register_buffer("shift", torch.zeros(16))

        def forward(self, x):
            return self.body(x) + self.shift

    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 16)
    gm = mpgraph.capture(model, x)
    assert "getattr(" not in gm.code and "self._modules['body']._modules['0'](x)" in gm.code
    assert "self._buffers['shift']" in gm.code
    exported = mpgraph.capture(model, x, export_only=True)  # every weight a get_attr node
    assert "getattr(" not in exported.code
    assert "self._modules['body']._modules['0']._parameters['weight']" in exported.code
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
        other = Net().eval()
        gm.load_state_dict(other.state_dict())
        torch.testing.assert_close(gm(x), other(x))
        gm.get_submodule("body.0").weight = nn.Parameter(torch.zeros(16, 16))
        gm.shift = torch.full((16,), 2.0)  # a new buffer object, as .to(device) makes
        want = other.body[2](other.body[1](torch.zeros(4, 16) + other.body[0].bias)) + 2.0
        torch.testing.assert_close(gm(x), want)
        torch.testing.assert_close(copy.deepcopy(gm)(x), want)


def test_a_tokenizer_s_batch_encoding_is_taken_as_keyword_arguments():
    """What a tokenizer returns (transformers.BatchEncoding, a UserDict, not a dict) was passed
    as one positional argument: torch's "embedding(): argument 'indices' must be Tensor, not
    BatchEncoding" came out of the capture."""
    import collections
    from conftest import GPU, tiny_bert
    from mpgraph.numerics import relative_l2
    from transformers import BatchEncoding
    model = tiny_bert(layers=1)  # (a one-layer BERT: the inputs' container is the point)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    encoded = BatchEncoding({"input_ids": ids, "attention_mask": mask})
    # (called with the example's own tensors: static captures)
    fast = mpgraph.convert(model, encoded, target=GPU, dtype="fp16", dynamic=False)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
    assert relative_l2(got, want) < 4e-3
    with pytest.raises(mpgraph.CalibrationError, match="not one batch"):
        mpgraph.convert(model, encoded, target=GPU, dtype="fp16", calibration=encoded,
                        dynamic=False)

    class TakesABatch(nn.Module):  # another mapping is what a forward(self, batch) takes whole
        def forward(self, batch):
            return batch["x"] * 2
    x = torch.randn(2, 4)
    fast = mpgraph.convert(TakesABatch(), collections.UserDict(x=x))
    assert torch.equal(fast(collections.UserDict(x=x)), x * 2)


def test_an_example_input_that_requires_grad_converts_without_torch_s_warning():
    """An example that requires grad (saliency maps, FGSM) printed torch's "Converting a
    tensor with requires_grad=True to a scalar" from the calibration's batch fingerprint."""
    import warnings
    x = torch.randn(2, 8).requires_grad_()
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # (torch warns once a process: an earlier test may have)
    try:
        with warnings.catch_warnings(record=True) as caught:  # (an error filter: a warning
            warnings.simplefilter("always")  # raised inside a try the fingerprint has)
            fast = convert_rules(nn.Sequential(nn.Linear(8, 8)), (x,), dtype="bf16")
    finally:
        torch.set_warn_always(always)
    assert not [str(w.message) for w in caught if "requires_grad" in str(w.message)]
    assert x.grad is None and fast(x).requires_grad


@pytest.mark.parametrize("kwargs, shown", [([1], "list [1]"), ("abc", "str 'abc'")])
def test_example_kwargs_that_are_not_a_dict_are_named(kwargs, shown):
    """A list gave dict()'s "cannot convert dictionary update sequence element #0"."""
    with pytest.raises(TypeError, match=rf"example_kwargs must be a dict of keyword arguments "
                                        rf"\(name: value\), got {re.escape(shown)}: positional "
                                        "arguments go in example_inputs"):
        mpgraph.convert(nn.Linear(2, 2), (torch.randn(1, 2),), example_kwargs=kwargs)


class _Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, idx):
        h = self.l(x)
        if h.shape[0] < 1:  # (fx cannot trace it: torch.export, whose nodes know their line)
            return h
        return h[idx]


def test_a_calibration_batch_that_fails_names_the_node_and_the_model_s_line():
    """It named the node before the failing one ("failed after node view_18"), a name the user
    never wrote: now the failing node and the line of the model's code that made it."""
    x = torch.randn(4, 8)
    with pytest.raises(mpgraph.CalibrationError, match=r"calibration batch 1 failed at node "
                                                       r"\w+ \(test_convert\.py:\d+: return "
                                                       r"h\[idx\]\): IndexError: index 9"):
        mpgraph.convert(_Gather().eval(), (x, torch.tensor([0, 1])), target=GPU,
                        calibration=[(x, torch.tensor([0, 1])), (x, torch.tensor([0, 9]))])


class _GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, adj):
        return torch.sparse.mm(adj, self.l(x))


def test_a_sparse_input_is_refused_by_its_argument_name():
    """It failed inside torch (aminmax has no SparseCPU kernel), blamed on the traced graph."""
    adj = torch.eye(4).to_sparse()
    with pytest.raises(ValueError, match=r"argument 'adj' is a sparse_coo tensor: mpgraph "
                                         r"converts graphs of dense tensors\. Convert the dense "
                                         r"parts .* _GCN's forward, or pass the input dense"):
        mpgraph.convert(_GCN(), (torch.randn(4, 8), adj))
    held = _GCN()
    held.register_buffer("adj", adj)  # (held as a buffer, the usual way: torch's bare "reshape
    with pytest.raises(ValueError, match=r"adj is a sparse_coo tensor: mpgraph converts graphs "
                                         r"of dense tensors"):  # is not implemented for sparse")
        mpgraph.convert(held, (torch.randn(4, 8), torch.eye(4)))


@pytest.mark.parametrize("name", ["graph", "meta", "plan", "cpu_linears"])
def test_a_top_level_submodule_named_like_the_converted_module_s_own_attributes_is_named(name):
    """A GNN's self.graph, a self.meta or self.plan: torch's "cannot assign 'Plan' as child
    module", a "the model itself" report for a model that runs, an internal PassError, or the
    unread keys silently dropped."""
    model = nn.Sequential()
    model.add_module("first", nn.Linear(8, 8))
    model.add_module(name, nn.Linear(8, 8))
    with pytest.raises(ValueError, match=rf"Sequential holds self\.{name}: the converted module "
                                         r"\(a torch\.fx GraphModule\) uses that name for its own "
                                         r"attribute\. Rename it"):
        mpgraph.convert(model, torch.randn(2, 8))


@pytest.mark.parametrize("option, value, shown", [
    ("keep_io_types", "False", "str 'False'"), ("dynamic", "false", "str 'false'"),
    ("keep_io_types", 0, "int 0"), ("progress", "no", "str 'no'")])
def test_a_flag_given_other_than_a_bool_is_named(option, value, shown):
    """keep_io_types="False" was taken as True, silently (the outputs float32 where False gives
    bfloat16), as any non-empty string is: probe pM 5."""
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    with pytest.raises(TypeError, match=rf"^{option} must be True or False, got {shown}$"):
        mpgraph.convert(model, torch.randn(2, 8), dtype="bf16", target=GPU, **{option: value})
    with pytest.raises(ValueError, match="check must be one of"):  # (1 == True passed)
        mpgraph.convert(model, torch.randn(2, 8), dtype="bf16", target=GPU, check=1)
