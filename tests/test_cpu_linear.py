"""bf16 linears of CPU plans run over weights packed once (PackCpuLinears, ir/cpu_linear): the
module computes what its graph says, the check reports the error of the kernels the module runs,
and a packed weight never outlives the weight it was packed from.

Where this CPU has no native bf16 (AVX2 only) the packing kernels do not run; the tests then put
plain-torch stand-ins in their place (``packing``), so that what they test (which nodes are
marked, the code, the cache, the fallbacks) is tested on every CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpgraph
from mpgraph.ir import cpu_linear
from mpgraph.ir.graph import run_recording
from mpgraph.ir.meta import PACKED
from mpgraph.cost.measured import CostTable, Measured
from mpgraph.cost.roofline import Roofline
from mpgraph.cost.device import measure_cpu
from mpgraph.numerics import relative_l2

NATIVE = cpu_linear.packing_available()


@pytest.fixture
def packing(monkeypatch):
    """Counts packs; plain-torch stand-ins for oneDNN's kernels where this CPU lacks them."""
    packs = []
    pack, run = cpu_linear._pack, cpu_linear._run
    if not NATIVE:
        monkeypatch.setattr("mpgraph.passes.pack_cpu_linears.packing_available", lambda: True)
        pack, run = (lambda w: w.detach().clone()), (lambda x, p, b: F.linear(x, p, b))

    def counted(w):
        packs.append(tuple(w.shape))
        return pack(w)
    monkeypatch.setattr(cpu_linear, "_pack", counted)
    monkeypatch.setattr(cpu_linear, "_run", run)
    # which way this CPU timed faster is the cost table's to say (test_packed_only_where_timed
    # _faster); here every layer is taken as faster packed, whatever this CPU measured
    monkeypatch.setattr(Measured, "packed_faster", lambda self, node, gm: True)
    return packs


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Functional(nn.Module):  # F.linear on parameters (torch.fx's call_function)
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(48, 64) * 0.1), nn.Parameter(torch.randn(48))

    def forward(self, x):
        return F.linear(x, self.w, self.b).relu()


def _bf16(model, x, **kw):
    """Every matmul in bf16 on this CPU, whatever it costs here (the test does not depend on
    which CPU it lands on)."""
    return mpgraph.convert(model, (x,), dtype="bf16", strategy="rules", **kw)


def _converted_mlp():
    """(the MLP, an 8-row input, its bf16 conversion for this CPU)."""
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    return model, x, _bf16(model, x)


def _marked(fast) -> list[str]:
    return [n.name for n in fast.graph.nodes if n.meta.get(PACKED)]


def test_marked_linears_run_packed_and_the_check_reports_their_error(packing):
    model, x, fast = _converted_mlp()
    assert _marked(fast) == ["fc1", "fc2"]
    assert fast.code.count("self.cpu_linears.module(") == 2
    with torch.no_grad():
        got, want = fast(x), model(x)
    assert got.dtype == torch.float32
    assert sorted(set(packing)) == [(32, 128), (128, 64)]
    # the error the plan reports is the one the caller computes on the module's own output
    assert relative_l2(got, want) == pytest.approx(fast.plan.check["error"], rel=1e-4)
    assert 1e-4 < fast.plan.check["error"] < 2e-2
    # the graph's own run (the check's interpreter) and the module's code agree bit for bit
    graph_out = run_recording(fast, (x,), {}, lambda n, v: None)
    assert torch.equal(graph_out, got)


def test_functional_linear_and_packs_made_once(packing):
    torch.manual_seed(0)
    model, x = Functional().eval(), torch.randn(4, 64)
    fast = _bf16(model, x)
    assert len(_marked(fast)) == 1 and "self.cpu_linears.linear(" in fast.code
    packing.clear()
    with torch.no_grad():
        first = fast(x)
        for _ in range(3):
            assert torch.equal(fast(x), first)
    assert packing == []  # packed once, by the conversion's check: not again on each call
    assert relative_l2(first, model(x)) < 2e-2


def test_a_written_or_replaced_weight_is_packed_again(packing):
    model, x, fast = _converted_mlp()
    other = MLP().eval()

    def expected():  # the same weights converted afresh
        ref = _bf16(copy.deepcopy(model), x)
        ref.load_state_dict(fast.state_dict())
        with torch.no_grad():
            return ref(x)

    with torch.no_grad():
        before = fast(x)
        fast.load_state_dict(other.state_dict())  # copies in place: the version moves
        after = fast(x)
        assert not torch.allclose(after, before)
        assert relative_l2(after, other(x)) < 2e-2
        fast.fc1.weight.mul_(2)  # an in-place write
        model.load_state_dict(other.state_dict())
        model.fc1.weight.mul_(2)
        assert relative_l2(fast(x), model(x)) < 2e-2
        fast.fc2.weight = nn.Parameter(fast.fc2.weight * 0.5)  # a new tensor in its place
        model.fc2.weight.mul_(0.5)
        assert relative_l2(fast(x), model(x)) < 2e-2
        assert torch.equal(fast(x), expected())
        # a write through .data is not seen by the version counter: clear() says so
        fast.fc1.weight.data.zero_()
        fast.cpu_linears.clear()
        model.fc1.weight.data.zero_()
        assert relative_l2(fast(x), model(x)) < 2e-2


