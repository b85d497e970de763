"""ONNX export: the file's types are the plan, it validates, and failures are clean ExportErrors."""
import functools
import os
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

onnx = pytest.importorskip("onnx")
ir = pytest.importorskip("onnx_ir")
pytest.importorskip("onnxruntime")

import mpgraph  # noqa: E402
from mpgraph.numerics import relative_l2  # noqa: E402
from mpgraph.cost.specs import DeviceSpec  # noqa: E402
from mpgraph.tools.onnx_check import inspect_model, load_with_types, validate_onnx  # noqa: E402

from conftest import GPU, convert_rules, MLP, ConvBnReluPool, ConvNextish, SoftmaxAttention  # noqa: E402

convert = convert_rules  # these tests pin the rules, planned for conftest.GPU
export_onnx = functools.partial(mpgraph.export_onnx, strategy="rules")

LOW = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}


def _tel():
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()


def _convnext():
    """ConvNeXt (issue 17): channels-last LayerNorms between convs and linears."""
    from transformers import ConvNextConfig, ConvNextModel
    torch.manual_seed(0)
    config = ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=64)
    return ConvNextModel(config).eval()


SMALL = {
    "mlp": (lambda: MLP().eval(), lambda: (torch.randn(4, 16),), {}),
    "convnext": (_convnext, lambda: (torch.randn(2, 3, 64, 64),), {}),
    "cnn": (lambda: ConvBnReluPool().eval(), lambda: (torch.randn(2, 3, 16, 16),), {}),
    "attention": (lambda: SoftmaxAttention().eval(), lambda: (torch.randn(2, 6, 16),), {}),
    "transformer_encoder_layer": (_tel, lambda: (torch.randn(2, 10, 32),), {}),
}


def _check_file(path, result, low):
    model = load_with_types(str(path))
    low_type = LOW[low]
    # weights of every matmul/gemm/conv reading low activations are low initializers
    weights = 0
    for node in model.graph:
        if node.op_type in ("MatMul", "Gemm", "Conv") and node.inputs[0].dtype == low_type:
            for v in node.inputs[1:]:
                if v is not None and v.is_initializer():
                    assert v.dtype == low_type, (node.name, v.name, v.dtype)
                    weights += 1
    assert weights > 0
    stats = inspect_model(model)
    assert stats.casts == result.casts_in_file == result.casts_expected == len(result.plan.cast_sequence())
    assert result.cast_differences == []
    assert stats.runtime_weight_casts == [] and stats.round_trips == [] and stats.low_fp32_ops == []
    assert stats.low_flop_share == 1.0
    for v in model.graph.inputs:
        assert v.dtype in (ir.DataType.FLOAT, ir.DataType.INT64)
    for v in model.graph.outputs:
        assert v.dtype == ir.DataType.FLOAT
    props = model.metadata_props
    assert props["mpgraph.dtype"] == result.plan.summary().split(" to ")[1].split()[0]
    assert props["mpgraph.summary"] == result.plan.summary()
    casts = [n for n in model.graph if n.op_type == "Cast" and "mpgraph.cast" in n.metadata_props]
    assert {n.metadata_props["mpgraph.cast"] for n in casts} == {c.name for c in result.plan.casts}
    assert all(n.metadata_props["mpgraph.inserted_by"] == "InsertCasts" for n in casts)


@pytest.mark.parametrize("low", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(SMALL))
def test_small_models_export_and_validate(name, low, tmp_path):
    build, inputs, kwargs = SMALL[name]
    model, args = build(), inputs()
    path = tmp_path / f"{name}.onnx"
    # static shapes: dynamic ones (the default) are tested on BERT (test_semantics.py) and cost
    # a second symbolic trace per export here
    result = export_onnx(model, args, path, dtype=low, dynamic_shapes=None)
    assert path.exists() and result.path == str(path)
    assert result.exporter == "torch.onnx.export(dynamo=True)"
    v = result.validation
    # onnxruntime's CPU provider has no bf16 MatMul: bf16 runs as the emulation there (a CUDA
    # provider, where one loads, runs the file as it is)
    assert v is not None and v.emulated == (low == "bf16" and v.provider == "CPUExecutionProvider")
    assert max(v.err_vs_converted) < {"fp16": 1e-2, "bf16": 3e-2}[low]
    assert max(v.err_vs_fp32) < {"fp16": 1e-2, "bf16": 4e-2}[low]
    _check_file(path, result, low)
    assert sorted(os.listdir(tmp_path)) == [f"{name}.onnx"]  # no temporary files left


@pytest.mark.parametrize("low", ["fp16", "bf16"])
@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_huggingface_models_export(arch, low, request, token_ids, tmp_path):
    model = request.getfixturevalue(arch)
    ids, mask = token_ids
    path = tmp_path / f"{arch}.onnx"
    # (static shapes: the file runs at the example's shapes only; a BERT's dynamic axes are
    # tested in test_semantics.py and test_dimensions_the_capture_fixed_stay_static_in_the_file)
    result = export_onnx(model, (ids,), path, example_kwargs={"attention_mask": mask}, dtype=low,
                         dynamic_shapes=None)
    _check_file(path, result, low)
    # the attention op computes its softmax in float32
    model_ir = load_with_types(str(path))
    attn = [n for n in model_ir.graph if n.op_type == "Attention"]
    assert len(attn) == model.config.num_hidden_layers
    assert all(n.attributes["softmax_precision"].value == int(ir.DataType.FLOAT) for n in attn)
    # 4 precision casts per transformer layer, plus 2 for BERT's pooler
    layers = model.config.num_hidden_layers
    assert result.casts_in_file == 4 * layers + (2 if arch == "bert" else 0)
    # onnxruntime on the file itself agrees with the module
    if low == "fp16":
        sess = mpgraph.ort_session(path)  # CUDA where torch sees a GPU and onnxruntime's loads
        if not torch.cuda.is_available():
            assert sess.get_providers() == ["CPUExecutionProvider"]
        out = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        with torch.no_grad():
            ref = model(ids, attention_mask=mask).last_hidden_state.numpy()
        assert relative_l2(out, ref) < 1e-2


