import operator

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from mpgraph.passes.op_table import (CAST, FOLLOW, FP32_COMPUTE, FP32_ONLY, OP_CLASSES, TENSOR_CORE,
                              UNKNOWN, ATEN_TABLE, FUNCTION_TABLE, METHOD_TABLE, MODULE_TABLE,
                              OP_OF_SPELLING, OPS, OpEntry, OpTable, spellings)
from mpgraph.ir.meta import dtype_name

from conftest import LOW_DTYPES


def _node(op, target, root=None):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    return g.create_node(op, target, (x,), {}), root or nn.Module()


@pytest.mark.parametrize("op,target,expected", [
    ("call_function", torch.matmul, TENSOR_CORE),
    ("call_function", F.linear, TENSOR_CORE),
    ("call_function", F.scaled_dot_product_attention, TENSOR_CORE),
    ("call_function", operator.matmul, TENSOR_CORE),
    ("call_function", F.softmax, FP32_COMPUTE),
    ("call_function", F.layer_norm, FP32_COMPUTE),
    ("call_function", torch.exp, FP32_ONLY),
    ("call_function", torch.sum, FP32_ONLY),
    ("call_function", operator.add, FOLLOW),
    ("call_function", F.relu, FOLLOW),
    ("call_method", "softmax", FP32_COMPUTE),
    ("call_method", "mean", FP32_ONLY),
    ("call_method", "view", FOLLOW),
    ("call_method", "to", CAST),
    ("call_method", "bmm", TENSOR_CORE),
    ("call_function", torch.ops.aten.linear.default, TENSOR_CORE),
    ("call_function", torch.ops.aten.addmm.default, TENSOR_CORE),
    ("call_function", torch.ops.aten.convolution.default, TENSOR_CORE),
    ("call_function", torch.ops.aten._softmax.default, FP32_COMPUTE),
    ("call_function", torch.ops.aten.native_layer_norm.default, FP32_COMPUTE),
    ("call_function", torch.ops.aten.sum.dim_IntList, FP32_ONLY),
    ("call_function", torch.ops.aten.add.Tensor, FOLLOW),
    ("call_function", torch.ops.aten._to_copy.default, CAST),
])
def test_function_and_aten_lookup(op, target, expected):
    node, root = _node(op, target)
    key, entry = OpTable.default().lookup(node, root)
    assert entry is not None, key
    assert entry.class_for(torch.float16) == expected


@pytest.mark.parametrize("module,expected", [
    (nn.Linear(2, 2), TENSOR_CORE), (nn.Conv2d(1, 1, 1), TENSOR_CORE),
    (nn.ConvTranspose2d(1, 1, 1), TENSOR_CORE), (nn.LayerNorm(2), FP32_COMPUTE),
    (nn.BatchNorm2d(2), FP32_COMPUTE), (nn.GroupNorm(1, 2), FP32_COMPUTE),
    (nn.Embedding(3, 2), FOLLOW), (nn.GELU(), FOLLOW), (nn.MaxPool2d(2), FOLLOW),
    (nn.Dropout(), FOLLOW), (nn.Softmax(-1), FP32_COMPUTE),
    (nn.MultiheadAttention(4, 1), TENSOR_CORE), (nn.CrossEntropyLoss(), FP32_ONLY),
])
def test_module_lookup(module, expected):
    root = nn.Module()
    root.m = module
    node, _ = _node("call_module", "m")
    assert OpTable.default().lookup(node, root)[1].class_for(torch.float16) == expected


def test_module_subclasses_match_through_the_mro():
    class MyLinear(nn.Linear):
        pass
    root = nn.Module()
    root.m = MyLinear(2, 2)
    node, _ = _node("call_module", "m")
    assert OpTable.default().lookup(node, root)[1].op_class == TENSOR_CORE


def test_range_expanding_elementwise_ops_relax_for_bf16_but_reductions_do_not():
    for target in (torch.pow, torch.exp):
        entry = FUNCTION_TABLE[target]
        assert entry.class_for(torch.float16) == FP32_ONLY
        assert entry.class_for(torch.bfloat16) == FOLLOW
    for target in (torch.sum, torch.mean):
        assert FUNCTION_TABLE[target].class_for(torch.bfloat16) == FP32_ONLY


def test_unknown_targets_return_none():
    def custom(x):
        return x
    node, root = _node("call_function", custom)
    key, entry = OpTable.default().lookup(node, root)
    assert entry is None and "custom" in key


