"""Record every node's output shape and dtype from one run on the example inputs.

The same run can also record what calibration measures of one batch (``observe``): capture runs
the graph on the example inputs anyway, and without calibration data the example inputs are the
only calibration batch, so ``Calibrate`` takes that batch from here instead of running it again.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.ir.fake import is_abstract
from mpgraph.ir.graph import flat_inputs, mutated_nodes, run_recording
from mpgraph.ir.meta import LAYOUT, MEMORY_FORMATS, OBSERVED, TENSOR, TensorInfo
from mpgraph.passes.calibrate import Observation, value_stats
from mpgraph.passes.infra import Pass, PassResult


def value_info(value):
    """TensorInfo for a tensor, a tuple of infos for a list/tuple of tensors, else None."""
    if isinstance(value, torch.Tensor):
        return TensorInfo.of(value)
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(value_info(v) for v in value)
    return None


def memory_layout(t: torch.Tensor) -> str:
    """The ``mpgraph.layout`` of a tensor (contiguous where it is both: size-1 dimensions);
    "broadcast": strided with its last dimension expanded (stride 0), as CUDA's attention
    kernels refuse a mask (ContiguousAttentionMask)."""
    names = ["contiguous"] + {4: ["channels_last"], 5: ["channels_last_3d"]}.get(t.dim(), [])
    return next((n for n in names if t.is_contiguous(memory_format=MEMORY_FORMATS[n])),
                "broadcast" if t.dim() and t.stride(-1) == 0 and t.shape[-1] > 1
                else "strided")


def _at_example_sizes(value):
    """``value_info`` of torch.export's fake value of a node, each symbolic size at its example
    value (its hint); TypeError where a size has none (data-dependent)."""
    if isinstance(value, torch.Tensor):
        return TensorInfo(tuple(int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)
                                for d in value.shape), value.dtype)
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_at_example_sizes(v) for v in value)
    return None


def _from_export(gm: torch.fx.GraphModule, inputs: list):
    """For example inputs without values (fakes of a model on the meta device), the shapes and
    dtypes torch.export recorded on every node, written as ``mpgraph.tensor``, and the graph's
    output: running the graph on fakes again computes exactly these, at a cost that grows with
    the graph (2 s of an 80-layer Llama's plan). None, writing nothing, when the inputs have
    values or a node lacks such a record (symbolic_trace, a data-dependent size)."""
    if not any(isinstance(v, torch.Tensor) and is_abstract(v) for v in inputs):
        return None
    infos, layouts, output = {}, {}, None
    for node in gm.graph.nodes:
        if node.op == "output":
            output = pytree.tree_map(
                lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, node.args[0])
            infos[node] = _at_example_sizes(output)
        elif "val" in node.meta:
            try:
                infos[node] = _at_example_sizes(node.meta["val"])
                if isinstance(node.meta["val"], torch.Tensor):
                    layouts[node] = memory_layout(node.meta["val"])
            except (TypeError, RuntimeError):  # (a stride read off a data-dependent size)
                return None
        elif node.op == "call_module" and not node.users:
            infos[node] = None  # export's input guard (_guards_fn): checks, returns nothing
        else:
            return None
    for node, info in infos.items():
        node.meta[TENSOR] = info
    for node, layout in layouts.items():
        node.meta[LAYOUT] = layout
    return output


class PropagateTensorInfo(Pass):
    """Analysis: writes ``mpgraph.tensor`` on every node (``mpgraph.layout`` on a tensor's).
    Runs the graph once, under no_grad, seeded, on fresh copies of the inputs, its buffers put
    back (as every conversion run); on fakes of a model without values, torch.export's records
    stand for that run.

    ``observe``: the run also records every float value's statistics (``tensor_stats``, in
    ``node.meta["mpgraph.observed"]``), and the inputs and outputs (with ``buffers``, the
    buffers after it too: capture's comparison with the eager model) as
    ``gm.meta["mpgraph.observed"]`` (an Observation)."""
    stage = "capture"
    writes = (TENSOR, OBSERVED, LAYOUT)

    def __init__(self, example_args: tuple, example_kwargs: dict | None = None,
                 observe: bool = False, buffers: bool = False):
        self.args = tuple(example_args)
        self.kwargs = dict(example_kwargs or {})
        self.observe = observe
        self.buffers = observe and buffers  # the buffers after the run (capture's comparison)

    def call(self, gm):
        measured: dict = {}
        weights: dict = {}
        mutated = mutated_nodes(gm.graph, gm) if self.observe else frozenset()

        def record(node, value):
            node.meta[TENSOR] = value_info(value)
            if isinstance(value, torch.Tensor):
                node.meta[LAYOUT] = memory_layout(value)
            if self.observe:
                measured[node] = node.meta[OBSERVED] = value_stats(node, value, measured, mutated)
                if node.op == "get_attr" and isinstance(value, torch.Tensor):
                    weights[id(value)] = (value, value._version, measured[node])

        for node in gm.graph.nodes:
            node.meta.pop(TENSOR, None)
            node.meta.pop(LAYOUT, None)
            node.meta.pop(OBSERVED, None)
        gm.meta.pop(OBSERVED, None)
        inputs = flat_inputs(gm, self.args, self.kwargs)
        output, buffers = _from_export(gm, inputs), {}
        if output is None:
            def keep(module):  # the buffers as the run left them
                buffers.update((n, b.clone()) for n, b in module.named_buffers())

            output = run_recording(gm, self.args, self.kwargs, record,
                                   after=keep if self.buffers else None)
        for node in gm.graph.nodes:
            node.meta.setdefault(TENSOR, None)
            if self.observe:
                node.meta.setdefault(OBSERVED, [])  # (no values: fakes of a meta model)
        if self.observe:
            gm.meta[OBSERVED] = Observation(inputs, output, buffers, weights)
        return PassResult(gm, False)
