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