def test_user_table_takes_precedence_and_is_validated():
    table = OpTable.default({torch.exp: "follow", "mystery": OpEntry(TENSOR_CORE, "mine")})
    node, root = _node("call_function", torch.exp)
    assert table.lookup(node, root)[1].op_class == FOLLOW
    node, root = _node("call_method", "mystery")
    assert table.lookup(node, root)[1].reason == "mine"
    with pytest.raises(ValueError, match="unknown op class"):
        OpTable.default({torch.exp: "fast"})


def test_every_entry_has_a_class_and_a_reason():
    for table in (MODULE_TABLE, FUNCTION_TABLE, METHOD_TABLE, ATEN_TABLE):
        for key, entry in table.items():
            assert entry.op_class in OP_CLASSES and entry.op_class != UNKNOWN, key
            assert entry.reason.strip(), key


# -- one entry per op, every spelling derived from it (issue 19, item 3) -------------------------

def _lookup(op, target):
    node, root = _node(op, target)
    return OpTable.default().lookup(node, root)[1]


def _overload(packet):
    """A concrete overload of an ATen packet (what torch.export puts in graphs)."""
    names = packet.overloads()
    return getattr(packet, "default" if "default" in names else names[0])


def _spelled(name: str) -> list[tuple[str, object]]:
    """(node op, target) of every spelling of ``name`` that this torch build has, found here
    without the table's own derivation: torch.<name>, F.<name>, torch.linalg.<rest>, the Tensor
    method and an overload of aten.<name>, each also with a trailing underscore (in place)."""
    out = []
    for variant in (name, name + "_"):
        for space, attr in ((torch, variant), (F, variant),
                            (torch.linalg, variant.removeprefix("linalg_"))):
            fn = getattr(space, attr, None)
            if (space is not torch.linalg or name.startswith("linalg_")) and callable(fn) \
                    and not isinstance(fn, type):
                out.append(("call_function", fn))
        if callable(getattr(torch.Tensor, variant, None)):
            out.append(("call_method", variant))
        packet = getattr(torch.ops.aten, variant, None) if "." not in variant else None
        if isinstance(packet, torch._ops.OpOverloadPacket):
            out.append(("call_function", _overload(packet)))
    return out


def test_every_op_is_one_entry_and_its_function_method_and_aten_spellings_agree():
    for name, entry in OPS.items():
        for op, target in _spelled(name):
            found = _lookup(op, target)
            assert found == entry, f"{name}: {op} {target} is {found}, the op's entry is {entry}"
            for low in (torch.float16, torch.bfloat16):
                assert found.class_for(low) == entry.class_for(low), (name, target)


def test_the_methods_the_three_tables_had_lost_are_classified():
    """exp2, trunc, erfinv, true_divide, fmax, fmin, isfinite had a function and an ATen entry
    but no method: ``x.exp2()`` was 'unknown'."""
    for name in ("exp2", "trunc", "erfinv", "true_divide", "fmax", "fmin", "isfinite"):
        assert _lookup("call_method", name) == OPS[name], name
        assert _lookup("call_function", getattr(torch, name)) == OPS[name], name


def test_every_spelling_belongs_to_one_op_and_every_op_has_one():
    for name in OPS:
        if name.startswith("transformers."):  # (registered on transformers' import: by name)
            continue
        assert spellings(name), f"{name} has no spelling in this torch build"
    for table in (MODULE_TABLE, FUNCTION_TABLE, METHOD_TABLE, ATEN_TABLE):
        for key, entry in table.items():
            assert OPS[OP_OF_SPELLING[key]] is entry, key


def test_range_expanding_ops_carry_a_flag_not_a_reason_text():
    """NumericSafety reads ``range_expanding`` (through OpInfo), never the reason's words."""
    flagged = {name for name, e in OPS.items() if e.range_expanding}
    assert {"exp", "exp2", "expm1", "pow", "rsqrt", "reciprocal", "softplus"} <= flagged
    assert not flagged & {"sum", "mean", "log", "softmax", "add"}
    for name in flagged:
        assert OPS[name].class_for(torch.float16) == FP32_ONLY
        assert OPS[name].class_for(torch.bfloat16) == FOLLOW


# -- coverage against PyTorch's own autocast lists ----------------------------------------------

