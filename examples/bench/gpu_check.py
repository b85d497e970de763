"""GPU check: fp16 speed and Tensor Core use of the benchmark models on one NVIDIA GPU.

For a machine with one NVIDIA GPU and nothing to download (random-weight HuggingFace models from
their configs): per model, median latency of fp32 eager, autocast fp16, ``.half()``, mpgraph fp16
eager, mpgraph fp16 replayed from CUDA graphs (``mpgraph.cuda_graph``, its cache stats printed
once per model), and (for ``--compile-models``) mpgraph + torch.compile and autocast +
torch.compile, with each one's relative L2 error against fp32 (CUDA events, interleaved runs).
Then BERT-base node by node: mpgraph.profile's per-node kernels and the share of matmul time in
Tensor Core kernels, and, where ``ncu`` runs, the command for Nsight Compute's tensor pipe
metrics per node. About 3–4 minutes on an H100/H200 with the defaults. Writes the tables to
stdout and to ``--out``. ``--batch 1`` is the latency size (BERT, GPT-2 and Llama at 1x16
tokens), where eager is bound by the host and CUDA graphs pay most; ``llama`` is a
TinyLlama-1.1B-shaped Llama, not in the default list.

    python examples/bench/gpu_check.py --out gpu_check.txt
    python examples/bench/gpu_check.py --models bert resnet50 --compile-models none
    python examples/bench/gpu_check.py --models bert gpt2 llama --batch 1 --compile-models none
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings

import torch

import mpgraph
from bench_strategies import build  # examples/bench/bench_strategies.py: the five models
from mpgraph.tools.ncu import ncu_command, query_metrics, shell

FP16 = torch.float16
SIZES = {"bert": 8, "gpt2": 4, "vit": 8, "resnet50": 8, "convnext": 8}
MODELS = [*SIZES, "llama"]


def build_model(name: str, batch: int):
    """bench_strategies' five models, and a Llama with TinyLlama-1.1B's shape (random weights)."""
    if name != "llama":
        return build(name, batch)
    import transformers as hf
    torch.manual_seed(0)
    cfg = hf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                         use_cache=False)
    seq = 128 if batch > 1 else 16
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return hf.LlamaModel(cfg).eval(), ids


def _out(value):
    return value.last_hidden_state if hasattr(value, "last_hidden_state") else value[0]


def _cuda_ms(f, x, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def model_rows(name: str, rounds: int, compile_: bool, batch: int | None = None) -> list[str]:
    batch = batch or SIZES.get(name, 1)
    model, x = build_model(name, batch)
    model, x = model.cuda(), x.cuda()
    converted = mpgraph.convert(model, (x,), dtype=FP16)  # planned for this GPU
    graphed = mpgraph.cuda_graph(converted)  # one graph for this input shape, on the first call
    half = copy.deepcopy(model).half()

    def autocast(inp):
        with torch.autocast("cuda", dtype=FP16):
            return model(inp)

    variants = {"fp32": model, "autocast": autocast,
                ".half()": lambda inp: half(inp.half() if inp.is_floating_point() else inp),
                "mpgraph": converted, "mpgraph CUDA graph": graphed}
    if compile_:
        variants["autocast + compile"] = torch.compile(autocast)
        variants["mpgraph + compile"] = torch.compile(converted)
    rows = []
    with torch.no_grad():
        ref = _out(model(x)).float()
        errors = {}
        for k, f in variants.items():
            t = time.perf_counter()
            out = _out(f(x)).float()
            errors[k] = float((out - ref).norm() / ref.norm())
            f(x)
            if "compile" in k:
                print(f"#   {name} {k}: first calls {time.perf_counter() - t:.1f}s", flush=True)
        times = {k: [] for k in variants}
        for _ in range(3):  # interleaved blocks of rounds
            for k, f in variants.items():
                times[k].append(_cuda_ms(f, x, rounds))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# {name}: {converted.plan.summary()}", flush=True)
    print(f"# {name} mpgraph CUDA graph: {graphed.stats}", flush=True)
    size = "x".join(map(str, x.shape))
    for k in variants:
        rows.append(f"| {name} | {size} | {k} | {med[k]:.2f} | {med['fp32'] / med[k]:.2f}× | "
                    f"{med['autocast'] / med[k]:.2f}× | {med['.half()'] / med[k]:.2f}× | "
                    f"{errors[k]:.2e} |")
    return rows


def bert_tensor_cores() -> list[str]:
    model, x = build("bert", 8)
    model, x = model.cuda(), x.cuda()
    converted = mpgraph.convert(model, (x,), dtype=FP16)
    result = mpgraph.profile(converted, (x,), iters=5)
    mm = [n for n in result.nodes if n.op_class == "tensor_core"]
    lines = [f"BERT-base fp16, node by node (torch.profiler kernels): {len(mm)} matmul-class nodes, "
             f"{sum(1 for n in mm if n.tensor_core)} on Tensor Core kernels; "
             f"{(result.tensor_core_share or 0):.1%} of their time"]
    lines += [f"  {n.name}: {n.time_s * 1e6:.1f} us, {n.kernels[0] if n.kernels else '-'}" for n in mm[:8]]
    lines += [f"  finding: {n.name}: {n.finding}" for n in result.findings]
    query = query_metrics()
    program = [sys.executable, "-m", "mpgraph.cli", "profile", "examples/bert.py:build", "--dtype",
               "fp16", "--iters", "1", "--device", "cuda"]
    command = shell(ncu_command(program, log_file="bert-ncu.csv"))
    lines.append(("ncu is available: run " if query else "ncu is not available here; elsewhere run ")
                 + command + "  (then: mpgraph profile --ncu-csv bert-ncu.csv)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SIZES), choices=MODELS)
    parser.add_argument("--batch", type=int, default=None,
                        help="batch for every model (1: 1x16 tokens, one image); default per model")
    parser.add_argument("--compile-models", nargs="*", default=["bert", "resnet50"],
                        help="models also timed under torch.compile ('none' for none)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here: nothing to check (this script is for a GPU machine)")
        return 1
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    start = time.time()
    gpu = torch.cuda.get_device_name(0)
    lines = [f"{time.strftime('%Y-%m-%d')} {gpu}, torch {torch.__version__}, fp16, median of "
             f"{args.rounds}-call blocks (CUDA events)", "",
             "| model | input | variant | median ms | vs fp32 | vs autocast | vs .half() | "
             "rel. L2 error |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for name in args.models:
        lines += model_rows(name, args.rounds, name in args.compile_models, args.batch)
    lines += [""] + bert_tensor_cores()
    lines.append(f"total {time.time() - start:.0f} s")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
