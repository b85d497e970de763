"""Fuse GPT-2's written-out GELU into one ``gelu(x, approximate="tanh")`` node.

``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` is eight ops, one of them a cube
that overflows fp16 for |x| > 40, so the op rules put the chain in float32 with two casts around
it. PyTorch's and ONNX's tanh-GELU compute the same function in one kernel, in float32 inside
for half inputs, and a GELU is bounded by |x|: one ``follow`` op, no casts, and one kernel instead
of eight in eager mode. Matched structurally on both graph levels (torch functions and operators
from symbolic_trace, ATen ops from torch.export), with the constants checked to 1e-6.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

from mpgraph.ir.meta import INSERTED_BY, OBSERVED, TENSOR
from mpgraph.passes.infra import Pass, PassResult

aten = torch.ops.aten
_MUL = {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar, "mul"}
_ADD = {operator.add, torch.add, aten.add.Tensor, aten.add.Scalar, "add"}
_POW = {operator.pow, torch.pow, aten.pow.Tensor_Scalar, "pow"}
_TANH = {torch.tanh, aten.tanh.default, "tanh", F.tanh}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _is(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") \
        and node.target in targets and not node.kwargs


def _split_const(node) -> Optional[tuple]:
    """(tensor operand, constant) of a binary op with one Python-number operand."""
    if len(node.args) != 2:
        return None
    a, b = node.args
    if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)):
        return a, float(b)
    if isinstance(b, torch.fx.Node) and isinstance(a, (int, float)):
        return b, float(a)
    return None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _only_user(node, user) -> bool:
    return list(node.users) == [user]


def match(tanh: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, list]]:
    """(x, the final mul, the matched nodes) when ``tanh`` sits in a tanh-GELU, else None."""
    if not _is(tanh, _TANH) or len(tanh.args) != 1:
        return None
    scaled = tanh.args[0]
    if not _is(scaled, _MUL) or not _only_user(scaled, tanh):
        return None
    inner = _split_const(scaled)
    if inner is None or not _close(inner[1], _SQRT_2_OVER_PI):
        return None
    add = inner[0]
    if not _is(add, _ADD) or len(add.args) != 2 or not _only_user(add, scaled):
        return None
    for x, cubic in (add.args, add.args[::-1]):
        if not _is(cubic, _MUL) or not _only_user(cubic, add):
            continue
        c = _split_const(cubic)
        if c is None or not _close(c[1], 0.044715):
            continue
        power = c[0]
        if not _is(power, _POW) or not _only_user(power, cubic) or len(power.args) != 2 \
                or power.args[0] is not x or power.args[1] not in (3, 3.0):
            continue
        break
    else:
        return None
    if len(tanh.users) != 1:
        return None
    one_plus = next(iter(tanh.users))
    c = _split_const(one_plus) if _is(one_plus, _ADD) else None
    if c is None or c[0] is not tanh or c[1] != 1.0 or len(one_plus.users) != 1:
        return None
    final = next(iter(one_plus.users))
    if not _is(final, _MUL) or len(final.args) != 2 or one_plus not in final.args:
        return None
    half = final.args[1] if final.args[0] is one_plus else final.args[0]
    h = _split_const(half) if _is(half, _MUL) else None
    if h is None or h[0] is not x or h[1] != 0.5 or not _only_user(half, final):
        return None
    return x, final, [final, one_plus, half, tanh, scaled, add, cubic, power]


class FuseTanhGelu(Pass):
    stage = "prepare"
    rewrites = True
    writes = (INSERTED_BY, TENSOR, OBSERVED)  # the new nodes' facts (values observed at capture)

    def call(self, gm):
        graph = gm.graph
        fused, erased = 0, set()
        for node in list(graph.nodes):
            if node in erased:  # part of a chain an earlier fusion removed
                continue
            found = match(node)
            if found is None:
                continue
            x, final, nodes = found
            aten_level = isinstance(final.target, torch._ops.OpOverload)
            with graph.inserting_before(final):
                if aten_level:
                    gelu = graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
                else:
                    gelu = graph.call_function(F.gelu, (x,), {"approximate": "tanh"})
            # the same function (to float32 rounding): the chain's output shape, dtype and
            # statistics of the example run stand for the fused node's (Calibrate takes them)
            gelu.meta.update({k: v for k, v in final.meta.items()
                              if k in (TENSOR, OBSERVED, "nn_module_stack", "stack_trace", "val")})
            gelu.meta[INSERTED_BY] = self.name
            final.replace_all_uses_with(gelu)
            for dead in nodes:
                graph.erase_node(dead)
            erased.update(nodes)
            fused += 1
        return PassResult(gm, fused > 0)
