"""CPU bfloat16 inference benchmark: fp32 vs torch.autocast vs model.to(bfloat16) vs mpgraph.

HuggingFace BertModel(BertConfig()) and GPT2Model(GPT2Config(use_cache=False)) with random
weights (nothing downloaded), eager, torch.no_grad(). The four variants run interleaved, one call
each per round, so drift on a noisy machine hits all of them alike; we report the median.

    python examples/bench/bench_cpu_bf16.py            # both models, both sizes
    python examples/bench/bench_cpu_bf16.py --rounds 5 --models bert
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import mpgraph
from mpgraph.numerics import relative_l2
from interleave import interleaved_medians  # examples/bench/interleave.py

SIZES = {"bert": {"throughput": (8, 128), "latency": (1, 16)},
         "gpt2": {"throughput": (4, 128), "latency": (1, 16)}}


def build(name: str) -> torch.nn.Module:
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model
    torch.manual_seed(0)
    if name == "bert":
        return BertModel(BertConfig()).eval()
    return GPT2Model(GPT2Config(use_cache=False)).eval()


rel_l2 = relative_l2  # the one metric mpgraph reports (mpgraph.numerics)


def bench(name: str, size: tuple[int, int], rounds: int) -> list[dict]:
    model = build(name)
    batch, seq = size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    t0 = time.perf_counter()
    converted = mpgraph.convert(model, (ids,), dtype=torch.bfloat16)
    convert_s = time.perf_counter() - t0
    full = copy.deepcopy(model).to(torch.bfloat16)

    def autocast_call(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    variants = {"fp32": model, "autocast": autocast_call, "to(bfloat16)": full, "mpgraph": converted}
    with torch.no_grad():
        ref = model(ids).last_hidden_state
        errors = {k: rel_l2(f(ids).last_hidden_state, ref) for k, f in variants.items()}
        for f in variants.values():  # warm-up
            f(ids)
        med = interleaved_medians(variants, ids, rounds)
    rows = []
    for k in variants:
        rows.append({"model": name, "size": f"{batch}x{seq}", "variant": k, "ms": med[k] * 1e3,
                     "vs_autocast": med["autocast"] / med[k], "vs_full_bf16": med["to(bfloat16)"] / med[k],
                     "rel_err": errors[k]})
    print(f"# {name} {batch}x{seq}: {converted.plan.summary()} (convert {convert_s:.1f}s)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert", "gpt2"], choices=sorted(SIZES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        for kind, size in SIZES[name].items():
            rows += bench(name, size, args.rounds)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds, median\n")
    print("| model | batch×seq | variant | median ms | speed vs autocast | speed vs .to(bf16) | rel. L2 error |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['size']} | {r['variant']} | {r['ms']:.1f} | {r['vs_autocast']:.2f}× | "
              f"{r['vs_full_bf16']:.2f}× | {r['rel_err']:.2e} |")


if __name__ == "__main__":
    main()
