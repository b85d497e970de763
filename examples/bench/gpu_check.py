"""GPU check: fp16 speed and Tensor Core use of the benchmark models on one NVIDIA GPU.

For a machine with one NVIDIA GPU and nothing to download (random-weight HuggingFace models from
their configs): per model, median latency of fp32 eager, autocast fp16, ``.half()``, mpgraph fp16
eager, mpgraph fp16 replayed from CUDA graphs (``mpgraph.cuda_graph``, its cache stats printed
once per model), and (for ``--compile-models``) mpgraph + torch.compile and autocast +
torch.compile, with each one's relative L2 error against fp32 (CUDA events, interleaved runs).
Then the training-step table (fp32 / autocast / mpgraph ``mode="train"``, fp16 with a
GradScaler, AdamW: BERT-base 8x128 and ResNet-50 32x224²). Then BERT-base node by node: mpgraph.profile's per-node kernels and the share of matmul time in
Tensor Core kernels, and, where ``ncu`` runs, the command for Nsight Compute's tensor pipe
metrics per node. Last, the GPU's calibration file for the roofline (``mpgraph calibrate --gpu``
does the same alone). About 3–4 minutes on an H100/H200 with the defaults. Writes the tables to
stdout and to ``--out``. ``--batch 1`` is the latency size (BERT, GPT-2 and Llama at 1x16
tokens), where eager is bound by the host and CUDA graphs pay most; ``llama`` is a
TinyLlama-1.1B-shaped Llama (22 layers), ``llama4`` the 4-layer, 2048-wide one of the GPU table
in the README's issue 16, ``t5`` T5-small's encoder. ``--tiny`` runs every model at tiny widths on
the CPU (timed with perf_counter, the CUDA-graph variant falling back to eager, the per-node
section profiled on the CPU): it checks that the script runs end to end before a GPU session
spends its minutes on it, and measures nothing of a GPU.

    python examples/bench/gpu_check.py --out gpu_check.txt
    python examples/bench/gpu_check.py --tiny --compile-models none   # CPU smoke, ~1 minute
    python examples/bench/gpu_check.py --models bert resnet50 --compile-models none
    python examples/bench/gpu_check.py --models bert gpt2 llama --batch 1 --compile-models none
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch

import mpgraph
from mpgraph.numerics import relative_l2
from bench_strategies import build  # examples/bench/bench_strategies.py: the five models
from mpgraph.tools.ncu import ncu_command, query_metrics, shell

FP16 = torch.float16
SIZES = {"bert": 8, "gpt2": 4, "vit": 8, "resnet50": 8, "convnext": 8}  # default batch
MODELS = [*SIZES, "llama", "llama4", "t5"]


def _tokens(vocab: int, batch: int, tiny: bool):
    seq = 4 if tiny else 128 if batch > 1 else 16
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


class T5Encoder(torch.nn.Module):
    """T5's encoder stack alone (its forward takes input_ids only)."""

    def __init__(self, cfg):
        super().__init__()
        import transformers as hf
        self.encoder = hf.T5EncoderModel(cfg)

    def forward(self, input_ids):
        return self.encoder(input_ids=input_ids)


def build_model(name: str, batch: int, tiny: bool = False):
    """bench_strategies' five models, Llamas of TinyLlama-1.1B's width (22 or 4 layers) and T5-small's
    encoder, random weights; ``tiny``: every one at widths a CPU runs in milliseconds."""
    import transformers as hf
    torch.manual_seed(0)
    if tiny and name in SIZES:
        from bench_host import _models  # examples/bench/bench_host.py: tiny widths
        if name != "resnet50":
            model, x = _models()[name]
            return model.eval(), x.expand(batch, *x.shape[1:]).clone()
        cfg = hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 16, 16, 16], depths=[1, 1, 1, 1])
        return hf.ResNetModel(cfg).eval(), torch.randn(batch, 3, 32, 32)
    if name in SIZES:
        return build(name, batch)
    if name in ("llama", "llama4"):
        width = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=100) if tiny else \
            dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000)
        cfg = hf.LlamaConfig(num_hidden_layers=2 if tiny else 22 if name == "llama" else 4,
                             use_cache=False, **width)
        return hf.LlamaModel(cfg).eval(), _tokens(cfg.vocab_size, batch, tiny)
    if name == "t5":
        cfg = hf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100) \
            if tiny else hf.T5Config.from_dict(dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                                                    num_heads=8, vocab_size=32128))
        return T5Encoder(cfg).eval(), _tokens(cfg.vocab_size, batch, tiny)
    raise ValueError(name)


def _out(value):
    return value.last_hidden_state if hasattr(value, "last_hidden_state") else value[0]


