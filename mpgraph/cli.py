"""The ``mpgraph`` command line. Printing happens here and nowhere else in the package."""
from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import sys
import traceback
import warnings

from mpgraph.api import resolve_dtype
from mpgraph.ir.meta import Kind


def _demo(args) -> int:
    from mpgraph import demo
    from mpgraph.cost.specs import GPU_SPECS
    names = ["transformer", "cnn"] if args.model == "all" else [args.model]
    dtype = resolve_dtype(args.dtype) if args.dtype != "auto" else None
    for name in names:
        r = demo.run(name, dtype=dtype, rounds=args.rounds)
        asked = str(r.dtype).replace('torch.', '')
        # (a plan that converted nothing heads as float32, as the report does; the warning it
        # repeats atop its summary was printed when it warned)
        held = r.plan.headline_dtype if r.plan is not None else asked
        why = r.dtype_reason if held == asked else \
            f"{asked} {r.dtype_reason}, where it converted nothing: the warning above"
        print(f"== {name} on {r.device}, planned for {r.target}: {held} ({why})")
        print(_without_plan_warnings(r.summary, r.plan) if r.plan is not None else r.summary)
        print(r.casts)
        print(f"relative L2 error vs float32: {r.rel_err:.2e}")
        estimate = f"{r.estimated:.2f}x estimated" if r.estimated else "no estimate"
        if r.speedup is not None:
            print(f"eager median latency: float32 {r.fp32_ms:.1f} ms, mpgraph {r.mpgraph_ms:.1f} ms "
                  f"-> {r.speedup:.2f}x measured, {estimate}")
        elif r.target == GPU_SPECS[demo.STAND_IN_GPU].name:  # a GPU's plan, run for its numbers
            here = "runs emulated here" if r.device == "cpu" else f"runs on {r.device} untimed"
            # (demo.run plans it replayed from CUDA graphs: its eager estimate is lower)
            print(f"eager speed: not measured (a plan for {r.target} {here}); replayed from CUDA "
                  f"graphs there: {estimate}")
        else:  # a plan for this machine that was not timed (rounds=0 ran none)
            print(f"eager speed: not measured (no timed rounds; {estimate})")
        print()
    return 0


def _calibrate(args) -> int:
    import time
    from mpgraph.api import calibrate
    if args.gpu:
        import torch
        from mpgraph.cost.device import resolve_target
        from mpgraph.cost.roofline import measure_calibration, write_calibration
        if not torch.cuda.is_available():
            print("mpgraph: calibrate --gpu needs a CUDA GPU here", file=sys.stderr)
            return 2
        spec = resolve_target(args.target or "cuda")
        data = measure_calibration(spec)
        path = write_calibration(spec, data)
        print(f"wrote {path}: host {data['host_per_node_s'] * 1e6:.2f} us a node; efficiency "
              + ", ".join(f"{k} {v:.2f}" for k, v in data["efficiency"].items()))
        return 0
    if args.target is not None and args.target.lower() != "cpu":  # (a GPU's was ignored: the
        # table measured this machine, silently; this CPU's is what it measures)
        print(f"mpgraph: calibrate --target {args.target} needs --gpu (a GPU's calibration file "
              "is written on that GPU); without --gpu the cost table is measured on this "
              "machine, which needs no target", file=sys.stderr)
        return 2
    if not args.factory:
        print("mpgraph: calibrate needs a factory (FILE.py:name), or --gpu", file=sys.stderr)
        return 2
    model, inputs, kwargs = build_from(args.factory, batch=args.batch, seq=args.seq)
    start = time.perf_counter()
    table = calibrate(model, inputs, example_kwargs=kwargs)
    print(table.format(args.rows))
    print(f"measured {table.measured_now} op variants in {time.perf_counter() - start:.1f} s; "
          f"cached in {table.path}")
    return 0