# torch/testing/_internal/autocast_test_lists.py: the ops autocast runs in the low dtype
# ("lower precision fp") and in float32, for CUDA (AutocastTestLists) and CPU
# (AutocastCPUTestLists). Its import needs expecttest, which is no dependency of ours: read as text.
_AUTOCAST_LOW = ("torch_fp16", "torch_16", "nn_fp16", "nn_16", "linalg_fp16", "methods_fp16")
_AUTOCAST_FP32 = ("torch_fp32", "nn_fp32", "methods_fp32")
# Where the table deliberately differs from autocast: op -> (our class, why).
AUTOCAST_DIFFERS = {
    "prelu": (FOLLOW, "elementwise max(0, x) + a min(0, x), no matmul: a follow op runs low "
                      "wherever its inputs are low (where autocast runs it), and alone it is not "
                      "worth two casts"),
    "avg_pool3d": (FOLLOW, "an average over a window stays within its inputs' range; only "
                           "autocast's CPU list keeps it float32, its CUDA list does not"),
    "reflection_pad1d": (FOLLOW, "padding copies elements, exact in any dtype; only autocast's "
                                 "CPU list keeps it float32, its CUDA list does not"),
}


def _autocast_lists() -> dict[str, set[str]]:
    import ast
    import pathlib
    path = pathlib.Path(torch.__file__).parent / "testing" / "_internal" / "autocast_test_lists.py"
    if not path.exists():
        pytest.skip(f"this torch build has no {path.name}")
    lists: dict[str, set[str]] = {}
    for klass in ast.parse(path.read_text()).body:
        if not (isinstance(klass, ast.ClassDef) and klass.name.startswith("Autocast")):
            continue
        for node in ast.walk(klass):  # self.<list> = [("op", args...), ...]
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.List) \
                    and isinstance(node.targets[0], ast.Attribute):
                lists.setdefault(node.targets[0].attr, set()).update(
                    item.elts[0].value for item in node.value.elts if isinstance(item, ast.Tuple))
    return lists


def _classes_of(name: str) -> set[str]:
    """The fp16 classes every spelling of an autocast op name gets ("__matmul__": a method)."""
    spelled = [("call_method", name)] if name.startswith("__") else _spelled(name)
    entries = [_lookup(op, target) for op, target in spelled]
    return {e.class_for(torch.float16) if e else UNKNOWN for e in entries}


def test_autocast_op_lists_are_covered():
    lists = _autocast_lists()
    low = set().union(*(lists.get(k, set()) for k in _AUTOCAST_LOW))
    fp32 = set().union(*(lists.get(k, set()) for k in _AUTOCAST_FP32))
    assert len(low) > 25 and len(fp32) > 50 and not low & fp32
    wrong = []
    for name in sorted(low | fp32):
        want = {AUTOCAST_DIFFERS[name][0]} if name in AUTOCAST_DIFFERS else \
            {TENSOR_CORE} if name in low else {FP32_ONLY, FP32_COMPUTE}
        got = _classes_of(name)
        if not got or not got <= want:
            wrong.append(f"{name}: {sorted(got)}, autocast {'low' if name in low else 'fp32'}")
    assert not wrong, "\n".join(wrong)
    assert set(AUTOCAST_DIFFERS) <= low | fp32  # no stale exceptions


# -- every ATen op the model zoo produces has a class --------------------------------------------

def _zoo():
    t = pytest.importorskip("transformers")
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    tokens, image = torch.randint(0, 100, (2, 8)), torch.randn(2, 3, 32, 32)
    return {
        "bert": lambda: (t.BertModel(t.BertConfig(vocab_size=100, max_position_embeddings=64,
                                                  **small)), tokens),
        "gpt2": lambda: (t.GPT2Model(t.GPT2Config(vocab_size=100, n_positions=64, n_embd=32,
                                                  n_layer=1, n_head=2, use_cache=False)), tokens),
        "llama": lambda: (t.LlamaModel(t.LlamaConfig(vocab_size=100, max_position_embeddings=64,
                                                     num_key_value_heads=1, use_cache=False,
                                                     **small)), tokens),
        "vit": lambda: (t.ViTModel(t.ViTConfig(image_size=32, patch_size=8, **small)), image),
        "resnet": lambda: (t.ResNetModel(t.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                                        depths=[1, 1], layer_type="basic")), image),
        "convnext": lambda: (t.ConvNextModel(t.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1],
                                                              num_stages=2, image_size=32)), image),
    }


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit", "resnet", "convnext"])
def test_every_aten_op_the_zoo_models_produce_is_classified(name):
    import mpgraph
    from mpgraph.ir.meta import OP_CLASS
    from mpgraph.passes import ClassifyOps
    torch.manual_seed(0)
    model, x = _zoo()[name]()
    gm = mpgraph.capture(model.eval(), x)
    ClassifyOps(torch.float16)(gm)
    unknown = sorted({n.meta[OP_CLASS].key for n in gm.graph.nodes
                      if n.meta[OP_CLASS].op_class == UNKNOWN})
    assert not unknown, f"{name}: {unknown}"


