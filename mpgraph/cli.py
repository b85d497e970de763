"""The ``mpgraph`` command line. Printing happens here and nowhere else in the package."""
from __future__ import annotations

import argparse
import logging
import sys

from .api import resolve_dtype


def _demo(args) -> int:
    from . import demo
    names = ["transformer", "cnn"] if args.model == "all" else [args.model]
    dtype = resolve_dtype(args.dtype) if args.dtype != "auto" else None
    for name in names:
        r = demo.run(name, dtype=dtype, rounds=args.rounds)
        print(f"== {name} on {r.device}: {str(r.dtype).replace('torch.', '')} ({r.dtype_reason})")
        print(r.summary)
        print(r.casts)
        print(f"relative L2 error vs float32: {r.rel_err:.2e}")
        print(f"eager median latency: float32 {r.fp32_ms:.1f} ms, mpgraph {r.mpgraph_ms:.1f} ms "
              f"-> {r.speedup:.2f}x")
        print()
    return 0


def load_factory(spec: str):
    """``path/to/file.py:name`` or ``package.module:name`` -> the callable it names."""
    import importlib
    import importlib.util
    import os

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"expected FILE.py:factory or module:factory, got {spec!r}")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise ValueError(f"no such file: {where}")
        module_spec = importlib.util.spec_from_file_location(f"_mpgraph_factory_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{where} has no callable {name!r}")
    return factory


def build_from(spec: str):
    """Call a factory; it returns (model, example_inputs) or (model, example_inputs, example_kwargs)."""
    built = load_factory(spec)()
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise ValueError(f"{spec} must return (model, example_inputs[, example_kwargs])")
    model, inputs = built[0], built[1]
    kwargs = built[2] if len(built) == 3 else None
    return model, inputs, kwargs


def _export(args) -> int:
    from .errors import MpgraphError
    from .onnx_export import export_onnx
    model, inputs, kwargs = build_from(args.factory)
    try:
        result = export_onnx(model, inputs, args.output, dtype=args.dtype, opset=args.opset,
                             example_kwargs=kwargs, validate=not args.no_validate,
                             target=args.target, strategy=args.strategy,
                             **({"external_data_threshold": args.external_data_threshold}
                                if args.external_data_threshold is not None else {}))
    except MpgraphError as e:
        print(f"mpgraph: export failed: {e}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0


def _inspect(args) -> int:
    from .api import convert
    from .errors import MpgraphError
    from .report import report
    model, inputs, kwargs = build_from(args.factory)
    try:
        converted = convert(model, inputs, example_kwargs=kwargs, dtype=args.dtype,
                            target=args.target, strategy=args.strategy)
    except MpgraphError as e:
        print(f"mpgraph: inspect failed: {e}", file=sys.stderr)
        return 1
    print(report(converted, "text"), end="")
    for fmt in ("html", "json", "dot"):
        path = getattr(args, fmt)
        if path:
            report(converted, fmt, path)
            print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mpgraph", description="Whole-graph mixed precision for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the passes do")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="convert the built-in models, check them against fp32, time them")
    d.add_argument("--model", choices=["transformer", "cnn", "all"], default="all")
    d.add_argument("--dtype", default="auto", help="auto (what this machine is fast at), fp16 or bf16")
    d.add_argument("--rounds", type=int, default=10, help="timed calls of each variant")
    d.set_defaults(func=_demo)
    e = sub.add_parser("export", help="convert a model and export it to ONNX with the plan's types")
    e.add_argument("factory", help="FILE.py:name or module:name returning (model, inputs[, kwargs])")
    e.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    e.add_argument("--dtype", default="fp16", help="fp16 (default) or bf16")
    e.add_argument("--opset", type=int, default=None, help="ONNX opset (default 23)")
    e.add_argument("--target", default=None,
                   help="GPU the file is for: h100, a100, t4, l4, ... (default: this GPU, else a100)")
    e.add_argument("--strategy", choices=["optimal", "rules"], default="optimal",
                   help="cost-optimal placement on the target (default) or the op-list rules")
    e.add_argument("--no-validate", action="store_true", help="skip the checker/onnxruntime proof")
    e.add_argument("--external-data-threshold", type=int, default=None,
                   help="bytes of weights above which they go to FILE.onnx.data")
    e.set_defaults(func=_export)
    i = sub.add_parser("inspect", help="convert a model and report every decision and cast")
    i.add_argument("factory", help="FILE.py:name or module:name returning (model, inputs[, kwargs])")
    i.add_argument("--dtype", default="auto", help="auto (what the target is fast at), fp16 or bf16")
    i.add_argument("--target", default=None, help="cpu, h100, a100, t4, ... (default: this machine)")
    i.add_argument("--strategy", choices=["optimal", "rules"], default="optimal")
    i.add_argument("--html", help="write the self-contained HTML report here")
    i.add_argument("--json", help="write the plan as JSON here (mpgraph.Plan.load reads it)")
    i.add_argument("--dot", help="write the Graphviz source here")
    i.set_defaults(func=_inspect)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"mpgraph: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
