"""One cost-model interface: seconds a node takes in float32 and in a low dtype, and a cast.

Two implementations stand behind it: ``mpgraph.cost.measured.Measured``, the times of this
machine's own kernels (each distinct op, shape and dtype of the graph timed once, cached on
disk), and ``mpgraph.cost.roofline.Roofline``, FLOPs and bytes against a device's peaks for a
device we are not on (a GPU planned from a CPU), floored by the host time each node costs in
eager mode and scaled by a calibration file where a GPU run wrote one. The placement pass asks
the model for node and cast costs and does not care which; every plan says where its numbers
came from (``source``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from mpgraph.ir.meta import Kind


@dataclass(frozen=True)
class NodeCost:
    """What a node costs: its FLOPs, bytes moved and seconds in float32 and in the low dtype."""

    flops: float
    bytes_fp32: float
    bytes_low: float
    t_fp32: float
    t_low: float


class CostModel:
    """Base of the cost models. ``kind`` is the device kind (Kind.CPU, Kind.GPU), ``name`` the device,
    ``source`` where the numbers come from ("measured on this CPU ...", "roofline for ...")."""

    kind: Kind = Kind.CPU
    name: str = ""
    source: str = ""

    def node_cost(self, node: torch.fx.Node, gm: torch.fx.GraphModule,
                  low: torch.dtype) -> NodeCost:
        """Seconds ``node`` takes in float32 and in ``low`` (with what it reads in that dtype)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement node_cost(node, gm, "
                                  "low): a CostModel subclass returns each node's NodeCost "
                                  "(mpgraph.cost.model)")

    def cast_cost(self, node: torch.fx.Node, low: torch.dtype) -> tuple[float, float]:
        """Seconds to cast ``node``'s float32 value to ``low`` and a ``low`` copy back."""
        raise NotImplementedError(f"{type(self).__name__} does not implement cast_cost(node, "
                                  "low): a CostModel subclass returns the seconds of a cast "
                                  "down and back (mpgraph.cost.model)")

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether the device has the dtype at all (a T4 has no bfloat16 Tensor Cores)."""
        return True
