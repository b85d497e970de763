"""What conversion costs against what it is built on: torch.export and one fp32 forward.

Users convert in a loop (a tolerance, a target, an override, the report), so ``convert``,
``plan`` and ``export_onnx`` should cost a small multiple of the capture under them. Each model
runs in its own process; every quantity is measured ``--rounds`` times, interleaved (each round
measures all of them in turn, so a busy machine slows them alike), and the fastest round is
reported, wall seconds:

- ``torch.export.export(model, args, strict=False)``, static and with the dynamic shapes
  mpgraph's capture uses (``Dim.AUTO`` on every dimension > 1), and one fp32 forward (no_grad);
- ``mpgraph.convert(model, args, dtype="fp16", target="h100")``, defaults otherwise (a dynamic
  capture), with the seconds of each stage (the ``mpgraph.progress`` log records), and the same
  with ``dynamic=False`` (captured at the example's shapes);
- the 70B-shaped Llama on the meta device: ``mpgraph.plan`` (fp16, h100), default and
  ``dynamic=False``, against both exports of it, and the process's peak resident memory;
- ``mpgraph.export_onnx`` of BERT-base and GPT-2 at 2x64 (it converts, exports, validates) with
  dynamic batch and sequence (the default) and with ``dynamic_shapes=None``, against
  ``torch.onnx.export(model, args, dynamo=True)`` of the fp32 model with the same shapes.

Bars (issue 18), ratios from the same run: convert BERT-base 8x128 <= 2x (torch.export + one
fp32 forward); plan of the 70B meta Llama <= 1.5x torch.export of it, peak < 4 GiB; export_onnx
of BERT-base and GPT-2 <= 2x the fp32 torch.onnx.export. Each is printed like against like
(dynamic against dynamic, static against static) and, since the issue measured it so, the
default (dynamic) against the static export.

    python examples/bench/bench_convert.py > examples/bench/results_convert.txt
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings

CONVERT = ("bert", "gpt2", "vit", "resnet50")
ONNX = ("bert", "gpt2")
STAGES = ("capture", "prepare", "calibrate", "decide", "rewrite", "check", "export", "validate")


def _model(name: str, batch: int, seq: int):
    import torch
    import transformers as hf
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "bert":
        return hf.BertModel(hf.BertConfig()).eval(), torch.randint(0, 30522, (batch, seq), generator=g)
    if name == "gpt2":
        return (hf.GPT2Model(hf.GPT2Config(use_cache=False)).eval(),
                torch.randint(0, 50257, (batch, seq), generator=g))
    if name == "vit":
        return hf.ViTModel(hf.ViTConfig()).eval(), torch.randn(batch, 3, 224, 224, generator=g)
    if name == "resnet50":
        return hf.ResNetModel(hf.ResNetConfig()).eval(), torch.randn(batch, 3, 224, 224, generator=g)
    if name == "llama70b":
        cfg = hf.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                             num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                             use_cache=False)
        with torch.device("meta"):
            return hf.LlamaModel(cfg).eval(), torch.randint(0, 32000, (1, 128), device="meta")
    raise ValueError(name)


class _Stages(logging.Handler):
    """Collects the seconds of each stage from mpgraph's progress records."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[str, float] = {}

    def emit(self, record):
        s = getattr(record, "mpgraph_seconds", None)
        if s is not None:
            self.seconds[record.mpgraph_stage] = self.seconds.get(record.mpgraph_stage, 0.0) + s


def _timed(fn, stages: _Stages | None = None) -> dict:
    if stages is not None:
        stages.seconds = {}
    start = time.perf_counter()
    fn()
    out = {"s": time.perf_counter() - start}
    if stages is not None:
        out["stages"] = dict(stages.seconds)
    return out


