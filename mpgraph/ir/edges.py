"""What dtype a consumer needs each of its inputs in: the one rule both rewrite passes share."""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.ir.graph import is_inplace
from mpgraph.ir.meta import PRECISION, TENSOR, Decision, TensorInfo, is_float32_tensor

DecisionOf = Callable[[torch.fx.Node], Optional[Decision]]


def _from_meta(node: torch.fx.Node) -> Optional[Decision]:
    return node.meta.get(PRECISION)


def required_dtype(consumer: torch.fx.Node, producer: torch.fx.Node, root: torch.nn.Module,
                   keep_io_types: bool = True,
                   decision_of: DecisionOf = _from_meta) -> Optional[torch.dtype]:
    """The dtype ``consumer`` must read ``producer``'s value in, or None to take it as it is.

    Only values that were float32 in the captured model are ever converted; everything else
    (integers, bools, float64, tensors already in low precision) is read unchanged.
    """
    info = producer.meta.get(TENSOR)
    if not is_float32_tensor(info):
        return None
    if isinstance(info, tuple) and consumer.op == "call_function" \
            and consumer.target is operator.getitem:
        return None  # an item of a multi-output value: in the dtype it was produced in
    if consumer.op == "output":
        return torch.float32 if keep_io_types else None
    decision = decision_of(consumer)
    if decision is None or decision.dtype is None or decision.reads_any:
        return None
    if consumer.args and consumer.args[0] is producer and is_inplace(consumer, root):
        return None  # an in-place op writes into this very value: it cannot read a copy
    if decision.promotes:
        produced = decision_of(producer)
        if produced is not None and produced.dtype in (torch.float16, torch.bfloat16):
            return None  # promoted to float32 inside the kernel
    if decision.param_dtype is not None:
        produced = decision_of(producer)
        if produced is not None and (produced.stored or producer.op == "get_attr"):
            return decision.param_dtype  # a norm's scale and shift, read in float32
    return decision.dtype


def cast_leaves(value, dtype: torch.dtype, have: torch.dtype):
    """A multi-output value (an LSTM's ``(h, c)``, ``topk``'s values and indices, a list from
    ``chunk``) with its ``have`` tensors cast to ``dtype``, in the container it came in: what
    InsertCasts puts where such a value is read whole (returned, or passed on as a tuple), for
    any number of items (a ``split`` gives as many as the size asks)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.dtype == have else t, value)


def cast_info(info, dtype: torch.dtype):
    """The tensor facts of a value after ``cast_leaves``: its float32 items in ``dtype``."""
    if isinstance(info, tuple):
        return tuple(cast_info(i, dtype) for i in info)
    if isinstance(info, TensorInfo) and info.dtype == torch.float32:
        return TensorInfo(info.shape, dtype)
    return info