def _cuda_ms(f, x, rounds: int) -> float:
    if not x.is_cuda:  # --tiny on the CPU
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            f(x)
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def model_rows(name: str, rounds: int, compile_: bool, batch: int | None = None,
               tiny: bool = False) -> list[str]:
    batch = batch or SIZES.get(name, 1)
    model, x = build_model(name, batch, tiny)
    device = "cpu" if tiny else "cuda"
    model, x = model.to(device), x.to(device)
    # planned for this GPU (--tiny: for an H100, on the CPU)
    target = "h100" if tiny else None
    converted = mpgraph.convert(model, (x,), dtype=FP16, target=target)
    graphed = mpgraph.cuda_graph(converted)  # one graph for this input shape, on the first call
    default = mpgraph.convert(model, (x,), target=target)  # no dtype: the plan's own choice
    # the estimate for a replayed run (the plan is the same; only the cost model's host term differs)
    replay_plan = mpgraph.convert(model, (x,), dtype=FP16, target=target, runtime="graphs",
                                  check=False).plan
    half = copy.deepcopy(model).half()

    def autocast(inp):
        with torch.autocast(device, dtype=FP16):
            return model(inp)

    variants = {"fp32": model, "autocast": autocast,
                ".half()": lambda inp: half(inp.half() if inp.is_floating_point() else inp),
                "mpgraph": converted, "mpgraph CUDA graph": graphed, "mpgraph default": default}
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
            errors[k] = relative_l2(out, ref)
            f(x)
            if "compile" in k:
                print(f"#   {name} {k}: first calls {time.perf_counter() - t:.1f}s", flush=True)
        times = {k: [] for k in variants}
        for _ in range(3):  # interleaved blocks of rounds
            for k, f in variants.items():
                times[k].append(_cuda_ms(f, x, rounds))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# {name}: {converted.plan.summary()}", flush=True)
    print(f"# {name} default: {default.plan.summary()}", flush=True)

    def estimated(plan):
        e = plan.estimate
        return e["fp32_s"] / e["plan_s"] if e.get("plan_s") else float("nan")
    print(f"# {name} estimated vs measured speed-up over fp32: mpgraph "
          f"{estimated(converted.plan):.2f}x vs {med['fp32'] / med['mpgraph']:.2f}x; CUDA graph "
          f"{estimated(replay_plan):.2f}x vs {med['fp32'] / med['mpgraph CUDA graph']:.2f}x; default "
          f"{estimated(default.plan):.2f}x vs {med['fp32'] / med['mpgraph default']:.2f}x", flush=True)
    print(f"# {name} mpgraph CUDA graph: {graphed.stats}", flush=True)
    size = "x".join(map(str, x.shape))
    for k in variants:
        rows.append(f"| {name} | {size} | {k} | {med[k]:.2f} | {med['fp32'] / med[k]:.2f}× | "
                    f"{med['autocast'] / med[k]:.2f}× | {med['.half()'] / med[k]:.2f}× | "
                    f"{errors[k]:.2e} |")
    return rows


def _classifier(name: str, tiny: bool):
    """(model in train mode, batch as keyword arguments with labels) for the training table:
    BERT-base sequence classification at 8x128, ResNet-50 image classification at 32x224²."""
    import transformers as hf
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "bert":
        cfg = hf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64, vocab_size=100) if tiny else hf.BertConfig()
        batch, seq = (2, 8) if tiny else (8, 128)
        return hf.BertForSequenceClassification(cfg).train(), {
            "input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
            "labels": torch.randint(0, 2, (batch,), generator=g)}
    cfg = hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 16, 16, 16], depths=[1, 1, 1, 1]) \
        if tiny else hf.ResNetConfig()
    batch, size = (2, 32) if tiny else (32, 224)
    return hf.ResNetForImageClassification(cfg).train(), {
        "pixel_values": torch.randn(batch, 3, size, size, generator=g),
        "labels": torch.randint(0, cfg.num_labels, (batch,), generator=g)}


def training_rows(name: str, steps: int, tiny: bool = False) -> list[str]:
    """ms per step (forward, backward, AdamW step, fp16 with a GradScaler) of fp32, autocast and
    mpgraph mode="train", interleaved, median of ``steps`` steps each after 3 warm-up steps."""
    device = "cpu" if tiny else "cuda"
    model, batch = _classifier(name, tiny)
    model, batch = model.to(device), {k: v.to(device) for k, v in batch.items()}
    converted = mpgraph.convert(model, example_kwargs=batch, dtype=FP16, mode="train",
                                target="h100" if tiny else None)
    models = {"fp32": copy.deepcopy(model), "autocast": copy.deepcopy(model), "mpgraph train": converted}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5) for k, m in models.items()}
    scalers = {k: torch.amp.GradScaler(device, enabled=k != "fp32") for k in models}

    def step(k):
        opts[k].zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=FP16, enabled=k == "autocast"):
            loss = models[k](**batch).loss
        scalers[k].scale(loss).backward()
        scalers[k].step(opts[k])
        scalers[k].update()
        return float(loss)

    losses = {k: [step(k) for _ in range(3)][-1] for k in models}  # warm-up
    times = {k: [] for k in models}
    for _ in range(steps):
        for k in models:
            times[k].append(_cuda_ms(lambda _x, k=k: step(k), next(iter(batch.values())), 1))
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = torch.cuda.max_memory_allocated() / 2**30 if not tiny else float("nan")
    return [f"| {name} | {k} | {med[k]:.2f} | {med['fp32'] / med[k]:.2f}× | "
            f"{med['autocast'] / med[k]:.2f}× | {losses[k]:.4f} |" for k in models] + \
        ([f"# {name}: peak CUDA memory of the process {peak:.2f} GiB"] if not tiny else [])


