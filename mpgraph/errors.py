"""Exceptions raised by mpgraph. Each says what went wrong and what to do about it."""
from __future__ import annotations


class MpgraphError(Exception):
    """Base class for every error mpgraph raises on purpose."""


class CaptureError(MpgraphError):
    """Neither torch.fx.symbolic_trace nor torch.export could capture the model.

    ``reports`` maps each tracer's name to what it said, so the user sees both.
    """

    def __init__(self, reports: dict[str, str]):
        self.reports = dict(reports)
        lines = ["could not capture the model's graph:"]
        for tracer, message in self.reports.items():
            lines.append(f"  {tracer}: {message}")
        if "torch.export" not in self.reports:
            lines.append("  (pass example_inputs so that torch.export can be tried)")
        super().__init__("\n".join(lines))


class PassError(MpgraphError):
    """A pass failed. Names the pass, the node if known, and the passes that ran before."""

    def __init__(self, pass_name: str, message: str, node=None, ran_before: list[str] | None = None):
        self.pass_name = pass_name
        self.message = message
        self.node = node
        self.ran_before = list(ran_before or [])
        super().__init__(message)

    def __str__(self) -> str:
        text = f"pass {self.pass_name} failed: {self.message}"
        if self.node is not None:
            text += f"\n  at node: {self.node.format_node()}"
        if self.ran_before:
            text += f"\n  passes run before it: {', '.join(self.ran_before)}"
        return text


class ConversionError(MpgraphError):
    """The converted graph does not match its plan (a bug in mpgraph, or an op we mis-classified)."""


class ExportError(MpgraphError):
    """ONNX export failed, or the exported file does not match the plan or its numbers."""


class CalibrationError(MpgraphError, ValueError):
    """Calibration data that cannot be used: no batches, or a batch that does not fit the model."""


class ToleranceError(MpgraphError, ValueError):
    """The stated tolerance cannot be met, not even with every node in float32."""


class PlanMismatchError(MpgraphError, ValueError):
    """A saved plan that does not fit the model it is applied to; ``mismatches`` lists why."""

    def __init__(self, mismatches: list[str]):
        self.mismatches = list(mismatches)
        shown = self.mismatches[:20]
        more = len(self.mismatches) - len(shown)
        super().__init__("the plan does not match this model:\n  " + "\n  ".join(shown)
                         + (f"\n  ... and {more} more" if more > 0 else ""))
