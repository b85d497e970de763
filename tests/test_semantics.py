"""No silent wrong answers: conversions keep the model's semantics (in-place ops, buffer updates,
functional dropout, output types), never write the caller's tensors, and check their values;
bad plan files, module-wide dtype changes and ONNX misuse are clear errors."""
import copy
import json
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

import mpgraph
from conftest import GPU, TOL, convert_rules, rel_err
from mpgraph.ir.meta import REFERENCE, Reference
from mpgraph.passes import CheckConversion

from semantics_battery import (BATTERY, D, CountingBuffer, FunctionalDropout,  # examples/
                               ModelOutputOut, RunningMean, run as run_battery)


@pytest.mark.parametrize("name", list(BATTERY))
def test_battery_converts_to_what_the_model_computes(name):
    """examples/semantics_battery.py's run (rules strategy, planned for an A100): what its
    table prints, asserted."""
    _, low, training = BATTERY[name]
    r = run_battery(name)
    assert r["input_untouched"], "convert wrote into the caller's example input"
    assert r["low_nodes"], r["summary"]
    assert r["trained_warnings"] == (1 if training else 0)
    # the check compared the values: within the bound it states
    assert r["check"] is not None and r["check"]["error"] <= r["check"]["bound"]
    assert r["same_type"]
    assert r["error"] < TOL[mpgraph.resolve_dtype(low)]
    assert r["inputs_written_alike"]  # an input the model writes into is written the same way
    assert r["buffers_same"]  # buffers updated as the model updates them


def test_fx_traces_that_drop_buffer_updates_or_output_types_take_the_export_route():
    for make in (CountingBuffer, ModelOutputOut):
        gm = convert_rules(make().eval(), torch.randn(4, D), dtype="bf16")
        assert gm.plan.capture == "torch.export", make.__name__
    assert convert_rules(RunningMean().eval(), torch.randn(4, D),
                         dtype="bf16").plan.capture == "torch.fx.symbolic_trace"


def test_functional_dropout_follows_train_and_eval_after_conversion():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="is in training mode and is converted for inference"):
        gm = convert_rules(FunctionalDropout().train(), torch.randn(8, D), dtype="bf16")
    x = torch.randn(8, D)
    with torch.no_grad():
        assert not torch.equal(gm(x), gm(x))  # dropout on, as in the model in training mode
        gm.eval()
        assert torch.equal(gm(x), gm(x))


class TorchFunctionsTakingTheFlag(nn.Module):
    """torch's functions given self.training (symbolic_trace bakes it in as a constant), and
    timm's BatchNormAct2d idiom: F.batch_norm over the module's own running statistics."""

    def __init__(self, how):
        super().__init__()
        self.how, self.fc = how, nn.Linear(D, D)
        self.weight, self.bias = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))
        self.register_buffer("running_mean", torch.zeros(D))
        self.register_buffer("running_var", torch.ones(D))

    def forward(self, x):
        h = self.fc(x)
        if self.how == "batch_norm":
            return torch.nn.functional.batch_norm(h, self.running_mean, self.running_var,
                                                  self.weight, self.bias, self.training, 0.1)
        if self.how == "rrelu":
            return torch.nn.functional.rrelu(h, training=self.training)
        return getattr(torch, self.how)(h, 0.5, self.training)


@pytest.mark.parametrize("how", ["dropout", "feature_dropout", "alpha_dropout", "rrelu",
                                 "batch_norm"])
def test_torch_functions_given_the_training_flag_follow_eval_after_conversion(how):
    # was: captured in training mode, they kept training's behaviour after .eval() (rel L2
    # 0.75 for torch.dropout, 0.77 for F.batch_norm, whose eval calls went on updating the
    # running statistics), while F.dropout followed
    torch.manual_seed(0)
    model = TorchFunctionsTakingTheFlag(how).train()
    with pytest.warns(UserWarning, match="is in training mode and is converted for inference"):
        gm = mpgraph.convert(model, torch.randn(8, D), target="a100")
    assert gm.plan.capture == "torch.fx.symbolic_trace"  # (export's aten ops followed already)
    with pytest.warns(UserWarning, match="reads self.training"):
        gm.eval()
    model.eval()
    x = torch.randn(8, D)
    with torch.no_grad():
        first, second, want = gm(x), gm(x), model(x)
    assert torch.equal(first, second)
    assert rel_err(first, want) < TOL[torch.float16]
    if how == "batch_norm":  # eval calls leave the statistics alone
        assert torch.equal(gm.running_mean, model.running_mean)


