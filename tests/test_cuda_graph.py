"""The CUDA-graph runtime (mpgraph.cuda_graph): its logic on the CPU, with a recording backend in
place of CUDA (signatures, the LRU cache, fresh and static outputs, fallbacks, errors); its
replay against eager on a GPU (skipped without one)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import mpgraph
from conftest import MLP, Recorder, rel_err
from mpgraph.tools.cuda_graph import CudaGraphBackend, GraphedModule, REASONS, signature

LOGGER = "mpgraph.tools.cuda_graph"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: replays a "
                          "real CUDA graph (run on a GPU machine: pytest tests/test_cuda_graph.py)")


def graphed(module, backend=None, **kw) -> GraphedModule:
    return GraphedModule(module, backend=backend or Recorder(), **kw)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


# signatures


def test_same_shapes_dtypes_and_devices_give_one_key():
    x = torch.randn(2, 16)
    a = signature((x,), {"scale": 2})
    b = signature((torch.zeros(2, 16),), {"scale": 2})
    assert a == b and hash(a) == hash(b)


def test_shape_dtype_device_scalar_kwarg_or_structure_give_another_key():
    x = torch.randn(2, 16)
    calls = [((x,), {}), ((torch.randn(3, 16),), {}), ((x.double(),), {}),
             ((torch.empty(2, 16, device="meta"),), {}), ((x, 1), {}), ((x, 2), {}),
             ((x, 1.0), {}), ((x, True), {}), ((x, None), {}), ((x, "mean"), {}),
             ((), {"x": x}), ((x,), {"mask": x}), (([x],), {}), (((x,),), {}), ((x, x), {})]
    keys = [signature(a, k) for a, k in calls]
    assert len(set(keys)) == len(calls)


# the cache


def test_lru_cache_counts_hits_misses_and_evicts_the_least_recently_used():
    torch.manual_seed(0)
    model = MLP().eval()
    g = graphed(model, max_graphs=2)
    a, b, c = (torch.randn(n, 16) for n in (1, 2, 3))
    with torch.no_grad():
        for x in (a, a, b, a, c, b, b):  # c evicts b (a was used last), then b evicts a
            torch.testing.assert_close(g(x), model(x), rtol=0, atol=0)
    s = g.stats
    assert (s.graphs, s.hits, s.misses, s.captures, s.evictions) == (2, 3, 4, 4, 2)
    assert [k[1][0][0] for k in g._graphs] == [(3, 16), (2, 16)]  # c then b, most recent last
    assert g.backend.captures == 4 and g.backend.warmups == 4 * 3 and g.backend.replays == 7
    assert s.fallbacks == {}
    assert "2 graphs cached (max 2), 3 hits, 4 misses" in str(s)
    g.reset()
    assert (g.stats.graphs, g.stats.hits, g.stats.misses, len(g._graphs)) == (0, 0, 0, 0)


def test_fresh_outputs_survive_the_next_call_static_ones_are_overwritten():
    torch.manual_seed(0)
    model = MLP().eval()
    x1, x2 = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        ref1, ref2 = model(x1), model(x2)
        fresh = graphed(model)
        o1, o2 = fresh(x1), fresh(x2)
        assert o1 is not o2 and torch.equal(o1, ref1) and torch.equal(o2, ref2)
        static = graphed(model, static_outputs=True)
        s1 = static(x1)
        s1_copy = s1.clone()
        s2 = static(x2)
        assert s2 is s1 and torch.equal(s2, ref2)  # the same tensor, now holding x2's answer
        assert torch.equal(s1_copy, ref1)


def test_output_structure_and_non_tensor_arguments_are_the_modules():
    class Structured(nn.Module):
        def forward(self, x, *, scale, mode="add"):
            y = x * scale if mode == "mul" else x + scale
            return {"y": y, "n": 3, "pair": (x.sum(), None)}

    m, x = Structured(), torch.randn(4)
    g = graphed(m)
    with torch.no_grad():
        for kw in ({"scale": 2}, {"scale": 2, "mode": "mul"}, {"scale": 2.5}, {"scale": 2}):
            out, ref = g(x, **kw), m(x, **kw)
            assert out.keys() == ref.keys() and out["n"] == 3 and out["pair"][1] is None
            assert torch.equal(out["y"], ref["y"]) and torch.equal(out["pair"][0], ref["pair"][0])
    assert (g.stats.misses, g.stats.hits) == (3, 1)  # scalars are part of the signature


# fallbacks and errors


def test_capture_failure_runs_eagerly_warns_once_and_is_not_retried(caplog):
    torch.manual_seed(0)
    model = MLP().eval()
    error = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    g = graphed(model, backend=Recorder(fail=error))
    x = torch.randn(2, 16)
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        for _ in range(3):
            assert torch.equal(g(x), model(x))
        assert g.backend.captures == 1  # the signature is remembered as not capturable
        y = torch.randn(5, 16)
        assert torch.equal(g(y), model(y))
    assert g.backend.captures == 2  # another signature is tried once too
    assert g.stats.fallbacks == {"capture_failed": 4} and g.stats.graphs == 0
    (message,) = warnings_of(caplog)
    assert "capture failed" in message  # and the error that started it, not capture_end's:
    assert "RuntimeError: CUDA error: operation not permitted when stream is capturing" in message
    assert "given once" in message


def test_cpu_tensors_run_eagerly_with_exactly_one_warning(caplog):
    torch.manual_seed(0)
    model = MLP().eval()
    g = mpgraph.cuda_graph(model)  # the real CUDA backend
    reason = "not_cuda" if torch.cuda.is_available() else "no_cuda"
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        for n in (1, 2, 1):
            x = torch.randn(n, 16)
            assert torch.equal(g(x), model(x))
    assert g.stats.fallbacks == {reason: 3}
    assert (g.stats.graphs, g.stats.misses, g.stats.hits) == (0, 0, 0)
    (message,) = warnings_of(caplog)
    assert REASONS[reason] in message and "MLP" in message
    assert CudaGraphBackend().unsupported([torch.zeros(1)]) == reason


def test_autograd_on_with_trainable_parameters_or_inputs_runs_eagerly(caplog):
    torch.manual_seed(0)
    model = MLP()  # parameters require grad
    g = graphed(model)
    x = torch.randn(2, 16)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = g(x)
        out.sum().backward()  # eager: gradients flow into the module
        assert model.fc1.weight.grad is not None
        with torch.no_grad():
            assert torch.equal(g(x), model(x))  # without autograd the graph path is taken
        frozen = graphed(MLP().requires_grad_(False))
        xg = torch.randn(2, 16, requires_grad=True)
        frozen(xg).sum().backward()
        assert xg.grad is not None
    assert g.stats.fallbacks == {"grad": 1} and g.stats.captures == 1
    assert frozen.stats.fallbacks == {"grad": 1} and frozen.stats.captures == 0
    messages = warnings_of(caplog)
    assert len(messages) == 2 and all("torch.no_grad()" in m for m in messages)


def test_module_that_writes_into_its_inputs_runs_eagerly():
    class AddInPlace(nn.Module):
        def forward(self, x):
            return x.add_(1)

    g = graphed(AddInPlace())
    x = torch.zeros(3)
    with torch.no_grad():
        g(x)
        g(x)
    assert torch.equal(x, torch.full((3,), 2.0))  # as eager: the warm-up wrote into a copy
    assert g.stats.fallbacks == {"mutates_input": 2} and g.backend.captures == 0


def test_unhashable_argument_runs_eagerly():
    class Ignores(nn.Module):
        def forward(self, x, extra):
            return x * 2

    g = graphed(Ignores())
    with torch.no_grad():
        assert torch.equal(g(torch.ones(2), bytearray(b"ab")), torch.full((2,), 2.0))
    assert g.stats.fallbacks == {"unhashable": 1} and g.stats.misses == 0


def test_the_modules_own_errors_raise_and_are_not_remembered():
    g = graphed(MLP().eval())
    with torch.no_grad(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        g(torch.randn(2, 15))
    assert not g._failed and g.stats.fallbacks == {} and g.stats.graphs == 0


def test_moved_parameters_drop_the_graphs():
    torch.manual_seed(0)
    model = MLP().eval()
    g = graphed(model)
    x = torch.randn(2, 16)
    with torch.no_grad():
        g(x)
        model.fc1.weight.data = model.fc1.weight.data * 2  # new storage: a graph reads the old
        assert torch.equal(g(x), model(x))
        assert (g.stats.invalidations, g.stats.misses, g.stats.graphs) == (1, 2, 1)
        g.double()  # through the wrapper: dropped at once
        assert g.stats.graphs == 0
        assert torch.equal(g(x.double()), model(x.double()))
    assert g.stats.misses == 3


def test_arguments_plan_passthrough_and_export():
    with pytest.raises(ValueError, match="max_graphs"):
        mpgraph.cuda_graph(MLP(), max_graphs=0)
    with pytest.raises(ValueError, match="warmup"):
        mpgraph.cuda_graph(MLP(), warmup=0)
    with pytest.raises(TypeError, match="nn.Module"):
        mpgraph.cuda_graph(lambda x: x)
    x = torch.randn(2, 16)
    fast = mpgraph.convert(MLP().eval(), (x,), dtype=torch.bfloat16, strategy="rules",
                           target="a100")
    g = graphed(fast)
    assert g.module is fast and g.plan is fast.plan
    assert isinstance(mpgraph.cuda_graph(fast), GraphedModule)
    with torch.no_grad():
        assert torch.equal(g(x), fast(x)) and torch.equal(g(x), fast(x))
    assert (g.stats.hits, g.stats.misses) == (1, 1)


def test_cuda_backend_brackets_capture_and_frees_a_failed_captures_pool(monkeypatch):
    """The CUDA calls in order, on a CPU: torch.cuda's pieces replaced by recorders. After a
    failed capture, a capture that ends (of one kernel, in a pool of its own) takes the default
    CUDA generator out of capture mode: a random op raised "Offset increment outside graph
    capture encountered unexpectedly" before."""
    import contextlib
    calls = []

    class Stream:
        def wait_stream(self, other):
            calls.append("wait")

    class Graph:
        ended = False

        def replay(self):
            calls.append("replay")

        def pool(self):
            if not self.ended:
                raise RuntimeError("Called CUDAGraph::pool() without a successful capture")

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        calls.append(("capture", pool))
        try:
            yield
        except Exception:
            raise RuntimeError("operation failed due to a previous error during capture")
        g.ended = True
        calls.append("end")

    fakes = {"device": lambda d: contextlib.nullcontext(), "Stream": Stream, "CUDAGraph": Graph,
             "current_stream": Stream, "stream": lambda s: contextlib.nullcontext(),
             "graph": graph, "graph_pool_handle": lambda: (0, 7), "current_device": lambda: 0}
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(torch._C, name, lambda d, p, n=name: calls.append((n, d, p)),
                            raising=False)
    backend, dev = CudaGraphBackend(), torch.device("cpu")
    backend.warmup(lambda: calls.append("run"), dev, 2)
    g, out = backend.capture(lambda: calls.append("run") or 5, dev)
    backend.replay(g, dev)
    assert out == 5 and calls == ["wait", "run", "run", "wait", ("capture", (0, 7)), "run", "end",
                                  "wait", "replay"]
    calls.clear()

    def sync():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="previous error"):
        backend.capture(sync, dev)
    assert calls == [("capture", (0, 7)), ("_cuda_endAllocateToPool", 0, (0, 7)),
                     ("_cuda_releasePool", 0, (0, 7)), ("capture", None), "end"]


