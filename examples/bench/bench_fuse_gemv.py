"""What FuseSiblingGemv buys on this CPU: sibling GEMVs (q/k/v, gate/up) as one over their
stacked weights, against the same GEMVs run separately, and a decoder's step with and without it.

    python examples/bench/bench_fuse_gemv.py [--steps 300]

1. GEMVs alone, bf16, each variant on 12 weights of its own read in turn (so each call reads its
   weight from memory, as a decode step does), interleaved, medians.
2. The 6-layer Llama of bench_decode.py converted twice with convert_decoder (batch 1, prompt
   16), once with the pass and once without, its decode step called alternately ``--steps``
   times each: medians and the median of the paired ratios (the machine drifts; pairs do not).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import build  # noqa: E402

import mpgraph  # noqa: E402
from mpgraph.cost.device import cpu_flags, cpu_name  # noqa: E402
from mpgraph.passes.fuse_sibling_gemv import FuseSiblingGemv  # noqa: E402
from mpgraph.passes.infra import PassResult  # noqa: E402

COPIES = 12


def gemvs(rounds: int = 20) -> list[str]:
    torch.manual_seed(0)

    def weights(*shapes):
        return [[torch.randn(*s).bfloat16() for s in shapes] for _ in range(COPIES)]

    x = torch.randn(768).bfloat16()
    variants = {
        "q/k/v: one 2304x768": weights((2304, 768)),
        "q/k/v: three 768x768": weights((768, 768), (768, 768), (768, 768)),
        "gate/up: one 4096x768": weights((4096, 768)),
        "gate/up: two 2048x768": weights((2048, 768), (2048, 768)),
    }
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for name, copies in variants.items():
            start = time.perf_counter()
            for group in copies:
                for w in group:
                    torch.mv(w, x)
            times[name].append((time.perf_counter() - start) / COPIES)
    return [f"{name}: {1e6 * statistics.median(t):.0f} us" for name, t in times.items()]


def step(steps: int) -> list[str]:
    model = build("llama")
    ids = torch.randint(1, 30000, (1, 16), generator=torch.Generator().manual_seed(0))
    fused = mpgraph.convert_decoder(model, ids, max_cache_len=49)
    real = FuseSiblingGemv.call
    FuseSiblingGemv.call = lambda self, gm: PassResult(gm, False)
    try:
        apart = mpgraph.convert_decoder(model, ids, max_cache_len=49)
    finally:
        FuseSiblingGemv.call = real
    same = torch.equal(fused.generate(ids, max_new_tokens=32), apart.generate(ids, max_new_tokens=32))
    mask = torch.ones(1, 49, dtype=torch.long)
    mask[:, 30:] = 0
    args = (ids[:, -1:], torch.tensor([[29]]), torch.tensor([29]), mask)
    times = {"with": [], "without": []}
    with torch.no_grad():
        for i in range(steps):
            order = (("with", fused), ("without", apart))
            for name, d in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                d.decode(*args)
                times[name].append(time.perf_counter() - start)
    ratio = statistics.median(b / a for a, b in zip(times["with"], times["without"]))
    return [f"decode step with the pass {1e3 * statistics.median(times['with']):.2f} ms, without "
            f"{1e3 * statistics.median(times['without']):.2f} ms; median of the paired ratios "
            f"{ratio:.3f}x; 32 greedy tokens equal: {same}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    flags = " ".join(sorted(cpu_flags() & {"avx2", "avx512_bf16", "avx512_fp16", "amx_bf16"}))
    print(f"{cpu_name()} ({flags}), {torch.get_num_threads()} threads, torch {torch.__version__}")
    for line in gemvs() + step(args.steps):
        print(line)


if __name__ == "__main__":
    main()
