"""The op classification table: one entry per op, its class and a one-line reason.

Three levels of targets meet us: ``call_module`` (nn.Module types), ``call_function`` and
``call_method`` (torch / torch.nn.functional / operator functions and Tensor method names), and the
ATen overloads that torch.export produces. An op is written once, by its name (``OPS``: "exp",
"layer_norm", "lstm"); every spelling of it is derived from the name (``spellings``): the
functions ``torch.<name>`` and ``torch.nn.functional.<name>`` (``torch.linalg.<rest>`` for
``linalg_<rest>``) and their in-place ``<name>_``, the Tensor methods ``<name>`` and ``<name>_``,
and the ATen overload packets ``aten.<name>`` and ``aten.<name>_`` (a packet covers every
overload: ``aten.add`` is ``aten.add.Tensor`` and ``aten.add.Scalar``). The spellings no name
derives are written beside it (``SPELLED_APART``): nn module types, Python's operators
(``operator.add``, ``Tensor.__add__``) and functions named apart from their op
(``F.logsigmoid``). So ``torch.exp``, ``x.exp()``, ``x.exp_()`` and ``aten.exp.default`` cannot
disagree, and a spelling two ops claim is an error when this module loads.

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
problem is accumulation precision, not range). Range-expanding ops say so (``range_expanding``):
ClassifyOps makes them ``follow`` in fp16 where calibration proves them in range (NumericSafety
says why where it does not).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mpgraph.ir.modules import CountBatches, DropoutRate, InputGuard, TrainingBatchNorm, TrainingFlag
from mpgraph.ir.ops import MOVES

from mpgraph.ir.meta import (CAST, FOLLOW, FP32_COMPUTE, FP32_ONLY, OP_CLASSES,  # noqa: F401
                             TENSOR_CORE, UNKNOWN, Kind)


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
    # |f(x)| >> |x| elementwise (exp, pow): fp32-only in fp16 until calibration proves the values
    # stay in range, which ClassifyOps checks (it reads this flag, never the reason's text)
    range_expanding: bool = False

    def class_for(self, low_dtype: torch.dtype, inference: bool = False) -> str:
        if inference and self.inference is not None:
            return self.inference
        if low_dtype == torch.bfloat16 and self.bf16 is not None:
            return self.bf16
        return self.op_class


# Target kinds a plan is made for (DeviceSpec.kind, and an ONNX file), and which of their
# kernels take a low-precision input with float32 parameters (weight, bias, running statistics).
CPU, GPU, ONNX = Kind.CPU, Kind.GPU, Kind.ONNX
KERNEL_KINDS = tuple(Kind)
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


# Reasons, written once and shared by the entries of each group.
_MATMUL = "matrix multiply: Tensor Core / AVX512-BF16 work, accumulates in fp32 in the kernel"
_CONV = "convolution: Tensor Core / oneDNN bf16 work, accumulates in fp32 in the kernel"
_SDPA = "attention matmuls; the fused kernels keep softmax statistics in fp32"
_MHA = "projection and attention matmuls dominate; runs as one module (see README limits)"
_RNN = ("recurrent layer: its input and hidden projections are matmuls (autocast runs it in "
        "fp16); gates are bounded by sigmoid/tanh, an LSTM's cell state grows by at most 1 a step")
_LAYOUT = "moves or selects elements without arithmetic: exact in any dtype"
_ACT = "activation bounded by |x| (or by a constant): cannot overflow"
_ARITH = "elementwise arithmetic: follows its inputs (NumericSafety keeps an overflowing one float32)"
_JOIN = "joins or selects between tensors without arithmetic: follows its inputs"
_SCALE = "elementwise scaling: a parameter operand is a weight (a layer scale), stored like one"
_POOL = "max/average over a window: result within the input's range"
_INTERP = "interpolation is a convex combination of inputs: range-preserving"
_DROPOUT = "dropout scales by 1/(1-p) at most: follows its input"
_COMPARE = "comparison or selection: output is bool/int or one of its inputs"
_CREATE = "allocates a tensor like its input: takes the input's dtype"
_FACTORY = "creates a tensor from sizes or scalars, reads no tensor: the dtype its code names"
_NORM = "normalisation: mean/variance accumulate over many elements, kept in fp32"
_BN = ("batch norm in training: batch mean/variance accumulate over many elements, in fp32 "
       "(low-precision input and output where its neighbours are low: statistics, parameters and "
       "running statistics stay fp32, as Apex O2's keep_batchnorm_fp32)")
_BN_EVAL = "batch norm with fixed statistics: a per-channel affine map, follows its input"
_SOFTMAX = "softmax: exp of logits and a sum over the axis, kept in fp32"
_EXP = "range-expanding (|f(x)| >> |x|): overflows fp16; bf16 has fp32's range"
_LOG = "log family: precision near 1 matters, kept in fp32 (autocast does the same)"
_ARC = ("inverse sine/cosine: the slope is unbounded at ±1, so rounding an input near ±1 moves "
        "the output far; kept in fp32 (autocast does the same)")
_REDUCE = "reduction over many elements: accumulation error and overflow in low precision"
_LOSS = "loss: reductions of logs/exps, kept in fp32"
_CASTDOC = "explicit dtype conversion in the model: output dtype is what the code asks for"
_GUARD = "torch.export's input guard check: returns nothing"
# (pL F7: 0.09 relative L2 off the model's noise in bf16, 0.047 in fp16, passed as rounding;
# randn_like and dropout draw the same sample in each dtype, up to rounding)
_UNIFORM = ("draws uniform noise: in float32, the model's sample for its seed (torch's CPU "
            "rand_like in bf16/fp16 draws another sequence from 4096 elements up)")
_COMPLEX = ("a complex view of float pairs: its input stays float32 (complex64), as there is no "
            "complex bfloat16 and complex32 (from float16) has few kernels")


def _ops(op_class: str, reason: str, names: str, **flags) -> dict[str, OpEntry]:
    """Entries for the ops ``names`` (separated by white space), sharing a class and a reason."""
    entry = OpEntry(op_class, reason, **flags)
    return {name: entry for name in names.split()}


def _table(*groups: dict[str, OpEntry]) -> dict[str, OpEntry]:
    """The groups as one table; an op written twice is an error."""
    table: dict[str, OpEntry] = {}
    for group in groups:
        twice = table.keys() & group.keys()
        if twice:
            raise ValueError(f"op table: {sorted(twice)} written twice")
        table.update(group)
    return table


# One entry per op, by name: its ATen name where it has one, else its torch.nn.functional name,
# else a name of ours for an op only other spellings have (getitem, identity, count_batches).
OPS: dict[str, OpEntry] = _table(
    _ops(TENSOR_CORE, _MATMUL, """matmul mm bmm baddbmm addmm addbmm addmv mv addr einsum linear
         bilinear chain_matmul linalg_multi_dot linalg_vecdot _addmm_activation _grouped_mm
         transformers.grouped_mm_fallback"""),
    _ops(TENSOR_CORE, _CONV, """convolution _convolution conv1d conv2d conv3d conv_transpose1d
         conv_transpose2d conv_transpose3d conv_tbc cudnn_convolution
         cudnn_convolution_transpose"""),
    _ops(TENSOR_CORE, _SDPA, "scaled_dot_product_attention"),
    _ops(TENSOR_CORE, _MHA, "multi_head_attention_forward _native_multi_head_attention"),
    _ops(TENSOR_CORE, _RNN, """lstm gru rnn_tanh rnn_relu lstm_cell gru_cell rnn_tanh_cell
         rnn_relu_cell _thnn_fused_lstm_cell _thnn_fused_gru_cell"""),

    _ops(FP32_COMPUTE, _NORM, "layer_norm group_norm", low_io=_MIXED_NORM),
    _ops(FP32_COMPUTE, _NORM, """native_layer_norm native_group_norm _native_batch_norm_legit
         _native_batch_norm_legit_no_training instance_norm local_response_norm rms_norm
         _fused_rms_norm"""),
    _ops(FP32_COMPUTE, _BN, "batch_norm", inference=FOLLOW, inference_reason=_BN_EVAL,
         low_io=_MIXED_BN),
    _ops(FP32_COMPUTE, _SOFTMAX, "softmax _softmax log_softmax _log_softmax _safe_softmax softmin"),

    _ops(FP32_ONLY, _EXP, "exp expm1 exp2 pow rsqrt reciprocal sinh cosh tan softplus",
         bf16=FOLLOW, range_expanding=True),
    _ops(FP32_ONLY, _LOG, "log log2 log10 log1p erfinv sqrt log_sigmoid log_sigmoid_forward"),
    _ops(FP32_ONLY, _ARC, "acos asin"),
    _ops(FP32_ONLY, _REDUCE, """sum mean prod cumsum cumprod var std var_mean std_mean norm
         linalg_norm linalg_vector_norm linalg_matrix_norm frobenius_norm nuclear_norm renorm
         logsumexp cdist _cdist_forward pdist _pdist_forward dist normalize cosine_similarity
         pairwise_distance"""),
    _ops(FP32_ONLY, _LOSS, """cross_entropy cross_entropy_loss nll_loss nll_loss_forward
         nll_loss_nd nll_loss2d nll_loss2d_forward mse_loss l1_loss smooth_l1_loss huber_loss
         binary_cross_entropy binary_cross_entropy_with_logits kl_div poisson_nll_loss
         gaussian_nll_loss cosine_embedding_loss hinge_embedding_loss margin_ranking_loss
         triplet_margin_loss triplet_margin_with_distance_loss soft_margin_loss multi_margin_loss
         multilabel_margin_loss multilabel_margin_loss_forward multilabel_soft_margin_loss
         ctc_loss"""),

    _ops(CAST, _CASTDOC, """to _to_copy prims.convert_element_type type float double half bfloat16
         int long bool"""),

    _ops(FOLLOW, _ACT, """relu relu6 leaky_relu prelu _prelu_kernel rrelu elu selu celu gelu silu
         mish hardswish hardsigmoid hardtanh sigmoid tanh softsign tanhshrink hardshrink
         softshrink threshold glu erf sign abs neg clamp clip clamp_min clamp_max floor ceil round
         trunc sin cos"""),
    _ops(FOLLOW, _DROPOUT, """dropout native_dropout feature_dropout alpha_dropout
         feature_alpha_dropout dropout1d dropout2d dropout3d"""),
    _ops(FOLLOW, _POOL, """max_pool1d max_pool2d max_pool3d max_pool2d_with_indices
         max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d
         adaptive_avg_pool2d adaptive_avg_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d
         adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d"""),
    _ops(FOLLOW, _INTERP, """interpolate upsample upsample_nearest1d upsample_nearest2d
         upsample_nearest3d _upsample_nearest_exact2d upsample_linear1d upsample_bilinear2d
         upsample_bicubic2d upsample_trilinear3d"""),
    _ops(FOLLOW, _LAYOUT, " ".join(n for n in MOVES if n != "view_as_complex")),  # (ir.ops)
    _ops(FP32_ONLY, _COMPLEX, "view_as_complex"),
    _ops(FOLLOW, _ARITH, "add sub rsub addcmul addcdiv lerp maximum minimum fmax fmin diff",
         params_as_values=True),
    _ops(FOLLOW, _SCALE, "mul div true_divide square"),
    _ops(FOLLOW, _JOIN, "cat concat stack where", params_as_values=True),
    _ops(FOLLOW, _COMPARE, """max min amax amin argmax argmin topk sort argsort masked_fill eq ne
         lt gt le ge isnan isinf isfinite logical_and logical_or logical_not __and__ __or__
         bitwise_and bitwise_or"""),
    _ops(FOLLOW, _CREATE, """zeros_like ones_like full_like empty_like randn_like
         new_zeros new_ones new_full new_empty new_tensor"""),
    _ops(FP32_ONLY, _UNIFORM, "rand_like"),
    _ops(FOLLOW, _FACTORY, """arange zeros ones full empty empty_strided linspace eye scalar_tensor
         rand randn randint"""),
    # ops only a module type spells (mpgraph's own modules, torch.export's guard)
    _ops(FP32_ONLY, "a torch.nn.utils.parametrize parametrization: computes its weight from "
         "the originals in float32 (orthogonal's and matrix_exp's linear algebra has no "
         "float16/bfloat16 kernels); its readers take the result in their dtype",
         "parametrization"),
    _ops(FOLLOW, "counts batches (an integer buffer): no float arithmetic", "count_batches"),
    _ops(FOLLOW, "a dropout probability (a Python float): no tensor", "dropout_rate"),
    _ops(FOLLOW, "the training flag (a Python bool): no tensor", "training_flag"),
    _ops(FOLLOW, _GUARD, "export_guards"),
)


def _nn(*names: str) -> tuple:
    """nn module types by name; names this torch build lacks are skipped."""
    return tuple(getattr(nn, n) for n in names if hasattr(nn, n))


def _numbered(*stems: str) -> tuple:
    """nn module types ``<stem>1d``, ``<stem>2d`` and ``<stem>3d``."""
    return _nn(*(f"{stem}{d}d" for stem in stems for d in (1, 2, 3)))


try:  # torch.export wraps its input guards in a submodule of this type (capture: InputGuard)
    from torch.export._unlift import GuardsFn as _GuardsFn  # type: ignore[attr-defined]
    _GUARDS: tuple = (_GuardsFn, InputGuard)
except ImportError:  # pragma: no cover - older torch
    _GUARDS = (InputGuard,)

# Spellings no name derives, by op: nn module types, Python's operators (the operator module's
# functions, and the Tensor methods, as strings, that ``x + y`` and ``x[i]`` call), functions
# named apart from their op.
SPELLED_APART: dict[str, tuple] = {
    "linear": _nn("Linear", "LazyLinear"),
    "bilinear": _nn("Bilinear"),
    "matmul": (operator.matmul, "__matmul__", "__rmatmul__"),
    **{f"conv{d}d": _nn(f"Conv{d}d", f"LazyConv{d}d") for d in (1, 2, 3)},
    **{f"conv_transpose{d}d": _nn(f"ConvTranspose{d}d", f"LazyConvTranspose{d}d")
       for d in (1, 2, 3)},
    "multi_head_attention_forward": _nn("MultiheadAttention"),
    "lstm": _nn("LSTM"), "gru": _nn("GRU"), "rnn_tanh": _nn("RNN"),  # nn.RNN: tanh or relu
    "lstm_cell": _nn("LSTMCell"), "gru_cell": _nn("GRUCell"), "rnn_tanh_cell": _nn("RNNCell"),
    "layer_norm": _nn("LayerNorm"),
    "group_norm": _nn("GroupNorm"),
    "instance_norm": _numbered("InstanceNorm"),
    "local_response_norm": _nn("LocalResponseNorm"),
    "rms_norm": _nn("RMSNorm"),
    "batch_norm": _numbered("BatchNorm") + _nn("SyncBatchNorm") + (TrainingBatchNorm,),
    "softmax": _nn("Softmax", "Softmax2d"),
    "log_softmax": _nn("LogSoftmax"),
    "softmin": _nn("Softmin"),
    "pow": (operator.pow, operator.ipow, "__pow__", "__rpow__", "__ipow__"),
    "softplus": _nn("Softplus"),
    "log_sigmoid": (F.logsigmoid,) + _nn("LogSigmoid"),
    **{op: _nn(module) for op, module in (
        ("relu", "ReLU"), ("relu6", "ReLU6"), ("leaky_relu", "LeakyReLU"), ("prelu", "PReLU"),
        ("rrelu", "RReLU"), ("elu", "ELU"), ("selu", "SELU"), ("celu", "CELU"), ("gelu", "GELU"),
        ("silu", "SiLU"), ("mish", "Mish"), ("hardswish", "Hardswish"),
        ("hardsigmoid", "Hardsigmoid"), ("hardtanh", "Hardtanh"), ("sigmoid", "Sigmoid"),
        ("tanh", "Tanh"), ("softsign", "Softsign"), ("tanhshrink", "Tanhshrink"),
        ("hardshrink", "Hardshrink"), ("softshrink", "Softshrink"), ("threshold", "Threshold"),
        ("glu", "GLU"), ("dropout", "Dropout"), ("dropout1d", "Dropout1d"),
        ("dropout2d", "Dropout2d"), ("dropout3d", "Dropout3d"), ("alpha_dropout", "AlphaDropout"),
        ("feature_alpha_dropout", "FeatureAlphaDropout"), ("flatten", "Flatten"),
        ("unflatten", "Unflatten"), ("pixel_shuffle", "PixelShuffle"),
        ("pixel_unshuffle", "PixelUnshuffle"), ("channel_shuffle", "ChannelShuffle"),
        ("embedding", "Embedding"), ("identity", "Identity"),
        ("cross_entropy", "CrossEntropyLoss"), ("mse_loss", "MSELoss"), ("l1_loss", "L1Loss"),
        ("smooth_l1_loss", "SmoothL1Loss"), ("huber_loss", "HuberLoss"),
        ("binary_cross_entropy", "BCELoss"),
        ("binary_cross_entropy_with_logits", "BCEWithLogitsLoss"), ("kl_div", "KLDivLoss"),
        ("poisson_nll_loss", "PoissonNLLLoss"), ("gaussian_nll_loss", "GaussianNLLLoss"),
        ("cosine_embedding_loss", "CosineEmbeddingLoss"),
        ("hinge_embedding_loss", "HingeEmbeddingLoss"),
        ("margin_ranking_loss", "MarginRankingLoss"), ("triplet_margin_loss", "TripletMarginLoss"),
        ("triplet_margin_with_distance_loss", "TripletMarginWithDistanceLoss"),
        ("soft_margin_loss", "SoftMarginLoss"), ("multi_margin_loss", "MultiMarginLoss"),
        ("multilabel_margin_loss", "MultiLabelMarginLoss"),
        ("multilabel_soft_margin_loss", "MultiLabelSoftMarginLoss"), ("ctc_loss", "CTCLoss"),
        ("cosine_similarity", "CosineSimilarity"), ("pairwise_distance", "PairwiseDistance"))},
    "nll_loss": _nn("NLLLoss", "NLLLoss2d"),
    "pad": _nn("CircularPad1d", "CircularPad2d", "CircularPad3d"),
    "constant_pad_nd": _numbered("ZeroPad", "ConstantPad"),
    **{f"{kind}_pad{d}d": _nn(f"{kind.capitalize()}Pad{d}d")
       for kind in ("reflection", "replication") for d in (1, 2, 3)},
    **{f"{kind}_pool{d}d": _nn(f"{module}Pool{d}d") for kind, module in (
        ("max", "Max"), ("avg", "Avg"), ("adaptive_avg", "AdaptiveAvg"),
        ("adaptive_max", "AdaptiveMax")) for d in (1, 2, 3)},
    "interpolate": _nn("Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"),
    "getitem": (operator.getitem, "__getitem__"),
    "parametrization": (torch.nn.utils.parametrize.ParametrizationList,),
    "getattr": (getattr,),
    "add": (operator.add, operator.iadd, "__add__", "__radd__", "__iadd__"),
    "sub": (operator.sub, operator.isub, "__sub__", "__isub__"),
    "rsub": ("__rsub__",),
    "mul": (operator.mul, operator.imul, "__mul__", "__rmul__", "__imul__"),
    "div": (operator.truediv, operator.itruediv, "__truediv__", "__rtruediv__", "__itruediv__"),
    "neg": (operator.neg, "__neg__"),
    "abs": (operator.abs, "__abs__"),
    **{op: (getattr(operator, op), f"__{op}__") for op in ("eq", "ne", "lt", "gt", "le", "ge")},
    "__and__": (operator.and_,),
    "__or__": (operator.or_,),
    "count_batches": (CountBatches,),
    "dropout_rate": (DropoutRate,),
    "training_flag": (TrainingFlag,),
    "export_guards": _GUARDS,
}


def _packets(namespace: str, names: tuple) -> list:
    """ATen (or prims) overload packets by name; names this torch build lacks are skipped."""
    out = []
    for name in names:
        try:
            out.append(getattr(getattr(torch.ops, namespace), name))
        except (AttributeError, RuntimeError):
            continue
    return out


def spellings(name: str) -> list:
    """Every target that spells the op ``name`` in this torch build: functions, Tensor method
    names (strings), ATen overload packets, then the spellings written apart (module types...)."""
    if "." in name:  # another namespace's op ("prims.convert_element_type"): its packet only
        namespace, op = name.split(".")
        return _packets(namespace, (op,))
    spaces = [(torch, name), (F, name)]
    if name.startswith("linalg_"):
        spaces.append((torch.linalg, name.removeprefix("linalg_")))
    found: list = []
    for space, attr in spaces:
        for fn in (getattr(space, attr, None), getattr(space, attr + "_", None)):
            # a function: not a dtype (torch.float), a type or a submodule (torch.linalg)
            if callable(fn) and not isinstance(fn, type) and not any(fn is f for f in found):
                found.append(fn)
    found += [m for m in (name, name + "_") if callable(getattr(torch.Tensor, m, None))]
    found += _packets("aten", (name, name + "_"))
    return found + list(SPELLED_APART.get(name, ()))


def _tables() -> tuple[dict, dict, dict, dict, dict]:
    """(modules, functions, methods, aten, op name by spelling): the tables map every op's
    spellings to its entry. A spelling two ops claim is an error."""
    modules: dict = {}
    functions: dict = {}
    methods: dict = {}
    aten: dict = {}
    owner: dict = {}
    unknown = SPELLED_APART.keys() - OPS.keys()
    if unknown:
        raise ValueError(f"op table: spellings written for ops it lacks: {sorted(unknown)}")
    for name, entry in OPS.items():
        for spelling in spellings(name):
            if isinstance(spelling, str):
                table = methods
            elif isinstance(spelling, type):
                table = modules
            elif isinstance(spelling, torch._ops.OpOverloadPacket):
                table = aten
            else:
                table = functions
            other = owner.setdefault(spelling, name)
            if other != name:
                raise ValueError(f"op table: {spelling!r} spells both {other!r} and {name!r}")
            table[spelling] = entry
    return modules, functions, methods, aten, owner


# The derived tables, one per kind of target: the lookup reads these.
MODULE_TABLE, FUNCTION_TABLE, METHOD_TABLE, ATEN_TABLE, OP_OF_SPELLING = _tables()


def _fn_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    if "<locals>" in name and getattr(target, "__name__", None):  # (F.max_pool1d is torch's
        name = target.__name__  # boolean_dispatch.<locals>.fn, named max_pool1d)
    if module.startswith("torch.nn.functional"):
        return f"F.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch"):
        return f"torch.{name}"
    return f"{module}.{name}" if module else name


@dataclass
class OpTable:
    """The lookup over the four derived tables. Users pass their own entries to extend or
    replace ours.

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
                # another library's op registered after this table was built (transformers'
                # MoE experts, grouped_mm_fallback, on its first import): by its name
                return name, OPS.get(name)
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


def table_op_name(node: torch.fx.Node) -> str:
    """The op table's name of what ``node`` calls ("" for none)."""
    target = node.target
    if node.op == "call_module" and node.graph.owning_module is not None:
        try:
            target = type(node.graph.owning_module.get_submodule(target))
        except AttributeError:
            return ""
    target = getattr(target, "overloadpacket", target)
    try:
        return OP_OF_SPELLING.get(target, "")
    except TypeError:  # (an unhashable target)
        return ""