def test_opset_18_decomposed_attention_gets_float32_softmax(tmp_path):
    result = export_onnx(_tel(), (torch.randn(2, 10, 32),), tmp_path / "t.onnx",
                         dtype="fp16", opset=18, dynamic_shapes=None)  # (static: not run)
    assert result.opset == 18
    assert result.edits["decomposed softmax wrapped in float32 casts"] == 1
    model = load_with_types(str(tmp_path / "t.onnx"))
    softmax = [n for n in model.graph if n.op_type == "Softmax"]
    assert [n.inputs[0].dtype for n in softmax] == [ir.DataType.FLOAT]
    assert result.casts_in_file == len(result.plan.casts)  # the softmax casts are labelled, not counted


class _PaddedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                             attn_mask=mask[:, None, None, :])
        return self.o(a.transpose(1, 2).reshape(b, t, 16))


def test_opset_18_attention_gives_a_fully_masked_row_torchs_zero(tmp_path):
    """torch.onnx's decomposition masks with the dtype's lowest value, so its IsNaN guard never
    fired: a fully padded item attended to every key alike (rel. L2 1.6 from the model), and an
    example holding one failed validation ('do not match ... node_scaled_dot_product_attention')."""
    torch.manual_seed(0)
    model, x = _PaddedAttention().eval(), torch.randn(3, 6, 16)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2] = False  # a fully padded item
    path = tmp_path / "p.onnx"
    # (static shapes: the file runs at the example's shapes only)
    result = export_onnx(model, (x, mask), path, dtype="fp16", opset=18, dynamic_shapes=None)
    assert result.edits["decomposed attention's bool mask set to -inf (a fully masked row gives 0)"] == 1
    out = mpgraph.ort_session(str(path), device="cpu").run(None, {"x": x.numpy(),
                                                                 "mask": mask.numpy()})[0]
    with torch.no_grad():
        ref = model(x, mask)
    assert relative_l2(out[2], ref[2].numpy()) < 1e-2


def test_external_data_round_trip(tmp_path):
    model, x = MLP().eval(), torch.randn(4, 16)
    path = tmp_path / "mlp.onnx"
    result = export_onnx(model, x, path, dtype="fp16", external_data_threshold=0,
                         dynamic_shapes=None)  # (static: the file runs at the example's shape)
    assert result.external_data == "mlp.onnx.data"
    assert sorted(os.listdir(tmp_path)) == ["mlp.onnx", "mlp.onnx.data"]
    proto = onnx.load(str(path), load_external_data=False)
    big = [i for i in proto.graph.initializer if np.prod(i.dims) * 2 > 256]  # small ones stay inline
    assert big and all(i.data_location == onnx.TensorProto.EXTERNAL for i in big)
    out = mpgraph.ort_session(path, device="cpu").run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), rtol=2e-2, atol=2e-3)


def test_converted_module_can_be_exported_as_is(tmp_path):
    x = torch.randn(4, 16)
    converted = convert(MLP().eval(), x, dtype=torch.float16)
    result = export_onnx(converted, x, tmp_path / "c.onnx")
    assert result.plan is converted.plan and result.validation.err_vs_fp32 is None


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, a, b):
        return self.fc(a) - self.fc(b)


def test_one_tensor_given_for_two_inputs_exports_a_file_with_both(tmp_path):
    """torch.export takes one tensor given twice as one input: the file read the second input
    for both (error 0.96 on two tensors), and validation on the same example passed."""
    torch.manual_seed(0)
    model, x, y = _Pair().eval(), torch.randn(4, 8), torch.randn(4, 8)
    path = tmp_path / "pair.onnx"
    # (static shapes: the file runs at the example's shapes only)
    mpgraph.export_onnx(model, (x, x), path, dtype="fp16", target=GPU, dynamic_shapes=None)
    session = mpgraph.ort_session(str(path))
    assert [i.name for i in session.get_inputs()] == ["a", "b"]
    out = session.run(None, {"a": x.numpy(), "b": y.numpy()})[0]
    assert relative_l2(torch.from_numpy(out).float(), model(x, y).detach()) < 4e-3


def test_unwritable_path_is_an_export_error(tmp_path):
    with pytest.raises(mpgraph.ExportError, match="does not exist"):
        export_onnx(MLP(), torch.randn(2, 16), tmp_path / "missing" / "m.onnx")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permission bits
            pytest.skip("running as a user that can write anywhere")
        with pytest.raises(mpgraph.ExportError, match="not writable"):
            export_onnx(MLP(), torch.randn(2, 16), locked / "m.onnx")
    finally:
        locked.chmod(0o700)


def test_readonly_directory_is_an_export_error_even_for_root(tmp_path):
    target = tmp_path / "taken.onnx"
    target.mkdir()  # a directory where the file should go
    with pytest.raises(mpgraph.ExportError, match="is a directory"):
        export_onnx(MLP(), torch.randn(2, 16), target)


class EinsumAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        w = torch.einsum("bqd,bkd->bqk", q, k).softmax(-1)
        return torch.einsum("bqk,bkd->bqd", w, v)


