"""In-place ops on intermediate values become their out-of-place twins.

``h = l1(x); torch.relu_(h); l2(h)`` computes relu into ``h``'s own storage. Once precisions are
decided per value, an in-place op is a trap: cast its input and it writes into the throwaway
copy (``l2`` then reads ``h`` before the relu), or keep it in the dtype it writes into and a
float32-only constant (``h.masked_fill_(m, -1e9)`` in fp16) overflows. So, as torch.export's
functionalization does, ``relu_(h)`` becomes ``h1 = relu(h)`` and every later reader of ``h`` (and
of the in-place op's result, which is ``h``) reads ``h1``; chains (``masked_fill_`` then ``relu_``)
follow in graph order. The dtype rules then treat it like any op.

Only where nothing else can see the write: the value is produced by an op (not a graph input,
parameter or buffer, whose mutation the caller or the next call must see), may not be another
tensor's storage (a view; ``h.float()`` of a float32 ``h``; ``nn.Identity``), has no such alias
of it taken before the write, is not the output of an in-place op or module, and the twin
computes in the dtype the op writes into (``h.mul_(float64 s)`` stays float32). Those in-place
ops stay, and compute in the dtype of the value they write into (the AssignPrecision rule).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx

from mpgraph.ir.graph import CALLS, is_inplace, may_alias
from mpgraph.ir.meta import INSERTED_BY, LAYOUT, OBSERVED, TENSOR, TensorInfo
from mpgraph.passes.infra import Pass, PassResult

_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub,
              operator.imul: operator.mul, operator.itruediv: operator.truediv}
_NAMESPACES = (torch, torch.nn.functional, torch.Tensor)


def out_of_place(node: torch.fx.Node) -> Optional[tuple[object, dict]]:
    """(target, kwargs) of the out-of-place twin of an in-place call node, or None."""
    target, kwargs = node.target, dict(node.kwargs)
    if node.op == "call_method":
        twin = target[:-1]  # (requires_grad_'s "twin" is a property, not a method)
        return (twin, kwargs) if callable(getattr(torch.Tensor, twin, None)) else None
    if node.op != "call_function":
        return None
    if target in _OPERATORS:
        return _OPERATORS[target], kwargs
    if kwargs.get("inplace") is True:  # F.relu(x, inplace=True)
        return target, {**kwargs, "inplace": False}
    if isinstance(target, torch._ops.OpOverload):  # aten.relu_.default -> aten.relu.default
        packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1][:-1], None)
        twin = getattr(packet, target._overloadname, None) if packet is not None else None
        if twin is None or any(a.alias_info is not None for a in twin._schema.arguments):
            return None
        return twin, kwargs
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.startswith("_"):  # torch.relu_, F.relu_
        for space in _NAMESPACES:
            if getattr(space, name, None) is target and callable(getattr(space, name[:-1], None)):
                return getattr(space, name[:-1]), kwargs
    return None


def _private_value(value: torch.fx.Node, gm: torch.fx.GraphModule, write: torch.fx.Node,
                   order: dict) -> bool:
    """A fresh tensor only this graph sees when ``write`` writes into it: produced by an op, not
    aliasing another value, and with no view of it taken before the write (a view taken after
    it is rewired to the new value like any reader)."""
    if value.op not in CALLS:
        return False  # a graph input, parameter or buffer: its mutation is part of the contract
    if may_alias(value, gm) or is_inplace(value, gm):
        return False
    return not any(may_alias(user, gm) and order.get(user, 0) < order[write]
                   for user in value.users)


def _keeps_dtype(node: torch.fx.Node) -> bool:
    """Whether the out-of-place twin computes in the dtype the in-place op writes into:
    ``h.mul_(s)`` with a float64 ``s`` leaves a float32 ``h`` float32, ``h.mul(s)`` is float64."""
    info = node.args[0].meta.get(TENSOR)
    if not isinstance(info, TensorInfo):
        return True
    into = torch.empty(info.shape, dtype=info.dtype, device="meta")
    for arg in node.args[1:]:
        other = arg.meta.get(TENSOR) if isinstance(arg, torch.fx.Node) else None
        if isinstance(other, TensorInfo) and torch.result_type(
                into, torch.empty(other.shape, dtype=other.dtype, device="meta")) != info.dtype:
            return False
    return True


class Functionalize(Pass):
    """Rewrite: in-place ops on private intermediate values -> out-of-place ops, readers rewired."""

    stage = "prepare"
    rewrites = True
    writes = (INSERTED_BY, TENSOR, OBSERVED, LAYOUT)  # the new nodes' facts (as captured)

    def call(self, gm):
        graph, changed = gm.graph, 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            if node.op not in ("call_function", "call_method") or not node.args \
                    or not isinstance(node.args[0], torch.fx.Node) or not is_inplace(node, gm):
                continue
            value = node.args[0]
            twin = out_of_place(node)
            if twin is None or not _private_value(value, gm, node, order) \
                    or not _keeps_dtype(node):
                continue
            target, kwargs = twin
            with graph.inserting_after(node):
                new = graph.create_node(node.op, target, node.args, kwargs,
                                        name=node.name.rstrip("_") or node.name)
            new.meta.update(node.meta)
            new.meta[INSERTED_BY] = self.name
            node.replace_all_uses_with(new)
            here = order[node]
            for user in list(value.users):
                if user is not new and user is not node and order.get(user, -1) > here:
                    user.replace_input_with(value, new)
            order[new] = here  # readers after the rewrite compare against the op's position
            graph.erase_node(node)
            changed += 1
        return PassResult(gm, changed > 0)
