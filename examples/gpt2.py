"""HuggingFace GPT-2 small with random weights (built from its config, nothing downloaded).

    mpgraph export examples/gpt2.py:build --dtype fp16 -o gpt2.onnx
"""
import torch
from transformers import GPT2Config, GPT2Model


def build(batch: int = 4, seq: int = 128):
    """(model, example positional inputs, example keyword inputs)."""
    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(use_cache=False)).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    return model, (ids,), {"attention_mask": torch.ones(batch, seq, dtype=torch.long)}
