"""ContiguousAttentionMask: a GPU plan's attention reads a mask broadcast along its last
dimension as a contiguous copy, which CUDA's fused SDPA kernels require (else the math path)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpgraph
from conftest import GPU
from mpgraph.numerics import relative_l2

aten = torch.ops.aten


def _copies(gm) -> list:
    return [n for n in gm.graph.nodes if n.meta.get("mpgraph.inserted_by") == "ContiguousAttentionMask"]


def _mask_strides(gm, *args) -> list:
    """The last-dimension stride of every SDPA's mask as the converted module runs."""
    seen = []

    class Grab(torch.fx.Interpreter):
        def run_node(self, n):
            if n.target in (aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention):
                a, k = self.fetch_args_kwargs_from_env(n)
                mask = a[3] if len(a) > 3 else k.get("attn_mask")
                seen.append(mask.stride(-1))
            return super().run_node(n)
    with torch.no_grad():
        Grab(gm).run(*args)
    return seen


def test_hf_bert_s_broadcast_padding_mask_is_copied_once_for_a_gpu_plan():
    """A traced HF BERT builds its mask as (kv_idx >= pad)[..., None].expand(...): stride 0 last.
    On an H200 every attention of the fp16 BERT-base plan then ran the math path in float32
    CUDA-core GEMMs (80.7 us each at 8x128). A CPU plan keeps the graph (its kernels take it)."""
    import transformers as hf
    cfg = hf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, vocab_size=100)
    torch.manual_seed(0)
    model, ids = hf.BertModel(cfg).eval(), torch.randint(0, 100, (2, 16))
    gpu = mpgraph.convert(model, (ids,), dtype="fp16", target=GPU, strategy="rules")
    assert len(_copies(gpu)) == 1 and _mask_strides(gpu, ids) == [1, 1]
    with torch.no_grad():
        ref = model(ids).last_hidden_state
        assert relative_l2(gpu(ids).last_hidden_state.float(), ref) < 2e-3
    cpu = mpgraph.convert(model, (ids,), target="cpu")
    assert not _copies(cpu) and _mask_strides(cpu, ids) == [0, 0]
    # a saved GPU plan applies again with its copy
    again = mpgraph.convert(model, (ids,), plan=gpu.plan)
    assert len(_copies(again)) == 1


class _Attend(nn.Module):
    """Causal attention from a start position, the mask broadcast along the keys (torch.fx)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x, start):
        q, k, v = self.qkv(x).view(x.shape[0], -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        s = x.shape[1]
        keep = (torch.arange(s)[:, None] >= start).expand(s, s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_a_user_s_keyword_mask_broadcast_along_the_keys_is_copied_under_torch_fx():
    torch.manual_seed(0)
    model, x = _Attend().eval(), torch.randn(2, 8, 32)
    start = torch.tensor(0)
    gpu = mpgraph.convert(model, (x, start), dtype="fp16", target=GPU, strategy="rules")
    assert len(_copies(gpu)) == 1 and _mask_strides(gpu, x, start) == [1]
    with torch.no_grad():
        assert relative_l2(gpu(x, start).float(), model(x, start)) < 2e-3


class _Padded(nn.Module):
    """A padding mask expanded over heads and queries: strided, but its last stride is 1."""

    def forward(self, q, keep):
        b, h, s, _ = q.shape
        return F.scaled_dot_product_attention(q, q, q, attn_mask=keep[:, None, None, :].expand(b, h, s, s))


def test_a_mask_whose_last_dimension_is_dense_is_not_copied():
    """Only a broadcast last dimension is refused by CUDA's kernels: a (B, H, S, S) copy of a
    padding mask would cost B*H*S*S values a call for nothing."""
    q, keep = torch.randn(2, 2, 8, 16), torch.ones(2, 8, dtype=torch.bool)
    gpu = mpgraph.convert(_Padded().eval(), (q, keep), dtype="fp16", target=GPU, strategy="rules")
    assert not _copies(gpu) and _mask_strides(gpu, q, keep) == [1]
