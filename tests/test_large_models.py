"""Planning without weights (meta device) and loading them later (safetensors)."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import transformers as hf
from conftest import ConvBnReluPool, kernels_only
from large_models import build, save_checkpoint
from safetensors.torch import save_file

import mpgraph

# (one decoder layer: a second adds the same nodes again, and no test here is about depth)
CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=100, use_cache=False)
OPTIONS = dict(dtype="bf16", target="a100", costs=kernels_only())  # (else launch-bound here)


@pytest.fixture(scope="module")
def llama():
    # parameters on meta, non-persistent buffers (rotary inv_freq: in no checkpoint) real, as
    # accelerate's init_empty_weights builds them (examples/large_models.py)
    cfg = hf.LlamaConfig(**CFG)
    real, meta = build(cfg, "cpu"), build(cfg, "meta")
    ids = torch.randint(0, CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    return real, meta, ids, mpgraph.convert(real, ids, **OPTIONS)


@pytest.fixture(scope="module")
def meta_planned(llama):
    """mpgraph.convert(meta, ids, **OPTIONS), converted once for the module: tests that load
    into it (or may write to it) take a copy, ``fresh(meta_planned)``."""
    _, meta, ids, _ = llama
    return mpgraph.convert(meta, ids, **OPTIONS)


def fresh(planned):
    """A module planned on meta, as ``mpgraph.convert(meta, ids, **OPTIONS)`` returns it (a
    copy of the module's shared one: the same conversion, not done again)."""
    return copy.deepcopy(planned)


def _records(plan):
    return [(r.name, r.op, r.target, r.dtype, r.reason, r.shape) for r in plan.nodes]


def _same_module(a, b, ids):
    assert a.code == b.code
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert (sa[k].dtype, sa[k].device, sa[k].stride()) == (sb[k].dtype, sb[k].device, sb[k].stride()), k
        assert torch.equal(sa[k], sb[k]), k
    with torch.no_grad():
        assert torch.equal(a(ids).last_hidden_state, b(ids).last_hidden_state)


def test_meta_llama_plans_node_by_node_like_the_materialised_model(llama, meta_planned):
    real, meta, ids, direct = llama
    planned = meta_planned
    # the same graph (no device-dependent .contiguous() nodes, the same names) and decisions
    assert _records(planned.plan) == _records(direct.plan)
    assert planned.code == direct.code
    assert len(direct.plan.low_nodes) > 0
    # no parameter storage: every parameter is meta, in the dtype the plan stores it in
    params = dict(planned.named_parameters())
    assert params and all(p.device.type == "meta" for p in params.values())
    assert {str(p.dtype) for p in params.values()} == \
        {str(p.dtype) for p in direct.parameters()} == {"torch.float32", "torch.bfloat16"}
    assert all(p.device.type == "meta" for p in meta.parameters())  # the model is untouched


def test_plan_then_load_safetensors_equals_direct_convert(llama, meta_planned, tmp_path):
    real, meta, ids, direct = llama
    planned = fresh(meta_planned)
    index = save_checkpoint(real, tmp_path, shards=3)
    assert mpgraph.load_weights(planned, index) is planned
    _same_module(planned, direct, ids)


def test_loaded_weights_keep_the_planned_memory_layout(tmp_path):
    """ChannelsLast stores low-precision conv weights NHWC: loaded weights land in that layout."""
    torch.manual_seed(0)
    real = ConvBnReluPool().eval()
    with torch.device("meta"):
        meta = ConvBnReluPool().eval()
    x = torch.randn(2, 3, 16, 16)
    direct = mpgraph.convert(real, x, dynamic=False, **OPTIONS)  # (both run at x alone)
    planned = mpgraph.convert(meta, x, dynamic=False, **OPTIONS)
    mpgraph.load_weights(planned, save_checkpoint(real, tmp_path))
    weight = planned.get_parameter("conv.weight")
    assert weight.dtype == torch.bfloat16 and weight.is_contiguous(memory_format=torch.channels_last)
    assert weight.stride() == direct.get_parameter("conv.weight").stride()
    assert planned.code == direct.code
    assert torch.equal(planned(x), direct(x))


def test_a_saved_plan_applies_to_the_materialised_model(llama, tmp_path):
    real, meta, ids, direct = llama
    plan = mpgraph.plan(meta, ids, **OPTIONS)
    assert isinstance(plan, mpgraph.Plan)
    plan.save(tmp_path / "plan.json")
    applied = mpgraph.convert(real, ids, plan=mpgraph.Plan.load(tmp_path / "plan.json"))
    _same_module(applied, direct, ids)


def test_training_conversion_planned_on_meta(llama):
    """mode="train" from meta: the same plan and code, float32 masters loaded, gradients flow."""
    real, meta, ids, _ = llama
    real, meta = copy.deepcopy(real).train(), copy.deepcopy(meta).train()
    # (both static: each is run only at ids, and compared with the other, not the fixture's)
    direct = mpgraph.convert(real, ids, mode="train", dynamic=False, **OPTIONS)
    planned = mpgraph.convert(meta, ids, mode="train", dynamic=False, **OPTIONS)
    assert _records(planned.plan) == _records(direct.plan) and planned.code == direct.code
    mpgraph.load_weights(planned, real.state_dict())
    assert {p.dtype for p in planned.parameters()} == {torch.float32}
    out = planned(ids).last_hidden_state
    assert torch.equal(out, direct(ids).last_hidden_state)
    out.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for n, p in planned.named_parameters() if "layers" in n)