# on a GPU: real capture and replay, compared with eager


def _converted_bert():
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=512, vocab_size=1000, max_position_embeddings=64)
    model = BertModel(cfg).eval().cuda()
    ids = torch.randint(0, 1000, (1, 16), device="cuda")
    return mpgraph.convert(model, (ids,), dtype=torch.float16)


@cuda
def test_gpu_replay_of_a_converted_bert_equals_eager():
    fast = _converted_bert()
    g = mpgraph.cuda_graph(fast, max_graphs=2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for shape in ((1, 16), (1, 8), (1, 16), (1, 8), (1, 16)):  # the batch is traced in
            ids = torch.randint(0, 1000, shape, device="cuda", generator=gen)
            out, ref = g(ids), fast(ids)
            assert type(out) is type(ref) and out.keys() == ref.keys()
            for k in ref.keys():
                assert rel_err(out[k], ref[k]) < 1e-3, k
    assert (g.stats.graphs, g.stats.captures, g.stats.hits) == (2, 2, 3)
    assert g.stats.fallbacks == {}


@cuda
def test_gpu_fresh_outputs_survive_static_outputs_are_overwritten():
    torch.manual_seed(0)
    model = MLP().eval().cuda()
    x1, x2 = torch.randn(4, 16, device="cuda"), torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        ref1, ref2 = model(x1), model(x2)
        g = mpgraph.cuda_graph(model)
        o1, o2 = g(x1), g(x2)
        assert rel_err(o1, ref1) < 1e-5 and rel_err(o2, ref2) < 1e-5
        s = mpgraph.cuda_graph(model, static_outputs=True)
        s1 = s(x1)
        assert rel_err(s1, ref1) < 1e-5
        s2 = s(x2)
        assert s2 is s1 and rel_err(s1, ref2) < 1e-5
        with torch.inference_mode():
            assert rel_err(g(x1), ref1) < 1e-5


@cuda
def test_gpu_eviction_and_moved_weights_never_give_a_stale_answer():
    torch.manual_seed(0)
    model = nn.Linear(16, 8).eval().cuda()
    g = mpgraph.cuda_graph(model, max_graphs=1)
    with torch.no_grad():
        for n in (1, 2, 1, 2):
            x = torch.randn(n, 16, device="cuda")
            assert rel_err(g(x), model(x)) < 1e-5
        assert g.stats.evictions == 3 and g.stats.graphs == 1
        model.weight.data = model.weight.data * 2
        assert rel_err(g(x), model(x)) < 1e-5 and g.stats.invalidations == 1
        model.half()
        assert rel_err(g(x.half()), model(x.half())) < 1e-3


@cuda
def test_gpu_host_sync_in_forward_falls_back_and_cuda_stays_usable(caplog):
    class Branches(nn.Module):  # data-dependent control flow through .item()
        def forward(self, x):
            return x * 2 if x.sum().item() > 0 else x - 1

    g = mpgraph.cuda_graph(Branches())
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        for sign in (1, -1, 1):
            x = sign * torch.ones(4, device="cuda")
            assert torch.equal(g(x), Branches()(x))
    assert g.stats.fallbacks == {"capture_failed": 3} and g.stats.graphs == 0
    (message,) = warnings_of(caplog)
    assert "capture failed" in message
    mlp = mpgraph.cuda_graph(MLP().eval().cuda())  # capture still works after a failed one
    x = torch.randn(2, 16, device="cuda")
    with torch.no_grad():
        assert rel_err(mlp(x), mlp.module(x)) < 1e-5 and mlp.stats.captures == 1
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    # the random generator works and is where it was: a failed capture draws nothing
    torch.cuda.manual_seed(3)
    first = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(3)
    with torch.no_grad():
        mpgraph.cuda_graph(Branches())(torch.ones(4, device="cuda"))
    assert torch.equal(torch.rand(4, device="cuda"), first)