def test_op_the_opset_cannot_express_is_an_export_error_and_leaves_nothing(tmp_path):
    # ONNX Conv takes bfloat16 only from opset 22 (static shapes throughout: no file here is run
    # at another shape, and the refusals do not depend on them)
    with pytest.raises(mpgraph.ExportError, match=r"ONNX's Conv takes bfloat16 from opset 22, "
                                                  r"this file is opset 18: export with opset=22"):
        export_onnx(ConvBnReluPool().eval(), torch.randn(2, 3, 16, 16),
                            tmp_path / "cnn.onnx", dtype="bf16", opset=18, dynamic_shapes=None)
    assert os.listdir(tmp_path) == []
    # Einsum has no bfloat16 at the default opset 23: the hint said "export with opset=23"
    x = torch.randn(2, 8, 32)
    with pytest.raises(mpgraph.ExportError, match=r"ONNX's Einsum takes bfloat16 from opset "
                                                  r"\d+, this file is opset 23: .* or keep it "
                                                  r"float32 \(mpgraph.convert with overrides="
                                                  r"\{'op:\*einsum\*': 'fp32'\}, then "
                                                  r"export_onnx of the module it returns\)"):
        export_onnx(EinsumAttention().eval(), x, tmp_path / "e.onnx", dtype="bf16",
                    target="a100", strategy="rules", dynamic_shapes=None)
    fast = mpgraph.convert(EinsumAttention().eval(), x, dtype="bf16", target="a100",
                           strategy="rules", overrides={"op:*einsum*": "fp32"}, dynamic=False)
    export_onnx(fast, x, tmp_path / "e.onnx")  # (what it says: written, validated)
    assert os.path.exists(tmp_path / "e.onnx")


@pytest.mark.parametrize("opset", [7, 17, 99, 0, 18.0, True])
def test_an_opset_the_exporter_cannot_write_is_a_value_error(tmp_path, opset):
    """opset=7 and opset=99 wrote opset 18, and opset=0 the default 23, each with exit code 0
    and nothing in the result that said so."""
    with pytest.raises(ValueError, match=r"opset must be an int from 18 to \d+ .* got "
                                         + re.escape(repr(opset))):
        export_onnx(MLP().eval(), torch.randn(2, 16), tmp_path / "x.onnx", opset=opset)
    assert os.listdir(tmp_path) == []


class NoOnnx(nn.Module):
    def forward(self, x):
        return torch.linalg.inv(x) + 1  # neither ONNX exporter can translate a matrix inverse


def test_model_that_fails_to_export_is_an_export_error_and_leaves_nothing(tmp_path):
    with pytest.raises(mpgraph.ExportError, match="could not be exported") as info:
        export_onnx(NoOnnx(), torch.randn(3, 3), tmp_path / "x.onnx", dynamic_shapes=None)
    assert "dynamo=True" in str(info.value) and "dynamo=False" in str(info.value)
    assert "linalg_inv" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_model_in_training_mode_is_an_export_error_that_says_eval(tmp_path):
    """A model built and exported without .eval() (HF models start in training mode) failed
    in onnx's checker ('unsupported type: tensor(bool)') or in the validation of dropout."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))  # training mode, as built
    # (static shapes throughout: no file here is run at another shape)
    for module in (model, convert(model, torch.randn(4, 8), dtype=torch.float16, dynamic=False)):
        with pytest.raises(mpgraph.ExportError, match=r"is in training mode .* Call \.eval\(\) "
                                                      r"on it before export_onnx"):
            export_onnx(module, torch.randn(4, 8), tmp_path / "train.onnx", dynamic_shapes=None)
    assert not os.listdir(tmp_path)
    export_onnx(model.eval(), torch.randn(4, 8), tmp_path / "eval.onnx", dynamic_shapes=None)


def test_a_meta_model_is_an_export_error_before_any_exporter_runs(tmp_path, caplog):
    """A model built on the meta device converted (planned from shapes), then torch's exporter
    failed (FakeTensorDeviceMismatchError), the TorchScript one was tried, and only then did the
    converted module say its weights were missing."""
    with torch.device("meta"):
        model = MLP().eval()
    for module in (model, mpgraph.convert(model, torch.randn(4, 16), dtype="fp16", target=GPU)):
        with pytest.raises(mpgraph.ExportError, match=r"the model or its inputs hold tensors on "
                                                      r"the meta device .* load its weights"):
            export_onnx(module, torch.randn(4, 16), tmp_path / "meta.onnx")
    assert "exporter" not in caplog.text and not os.listdir(tmp_path)


def test_an_output_that_is_not_a_tensor_is_an_export_error_naming_it(tmp_path, caplog):
    """A str (or int) among the outputs converted, then both of torch's exporters failed inside
    ("'str' object has no attribute 'name'", "number of output names provided (3) exceeded
    number of outputs (1)"). A None output exports (the exporter leaves it out)."""
    class Tagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)

        def forward(self, x):
            return {"y": self.a(x), "tag": "hello", "n": None, "k": 3}

    with pytest.raises(mpgraph.ExportError, match=r"outputs tag \(a str, 'hello'\), k \(an int, 3\) "
                                                  r"are not a tensor: .* return such values "
                                                  r"outside the exported module"):
        export_onnx(Tagged().eval(), torch.randn(4, 16), tmp_path / "tagged.onnx")
    assert "exporter" not in caplog.text and not os.listdir(tmp_path)


