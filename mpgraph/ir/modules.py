"""Small modules that rewritten graphs call, so that ``.train()``/``.eval()`` keep their meaning.

torch.export bakes the training flag into the graph (``aten.dropout(x, p, True)``,
``aten.batch_norm(..., training=True, ...)``, ``num_batches_tracked.add_(1)``); these modules read
``self.training`` at run time instead, as nn.Dropout and nn.BatchNorm do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TrainingBatchNorm(torch.nn.Module):
    """``F.batch_norm`` with the statistics of the batch in training, the running ones in eval;
    the running statistics (arguments 3 and 4) are updated in place in training."""

    def __init__(self, momentum: float, eps: float):
        super().__init__()
        self.momentum, self.eps = momentum, eps

    def forward(self, x, weight, bias, running_mean, running_var):
        return F.batch_norm(x, running_mean, running_var, weight, bias, self.training,
                            self.momentum, self.eps)

    @property
    def mutates_args(self) -> tuple:
        """For mpgraph.ir.graph.mutated_nodes: the running statistics, written in training only."""
        return (3, 4) if self.training else ()



class CountBatches(torch.nn.Module):
    """``num_batches_tracked += 1`` in training only, as nn.BatchNorm does."""

    @property
    def mutates_args(self) -> tuple:
        return (0,) if self.training else ()

    def forward(self, counter):
        if self.training:
            counter.add_(1)
        return counter


class DropoutRate(torch.nn.Module):
    """The dropout probability of a fused op (attention's ``dropout_p``): ``p`` in training,
    0 in eval, as nn.MultiheadAttention passes it."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self) -> float:
        return self.p if self.training else 0.0


class ConvertedModule(torch.fx.GraphModule):
    """The class of what capture and convert return: a GraphModule whose parameters carry the
    plan's dtypes (low ones for low nodes, float32 for the rest, read through the graph's
    casts), so a module-wide dtype change (``.half()``, ``.to(torch.float16)``) is refused with
    what to do instead; moving it to a device (``.to("cuda")``) is what ``to`` is for."""

    @classmethod
    def wrap(cls, gm: torch.fx.GraphModule) -> "ConvertedModule":
        """``gm`` as a ConvertedModule: same graph, attributes, pytree specs and meta."""
        new = cls(gm, gm.graph, class_name=type(gm).__name__)
        for key in ("_in_spec", "_out_spec"):
            if hasattr(gm, key):
                setattr(new, key, getattr(gm, key))
        new.meta = gm.meta
        return new

    def _refuse(self, call: str):
        plan = getattr(self, "plan", None)
        planned = str(plan.dtype).replace("torch.", "") if plan is not None else "its low dtype"
        return TypeError(f"{call} on a converted module would change the dtypes its plan gave "
                         f"each parameter ({planned} where nodes compute in {planned}, float32 "
                         "elsewhere) under the graph's casts. Convert the model again with the "
                         "dtype you want: mpgraph.convert(model, ..., dtype=...); .to(device) "
                         "moves it")

    def half(self):
        raise self._refuse(".half()")

    def float(self):
        raise self._refuse(".float()")

    def bfloat16(self):
        raise self._refuse(".bfloat16()")

    def double(self):
        raise self._refuse(".double()")

    def type(self, dst_type):
        raise self._refuse(f".type({dst_type})")

    def to(self, *args, **kwargs):
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            raise self._refuse(f".to({dtype})")
        return super().to(*args, **kwargs)
