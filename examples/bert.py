"""HuggingFace BERT-base with random weights (built from its config, nothing downloaded).

    mpgraph export examples/bert.py:build --dtype fp16 -o bert.onnx
"""
import torch
from transformers import BertConfig, BertModel


def build(batch: int = 8, seq: int = 128):
    """(model, example positional inputs, example keyword inputs)."""
    torch.manual_seed(0)
    model = BertModel(BertConfig()).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    return model, (ids,), {"attention_mask": torch.ones(batch, seq, dtype=torch.long)}
