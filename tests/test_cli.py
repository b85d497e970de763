import re
import subprocess
import sys

import pytest
import torch

from mpgraph import cli, demo
from mpgraph.cost.device import auto_dtype, resolve_target
from mpgraph.cost.specs import GPU_SPECS, DeviceSpec


def test_demo_converts_checks_and_times_where_low_precision_pays(capsys):
    """About this machine: timed (measured beside estimated) where some node is faster in low
    precision by this CPU's own measured op times, a GPU plan run for its numbers where none is
    (an AVX2-only CPU), in both cases a real conversion."""
    assert cli.main(["demo", "--model", "transformer", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "== transformer on cpu, planned for " in out
    converted = int(out.split("converted ")[1].split("/")[0])
    assert converted > 0 and " casts" in out
    err = float(out.split("relative L2 error vs float32: ")[1].split()[0])
    assert err < 2e-2
    if f"planned for {GPU_SPECS[demo.STAND_IN_GPU].name}" in out:
        assert "no node is faster in float16 or bfloat16 than in float32" in out
        assert "eager speed: not measured" in out and "eager median latency" not in out
    else:
        assert re.search(r"-> [\d.]+x measured, [\d.]+x estimated", out), out


def test_demo_on_a_cpu_where_low_precision_is_slower_plans_for_a_gpu(monkeypatch):
    slow = DeviceSpec("AVX2-only CPU", "cpu", {"fp32": 89e9, "bf16": 0.97e9, "fp16": 0.9e9},
                      20e9, 2, 2e-6, tile=1, source="measured on this CPU, flags avx2")
    original = demo.convert
    # this machine as an AVX2-only CPU: its roofline (no op measured) says nothing pays
    monkeypatch.setattr(demo, "convert", lambda *a, **k: original(
        *a, **{**k, "target": slow if k.get("target") is None else k["target"]}))
    r = demo.run("cnn", rounds=1)
    assert r.dtype == torch.float16 and r.target == GPU_SPECS[demo.STAND_IN_GPU].name
    assert "no node is faster in float16 or bfloat16 than in float32 on AVX2-only CPU" \
        in r.dtype_reason
    assert r.speedup is None and r.fp32_ms is None and r.estimated > 1
    assert "converted 13/17 nodes to float16" in r.summary and r.rel_err < 4e-3


def test_console_script_reports_bad_dtype():
    proc = subprocess.run([sys.executable, "-m", "mpgraph", "demo", "--dtype", "int8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "dtype must be torch.float16 or torch.bfloat16" in proc.stderr


FACTORY = '''import logging, warnings
import torch, torch.nn as nn

def build(batch: int = 16, seq: int = 64):
    warnings.warn("a third-party deprecation", FutureWarning)
    logging.getLogger("torch.export").error("torch narrating something")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(seq, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.randn(batch, seq)
'''


def test_cli_shows_stage_progress_and_keeps_third_party_noise_for_verbose(tmp_path):
    """Run as a user would (a real stderr, torch's own log handlers included)."""
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)

    def cli_run(*argv):
        proc = subprocess.run([sys.executable, "-m", "mpgraph", *argv], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr

    out, err = cli_run("--progress", "inspect", f"{factory}:build", "--dtype", "fp16",
                       "--target", "a100", "--runtime", "graphs", "--batch", "4", "--seq", "32")
    lines = err.splitlines()
    stages = [line.split(" ...")[0] for line in lines[:6]]
    assert stages == ["mpgraph: capture", "mpgraph: prepare", "mpgraph: calibrate",
                      "mpgraph: decide", "mpgraph: rewrite", "mpgraph: check"], err
    assert all(line.endswith(" s") for line in lines[:6])
    # then mpgraph's own warning, one line: an fp16 plan calibrated on the example batch alone
    assert len(lines) == 7 and lines[6].startswith("mpgraph: warning: the float16 plan was "
                                                   "calibrated on one batch"), err
    # the factory got --batch and --seq: the input cast moves 4 x 32 values, M is 4
    assert re.search(r"float32 -> float16\s+128\s", out) and "pad M 4->8" in out
    # -v: the third-party warning and log record are shown; no progress when not asked for
    _, err = cli_run("-v", "--no-progress", "inspect", f"{factory}:build", "--dtype", "fp16",
                     "--target", "a100")
    assert "third-party deprecation" in err and "torch narrating something" in err
    assert "mpgraph: capture" not in err


def test_cli_passes_sizes_only_to_factories_that_take_them(tmp_path, capsys):
    factory = tmp_path / "plain.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n    return nn.Linear(8, 8), torch.randn(2, 8)\n")
    assert cli.main(["inspect", f"{factory}:build", "--seq", "16", "--target", "a100"]) == 2
    assert "takes no seq argument (its parameters: none)" in capsys.readouterr().err


def test_cli_names_a_missing_module_and_a_size_below_one_without_a_traceback(capsys):
    """'no_such_module:build' printed a ModuleNotFoundError traceback (rc 1); --batch 0 failed
    inside the model's reshape, --seq -3 inside the factory."""
    assert cli.main(["inspect", "no_such_module:build"]) == 2
    assert "mpgraph: error: no module 'no_such_module'" in capsys.readouterr().err
    for size in (["--batch", "0"], ["--seq", "-3"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["inspect", "examples/bert.py:build", *size])
        assert exit_.value.code == 2
        assert "expected a size of 1 or more" in capsys.readouterr().err


def test_cli_checks_a_report_path_before_converting(tmp_path, capsys):
    factory = tmp_path / "plain.py"
    factory.write_text("raise SystemExit('the factory was loaded')\n")  # (not reached)
    assert cli.main(["inspect", f"{factory}:build", "--json",
                     str(tmp_path / "missing" / "x.json")]) == 2
    assert "cannot write --json" in capsys.readouterr().err


def test_cli_prints_mpgraph_warnings_as_one_line(tmp_path, capsys):
    factory = tmp_path / "small.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n    return nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8)\n")
    assert cli.main(["inspect", f"{factory}:build", "--dtype", "fp16", "--target", "h100"]) == 0
    err = capsys.readouterr().err
    # an 8x8 matmul does not pay for its casts on an H100: said once, as mpgraph's own line
    assert err.count("mpgraph: warning: dtype=float16 converted 0 of 1 matmul/conv nodes") == 1
    assert "UserWarning" not in err and "warnings.warn" not in err


def test_cli_explain_lists_each_pass_with_its_time_and_facts(tmp_path, capsys):
    factory = tmp_path / "mlp.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), "
                       "nn.Linear(1024, 1024)), torch.randn(256, 1024)\n")
    assert cli.main(["inspect", f"{factory}:build", "--dtype", "fp16", "--target", "a100",
                     "--explain"]) == 0
    out = capsys.readouterr().out
    head, table = out.split("\n")[0], out.split("\n")[2:]
    count, total = re.match(r"pipeline: (\d+) passes, ([\d.]+) s", head).groups()
    rows = [line.split() for line in table[:int(count)]]
    names = [r[1] for r in rows]
    # the passes of every pipeline the conversion ran, in order, each once per run
    for earlier, later in (("Functionalize", "Calibrate"), ("Calibrate", "ClassifyOps"),
                           ("ClassifyOps", "NumericSafety"), ("NumericSafety", "InsertCasts"),
                           ("StoreWeights", "InsertCasts")):
        assert names.index(earlier) < names.index(later), names
    insert = rows[names.index("InsertCasts")]
    assert insert[0] == "rewrite" and insert[3] == "yes"  # it added casts
    assert abs(sum(float(r[2]) for r in rows) - float(total)) < 0.01 * int(count) + 0.01
    line = table[names.index("InsertCasts")]
    assert "precision" in line.split("->")[0] and "inserted_by" in line.split("->")[1]
    assert "range?" in table[names.index("ClassifyOps")]  # read where calibrated
    # with the dtype left to the cost model, each candidate's decisions are listed too
    assert cli.main(["inspect", f"{factory}:build", "--target", "a100", "--explain"]) == 0
    stages = [line.split()[:2] for line in capsys.readouterr().out.split("\n")[2:]
              if line.startswith("choose:")]
    assert ["choose:float16", "AssignPrecisionOptimal"] in stages
    assert ["choose:bfloat16", "AssignPrecisionOptimal"] in stages