# -- recurrent layers convert like autocast runs them --------------------------------------------

class Recurrent(nn.Module):
    """A linear layer, a two-layer recurrent layer, a linear layer. ``export``: a shape check
    symbolic tracing cannot follow, so torch.export captures it (the layer as one ATen op,
    aten.lstm / aten.gru / aten.rnn_tanh, with flat outputs) instead of fx (a leaf module whose
    output is nested for nn.LSTM: (output, (h, c)))."""

    def __init__(self, kind, export: bool):
        super().__init__()
        self.export = export
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(16, 4)
        self.rnn = kind(8, 16, num_layers=2, batch_first=True)

    def forward(self, x):
        if self.export and x.shape[-1] != 8:
            raise ValueError("expected 8 features")
        return self.out(self.rnn(self.fc(x))[0])


@pytest.mark.filterwarnings("ignore:The tensor attributes self.rnn._flat_weights")  # torch.export's
@pytest.mark.parametrize("kind, export", [
    (nn.GRU, False), (nn.RNN, False), (nn.GRU, True), (nn.RNN, True), (nn.LSTM, True),
    (nn.LSTM, False),
])
def test_recurrent_layers_run_low_within_tolerance(kind, export):
    import mpgraph
    from conftest import TOL, rel_err
    torch.manual_seed(0)
    model, x = Recurrent(kind, export).eval(), torch.randn(2, 5, 8)
    # (called at the example's shape only: the torch.export route captures statically)
    gm = mpgraph.convert(model, x, dtype=torch.float16, target="a100", strategy="rules",
                         **({"dynamic": False} if export else {}))
    assert gm.plan.capture == ("torch.export at the example's shapes" if export
                               else "torch.fx.symbolic_trace")
    layers = [r for r in gm.plan.nodes if r.op_class == TENSOR_CORE and r.name not in
              ("fc", "out", "linear", "linear_1")]
    assert len(layers) == 1 and layers[0].dtype == "float16", layers
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL[torch.float16]


class ExpBetweenLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.exp(self.a(x)))


@pytest.mark.parametrize("flag", [True, False])
def test_numeric_safety_lowers_what_the_flag_marks_whatever_the_reason_says(flag):
    import mpgraph
    torch.manual_seed(0)
    text = "mine" if flag else OPS["exp"].reason  # the flag decides, not the words
    table = {torch.exp: OpEntry(FP32_ONLY, text, bf16=FOLLOW, range_expanding=flag)}
    gm = mpgraph.convert(ExpBetweenLinears().eval(), torch.randn(4, 8), dtype=torch.float16,
                         target="a100", strategy="rules", op_table=table)
    exp = gm.plan.node("exp")
    if flag:
        assert exp.dtype == "float16" and exp.op_class == FOLLOW
        assert exp.reason.startswith("all float inputs are float16"), exp.reason
    else:
        assert exp.dtype == "float32" and exp.op_class == FP32_ONLY and exp.reason == text


class TransposedWeight(nn.Module):
    """Falcon's FalconLinear (``x @ self.weight.T``) and its cousins, captured by torch.export
    (the branch on a shape stops symbolic_trace)."""

    def __init__(self, spell):
        super().__init__()
        self.spell = spell
        self.w = nn.Parameter(torch.randn(64, 32) / 8)

    def forward(self, x):
        if x.shape[-1] != 32:
            raise ValueError("expected 32 features")
        return torch.relu(x @ self.spell(self.w))


@pytest.mark.parametrize("name, spell", [
    ("T", lambda w: w.T), ("mT", lambda w: w.mT), ("mH", lambda w: w.mH),
    ("swapaxes", lambda w: w.swapaxes(0, 1)), ("swapdims", lambda w: w.swapdims(0, 1)),
    ("adjoint", lambda w: w.adjoint()), ("moveaxis", lambda w: torch.moveaxis(w, 0, 1))])
