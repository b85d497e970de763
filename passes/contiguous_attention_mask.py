"""An attention mask whose last dimension is broadcast (stride 0) is read as a contiguous copy
by ``scaled_dot_product_attention`` in GPU plans.

torch's CUDA attention backends that take a mask (memory-efficient, cuDNN; flash takes none)
require its last dimension to have stride 1 (the CPU's do not); given a broadcast one, SDPA
falls back to its math path, which also computes fp16/bf16 in float32. A captured HF BERT builds its padding mask
as ``(kv_idx >= pad)[..., None].expand(...)`` (its eager forward skips an all-ones mask; a
traced one cannot): on an H200, every attention of the converted BERT-base ran float32
CUDA-core GEMMs (80.7 us each at 8x128), where ``.half()`` ran the fused kernel. The copy is
the mask's own size (batch x query x key booleans), once for all the layers that read it.
"""
from __future__ import annotations

import torch
import torch.fx

from mpgraph.ir.graph import SDPA
from mpgraph.ir.meta import LAYOUT
from mpgraph.passes.contiguous_linear_inputs import ContiguousCopies


def _mask(node: torch.fx.Node):
    """The mask argument's node of an SDPA call, or None."""
    if node.op != "call_function" or node.target not in SDPA:
        return None
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return mask if isinstance(mask, torch.fx.Node) else None


def _broadcast_last(mask: torch.fx.Node) -> bool:
    """Whether the example run (or torch.export's record, on the meta device) gave the mask with
    its last dimension expanded (``mpgraph.layout`` "broadcast")."""
    return mask.meta.get(LAYOUT) == "broadcast"


class ContiguousAttentionMask(ContiguousCopies):
    def copied_input(self, node, gm):
        mask = _mask(node)
        return mask if mask is not None and _broadcast_last(mask) else None
