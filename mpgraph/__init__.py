"""mpgraph: whole-graph mixed precision for PyTorch models.

``mpgraph.convert(model, example_inputs, dtype=torch.bfloat16)`` captures the graph, decides a
precision for every node, stores weights once in low precision, inserts the fewest shared casts,
checks the result by running it, and returns a GraphModule carrying ``.plan``.

The package follows the data flow; no public name here is also the name of a module:

- ``mpgraph.frontend``: capture (torch.fx / torch.export) and fake tensors for meta models
- ``mpgraph.ir``: node meta keys and values, graph helpers, the dtype rule on edges
- ``mpgraph.passes``: one file per pass, their infrastructure, the pipeline and the op table
- ``mpgraph.cost``: device specs (named GPUs, a measured CPU) and the min-cut solver
- ``mpgraph.plans``: the Plan (the record of every decision), its JSON form, diffs
- ``mpgraph.tools``: reports, ONNX export and validation, profiling, loading weights
- ``mpgraph.api``: ``convert`` and ``plan``, which drive the stages; ``mpgraph.cli``: the command
"""
from mpgraph.api import calibrate, convert, plan, resolve_dtype
from mpgraph.errors import (CalibrationError, CaptureError, ConversionError, ExportError,
                            InputMismatchError, MissingWeightsError, MpgraphError, PassError,
                            PlanMismatchError, ToleranceError, ValueCheckError,
                            WeightOverflowError)
from mpgraph.frontend.capture import capture
from mpgraph.passes.infra import Pass, PassResult, run_passes
from mpgraph.passes.op_table import OpEntry, OpTable
from mpgraph.plans.diff import PlanDiff, diff
from mpgraph.plans.plan import CastRecord, NodeRecord, Plan
from mpgraph.tools.cuda_graph import cuda_graph
from mpgraph.tools.generate import ConvertedDecoder, convert_decoder, generate
from mpgraph.tools.guard import NonFiniteError, guard
from mpgraph.tools.profiling import ProfileResult, profile
from mpgraph.tools.report import report
from mpgraph.plans.weights import load_weights


def export_onnx(*args, **kwargs):
    """Export to ONNX with the plan's types and validate the file (mpgraph.tools.onnx_export;
    imported on first use: onnx and onnxruntime are an optional extra)."""
    from mpgraph.tools.onnx_export import export_onnx as _export
    return _export(*args, **kwargs)


def ncu_command(*args, **kwargs):
    """The Nsight Compute command that profiles a program node by node (mpgraph.tools.ncu)."""
    from mpgraph.tools.ncu import ncu_command as _command
    return _command(*args, **kwargs)


def ort_session(*args, **kwargs):
    """onnxruntime session on CUDA when usable, else CPU (mpgraph.tools.onnx_check)."""
    from mpgraph.tools.onnx_check import ort_session as _session
    return _session(*args, **kwargs)


__version__ = "0.1.0"
__all__ = ["convert", "plan", "calibrate", "load_weights", "capture", "resolve_dtype", "Plan", "NodeRecord",
           "CastRecord", "OpTable", "OpEntry", "Pass", "PassResult", "run_passes", "CaptureError",
           "ConversionError", "ValueCheckError", "PassError", "MpgraphError", "ExportError", "CalibrationError",
           "ToleranceError", "PlanMismatchError", "InputMismatchError", "WeightOverflowError", "MissingWeightsError", "report", "diff", "PlanDiff", "export_onnx",
           "ort_session", "profile", "ProfileResult", "ncu_command", "cuda_graph",
           "convert_decoder", "generate", "ConvertedDecoder", "guard", "NonFiniteError"]
