"""mpgraph's default (no dtype, no target: this machine, its measured costs) against the ways
users run low precision on a CPU: float32, torch.autocast(bfloat16), model.to(bfloat16) and
model.half(), on a 1024^3 Linear, BERT-base, GPT-2, ViT-base and ResNet-50 (random weights from
HuggingFace configs, nothing downloaded), each at a latency size (1x16 tokens, one 224^2 image)
and a throughput size (8x128, 8 images). Eager, torch.no_grad(); the variants run interleaved,
one call each per round, median. Per variant: ms, speed against the fastest of the four
baselines, relative L2 error against float32 (the worst output), and for mpgraph its own
estimated speed-up over float32 beside the measured one.

    python examples/bench/bench_default.py > examples/bench/results_default.txt
    python examples/bench/bench_default.py --models linear bert --rounds 5

Conversion measures the model's ops once per machine (cached on disk); the script starts from an
empty cache (a temporary directory) so that the first conversion of each model pays for its
measurement, reported apart from the second conversion, which measures nothing.
"""
from __future__ import annotations

import argparse
import math
import copy
import os
import platform
import tempfile
import time

import torch

import mpgraph
from mpgraph.cost.device import cpu_flags, cpu_name
from mpgraph.numerics import output_errors
from interleave import interleaved_medians  # examples/bench/interleave.py

SIZES = {"linear": {"latency": 16, "throughput": 1024}, "bert": {"latency": (1, 16), "throughput": (8, 128)},
         "gpt2": {"latency": (1, 16), "throughput": (8, 128)},
         "vit": {"latency": 1, "throughput": 8}, "resnet": {"latency": 1, "throughput": 8}}
BASELINES = ("fp32", "autocast bf16", ".to(bf16)", ".half()")


def build(name: str, size):
    import transformers as t
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "linear":
        return torch.nn.Sequential(torch.nn.Linear(1024, 1024)).eval(), \
            torch.randn(size, 1024, generator=g)
    if name in ("bert", "gpt2"):
        model = (t.BertModel(t.BertConfig()) if name == "bert"
                 else t.GPT2Model(t.GPT2Config(use_cache=False))).eval()
        return model, torch.randint(0, model.config.vocab_size, size, generator=g)
    model = (t.ViTModel(t.ViTConfig()) if name == "vit" else t.ResNetModel(t.ResNetConfig())).eval()
    return model, torch.randn(size, 3, 224, 224, generator=g)


def bench(name: str, kind: str, rounds: int) -> list[dict]:
    model, x = build(name, SIZES[name][kind])
    # the first conversion measures the model's ops (once per machine: cached); the second is
    # what conversion costs from then on
    t0 = time.perf_counter()
    mpgraph.convert(model, (x,))
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    converted = mpgraph.convert(model, (x,))
    convert_s = time.perf_counter() - t0
    full_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    half = copy.deepcopy(model).half()
    floating = x.is_floating_point()

    def autocast_call(v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(v)

    variants = {"fp32": model, "autocast bf16": autocast_call,
                ".to(bf16)": (lambda v: full_bf16(v.bfloat16())) if floating else full_bf16,
                ".half()": (lambda v: half(v.half())) if floating else half,
                "mpgraph default": converted}
    with torch.no_grad():
        ref = model(x)
        errors = {k: max(output_errors(f(x), ref)) for k, f in variants.items()}
        for f in variants.values():  # warm-up
            f(x)
        med = interleaved_medians(variants, x, rounds)
    fastest = min(med[k] for k in BASELINES)
    plan = converted.plan
    estimate = plan.estimate["fp32_s"] / plan.estimate["plan_s"] if plan.estimate.get("plan_s") \
        else 1.0
    size = SIZES[name][kind]
    label = f"{size[0]}x{size[1]}" if isinstance(size, tuple) else (
        f"{size}x1024" if name == "linear" else f"{size}x224²")
    rows = []
    for k in variants:
        rows.append({"model": name, "size": label, "variant": k, "ms": med[k] * 1e3,
                     "vs_fastest": fastest / med[k], "err": errors[k],
                     "measured": med["fp32"] / med[k] if k == "mpgraph default" else None,
                     "estimated": estimate if k == "mpgraph default" else None})
    print(f"# {name} {label}: {plan.summary()}", flush=True)
    print(f"#   first conversion (measures the ops) {first_s:.1f} s, then {convert_s:.1f} s",
          flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--sizes", nargs="+", default=["latency", "throughput"])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mpgraph-bench-cache-")
    rows = []
    for name in args.models:
        for kind in args.sizes:
            rows += bench(name, kind, args.rounds)
    flags = " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16",
                                          "amx_bf16", "amx_fp16"}))
    print(f"\n{cpu_name()} ({flags}), {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, Python {platform.python_version()}; {args.rounds} interleaved "
          "rounds, median\n")
    print("| model | size | variant | median ms | vs fastest baseline | rel. L2 error | "
          "estimated vs fp32 | measured vs fp32 |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        est = f"{r['estimated']:.2f}×" if r["estimated"] else ""
        got = f"{r['measured']:.2f}×" if r["measured"] else ""
        print(f"| {r['model']} | {r['size']} | {r['variant']} | {r['ms']:.2f} | "
              f"{r['vs_fastest']:.2f}× | {r['err']:.2e} | {est} | {got} |")
    print()
    for name in args.models:  # the bars: >= 0.95x the fastest baseline, estimate within 1.3x
        for r in rows:
            if r["model"] == name and r["variant"] == "mpgraph default":
                ratio = r["estimated"] / r["measured"]
                print(f"{name} {r['size']}: {math.floor(r['vs_fastest'] * 1000) / 1000:.3f}x the fastest baseline "
                      f"({'met' if r['vs_fastest'] >= 0.95 else 'NOT met'}: 0.95x); estimate / "
                      f"measured {ratio:.3f} ({'met' if 1 / 1.3 <= ratio <= 1.3 else 'NOT met'}: "
                      "within 1.3x)")


if __name__ == "__main__":
    main()