def test_model_that_cannot_be_captured_is_an_export_error(tmp_path):
    class DataDependent(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(mpgraph.ExportError, match="could not convert"):
        export_onnx(DataDependent(), torch.randn(3), tmp_path / "x.onnx")
    assert os.listdir(tmp_path) == []


def test_numeric_mismatch_names_the_node(tmp_path):
    model, x = SoftmaxAttention().eval(), torch.randn(2, 6, 16)
    path = tmp_path / "a.onnx"
    # (static shapes: the file runs at the example's shape only)
    result = export_onnx(model, x, path, dtype="fp16", dynamic_shapes=None)
    proto = onnx.load(str(path))
    weight = next(i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16
                  and len(i.dims) == 2)
    arr = onnx.numpy_helper.to_array(weight) * np.float16(3000.0)  # overflows fp16 downstream
    weight.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float16), weight.name))
    onnx.save(proto, str(path))
    with pytest.raises(mpgraph.ExportError, match=r"do not match .*node \S+ \((MatMul|Gemm|Attention|Softmax|Mul|Div|Add)\)"):
        validate_onnx(str(path), convert(model, x, dtype="fp16", dynamic=False), (x,), {},
                      reference=model)
    assert result.validation is not None


def test_ort_session_prefers_cpu_quietly_without_a_gpu(tmp_path, capfd):
    path = tmp_path / "m.onnx"
    export_onnx(MLP(), torch.randn(2, 16), path, validate=False, dynamic_shapes=None)  # (static)
    capfd.readouterr()
    sess = mpgraph.ort_session(path, device=None if not torch.cuda.is_available() else "cpu")
    assert sess.get_providers() == ["CPUExecutionProvider"]
    err = capfd.readouterr().err
    assert "libcublas" not in err and "CUDAExecutionProvider" not in err
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            mpgraph.ort_session(path, device="cuda")


def test_dynamic_shapes_pass_through_to_the_exporter(tmp_path):
    model = MLP().eval()
    path = tmp_path / "dyn.onnx"
    batch = torch.export.Dim("batch", min=1, max=64)
    export_onnx(model, torch.randn(4, 16), path, dynamic_shapes={"x": {0: batch}})
    x = torch.randn(9, 16)
    out = mpgraph.ort_session(path).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        assert relative_l2(out, model(x)) < 1e-2


@pytest.mark.slow
def test_dimensions_the_capture_fixed_stay_static_in_the_file(tmp_path):
    """The converted graph's own export saw no guard on what the first capture fixed: a ViT's
    file declared channels and image size free (['s99', 's59', 's100', 's4']), ran 36x36
    images silently and failed inside onnxruntime on 64x64. Batch and sequence stay dynamic."""
    from transformers import BertConfig, BertModel, ViTConfig, ViTModel
    torch.manual_seed(0)
    vit = ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1,
                             num_attention_heads=4, intermediate_size=128)).eval()
    export_onnx(vit, torch.randn(2, 3, 32, 32), tmp_path / "vit.onnx")
    shape = mpgraph.ort_session(tmp_path / "vit.onnx").get_inputs()[0].shape
    assert isinstance(shape[0], str) and shape[1:] == [3, 32, 32]
    # a BERT given its mask and token types at its maximum length (padding="max_length"): the
    # three sequences are tied (changed one at a time, each was refused) and bounded above
    # (a longer one refused): neither fixes them
    bert = BertModel(BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=128, vocab_size=100,
                                max_position_embeddings=16)).eval()
    ids = torch.randint(0, 100, (2, 16))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "token_type_ids": torch.zeros_like(ids)}
    export_onnx(bert, (), tmp_path / "bert.onnx", example_kwargs=example)
    session = mpgraph.ort_session(tmp_path / "bert.onnx")
    for given in session.get_inputs():  # batch and sequence of each
        assert all(isinstance(d, str) for d in given.shape), (given.name, given.shape)
    ids = torch.randint(0, 100, (3, 9))
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "token_type_ids": torch.zeros_like(ids)}
    with torch.no_grad():
        want = bert(**call).last_hidden_state
    got = session.run(["last_hidden_state"], {k: v.numpy() for k, v in call.items()})[0]
    assert relative_l2(got, want) < 1e-2


def test_an_image_size_guarded_through_its_patch_count_stays_static():
    """Dinov2's guard is on the patch count, size // 8: it holds at 33 for 32 and breaks at 31,
    and the probe tried one larger only, so the file declared height and width free and failed
    inside onnxruntime at 48x48 (the 17-token position table fixed in it)."""
    from transformers import Dinov2Config, Dinov2Model
    from mpgraph.tools.onnx_export import auto_dynamic_shapes
    torch.manual_seed(0)
    model = Dinov2Model(Dinov2Config(image_size=32, patch_size=8, hidden_size=64,
                                     num_hidden_layers=1, num_attention_heads=4)).eval()
    x = torch.randn(2, 3, 32, 32)
    fast = mpgraph.convert(model, (x,), target="a100", check=False)
    with pytest.raises(mpgraph.InputMismatchError):
        fast(torch.randn(2, 3, 31, 31))
    spec = auto_dynamic_shapes(fast, (x,), {})
    assert len(spec) == 1 and sorted(spec[0]) == [0], spec  # the batch alone stays free
    # a bound is no fix: a BERT's sequence past half its position table (twice it is refused,
    # shorter ones run) stays free
    from transformers import BertConfig, BertModel
    bert = BertModel(BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=128, vocab_size=100,
                                max_position_embeddings=32)).eval()
    ids = torch.randint(0, 100, (2, 20))
    fast = mpgraph.convert(bert, (ids,), target="a100", check=False)
    spec = auto_dynamic_shapes(fast, (ids,), {})
    assert len(spec) == 1 and sorted(spec[0]) == [0, 1], spec


