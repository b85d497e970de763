"""Shared models and helpers for the tests. Everything is built locally; nothing downloads."""
from __future__ import annotations

import atexit
import functools
import math
import os
import pathlib
import shutil
import sys
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import mpgraph
from mpgraph.numerics import relative_l2
from mpgraph.ir.meta import INSERTED_BY
from mpgraph.tools.cuda_graph import CudaGraphBackend

# Plans for "this machine" (no target) come from a CPU micro-benchmark cached in ~/.cache/mpgraph.
# The tests measure afresh into a private directory, so a stale or noisy cache cannot decide them.
_CACHE = tempfile.mkdtemp(prefix="mpgraph-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE  # subprocesses (CLI tests) inherit it
# every pipeline run in the suite checks each pass's writes against its declaration
os.environ["MPGRAPH_CHECK_PASSES"] = "1"
atexit.register(shutil.rmtree, _CACHE, True)

# Under pytest-xdist each worker takes one core: the tests are mostly Python (tracing, passes),
# and two workers with two threads each would fight over the machine's two cores
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The tests marked ``slow`` run first. pytest-xdist's worksteal gives each worker a
    contiguous share and an idle worker steals from the end of another's queue: a long test
    near the end of the order keeps one worker busy while the other waits for it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (stable otherwise)


@pytest.fixture(autouse=True)
def _this_cpu_emulates_fp16_and_bf16(request, monkeypatch):
    """A plan for this machine (no target) plans float32 and the low dtypes this CPU runs
    natively, by its measured op times: on an AVX2-only CPU float32 alone, on one with AMX bf16
    wherever its timings say so, which varies with the sizes and the machine's load. So a test's
    plan for this machine treats fp16 and bf16 as emulated here, as on an AVX2-only CPU, whatever
    the CPU (on an AMX Xeon a one-layer GPT-2's default decoder was bf16, and a 32x256 linear's
    default plan bf16 under load, float32 when quiet). A test about low precision plans for
    conftest.GPU or gives a cost table; one about this CPU's own choice is marked ``this_cpu``."""
    if request.node.get_closest_marker("this_cpu") is None:
        monkeypatch.setattr(mpgraph.api, "emulated", lambda dtype, spec: True)


# The GPU that tests about low precision plan for: what is low there does not depend on the CPU
# the suite lands on (an AVX2-only CPU keeps everything float32 for itself, one with AMX almost
# nothing). The plans still run here: the CPU computes fp16/bf16, slowly where it emulates them.
GPU = "a100"
# the op-list rules (every Tensor Core op low, whatever its size) planned for that GPU
convert_rules = functools.partial(mpgraph.convert, strategy="rules", target=GPU)


def kernels_only(target: str = GPU):
    """A GPU's roofline priced on its kernels alone, no host time and no least time a kernel:
    the tests' tiny models then plan low where their arithmetic says (replayed, they would be
    launch-bound, and nothing would pay)."""
    from mpgraph.cost.device import resolve_target
    from mpgraph.cost.roofline import Roofline
    return Roofline(resolve_target(target), runtime="graphs", kernel_floor=0.0)

# the example model loaders (examples/crepe.py, ...) are importable from the tests
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

# Relative L2 error allowed against float32, per low dtype (bf16 keeps 8 mantissa bits, fp16 11).
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LOW_DTYPES = [torch.bfloat16, torch.float16]


rel_err = relative_l2  # the one metric mpgraph reports and checks (mpgraph.numerics)


def casts(gm) -> list:
    """The cast nodes mpgraph inserted."""
    return [n for n in gm.graph.nodes if n.meta.get(INSERTED_BY) == "InsertCasts"]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ConvBnReluPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.relu(self.bn(self.conv(x)))), 1))


class SharedInput(nn.Module):
    """One float32 value read by three matmuls: needs exactly one shared cast."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.q(x) + self.k(x) + self.v(x)


class SoftmaxAttention(nn.Module):
    """Written-out attention: matmul -> scale -> softmax -> matmul, plus a sum."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(16), dim=-1)
        out = probs @ v
        return out, out.sum(dim=-1)


class ConvNextish(nn.Module):
    """conv -> channels-last LayerNorm -> linear: the norm's input and readers are all low."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x).permute(0, 2, 3, 1)))


def small_bert():
    """A 2-layer BERT with a 512-token vocabulary, seeded: for reports and the tolerance search."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=64)
    return BertModel(cfg).eval()


def tiny_bert(layers: int = 2):
    """The ``bert`` fixture's model, seeded; ``layers=1`` where depth is not a test's point."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=128, vocab_size=100, max_position_embeddings=64)
    return BertModel(cfg).eval()


@pytest.fixture
def bert():
    return tiny_bert()


def tiny_gpt2(layers: int = 2):
    """The ``gpt2`` fixture's model, seeded; ``layers=1`` where depth is not a test's point."""
    from transformers import GPT2Config, GPT2Model
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=100, n_positions=64,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2Model(cfg).eval()


@pytest.fixture
def gpt2():
    return tiny_gpt2()


@pytest.fixture
def token_ids():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    return ids, mask


def round_trips(gm) -> list[str]:
    """Casts that undo an earlier cast through dtype-transparent ops only (a defect).

    From each inserted cast A->B, walk forward through unpinned follow ops with a single float
    input; reaching a cast B->A there means the value went down and came back for nothing.
    """
    from mpgraph.ir.meta import OP_CLASS, PRECISION, TENSOR, is_float32_tensor
    found = []
    for c in casts(gm):
        src = c.args[0].meta[PRECISION].dtype
        todo = list(c.users)
        seen = set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in casts(gm):
                if n.args[1] == src:
                    found.append(f"{c.name} ... {n.name}")
                continue
            info, d = n.meta.get(OP_CLASS), n.meta.get(PRECISION)
            float_inputs = [a for a in n.all_input_nodes
                            if a.op != "get_attr" and is_float32_tensor(a.meta.get(TENSOR))
                            or a in casts(gm)]
            if info and info.op_class == "follow" and d is not None and not d.pinned \
                    and len(float_inputs) == 1:
                todo.extend(n.users)
    return found


class Recorder(CudaGraphBackend):
    """A CUDA-graph backend (mpgraph.tools.cuda_graph.CudaGraphBackend) that stands in for CUDA:
    accepts CPU tensors, "captures" by calling the module and "replays" by calling it again and
    writing the result into the captured outputs, as a graph would; ``fail`` makes capture fail
    as torch.cuda.graph does. Counts warm-up runs, captures and replays."""

    def __init__(self, fail: Exception | None = None):
        self.fail, self.warmups, self.captures, self.replays = fail, 0, 0, 0

    def unsupported(self, tensors):
        return None

    def warmup(self, fn, device, iters):
        for _ in range(iters):
            fn()
        self.warmups += iters

    def capture(self, fn, device):
        self.captures += 1
        if self.fail:
            try:
                raise self.fail
            except Exception:  # as torch.cuda.graph's __exit__: capture_end fails in turn
                raise RuntimeError("CUDA error: operation failed due to a previous error during "
                                   "capture")
        out = fn()
        return (fn, out), out

    def replay(self, graph, device):
        self.replays += 1
        fn, out = graph
        for static, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(fn())):
            if isinstance(static, torch.Tensor):
                static.copy_(new)