def test_value_check_names_the_node_where_values_part_from_float32():
    """CheckConversion on its own: a graph whose dtypes are all right but that computes something
    else than the float32 graph Calibrate ran (a relu turned into its negation) is an error."""
    torch.manual_seed(0)
    gm = convert_rules(nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)).eval(),
                       torch.randn(8, D), dtype="bf16", check=False)
    x = torch.randn(8, D)
    with torch.no_grad():  # the reference: what this very graph computes, as Calibrate keeps it
        gm.meta[REFERENCE] = Reference((x,), {}, (gm(x),))
    CheckConversion((x,), {})(gm)  # the graph as converted: passes
    assert gm.meta["mpgraph.check"]["error"] < 1e-6
    relu = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "1")
    with gm.graph.inserting_after(relu):
        neg = gm.graph.call_function(torch.neg, (relu,))
    neg.meta.update(relu.meta)
    relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
    gm.recompile()
    with pytest.raises(mpgraph.ConversionError,
                       match=r"output 0 differs from float32 by .* more than a bfloat16 plan should"):
        CheckConversion((x,), {})(gm)


def test_tolerance_with_nan_in_the_calibration_is_an_error_not_met():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()
    bad = torch.randn(4, 16)
    bad[0, 0] = float("nan")
    with pytest.raises(mpgraph.CalibrationError, match="1 NaN values of 64"):
        mpgraph.convert(model, bad, dtype="bf16", target=GPU, strategy="rules",
                        calibration=[bad], tolerance=1e-2)
    bad[0, 0] = float("inf")  # (an input inf is taken; outputs float32 gives as inf are not)
    with pytest.raises(mpgraph.CalibrationError, match="inf/NaN"):
        mpgraph.convert(model, bad, dtype="bf16", target=GPU, strategy="rules",
                        calibration=[bad], tolerance=1e-2)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["nodes"][1].__setitem__("dtype", "float17"), "dtype 'float17' is not one of"),
    (lambda d: d.__setitem__("dtype", "int8"), "dtype 'int8' is not one of float16, bfloat16"),
    (lambda d: d.__setitem__("nodes", None), "nodes must be a list of node records"),
    (lambda d: d.__setitem__("mode", "sideways"), "mode 'sideways' is not one of"),
    (lambda d: d["nodes"][1].pop("op"), r"missing fields \['op'\]"),
])
def test_bad_plan_files_are_clear_errors(edit, message, tmp_path):
    gm = convert_rules(nn.Sequential(nn.Linear(16, 16)).eval(), torch.randn(4, 16), dtype="fp16")
    data = json.loads(json.dumps(gm.plan.to_dict()))
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        mpgraph.Plan.load(path)
    path.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="not a text"):
        mpgraph.Plan.load(path)


def test_deepcopy_keeps_the_plan_and_dtype_changes_are_refused():
    gm = convert_rules(nn.Sequential(nn.Linear(16, 16)).eval(), torch.randn(4, 16), dtype="fp16")
    twin = copy.deepcopy(gm)
    assert twin.plan.to_dict() == gm.plan.to_dict() and twin.plan is not gm.plan
    assert "mpgraph plan: float16" in mpgraph.report(twin)
    for call in (lambda m: m.float(), lambda m: m.to(torch.bfloat16),
                 lambda m: m.type(torch.float32)):
        with pytest.raises(TypeError, match="would change the dtypes its plan gave each "
                                            "parameter .* Convert the model again with the dtype"):
            call(twin)
    # float64: no conversion computes it (the way out named dtype=, which refuses it: pA 7)
    for call in (lambda m: m.double(), lambda m: m.to(torch.float64)):
        with pytest.raises(TypeError, match="computes in float32 and its low dtype: for "
                                            "float64, use the model itself"):
            call(twin)
    assert gm.to("cpu") is gm  # moving is fine
    assert gm.to("cpu", torch.float16) is gm  # (every parameter is float16 already: no change)
    assert gm.half() is gm  # (the same: it was refused where .to(float16) was not)
    with torch.no_grad():
        assert twin(torch.randn(2, 16)).dtype == torch.float32
    # a training conversion holds float32 masters (the text said they were float16), and
    # .type(float32), as .float() and .to(float32), changes nothing there
    train = mpgraph.convert(nn.Sequential(nn.Linear(16, 16)), torch.randn(4, 16), dtype="fp16",
                            target=GPU, strategy="rules", mode="train")
    assert train.float() is train and train.type(torch.float32) is train
    with pytest.raises(TypeError, match=r"^\.half\(\) on a converted module would change its "
                                        r"float32 master weights \(cast to float16 inside"):
        train.half()


