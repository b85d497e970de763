"""Training-step time and peak memory on this CPU, bf16: fp32, torch.autocast, mpgraph mode="train".

BERT-base (BertForSequenceClassification, 8 × 128 tokens) and ResNet-50
(ResNetForImageClassification, 8 × 224²), random weights from their transformers configs, the loss
computed inside the model (labels given), SGD with momentum. Each variant runs in its own
subprocess (so its peak resident memory is its own): it builds the model, converts it when it is
mpgraph's, runs warm-up steps, then times steps; peak memory is the process's maximum resident
set size minus what it held before the first step. Variants alternate over ``--rounds`` rounds;
the table shows the median step time and the largest peak.

    python examples/bench/bench_training.py                 # both models (~10 min)
    python examples/bench/bench_training.py --models resnet50 --steps 3 --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("fp32", "autocast", "mpgraph train")
MODELS = ("bert", "resnet50")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(model_name: str, variant: str, steps: int, warmup: int) -> dict:
    import torch
    import transformers as hf

    import mpgraph

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if model_name == "bert":
        model = hf.BertForSequenceClassification(hf.BertConfig(num_labels=2)).train()
        inputs = {"input_ids": torch.randint(0, 30522, (8, 128), generator=g),
                  "labels": torch.randint(0, 2, (8,), generator=g)}
    else:
        model = hf.ResNetForImageClassification(hf.ResNetConfig(num_labels=10)).train()
        inputs = {"pixel_values": torch.randn(8, 3, 224, 224, generator=g),
                  "labels": torch.randint(0, 10, (8,), generator=g)}
    step_model = model
    if variant == "mpgraph train":
        step_model = mpgraph.convert(model, example_kwargs=inputs, dtype=torch.bfloat16, mode="train")
        del model
    opt = torch.optim.SGD(step_model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        if variant == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = step_model(**inputs).loss
        else:
            out = step_model(**inputs)
            loss = out.loss if hasattr(out, "loss") else out["loss"]
        loss.backward()
        opt.step()
        return float(loss)

    base = _current_rss_mb()
    losses = [step() for _ in range(warmup)]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    return {"ms": statistics.median(times) * 1e3, "peak_mb": _rss_mb() - base,
            "first_loss": losses[0], "last_loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.steps, args.warmup)))
        return
    import torch
    rows = []
    for name in args.models:
        results = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in VARIANTS:
                done = subprocess.run([sys.executable, __file__, "--child", name, v, "--steps",
                                       str(args.steps), "--warmup", str(args.warmup)],
                                      capture_output=True, text=True, check=True)
                results[v].append(json.loads(done.stdout.strip().splitlines()[-1]))
        ms = {v: statistics.median(r["ms"] for r in results[v]) for v in VARIANTS}
        for v in VARIANTS:
            peak = max(r["peak_mb"] for r in results[v])
            loss = results[v][0]
            rows.append(f"| {name} | {v} | {ms[v]:.0f} | {ms['fp32'] / ms[v]:.2f}× | "
                        f"{ms['autocast'] / ms[v]:.2f}× | {peak:.0f} | "
                        f"{loss['first_loss']:.3f} → {loss['last_loss']:.3f} |")
        print(f"# {name} done", flush=True)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, batch 8, SGD+momentum, "
          f"median of {args.steps} steps × {args.rounds} rounds after {args.warmup} warm-up steps\n")
    print("| model | variant | step ms | vs fp32 | vs autocast | peak MB | loss first → last |")
    print("|---|---|---:|---:|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
