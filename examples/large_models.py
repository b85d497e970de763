"""Plan a Llama on the meta device, then load its safetensors checkpoint into the converted module.

The flow for a model too big to materialise in float32 here: build it with meta parameters (no
storage), plan and convert it (every pass runs on fake tensors), save the plan, then fill the
converted module from the checkpoint, one tensor at a time, each cast to the dtype the plan stores
it in. For a model this size the script also converts the materialised model directly and checks
that the two modules are the same (graph, every weight's dtype and bits, outputs).

    python examples/large_models.py                       # 2 layers, hidden 512: seconds
    python examples/large_models.py --layers 8 --hidden 2048 --out /tmp/llama
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import torch
import transformers as hf
from safetensors.torch import save_file

import mpgraph
from mpgraph.ir.graph import owner_of


def build(cfg: hf.LlamaConfig, device: str) -> torch.nn.Module:
    """The model with parameters on ``device``; on meta, buffers stay real (rotary inv_freq is
    computed, not stored in checkpoints), as accelerate's init_empty_weights builds them."""
    torch.manual_seed(0)
    if device != "meta":
        return hf.LlamaModel(cfg).eval()
    with torch.device("meta"):
        model = hf.LlamaModel(cfg).eval()
    with torch.device("cpu"):
        rotary = type(model.rotary_emb)(cfg)
    for name, b in rotary.named_buffers():
        owner, leaf = owner_of(model, f"rotary_emb.{name}")
        owner._buffers[leaf] = b
    return model


def save_checkpoint(model: torch.nn.Module, directory: str, shards: int = 2) -> str:
    """A sharded safetensors checkpoint with an index, as HuggingFace writes them."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in keys[i::shards]}, os.path.join(directory, name))
        weight_map.update({k: name for k in keys[i::shards]})
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--target", default="h100", help="device to plan for (default h100)")
    ap.add_argument("--out", help="directory for the plan and checkpoint (default: a temp dir)")
    opts = ap.parse_args()
    cfg = hf.LlamaConfig(hidden_size=opts.hidden, intermediate_size=opts.hidden * 11 // 4,
                         num_hidden_layers=opts.layers, num_attention_heads=opts.hidden // 64,
                         num_key_value_heads=opts.hidden // 128, vocab_size=32000, use_cache=False)
    out = opts.out or tempfile.mkdtemp(prefix="mpgraph-large-")
    os.makedirs(out, exist_ok=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    options = dict(dtype="bf16", target=opts.target)

    meta = build(cfg, "meta")
    t = time.perf_counter()
    planned = mpgraph.convert(meta, ids, **options)
    print(f"planned on meta in {time.perf_counter() - t:.1f} s: {planned.plan.summary()}")
    planned.plan.save(os.path.join(out, "plan.json"))
    print(f"plan saved: {os.path.join(out, 'plan.json')}")

    real = build(cfg, "cpu")  # here only to write a checkpoint and to compare; yours exists
    index = save_checkpoint(real, out)
    t = time.perf_counter()
    mpgraph.load_weights(planned, index)
    print(f"weights loaded from {index} in {time.perf_counter() - t:.1f} s")

    direct = mpgraph.convert(real, ids, **options)
    same_code = planned.code == direct.code
    a, b = planned.state_dict(), direct.state_dict()
    same_weights = list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
                                              for k in a)
    with torch.no_grad():
        same_out = torch.equal(planned(ids).last_hidden_state, direct(ids).last_hidden_state)
    print(f"against converting the materialised model: graph {'same' if same_code else 'DIFFERS'}, "
          f"weights {'same' if same_weights else 'DIFFER'}, outputs "
          f"{'bit-equal' if same_out else 'DIFFER'}")
    print(f"peak memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    raise SystemExit(0 if same_code and same_weights and same_out else 1)


if __name__ == "__main__":
    main()