def test_a_bf16_file_on_the_cpu_provider_is_an_error_that_says_bf16(tmp_path):
    """export_onnx validates a bf16 file by emulating it (the CPU provider has no bf16 Gemm);
    ort_session on it then raised onnxruntime's raw NOT_IMPLEMENTED for 'node_linear'."""
    path = tmp_path / "mlp.onnx"
    export_onnx(MLP().eval(), torch.randn(4, 16), path, dtype="bf16", dynamic_shapes=None)
    with pytest.raises(RuntimeError, match=r"computes in bfloat16, which onnxruntime's CPU "
                                           r"provider cannot run .* dtype='fp16'"):
        mpgraph.ort_session(path, device="cpu")


def test_a_model_given_in_fp16_is_compared_with_itself_and_says_so(tmp_path):
    """Its validation said "vs float32" of a comparison with the fp16 model itself, beside a
    plan summary that said "converted 0/0 nodes ... (all float32)"."""
    result = export_onnx(MLP().half().eval(), torch.randn(4, 16).half(), tmp_path / "h.onnx",
                         dynamic_shapes=None)  # (static: the file runs at the example's shape)
    assert "vs the model as given (float16)" in result.validation.summary()
    assert "vs float32" not in result.validation.summary()
    assert "kept the model's own dtypes: none of its" in result.plan.summary()


def test_cli_export(tmp_path, capsys):
    from mpgraph import cli
    factory = tmp_path / "factory.py"
    factory.write_text("import torch\n"
                       "def build():\n"
                       "    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()\n"
                       "    return m, (torch.randn(2, 8),)\n")
    out = tmp_path / "m.onnx"
    assert cli.main(["export", f"{factory}:build", "--dtype", "fp16", "--strategy", "rules",
                     "--target", "t4", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert f"wrote {out}" in text and "Cast nodes in the file: 2 (plan: 2)" in text
    # the fp16 plan's calibration warning: once, on stderr (it led the summary too)
    assert "warning" not in text and captured.err.count("calibrated on one batch") == 1
    assert "validated: onnx.checker full_check" in text
    assert cli.main(["export", f"{factory}:nope", "-o", str(out)]) == 2
    assert "has no callable 'nope'" in capsys.readouterr().err
    assert cli.main(["export", f"{factory}:build", "-o", str(tmp_path / "no" / "m.onnx")]) == 1
    assert "does not exist" in capsys.readouterr().err


# a CPU whose low-precision matmuls are 1000x its float32 ones: its plans keep CPU kernel
# contracts (float32 norm parameters with low input) whatever CPU runs the tests
FAST_LOW_CPU = DeviceSpec("test CPU, low precision 1000x float32", "cpu",
                          {"fp32": 1e9, "fp16": 1e12, "bf16": 1e12, "vector": 1e9}, 1e9, 1, 0.0)


@pytest.mark.parametrize("target", ["a100", "cpu"])
@pytest.mark.parametrize("low", ["fp16", "bf16"])
def test_norm_with_low_io_exports_and_validates(low, target, tmp_path):
    """LayerNormalization types X, Scale and B as one T. A GPU plan stores the scale and bias low
    (CUDA's kernel wants that too); a CPU plan's float32 ones are converted in the file."""
    model, x = ConvNextish().eval(), torch.randn(2, 8, 6, 6)
    # (static shapes: the norm's types are the point, the file runs at the example's shape only)
    if target == "a100":
        result = export_onnx(model, x, tmp_path / "n.onnx", dtype=low, dynamic_shapes=None)
    else:
        converted = mpgraph.convert(model, x, dtype=low, target=FAST_LOW_CPU, dynamic=False)
        assert converted.norm.weight.dtype == torch.float32
        result = export_onnx(converted, x, tmp_path / "n.onnx")
    assert result.plan.node("norm").dtype == {"fp16": "float16", "bf16": "bfloat16"}[low]
    assert result.casts_in_file == 2 and result.validation is not None
    assert result.edits["folded weights stored in the activation dtype"] == (target == "cpu") * 2
    norm = next(n for n in load_with_types(str(tmp_path / "n.onnx")).graph
                if n.op_type == "LayerNormalization")
    assert [v.dtype for v in norm.inputs] == [LOW[low]] * 3
    stash = norm.attributes.get("stash_type")
    assert stash is None or stash.value == 1  # statistics in float32


def test_convnext_planned_for_a_cpu_exports_with_one_type_per_layer_norm(tmp_path):
    """Issue 17: ConvNeXt's file failed onnx.checker (LayerNormalization with a float32 Scale; the
    GPU plan is in SMALL). A CPU plan keeps float32 norm parameters, and the exporter merges equal
    initializers (the last stage's LayerNorm and the pooler's: ones and zeros), so one feeds a
    float16 and a float32 norm: the float16 one gets a converted copy."""
    model, x = _convnext(), torch.randn(2, 3, 64, 64)
    path = tmp_path / "c.onnx"
    # (static shapes, the capture as the export: the file runs at the example's shape only)
    result = export_onnx(mpgraph.convert(model, x, dtype="fp16", target=FAST_LOW_CPU,
                                         dynamic=False), x, path, dynamic_shapes=None)
    v = result.validation
    assert v is not None and max(v.err_vs_converted) < 1e-2
    norms = [n for n in load_with_types(str(path)).graph if n.op_type == "LayerNormalization"]
    low = [n for n in norms if n.inputs[0].dtype == ir.DataType.FLOAT16]
    assert len(low) >= 4 and len(norms) > len(low)
    assert any(v.name.endswith("_float16") for n in low for v in n.inputs[1:])
    assert all(v.dtype == n.inputs[0].dtype for n in norms for v in n.inputs)


@pytest.mark.parametrize("trap", ["RMSNorm pow(2).mean on large values", "-1e9 attention mask",
                                  "activations 1e5 before LayerNorm", "eps 1e-12 over constant rows",
                                  "exp of large logits"])
def test_overflow_traps_export_to_fp16_onnx_that_stays_finite(tmp_path, trap):
    """At opset 23 the exporter fuses the written-out RMSNorm over our fp32 cast into one
    RMSNormalization on the fp16 value (invalid: X and Y must share a type); the export puts the
    plan's cast back in front of it. Its optimiser drops ``var + 1e-12`` as ``x + 0`` (NaN on
    constant rows, in float32 files too): such a graph is exported without the optimiser."""
    import traps
    model, inputs = traps.build(trap)
    path = str(tmp_path / "trap.onnx")
    # (static shapes: the file runs at the example's shapes only)
    result = export_onnx(model, inputs, path, dtype=torch.float16, target="a100", opset=23,
                         dynamic_shapes=None)
    session = mpgraph.ort_session(path, device="cpu")
    feeds = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)}
    out = session.run(None, feeds)[0]
    with torch.no_grad():
        ref = model(*inputs).numpy()
    assert np.isfinite(out).all()
    assert relative_l2(out, ref) < 1e-2
    if trap.startswith("RMSNorm"):
        assert result.edits["norm input casts restored after fusion"] == 1
    assert ("optimize=False" in result.exporter) == trap.startswith("eps")


