"""Run the converted graph once and check every value and every edge has the planned dtype.

Static checks alone would trust the op table; this runs the graph on the example inputs (under
no_grad) and compares what each node really produced with what the plan says, so an op whose
dtype behaviour we misjudged is an error at conversion time, never a silently different model.
"""
from __future__ import annotations

import torch

from mpgraph.ir.edges import required_dtype
from mpgraph.errors import ConversionError
from mpgraph.ir.graph import input_nodes, run_recording
from mpgraph.ir.meta import INSERTED_BY, PRECISION, TENSOR, planned_dtype
from mpgraph.passes.infra import Pass, PassResult


def expected_dtypes(node):
    """The dtype(s) a node must produce: its decision for float32 values, else what was recorded."""
    return planned_dtype(node.meta.get(TENSOR), node.meta.get(PRECISION))


def _actual(value):
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_actual(v) for v in value)
    return None


class CheckDtypes(Pass):
    stage = "check"

    def __init__(self, example_args: tuple, example_kwargs: dict | None = None,
                 keep_io_types: bool = True):
        self.args = tuple(example_args)
        self.kwargs = dict(example_kwargs or {})
        self.keep_io_types = keep_io_types

    def call(self, gm):
        gm.graph.lint()
        for node in gm.graph.nodes:
            if node.meta.get(INSERTED_BY) == "InsertCasts" \
                    and node.args[0].meta.get(INSERTED_BY) == "InsertCasts":
                raise ConversionError(f"cast of a cast (round trip): {node.format_node()}")
        actual = {}
        run_recording(gm, self.args, self.kwargs, lambda n, v: actual.__setitem__(n, _actual(v)))
        problems = []
        for node in gm.graph.nodes:
            if node.op == "output" or node not in actual:
                continue
            want = expected_dtypes(node)
            if want is not None and actual[node] != want:
                problems.append(f"{node.name}: produced {actual[node]}, plan says {want}")
            for arg in input_nodes(node):
                need = required_dtype(node, arg, gm, self.keep_io_types)
                if need is not None and arg in actual and actual[arg] is not None \
                        and actual[arg] != need:
                    problems.append(f"{node.name} reads {arg.name} as {actual[arg]}, needs {need}")
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise ConversionError("the converted graph does not match its plan:\n  " + shown + more)
        return PassResult(gm, False)
