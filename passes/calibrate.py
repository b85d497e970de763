"""Record the range of every float value over calibration batches.

The float32 graph runs node by node (a torch.fx Interpreter) on each batch; for every floating
value we keep its finite absolute max (per batch, so findings can say "on 3/8 batches"), its
smallest non-zero magnitude and its count of inf/NaN elements. The safety rules read these: a
range seen in float32 is the range the low-precision graph has to hold. Without calibration data
``convert`` passes the example inputs, so every plan has ranges from at least one real run.
"""
from __future__ import annotations

import logging
import math
import sys
from typing import Iterable, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.errors import CalibrationError
from mpgraph.ir.graph import as_call, flat_inputs, float_tensors, run_recording
from mpgraph.ir.meta import RANGE, REFERENCE, Reference, ValueRange
from mpgraph.passes.infra import Pass, PassResult
from mpgraph.frontend.fake import is_abstract

log = logging.getLogger(__name__)
_PROGRESS_MIN_BATCHES = 8  # show a progress bar (on a terminal) from this many batches up


def tensor_stats(t: torch.Tensor) -> tuple[float, float, int]:
    """(finite absmax, smallest non-zero finite magnitude, count of inf/NaN) of one tensor.

    Two reductions in the common, all-finite case (max, then min over the non-zeros); the
    inf/NaN masks only when the max says there are some. float16/bfloat16 values are exact in
    float32, which the reductions run in."""
    if t.numel() == 0:
        return 0.0, math.inf, 0
    flat = t.detach().reshape(-1)
    if flat.numel() > _CHUNK:  # weights of GBs: chunks keep the temporaries small and reused
        parts = [tensor_stats(c) for c in flat.split(_CHUNK)]
        return max(p[0] for p in parts), min(p[1] for p in parts), sum(p[2] for p in parts)
    a = flat.abs()
    if a.dtype not in (torch.float32, torch.float64):
        a = a.float()
    nonfinite = 0
    top = a.max()
    if not torch.isfinite(top):  # inf or NaN somewhere (NaN propagates through max)
        finite = torch.isfinite(a)
        nonfinite = int(a.numel() - int(finite.sum()))
        a = a.masked_fill(~finite, 0)
        top = a.max()
    small = torch.where(a > 0, a, math.inf).min()
    return float(top), float(small), nonfinite


_CHUNK = 1 << 22  # values per chunk of tensor_stats: 16 MB of float32


def _progress(batches, show: Optional[bool]):
    total = len(batches) if hasattr(batches, "__len__") else None
    if show is None:
        show = total is not None and total >= _PROGRESS_MIN_BATCHES and sys.stderr.isatty()
    if not show:
        return batches
    try:
        from tqdm.auto import tqdm
    except ImportError:  # no tqdm: progress through logging instead
        return _logged(batches, total)
    return tqdm(batches, total=total, desc="mpgraph calibration", unit="batch")


def _logged(batches, total):
    for i, b in enumerate(batches):
        log.info("calibration batch %d%s", i + 1, f"/{total}" if total else "")
        yield b


class Calibrate(Pass):
    """Analysis: writes ``mpgraph.range`` (a ValueRange) on every node with a float output."""
    stage = "calibrate"

    def __init__(self, batches: Iterable, progress: Optional[bool] = None,
                 example: Optional[tuple[tuple, dict]] = None):
        if isinstance(batches, (torch.Tensor, dict)):
            raise CalibrationError("calibration must be an iterable of batches (e.g. a list of "
                                   "input tensors or tuples), not one batch")
        self.batches = batches
        self.progress = progress
        self.example = example  # (args, kwargs) of capture, to explain a batch that does not fit

    def _check_fits(self, gm, i: int, args: tuple, kwargs: dict) -> None:
        try:
            got = flat_inputs(gm, args, kwargs)
        except (TypeError, ValueError) as e:
            raise CalibrationError(f"calibration batch {i} does not match the model's "
                                   f"arguments: {e}") from None
        if self.example is None:
            return
        want = flat_inputs(gm, *self.example)
        for j, (g, w) in enumerate(zip(got, want)):
            if isinstance(w, torch.Tensor) and not isinstance(g, torch.Tensor):
                raise CalibrationError(f"calibration batch {i}, input {j}: expected a tensor like "
                                       f"the example input, got {type(g).__name__}")
            if isinstance(w, torch.Tensor) and (g.dim() != w.dim() or g.dtype != w.dtype):
                raise CalibrationError(
                    f"calibration batch {i}, input {j}: shape {tuple(g.shape)} {g.dtype} does not "
                    f"fit the example input's {tuple(w.shape)} {w.dtype} (same rank and dtype needed)")

    def call(self, gm):
        per_batch: dict[torch.fx.Node, list[float]] = {}
        smallest: dict[torch.fx.Node, float] = {}
        bad: dict[torch.fx.Node, int] = {}
        count = 0
        for i, batch in enumerate(_progress(self.batches, self.progress)):
            args, kwargs = as_call(batch)
            self._check_fits(gm, i, args, kwargs)
            seen: dict[torch.fx.Node, float] = {}
            last = ["(graph inputs)"]

            def record(node, value):
                last[0] = node.name
                tensors = [t for t in float_tensors(value) if not is_abstract(t)]
                if not tensors or (count and node.op == "get_attr" and node in per_batch):
                    return
                stats = [tensor_stats(t) for t in tensors]
                seen[node] = max(s[0] for s in stats)
                smallest[node] = min([smallest.get(node, math.inf)] + [s[1] for s in stats])
                bad[node] = bad.get(node, 0) + sum(s[2] for s in stats)

            try:
                output = run_recording(gm, args, kwargs, record)
            except Exception as e:  # noqa: BLE001 - re-raised with the batch and node named
                raise CalibrationError(f"calibration batch {i} failed after node {last[0]}: "
                                       f"{type(e).__name__}: {str(e).splitlines()[0]}") from e
            for node, m in seen.items():
                per_batch.setdefault(node, []).append(m)
            if count == 0:  # what the converted graph is checked against (CheckDtypes)
                gm.meta[REFERENCE] = Reference(args, kwargs, tuple(
                    v.detach() if isinstance(v, torch.Tensor) else v
                    for v in pytree.tree_leaves(output)))
            count += 1
        if count == 0:
            raise CalibrationError("calibration is empty: pass at least one batch of inputs")
        for node in gm.graph.nodes:
            node.meta.pop(RANGE, None)
            if node in per_batch:
                node.meta[RANGE] = ValueRange(max(per_batch[node]), smallest[node], bad[node],
                                              tuple(per_batch[node]))
        gm.meta[RANGE] = count
        log.debug("calibrated %d values over %d batches", len(per_batch), count)
        return PassResult(gm, False)
