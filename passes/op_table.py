"""The op classification table: every target we know, its class and a one-line reason.

Three levels of targets meet us: ``call_module`` (nn.Module types), ``call_function`` and
``call_method`` (torch / torch.nn.functional / operator functions and Tensor method names), and the
ATen overloads that torch.export produces (keyed by overload packet, so ``aten.add`` covers
``aten.add.Tensor`` and ``aten.add.Scalar``).

Classes (the rule "if |f(x)| >> |x| for expected inputs, it is not follow" is TVM's):

- ``tensor_core``: matmul/conv work that Tensor Cores (and AVX512-BF16/AMX on CPUs) speed up.
- ``follow``: dtype-polymorphic and range-preserving; computes in its inputs' precision.
- ``fp32_compute``: accumulates internally (softmax, norms); kept in fp32 in this version.
- ``fp32_only``: range-expanding or long reductions (exp, pow, sum, mean, losses).
- ``cast``: an explicit dtype conversion in the model's own code; reads any dtype, writes the
  dtype it names, so it never needs a cast of ours in front of it.
- ``unknown``: not in the table; stays fp32 and is listed in the plan.

An entry may name a different class for bfloat16 (``bf16``): bf16 keeps fp32's exponent range,
so a range-expanding elementwise op is no overflow risk there (reductions keep their class: the
problem is accumulation precision, not range).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mpgraph.ir.modules import CountBatches, DropoutRate, TrainingBatchNorm

TENSOR_CORE = "tensor_core"
FOLLOW = "follow"
FP32_COMPUTE = "fp32_compute"
FP32_ONLY = "fp32_only"
CAST = "cast"
UNKNOWN = "unknown"
OP_CLASSES = (TENSOR_CORE, FOLLOW, FP32_COMPUTE, FP32_ONLY, CAST, UNKNOWN)


@dataclass(frozen=True)
class OpEntry:
    op_class: str
    reason: str
    bf16: Optional[str] = None       # class to use instead when the low dtype is bfloat16
    inference: Optional[str] = None  # class to use instead with fixed statistics (eval batch norm)
    inference_reason: str = ""
    # a parameter operand is a value added to or joined with the activations (a position
    # embedding, a class token), not a weight: it keeps float32 and so does the op, which keeps a
    # residual stream that starts at such an op in float32, as autocast's type promotion does
    params_as_values: bool = False
    # may read and write the low dtype while computing in float32 inside the kernel (a norm):
    # used where its input is already low and all its readers want low, 2 casts fewer than
    # casting around it. The value is the kernel contract: the target kinds whose kernel takes
    # float32 parameters with a low input (then the values are exactly those of casting around
    # it); on the others its parameters are stored in the low dtype. Empty: no low I/O.
    low_io: tuple[str, ...] = ()

    def class_for(self, low_dtype: torch.dtype, inference: bool = False) -> str:
        if inference and self.inference is not None:
            return self.inference
        if low_dtype == torch.bfloat16 and self.bf16 is not None:
            return self.bf16
        return self.op_class


def _group(targets, op_class: str, reason: str, bf16: Optional[str] = None,
           inference: Optional[str] = None, inference_reason: str = "",
           params_as_values: bool = False, low_io: tuple[str, ...] = ()) -> dict[Any, OpEntry]:
    entry = OpEntry(op_class, reason, bf16, inference, inference_reason, params_as_values, low_io)
    return {t: entry for t in targets}


# Target kinds a plan is made for (DeviceSpec.kind, and an ONNX file), and which of their
# kernels take a low-precision input with float32 parameters (weight, bias, running statistics).
CPU, GPU, ONNX = "cpu", "gpu", "onnx"
KERNEL_KINDS = (CPU, GPU, ONNX)
# ATen's CPU layer/group norm take float32 gamma/beta with bf16/fp16 input (mixed-dtype path);
# CUDA's read gamma/beta as the input's type (layer_norm_kernel.cu, group_norm_kernel.cu:
# "expected scalar type Half but found Float"); ONNX LayerNormalization and GroupNormalization
# type X, Scale and B as one T (their statistics stay float32: stash_type=1).
_MIXED_NORM = (CPU,)
# CPU batch norm has the same mixed-dtype path; CUDA's batch_norm_elementwise dispatches float
# parameters with a half input and cuDNN demands them; ONNX BatchNormalization (opset 15) types
# scale/B (T1) and mean/var (T2) apart from X (T).
_MIXED_BN = (CPU, GPU, ONNX)


def mixed_params_ok(low_io, kind: Optional[str]) -> bool:
    """Whether ``kind``'s kernel (None: every target's) takes float32 parameters with a low
    input, by an entry's ``low_io`` (``True``, from an older user entry, means every target)."""
    kinds = KERNEL_KINDS if low_io is True else tuple(low_io or ())
    return all(k in kinds for k in ((kind,) if kind else KERNEL_KINDS))


