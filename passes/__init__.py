"""mpgraph's passes, one file each, named for what they do.

Installed as ``mpgraph.passes``. The default pipeline is built by ``mpgraph.pipeline.default_pipeline``.
"""
from .assign_precision import AssignPrecision
from .assign_precision_optimal import AssignPrecisionOptimal
from .calibrate import Calibrate
from .channels_last import ChannelsLast
from .check_dtypes import CheckDtypes
from .classify_ops import ClassifyOps
from .estimate_cost import EstimateCost
from .follow_training_flag import FollowTrainingFlag
from .fuse_tanh_gelu import FuseTanhGelu
from .insert_casts import InsertCasts
from .lint_tensor_cores import LintTensorCores
from .numeric_safety import NumericSafety
from .propagate_tensor_info import PropagateTensorInfo
from .retarget_dtype_asserts import RetargetDtypeAsserts
from .store_weights import StoreWeights

__all__ = ["AssignPrecision", "AssignPrecisionOptimal", "Calibrate", "ChannelsLast",
           "CheckDtypes", "ClassifyOps", "EstimateCost", "FollowTrainingFlag", "FuseTanhGelu", "InsertCasts",
           "LintTensorCores", "NumericSafety", "PropagateTensorInfo",
           "RetargetDtypeAsserts", "StoreWeights"]