def test_load_weights_reports_what_is_wrong(llama, meta_planned, tmp_path):
    real, meta, ids, _ = llama
    state = {k: v.contiguous() for k, v in real.state_dict().items()}
    planned = fresh(meta_planned)
    partial = dict(state)
    del partial["norm.weight"], partial["layers.0.mlp.up_proj.weight"]
    save_file(partial, tmp_path / "partial.safetensors")
    with pytest.raises(ValueError, match="2 tensors .* no value.*layers.0.mlp.up_proj.weight"):
        mpgraph.load_weights(planned, tmp_path / "partial.safetensors")
    wrong = dict(state, **{"norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"norm.weight: shape \(3,\).*\(64,\)"):
        mpgraph.load_weights(fresh(meta_planned), wrong)
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        mpgraph.load_weights(planned, tmp_path / "nowhere.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .safetensors file in"):
        mpgraph.load_weights(planned, tmp_path / "empty")


def test_load_weights_into_a_real_module_refuses_weights_under_other_names(llama, tmp_path):
    """A checkpoint of the model under a head ('model.' before every key) loaded nothing into
    a materialised conversion, quietly: with strict (the default), that is an error naming the
    names on both sides; strict=False loads what matches, and says what it did not use."""
    real, _, ids, direct = llama
    fast = copy.deepcopy(direct)  # (mpgraph.convert(real, ids, **OPTIONS), the fixture's)
    prefixed = {f"model.{k}": v for k, v in real.state_dict().items()}
    with pytest.raises(ValueError, match=r"no tensor of the weights has a name of the converted "
                       r"module \(the weights' first key: 'model\.embed_tokens\.weight'\).*"
                       r"strict=False"):
        mpgraph.load_weights(fast, prefixed)
    mpgraph.load_weights(fast, prefixed, strict=False)  # (nothing matched: nothing changed)
    with pytest.raises(TypeError, match=r"takes safetensors files .* or state dicts, got "
                                        r"LlamaModel: pass model\.state_dict\(\)"):
        mpgraph.load_weights(fast, real)
    torch.save(real.state_dict(), tmp_path / "w.pt")
    with pytest.raises(ValueError, match=r"w\.pt is not a \.safetensors file: .*torch\.load"):
        mpgraph.load_weights(fast, tmp_path / "w.pt")


def test_load_weights_moves_device_constants_with_the_weights(llama, meta_planned):
    """Traced for the CPU, loaded elsewhere: ops that create tensors on the traced device (masks,
    positions, export's asserts) follow the weights. The meta device stands in for CUDA here: a
    CPU constant left behind would make the run fail on mixed devices."""
    real, meta, ids, _ = llama
    planned = fresh(meta_planned)
    placed = [n for n in planned.graph.nodes if str(n.kwargs.get("device")) == "cpu"]
    assert placed  # arange(device=cpu) and friends
    mpgraph.load_weights(planned, real.state_dict(), device="meta")
    assert not [n for n in planned.graph.nodes if "cpu" in n.format_node()]
    assert {t.device.type for t in planned.state_dict().values()} == {"meta"}
    out = planned(ids.to("meta")).last_hidden_state
    assert out.device.type == "meta" and out.shape == (2, 16, CFG["hidden_size"])


def test_a_device_named_another_way_is_the_one_the_plan_was_traced_for(llama, meta_planned):
    """load_weights(device="cuda") of a plan traced for cuda:0 (CUDA example inputs) moved each
    device constant from cuda:0 to cuda: the code differed from the materialised model's (and a
    decoder on cuda:0 refused device="cuda"). "cpu:0" names the CPU the same other way."""
    real, meta, ids, direct = llama
    planned = fresh(meta_planned)
    mpgraph.load_weights(planned, real.state_dict(), device="cpu:0")
    assert planned.code == direct.code and planned.meta["mpgraph.traced_on"] == "cpu"


class _Positions(nn.Module):
    """A region under no_grad (HF's rotary embedding in transformers 5.17) with a device constant."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        n = x.shape[-1]
        with torch.no_grad():
            pos = torch.arange(n, device=x.device).float()
        return self.fc(x + pos if n > 8 else x)  # (a branch on a size: torch.export)


def test_a_plan_applies_in_either_grad_mode():
    """torch.export keeps a no_grad region as one node with gradients on and inlines it with
    them off: a plan made outside torch.no_grad() and applied inside it listed a dozen missing
    nodes and no reason (a meta Llama's plan under transformers 5.17), and then a
    PlanMismatchError saying why. The plan records the grad mode it was captured in; applied,
    the model is captured in that mode again. A plan saved before it says why it mismatches."""
    torch.manual_seed(0)
    model, x = _Positions().eval(), torch.randn(2, 16)
    direct = mpgraph.convert(model, x, **OPTIONS)
    plan = mpgraph.Plan.from_dict(direct.plan.to_dict())  # (as saved and loaded)
    assert plan.grad_enabled is True
    with torch.no_grad():
        applied = mpgraph.convert(model, x, plan=plan)
        assert applied.code == direct.code and torch.equal(applied(x), direct(x))
        inside = mpgraph.convert(model, x, **OPTIONS)
    assert inside.plan.grad_enabled is False and "wrap_with_set_grad_enabled" not in inside.code
    assert mpgraph.convert(model, x, plan=inside.plan).code == inside.code  # (with grad on)
    plan.grad_enabled = None  # (saved before plans recorded it)
    with torch.no_grad(), pytest.raises(mpgraph.PlanMismatchError, match=r"made with gradients "
                                        r"on and this conversion runs with them off.*outside "
                                        r"torch\.no_grad\(\)"):
        mpgraph.convert(model, x, plan=plan)


def test_device_constants_inside_a_no_grad_region_move_with_the_weights():
    """torch.export puts a region under no_grad (HF's rotary embedding in transformers 5.17) in a
    submodule of its own: its device constants stayed on the traced device, and the module,
    loaded elsewhere, ran .to(cpu) of a meta tensor ("Cannot copy out of meta tensor")."""
    torch.manual_seed(0)
    real = _Positions().eval()
    with torch.device("meta"):
        meta = _Positions().eval()
    x = torch.randn(2, 16)
    planned = mpgraph.convert(meta, x, **OPTIONS)
    (region,) = [m for m in planned.modules() if isinstance(m, torch.fx.GraphModule)
                 and m is not planned]
    assert "device(type='cpu')" in region.code
    mpgraph.load_weights(planned, real.state_dict(), device="meta")
    assert "cpu" not in region.code
    assert planned(x.to("meta")).device.type == "meta"


def test_values_are_refused_for_a_meta_model(llama):
    _, meta, ids, _ = llama
    with pytest.raises(ValueError, match="calibration and tolerance measure values"):
        mpgraph.convert(meta, ids, calibration=[ids], **OPTIONS)
    with pytest.raises(ValueError, match="calibration and tolerance measure values"):
        mpgraph.convert(meta, ids, tolerance=0.01, **OPTIONS)


def test_inference_conversion_is_frozen_training_conversion_is_not(llama):
    real, _, ids, direct = llama
    assert not any(p.requires_grad for p in direct.parameters())
    assert all(p.requires_grad for p in real.parameters())  # the model keeps its own flags


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plan_on_meta_then_load_onto_the_gpu(llama, tmp_path):
    real, meta, ids, _ = llama
    direct = mpgraph.convert(copy.deepcopy(real).cuda(), ids.cuda(), **OPTIONS)
    planned = mpgraph.convert(meta, ids.cuda(), **OPTIONS)  # traced for CUDA: fake CUDA tensors
    mpgraph.load_weights(planned, save_checkpoint(real, tmp_path), device="cuda")
    _same_module(planned, direct, ids.cuda())


def test_a_tied_weight_loads_from_the_one_name_a_checkpoint_keeps_and_stays_tied(tmp_path):
    """HF checkpoints keep a tied LM head once (under the embedding's name): the converted
    module's head took its old values, silently, before."""
    def gpt2(seed):
        torch.manual_seed(seed)
        return hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=100,
                                                use_cache=False)).eval()
    model, other = gpt2(0), gpt2(1)
    assert other.lm_head.weight is other.transformer.wte.weight
    with torch.device("meta"):
        meta = gpt2(0)
    assert meta.lm_head.weight is meta.transformer.wte.weight
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    save_file({k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors")
    for source in (model, meta):  # a real model, and one planned on meta (two fakes before)
        converted = mpgraph.convert(source, ids, dynamic=False, **OPTIONS)  # (run at ids alone)
        mpgraph.load_weights(converted, tmp_path / "model.safetensors")
        params = dict(converted.named_parameters(remove_duplicate=False))
        assert params["lm_head.weight"] is params["transformer.wte.weight"]
        with torch.no_grad():
            ref = other(ids).logits
            assert mpgraph.numerics.relative_l2(converted(ids).logits, ref) < 2e-2


def test_calling_a_module_with_tensors_still_meta_is_an_error_naming_them(llama, meta_planned):
    """A meta tensor read by a CPU kernel is uninitialised memory: a module planned on meta
    called before its weights were loaded, or after a strict=False load that missed some,
    returned garbage or NaN (or torch's device error) before."""
    real, meta, ids, direct = llama
    planned = fresh(meta_planned)
    with pytest.raises(mpgraph.MissingWeightsError, match=r"have no value .*embed_tokens.weight"
                       r".*mpgraph\.load_weights"):
        planned(ids)
    state = real.state_dict()
    partial = {k: v for k, v in state.items() if k != "layers.0.mlp.down_proj.weight"}
    mpgraph.load_weights(planned, partial, strict=False)
    with pytest.raises(mpgraph.MissingWeightsError,
                       match=r"^1 tensors .*: layers\.0\.mlp\.down_proj\.weight: load them"):
        planned(ids)
    mpgraph.load_weights(planned, {"layers.0.mlp.down_proj.weight":
                                   state["layers.0.mlp.down_proj.weight"]})
    with torch.no_grad():
        assert torch.equal(planned(ids).last_hidden_state, direct(ids).last_hidden_state)


def test_a_tensor_the_forward_creates_on_meta_is_named_as_such():
    """A constant the forward builds (torch.tensor([...]), torch.ones(...)) stays meta in a meta
    plan and is in no checkpoint: the missing-weights error told the user to load it."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x):
            return self.fc(x) * torch.tensor([0.5, 2.0]).repeat(32) + torch.ones(64)

    torch.manual_seed(0)
    real = Scaled().eval()
    with torch.device("meta"):
        meta = Scaled().eval()
    planned = mpgraph.convert(meta, (torch.randn(4, 64, device="meta"),), dtype="bf16",
                              target="a100")
    with pytest.raises(ValueError, match=r"holds 2 tensor\(s\) its forward creates "
                       r".*_tensor_constant0.*register each as a buffer.*nothing was loaded"):
        mpgraph.load_weights(planned, real.state_dict())
    with pytest.raises(mpgraph.MissingWeightsError, match=r"holds 2 tensor\(s\) its forward "
                       r"creates .*_tensor_constant0.*register each as a buffer"):
        planned(torch.randn(4, 64))


def test_a_name_in_two_files_is_an_error_and_an_index_decides_where_each_name_is(llama, meta_planned,
                                                                                tmp_path):
    """A directory holding two checkpoints (an old export beside the new one) gave every tensor
    from whichever file sorted last, silently; an index's weight_map was read only for its file
    names, so a stale copy of a name in a listed shard could win the same way."""
    real, meta, ids, direct = llama
    state = {k: v.contiguous() for k, v in real.state_dict().items()}
    stale = {k: torch.zeros_like(v) for k, v in state.items()}
    save_file(state, tmp_path / "model.safetensors")
    save_file(stale, tmp_path / "model_v0_backup.safetensors")
    planned = fresh(meta_planned)
    with pytest.raises(ValueError, match=r"weight \S+ is in two files, .*model\.safetensors and "
                                         r".*model_v0_backup\.safetensors"):
        mpgraph.load_weights(planned, tmp_path)
    # an index: each name from the shard it maps the name to, and a directory with one follows it
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    index = save_checkpoint(real, sharded, shards=2)
    first = sorted(state)[0]  # (in the first shard)
    save_file({**{k: state[k] for k in sorted(state)[1::2]}, first: stale[first]},
              sharded / "model-00002-of-00002.safetensors")  # a stale copy of it in the other shard
    save_file(stale, sharded / "zz_old.safetensors")  # an old export the index does not list
    for source in (index, sharded):
        loaded = mpgraph.load_weights(fresh(meta_planned), source)
        _same_module(loaded, direct, ids)


def test_a_load_weights_error_writes_nothing(llama, meta_planned, tmp_path):
    """A wrong shape (or a tensor without a value, strict) found after some tensors were written
    left a loaded module holding two checkpoints' tensors (13 of 20 replaced): neither's answer."""
    real, _, ids, direct = llama
    fast = copy.deepcopy(direct)
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    other = {k: torch.randn_like(v) for k, v in real.state_dict().items()}
    last = list(other)[-3]
    save_file({**other, last: torch.zeros(3, 3)}, tmp_path / "wrong.safetensors")
    for weights in ({**other, last: torch.zeros(3, 3)}, tmp_path / "wrong.safetensors"):
        with pytest.raises(ValueError, match=rf"weight {last}: shape \(3, 3\).*nothing was loaded"):
            mpgraph.load_weights(fast, weights)
        assert all(torch.equal(v, before[k]) for k, v in fast.state_dict().items())
    planned = fresh(meta_planned)  # (mpgraph.convert(llama[1], ids, **OPTIONS))
    partial = {k: v for k, v in real.state_dict().items() if k != "norm.weight"}
    with pytest.raises(ValueError, match=r"1 tensors .* no value.*norm\.weight.*nothing was loaded"):
        mpgraph.load_weights(planned, partial)
    assert all(p.is_meta for p in planned.parameters())


def test_a_shared_load_checks_the_second_module_before_writing_the_first():
    """A decoder's two graphs load as one: a tensor only the second stores in float16 (1e5
    overflows it) was found after the first graph had been written, "nothing was loaded" false."""
    from mpgraph.plans.weights import load_weights_shared
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    x = torch.randn(4, 16)
    options = dict(dtype="fp16", target="a100", strategy="rules", dynamic=False)  # (never run)
    first = mpgraph.convert(model, x, overrides={"2": "fp32"}, **options)
    second = mpgraph.convert(model, x, **options)
    assert dict(first.named_parameters())["2.weight"].dtype == torch.float32
    assert torch.float16 in {p.dtype for n, p in second.named_parameters() if n.startswith("2.")}
    before = {k: v.clone() for k, v in first.state_dict().items()}
    weights = {k: v + 1 for k, v in model.state_dict().items()}
    weights["2.weight"] = torch.full((16, 16), 1e5)
    with pytest.raises(mpgraph.WeightOverflowError, match=r"2\.weight.*nothing was loaded"):
        load_weights_shared(first, second, (weights,), share=lambda: ["2.weight", "2.bias"])
    assert all(torch.equal(v, before[k]) for k, v in first.state_dict().items())


def test_a_plan_on_meta_says_it_is_not_calibrated(llama):
    """A run on fakes measures nothing: the plan said "calibrated on 1 batch" and warned that an
    fp16 plan calibrated on one batch should be given calibration=, which a meta model refuses."""
    real, meta, ids, _ = llama
    options = dict(OPTIONS, dtype="fp16", dynamic=False)  # (neither is run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning at all)
        plan = mpgraph.convert(meta, ids, **options).plan
    assert plan.calibration_batches == 0 and plan.safety_nodes
    assert "(not calibrated: planned without values, on the meta device)" in plan.summary()
    with pytest.warns(UserWarning, match="calibrated on one batch"):  # the real model's, as before
        assert mpgraph.convert(real, ids, **options).plan.calibration_batches == 1


def test_a_meta_model_reading_a_tensor_value_is_refused_at_capture():
    """torch.export traces .item() of a meta buffer (an unbacked number), but the conversion's
    runs on fakes cannot compute it: a PassError from CheckConversion quoting torch's
    DataDependentOutputException, before."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)
            self.register_buffer("temp", torch.tensor(2.0))

        def forward(self, x):
            return self.fc(x) / self.temp.item()

    x = torch.randn(4, 16)
    mpgraph.convert(Scaled().eval(), x, **OPTIONS)  # (the materialised model converts)
    with torch.device("meta"):
        meta = Scaled().eval()
    with pytest.raises(ValueError, match=r"Scaled's forward reads the value of a tensor \(item of "
                       r"temp at test_large_models\.py:\d+: return self\.fc\(x\) / "
                       r"self\.temp\.item\(\)\).*Convert the materialised model"):
        mpgraph.convert(meta, x, **OPTIONS)


def test_a_size_1_guard_kept_by_a_meta_plan_says_why_and_the_way_out(llama, meta_planned):
    """A plan on meta cannot test the guards that exclude a size of 1 (no values), so it keeps
    them: batch 1 was refused with advice to convert at batch 1 (a graph for batch 1 only)."""
    real, meta, ids, direct = llama
    planned = mpgraph.load_weights(fresh(meta_planned), real.state_dict())
    with torch.no_grad():
        with pytest.raises(mpgraph.InputMismatchError, match=r"size\(\)\[0\] != 1\. It was planned "
                           r"on the meta device.*plan=module\.plan"):
            planned(ids[:1])
        again = mpgraph.convert(real, ids, plan=planned.plan)
        assert torch.equal(again(ids[:1]).last_hidden_state, direct(ids[:1]).last_hidden_state)


def test_a_meta_plan_is_traced_where_its_inputs_are_with_cuda_here_or_not(monkeypatch):
    """A machine with CUDA traced a meta model planned for a GPU on fake CUDA tensors, whatever
    its example inputs: CPU inputs gave a plan unlike the materialised model's and the one a
    machine without CUDA made (device constants on cuda:0, load_weights moving the weights to
    CUDA; a forward's own CPU constants refused). The inputs decide, all on meta: torch's default
    device. torch.cuda.is_available() patched stands in for the GPU."""
    from mpgraph.ir.fake import TRACED_ON, Abstract

    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x).relu() + torch.arange(16, device=x.device)

    class Masked(Shifted):  # (a branch on a size: torch.export, which bakes the device in)
        def forward(self, x):
            n = x.shape[-1]
            return self.fc(x + torch.arange(n, device=x.device) if n > 8 else x)

    x = torch.randn(2, 16)
    for cls in (Shifted, Masked):
        torch.manual_seed(0)
        real = cls().eval()
        with torch.device("meta"):
            meta = cls().eval()
        direct = mpgraph.convert(real, x, **OPTIONS)
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            for inputs in (x, x.to("meta")):
                planned = mpgraph.convert(meta, inputs, **OPTIONS)
                assert planned.meta[TRACED_ON] == "cpu" and planned.code == direct.code
                mpgraph.load_weights(planned, real.state_dict())
                assert {t.device.type for t in planned.state_dict().values()} == {"cpu"}
                assert torch.equal(planned(x), direct(x))
    assert "device(type='cpu')" in planned.code  # (Masked: export's arange)
    from mpgraph.ir.fake import trace_device
    cuda = Abstract(torch.device("cuda")).fake(x)  # CUDA inputs (fakes here): a CUDA trace
    assert trace_device((cuda,), {}) == torch.device("cuda", 0)