def _aten(*names: str) -> list:
    """ATen overload packets by name; names this torch build lacks are skipped."""
    out = []
    for name in names:
        ns, _, op = name.rpartition(".")
        namespace = getattr(torch.ops, ns or "aten")
        try:
            out.append(getattr(namespace, op))
        except (AttributeError, RuntimeError):
            continue
    return out


def _mods(*names: str) -> list:
    """nn module types by name; names this torch build lacks are skipped."""
    return [getattr(nn, n) for n in names if hasattr(nn, n)]


# Reasons, written once and shared by the entries of each group.
_MATMUL = "matrix multiply: Tensor Core / AVX512-BF16 work, accumulates in fp32 in the kernel"
_CONV = "convolution: Tensor Core / oneDNN bf16 work, accumulates in fp32 in the kernel"
_SDPA = "attention matmuls; the fused kernels keep softmax statistics in fp32"
_MHA = "projection and attention matmuls dominate; runs as one module (see README limits)"
_LAYOUT = "moves or selects elements without arithmetic: exact in any dtype"
_ACT = "activation bounded by |x| (or by a constant): cannot overflow"
_ARITH = "elementwise arithmetic: follows its inputs (calibrated ranges are issue #5's job)"
_JOIN = "joins or selects between tensors without arithmetic: follows its inputs"
_SCALE = "elementwise scaling: a parameter operand is a weight (a layer scale), stored like one"
_POOL = "max/average over a window: result within the input's range"
_DROPOUT = "dropout scales by 1/(1-p) at most: follows its input"
_COMPARE = "comparison or selection: output is bool/int or one of its inputs"
_CREATE = "allocates a tensor like its input: takes the input's dtype"
_NORM = "normalisation: mean/variance accumulate over many elements, kept in fp32"
_BN = ("batch norm in training: batch mean/variance accumulate over many elements, in fp32 "
       "(low-precision input and output where its neighbours are low: statistics, parameters and "
       "running statistics stay fp32, as Apex O2's keep_batchnorm_fp32)")
_BN_EVAL = "batch norm with fixed statistics: a per-channel affine map, follows its input"
_SOFTMAX = "softmax: exp of logits and a sum over the axis, kept in fp32"
_EXP = "range-expanding (|f(x)| >> |x|): overflows fp16; bf16 has fp32's range"
RANGE_EXPANDING_REASON = _EXP  # NumericSafety lowers these in fp16 when calibration proves them safe
_LOG = "log family: precision near 1 matters, kept in fp32 (autocast does the same)"
_REDUCE = "reduction over many elements: accumulation error and overflow in low precision"
_LOSS = "loss: reductions of logs/exps, kept in fp32"
_CASTDOC = "explicit dtype conversion in the model: output dtype is what the code asks for"
_GUARD = "torch.export's input guard check: returns nothing"

