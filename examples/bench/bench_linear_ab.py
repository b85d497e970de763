"""The 1024^3 Linear of issue 26, mpgraph's default against ``model.to(torch.bfloat16)`` alone:
the two called in turn (and mpgraph's module with its bf16 linear run by ATen instead of over the
packed weight, to show what packing gives), median of the rounds. Both take the float32 input;
``.to(bf16)`` returns bf16, mpgraph float32 (its output cast is part of its time). Beside them,
like for like: ``.to(bf16)`` with its output cast to float32, and mpgraph with
``keep_io_types=False`` (bf16 in and out, as ``.to(bf16)``).

    python examples/bench/bench_linear_ab.py --rows 1024 --rounds 60
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import mpgraph


class _Unpacked:
    """What the converted module's code calls for its marked linears, run by ATen's op."""

    def module(self, mod, x):
        return mod(x)

    def linear(self, x, w, b=None):
        return torch.nn.functional.linear(x, w, b)

    def addmm(self, b, x, w):
        return torch.addmm(b, x, w)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=60)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024)).eval()
    x = torch.randn(a.rows, 1024)
    fast = mpgraph.convert(model, (x,))
    unpacked = mpgraph.convert(model, (x,))
    unpacked.__dict__["_cpu_linears"] = _Unpacked()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16_out = mpgraph.convert(model, (x,), keep_io_types=False)  # (takes and returns its
    low = bf16_out.plan.dtype if bf16_out.plan.dtype in (torch.bfloat16, torch.float16) \
        else torch.float32                                          # plan's dtype: bf16 here)
    runs = {"model.to(bf16)": lambda: bf16(x.bfloat16()), "mpgraph": lambda: fast(x),
            "mpgraph, unpacked": lambda: unpacked(x),
            # what returning the model's float32 costs either: the output cast
            "model.to(bf16), float32 out": lambda: bf16(x.bfloat16()).float(),
            "mpgraph, keep_io_types=False": lambda: bf16_out(x.to(low))}
    times = {k: [] for k in runs}
    with torch.no_grad():
        for fn in runs.values():
            fn()
        for _ in range(a.rounds):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{fast.plan.dtype}, {torch.get_num_threads()} threads, {a.rows}x1024x1024, "
          f"{a.rounds} rounds, median ms:")
    for name, t in ms.items():
        print(f"  {name:30s} {t:8.3f}  ({ms['model.to(bf16)'] / t:.2f}x model.to(bf16))")


if __name__ == "__main__":
    main()
