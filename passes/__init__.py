"""mpgraph's passes, one file each, named for what they do, with what they share: the pass
contract (``infra``), the op table every pass reads (``op_table``) and the default pipeline
(``pipeline``: a plain list of pass instances).

Installed as ``mpgraph.passes``.
"""
from mpgraph.passes.assign_precision import AssignPrecision
from mpgraph.passes.assign_precision_optimal import AssignPrecisionOptimal
from mpgraph.passes.calibrate import Calibrate
from mpgraph.passes.channels_last import ChannelsLast
from mpgraph.passes.check_conversion import CheckConversion
from mpgraph.passes.classify_ops import ClassifyOps
from mpgraph.passes.contiguous_attention_mask import ContiguousAttentionMask
from mpgraph.passes.contiguous_linear_inputs import ContiguousLinearInputs
from mpgraph.passes.estimate_cost import EstimateCost
from mpgraph.passes.fold_dtype_reads import FoldDtypeReads
from mpgraph.passes.follow_training_flag import FollowTrainingFlag
from mpgraph.passes.functionalize import Functionalize
from mpgraph.passes.fuse_sibling_gemv import FuseSiblingGemv
from mpgraph.passes.fuse_tanh_gelu import FuseTanhGelu
from mpgraph.passes.insert_casts import InsertCasts
from mpgraph.passes.lint_tensor_cores import LintTensorCores
from mpgraph.passes.mat_vec_linear import MatVecLinear
from mpgraph.passes.numeric_safety import NumericSafety
from mpgraph.passes.pack_cpu_linears import PackCpuLinears
from mpgraph.passes.propagate_tensor_info import PropagateTensorInfo
from mpgraph.passes.prune_for_inference import PruneForInference
from mpgraph.passes.retarget_dtype_asserts import RetargetDtypeAsserts
from mpgraph.passes.store_weights import StoreWeights

__all__ = ["AssignPrecision", "AssignPrecisionOptimal", "Calibrate", "ChannelsLast",
           "CheckConversion", "ClassifyOps", "ContiguousAttentionMask", "ContiguousLinearInputs", "EstimateCost", "FoldDtypeReads", "FollowTrainingFlag", "Functionalize",
           "FuseSiblingGemv", "FuseTanhGelu", "InsertCasts",
           "LintTensorCores", "MatVecLinear", "NumericSafety", "PackCpuLinears", "PropagateTensorInfo", "PruneForInference",
           "RetargetDtypeAsserts", "StoreWeights"]
