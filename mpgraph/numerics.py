"""The one error metric mpgraph reports, checks and searches with, and dtype facts beside it.

What a user computes to judge a conversion is the plain relative L2 error of each output,
``||y - y_hat|| / ||y||`` over the whole output tensor, against the float32 model on the same
inputs. The check (``plan.check``), ``tolerance=``, ONNX validation, reports, tests and benchmarks
all use ``relative_l2`` and take the worst output (``worst_error``): no output is averaged away by
a larger one, and no output is measured against anything but itself. Positions where float32
itself is inf/NaN are left out (there is nothing to compare); a non-finite value where float32
is finite makes the error inf.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree


def relative_l2(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64 over the whole tensor (torch tensors or numpy
    arrays); inf where ``out`` is inf/NaN and ``ref`` is finite, or where ``ref`` is all zeros
    and ``out`` is not."""
    out, ref = _tensor(out), _tensor(ref)
    if out.shape != ref.shape:
        raise ValueError(f"output of shape {tuple(out.shape)} compared with float32's "
                         f"{tuple(ref.shape)}")
    keep = torch.isfinite(ref)
    if not bool(keep.all()):
        out, ref = out[keep], ref[keep]
    if not bool(torch.isfinite(out).all()):
        return math.inf
    num, den = float((out - ref).norm()), float(ref.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _tensor(value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    # (a complex output keeps its imaginary part: complex128)
    return value.detach().to("cpu", torch.complex128 if value.is_complex() else torch.float64)


def leaves(value: Any) -> list:
    """The leaves of an output structure: tensors, tuples, lists, dicts, HuggingFace
    ModelOutputs and dataclasses (field by field), in order."""
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    out = []
    for leaf in pytree.tree_leaves(value):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        else:
            out.append(leaf)
    return out


def float_leaves(value: Any) -> list[torch.Tensor]:
    """The floating-point and complex tensors of an output structure (``leaves``), in order."""
    return [t for t in leaves(value) if isinstance(t, torch.Tensor)
            and (t.is_floating_point() or t.is_complex())]


def output_errors(outputs: Any, references: Any) -> list[float]:
    """``relative_l2`` of each float output against float32's, in output order (a Python
    float among them too: ``loss.item()``)."""
    def floats(value):
        return [torch.tensor(t, dtype=torch.float64) if type(t) is float else t
                for t in leaves(value) if _is_float(t)]
    got, want = floats(outputs), floats(references)
    if len(got) != len(want):
        raise ValueError(f"the converted model returns {len(got)} float outputs, float32 "
                         f"returned {len(want)}")
    return [relative_l2(g, w) for g, w in zip(got, want)]


def float_leaf_positions(outputs: Any) -> list[int]:
    """The place among the outputs' leaves (``leaves``) of each error ``output_errors`` gives:
    the summary and ``discrete_mismatches`` number outputs by that place."""
    return [i for i, t in enumerate(leaves(outputs)) if _is_float(t)]


def _is_float(leaf) -> bool:
    """An output leaf an error is measured on: a float or complex tensor (``torch.polar``'s
    oscillator: its error was never measured, "checked: error 0" on one off by 0.22), or a
    Python float."""
    return type(leaf) is float or (isinstance(leaf, torch.Tensor)
                                   and (leaf.is_floating_point() or leaf.is_complex()))


def discrete_mismatches(outputs: Any, references: Any) -> dict[str, float]:
    """Of each integer or bool output (an argmax, a mask, quantised codes, a count's
    ``.item()``), the fraction of its values that differ from float32's, by its place among the
    outputs' leaves (``leaves``), where any differ: rounding moves a value across a threshold or
    a rounding boundary, which no relative error says."""
    differ = {}
    for i, (g, w) in enumerate(zip(leaves(outputs), leaves(references))):
        if type(g) in (int, bool) and type(w) is type(g):  # ``n.item()``: one value
            if g != w:
                differ[str(i)] = 1.0
            continue
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and g.shape == w.shape \
                and g.numel() and not (g.is_floating_point() or g.is_complex()):
            fraction = float((g.detach().cpu() != w.detach().cpu()).float().mean())
            if fraction:
                differ[str(i)] = fraction
    return differ


def worst_error(runs: Sequence[tuple[Any, Any]]) -> float:
    """The largest ``relative_l2`` over every output of every (outputs, references) pair: the
    error a user sees on the worst output of the worst batch."""
    return max((e for out, ref in runs for e in output_errors(out, ref)), default=0.0)


def rounding(dtype: torch.dtype) -> float:
    """Relative rounding error of one value stored in ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2
