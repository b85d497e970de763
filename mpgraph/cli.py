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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mpgraph", description="Whole-graph mixed precision for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the passes do")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="convert the built-in models, check them against fp32, time them")
    d.add_argument("--model", choices=["transformer", "cnn", "all"], default="all")
    d.add_argument("--dtype", default="auto", help="auto (what this machine is fast at), fp16 or bf16")
    d.add_argument("--rounds", type=int, default=10, help="timed calls of each variant")
    d.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"mpgraph: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
