import os
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
    # the model's 15 nodes: the layout copy ChannelsLast adds before the 8th conv computes
    # nothing of the model's, and is not counted (it made 12/16, and counts changed with batch)
    assert "converted 11/15 nodes to float16" in r.summary and r.rel_err < 4e-3
    # calibrated on a few batches: no "calibrated on one batch" warning (printed twice)
    assert "warning" not in r.summary


def test_console_script_reports_bad_dtype():
    proc = subprocess.run([sys.executable, "-m", "mpgraph", "demo", "--dtype", "int8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "dtype must be torch.float16 or torch.bfloat16" in proc.stderr


FACTORY = '''import logging, warnings
import torch, torch.nn as nn
try:
    from transformers import GPT2Config
except ImportError:  # (test_cli_keeps_transformers_logs_for_verbose is skipped then)
    GPT2Config = None

def build(batch: int = 16, seq: int = 64):
    warnings.warn("a third-party deprecation", FutureWarning)
    logging.getLogger("torch.export").error("torch narrating something")
    if GPT2Config is not None:
        GPT2Config(vocab_size=1000)  # transformers logs that bos/eos_token_id 50256 lie outside it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(seq, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.randn(batch, seq)
'''


@pytest.fixture(scope="module")
def noisy_factory_runs(tmp_path_factory):
    """`mpgraph` run as a user would (a real stderr, torch's own log handlers included) on a
    factory whose model warns, logs through torch's logger and builds a transformers config:
    once with --progress and no -v, once with -v --no-progress. The two tests below (next to
    each other: one worker runs both) read the same two launches (each launch pays ~5 s of
    imports; they were four)."""
    factory = tmp_path_factory.mktemp("cli") / "factory.py"
    factory.write_text(FACTORY)
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}

    def cli_run(*argv):
        proc = subprocess.run([sys.executable, "-m", "mpgraph", *argv], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr

    quiet = cli_run("--progress", "inspect", f"{factory}:build", "--dtype", "fp16",
                    "--target", "a100", "--runtime", "graphs", "--batch", "4", "--seq", "32")
    verbose = cli_run("-v", "--no-progress", "inspect", f"{factory}:build", "--dtype", "fp16",
                      "--target", "a100")
    return quiet, verbose


def test_cli_shows_stage_progress_and_keeps_third_party_noise_for_verbose(noisy_factory_runs):
    """Run as a user would (a real stderr, torch's own log handlers included)."""
    (out, err), (_, verbose_err) = noisy_factory_runs
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
    err = verbose_err
    assert "third-party deprecation" in err and "torch narrating something" in err
    assert "mpgraph: capture" not in err


HF_FACTORY = '''import torch, torch.nn as nn
from transformers import GPT2Config

def build():
    GPT2Config(vocab_size=1000)  # transformers logs that bos/eos_token_id 50256 lie outside it
    return nn.Linear(8, 8), torch.randn(2, 8)
'''


def test_cli_keeps_transformers_logs_for_verbose(noisy_factory_runs, tmp_path, monkeypatch):
    """transformers set its logger's level itself when the factory imported it, over the CLI's:
    its config warnings reached stderr without -v. (The launches: the noisy factory's above,
    which builds a GPT2Config as HF_FACTORY does.)"""
    pytest.importorskip("transformers")
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    (_, err), (_, verbose_err) = noisy_factory_runs
    assert "bos_token_id must be" not in err
    assert "[transformers] Model config: bos_token_id must be" in verbose_err
    # in a library user's process, the CLI leaves transformers' settings as they were
    factory = tmp_path / "hf.py"
    factory.write_text(HF_FACTORY)
    assert cli.main(["inspect", f"{factory}:build", "--target", "a100", "--check", "off"]) == 0
    assert "TRANSFORMERS_VERBOSITY" not in os.environ


def test_cli_passes_sizes_only_to_factories_that_take_them(tmp_path, capsys):
    factory = tmp_path / "plain.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n    return nn.Linear(8, 8), torch.randn(2, 8)\n")
    assert cli.main(["inspect", f"{factory}:build", "--seq", "16", "--target", "a100"]) == 2
    assert "takes no seq argument (its parameters: none)" in capsys.readouterr().err


def test_cli_calibrate_names_a_factory_model_that_is_not_a_module(tmp_path, capsys):
    """`mpgraph calibrate` printed a traceback (AttributeError: 'str' object has no attribute
    'forward') where `mpgraph inspect` names the problem."""
    factory = tmp_path / "bad.py"
    factory.write_text("import torch\ndef build():\n    return 'model', torch.randn(2)\n")
    assert cli.main(["calibrate", f"{factory}:build"]) == 2
    assert "mpgraph: error: calibrate expects a torch.nn.Module, got str" in capsys.readouterr().err
    # --target without --gpu was ignored: the table of this machine, measured silently
    assert cli.main(["calibrate", f"{factory}:build", "--target", "a100"]) == 2
    assert ("mpgraph: calibrate --target a100 needs --gpu (a GPU's calibration file is written "
            "on that GPU)") in capsys.readouterr().err
    # (--target cpu names what calibrate measures without --gpu: the factory's error again)
    assert cli.main(["calibrate", f"{factory}:build", "--target", "cpu"]) == 2
    assert "needs --gpu" not in capsys.readouterr().err


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
    # a directory: said before converting, not as "[Errno 21] Is a directory" after it
    assert cli.main(["inspect", f"{factory}:build", "--html", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"mpgraph: error: cannot write --html {tmp_path}: it is a "
                                       "directory; name the file to write in it\n")


def test_cli_prints_mpgraph_warnings_as_one_line(tmp_path, capsys):
    factory = tmp_path / "small.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n    return nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8)\n")
    assert cli.main(["inspect", f"{factory}:build", "--dtype", "fp16", "--target", "h100"]) == 0
    err = capsys.readouterr().err
    # an 8x8 matmul does not pay for its casts on an H100: said once, as mpgraph's own line
    assert err.count("mpgraph: warning: dtype=float16 converted 0 of 1 matmul/conv nodes") == 1
    assert "UserWarning" not in err and "warnings.warn" not in err


MASKED_FACTORY = '''import torch, torch.nn as nn
class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 256)

    def forward(self, x, attention_mask):
        return self.fc(x) * attention_mask[..., None]

def build():
    torch.manual_seed(0)  # (README's example factories: an unpadded batch's all-ones mask)
    return Masked().eval(), (torch.randn(8, 64, 256),), {"attention_mask": torch.ones(8, 64)}
'''


def test_cli_says_the_calibration_warning_once_with_a_way_out_of_the_command_line(tmp_path,
                                                                                  capsys):
    """It was printed twice (stderr, and the summary's first line), said 'Pass calibration=[...]'
    as if the command line took it, and called an all-ones mask 'all zeros, or constant'."""
    factory = tmp_path / "masked.py"
    factory.write_text(MASKED_FACTORY)
    assert cli.main(["inspect", f"{factory}:build", "--dtype", "fp16", "--target", "a100",
                     "--check", "off"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.out
    warned = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warned) == 1 and warned[0].startswith(
        "mpgraph: warning: input attention_mask (all 1) held one value in every calibration "
        "batch and the float16 plan was calibrated on one batch: "), captured.err
    assert "in mpgraph.convert (the command line calibrates on the factory's example alone: " \
           "convert in Python with it, then export_onnx of the module it returns)" in warned[0]


def test_cli_shows_only_warnings_mpgraph_issues_itself(capsys):
    """torch.onnx.export's DeprecationWarning (stacklevel=2) pointed at mpgraph's call to it and
    was printed as 'mpgraph: warning: You are using the legacy TorchScript-based ONNX export'."""
    third, ours = {"__name__": "torch.onnx"}, {"__name__": "mpgraph.tools.calls_torch"}
    exec("import warnings\ndef export():\n    warnings.warn('legacy exporter', "
         "DeprecationWarning, stacklevel=2)\n    warnings.warn('a note', stacklevel=2)", third)
    exec("import warnings\ndef run(export):\n    export()\n    warnings.warn('ours')", ours)
    with cli._console(False, False):
        ours["run"](third["export"])
    assert capsys.readouterr().err == "mpgraph: warning: ours\n"
    import sys
    import warnings
    with warnings.catch_warnings():  # (as a command runs: not pytest's capture of warnings)
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, file=None, \
            line=None: sys.stderr.write(warnings.formatwarning(message, category, filename,
                                                               lineno, line))
        with cli._console(True, False):  # -v: Python's own filters and display
            ours["run"](third["export"])
    err = capsys.readouterr().err
    assert "UserWarning: a note" in err and "UserWarning: ours" in err


def test_cli_explain_lists_each_pass_with_its_time_and_facts(tmp_path, capsys):
    factory = tmp_path / "mlp.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), "
                       "nn.Linear(1024, 1024)), torch.randn(32, 1024)\n")  # (32 rows: still
    # a plan with casts on the A100; the pass list is the point, not the size)
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


def test_demo_takes_only_a_positive_round_count_and_says_why_nothing_was_timed(monkeypatch, capsys):
    """--rounds 0 timed nothing and blamed a plan for another device ("runs emulated here") for
    a plan made for this CPU."""
    for rounds in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["demo", "--model", "cnn", "--rounds", rounds])
        assert exit_.value.code == 2
        assert f"expected a count of 1 or more, got {rounds}" in capsys.readouterr().err
    stand_in = GPU_SPECS[demo.STAND_IN_GPU].name
    for target in ("CPU of this machine", stand_in):  # (demo.run's results, as run would give)
        monkeypatch.setattr(demo, "run", lambda name, target=target, **k: demo.DemoResult(
            name, torch.bfloat16, "chosen on the command line", "cpu", target, "summary",
            "casts", 1e-3, None, None, 2.5))
        assert cli.main(["demo", "--model", "cnn"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("eager"))
        if target == stand_in:
            # (the estimate of a plan replayed from CUDA graphs: printed as the eager one, 3.2x
            # the A100's eager estimate for the transformer)
            assert line == (f"eager speed: not measured (a plan for {stand_in} runs emulated "
                            "here); replayed from CUDA graphs there: 2.50x estimated")
        else:
            assert line == "eager speed: not measured (no timed rounds; 2.50x estimated)"


def test_cli_profile_checks_the_device_before_building_the_model(tmp_path, monkeypatch, capsys):
    """--device tpu and --device cuda without CUDA were torch tracebacks from moving the model."""
    factory = tmp_path / "plain.py"
    factory.write_text("raise SystemExit('the factory was loaded')\n")  # (not reached)
    assert cli.main(["profile", f"{factory}:build", "--device", "tpu"]) == 2
    assert capsys.readouterr().err == ("mpgraph: error: --device tpu: profile runs on cpu or cuda "
                                       "(cuda:N)\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["profile", f"{factory}:build", "--device", "cuda"]) == 2
    # the library's own words (mpgraph.profile(..., device="cuda") says the same)
    assert capsys.readouterr().err == "mpgraph: error: device='cuda' but torch sees no GPU\n"


META_FACTORY = '''import torch, torch.nn as nn
def build():
    with torch.device("meta"):  # README's large models: planned from shapes, weights loaded later
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    return model, (torch.randn(4, 16),)
'''


def test_cli_profile_refuses_a_meta_model_before_moving_it(tmp_path, capsys):
    """It died in torch at model.to(device): 'Cannot copy out of meta tensor ... use to_empty()'."""
    factory = tmp_path / "meta.py"
    factory.write_text(META_FACTORY)
    assert cli.main(["profile", f"{factory}:build", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpgraph: error: profile times {factory}:build's model running on "
                          "real values; it or its inputs hold tensors on the meta device"), err
    assert "load its weights" in err and "to_empty" not in err


USER_FACTORIES = '''import torch, torch.nn as nn
not_callable = 3

def build_raises():
    raise RuntimeError("boom in the user's factory")
'''


def test_cli_says_what_a_factory_name_is_and_what_the_factory_raised(tmp_path, capsys):
    """A name bound to 3 was 'has no callable'; a factory that raised, a raw traceback."""
    factory = tmp_path / "models.py"
    factory.write_text(USER_FACTORIES)
    assert cli.main(["inspect", f"{factory}:not_callable"]) == 2
    assert capsys.readouterr().err == (f"mpgraph: error: 'not_callable' in {factory} is an int, "
                                       "not a callable that builds the model\n")
    assert cli.main(["inspect", f"{factory}:build_raises"]) == 2
    assert capsys.readouterr().err == (f"mpgraph: error: {factory}:build_raises raised "
                                       "RuntimeError: boom in the user's factory (-v shows its "
                                       "traceback)\n")
    assert cli.main(["-v", "inspect", f"{factory}:build_raises"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and 'raise RuntimeError("boom in the user\'s factory")' in err
    assert err.endswith(f"mpgraph: error: {factory}:build_raises raised RuntimeError: boom in "
                        "the user's factory\n")


def test_cli_names_a_factory_file_that_fails_to_load(tmp_path, capsys):
    """A SyntaxError or a failing import in the factory's file was a raw traceback (rc 1), and a
    ValueError raised as it loaded printed bare, as if mpgraph's own: named like a factory that
    raised when called."""
    cases = {"syn.py": ("def build(:\n", "SyntaxError: "),
             "imperr.py": ("import nosuchpackage_xyz\ndef build(): pass\n",
                           "ModuleNotFoundError: No module named 'nosuchpackage_xyz'"),
             "top.py": ("raise ValueError('config file missing')\ndef build(): pass\n",
                        "ValueError: config file missing")}
    for name, (text, what) in cases.items():
        (tmp_path / name).write_text(text)
        assert cli.main(["inspect", f"{tmp_path / name}:build"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mpgraph: error: could not load {tmp_path / name}: {what}"), err
        assert err.endswith(" (-v shows its traceback)\n") and err.count("\n") == 1, err
    assert cli.main(["-v", "inspect", f"{tmp_path / 'top.py'}:build"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_cli_names_a_report_file_that_is_not_text(tmp_path, capsys):
    """A non-UTF-8 --ncu-csv printed the codec's error alone, naming no file."""
    (tmp_path / "bin.csv").write_bytes(b"\x00\x01\xff")
    assert cli.main(["profile", "--ncu-csv", str(tmp_path / "bin.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpgraph: error: cannot read {tmp_path / 'bin.csv'}: not a text "
                          "file"), err


def test_cli_factories_import_modules_beside_them_and_from_the_current_folder(tmp_path, capsys,
                                                                              monkeypatch):
    """As `python FILE.py` and `python -m` do: a factory file importing a module beside it, and
    module:factory naming a module in the current folder (only PYTHONPATH=. worked)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "mp_sibling_layers.py").write_text(
        "import torch.nn as nn\ndef head():\n    return nn.Linear(8, 4)\n")
    (tmp_path / "mp_sibling_factory.py").write_text(
        "import torch\nfrom mp_sibling_layers import head\n"
        "def build():\n    return head(), torch.randn(2, 8)\n"
        "def listed():\n    return head(), (torch.randn(2, 8),), [1]\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["inspect", f"{tmp_path / 'mp_sibling_factory.py'}:build", "--target",
                     "a100", "--check", "off"]) == 0, capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert cli.main(["inspect", "mp_sibling_factory:build", "--target", "a100", "--check",
                     "off"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli.main(["inspect", "mp_sibling_factory:listed", "--target", "a100"]) == 2
    assert capsys.readouterr().err == (
        "mpgraph: error: mp_sibling_factory:listed must return (model, example_inputs[, "
        "example_kwargs]): its example_kwargs is a list, not a dict\n")
    for module in ("mp_sibling_layers", "mp_sibling_factory"):
        sys.modules.pop(module, None)


def test_cli_inspect_read_by_head_writes_its_files_and_exits_0(tmp_path):
    """`mpgraph inspect ... | head`: the report files were not written and the command ended
    "mpgraph: error: [Errno 32] Broken pipe", status 2."""
    factory = tmp_path / "lin.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n    return nn.Linear(8, 8), torch.randn(2, 8)\n")
    out = tmp_path / "plan.json"
    command = (f"{sys.executable} -m mpgraph inspect {factory}:build --target a100 --explain "
               f"--json {out} | head -1; exit ${{PIPESTATUS[0]}}")
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert proc.returncode == 0 and "Broken pipe" not in proc.stderr, proc.stderr
    assert proc.stdout.count("\n") == 1 and out.stat().st_size > 100


def test_demo_heads_a_plan_that_converted_nothing_as_float32_and_warns_once(capsys, monkeypatch):
    # was "== cnn ...: bfloat16 (chosen on the command line)" over "kept all 15 nodes in
    # float32", the dtype warning printed twice (stderr, then atop the summary)
    from mpgraph.cost import measured
    monkeypatch.setattr(measured, "cpu_flags", lambda: frozenset({"avx2"}))  # bf16 emulated
    monkeypatch.setattr(measured, "isa_caps", lambda: "")
    assert cli.main(["demo", "--model", "cnn", "--dtype", "bf16", "--rounds", "1"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"== cnn on cpu, planned for CPU .*: float32 \(bfloat16 chosen on the "
                     r"command line, where it converted nothing: the warning above\)",
                     captured.out), captured.out
    assert "converted 0 of 4 matmul/conv nodes" not in captured.out
    assert captured.err.count("converted 0 of 4 matmul/conv nodes") == 1