def test_a_weight_written_while_it_is_packed_is_packed_again(packing, monkeypatch):
    """The version was read after packing: a load_state_dict landing in another thread while a
    pack was made stored the old values' pack under the new version, and every later call used
    it (probe 40b: errors 0.09-44 until the next write). Here the other thread's write is made
    inside the pack."""
    model, x, fast = _converted_mlp()
    other = MLP().eval()
    pack, fired = cpu_linear._pack, []

    def pack_while_written(w):
        packed = pack(w)  # the values the weight holds now
        if not fired:  # meanwhile, another thread's load_state_dict lands
            fired.append(True)
            fast.load_state_dict(other.state_dict())
        return packed

    fast.cpu_linears.clear()
    monkeypatch.setattr(cpu_linear, "_pack", pack_while_written)
    with torch.no_grad():
        fast(x)  # the call that packs, racing the write
        assert fired
        assert relative_l2(fast(x), other(x)) < 2e-2  # the next call: the new weights


def test_weights_in_shared_memory_are_not_packed(packing):
    """share_memory() and another process's load_state_dict: the packs (this process's memory,
    keyed by a version counter the other process does not move) kept the old weights (probe
    40b: BERT, error 0.35). A weight in shared memory takes ATen's op, which reads it."""
    model, x, fast = _converted_mlp()
    other = MLP().eval()
    with torch.no_grad():
        fast(x)
        fast.share_memory()
        count = len(packing)
        fast(x)
        assert len(packing) == count  # (its address moved: a miss, and no pack)
        # what another process's load_state_dict does, as this one sees it: new values, no
        # version counter moved (a write through .data moves none either; no fork in a test)
        for name, t in fast.named_parameters():
            t.data.copy_(other.state_dict()[name])
        assert relative_l2(fast(x), other(x)) < 2e-2


def test_autograd_and_tracers_take_atens_own_op(packing):
    model, x, fast = _converted_mlp()
    packing.clear()
    out = fast(x.requires_grad_())  # grad mode: autograd records aten.linear
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert packing == []
    x = x.detach()
    exported = torch.export.export(fast, (x,))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "aten.linear.default" in targets and not any("mkldnn" in t for t in targets)
    with torch.no_grad():
        assert relative_l2(exported.module()(x), fast(x)) < 1e-2
    traced = torch.jit.trace(fast, (x,), check_trace=False)
    assert "mkldnn" not in str(traced.graph)


def test_gpt2_conv1d_addmm_is_packed_transposed(packing):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=100, n_positions=32,
                                  use_cache=False)
    model = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 100, (2, 8))
    fast = _bf16(model, ids, dynamic=False)  # (called at the example's shapes: static)
    assert fast.code.count("self.cpu_linears.addmm(") == 4
    assert (192, 64) in packing  # c_attn's weight, stored k x n (64 x 192), packed as n x k
    with torch.no_grad():
        got, want = fast(ids).last_hidden_state, model(ids).last_hidden_state
    assert relative_l2(got, want) == pytest.approx(fast.plan.check["error"], rel=1e-4)


def test_no_marks_for_gpus_training_or_float32(packing):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    assert _marked(mpgraph.convert(model, (x,), target="a100", dtype="bf16",
                                   strategy="rules")) == []
    assert _marked(_bf16(MLP().train(), x, mode="train")) == []
    kept = mpgraph.convert(model, (x,), dtype="bf16", strategy="rules", overrides={"fc2": "fp32"})
    assert _marked(kept) == ["fc1"]


def test_copies_pack_their_own(packing):
    model, x, fast = _converted_mlp()
    twin = copy.deepcopy(fast)
    with torch.no_grad():
        want = fast(x)
        assert twin.cpu_linears is not fast.cpu_linears
        twin.fc1.weight.zero_()
        assert torch.equal(fast(x), want)  # the original's packs are its own weights'
        assert not torch.equal(twin(x), want)


