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
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch.fx

from mpgraph.errors import MpgraphError, PassError

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


CALLS = ("call_function", "call_method", "call_module")
ALL_NODES = CALLS + ("placeholder", "get_attr", "output")


class Pass:
    """Base class. Subclasses implement ``call`` and declare ``reads``/``writes``/``rewrites``;
    they may add checks of their own in ``requires``/``ensures``."""

    stage = "plan"      # what progress calls the part of the work this pass belongs to
    reads: tuple = ()   # meta keys every node of an op in ``reads_on`` must carry beforehand
    reads_on: tuple = CALLS
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


def run_passes(passes: Iterable[Pass], gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Run a pipeline (a plain list of pass instances) in order, with context on failure."""
    with deferred_recompile():
        return _run(passes, gm, [])


def _run(passes, gm, ran: list) -> torch.fx.GraphModule:
    for name, group in itertools.groupby(passes, key=lambda p: p.stage):
        with stage(name):
            for p in group:
                try:
                    result = p(gm)
                except PassError as e:
                    e.ran_before = e.ran_before or list(ran)
                    raise
                except MpgraphError:
                    raise
                except Exception as e:  # an unexpected failure inside a pass: say which pass
                    raise PassError(p.name, f"{type(e).__name__}: {e}", None, ran) from e
                gm = result.graph_module
                log.debug("pass %s: modified=%s", p.name, result.modified)
                ran.append(p.name)
    return gm