MODULE_TABLE: dict[Any, OpEntry] = {
    **_group(_mods("Linear", "Bilinear", "LazyLinear"), TENSOR_CORE, _MATMUL),
    **_group(_mods("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                   "ConvTranspose3d", "LazyConv1d", "LazyConv2d", "LazyConv3d"), TENSOR_CORE, _CONV),
    **_group(_mods("MultiheadAttention"), TENSOR_CORE, _MHA),
    **_group(_mods("LayerNorm", "GroupNorm"), FP32_COMPUTE, _NORM, low_io=_MIXED_NORM),
    **_group(_mods("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm",
                   "RMSNorm"), FP32_COMPUTE, _NORM),
    **_group(_mods("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm") + [TrainingBatchNorm],
             FP32_COMPUTE, _BN, inference=FOLLOW, inference_reason=_BN_EVAL, low_io=_MIXED_BN),
    **_group([CountBatches], FOLLOW, "counts batches (an integer buffer): no float arithmetic"),
    **_group([DropoutRate], FOLLOW, "a dropout probability (a Python float): no tensor"),
    **_group(_mods("Softmax", "LogSoftmax", "Softmin", "Softmax2d"), FP32_COMPUTE, _SOFTMAX),
    **_group(_mods("ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "ELU", "SELU", "CELU", "GELU",
                   "SiLU", "Mish", "Hardswish", "Hardsigmoid", "Hardtanh", "Sigmoid", "Tanh",
                   "Softsign", "Tanhshrink", "Hardshrink", "Softshrink", "Threshold", "GLU",
                   "LogSigmoid"), FOLLOW, _ACT),
    **_group(_mods("Softplus"), FP32_ONLY, _EXP, bf16=FOLLOW),
    **_group(_mods("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                   "FeatureAlphaDropout"), FOLLOW, _DROPOUT),
    **_group(_mods("MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
                   "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
                   "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d"), FOLLOW, _POOL),
    **_group(_mods("Identity", "Flatten", "Unflatten", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d",
                   "ConstantPad1d", "ConstantPad2d", "ConstantPad3d", "ReflectionPad1d",
                   "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d", "ReplicationPad2d",
                   "ReplicationPad3d", "PixelShuffle", "PixelUnshuffle", "ChannelShuffle",
                   "Embedding"), FOLLOW, _LAYOUT),
    **_group(_mods("Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"), FOLLOW,
             "interpolation is a convex combination of inputs: range-preserving"),
    **_group(_mods("CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss",
                   "BCELoss", "BCEWithLogitsLoss", "KLDivLoss", "CosineEmbeddingLoss"),
             FP32_ONLY, _LOSS),
}
try:  # torch.export wraps its input guards in a submodule of this type
    from torch.export._unlift import GuardsFn as _GuardsFn  # type: ignore[attr-defined]
    MODULE_TABLE[_GuardsFn] = OpEntry(FOLLOW, _GUARD)
except ImportError:  # pragma: no cover - older torch
    pass

FUNCTION_TABLE: dict[Any, OpEntry] = {
    # tensor core
    **_group([torch.matmul, torch.mm, torch.bmm, torch.baddbmm, torch.addmm, torch.addbmm,
              torch.addmv, torch.mv, torch.einsum, F.linear, F.bilinear, operator.matmul],
             TENSOR_CORE, _MATMUL),
    **_group([F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
              F.conv_transpose3d, torch.conv1d, torch.conv2d, torch.conv3d], TENSOR_CORE, _CONV),
    **_group([F.scaled_dot_product_attention], TENSOR_CORE, _SDPA),
    # fp32 compute
    **_group([F.layer_norm, F.group_norm, torch.layer_norm, torch.group_norm], FP32_COMPUTE, _NORM,
             low_io=_MIXED_NORM),
    **_group([F.instance_norm, F.local_response_norm]
             + ([F.rms_norm] if hasattr(F, "rms_norm") else []), FP32_COMPUTE, _NORM),
    **_group([F.batch_norm, torch.batch_norm], FP32_COMPUTE, _BN, low_io=_MIXED_BN, inference=FOLLOW,
             inference_reason=_BN_EVAL),
    **_group([F.softmax, F.log_softmax, F.softmin, torch.softmax, torch.log_softmax],
             FP32_COMPUTE, _SOFTMAX),
    # fp32 only
    **_group([torch.exp, torch.expm1, torch.pow, torch.rsqrt, torch.reciprocal, torch.sinh,
              torch.cosh, torch.tan, torch.exp2, F.softplus, operator.pow], FP32_ONLY, _EXP,
             bf16=FOLLOW),
    **_group([torch.log, torch.log2, torch.log10, torch.log1p, torch.erfinv, torch.sqrt,
              F.logsigmoid], FP32_ONLY, _LOG),
    **_group([torch.sum, torch.mean, torch.prod, torch.cumsum, torch.cumprod, torch.var,
              torch.std, torch.var_mean, torch.std_mean, torch.norm, torch.linalg.norm,
              torch.linalg.vector_norm, torch.logsumexp, torch.cdist, torch.dist,
              F.normalize, F.cosine_similarity, F.pairwise_distance], FP32_ONLY, _REDUCE),
    **_group([F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
              F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div],
             FP32_ONLY, _LOSS),
    # follow
    **_group([F.relu, F.relu6, F.leaky_relu, F.prelu, F.elu, F.selu, F.celu, F.gelu, F.silu,
              F.mish, F.hardswish, F.hardsigmoid, F.hardtanh, F.softsign, F.glu, F.threshold,
              torch.relu, torch.sigmoid, torch.tanh, torch.erf, torch.sign, torch.abs,
              torch.neg, torch.clamp, torch.clip, torch.floor, torch.ceil, torch.round,
              torch.trunc, torch.sin, torch.cos, torch.nn.functional.tanh,
              torch.nn.functional.sigmoid], FOLLOW, _ACT),
    **_group([F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
              F.feature_alpha_dropout, torch.dropout], FOLLOW, _DROPOUT),
    **_group([F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d,
              F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
              F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d],
             FOLLOW, _POOL),
    **_group([F.interpolate, F.upsample], FOLLOW,
             "interpolation is a convex combination of inputs: range-preserving"),
    **_group([torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.split, torch.chunk, torch.squeeze, torch.unsqueeze,
              torch.narrow, torch.select, torch.gather, torch.index_select, torch.flip,
              torch.roll, torch.t, torch.tile, torch.repeat_interleave, torch.unbind,
              torch.movedim, torch.broadcast_to, torch.tril, torch.triu, torch.diagonal,
              torch.masked_select, torch.take_along_dim, F.pad, F.embedding, F.pixel_shuffle,
              F.pixel_unshuffle, operator.getitem, getattr, torch.clone, torch.detach],
             FOLLOW, _LAYOUT),
    **_group([operator.add, operator.sub, operator.iadd, operator.isub, torch.add, torch.sub,
              torch.rsub, torch.addcmul, torch.addcdiv, torch.lerp, torch.maximum, torch.minimum,
              torch.fmax, torch.fmin], FOLLOW, _ARITH, params_as_values=True),
    **_group([operator.mul, operator.truediv, operator.neg, operator.imul, operator.itruediv,
              torch.mul, torch.div, torch.true_divide, torch.square], FOLLOW, _SCALE),
    **_group([torch.cat, torch.concat, torch.stack, torch.where], FOLLOW, _JOIN, params_as_values=True),
    **_group([torch.max, torch.min, torch.amax, torch.amin, torch.argmax, torch.argmin,
              torch.masked_fill, torch.eq, torch.ne, torch.lt, torch.gt, torch.le,
              torch.ge, torch.isnan, torch.isinf, torch.isfinite, operator.eq, operator.ne,
              operator.lt, operator.gt, operator.le, operator.ge, torch.topk, torch.sort,
              torch.argsort], FOLLOW, _COMPARE),
    **_group([torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
              torch.rand_like, torch.randn_like], FOLLOW, _CREATE),
}

METHOD_TABLE: dict[str, OpEntry] = {
    **_group(["matmul", "mm", "bmm", "baddbmm", "addmm", "__matmul__", "mv", "addmv"],
             TENSOR_CORE, _MATMUL),
    **_group(["softmax", "log_softmax"], FP32_COMPUTE, _SOFTMAX),
    **_group(["exp", "exp_", "expm1", "pow", "pow_", "rsqrt", "reciprocal", "sinh", "cosh",
              "tan", "__pow__", "__rpow__"], FP32_ONLY, _EXP, bf16=FOLLOW),
    **_group(["log", "log2", "log10", "log1p", "sqrt"], FP32_ONLY, _LOG),
    **_group(["sum", "mean", "prod", "cumsum", "cumprod", "var", "std", "norm", "logsumexp"],
             FP32_ONLY, _REDUCE),
    **_group(["to", "float", "double", "half", "bfloat16", "type", "int", "long", "bool"],
             CAST, _CASTDOC),
    **_group(["relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "abs", "neg", "sign",
              "clamp", "clamp_", "clip", "clamp_min", "clamp_max", "floor", "ceil", "round",
              "erf", "sin", "cos"], FOLLOW, _ACT),
    **_group(["view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t",
              "contiguous", "flatten", "unflatten", "unsqueeze", "squeeze", "expand",
              "expand_as", "repeat", "repeat_interleave", "split", "chunk", "unbind", "narrow",
              "select", "gather", "index_select", "flip", "roll", "movedim", "tril", "triu",
              "masked_select", "__getitem__", "detach", "clone", "size", "dim", "numel",
              "type_as", "tile", "diagonal", "masked_scatter", "scatter", "index_fill",
              "copy_", "fill_", "zero_"], FOLLOW, _LAYOUT),
    **_group(["add", "add_", "sub", "sub_", "__add__", "__radd__", "__sub__", "__rsub__",
              "__iadd__", "__isub__", "addcmul", "addcdiv", "lerp", "maximum", "minimum"],
             FOLLOW, _ARITH, params_as_values=True),
    **_group(["mul", "mul_", "div", "div_", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__neg__", "__imul__", "__itruediv__", "square"], FOLLOW, _SCALE),
    **_group(["max", "min", "amax", "amin", "argmax", "argmin", "masked_fill", "masked_fill_",
              "where", "eq", "ne", "lt", "gt", "le", "ge", "__eq__", "__ne__", "__lt__", "__gt__",
              "__le__", "__ge__", "topk", "sort", "argsort", "isnan", "isinf"], FOLLOW, _COMPARE),
    **_group(["new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"], FOLLOW, _CREATE),
    **_group(["dropout"], FOLLOW, _DROPOUT),
}

ATEN_TABLE: dict[Any, OpEntry] = {
    **_group(_aten("linear", "addmm", "mm", "bmm", "baddbmm", "addbmm", "matmul", "einsum",
                   "mv", "addmv", "bilinear"), TENSOR_CORE, _MATMUL),
    **_group(_aten("convolution", "_convolution", "conv1d", "conv2d", "conv3d",
                   "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
             TENSOR_CORE, _CONV),
    **_group(_aten("scaled_dot_product_attention"), TENSOR_CORE, _SDPA),
    **_group(_aten("layer_norm", "group_norm"), FP32_COMPUTE, _NORM, low_io=_MIXED_NORM),
    **_group(_aten("native_layer_norm", "native_group_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_no_training", "instance_norm", "rms_norm",
                   "_fused_rms_norm"), FP32_COMPUTE, _NORM),
    **_group(_aten("batch_norm"), FP32_COMPUTE, _BN, inference=FOLLOW, inference_reason=_BN_EVAL,
             low_io=_MIXED_BN),
    **_group(_aten("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"),
             FP32_COMPUTE, _SOFTMAX),
    **_group(_aten("exp", "exp_", "expm1", "pow", "pow_", "rsqrt", "reciprocal", "sinh", "cosh",
                   "tan", "exp2", "softplus"), FP32_ONLY, _EXP, bf16=FOLLOW),
    **_group(_aten("log", "log2", "log10", "log1p", "erfinv", "sqrt", "log_sigmoid_forward"),
             FP32_ONLY, _LOG),
    **_group(_aten("sum", "mean", "prod", "cumsum", "cumprod", "var", "std", "var_mean",
                   "std_mean", "norm", "linalg_vector_norm", "logsumexp", "cdist",
                   "_cdist_forward", "dist", "cosine_similarity"), FP32_ONLY, _REDUCE),
    **_group(_aten("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward",
                   "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                   "binary_cross_entropy_with_logits", "kl_div"), FP32_ONLY, _LOSS),
    **_group(_aten("_to_copy", "to", "prims.convert_element_type"), CAST, _CASTDOC),
    **_group(_aten("relu", "relu_", "relu6", "leaky_relu", "leaky_relu_", "prelu",
                   "_prelu_kernel", "elu", "selu", "celu", "gelu", "silu", "silu_", "mish",
                   "hardswish", "hardswish_", "hardsigmoid", "hardtanh", "hardtanh_", "sigmoid",
                   "tanh", "erf", "sign", "abs", "neg", "clamp", "clamp_", "clamp_min",
                   "clamp_max", "clip", "floor", "ceil", "round", "trunc", "sin", "cos", "glu",
                   "threshold"), FOLLOW, _ACT),
    **_group(_aten("dropout", "native_dropout", "feature_dropout", "alpha_dropout",
                   "feature_alpha_dropout"), FOLLOW, _DROPOUT),
    **_group(_aten("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
                   "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                   "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
                   "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
                   "adaptive_max_pool2d", "adaptive_max_pool3d"), FOLLOW, _POOL),
    **_group(_aten("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                   "upsample_bilinear2d", "upsample_linear1d", "upsample_bicubic2d",
                   "upsample_trilinear3d", "_upsample_nearest_exact2d"), FOLLOW,
             "interpolation is a convex combination of inputs: range-preserving"),
    **_group(_aten("view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand",
                   "expand_as", "unsqueeze", "squeeze", "contiguous", "clone", "slice",
                   "select", "narrow", "split", "split_with_sizes",
                   "chunk", "unbind", "index", "index_select", "gather", "embedding", "flatten",
                   "unflatten", "alias", "detach", "lift_fresh_copy", "constant_pad_nd", "pad",
                   "flip", "roll", "repeat", "tile", "repeat_interleave", "tril", "triu",
                   "diagonal", "movedim", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
                   "masked_select", "index_put", "index_put_", "scatter", "copy_", "fill_",
                   "zero_", "slice_scatter", "select_scatter", "as_strided", "unfold",
                   "sym_size", "sym_numel", "sym_stride", "_assert_tensor_metadata"),
             FOLLOW, _LAYOUT),
    **_group(_aten("add", "add_", "sub", "sub_", "rsub", "addcmul", "addcdiv", "lerp", "maximum",
                   "minimum"), FOLLOW, _ARITH, params_as_values=True),
    **_group(_aten("mul", "mul_", "div", "div_", "square"), FOLLOW, _SCALE),
    **_group(_aten("cat", "concat", "stack", "where"), FOLLOW, _JOIN, params_as_values=True),
    **_group(_aten("max", "min", "amax", "amin", "argmax", "argmin", "masked_fill",
                   "masked_fill_", "eq", "ne", "lt", "gt", "le", "ge", "isnan", "isinf",
                   "topk", "sort", "argsort", "logical_and", "logical_or", "logical_not",
                   "__and__", "__or__", "bitwise_and", "bitwise_or"), FOLLOW, _COMPARE),
    **_group(_aten("zeros_like", "ones_like", "full_like", "empty_like", "rand_like",
                   "randn_like", "new_zeros", "new_ones", "new_full", "new_empty"),
             FOLLOW, _CREATE),
}


def _fn_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    if module.startswith("torch.nn.functional"):
        return f"F.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch"):
        return f"torch.{name}"
    return f"{module}.{name}" if module else name


@dataclass
class OpTable:
    """The lookup over the four tables. Users pass their own entries to extend or replace ours.

    ``extra`` maps any key the tables use (module type, function, method name, ATen overload or
    packet) to an OpEntry or to a class name; it takes precedence over the built-in tables.
    """

    modules: dict
    functions: dict
    methods: dict
    aten: dict
    extra: dict

    @classmethod
    def default(cls, extra: Optional[dict] = None) -> "OpTable":
        norm = {}
        for key, value in (extra or {}).items():
            if isinstance(value, str):
                if value not in OP_CLASSES:
                    raise ValueError(f"unknown op class {value!r} for {key!r}; use one of {OP_CLASSES}")
                value = OpEntry(value, "user table entry")
            if not isinstance(value, OpEntry):
                raise TypeError(f"op table values must be OpEntry or a class name, got {value!r}")
            norm[key] = value
        return cls(MODULE_TABLE, FUNCTION_TABLE, METHOD_TABLE, ATEN_TABLE, norm)

    def lookup(self, node, root: torch.nn.Module) -> tuple[str, Optional[OpEntry]]:
        """Return (key as text, entry or None) for a call_* node."""
        if node.op == "call_module":
            mod = root.get_submodule(node.target)
            for klass in type(mod).__mro__:
                for table in (self.extra, self.modules):
                    if klass in table:
                        return _module_name(klass), table[klass]
            return _module_name(type(mod)), None
        if node.op == "call_method":
            for table in (self.extra, self.methods):
                if node.target in table:
                    return f"Tensor.{node.target}", table[node.target]
            return f"Tensor.{node.target}", None
        if node.op == "call_function":
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                packet = target.overloadpacket
                name = f"{target.namespace}.{target._opname}"
                for table in (self.extra, self.aten):
                    for key in (target, packet):
                        if key in table:
                            return name, table[key]
                return name, None
            if isinstance(target, torch._ops.OpOverloadPacket):
                name = str(target)
                for table in (self.extra, self.aten):
                    if target in table:
                        return name, table[target]
                return name, None
            for table in (self.extra, self.functions):
                try:
                    if target in table:
                        return _fn_name(target), table[target]
                except TypeError:  # unhashable target
                    break
            return _fn_name(target), None
        return node.op, None


def _module_name(klass: type) -> str:
    if klass.__module__.startswith("torch.nn"):
        return f"nn.{klass.__name__}"
    return f"{klass.__module__}.{klass.__name__}"