@pytest.mark.skipif(not NATIVE, reason="this CPU has no native bf16 (oneDNN's packed kernels)")
def test_native_kernels_agree_with_atens():
    torch.manual_seed(0)
    for shape in ((16, 64), (2, 5, 64), (1, 64), (64,), (0, 64)):
        x = torch.randn(*shape).bfloat16()
        w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
        got = cpu_linear.CpuLinears().linear(x, w, b)
        want = F.linear(x, w, b)
        assert got.shape == want.shape
        assert relative_l2(got.float(), want.float()) < 1e-2


def test_a_decoders_two_graphs_share_their_packs(packing):
    """convert_decoder's prefill and decode graphs hold the same weight tensors: one pack each
    (batch 2: the decode step's linears have two rows, so they are packed too)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=16, dtype="bf16",
                                      strategy="rules")
    assert _marked(decoder.prefill) and _marked(decoder.decode)
    packing.clear()
    with torch.no_grad():
        out = decoder.generate(ids, max_new_tokens=4, do_sample=False)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                              do_sample=False)
    assert packing == []  # the check's packs serve both graphs: none made again
    assert out.shape == want.shape and torch.equal(out[:, :6], ids)


def test_profile_times_the_kernels_the_module_runs(packing):
    model, x, fast = _converted_mlp()
    calls = []
    run = cpu_linear._run

    def counted(*a):
        calls.append(1)
        return run(*a)
    cpu_linear._run = counted
    try:
        result = mpgraph.profile(fast, (x,), iters=1)
    finally:
        cpu_linear._run = run
    assert len(calls) >= 2  # fc1 and fc2 ran packed under the profiler too
    assert {"fc1", "fc2"} <= {n.name for n in result.nodes}


class OddBias(nn.Module):
    """A bias oneDNN's linear would read wrongly: strided, broadcast from one element, 2-D."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(256, 64) * 0.1)
        self.b = nn.Parameter(torch.randn(256, 2) if kind == "strided" else
                              torch.randn(1) if kind == "broadcast" else torch.randn(1, 256))

    def forward(self, x):
        b = self.b[:, 0] if self.kind == "strided" else \
            self.b.expand(256) if self.kind == "broadcast" else self.b
        return F.linear(x, self.w, b)


@pytest.mark.parametrize("kind", ["strided", "broadcast", "row"])
def test_a_bias_the_packed_kernel_cannot_read_takes_atens_op(packing, kind):
    torch.manual_seed(0)
    model, x = OddBias(kind).eval(), torch.randn(8, 64)
    fast = _bf16(model, x)  # (the check ran the module's kernels: it would fail the conversion)
    with torch.no_grad():
        assert relative_l2(fast(x), model(x)) < 1e-2
    assert fast.plan.check["error"] < 1e-2


def test_forward_ad_and_vmap_see_atens_op(packing):
    model, x, fast = _converted_mlp()
    v = torch.randn_like(x)
    with torch.no_grad():
        _, tangent = torch.func.jvp(fast, (x,), (v,))
        _, want = torch.func.jvp(model, (x,), (v,))
        assert relative_l2(tangent, want) < 2e-2
        batched = torch.func.vmap(fast)(x[:, None])
    assert relative_l2(batched[:, 0], model(x).detach()) < 2e-2


def test_a_weight_given_new_data_twice_is_packed_again(packing):
    model, x, fast = _converted_mlp()
    w = fast.fc1.weight
    for _ in range(8):  # (before: the second new storage landed where the packed one had been)
        with torch.no_grad():
            fast(x)
        w.data = w.data * 2
        w.data = w.data * 2
        with torch.no_grad():
            got = fast(x)
            want = fast.fc2(F.gelu(F.linear(x.bfloat16(), w, fast.fc1.bias))).float()
        assert relative_l2(got, want) < 1e-2  # (a stale pack: off by 30-170 in absolute terms)


def test_global_hooks_and_a_patched_forward_are_honoured(packing):
    model, x, fast = _converted_mlp()
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, i, o: seen.append(type(mod).__name__))
    try:
        with torch.no_grad():
            fast(x)
    finally:
        handle.remove()
    assert seen.count("Linear") == 2
    fast.fc2.forward = lambda inp: torch.zeros(inp.shape[0], 32, dtype=inp.dtype)
    with torch.no_grad():
        assert torch.equal(fast(x), torch.zeros(8, 32))


