"""One pass contract for every stage: ``requires`` -> ``call`` -> ``ensures``.

Modelled on onnx-ir's pass infrastructure: a pass is a small class, ``__call__`` returns a frozen
``PassResult(graph_module, modified)`` and ``modified`` is honest (analysis passes say False), so a
pipeline can run to a fixed point and a caller can tell what changed.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Iterable

import torch.fx

from mpgraph.errors import MpgraphError, PassError

log = logging.getLogger(__name__)
# One record when a stage starts and one when it ends (extra: mpgraph_stage, mpgraph_seconds):
# the CLI shows them on a terminal; a library user can attach a handler of their own.
progress = logging.getLogger("mpgraph.progress")


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


class Pass:
    """Base class. Subclasses implement ``call`` and may check ``requires``/``ensures``."""

    stage = "plan"  # what progress calls the part of the work this pass belongs to

    @property
    def name(self) -> str:
        return type(self).__name__

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Raise PassError when the input graph lacks what this pass needs."""

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
        self.ensures(result.graph_module)
        return result


def run_passes(passes: Iterable[Pass], gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Run a pipeline (a plain list of pass instances) in order, with context on failure."""
    ran: list[str] = []
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
