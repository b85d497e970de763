"""An opt-in run-time guard: an inf/NaN output that float32 would not give is an error naming the
first node where it appeared.

A plan keeps float32 what calibration saw overflow the low dtype; data larger than any
calibration batch can still overflow fp16 at run time, and the outputs are then inf/NaN with no
word of where. ``guard(module)`` checks every call's outputs (one ``isfinite`` per output: cheap);
when one is not finite it runs the graph again node by node, as converted and in float32 (the
same graph, every value kept float32: ``mpgraph.ir.simulate`` without rounding), and raises
``NonFiniteError`` naming the first node whose value is inf/NaN where float32's is finite, with
what calibration saw there and the way out. Outputs that float32 gives as inf/NaN too (NaN in
the inputs) are returned as they are.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.errors import MpgraphError
from mpgraph.ir.graph import run_recording, target_name
from mpgraph.ir.meta import PRECISION, dtype_name, is_inserted_cast
from mpgraph.ir.modules import compiler_disable
from mpgraph.ir.simulate import run_simulated
from mpgraph.numerics import float_leaves


class NonFiniteError(MpgraphError, FloatingPointError):
    """A guarded module's output went inf/NaN where float32's would not (``mpgraph.guard``)."""

    def __init__(self, message: str, node: Optional[str] = None):
        self.node = node
        super().__init__(message)


def guard(module: torch.fx.GraphModule, enabled: bool = True) -> torch.fx.GraphModule:
    """Turn the run-time guard on (or off, ``enabled=False``) for a converted module; returns it."""
    if not isinstance(module, torch.fx.GraphModule) or getattr(module, "plan", None) is None:
        raise TypeError(f"guard expects a module mpgraph.convert returned, got {type(module).__name__}")
    # found by its function, not by a handle: a deep copy runs the hooks of its original (the
    # guard included), in dicts of its own, where turning it off leaves the original's on
    for key in [k for k, hook in module._forward_hooks.items() if hook is _check]:
        for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs,
                      module._forward_hooks_always_called):
            hooks.pop(key, None)
    if enabled:
        module.register_forward_hook(_check, with_kwargs=True)
    return module


@compiler_disable((
    "mpgraph.guard: the guard checks a converted module's outputs for inf/NaN (and then runs "
    "it node by node) outside the compiled graph, after it (a graph break): compile without "
    "fullgraph=True, or turn the guard off first (mpgraph.guard(module, enabled=False))"))
def _check(module, args, kwargs, output):
    # (a branch on the outputs' values: dynamo cannot keep it in a graph, fullgraph=True failed
    # inside it with torch's "data-dependent expression" error)
    if all(bool(torch.isfinite(t).all()) for t in float_leaves(output)):
        return None
    culprit = first_nonfinite(module, args, kwargs)
    if culprit is not None:
        raise NonFiniteError(culprit[1], culprit[0])
    return None  # float32 gives inf/NaN as well: the model's own answer


def _count(value) -> tuple[int, int]:
    leaves = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
              and t.is_floating_point()]
    return (sum(int((~torch.isfinite(t)).sum()) for t in leaves), sum(t.numel() for t in leaves))


def first_nonfinite(module: torch.fx.GraphModule, args: tuple, kwargs: dict):
    """(node name, message) of the first node whose output is inf/NaN where float32's is finite
    on these inputs, or None when there is none."""
    bad: dict = {}

    def converted(node, value):
        if node not in bad:
            bad[node] = _count(value)

    reference: dict = {}

    def float32(node, value):
        reference[node] = _count(value)

    got_out = run_recording(module, args, kwargs, converted)
    want_out = run_simulated(module, args, kwargs, float32, rounding=False)
    # inf/NaN only where float32's output has them too (an input of 1e37, one corrupt sample
    # in a batch): the model's own answer, returned as it is (a cast that overflowed first on
    # the way was blamed, and the batch lost)
    if all(bool((torch.isfinite(g) | ~torch.isfinite(w.to(g.device))).all())
           for g, w in zip(float_leaves(got_out), float_leaves(want_out)) if g.shape == w.shape):
        return None
    for node in module.graph.nodes:
        (got, numel), (want, _) = bad.get(node, (0, 0)), reference.get(node, (0, 0))
        if node.op == "output" or got <= want:
            continue
        return node.name, _message(module, node, got, numel)
    return None


def _message(module, node: torch.fx.Node, got: int, numel: int) -> str:
    plan = module.plan
    records = {r.name: r for r in plan.nodes}
    record = records.get(node.name)
    if record is None and is_inserted_cast(node) and isinstance(node.args[0], torch.fx.Node):
        # the value was too large for the cast: what calibration saw is the cast value's, and
        # the way out is to keep its readers in float32 (a cast is not a node of the plan)
        source = node.args[0]
        readers = [u.name for u in node.users if u.name in records]
        dtype = dtype_name(node.meta[PRECISION].dtype) if PRECISION in node.meta \
            else "the low dtype"
        how = f"mpgraph's cast of {source.name} to {dtype} for {', '.join(readers) or 'its readers'}"
        record, keep = records.get(source.name), readers or [node.name]
    else:
        how = f"computed in {record.dtype}: {record.reason}" if record else "a cast mpgraph inserted"
        keep = [node.name]
    seen = (f"calibration saw absmax {record.absmax:.3g} "
            f"{'there' if record.name == node.name else 'at ' + record.name} on "
            f"{plan.calibration_batches} batch{'es' if plan.calibration_batches != 1 else ''}"
            if record is not None and record.absmax is not None and math.isfinite(record.absmax)
            else "calibration measured no range there")
    where = f", module {record.module}" if record is not None and record.module else ""
    overrides = ", ".join(f"'{name}': 'fp32'" for name in keep)
    return (f"output is inf/NaN where float32 is finite: the first node that went non-finite is "
            f"{node.name} ({target_name(node)}{where}), {got} of {numel} values, {how}; {seen}. "
            "These inputs are larger than the calibration data: convert with calibration=[real "
            f"batches, the largest you expect], keep {'it' if len(keep) == 1 else 'them'} in "
            f"float32 (overrides={{{overrides}}}), or use bfloat16 (float32's range)")
