"""Rule-based vs cost-optimal mpgraph on this CPU (bf16), eager and under torch.compile.

Five HuggingFace models built from their configs with random weights (nothing downloaded):
BERT-base, GPT-2 small, ViT-base, ResNet-50, ConvNeXt-tiny. At a throughput and a latency size:
median latency of fp32, torch.autocast, model.to(bfloat16), mpgraph rules and mpgraph optimal,
run interleaved, with each one's relative L2 error against fp32; at the throughput size also
autocast, rules and optimal under torch.compile. Then, for BERT and ResNet, the cost model's
predicted time of every matmul-class node against its measured eager time, with their Spearman
rank correlation.

    python examples/bench/bench_strategies.py                       # everything (~30 min)
    python examples/bench/bench_strategies.py --models bert --no-compile --rounds 5
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

import mpgraph
from mpgraph.numerics import relative_l2
from interleave import interleaved_medians  # examples/bench/interleave.py
from mpgraph.ir.graph import flat_inputs
from mpgraph.ir.meta import COST, OP_CLASS, PRECISION

BF16 = torch.bfloat16


def build(name: str, batch: int):
    import transformers as hf
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "bert":
        m = hf.BertModel(hf.BertConfig()).eval()
        seq = 128 if batch > 1 else 16
        return m, torch.randint(0, m.config.vocab_size, (batch, seq), generator=g)
    if name == "gpt2":
        m = hf.GPT2Model(hf.GPT2Config(use_cache=False)).eval()
        seq = 128 if batch > 1 else 16
        return m, torch.randint(0, m.config.vocab_size, (batch, seq), generator=g)
    image = torch.randn(batch, 3, 224, 224, generator=g)
    if name == "vit":
        return hf.ViTModel(hf.ViTConfig()).eval(), image
    if name == "resnet50":
        return hf.ResNetModel(hf.ResNetConfig()).eval(), image
    if name == "convnext":
        return hf.ConvNextModel(hf.ConvNextConfig()).eval(), image
    raise ValueError(name)


SIZES = {"bert": (8, 1), "gpt2": (4, 1), "vit": (8, 1), "resnet50": (8, 1), "convnext": (8, 1)}


def _out(value):
    return value.last_hidden_state if hasattr(value, "last_hidden_state") else value[0]


rel = relative_l2  # the one metric mpgraph reports (mpgraph.numerics)


def run_size(name: str, batch: int, rounds: int, compile_: bool) -> list[dict]:
    model, x = build(name, batch)
    rules = mpgraph.convert(model, (x,), dtype=BF16, strategy="rules")
    optimal = mpgraph.convert(model, (x,), dtype=BF16, strategy="optimal")
    full_model = copy.deepcopy(model).to(BF16)

    def full(inp):  # everything bf16, the input too
        return full_model(inp.to(BF16) if inp.is_floating_point() else inp)

    def autocast(inp):
        with torch.autocast("cpu", dtype=BF16):
            return model(inp)

    variants = {"fp32": model, "autocast": autocast, "to(bfloat16)": full,
                "mpgraph rules": rules, "mpgraph optimal": optimal}
    if compile_:
        variants["autocast + compile"] = torch.compile(autocast)
        variants["rules + compile"] = torch.compile(rules)
        variants["optimal + compile"] = torch.compile(optimal)
    with torch.no_grad():
        ref = _out(model(x))
        errors = {}
        for k, f in variants.items():
            t = time.perf_counter()
            errors[k] = rel(_out(f(x)), ref)  # also the warm-up / compile
            if "compile" in k:
                print(f"#   {name} {k}: first call {time.perf_counter() - t:.1f}s", flush=True)
            f(x)
        med = interleaved_medians(variants, x, rounds)
    size = "throughput" if batch > 1 else "latency"
    print(f"# {name} batch {batch}: rules: {rules.plan.summary()}", flush=True)
    print(f"# {name} batch {batch}: optimal: {optimal.plan.summary()}", flush=True)
    return [{"model": name, "size": f"{size} (batch {batch})", "variant": k, "ms": med[k] * 1e3,
             "vs_autocast": med["autocast"] / med[k], "vs_full": med["to(bfloat16)"] / med[k],
             "err": errors[k], "err_vs_autocast": errors[k] / errors["autocast"] if errors["autocast"] else 0}
            for k in variants]


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation; equal values share their average rank (same-shape layers tie)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def predicted_vs_measured(name: str, batch: int, repeats: int = 5) -> None:
    """Time every matmul-class node of the optimal plan in eager mode, against its prediction."""
    model, x = build(name, batch)
    gm = mpgraph.convert(model, (x,), dtype=BF16)
    measured: dict[str, list[float]] = {}

    class Timed(torch.fx.Interpreter):
        def run_node(self, n):
            if n.meta.get(OP_CLASS) is not None and n.meta[OP_CLASS].op_class == "tensor_core":
                t = time.perf_counter()
                out = super().run_node(n)
                measured.setdefault(n.name, []).append(time.perf_counter() - t)
                return out
            return super().run_node(n)

    with torch.no_grad():
        flat = flat_inputs(gm, (x,), {})
        for _ in range(repeats + 1):
            Timed(gm).run(*flat, enable_io_processing=False)
    rows = []
    for n in gm.graph.nodes:
        if n.name in measured:
            cost, dtype = n.meta[COST], n.meta[PRECISION].dtype
            pred = cost.t_low if dtype == BF16 else cost.t_fp32
            rows.append((n.name, pred, statistics.median(measured[n.name][1:])))
    rho = spearman([r[1] for r in rows], [r[2] for r in rows])
    total_p, total_m = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"\n{name} batch {batch}: {len(rows)} matmul-class nodes, predicted {total_p * 1e3:.1f} ms, "
          f"measured {total_m * 1e3:.1f} ms in all; Spearman rank correlation {rho:.3f}")
    print("| node | predicted us | measured us |")
    print("|---|---:|---:|")
    shown = sorted(rows, key=lambda r: -r[2])
    for r in shown[:6] + shown[-3:]:
        print(f"| {r[0]} | {r[1] * 1e6:.0f} | {r[2] * 1e6:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for name in args.models:
        big, small = SIZES[name]
        rows += run_size(name, big, args.rounds, compile_=not args.no_compile)
        rows += run_size(name, small, args.rounds, compile_=False)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds, median\n")
    print("| model | size | variant | median ms | vs autocast | vs .to(bf16) | rel. L2 error | error / autocast's |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['size']} | {r['variant']} | {r['ms']:.1f} | {r['vs_autocast']:.2f}× | "
              f"{r['vs_full']:.2f}× | {r['err']:.2e} | {r['err_vs_autocast']:.2f} |")
    for name in ("bert", "resnet50"):
        if name in args.models:
            predicted_vs_measured(name, SIZES[name][0])


if __name__ == "__main__":
    main()
