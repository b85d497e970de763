"""What dtype a consumer needs each of its inputs in: the one rule both rewrite passes share."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx

from mpgraph.ir.graph import is_inplace
from mpgraph.ir.meta import PRECISION, TENSOR, Decision, is_float32_tensor

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
    if not is_float32_tensor(producer.meta.get(TENSOR)) or isinstance(producer.meta.get(TENSOR), tuple):
        return None
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
