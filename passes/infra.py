"""One pass contract for every stage: ``requires`` -> ``call`` -> ``ensures``.

Modelled on onnx-ir's pass infrastructure: a pass is a small class, ``__call__`` returns a frozen
``PassResult(graph_module, modified)`` and ``modified`` is honest (analysis passes say False), so a
caller can tell what changed. A pass declares what it needs and what it does, and the
infrastructure holds it to that: ``reads`` (the ``mpgraph.*`` meta keys every node it looks at
must carry: checked before it runs, naming the pass that writes a missing one), ``writes`` (the
keys it sets) and ``rewrites`` (whether it may change the graph: after a pass that did, the
graph is linted here, not by each pass, and its code regenerated once: after the pass when it
runs alone, when the outermost ``deferred_recompile`` ends otherwise (``run_passes``, or
``convert`` around all its pipelines), since the passes read the graph, never its generated
code (an 80-layer Llama's plan recompiled its 6000 nodes 14 times, ~0.9 s); an analysis pass
that reports a change is an error).
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch.fx

from mpgraph.errors import MpgraphError, PassError
from mpgraph.ir.graph import CALLS

log = logging.getLogger(__name__)
# One record when a stage starts and one when it ends (extra: mpgraph_stage, mpgraph_seconds):
# the CLI shows them on a terminal; a library user can attach a handler of their own.
progress = logging.getLogger("mpgraph.progress")
# graphs rewritten inside run_passes whose code is regenerated when the pipeline ends (per thread)
_pending = threading.local()


@contextlib.contextmanager
def stage(name: str):
    """Report a stage of the work (capture, calibrate, decide, rewrite, check, export, ...)."""
    start = time.perf_counter()
    progress.info("%s ...", name, extra={"mpgraph_stage": name, "mpgraph_seconds": None})
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        progress.info("%s: %.1f s", name, seconds,
                      extra={"mpgraph_stage": name, "mpgraph_seconds": seconds})


@dataclass(frozen=True)
class PassResult:
    graph_module: torch.fx.GraphModule
    modified: bool


ALL_NODES = CALLS + ("placeholder", "get_attr", "output")


class Pass:
    """Base class. Subclasses implement ``call`` and declare ``reads``/``writes``/``rewrites``;
    they may add checks of their own in ``requires``/``ensures``."""

    stage = "plan"      # what progress calls the part of the work this pass belongs to
    reads: tuple = ()   # meta keys every node of an op in ``reads_on`` must carry beforehand
    reads_on: tuple = CALLS
    also_reads: tuple = ()  # facts it reads where present (a calibrated range, a finding)
    writes: tuple = ()  # meta keys this pass sets, the one it exists to write first
    rewrites = False    # whether it changes the graph (the infrastructure recompiles after)

    @property
    def name(self) -> str:
        return type(self).__name__

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Raise PassError when the input graph lacks what this pass needs: by default, a node
        without one of the ``reads`` keys."""
        for node in gm.graph.nodes:
            if node.op not in self.reads_on:
                continue
            for key in self.reads:
                if key not in node.meta:
                    writers = [w.__name__ for w in _subclasses(Pass) if w.writes[:1] == (key,)]
                    raise self.fail(f"needs {key} on every node: run "
                                    f"{' or '.join(writers) or 'the pass that writes it'} first",
                                    node)

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        raise NotImplementedError

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Raise PassError when the result breaks this pass's promise."""

    def fail(self, message: str, node=None) -> PassError:
        return PassError(self.name, message, node)

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        self.requires(gm)
        result = self.call(gm)
        if not isinstance(result, PassResult):
            raise PassError(self.name, f"returned {type(result).__name__}, not PassResult")
        if result.modified:
            if not self.rewrites:
                raise PassError(self.name, "reported a change to the graph, but declares "
                                           "rewrites = False (an analysis pass)")
            result.graph_module.graph.lint()
            pending = getattr(_pending, "modules", None)
            if pending is None:
                result.graph_module.recompile()
            else:
                pending[id(result.graph_module)] = result.graph_module
        self.ensures(result.graph_module)
        return result


def _subclasses(cls) -> list:
    out = []
    for sub in cls.__subclasses__():
        out += [sub] + _subclasses(sub)
    return out


@contextlib.contextmanager
def deferred_recompile(discard: bool = False):
    """Inside it, graphs that passes rewrite get their code regenerated once, when the outermost
    of these contexts ends (``run_passes`` is one; ``convert`` holds one around its pipelines).
    ``discard``: the outermost context's caller drops every module made inside it (``plan``
    keeps only the Plan), so none is regenerated."""
    outer = getattr(_pending, "modules", None)
    _pending.modules = {} if outer is None else outer
    try:
        yield
    finally:
        if outer is None and discard:
            _pending.modules = None
        elif outer is None:
            modules, _pending.modules = _pending.modules, None
            for module in modules.values():
                module.recompile()