def test_a_torch_function_mode_sees_linear(packing):
    from torch.overrides import TorchFunctionMode

    class Zero(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 0 if func is F.linear else out

    model, x, fast = _converted_mlp()
    with torch.no_grad(), Zero():
        out = fast(x)
    assert torch.equal(out.abs(), torch.zeros(8, 32))  # the mode zeroed both layers' results


def test_tiny_layers_and_a_wrong_width_take_atens_op(packing):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()
    x = torch.randn(2, 16)
    fast = _bf16(model, x)
    packing.clear()
    with torch.no_grad():
        fast(torch.randn(4, 16))  # 4 x 16 x 16 = 1024: ATen's small GEMM is faster
    assert packing == []
    big = _bf16(MLP().eval(), torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        with torch.no_grad():
            big.cpu_linears.linear(torch.randn(8, 63).bfloat16(), big.fc1.weight, big.fc1.bias)


def test_packed_only_where_timed_faster(packing, monkeypatch):
    """oneDNN's packed kernel is faster at most sizes and slower at some (0.71x at 512 rows of a
    2048->768 layer here): the cost table times both, and a layer is packed where packed won."""
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    monkeypatch.setattr(Measured, "packed_faster", lambda self, node, gm: node.name == "fc2")
    assert _marked(_bf16(model, x)) == ["fc2"]
    fast = _bf16(model, x)
    node = fast.graph.find_nodes(op="call_module", target="fc1")[0]
    monkeypatch.undo()
    # (faster by less than the timings' noise, 10%, is not faster)
    for packed, plain, faster in ((1e-4, 2e-4, True), (1.9e-4, 2e-4, False), (3e-4, 2e-4, False),
                                  (None, 2e-4, False)):
        entries = {"k|fp32": 5e-4, "k|bf16": plain, **({"k|bf16 packed": packed} if packed else {})}
        costs = Measured(CostTable(torch.device("cpu"), entries), Roofline(measure_cpu()),
                         (torch.bfloat16,), keys={node: "k"}, packs=True)
        assert costs.packed_faster(node, fast) is faster
        # the plan's bf16 time is the way the module will run it
        assert costs.node_cost(node, fast, torch.bfloat16).t_low == (packed if faster else plain)


def test_the_interpreter_runs_a_swapped_in_module_and_autocast_sees_linear(packing):
    model, x, fast = _converted_mlp()

    class Sub(nn.Linear):  # (what the marked node calls now is not an nn.Linear itself)
        pass
    sub = Sub(64, 128).to(torch.bfloat16)
    sub.load_state_dict(fast.fc1.state_dict())
    fast.fc1 = sub
    with torch.no_grad():
        out = run_recording(fast, (x,), {}, lambda n, v: None)
        assert relative_l2(out, fast(x)) < 1e-2
        with torch.autocast("cpu", dtype=torch.float16):  # autocast decides linear's dtype
            direct = fast.cpu_linears.linear(x.bfloat16(), fast.fc2.weight[:, :64],
                                             fast.fc2.bias)
        assert direct.dtype == torch.float16


def test_tolerance_search_keeps_the_packing_choice(packing, monkeypatch):
    """The tolerance search converts deep copies of the graph: the cost table's keys travel with
    the nodes, so the copy packs what the plan priced packed."""
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    monkeypatch.setattr(Measured, "packed_faster", Measured.__dict__["packed_faster"])

    def packed_s(self, node, gm):  # packed wins wherever the node's measured key is found
        return 1e-12 if self._key_of(node, gm) in set(self.keys.values()) else None
    monkeypatch.setattr(Measured, "packed_s", packed_s)
    fast = mpgraph.convert(model, (x,), dtype="bf16", strategy="rules", tolerance=3e-3)
    low = [r.name for r in fast.plan.compute_nodes if r.dtype == "bfloat16"]
    assert "fc2" in low and "fc1" not in low  # (the search pinned fc1: it ran on copies)
    assert _marked(fast) == ["fc2"]


def test_training_and_gpu_tables_price_no_packed_time(packing):
    """Training never packs and a GPU table is not this CPU's: their bf16 linears cost ATen's."""
    model, x, fast = _converted_mlp()
    node = fast.graph.find_nodes(op="call_module", target="fc1")[0]
    entries = {"k|fp32": 5e-4, "k|bf16": 2e-4, "k|bf16 packed": 1e-4}
    costs = Measured(CostTable(torch.device("cpu"), entries), Roofline(measure_cpu()),
                     (torch.bfloat16,), keys={node: "k"})  # packs=False: a training plan's
    assert costs.packed_s(node, fast) is None and costs.node_cost(node, fast, torch.bfloat16).t_low == 2e-4


def test_a_failed_value_check_of_packed_linears_names_the_rounding(packing):
    """The failed check's float32 run of the graph (where values part, which rounding accounts
    for it) goes through packed Linears too."""
    class OffsetBeforeNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.n, self.b = nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)

        def forward(self, x):
            return self.b(F.silu(self.n(self.a(x) * 0.01 + 100.0)))
    torch.manual_seed(0)
    with pytest.raises(mpgraph.ValueCheckError) as caught:
        _bf16(OffsetBeforeNorm().eval(), torch.randn(8, 64))
    assert "(keep it in float32: overrides={'add': 'fp32'}" in str(caught.value)
