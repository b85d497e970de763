"""Kernel dtype contracts: a plan for a target never feeds a kernel a dtype mix it rejects.

The op table says, for every op that may read and write the low dtype while computing in float32
inside (``OpEntry.low_io``), which target kinds' kernels take a low input with float32
parameters: CPU kernels do; CUDA's layer and group norm read their weight and bias as the input's
type ("expected scalar type Half but found Float"), its batch norm does not. These tests plan for
GPUs on this CPU and read the dtypes the converted graph really gives each such op (a run on fake
tensors), so they need no GPU.
"""
import pytest
import torch
import torch.nn as nn

import mpgraph
from mpgraph.cost.specs import DeviceSpec
from mpgraph.ir.meta import PRECISION
from mpgraph.ir.simulate import fake_dtypes
from mpgraph.passes import AssignPrecision, ClassifyOps
from mpgraph.passes.op_table import (ATEN_TABLE, CPU, FUNCTION_TABLE, GPU, KERNEL_KINDS,
                                     METHOD_TABLE, MODULE_TABLE, ONNX, OpTable, mixed_params_ok)

from conftest import TOL, ConvNextish, rel_err

# the cost strategy keeps these tiny models' convs float32 on a GPU, and says so
pytestmark = pytest.mark.filterwarnings(r"ignore:dtype=\S+ converted 0 of:UserWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LOW = (FP16, BF16)
# A CPU whose low-precision matmuls are 1000x its float32 ones: plans for it keep the Tensor
# Core ops low whatever CPU runs the tests (a measured one may keep everything float32)
FAST_LOW_CPU = DeviceSpec("test CPU, low precision 1000x float32", "cpu",
                          {"fp32": 1e9, "fp16": 1e12, "bf16": 1e12, "vector": 1e9}, 1e9, 1, 0.0)


class GroupNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


class ExportRoute(nn.Module):
    """A shape check symbolic tracing cannot follow (as HuggingFace's): captured by torch.export,
    so the norms are ATen ops and export's batch norm module."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.shape[1] != 8:
            raise ValueError("expected 8 channels")
        return self.inner(x)


def _randomised(model):
    """Norm parameters that are not exact in every dtype (the default init is 1 and 0)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm2d)):
                m.weight.copy_(1 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model


MODELS = {
    "layer norm": lambda: ConvNextish().eval(),
    "group norm": lambda: GroupNormNet().eval(),
    "batch norm eval": lambda: BatchNormNet().eval(),
    "batch norm train": lambda: BatchNormNet().train(),
    "aten layer norm": lambda: ExportRoute(ConvNextish()).eval(),
    "aten group norm": lambda: ExportRoute(GroupNormNet()).eval(),
    "export batch norm train": lambda: ExportRoute(BatchNormNet()).train(),
}


def kernel_inputs(gm, args):
    """(table key, node, input dtype, parameter dtypes, contract) of every op the table marks
    low-I/O, with the dtypes the converted graph really gives them."""
    table = OpTable.default()
    dtypes = fake_dtypes(gm, args, {})
    found = []
    for node in gm.graph.nodes:
        if not node.op.startswith("call_"):
            continue
        key, entry = table.lookup(node, gm)
        if entry is None or not entry.low_io:
            continue
        params = [dtypes[a] for a in node.args[1:] if isinstance(a, torch.fx.Node)]
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            params += [t.dtype for t in list(module.parameters()) + list(module.buffers())
                       if t.is_floating_point()]
        found.append((key, node, dtypes[node.args[0]], params, entry.low_io))
    return found


def test_the_contract_table():
    """Every low-I/O entry states its kernels' contract; only batch norm's GPU kernel mixes."""
    entries = [(k, e) for table in (MODULE_TABLE, FUNCTION_TABLE, METHOD_TABLE, ATEN_TABLE)
               for k, e in table.items() if e.low_io]
    assert len(entries) >= 12
    for key, entry in entries:
        name = str(getattr(key, "__name__", key)).lower()
        assert set(entry.low_io) <= set(KERNEL_KINDS), key
        assert mixed_params_ok(entry.low_io, CPU), key
        assert mixed_params_ok(entry.low_io, GPU) == ("batch" in name), key
        assert mixed_params_ok(entry.low_io, ONNX) == ("batch" in name), key
        assert not mixed_params_ok(entry.low_io, None) or "batch" in name  # None: every target
    assert mixed_params_ok(True, GPU)  # an older user entry's low_io=True: every target


@pytest.mark.parametrize("low", LOW)
@pytest.mark.parametrize("target", ["h100", "a100"])
def test_no_gpu_plan_feeds_a_kernel_a_dtype_mix_it_rejects(target, low):
    seen = set()
    for name, build in MODELS.items():
        model, x = _randomised(build()), torch.randn(2, 8, 6, 6)
        for strategy in ("rules", "optimal"):
            # (dynamic=False: called at the example's shape only; the kernels' dtypes are the point)
            gm = mpgraph.convert(model, x, dtype=low, target=target, strategy=strategy,
                                 dynamic=False)
            ops = kernel_inputs(gm, (x,))
            assert ops, name
            for key, node, x_dtype, params, contract in ops:
                mixed = x_dtype in LOW and any(p != x_dtype for p in params)
                assert not mixed or mixed_params_ok(contract, GPU), \
                    f"{name} ({strategy}): {key} {node.name} reads {x_dtype} with {params}"
                if x_dtype == low and strategy == "rules":
                    seen.add((key, mixed))
            with torch.no_grad():
                assert rel_err(gm(x), model(x)) < TOL[low], name
    # the low-I/O norms did run low: layer/group norm with low parameters, training batch norm
    # with float32 ones (CUDA and cuDNN take that mix)
    assert {("nn.LayerNorm", False), ("nn.GroupNorm", False), ("aten.layer_norm", False),
            ("aten.group_norm", False), ("nn.BatchNorm2d", True),
            ("mpgraph.ir.modules.TrainingBatchNorm", True)} <= seen


@pytest.mark.parametrize("kernels, params", [("cpu", FP32), ("gpu", BF16), ("onnx", BF16),
                                             (None, BF16)])
def test_the_rules_take_the_contract_of_the_kernels_they_plan_for(kernels, params):
    gm = mpgraph.capture(ConvNextish().eval(), torch.randn(2, 8, 6, 6))
    ClassifyOps(BF16)(gm)
    AssignPrecision(BF16, kernels=kernels)(gm)
    norm = next(n for n in gm.graph.nodes if n.name == "norm").meta[PRECISION]
    assert norm.dtype == BF16 and norm.param_dtype == params
    assert f"with {'float32' if params == FP32 else 'bfloat16'} parameters" in norm.reason


def test_a_cpu_plan_keeps_float32_norm_parameters_with_the_values_of_casting_around_it():
    model, x = _randomised(ConvNextish().eval()), torch.randn(2, 8, 6, 6)
    gm = mpgraph.convert(model, x, dtype=BF16, target=FAST_LOW_CPU)
    rec = gm.plan.node("norm")
    assert rec.dtype == "bfloat16" and "with float32 parameters" in rec.reason
    assert gm.norm.weight.dtype == FP32 and gm.conv.weight.dtype == BF16
    assert [c.value for c in gm.plan.casts] == ["x", "fc"]
    pinned = mpgraph.convert(model, x, dtype=BF16, target=FAST_LOW_CPU, overrides={"norm": "fp32"})
    assert len(pinned.plan.casts) == 4  # up before the norm, down after it
    with torch.no_grad():
        assert torch.equal(gm(x), pinned(x))  # PyTorch's mixed-dtype CPU layer norm


def _small_convnext():
    from transformers import ConvNextConfig, ConvNextModel
    torch.manual_seed(0)
    config = ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=64)
    return _randomised(ConvNextModel(config).eval()), torch.randn(2, 3, 64, 64)


def test_convnext_planned_for_h100_gives_its_layer_norms_one_dtype():
    """Issue 17: CUDA's layer_norm rejected the plan's fp16 input with float32 weight."""
    model, x = _small_convnext()
    gm = mpgraph.convert(model, x, dtype=FP16, target="h100", dynamic=False)
    ops = kernel_inputs(gm, (x,))
    low = [(node.name, params) for key, node, x_dtype, params, _ in ops if x_dtype == FP16]
    assert len(low) >= 4 and all(p == [FP16, FP16] for _, p in low), low
    assert len(gm.plan.casts) == 2
    with torch.no_grad():
        assert rel_err(gm(x).last_hidden_state, model(x).last_hidden_state) < TOL[FP16]