def test_a_transposed_weight_is_stored_low_not_cast_on_every_call(name, spell):
    """aten.numpy_T, mT, swapaxes ... were unknown ops: the weight stayed float32 and was cast
    to bf16 on every call (Falcon: 0 weights stored low, 8 weight casts a forward), and
    export_onnx refused its own plan ("runtime weight cast"). They are views, as transpose is."""
    import mpgraph
    from mpgraph.numerics import relative_l2
    model = TransposedWeight(spell).eval()
    x = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(0))
    fast = mpgraph.convert(model, (x,), dtype="bf16", target="a100", strategy="rules")
    assert "torch.export" in fast.plan.summary() and fast.plan.unknown_nodes == []
    assert fast.w.dtype == torch.bfloat16
    assert all(c.numel != 64 * 32 for c in fast.plan.casts), fast.plan.format_casts()
    assert relative_l2(fast(x), model(x)) < 3e-2


def test_moe_experts_grouped_matmul_is_tensor_core_work_priced_by_its_flops():
    """transformers' MoE experts (Mixtral, Qwen-MoE) run as its custom op grouped_mm_fallback,
    registered on transformers' first import (after this table was built): it was an unknown
    op, kept float32 and priced by its output size (1/K of its FLOPs: 500x too few at Mixtral's
    sizes), where the experts are most of an MoE layer's work."""
    transformers = pytest.importorskip("transformers")
    import mpgraph
    from mpgraph.numerics import relative_l2
    torch.manual_seed(0)
    hidden, inner, experts, top = 64, 128, 4, 2
    model = transformers.MixtralModel(transformers.MixtralConfig(
        hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=inner, vocab_size=100, num_local_experts=experts,
        num_experts_per_tok=top, use_cache=False)).eval()
    ids = torch.randint(0, 100, (2, 16))
    # (priced and called at the example's shape: a static capture)
    fast = mpgraph.convert(model, (ids,), dtype="bf16", target="a100", strategy="rules",
                           dynamic=False)
    grouped = {r.name: r for r in fast.plan.nodes if "grouped_mm" in r.name}
    rows = ids.numel() * top  # (each token goes to its top experts)
    assert sorted(r.flops for r in grouped.values()) == [2.0 * rows * hidden * inner,
                                                         2.0 * rows * hidden * 2 * inner]
    assert {r.dtype for r in grouped.values()} == {"bfloat16"}
    assert all("matrix multiply" in r.reason for r in grouped.values())
    with torch.no_grad():
        measured = relative_l2(fast(ids).last_hidden_state.float(), model(ids).last_hidden_state)
    assert measured == pytest.approx(fast.plan.check["error"], rel=0.05)


class Rotary(nn.Module):
    """A rotary embedding applied as complex numbers with no ``.float()`` first (Meta's reference
    code writes one): valid float32 code."""

    def __init__(self, export):
        super().__init__()
        self.export, self.q, self.o = export, nn.Linear(16, 16), nn.Linear(16, 16)
        angles = torch.outer(torch.arange(6).float(), torch.rand(8))
        self.register_buffer("cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x):
        if self.export and x.shape[-1] != 16:  # (a data-dependent branch: torch.export)
            raise ValueError("expected 16 features")
        q = self.q(x)
        qc = torch.view_as_complex(q.unflatten(-1, (-1, 2)))
        return self.o(torch.view_as_real(qc * self.cis).flatten(2))


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("export", [False, True])
def test_a_complex_view_keeps_its_input_float32(dtype, export):
    """Probe pN F4: ``view_as_complex`` was a layout move, following its low input: an fp16 plan
    made complex32 where the plan said complex64 ("ConversionError: the converted graph does not
    match its plan"), a bf16 one a RuntimeError inside the check (there is no complex bfloat16).
    Its input now stays float32, and ``view_as_real`` of the complex64 result gives float32."""
    import mpgraph
    from conftest import TOL, rel_err
    torch.manual_seed(0)
    model, x = Rotary(export).eval(), torch.randn(2, 6, 16)
    gm = mpgraph.convert(model, (x,), dtype=dtype, target="a100", strategy="rules")
    assert gm.plan.capture == ("torch.export" if export else "torch.fx.symbolic_trace")
    view, real = gm.plan.node("view_as_complex"), gm.plan.node("view_as_real")
    assert (view.op_class, view.dtype, real.dtype) == (FP32_ONLY, "float32", "float32")
    assert "no complex bfloat16" in view.reason
    assert {r.dtype for r in gm.plan.nodes if r.op_class == TENSOR_CORE} == {dtype_name(dtype)}
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL[dtype]