def _one_layer_bert():
    """conftest's ``bert`` (hidden 64, vocabulary 100) with one encoder layer: what the tests
    below check (threads, ONNX names, axes and dtype) does not depend on the depth."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=128, vocab_size=100, max_position_embeddings=64)
    return BertModel(cfg).eval()


def test_two_threads_convert_export_route_models_at_once(token_ids):
    bert = _one_layer_bert()
    ids, mask = token_ids
    results, errors = [], []

    def work():
        try:
            results.append(mpgraph.convert(copy.deepcopy(bert), (ids,), dtype="fp16", target=GPU,
                                           example_kwargs={"attention_mask": mask}))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2
    assert results[0].code == results[1].code


@pytest.mark.slow
def test_onnx_outputs_keep_their_names_axes_are_dynamic_and_dtype_is_the_plans(token_ids,
                                                                              tmp_path):
    bert = _one_layer_bert()
    ids, mask = token_ids
    path = tmp_path / "bert.onnx"
    mpgraph.export_onnx(bert, (ids,), path, example_kwargs={"attention_mask": mask}, target=GPU)
    sess = mpgraph.ort_session(path, device="cpu")
    assert [o.name for o in sess.get_outputs()] == ["last_hidden_state", "pooler_output"]
    ids7 = torch.randint(0, 100, (7, 5))
    out = sess.run(None, {"input_ids": ids7.numpy(), "attention_mask": np.ones((7, 5), np.int64)})
    with torch.no_grad():
        ref = bert(ids7, attention_mask=torch.ones(7, 5, dtype=torch.long)).last_hidden_state
    assert out[0].shape == (7, 5, 64) and rel_err(torch.from_numpy(out[0]), ref) < 1e-2
    # (exported below at the example's shapes alone: a static capture)
    gm = mpgraph.convert(bert, (ids,), example_kwargs={"attention_mask": mask}, dtype="fp16",
                         target=GPU, dynamic=False)
    with pytest.raises(mpgraph.ExportError, match="converted to float16; dtype='bf16' cannot"):
        mpgraph.export_onnx(gm, (ids,), tmp_path / "x.onnx", example_kwargs={"attention_mask": mask},
                            dtype="bf16")
    static = mpgraph.export_onnx(gm, (ids,), tmp_path / "s.onnx", dynamic_shapes=None,
                                 example_kwargs={"attention_mask": mask})
    shapes = [i.shape for i in mpgraph.ort_session(static.path, device="cpu").get_inputs()]
    assert shapes == [list(ids.shape), list(mask.shape)]


# -- what a symbolic trace loses without a word (probe 43a) --------------------------------

class IsTensorMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, mask):
        h = self.fc(x)
        if isinstance(mask, torch.Tensor):  # (callers may pass None)
            h = h * mask[..., None]
        return h


class AugmentedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, state):
        state += self.fc(x)  # the caller's state tensor, written as the model writes it
        return state * 2


class PlainTensorState(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.mem = nn.Linear(D, D), torch.zeros(D)  # not a registered buffer

    def forward(self, x):
        h = self.fc(x)
        self.mem.mul_(0.5).add_(h.mean((0, 1)))
        return h + self.mem


@pytest.mark.parametrize("target", [None, GPU])
def test_forwards_a_symbolic_trace_gets_wrong_on_the_example_take_the_export_route(target):
    """Each converted to exactly what the model computes, over several calls on other inputs:
    fx took the branch a proxy takes (no tensor) and the all-ones example mask hid it (0.65 off
    on a padded batch); it traced ``state += y`` as ``state = state + y`` (the caller's tensor
    unwritten: 0.39-0.47 off from the second chunk on); it ran ``self.mem.mul_(0.5)`` on a plain
    tensor attribute at trace time and recorded only the add (0.13 off on the second call),
    and conversion's own runs advanced that tensor before the first call."""
    torch.manual_seed(0)
    kw = dict(target=target, dtype="fp16", strategy="rules") if target else {}
    x = torch.randn(2, 8, D)
    model = IsTensorMask().eval()
    fast = mpgraph.convert(model, (x, torch.ones(2, 8)), **kw)
    assert fast.plan.capture == "torch.export"
    mask = torch.ones(2, 8)
    mask[1, 4:] = 0
    with torch.no_grad():
        assert rel_err(fast(x, mask), model(x, mask)) < 2e-3
    model = AugmentedInput().eval()
    fast = mpgraph.convert(model, (x, torch.zeros(2, 8, D)), **kw)
    mine, theirs = torch.zeros(2, 8, D), torch.zeros(2, 8, D)
    for chunk in range(3):
        x = torch.randn(2, 8, D)
        with torch.no_grad():
            assert rel_err(fast(x, mine), model(x, theirs)) < 2e-3
        assert rel_err(mine, theirs) < 2e-3
    model = PlainTensorState().eval()
    fast = mpgraph.convert(model, (torch.randn(4, 8, D),), **kw)
    assert torch.equal(model.mem, torch.zeros(D))  # (the model's own: never written)
    for call in range(3):
        x = torch.randn(2, 5, D)
        with torch.no_grad():
            assert rel_err(fast(x), model(x)) < 2e-3, call


class IndexCopyCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("cache", torch.zeros(16, D))

    def forward(self, x, pos):
        h = self.fc(x)
        self.cache.index_copy_(0, pos, h[:pos.numel()])
        return self.cache.sum(0) + h


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_cache_written_low_in_place_and_read_by_a_float32_reduction_converts(dtype):
    """The cache is stored low (it is written from a low value); its sum stays float32. The sum
    read the low buffer uncast, and the check raised 'the converted graph does not match its
    plan: sum_1 produced float16, plan says float32', naming nothing the user could change."""
    torch.manual_seed(0)
    model = IndexCopyCache().eval()
    fast = mpgraph.convert(model, (torch.randn(4, D), torch.tensor([0, 1])), target=GPU,
                           dtype=dtype, strategy="rules")
    assert fast.cache.dtype == mpgraph.resolve_dtype(dtype)
    theirs = copy.deepcopy(model)
    for step in range(3):
        x, pos = torch.randn(4, D), torch.tensor([2 * step + 2, 2 * step + 3])
        with torch.no_grad():
            assert rel_err(fast(x, pos), theirs(x, pos)) < TOL[mpgraph.resolve_dtype(dtype)]
        assert rel_err(fast.cache.float(), theirs.cache) < TOL[mpgraph.resolve_dtype(dtype)]


class ShapeThenIsTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, mask):
        b = mask.shape[0]  # (a read of its shape, not of its values)
        if torch.is_tensor(mask):
            x = x * mask.unsqueeze(-1)
        return self.fc(x).reshape(b, -1)


class ScaledIfTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, scale):
        if isinstance(scale, torch.Tensor):
            if (scale <= 0).any():
                raise ValueError("scales must be positive")
            x = x * scale
        return self.fc(x)


def test_an_input_read_only_for_its_shape_or_refusing_other_values_is_still_tested():
    """probe 44: a mask whose shape the graph reads counted as read, and a model that raised
    on the other values tried in place of the example's counted as ignoring them: both kept
    fx's trace, which dropped the input (1.28 off on a real mask)."""
    torch.manual_seed(0)
    x, ones = torch.randn(4, 8, D), torch.ones(4, 8)
    mask = (torch.rand(4, 8) > 0.5).float()
    mask[:, 0] = 1
    model = ShapeThenIsTensor().eval()
    fast = mpgraph.convert(model, (x, ones))
    assert fast.plan.capture == "torch.export"
    with torch.no_grad():
        assert rel_err(fast(x, mask), model(x, mask)) < 1e-5
    # (torch.export cannot branch on the scales' values: the error says why fx's was not taken)
    with pytest.raises(mpgraph.CaptureError, match="the graph ignores input scale"):
        mpgraph.convert(ScaledIfTensor().eval(), (x, torch.ones(4, 8, D)))


def test_an_ignored_transposed_input_is_tested_too():
    """Noise makes some scales negative, which the model refuses; the one-element change then
    read the first element through view(-1), which a transposed example cannot take: capture
    failed with a RuntimeError from inside it. Now fx's trace, which drops the scale, is
    refused, and torch.export cannot take the check on its values: a CaptureError says both."""
    torch.manual_seed(0)
    model, x = ScaledIfTensor().eval(), torch.randn(D, 4).t()
    with pytest.raises(mpgraph.CaptureError, match=r"the graph ignores input scale, which the "
                                                   r"model's output depends on"):
        mpgraph.convert(model, (x, torch.ones(D, 4).t()))


class KeepsLastAndAnExpandedTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.last = torch.zeros(D)  # replaced on each call: not a write into it
        self.table = torch.linspace(0, 1, D).expand(4, D)  # an expanded view, only read

    def forward(self, x):
        h = self.fc(x) + self.table
        self.last = h.detach()
        return h


def test_a_replaced_or_expanded_plain_tensor_attribute_keeps_fx_and_converts():
    """The review of stop 42's fixes: a plain tensor attribute replaced by the forward counted
    as written at trace time (fx's trace refused for nothing), and the restore of plain tensor
    attributes wrote into an expanded view, which raised in every run."""
    torch.manual_seed(0)
    model = KeepsLastAndAnExpandedTable().eval()
    x = torch.randn(4, D)
    with torch.no_grad():
        model(x)  # (called once: self.last is a tensor of its own)
    fast = mpgraph.convert(model, x)
    assert fast.plan.capture == "torch.fx.symbolic_trace"
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) < 1e-6