def bert_tensor_cores(tiny: bool = False) -> list[str]:
    model, x = build_model("bert", 8, tiny)
    if tiny:  # (--tiny: one of the tiny BERT's 12 layers, profiled once: the lines come out)
        model.encoder.layer = model.encoder.layer[:1]
        model.config.num_hidden_layers = 1
    device = "cpu" if tiny else "cuda"
    model, x = model.to(device), x.to(device)
    converted = mpgraph.convert(model, (x,), dtype=FP16, target="h100" if tiny else None)
    result = mpgraph.profile(converted, (x,), iters=1 if tiny else 5)
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


def calibration_lines(tiny: bool = False) -> list[str]:
    """Time what the roofline rests on here (matmul per dtype, a copy, GELU, a tiny op's host
    time) and write the calibration file that plans for this GPU made elsewhere then read (copy
    it to the same place under ``~/.cache/mpgraph`` on the machine that plans)."""
    import tempfile
    from mpgraph.cost.device import resolve_target
    from mpgraph.cost.roofline import measure_calibration, write_calibration
    spec = resolve_target("h100" if tiny else "cuda")  # --tiny: any GPU's peaks, CPU timings
    data = measure_calibration(spec, "cpu" if tiny else "cuda", size=256 if tiny else 4096)
    path = write_calibration(spec, data, os.path.join(tempfile.mkdtemp(), "calibration.json")
                             if tiny else None)
    eff = ", ".join(f"{k} {v:.2f}" for k, v in data["efficiency"].items())
    return [f"Calibration for {spec.name}: host time a node {data['host_per_node_s'] * 1e6:.1f} "
            f"us; efficiency against the peaks: {eff}; written to {path}"]


def emit(lines: list[str], part, *args) -> None:
    """Print a part's lines as they come (a run cut short by a time limit keeps what it made) and
    keep them for --out; a part that fails prints its error and the rest still run."""
    try:
        new = part(*args) if callable(part) else part
    except Exception as e:  # a GPU session has one try: one model's failure must not end it
        import traceback
        traceback.print_exc()
        new = [f"FAILED {getattr(part, '__name__', part)}{args[:1]}: {type(e).__name__}: {e}"]
    print("\n".join(new), flush=True)
    lines += new


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[*SIZES, "llama4", "t5"], choices=MODELS)
    parser.add_argument("--batch", type=int, default=None,
                        help="batch for every model (1: 1x16 tokens, one image); default per model")
    parser.add_argument("--compile-models", nargs="*", default=["bert", "resnet50"],
                        help="models also timed under torch.compile ('none' for none)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--train-models", nargs="*", default=["bert", "resnet50"],
                        choices=["bert", "resnet50"], help="the training-step table ('' for none)")
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny widths on the CPU: checks the script runs, measures no GPU")
    args = parser.parse_args()
    if args.tiny:
        args.rounds = min(args.rounds, 3)
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here: nothing to check (this script is for a GPU machine)")
        return 1
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    start = time.time()
    gpu = "CPU (--tiny smoke run)" if args.tiny else torch.cuda.get_device_name(0)
    lines: list[str] = []
    emit(lines, [f"{time.strftime('%Y-%m-%d')} {gpu}, torch {torch.__version__}, fp16, median of "
             f"{args.rounds}-call blocks ({'perf_counter' if args.tiny else 'CUDA events'})", "",
             "| model | input | variant | median ms | vs fp32 | vs autocast | vs .half() | "
             "rel. L2 error |",
             "|---|---|---|---:|---:|---:|---:|---:|"])
    for name in args.models:
        emit(lines, model_rows, name, args.rounds, name in args.compile_models, args.batch, args.tiny)
    if args.train_models:
        emit(lines, ["", "Training steps (fp16, GradScaler, AdamW), ms per step:", "",
                  "| model | variant | median ms | vs fp32 | vs autocast | loss after warm-up |",
                  "|---|---|---:|---:|---:|---:|"])
        for name in args.train_models:
            emit(lines, training_rows, name, args.train_steps, args.tiny)
    emit(lines, [""])
    emit(lines, bert_tensor_cores, args.tiny)
    emit(lines, [""])
    emit(lines, calibration_lines, args.tiny)
    emit(lines, [f"total {time.time() - start:.0f} s"])
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if any(line.startswith("FAILED") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
