import subprocess
import sys

import torch

from mpgraph import cli, demo


def test_demo_converts_checks_and_times(capsys):
    assert cli.main(["demo", "--model", "transformer", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "== transformer on cpu" in out
    assert "converted " in out and " casts" in out
    err = float(out.split("relative L2 error vs float32: ")[1].split()[0])
    assert err < 2e-2
    assert "eager median latency" in out


def test_demo_cnn_runs_in_bf16_on_this_cpu():
    r = demo.run("cnn", rounds=1)
    assert r.dtype == torch.bfloat16
    assert r.rel_err < 2e-2 and r.fp32_ms > 0 and r.mpgraph_ms > 0


def test_console_script_reports_bad_dtype():
    proc = subprocess.run([sys.executable, "-m", "mpgraph", "demo", "--dtype", "int8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "dtype must be torch.float16 or torch.bfloat16" in proc.stderr