def child(job: str, name: str, rounds: int) -> dict:
    """One model, in this process: every quantity ``rounds`` times, interleaved; the fastest."""
    import torch
    import mpgraph
    from mpgraph.frontend.capture import dynamic_spec

    warnings.simplefilter("ignore")
    logging.getLogger("mpgraph").setLevel(logging.ERROR)  # the summaries; progress stays on
    stages = _Stages()
    progress = logging.getLogger("mpgraph.progress")
    progress.setLevel(logging.INFO)
    progress.addHandler(stages)
    batch, seq = (2, 64) if job == "onnx" else (8, 128)
    model, x = _model(name, batch, seq)
    dyn = dynamic_spec(model, (x,), {})

    def forward():
        with torch.no_grad():
            model(x)

    work = {"export static": lambda: torch.export.export(model, (x,), strict=False),
            "export dynamic": lambda: torch.export.export(model, (x,), strict=False,
                                                          dynamic_shapes=dyn)}
    tmp = tempfile.mkdtemp()
    if job == "convert":
        work["fp32 forward"] = forward
        work["convert"] = lambda: mpgraph.convert(model, x, dtype="fp16", target="h100")
        work["convert static"] = lambda: mpgraph.convert(model, x, dtype="fp16", target="h100",
                                                         dynamic=False)
    elif job == "plan":
        work["plan"] = lambda: mpgraph.plan(model, x, dtype="fp16", target="h100")
        work["plan static"] = lambda: mpgraph.plan(model, x, dtype="fp16", target="h100",
                                                   dynamic=False)
    else:
        onnx_path, ours = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "mpgraph.onnx")
        work = {"torch.onnx static": lambda: torch.onnx.export(model, (x,), onnx_path, dynamo=True,
                                                               verbose=False),
                "torch.onnx dynamic": lambda: torch.onnx.export(model, (x,), onnx_path, dynamo=True,
                                                                verbose=False, dynamic_shapes=dyn),
                "export_onnx": lambda: mpgraph.export_onnx(model, (x,), ours),
                "export_onnx static": lambda: mpgraph.export_onnx(model, (x,), ours,
                                                                  dynamic_shapes=None)}
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for key, fn in work.items():
            got = _timed(fn, stages if key in ("convert", "plan", "export_onnx") else None)
            if key not in best or got["s"] < best[key]["s"]:
                best[key] = got
    out = {key: v["s"] for key, v in best.items()}
    out["stages"] = next((v["stages"] for v in best.values() if "stages" in v), {})
    out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def _machine() -> str:
    import torch
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("", platform.machine()):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = ", ".join(sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"}))
    return (f"{cpu} ({os.cpu_count()} cores; {isa or 'ISA unknown'}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch threads, Python {platform.python_version()}")


def _run(job: str, name: str, rounds: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", job, name, "--rounds", str(rounds)],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{job} {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _stages(r: dict) -> str:
    return " | ".join(f"{r['stages'].get(s, 0.0):.2f}" for s in STAGES[:6])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=list(CONVERT))
    parser.add_argument("--child", nargs=2, metavar=("JOB", "MODEL"))
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-onnx", action="store_true")
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(child(*opts.child, opts.rounds)))
        return
    print(f"# {_machine()}")
    print(f"# python examples/bench/bench_convert.py --rounds {opts.rounds}: each model in its "
          f"own process, fastest of {opts.rounds} interleaved rounds, wall seconds")
    print("\n## convert (fp16, target h100), 8x128 tokens or 8 images\n")
    print("Default capture (dynamic: every dimension > 1 symbolic) against the dynamic export, "
          "`dynamic=False` against the static one; the last column is the default against the "
          "static export.\n")
    print("| model | export static | export dynamic | fp32 forward | convert | convert dynamic=False "
          "| convert / (dynamic + fwd) | static convert / (static + fwd) | convert / (static + fwd) |")
    print("|---|" + "---:|" * 8)
    results = {}
    for name in opts.models:
        r = results[name] = _run("convert", name, opts.rounds)
        print(f"| {name} | {r['export static']:.2f} | {r['export dynamic']:.2f} | "
              f"{r['fp32 forward']:.2f} | {r['convert']:.2f} | {r['convert static']:.2f} | "
              f"{r['convert'] / (r['export dynamic'] + r['fp32 forward']):.2f} | "
              f"{r['convert static'] / (r['export static'] + r['fp32 forward']):.2f} | "
              f"{r['convert'] / (r['export static'] + r['fp32 forward']):.2f} |", flush=True)
    if opts.models:
        print("\nSeconds per stage of the default convert:\n")
        print("| model | " + " | ".join(STAGES[:6]) + " |")
        print("|---|" + "---:|" * 6)
        for name in opts.models:
            print(f"| {name} | {_stages(results[name])} |")
    if not opts.no_llama:
        r = results["llama70b"] = _run("plan", "llama70b", min(opts.rounds, 2))
        print("\n## plan of the 70B-shaped Llama (80 layers) on the meta device, 1x128\n")
        print("| export static | export dynamic | plan | plan dynamic=False | " +
              " | ".join(STAGES[:6]) + " | plan / dynamic | static plan / static | "
              "plan / static | peak GiB |")
        print("|" + "---:|" * 14)
        print(f"| {r['export static']:.2f} | {r['export dynamic']:.2f} | {r['plan']:.2f} | "
              f"{r['plan static']:.2f} | {_stages(r)} | {r['plan'] / r['export dynamic']:.2f} | "
              f"{r['plan static'] / r['export static']:.2f} | "
              f"{r['plan'] / r['export static']:.2f} | {r['peak_gib']:.2f} |", flush=True)
    if not opts.no_onnx:
        print("\n## export_onnx (fp16, validated) at 2x64\n")
        print("The default file has dynamic batch and sequence, against torch.onnx.export with the "
              "same dynamic shapes; `dynamic_shapes=None` against the static torch.onnx.export. "
              "Stages of the default.\n")
        print("| model | torch.onnx static | torch.onnx dynamic | export_onnx | export_onnx static "
              "| convert stages | export | validate | / dynamic | static / static | / static |")
        print("|---|" + "---:|" * 10)
        for name in ONNX:
            r = results[f"onnx {name}"] = _run("onnx", name, min(opts.rounds, 2))
            conv = sum(r["stages"].get(s, 0.0) for s in STAGES[:6])
            print(f"| {name} | {r['torch.onnx static']:.2f} | {r['torch.onnx dynamic']:.2f} | "
                  f"{r['export_onnx']:.2f} | {r['export_onnx static']:.2f} | {conv:.2f} | "
                  f"{r['stages'].get('export', 0.0):.2f} | {r['stages'].get('validate', 0.0):.2f} | "
                  f"{r['export_onnx'] / r['torch.onnx dynamic']:.2f} | "
                  f"{r['export_onnx static'] / r['torch.onnx static']:.2f} | "
                  f"{r['export_onnx'] / r['torch.onnx static']:.2f} |", flush=True)
    print("\n## bars (issue 18): like against like, then the default against the static export\n")
    bars = []
    if "bert" in results:
        r = results["bert"]
        bars += [("convert BERT-base 8x128 <= 2x (dynamic torch.export + fp32 forward)",
                  r["convert"] / (r["export dynamic"] + r["fp32 forward"]), 2.0),
                 ("convert BERT-base 8x128 dynamic=False <= 2x (static torch.export + fp32 forward)",
                  r["convert static"] / (r["export static"] + r["fp32 forward"]), 2.0),
                 ("convert BERT-base 8x128 <= 2x (static torch.export + fp32 forward)",
                  r["convert"] / (r["export static"] + r["fp32 forward"]), 2.0)]
    if "llama70b" in results:
        r = results["llama70b"]
        bars += [("plan 70B meta Llama <= 1.5x dynamic torch.export", r["plan"] / r["export dynamic"], 1.5),
                 ("plan 70B meta Llama dynamic=False <= 1.5x static torch.export",
                  r["plan static"] / r["export static"], 1.5),
                 ("plan 70B meta Llama <= 1.5x static torch.export", r["plan"] / r["export static"], 1.5),
                 ("plan 70B meta Llama peak memory < 4 GiB", r["peak_gib"], 4.0)]
    for name in ONNX:
        if f"onnx {name}" in results:
            r = results[f"onnx {name}"]
            bars += [(f"export_onnx {name} 2x64 <= 2x fp32 torch.onnx.export (dynamic)",
                      r["export_onnx"] / r["torch.onnx dynamic"], 2.0),
                     (f"export_onnx {name} 2x64 dynamic_shapes=None <= 2x fp32 torch.onnx.export (static)",
                      r["export_onnx static"] / r["torch.onnx static"], 2.0),
                     (f"export_onnx {name} 2x64 <= 2x fp32 torch.onnx.export (static)",
                      r["export_onnx"] / r["torch.onnx static"], 2.0)]
    for text, value, bar in bars:
        print(f"- {text}: {value:.2f} -> {'met' if value <= bar else 'NOT met'}")

if __name__ == "__main__":
    main()
