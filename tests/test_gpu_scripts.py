"""The GPU scripts run end to end before a GPU session spends its minutes on them: their CPU smoke
modes (tiny widths, every variant, the same code paths but CUDA's) on this machine.

They measure nothing here; what is checked is that every table row comes out, with finite
numbers, and that the script exits 0.
"""
import math
import pathlib
import re
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "examples" / "bench"


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, script, *args], cwd=BENCH, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _rows(text: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first} |")]


@pytest.mark.slow
def test_gpu_check_runs_every_variant_and_the_training_table_on_the_cpu():
    # (--rounds 1: one call a variant per block; the table is checked for finite numbers only)
    out = _run("gpu_check.py", "--tiny", "--rounds", "1", "--models", "t5",
               "--compile-models", "none", "--train-models", "bert", "--train-steps", "2")
    for model in ("t5",):
        rows = [r for r in _rows(out, model) if len(r) == 8]
        assert [r[2] for r in rows] == ["fp32", "autocast", ".half()", "mpgraph",
                                        "mpgraph CUDA graph", "mpgraph default"], out
        assert all(math.isfinite(float(r[3])) and float(r[7]) < 1e-2 for r in rows), rows
    assert re.search(r"# t5 estimated vs measured speed-up over fp32: mpgraph [\d.]+x vs [\d.]+x; "
                     r"CUDA graph [\d.]+x vs [\d.]+x; default [\d.]+x vs [\d.]+x", out), out
    train = [r for r in _rows(out, "bert") if len(r) == 6]
    assert [r[1] for r in train] == ["fp32", "autocast", "mpgraph train"], out
    assert all(math.isfinite(float(r[5])) for r in train)
    assert re.search(r"\d+ matmul-class nodes, \d+ on Tensor Core kernels", out) and "total" in out
    calibration = re.search(r"Calibration for NVIDIA H100.*: host time a node ([\d.]+) us; "
                            r"efficiency against the peaks: fp32 [\d.]+.*written to (\S+)", out)
    assert calibration and float(calibration[1]) > 0, out[-2000:]
    assert pathlib.Path(calibration[2]).exists()


@pytest.mark.slow
def test_bench_generate_runs_on_the_cpu():
    # (8 prompt + 4 new tokens, not --tiny's 16 + 16: each variant generates three times, and the
    # rows check that the columns come out, finite, not what the length would measure)
    out = _run("bench_generate.py", "--tiny", "--batches", "1", "--reps", "1", "--prompt", "8",
               "--new", "4")
    rows = [r for r in _rows(out, "1") if len(r) == 9]
    assert [r[1] for r in rows] == ["fp32", "autocast", ".half()", "mpgraph eager"], out
    for r in rows:
        ttft, per = float(r[2]), float(r[3])
        assert math.isfinite(ttft) and ttft > 0 and math.isfinite(per), r
        shares = [float(c.rstrip("%")) for c in r[5:8]]
        assert all(0 <= x <= 100 for x in shares) and float(r[8]) < 0.05, r
    assert rows[0][6] == "100.0%" and float(rows[0][8]) == 0  # fp32 against itself
