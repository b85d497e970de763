"""Kernels a pass may lower an op to: plain torch functions that one graph node calls (one call's
host time), each used only where this machine's measured costs timed it faster than the op.

Their size arguments are ints the pass computes from the graph's shapes, so the body has no
branch on a tensor's size: it traces under torch.fx, torch.export and torch.compile as written.
"""
from __future__ import annotations

import torch

SPLIT_PARTS = (4, 8, 16)  # the row blocks split_mv is timed with (2 never won; 4-16 each did)
SPLIT_MIN_BLOCK = 64      # rows a block has at least


def mv_splits(rows: int) -> dict[str, tuple[int, int, bool]]:
    """The ways ``split_mv`` can run a GEMV over ``rows`` weight rows: a name ("split/8") to
    ``split_mv``'s (parts, block, rest)."""
    return {f"split/{p}": (p, rows // p, rows % p != 0) for p in SPLIT_PARTS
            if rows // p >= SPLIT_MIN_BLOCK}


def split_mv(weight: torch.Tensor, x: torch.Tensor, parts: int, block: int,
             rest: bool) -> torch.Tensor:
    """``torch.mv(weight, x)`` as ``parts`` blocks of ``block`` rows in one batched product, the
    last ``weight.shape[0] - parts * block`` rows (``rest``) by ``mv``.

    Why: on a 2-core AMX Xeon, ATen's bf16 GEMV reads a weight from memory at 11-14 GB/s, and
    the same rows as a ``bmm`` over 4-16 row blocks at 20-27 GB/s (each block's product is a
    GEMV on one thread, the blocks spread over the threads): a 32000x768 LM head 3.2 -> 1.5 ms,
    a 768x768 projection 76 -> 53 us. Float32's GEMV (MKL) is slower so (3.8 -> 7.2 ms). Each
    output is the same dot product over the same row, accumulated in float32 either way.
    """
    k = weight.shape[1]
    rows = parts * block
    # (a view where the pass put it: SplitMatVec lowers only a weight held contiguous)
    blocks = (weight[:rows] if rest else weight).reshape(parts, block, k)
    y = torch.bmm(blocks, x.view(1, k, 1).expand(parts, k, 1)).view(rows)
    return torch.cat([y, torch.mv(weight[rows:], x)]) if rest else y