def _positive(text: str, what: str = "a size") -> int:
    """--batch and --seq: a size, 1 or more (0 or -3 failed deep inside the model); --rounds: a
    count (0 timed nothing, and the demo blamed another device for it)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected {what} of 1 or more, got {value}")
    return value


def _count(text: str) -> int:
    return _positive(text, "a count")


class FactoryError(ValueError):
    """The user's factory, or its file as it loaded, raised: one line names it and its exception
    (-v: the traceback)."""


def _on_path(folder: str) -> None:
    if os.path.abspath(folder) not in map(os.path.abspath, sys.path):  # ('' is the cwd)
        sys.path.insert(0, folder)


def load_factory(spec: str):
    """``path/to/file.py:name`` or ``package.module:name`` -> the callable it names."""
    import importlib
    import importlib.util

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"expected FILE.py:factory or module:factory, got {spec!r}")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise ValueError(f"no such file: {where}")
        _on_path(os.path.dirname(os.path.abspath(where)))  # (as `python FILE.py` does: a
        # module beside the file imports)
        module_spec = importlib.util.spec_from_file_location(f"_mpgraph_factory_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # the user's code, as when the factory is called
            raise FactoryError(f"could not load {where}: {type(e).__name__}: {e}") from e
    else:
        _on_path(os.getcwd())  # (as `python -m` does: a module in the current directory)
        try:
            module = importlib.import_module(where)
        except Exception as e:
            if isinstance(e, ModuleNotFoundError) and e.name is not None and (
                    where == e.name or where.startswith(e.name + ".")):
                raise ValueError(f"no module {where!r} ({e}): name a FILE.py:factory, or a "
                                 "module importable from here") from None
            # (the module is there: it, or something it imports, failed)
            raise FactoryError(f"could not load {where}: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        raise ValueError(f"{where} has no callable {name!r}")
    factory = getattr(module, name)
    if not callable(factory):
        kind = type(factory).__name__
        what = "None" if factory is None else f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}"
        raise ValueError(f"{name!r} in {where} is {what}, not a callable that builds the model")
    return factory


def build_from(spec: str, **sizes):
    """Call a factory; it returns (model, example_inputs) or (model, example_inputs, example_kwargs).
    ``sizes`` (batch=, seq= from the command line; None: the factory's default) are passed to it
    by name; a factory without such a parameter is an error that lists the ones it has."""
    factory = load_factory(spec)
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if sizes:
        params = inspect.signature(factory).parameters
        missing = [k for k in sizes if k not in params]
        if missing and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ValueError(f"{spec} takes no {', '.join(missing)} argument (its parameters: "
                             f"{', '.join(params) or 'none'})")
    try:
        built = factory(**sizes)
    except Exception as e:  # the user's code, not the command line: named, traceback under -v
        raise FactoryError(f"{spec} raised {type(e).__name__}: {e}") from e
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise ValueError(f"{spec} must return (model, example_inputs[, example_kwargs])")
    model, inputs = built[0], built[1]
    kwargs = built[2] if len(built) == 3 else None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"{spec} must return (model, example_inputs[, example_kwargs]): its "
                         f"example_kwargs is a {type(kwargs).__name__}, not a dict")
    return model, inputs, kwargs


def _export(args) -> int:
    from mpgraph.errors import MpgraphError
    from mpgraph.tools.onnx_export import export_onnx
    model, inputs, kwargs = build_from(args.factory, batch=args.batch, seq=args.seq)
    try:
        result = export_onnx(model, inputs, args.output, dtype=args.dtype, opset=args.opset,
                             example_kwargs=kwargs, validate=not args.no_validate,
                             target=args.target, strategy=args.strategy,
                             dynamic_shapes=None if args.static else "auto",
                             **({"external_data_threshold": args.external_data_threshold}
                                if args.external_data_threshold is not None else {}))
    except MpgraphError as e:
        print(f"mpgraph: export failed: {e}", file=sys.stderr)
        return 1
    print(_without_plan_warnings(result.summary(), result.plan))
    return 0


def _without_plan_warnings(text: str, plan) -> str:
    """``text`` without the summary's first lines that repeat the plan's warnings: the
    conversion printed each on stderr as it warned it (each was printed twice)."""
    for warning in (plan.warning, plan.calibration_warning):
        if warning:
            text = text.replace(f"warning: {warning}\n", "", 1)
    return text


def explain(runs) -> str:
    """The passes a conversion ran, in order: stage, time, whether it changed the graph, and the
    facts (mpgraph.* meta keys) it read (``?``: where present) and wrote."""
    def short(keys, optional=()):
        return ", ".join([k.removeprefix("mpgraph.") for k in keys]
                         + [k.removeprefix("mpgraph.") + "?" for k in optional]) or "-"

    lines = [f"pipeline: {len(runs)} passes, {sum(r.seconds for r in runs):.2f} s",
             f"{'stage':<15} {'pass':<26} {'seconds':>8}  {'changed':<7}  reads -> writes"]
    lines += [f"{r.stage:<15} {r.name:<26} {r.seconds:>8.3f}  {'yes' if r.modified else 'no':<7}  "
              f"{short(r.reads, r.also_reads)} -> {short(r.writes)}" for r in runs]
    return "\n".join(lines) + "\n"


def _inspect(args) -> int:
    from mpgraph.api import convert
    from mpgraph.errors import MpgraphError
    from mpgraph.tools.report import check_folder, report
    from mpgraph.passes.infra import recording
    for fmt in ("html", "json", "dot"):  # (before the conversion, not after it)
        if getattr(args, fmt):
            check_folder(getattr(args, fmt), f"--{fmt} {getattr(args, fmt)}")
    model, inputs, kwargs = build_from(args.factory, batch=args.batch, seq=args.seq)
    try:
        check = {"auto": True, "off": False}.get(args.check, args.check)
        with recording() as runs:
            converted = convert(model, inputs, example_kwargs=kwargs, dtype=args.dtype,
                                target=args.target, strategy=args.strategy,
                                dynamic=not args.static, check=check, runtime=args.runtime)
    except MpgraphError as e:
        print(f"mpgraph: inspect failed: {e}", file=sys.stderr)
        return 1
    written = []  # (the files first: a reader that stops early, `| head`, must not lose them)
    for fmt in ("html", "json", "dot"):
        path = getattr(args, fmt)
        if path:
            report(converted, fmt, path)
            written.append(f"wrote {path}")
    if args.explain:
        print(explain(runs))
    print(_without_plan_warnings(report(converted, "text"), converted.plan), end="")
    for line in written:
        print(line)
    return 0


def _profile(args) -> int:
    from mpgraph.tools import ncu
    if args.ncu_csv or args.nvprof_csv:  # a report made elsewhere: no model needed
        path = args.ncu_csv or args.nvprof_csv
        try:
            with open(path) as f:
                text = f.read()
        except UnicodeDecodeError as e:  # (the codec's message named no file)
            raise ValueError(f"cannot read {path}: not a text file ({e}); --ncu-csv and "
                             "--nvprof-csv take the CSV text that ncu --csv / nvprof --csv "
                             "write") from None
        rows = ncu.parse_ncu_csv(text) if args.ncu_csv else ncu.parse_nvprof_csv(text)
        uses = ncu.per_node(rows)
        if uses:
            print(ncu.format_per_node(uses))
        else:  # nvprof has no NVTX: kernels only
            for r in rows:
                print(f"{r.kernel[:70]:<70} tensor {r.tensor_active}")
        return 0
    if not args.factory:
        print("mpgraph: profile needs FILE.py:factory (or --ncu-csv/--nvprof-csv FILE)", file=sys.stderr)
        return 2
    import torch
    from mpgraph.api import convert
    from mpgraph.tools.profiling import profile
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.ncu:
        program = [sys.executable, "-m", "mpgraph.cli", "profile", args.factory, "--dtype", args.dtype,
                   "--iters", "1", "--device", "cuda"] + (["--target", args.target] if args.target else [])
        query = ncu.query_metrics() if torch.cuda.is_available() else None
        metrics = ncu.available_metrics(query) if query else None
        command = ncu.ncu_command(program, metrics, log_file=args.ncu_log)
        if query is None:
            print("mpgraph: ncu is not usable here (needs an NVIDIA GPU and ncu on PATH). On a GPU "
                  "machine run:\n  " + ncu.shell(command) + "\nthen here: mpgraph profile "
                  f"--ncu-csv {args.ncu_log}", file=sys.stderr)
            return 1
        import subprocess
        done = subprocess.run(command)
        if done.returncode != 0:
            return done.returncode
        with open(args.ncu_log) as f:
            print(ncu.format_per_node(ncu.per_node(ncu.parse_ncu_csv(f.read()))))
        return 0
    from mpgraph.ir.graph import as_call, to_device as _to
    from mpgraph.tools.profiling import check_device
    check_device(device, given=f"--device {device}")  # (before the model is moved there)
    model, inputs, kwargs = build_from(args.factory, batch=args.batch, seq=args.seq)
    from mpgraph.ir.fake import has_abstract_tensors
    if isinstance(model, torch.nn.Module) and has_abstract_tensors(model, *as_call(inputs, kwargs)):
        # (model.to(device) failed inside torch, advising to_empty(): no weights either way)
        raise ValueError(f"profile times {args.factory}'s model running on real values; it or "
                         "its inputs hold tensors on the meta device (or fake tensors): load its "
                         "weights and pass real inputs (mpgraph inspect plans a meta model from "
                         "shapes alone)")
    model, inputs, kwargs = model.to(device), _to(inputs, device), _to(kwargs, device)
    converted = convert(model, inputs, example_kwargs=kwargs, dtype=args.dtype, target=args.target,
                        runtime=args.runtime)
    if args.target is not None:
        from mpgraph.cost.device import resolve_target
        planned = resolve_target(args.target)
        if (planned.kind == Kind.GPU) != (device == "cuda"):
            print(f"mpgraph: note: planned for {planned.name}, profiled on {device}: the measured "
                  f"times are this {device}'s (low precision may be emulated here), the predicted "
                  f"ones {planned.name}'s; compare their ranks, not their values", file=sys.stderr)
    with _c_stderr_silenced(not args.verbose):  # the profiler's C++ side prints to fd 2
        result = profile(converted, inputs, example_kwargs=kwargs, device=device, iters=args.iters)
    print(result.table())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mpgraph", description="Whole-graph mixed precision for PyTorch.")
    # -v and --progress go before or after the command (SUPPRESS: a command's parser does not
    # overwrite what was given before it)
    common = argparse.ArgumentParser(add_help=False)
    for where, default in ((parser, None), (common, argparse.SUPPRESS)):
        where.add_argument("-v", "--verbose", action="store_true",
                           default=False if default is None else default,
                           help="log what the passes do; show third-party warnings and logs")
        where.add_argument("--progress", action=argparse.BooleanOptionalAction, default=default,
                           help="a line per stage on stderr (default: when stderr is a terminal)")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", parents=[common],
                       help="convert the built-in models, check them against fp32, time them")
    d.add_argument("--model", choices=["transformer", "cnn", "all"], default="all")
    d.add_argument("--dtype", default="auto", help="auto (what this machine is fast at), fp16 or bf16")
    d.add_argument("--rounds", type=_count, default=10, help="timed calls of each variant")
    d.set_defaults(func=_demo)
    e = sub.add_parser("export", parents=[common],
                       help="convert a model and export it to ONNX with the plan's types")
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
    i = sub.add_parser("inspect", parents=[common],
                       help="convert a model and report every decision and cast")
    i.add_argument("factory", help="FILE.py:name or module:name returning (model, inputs[, kwargs])")
    i.add_argument("--dtype", default="auto", help="auto (what the target is fast at), fp16 or bf16")
    i.add_argument("--target", default=None, help="cpu, h100, a100, t4, ... (default: this machine)")
    i.add_argument("--strategy", choices=["optimal", "rules"], default="optimal")
    i.add_argument("--check", choices=["auto", "values", "dtypes", "off"], default="auto",
                   help="auto: dtypes always, values where they are cheap to run (a plan for "
                        "another device: up to 20 GFLOP, simulated); values: always; dtypes: "
                        "no value run; off: no check")
    i.add_argument("--explain", action="store_true",
                   help="first list the passes that ran: stage, seconds, facts read and written")
    i.add_argument("--html", help="write the self-contained HTML report here")
    i.add_argument("--json", help="write the plan as JSON here (mpgraph.Plan.load reads it)")
    i.add_argument("--dot", help="write the Graphviz source here")
    i.set_defaults(func=_inspect)
    p = sub.add_parser("profile", parents=[common],
                       help="per-node time and Tensor Core use of a converted model")
    p.add_argument("factory", nargs="?", help="FILE.py:name or module:name returning (model, inputs[, kwargs])")
    p.add_argument("--dtype", default="auto", help="auto, fp16 or bf16")
    p.add_argument("--target", default=None, help="the device to plan for (default: this one)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--iters", type=int, default=5, help="profiled runs")
    p.add_argument("--ncu", action="store_true", help="run Nsight Compute on the node ranges")
    p.add_argument("--ncu-log", default="mpgraph-ncu.csv", help="where ncu writes its CSV")
    p.add_argument("--ncu-csv", help="read an ncu --csv report made elsewhere")
    p.add_argument("--nvprof-csv", help="read an nvprof --csv --metrics tensor_precision_fu_utilization report")
    p.set_defaults(func=_profile)
    c = sub.add_parser("calibrate", parents=[common],
                       help="measure a model's ops on this machine afresh (the cost table), or "
                            "this GPU for the roofline (--gpu)")
    c.add_argument("factory", nargs="?", help="FILE.py:name or module:name returning (model, inputs[, kwargs])")
    c.add_argument("--gpu", action="store_true", help="write this GPU's calibration file instead")
    c.add_argument("--target", default=None, help="with --gpu: the spec to calibrate (default: this GPU)")
    c.add_argument("--rows", type=_count, default=40, help="rows of the table to print")
    c.set_defaults(func=_calibrate)
    for command in (i, p):
        command.add_argument("--runtime", choices=["eager", "graphs"], default="eager",
                             help="what a GPU target's estimates are for: eager calls (each node "
                                  "costs the host's time at least: the default) or replayed CUDA "
                                  "graphs / torch.compile (kernel time only)")
    for command in (e, i):
        command.add_argument("--static", action="store_true",
                             help="torch.export at the example's shapes only: about half the "
                                  "capture time, and the result takes no other shape (a model "
                                  "that symbolic_trace captures is not tied to shapes anyway)")
    for command in (e, i, p, c):
        command.add_argument("--batch", type=_positive, default=None,
                             help="passed to the factory as batch= (default: the factory's)")
        command.add_argument("--seq", type=_positive, default=None,
                             help="passed to the factory as seq= (default: the factory's)")
    args = parser.parse_args(argv)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    with _console(args.verbose, show):
        try:
            status = args.func(args)
            sys.stdout.flush()
            return status
        except BrokenPipeError:  # (`mpgraph inspect ... | head`: the reader has what it wants)
            devnull = os.open(os.devnull, os.O_WRONLY)  # (no second error when Python exits
            os.dup2(devnull, sys.stdout.fileno())  # and flushes stdout)
            return 0
        except (ValueError, TypeError, OSError) as e:
            if args.verbose:
                traceback.print_exception(e, file=sys.stderr)
            hint = isinstance(e, FactoryError) and not args.verbose
            print(f"mpgraph: error: {e}{' (-v shows its traceback)' if hint else ''}", file=sys.stderr)
            return 2


# third-party loggers that narrate on the screen (torch's fake-tensor E-logs, the ONNX exporter's
# notes on torchvision, onnxscript's constant folding, transformers' config checks): shown with -v
_THIRD_PARTY = ("torch", "onnxscript", "onnx_ir", "onnxruntime", "transformers")
_HF_VERBOSITY = "TRANSFORMERS_VERBOSITY"


class StageLines(logging.Handler):
    """mpgraph's stage progress as lines on stderr: 'mpgraph: capture ... 7.1 s'."""

    def __init__(self, stream=None):
        super().__init__(logging.INFO)
        self.stream = stream
        self.open = None  # the stage whose line waits for its time

    def emit(self, record):
        out = self.stream or sys.stderr
        name, seconds = getattr(record, "mpgraph_stage", None), getattr(record, "mpgraph_seconds", None)
        if name is None:
            return
        if seconds is None:  # a stage starts
            out.write(("\n" if self.open else "") + f"mpgraph: {name} ...")
            self.open = name
        elif self.open == name:
            out.write(f" {seconds:.1f} s\n")
            self.open = None
        else:  # a stage ends after another one printed inside it
            out.write(("\n" if self.open else "") + f"mpgraph: {name}: {seconds:.1f} s\n")
            self.open = None
        out.flush()


@contextlib.contextmanager
def _c_stderr_silenced(silence: bool):
    """File descriptor 2 pointed at /dev/null (what C++ libraries print bypasses sys.stderr)."""
    if not silence:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _show_own_warning(message, category, *_, **__) -> None:
    """One line for a warning mpgraph issued. The filter passes warnings attributed to mpgraph's
    modules, which includes third-party ones whose stacklevel points at mpgraph's call (torch's
    'legacy TorchScript-based ONNX export', a DeprecationWarning) and C++ ones raised while
    mpgraph's code runs (torch.jit.TracerWarning): mpgraph's own are UserWarnings that its code
    issues itself."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == "warnings":
        frame = frame.f_back  # (warnings.warn is C code: the next frame is the one calling it)
    issuer = frame.f_globals.get("__name__", "") if frame is not None else ""
    if issubclass(category, UserWarning) and issuer.split(".")[0] == "mpgraph":
        print(f"mpgraph: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def _console(verbose: bool, progress: bool):
    """What reaches the screen while a command runs: mpgraph's own warnings (one line each) and
    stage progress; third-party logs and warnings only with -v."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s" if verbose
                                           else "mpgraph: %(levelname)s: %(message)s"))
    old_root = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    quiet = [] if verbose else [logging.getLogger(n) for n in _THIRD_PARTY]
    old_levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    # transformers sets its logger's level itself when a factory first imports it, from
    # TRANSFORMERS_VERBOSITY (transformers.utils.logging): the variable says the same meanwhile
    old_verbosity = os.environ.get(_HF_VERBOSITY)
    if not verbose:
        os.environ[_HF_VERBOSITY] = "critical"
    steps = logging.getLogger("mpgraph.progress")
    stage_lines = StageLines() if progress else None
    old_steps = (steps.level, steps.propagate)
    if stage_lines:
        steps.addHandler(stage_lines)
        steps.setLevel(logging.INFO)
        steps.propagate = False
    show = warnings.showwarning
    with warnings.catch_warnings():
        if not verbose:
            warnings.simplefilter("ignore")
            warnings.filterwarnings("default", module=r"mpgraph(\.|$)")
            warnings.showwarning = _show_own_warning
        try:
            yield
        finally:
            warnings.showwarning = show
            root.removeHandler(handler)
            root.setLevel(old_root)
            for lg, level in zip(quiet, old_levels):
                lg.setLevel(level)
            if old_verbosity is None:
                os.environ.pop(_HF_VERBOSITY, None)
            else:
                os.environ[_HF_VERBOSITY] = old_verbosity
            if stage_lines:
                steps.removeHandler(stage_lines)
                steps.setLevel(old_steps[0])
                steps.propagate = old_steps[1]


if __name__ == "__main__":
    sys.exit(main())
