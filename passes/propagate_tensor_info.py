"""Record every node's output shape and dtype from one run on the example inputs."""
from __future__ import annotations

import torch

from mpgraph.ir.graph import run_recording
from mpgraph.ir.meta import TENSOR, TensorInfo
from mpgraph.passes.infra import Pass, PassResult


def value_info(value):
    """TensorInfo for a tensor, a tuple of infos for a list/tuple of tensors, else None."""
    if isinstance(value, torch.Tensor):
        return TensorInfo.of(value)
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(value_info(v) for v in value)
    return None


class PropagateTensorInfo(Pass):
    """Analysis: writes ``mpgraph.tensor`` on every node. Runs the graph once, under no_grad."""
    stage = "capture"

    def __init__(self, example_args: tuple, example_kwargs: dict | None = None):
        self.args = tuple(example_args)
        self.kwargs = dict(example_kwargs or {})

    def call(self, gm):
        def record(node, value):
            node.meta[TENSOR] = value_info(value)

        for node in gm.graph.nodes:
            node.meta.pop(TENSOR, None)
        run_recording(gm, self.args, self.kwargs, record)
        for node in gm.graph.nodes:  # the output node is not run by run_node
            node.meta.setdefault(TENSOR, None)
        return PassResult(gm, False)
