"""mpgraph's fp16 ONNX export against the two fp16 converters people use today.

BERT-base and GPT-2 small (random weights from their configs) are exported to fp32 ONNX with the
same exporter mpgraph uses (torch.onnx.export(dynamo=True), at the same opset), then converted by
``onnxconverter_common.float16.convert_float_to_float16(keep_io_types=True)`` and
``onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True)``; mpgraph exports
its own plan. Every file is measured the same way (``mpgraph.tools.onnx_check.inspect_model`` after ONNX
shape inference) and run on onnxruntime's CPU provider.

    python examples/bench/compare_onnx_fp16.py                 # opsets 18 and 23, both models
    python examples/bench/compare_onnx_fp16.py --opsets 23 --models bert
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings

import numpy as np
import onnx
import torch

import mpgraph
from mpgraph.numerics import relative_l2
from mpgraph.tools.onnx_check import inspect_model, load_with_types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bert as bert_example  # noqa: E402  (examples/bert.py)
import gpt2 as gpt2_example  # noqa: E402

BUILDERS = {"bert": bert_example.build, "gpt2": gpt2_example.build}


def _run(path: str, feeds: dict):
    try:
        session = mpgraph.ort_session(path, device="cpu")
    except Exception as e:
        text = str(e).splitlines()[0]
        return None, text.split("failed:", 1)[-1].strip()[:70]
    try:
        return session.run(None, feeds)[0], None
    except Exception as e:
        return None, "run failed: " + str(e).splitlines()[0][:100]


def _row(model_name, opset, tool, path, feeds, ref, layers):
    out, why = _run(path, feeds)
    try:
        stats = inspect_model(load_with_types(path))
    except Exception as e:  # a file shape inference cannot read
        return {"model": model_name, "opset": opset, "tool": tool, "loads": "no", "casts": "-",
                "per_layer": "-", "share": "-", "fp32_ops": f"unreadable: {str(e)[:60]}", "err": "-"}
    err = "-" if out is None else f"{relative_l2(out, ref):.2e}"
    low = stats.low_fp32_ops
    return {"model": model_name, "opset": opset, "tool": tool,
            "loads": "yes" if out is not None else f"no: {why}",
            "casts": str(stats.casts), "per_layer": f"{stats.casts / layers:.1f}",
            "share": f"{stats.low_flop_share:.1%}",
            "fp32_ops": "yes" if not low else f"no ({len(low)} in fp16)", "err": err}


def compare(model_name: str, opset: int, workdir: str) -> list[dict]:
    from onnxconverter_common import float16 as occ
    from onnxruntime.transformers import float16 as ortf16

    model, args, kwargs = BUILDERS[model_name](batch=2, seq=128)
    layers = model.config.num_hidden_layers
    feeds = {"input_ids": args[0].numpy(), "attention_mask": kwargs["attention_mask"].numpy()}
    with torch.no_grad():
        ref = model(*args, **kwargs).last_hidden_state.numpy()
    fp32_path = os.path.join(workdir, f"{model_name}_{opset}_fp32.onnx")
    torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, opset_version=opset,
                      verbose=False).save(fp32_path)
    rows = [_row(model_name, opset, "fp32 (reference)", fp32_path, feeds, ref, layers)]
    for tool, fn in (("onnxconverter-common", occ.convert_float_to_float16),
                     ("onnxruntime.transformers", ortf16.convert_float_to_float16)):
        path = os.path.join(workdir, f"{model_name}_{opset}_{tool}.onnx")
        try:
            converted = fn(onnx.load(fp32_path), keep_io_types=True)
            onnx.save(converted, path)
        except Exception as e:
            rows.append({"model": model_name, "opset": opset, "tool": tool,
                         "loads": f"conversion failed: {str(e)[:80]}", "casts": "-", "per_layer": "-",
                         "share": "-", "fp32_ops": "-", "err": "-"})
            continue
        rows.append(_row(model_name, opset, tool, path, feeds, ref, layers))
    path = os.path.join(workdir, f"{model_name}_{opset}_mpgraph.onnx")
    mpgraph.export_onnx(model, args, path, example_kwargs=kwargs, dtype="fp16", opset=opset,
                        validate=False)
    rows.append(_row(model_name, opset, "mpgraph", path, feeds, ref, layers))
    for r in rows:
        print(f"# {r}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert", "gpt2"], choices=sorted(BUILDERS))
    ap.add_argument("--opsets", nargs="+", type=int, default=[18, 23])
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models:
            for opset in args.opsets:
                rows += compare(name, opset, workdir)
    print("\n| model | opset | tool | loads in onnxruntime | Cast nodes | per layer | matmul FLOPs in fp16 "
          "| LayerNorm/Softmax/reductions read fp32 | rel. L2 error (ORT CPU) |")
    print("|---|---|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['opset']} | {r['tool']} | {r['loads']} | {r['casts']} | "
              f"{r['per_layer']} | {r['share']} | {r['fp32_ops']} | {r['err']} |")


if __name__ == "__main__":
    main()
