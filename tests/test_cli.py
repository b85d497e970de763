import subprocess
import sys

import torch

from mpgraph import cli, demo
from mpgraph.cost.device import auto_dtype, resolve_target
from mpgraph.cost.specs import GPU_SPECS, DeviceSpec


def test_demo_converts_checks_and_times_where_low_precision_pays(capsys):
    """About this machine: timed where its low precision is faster, a GPU plan run for its
    numbers where it is not (an AVX2-only CPU), in both cases a real conversion."""
    fast = auto_dtype(resolve_target("cpu"))[0]
    assert cli.main(["demo", "--model", "transformer", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "== transformer on cpu, planned for " in out
    converted = int(out.split("converted ")[1].split("/")[0])
    assert converted > 0 and " casts" in out
    err = float(out.split("relative L2 error vs float32: ")[1].split()[0])
    assert err < 2e-2
    if fast is not None:
        assert "eager median latency" in out and "not measured" not in out
    else:
        assert f"planned for {GPU_SPECS[demo.STAND_IN_GPU].name}: float16" in out
        assert "eager speed: not measured" in out and "eager median latency" not in out


def test_demo_on_a_cpu_where_low_precision_is_slower_plans_for_a_gpu(monkeypatch):
    slow = DeviceSpec("AVX2-only CPU", "cpu", {"fp32": 89e9, "bf16": 0.97e9, "fp16": 0.9e9},
                      20e9, 2, 2e-6, tile=1, source="measured on this CPU, flags avx2")
    monkeypatch.setattr(demo, "resolve_target", lambda name: slow)
    r = demo.run("cnn", rounds=1)
    assert r.dtype == torch.float16 and r.target == GPU_SPECS[demo.STAND_IN_GPU].name
    assert "low precision is slower than float32 on this CPU" in r.dtype_reason
    assert r.speedup is None and r.fp32_ms is None
    assert "converted 18/18 nodes to float16" in r.summary and r.rel_err < 4e-3


def test_console_script_reports_bad_dtype():
    proc = subprocess.run([sys.executable, "-m", "mpgraph", "demo", "--dtype", "int8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "dtype must be torch.float16 or torch.bfloat16" in proc.stderr