class _Big(nn.Module):
    """Four Linear layers, 2.15 GB of float32 weights: just past protobuf's 2 GiB limit."""

    def __init__(self):
        super().__init__()
        with torch.device("meta"):  # (torch's random init of 537M weights cost ~8 s)
            self.a, self.b = nn.Linear(8192, 16392), nn.Linear(16392, 8192)
            self.c, self.d = nn.Linear(8192, 16392), nn.Linear(16392, 8192)
        self.to_empty(device="cpu")
        for layer in (self.a, self.b, self.c, self.d):  # (a random block, tiled)
            rows, cols = layer.weight.shape
            block = torch.randn(rows // 8, cols).div_(cols ** 0.5)
            # (broadcast into the weight's 8 row blocks: block.repeat(8, 1)'s values, without
            # its 0.5 GB copy per layer; 3.5 s -> 1.9 s of CPU for the model)
            layer.weight.data.view(8, rows // 8, cols).copy_(block)
            layer.bias.data.copy_(torch.randn(rows) * 0.01)

    def forward(self, x):
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


@pytest.mark.slow
def test_model_over_2gb_exports_with_external_data_and_validates_by_path(tmp_path):
    """~30 s and ~8 GiB peak here: the fp16 file's weights (1.07 GB) go to FILE.onnx.data, every
    check reads the file by path, and the files are removed afterwards."""
    torch.manual_seed(0)
    model = _Big().eval()
    assert sum(p.numel() for p in model.parameters()) * 4 > 2**31
    x = torch.randn(2, 8192)
    path = tmp_path / "big.onnx"
    try:
        # (static shapes: the file is never run at another shape, and the dynamic capture
        # and export cost more here than anywhere)
        result = export_onnx(model, x, str(path), dtype=torch.float16, target="a100",
                             dynamic_shapes=None)
        data = tmp_path / "big.onnx.data"
        assert result.external_data == "big.onnx.data"
        assert path.stat().st_size < 1_000_000 and data.stat().st_size > 1.07e9
        # (the validation ran onnxruntime on the file by path, its weights in FILE.onnx.data,
        # against the float32 model: a second session here cost the suite ~20 s)
        assert result.validation is not None and max(result.validation.err_vs_fp32) < 1e-2
    finally:
        for f in tmp_path.iterdir():
            f.unlink()
    assert not list(tmp_path.iterdir())


def test_onnx_ir_passes_alone_on_a_hand_made_graph():
    """The plan's IR edits are onnx-ir passes: each runs on a small model of its own."""
    from mpgraph.tools.onnx_passes import AttentionSoftmaxFp32, RemoveNoopCasts, SoftmaxFp32
    x = ir.val("x", ir.DataType.FLOAT16, ir.Shape([2, 4]))
    noop = ir.node("Cast", [x], {"to": ir.DataType.FLOAT16}, name="noop")
    noop.outputs[0].dtype, noop.outputs[0].shape = ir.DataType.FLOAT16, x.shape
    soft = ir.node("Softmax", [noop.outputs[0]], {"axis": -1}, name="soft")
    soft.outputs[0].dtype, soft.outputs[0].shape = ir.DataType.FLOAT16, x.shape
    soft.outputs[0].name = "y"
    graph = ir.Graph([x], [soft.outputs[0]], nodes=[noop, soft], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    removed = RemoveNoopCasts()
    assert removed(model).modified and removed.count == 1
    assert [n.op_type for n in model.graph] == ["Softmax"] and soft.inputs[0] is x
    wrap = SoftmaxFp32()
    assert wrap(model).modified and wrap.count == 1
    assert [n.op_type for n in model.graph] == ["Cast", "Softmax", "Cast"]
    assert soft.inputs[0].dtype == ir.DataType.FLOAT and soft.outputs[0].dtype == ir.DataType.FLOAT
    assert model.graph.outputs[0].dtype == ir.DataType.FLOAT16
    assert not AttentionSoftmaxFp32()(model).modified  # no Attention op: nothing to do


def _runs_in_a_default_session(path, feeds) -> int:
    """onnxruntime's exit status running ``path`` with every default (ORT_ENABLE_ALL), in a
    process of its own (a crash is a negative status)."""
    import subprocess
    import sys
    np.savez(str(path) + ".feeds.npz", **feeds)
    code = ("import numpy as np, onnxruntime as ort, sys\n"
            f"s = ort.InferenceSession({str(path)!r}, providers=['CPUExecutionProvider'])\n"
            f"f = dict(np.load({str(path) + '.feeds.npz'!r}))\n"
            "s.run(None, f)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode


class _RecurrentHead(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn, self.fc = kind(16, 32, batch_first=True), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


# (LSTM alone: GRU takes the same path, RUNTIME_FP32_OPS's crash fallback, at ~1.3x the time;
# dynamic shapes, the default, throughout: onnxruntime 1.31 runs the static fp16 file)
@pytest.mark.parametrize("kind", [nn.LSTM])
@pytest.mark.slow
def test_a_file_onnxruntime_crashes_on_keeps_the_op_float32_and_says_why(kind, tmp_path):
    """onnxruntime 1.31 segfaults running an fp16 GRU/LSTM followed by a Linear at its default
    optimisation level (issue 25.11): validation runs the file as users do, in a process of its
    own, and the file written keeps the recurrent layer float32, saying why."""
    torch.manual_seed(0)
    model, x = _RecurrentHead(kind).eval(), torch.randn(2, 5, 16)
    path = tmp_path / "rnn.onnx"
    result = export_onnx(model, x, path, dtype="fp16", target=GPU, strategy="rules")
    assert len(result.fallbacks) == 1
    assert re.match(r"kept float32: rnn \(onnxruntime could not run them in low precision: .*"
                    r"onnxruntime [\d.]+, in a default session \(ORT_ENABLE_ALL, as users run "
                    r"it\), crashed \(SIGSEGV\)", result.fallbacks[0]), result.fallbacks[0]
    assert result.plan.node("rnn").dtype == "float32" and result.plan.node("fc").dtype == "float16"
    assert _runs_in_a_default_session(path, {"x": x.numpy()}) == 0
    converted = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules")
    with pytest.raises(mpgraph.ExportError, match=r"crashed \(SIGSEGV\).*nothing is written; "
                                                  r"convert it with overrides=\{'rnn': 'fp32'\}"):
        export_onnx(converted, x, tmp_path / "given.onnx")
    assert not (tmp_path / "given.onnx").exists()


@pytest.mark.slow
def test_a_rotary_decoder_exports_with_the_optimiser_and_runs_at_other_batch_sizes(tmp_path):
    """A Llama-family decoder takes the optimiser's path (no near-identity constants) and its
    opset-23 RotaryEmbedding fusion, which onnxruntime 1.31 rejects with a dynamic batch (issue
    25.13: nothing was written); the file is the unfused graph, and says so."""
    from transformers import LlamaConfig, LlamaModel
    torch.manual_seed(0)
    # (one layer: the rotary embedding and its fusion are per model, not per layer)
    model = LlamaModel(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=1000)).eval()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "llama.onnx"
    result = mpgraph.export_onnx(model, (ids,), path, dtype="fp16", target=GPU)  # the defaults
    assert "optimize=False" not in result.exporter  # the path real models take
    assert len(result.fallbacks) == 1 and "RotaryEmbedding" in result.fallbacks[0]
    assert result.exporter.endswith("without onnxscript's ONNX fusions")
    other = torch.randint(0, 1000, (3, 9), generator=torch.Generator().manual_seed(1))
    assert _runs_in_a_default_session(path, {"input_ids": other.numpy()}) == 0
    sess = mpgraph.ort_session(path, device="cpu")
    out = sess.run(None, {"input_ids": other.numpy()})[0]
    with torch.no_grad():
        want = model(other, use_cache=False).last_hidden_state
    assert relative_l2(out, want) < 1e-2


def test_a_batch_1_example_says_the_file_takes_batch_1_only(tmp_path):
    """torch.export keeps a size of 1 static: a batch-1 example gave a file that refused batch 4
    inside onnxruntime ('Got: 4 Expected: 1'), where the README says batch and sequence stay
    dynamic, without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    with pytest.warns(UserWarning, match=r"the example's input has batch 1: the file takes "
                                         r"batch 1 only .* batch 2 or more"):
        export_onnx(model, torch.randn(1, 4, 16), tmp_path / "one.onnx")
    assert mpgraph.ort_session(tmp_path / "one.onnx").get_inputs()[0].shape[0] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="the float16 plan was calibrated on one batch")
        export_onnx(model, torch.randn(2, 4, 16), tmp_path / "two.onnx")


@pytest.mark.slow
def test_moe_experts_export_with_transformers_own_onnx_translation(tmp_path):
    """transformers' MoE experts run as its custom op grouped_mm_fallback, which torch.onnx has
    no ONNX function for ('No ONNX function found for transformers.grouped_mm_fallback': nothing
    was written); the file now takes transformers' own translation of it (a MatMul per expert),
    in fp16, validated on onnxruntime and run at another batch and sequence length."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.exporters.exporter_onnx")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
        use_cache=False)).eval()
    ids = torch.randint(1, 100, (2, 16))
    path = tmp_path / "moe.onnx"
    result = mpgraph.export_onnx(model, (), path, example_kwargs={"input_ids": ids},
                                 dtype="fp16", target=GPU)
    assert result.exporter.startswith("torch.onnx.export(dynamo=True)")
    assert max(result.validation.err_vs_fp32) < 1e-2
    grouped = [r for r in result.plan.nodes if "grouped_mm" in r.name]
    assert grouped and {r.dtype for r in grouped} == {"float16"}
    other = torch.randint(1, 100, (3, 9))
    out = mpgraph.ort_session(path, device="cpu").run(None, {"input_ids": other.numpy()})[0]
    with torch.no_grad():
        assert relative_l2(out, model(other).logits) < 1e-2


@torch.library.custom_op("mpgraph_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


class CustomOpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, mask=None, twice=True):  # (converted without mask: fixed to None)
        return _twice(self.fc(x)) if twice else self.fc(x)


def test_a_custom_op_without_onnx_function_is_named_not_the_fallbacks_argument_refusal(tmp_path):
    """Qwen2-MoE's export failed on an op with no ONNX function; the error then told the user
    to convert with position_ids (the TorchScript fallback passes every forward parameter, and
    the converted module refused that call): advice about an argument never given, the real
    blocker named only inside the exporter's text."""
    with pytest.raises(mpgraph.ExportError, match=r"the graph calls mpgraph_test\.twice, which "
                                                  r"torch\.onnx has no ONNX function for") as info:
        export_onnx(CustomOpModel().eval(), (), tmp_path / "x.onnx", dynamic_shapes=None,
                    example_kwargs={"x": torch.randn(2, 16), "twice": True})
    assert "cannot call the converted module" in str(info.value)
    assert "Convert with it" not in str(info.value) and "'mask'" not in str(info.value)
    assert os.listdir(tmp_path) == []


def test_torch_onnx_s_registry_is_built_once_and_each_export_registers_into_its_own_copy():
    """torch.onnx.export rebuilt its registry of ONNX functions on every call (2.2 s of a 3.5 s
    two-layer export). Built once now; what one export registers (transformers' translation of
    its MoE op) must not reach the next: the custom op above stays one with no ONNX function."""
    from torch.onnx._internal.exporter import _registration
    from mpgraph.tools import onnx_export as module
    own = _registration.ONNXRegistry.__dict__["from_torchlib"]
    twice = torch.ops.mpgraph_test.twice.default
    with module._registry_built_once():
        first = _registration.ONNXRegistry.from_torchlib()
        first.register_op(twice, lambda x: x)
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is own  # (put back)
    with module._registry_built_once():
        second = _registration.ONNXRegistry().from_torchlib(opset_version=first.opset_version)
    assert first.is_registered(twice) and not second.is_registered(twice)
    relu = torch.ops.aten.relu.default.name()
    assert second.functions[relu][0] is first.functions[relu][0]  # (built once)
    assert second.functions[relu] is not first.functions[relu]
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is own  # torch's, put back
    with module._registry_built_once():  # (two exports at once, in two threads: one patch,
        with module._registry_built_once():  # put back when the last one ends)
            pass
        assert _registration.ONNXRegistry.__dict__["from_torchlib"] is not own
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is own


class Whitens(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.linalg.cholesky(h.T @ h + torch.eye(8))


def test_torchs_own_op_without_onnx_function_is_not_called_a_custom_op(tmp_path):
    """Review rC: torch.linalg.cholesky's aten.linalg_cholesky_ex was named 'a custom op' with
    the advice to compute it with torch operators, which it is."""
    with pytest.raises(mpgraph.ExportError, match=r"the graph calls aten\.linalg_cholesky_ex, "
                                                  r".* \(torch's own op: keep it out of the "
                                                  r"exported part") as info:
        export_onnx(Whitens().eval(), torch.randn(16, 8), tmp_path / "w.onnx",
                    dynamic_shapes=None)  # (static: the refusal does not depend on shapes)
    assert "a custom op" not in str(info.value)


class CastRoundTrip(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):  # (fc1 low: the model's .float() and the plan's cast back, a round trip)
        return self.fc3(torch.relu(self.fc2(self.fc1(x).float())))


def test_each_file_cast_is_labelled_with_the_plan_cast_it_was_traced_from(tmp_path):
    """The file's Casts were paired with the plan's by position: the two the exporter folds (an
    exact fp16->fp32->fp16 round trip) shifted every later label (the output's cast labelled as
    the model's .float(), and reported missing with the round trip's second cast)."""
    torch.manual_seed(0)
    path = tmp_path / "rt.onnx"
    result = export_onnx(CastRoundTrip().eval(), torch.randn(4, 16), path, dtype="fp16",
                         target=GPU, validate=False, dynamic_shapes=None)  # (static)
    plan = {c.name: c for c in result.plan.cast_sequence()}
    folded = [name for name, c in plan.items() if c.value == "fc1" or c.value.startswith("float")]
    assert len(folded) == 2 and result.casts_expected == result.casts_in_file + 2
    assert result.cast_differences == [
        f"plan cast {name} ({plan[name].src}->{plan[name].dst} of {plan[name].value}) has no "
        "Cast in the file" for name in folded]
    to = {ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16"}
    labelled = {}
    for node in load_with_types(str(path)).graph:
        if node.op_type == "Cast" and "mpgraph.cast" in node.metadata_props:
            rec = plan[node.metadata_props["mpgraph.cast"]]
            assert (to[node.inputs[0].dtype], to[ir.DataType(node.attributes["to"].value)]) == \
                (rec.src, rec.dst)
            labelled[rec.name] = node.metadata_props["mpgraph.value"]
    assert labelled == {"x_to_f16": "x", "fc3_to_f32": "fc3"}
