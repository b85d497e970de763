"""Decode speed against HuggingFace's own generate, on this machine (issue 27).

Models, random weights from configs (nothing downloads): ``gpt2`` (GPT-2 small: 12 layers, 768
wide, 50k vocabulary, LM head tied to the embedding) and ``llama`` (6 layers, 768 wide, 2048 MLP,
32k vocabulary). Variants, all greedy, all through ``generate`` with HF's arguments:

- ``HF fp32``: ``model.generate`` on the float32 model (dynamic cache);
- ``HF bf16``: on a ``.to(torch.bfloat16)`` copy (dynamic cache);
- ``HF bf16 static``: the same with ``cache_implementation="static"``;
- ``HF bf16 static compiled``: that, with ``model.forward`` under ``torch.compile`` (``--compile``;
  minutes of compilation on a small CPU, so not by default);
- ``mpgraph``: ``mpgraph.convert_decoder(model, ...)`` with its defaults (the precision the cost
  model finds fastest here), then ``decoder.generate(ids, attention_mask=..., max_new_tokens=n)``.

First-token latency is the time of a ``max_new_tokens=1`` call (the prompt's prefill and one
token); per-token time is ``(T(1 + new) - T(1)) / new``; medians over ``--rounds`` rounds, the
variants interleaved within each round (a shared machine's slow minutes hit all alike).

The memory floor: a decode step reads every weight once (the input embedding only a row), so it
takes at least those bytes over the memory bandwidth this machine measures (a 64 MB copy,
``mpgraph.cost.device``); ``floor tok/s`` is that bound for the weights in bfloat16, and each
row's ``% of floor`` its tokens/s against it. Greedy tokens are compared with HF bf16's.

    python examples/bench/bench_decode.py                      # batch 1, prompt 16: the bar
    python examples/bench/bench_decode.py --batches 1 8 --prompts 16 512 --out decode.txt
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

import mpgraph
from mpgraph.cost.device import cpu_flags, cpu_name, measure_cpu


def build(name: str):
    import transformers as hf
    torch.manual_seed(0)
    if name == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config())
    else:
        model = hf.LlamaForCausalLM(hf.LlamaConfig(
            hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
            vocab_size=32000))
    model.generation_config.eos_token_id = None  # every run makes all its new tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def weight_bytes_per_token(model, itemsize: int) -> int:
    """Bytes a decode step reads: every weight, the input embedding's one row (a tied LM head
    reads the whole matrix anyway)."""
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is emb
    total = sum(p.numel() for p in model.parameters())
    if not tied:
        total -= emb.numel()
    return total * itemsize


def hf_runner(model, ids, mask, **extra):
    def run(n):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                  **extra)
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--prompts", nargs="+", type=int, default=[16])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also HF bf16 static compiled")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    spec = measure_cpu()
    bandwidth = spec.bandwidth
    flags = " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16",
                                           "amx_bf16"}))
    lines = [f"{cpu_name()} ({flags}), {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}, Python {platform.python_version()}; memory bandwidth "
             f"{bandwidth / 1e9:.1f} GB/s (64 MB copy); greedy, {args.new} new tokens, "
             f"{args.rounds} interleaved rounds, medians", ""]
    table = ["| model | batch | prompt | variant | first token ms | per-token ms | tokens/s | "
             "vs HF bf16 static | % of floor | tokens = HF bf16 |", "|" + "---|" * 10]
    bars = []
    for name in args.models:
        model = build(name)
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        floor_s = weight_bytes_per_token(model, 2) / bandwidth
        lines.append(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
                     f"parameters; bf16 weights read per token "
                     f"{weight_bytes_per_token(model, 2) / 1e6:.0f} MB -> floor "
                     f"{floor_s * 1e3:.1f} ms, {1 / floor_s:.0f} tokens/s at batch 1")
        for batch in args.batches:
            for prompt in args.prompts:
                g = torch.Generator().manual_seed(batch * 1000 + prompt)
                ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g)
                mask = torch.ones_like(ids)
                slots = prompt + args.new + 1
                t = time.perf_counter()
                decoder = mpgraph.convert_decoder(model, ids, max_cache_len=slots)
                convert_s = time.perf_counter() - t
                lines.append(f"  batch {batch}, prompt {prompt}: convert_decoder {convert_s:.1f} s"
                             f"; {decoder!r}")
                variants = {
                    "HF fp32": hf_runner(model, ids, mask),
                    "HF bf16": hf_runner(bf16, ids, mask),
                    "HF bf16 static": hf_runner(bf16, ids, mask, cache_implementation="static"),
                }
                if args.compile:
                    compiled = copy.deepcopy(bf16)
                    compiled.forward = torch.compile(compiled.forward)
                    variants["HF bf16 static compiled"] = hf_runner(
                        compiled, ids, mask, cache_implementation="static")
                variants["mpgraph"] = lambda n: decoder.generate(ids, attention_mask=mask,
                                                                 max_new_tokens=n)
                firsts = {v: [] for v in variants}
                pers = {v: [] for v in variants}
                seqs = {}
                for v, run in variants.items():   # warm-up (and compilation)
                    seqs[v] = run(args.new + 1)
                for _ in range(args.rounds):
                    for v, run in variants.items():
                        t0 = time.perf_counter()
                        run(1)
                        t1 = time.perf_counter()
                        run(args.new + 1)
                        t2 = time.perf_counter()
                        firsts[v].append(t1 - t0)
                        pers[v].append(((t2 - t1) - (t1 - t0)) / args.new)
                per = {v: statistics.median(x) for v, x in pers.items()}
                ref = seqs["HF bf16"][:, prompt:]
                for v in variants:
                    same = float((seqs[v][:, prompt:] == ref).float().mean())
                    tps = batch / per[v]
                    table.append(
                        f"| {name} | {batch} | {prompt} | {v} | "
                        f"{statistics.median(firsts[v]) * 1e3:.1f} | {per[v] * 1e3:.2f} | "
                        f"{tps:.0f} | {per['HF bf16 static'] / per[v]:.2f}x | "
                        f"{floor_s / per[v]:.0%} | {same:.0%} |")
                if batch == 1:
                    ratio = per["HF bf16 static"] / per["mpgraph"]
                    bars.append(f"{name} batch 1 prompt {prompt}: mpgraph {ratio:.2f}x HF bf16 "
                                f"static's tokens/s ({'met' if ratio >= 1.25 else 'NOT met'}: "
                                f"1.25x), {floor_s / per['mpgraph']:.0%} of the bf16 memory floor")
                decoder = None
    text = "\n".join(lines + [""] + table + [""] + bars) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