def checking() -> bool:
    """Whether PassManager checks every pass's writes: ``MPGRAPH_CHECK_PASSES=1`` (the test
    suite sets it); off by default, where it would cost a snapshot of the meta per pass."""
    return os.environ.get("MPGRAPH_CHECK_PASSES", "") not in ("", "0")


_MISSING = object()  # a fact absent before or after a pass


def _facts(gm: torch.fx.GraphModule) -> dict:
    """Every mpgraph fact on the graph (gm.meta) and its nodes, by (owner, key) -> the value."""
    out = {(None, k): v for k, v in gm.meta.items() if k.startswith("mpgraph.")}
    for node in gm.graph.nodes:
        out.update(((node, k), v) for k, v in node.meta.items() if k.startswith("mpgraph."))
    return out


def _written(before: dict, gm: torch.fx.GraphModule) -> dict:
    """The keys a pass wrote (set, replaced or removed on a node that survived, or on the
    graph), each with one place it did."""
    after = _facts(gm)
    alive = set(gm.graph.nodes)
    out: dict = {}
    for place in set(before) | set(after):
        owner, key = place
        if owner is not None and owner not in alive:
            continue  # an erased node's facts went with it
        if before.get(place, _MISSING) is not after.get(place, _MISSING):
            out.setdefault(key, "the graph" if owner is None else owner.name)
    return out


@dataclass(frozen=True)
class PassRun:
    """One pass as it ran: what ``mpgraph inspect --explain`` prints."""

    name: str
    stage: str
    seconds: float
    modified: bool
    reads: tuple
    writes: tuple
    also_reads: tuple = ()


_RECORDS: contextvars.ContextVar = contextvars.ContextVar("mpgraph_pass_runs", default=None)


@contextlib.contextmanager
def recording():
    """Collects a PassRun for every pass any PassManager runs inside the block (a conversion
    runs several pipelines), in order: ``with recording() as runs: convert(...)``."""
    runs: list[PassRun] = []
    token = _RECORDS.set(runs)
    try:
        yield runs
    finally:
        _RECORDS.reset(token)


class PassManager:
    """Runs a pipeline (a plain list of pass instances) in order: each pass's ``reads`` are
    checked before it runs (``Pass.requires``); with ``check`` (default: ``checking()``) every
    mpgraph fact it wrote must be one of its ``writes``, or the run stops with a PassError naming
    the pass and the key; any failure inside a pass names the pass and those that ran before.
    ``timings``: (pass, seconds, modified) of the last run, also logged at debug level
    (logger ``mpgraph.passes.infra``)."""

    def __init__(self, passes: Iterable[Pass], check: bool | None = None,
                 label: str | None = None):
        self.passes = list(passes)
        self.check = checking() if check is None else check
        self.label = label  # runs inside a stage of the caller's: no stage records of its own
        self.timings: list[tuple[str, float, bool]] = []

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        self.timings = []
        with deferred_recompile():
            return self.run(gm, [])

    def run(self, gm: torch.fx.GraphModule, ran: list) -> torch.fx.GraphModule:
        for name, group in itertools.groupby(self.passes, key=lambda p: p.stage):
            if self.label:
                name = self.label
            with stage(name) if not self.label else contextlib.nullcontext():
                for p in group:
                    before = _facts(gm) if self.check else None
                    start = time.perf_counter()
                    try:
                        result = p(gm)
                    except PassError as e:
                        e.ran_before = e.ran_before or list(ran)
                        raise
                    except MpgraphError:
                        raise
                    except Exception as e:  # an unexpected failure inside a pass: say which
                        raise PassError(p.name, f"{type(e).__name__}: {e}", None, ran) from e
                    seconds = time.perf_counter() - start
                    gm = result.graph_module
                    if before is not None:
                        undeclared = {k: w for k, w in _written(before, gm).items()
                                      if k not in p.writes}
                        if undeclared:
                            raise PassError(p.name, "wrote facts it does not declare in its "
                                            "writes: " + ", ".join(f"{k} (on {w})" for k, w in
                                                                   sorted(undeclared.items())),
                                            None, ran)
                    self.timings.append((p.name, seconds, result.modified))
                    if _RECORDS.get() is not None:
                        _RECORDS.get().append(PassRun(p.name, name, seconds, result.modified,
                                                      tuple(p.reads), tuple(p.writes),
                                                      tuple(p.also_reads)))
                    log.debug("pass %s: %.3f s, modified=%s", p.name, seconds, result.modified)
                    ran.append(p.name)
        return gm


def run_passes(passes: Iterable[Pass], gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Run a pipeline with a PassManager (context on failure; writes checked when checking())."""
    return PassManager(passes)(gm)
