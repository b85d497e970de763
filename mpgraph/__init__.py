"""mpgraph: whole-graph mixed precision for PyTorch models.

``mpgraph.convert(model, example_inputs, dtype=torch.bfloat16)`` captures the graph, decides a
precision for every node, stores weights once in low precision, inserts the fewest shared casts,
checks the result by running it, and returns a GraphModule carrying ``.plan``.
"""
from .capture import capture
from .errors import (CalibrationError, CaptureError, ConversionError, ExportError, MpgraphError,
                     PassError, PlanMismatchError, ToleranceError)
from .op_table import OpEntry, OpTable
from .pass_infra import Pass, PassResult, run_passes
from .plan import CastRecord, NodeRecord, Plan
from .plan_diff import PlanDiff, diff
from .profiling import ProfileResult, profile
from .reporting import report
from .weights import load_weights
# after the submodule imports: ``mpgraph.plan`` is the function (the Plan class is mpgraph.Plan)
from .api import convert, plan, resolve_dtype



def export_onnx(*args, **kwargs):
    """Export to ONNX with the plan's types and validate the file (see mpgraph.onnx_export)."""
    from .onnx_export import export_onnx as _export
    return _export(*args, **kwargs)


def ncu_command(*args, **kwargs):
    """The Nsight Compute command that profiles a program node by node (see mpgraph.ncu)."""
    from .ncu import ncu_command as _command
    return _command(*args, **kwargs)


def ort_session(*args, **kwargs):
    """onnxruntime session on CUDA when usable, else CPU (see mpgraph.onnx_export)."""
    from .onnx_export import ort_session as _session
    return _session(*args, **kwargs)


__version__ = "0.1.0"
__all__ = ["convert", "plan", "load_weights", "capture", "resolve_dtype", "Plan", "NodeRecord", "CastRecord", "OpTable",
           "OpEntry", "Pass", "PassResult", "run_passes", "CaptureError", "ConversionError",
           "PassError", "MpgraphError", "ExportError", "CalibrationError", "ToleranceError", "PlanMismatchError",
           "report", "diff", "PlanDiff", "export_onnx", "ort_session",
           "profile", "ProfileResult", "ncu_command"]
