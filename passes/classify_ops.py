"""Look every node up in the op table and record its class and the reason."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch

from mpgraph.ir.modules import TrainingBatchNorm
from mpgraph.ir.graph import grad_region, own_autocast
from mpgraph.ir.meta import LINEAR_BIAS, OP_CLASS, RANGE, OpInfo, dtype_name
from mpgraph.passes.numeric_safety import proven_in_range
from mpgraph.passes.op_table import FOLLOW, FP32_ONLY, UNKNOWN, OpTable
from mpgraph.passes.infra import Pass, PassResult

_NON_CALL = {
    "placeholder": OpInfo("input", "graph input: keeps its dtype", "placeholder"),
    "get_attr": OpInfo("parameter", "parameter or buffer: stored in the dtype its readers need",
                       "get_attr"),
    "output": OpInfo("output", "graph output: keeps its dtype by default", "output"),
}


def fixed_statistics(node, gm) -> bool:
    """True for a batch norm that normalises with its running statistics (eval mode)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        stats = getattr(module, "running_mean", None) is not None or isinstance(module, TrainingBatchNorm)
        return not module.training and stats
    # F.batch_norm, torch.batch_norm and aten.batch_norm all take ``training`` sixth
    training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else None)
    return training is False


def _container(node: torch.fx.Node) -> bool:
    """Whether ``node`` builds a namedtuple or dataclass of values (fx's record of ``return
    Out(logits, feats)``): a structure, not an op."""
    t = node.target
    return node.op == "call_function" and isinstance(t, type) and (
        (issubclass(t, tuple) and hasattr(t, "_fields")) or dataclasses.is_dataclass(t))


class ClassifyOps(Pass):
    """Analysis: writes ``mpgraph.op_class``, the only pass that does. The class may depend on
    the low dtype (bf16 vs fp16) and, for a range-expanding op in fp16, on calibration: where
    its calibrated values stay in fp16's range (``mpgraph.range``, when Calibrate ran before)
    it is ``follow``, else NumericSafety says why it stays float32."""
    stage = "decide"
    writes, also_reads = (OP_CLASS,), (RANGE, LINEAR_BIAS)

    def __init__(self, low_dtype: torch.dtype, table: OpTable | None = None):
        self.low = low_dtype
        self.table = table or OpTable.default()

    def call(self, gm):
        for node in gm.graph.nodes:
            if node.op in _NON_CALL:
                node.meta[OP_CLASS] = _NON_CALL[node.op]
                continue
            key, entry = self.table.lookup(node, gm)
            own = own_autocast(node)
            if own is not None:  # (not "unknown op kept in float32": it computes in its dtype)
                info = OpInfo(FP32_ONLY, f"the model's own torch.autocast({node.args[0]!r}, "
                                         f"{dtype_name(own)}) region: computes in {dtype_name(own)}"
                                         " inside, as the model does, kept whole", key)
            elif entry is None and (grad := grad_region(node)) is not None:  # (a region)
                mode = "torch.enable_grad()" if grad else "torch.no_grad()"
                info = OpInfo(FP32_ONLY, f"the model's own {mode} region, which torch.export "
                                         "keeps as one call: computes inside as the model does, "
                                         "kept whole", key)
            elif entry is None and _container(node):
                info = OpInfo(FP32_ONLY, f"builds the container {node.target.__name__} the "
                                         "model returns its values in: reads them in float32, "
                                         "as the model has them", key)
            elif entry is None:
                info = OpInfo(UNKNOWN, f"{key} is not in the op table: kept in float32", key)
            elif entry.inference is not None and fixed_statistics(node, gm):
                info = OpInfo(entry.class_for(self.low, inference=True),
                              entry.inference_reason or entry.reason, key)
            else:
                info = OpInfo(entry.class_for(self.low), entry.reason, key,
                              entry.params_as_values, entry.low_io, entry.range_expanding)
                proof = proven_in_range(node, self.low, name=key.rpartition(".")[2]) \
                    if info.op_class == FP32_ONLY \
                    and info.range_expanding and self.low == torch.float16 else None
                if proof:
                    info = replace(info, op_class=FOLLOW, reason=f"{info.reason}; {proof}")
                if node.meta.get(LINEAR_BIAS) and info.params_as_values:
                    info = replace(info, params_as_values=False,
                                   reason=f"{info.reason}; here a linear layer's bias, a weight")
            node.meta[OP_CLASS] = info
        return PassResult(gm, False)
