import operator

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from mpgraph.passes.op_table import (CAST, FOLLOW, FP32_COMPUTE, FP32_ONLY, OP_CLASSES, TENSOR_CORE,
                              UNKNOWN, ATEN_TABLE, FUNCTION_TABLE, METHOD_TABLE, MODULE_TABLE,
                              OpEntry, OpTable)


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
