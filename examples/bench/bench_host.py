"""Host cost per call: the converted module against .half() eager, where compute is negligible.

Eager inference on a modern GPU is host-bound at ordinary sizes (~5-10 us of Python and dispatch
per node, see the GPU table in the README): a converted module with more nodes than the model
runs slower than ``.half()`` even where its kernels are as fast. Tiny-width versions of the
architectures (hidden 32, 12 layers, 1x4 tokens or one 32x32 image) make that cost visible on a
CPU, where kernels take next to nothing. Planned for an H100 (fp16), one torch thread, the
two variants interleaved, median of 20 blocks of 30 calls; also the node counts of both graphs.

    python examples/bench/bench_host.py > examples/bench/results_host.txt
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

import mpgraph
import mpgraph.cost.device

_SHOWN = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}


def _models():
    from transformers import (BertConfig, BertModel, ConvNextConfig, ConvNextModel, GPT2Config,
                              GPT2Model, LlamaConfig, LlamaModel, ViTConfig, ViTModel)
    tokens = torch.randint(0, 100, (1, 4), generator=torch.Generator().manual_seed(0))
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    return {
        "bert": (BertModel(BertConfig(hidden_size=32, num_hidden_layers=12, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=100)), tokens),
        "gpt2": (GPT2Model(GPT2Config(n_embd=32, n_layer=12, n_head=2, vocab_size=100,
                                      use_cache=False, bos_token_id=0, eos_token_id=0)), tokens),
        "llama": (LlamaModel(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=12,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         vocab_size=100, use_cache=False)), tokens),
        "vit": (ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=12, num_attention_heads=2,
                                   intermediate_size=64, image_size=32, patch_size=16)), image),
        "convnext": (ConvNextModel(ConvNextConfig(hidden_sizes=[32, 32, 32, 32],
                                                  depths=[3, 3, 3, 3], image_size=32)), image),
    }


def _block(f, x, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        f(x)
    return (time.perf_counter() - t) / calls


def _nodes(module, x) -> int:
    """Nodes of the model's own graph as torch.export captures it (what .half() executes)."""
    return len(torch.export.export(module, (x,), strict=False).graph.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cpu = mpgraph.cost.device.cpu_name()
    print(f"# {cpu}, flags {' '.join(sorted(mpgraph.cost.device.cpu_flags() & _SHOWN))}, torch "
          f"{torch.__version__}, 1 thread; "
          f"planned for h100 (fp16), run here; median of {args.blocks} interleaved blocks of "
          f"{args.calls} calls")
    print("| model | export nodes | mpgraph nodes | .half() ms | mpgraph ms | mpgraph / .half() |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (model, x) in _models().items():
        if args.models and name not in args.models:
            continue
        model.eval()
        converted = mpgraph.convert(model, x, dtype="fp16", target="h100")
        half = copy.deepcopy(model).half()
        xh = x.half() if x.is_floating_point() else x
        a, b = [], []
        with torch.no_grad():
            for _ in range(3):
                converted(x), half(xh)
            for _ in range(args.blocks):
                a.append(_block(converted, x, args.calls))
                b.append(_block(half, xh, args.calls))
        ours, theirs = statistics.median(a), statistics.median(b)
        print(f"| {name} | {_nodes(model, x)} | {len(converted.graph.nodes)} | {theirs * 1e3:.2f} | "
              f"{ours * 1e3:.2f} | {ours / theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
