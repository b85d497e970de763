"""mpgraph: whole-graph mixed precision for PyTorch models.

``mpgraph.convert(model, example_inputs, dtype=torch.bfloat16)`` captures the graph, decides a
precision for every node, stores weights once in low precision, inserts the fewest shared casts,
checks the result by running it, and returns a GraphModule carrying ``.plan``.
"""
from .api import convert, resolve_dtype
from .capture import capture
from .errors import CaptureError, ConversionError, MpgraphError, PassError
from .op_table import OpEntry, OpTable
from .pass_infra import Pass, PassResult, run_passes
from .plan import CastRecord, NodeRecord, Plan

__version__ = "0.1.0"
__all__ = ["convert", "capture", "resolve_dtype", "Plan", "NodeRecord", "CastRecord", "OpTable",
           "OpEntry", "Pass", "PassResult", "run_passes", "CaptureError", "ConversionError",
           "PassError", "MpgraphError"]
