"""Namespaced node.meta keys and the frozen values stored under them.

Analysis passes write these; nothing here reuses torch's own keys (``val``, ``tensor_meta``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

import torch

TENSOR = "mpgraph.tensor"            # TensorInfo, a tuple of them (multi-output ops) or None
OP_CLASS = "mpgraph.op_class"        # OpInfo
# the memory format a tensor value had in the example run (PropagateTensorInfo): "contiguous",
# "channels_last", "channels_last_3d", "broadcast" (the last dimension expanded: stride 0), or
# "strided" (none of those: a slice, a transpose)
LAYOUT = "mpgraph.layout"
MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                  "channels_last_3d": torch.channels_last_3d}
PRECISION = "mpgraph.precision"      # Decision
INSERTED_BY = "mpgraph.inserted_by"  # name of the pass that created the node
WEIGHTS = "mpgraph.weights"          # on gm.meta: WeightRecord list written by StoreWeights
COST = "mpgraph.cost"                # NodeCost written by EstimateCost
CAST_COST = "mpgraph.cast_cost"      # (down, up) seconds to cast a float32 value to the low dtype and back: EstimateCost
COST_MODEL = "mpgraph.cost_model"    # on gm.meta: {"target", "source"} of the cost model EstimateCost asked
TC_FINDING = "mpgraph.tensor_core"  # TensorCoreFinding written by LintTensorCores
ESTIMATE = "mpgraph.estimate"        # on gm.meta: {"target", "fp32_s", "plan_s"} of the plan
CAPTURE = "mpgraph.capture"          # on gm.meta: which tracer produced the graph
STATIC_SHAPES = "mpgraph.static_shapes"  # on gm.meta: True when exported at the example's shapes
# on gm.meta: ((alias, the path the graph records), ...) of each submodule the model holds under
# a second name (self.shared = self.blocks[3]: ("shared", "blocks.3")), written at capture
MODULE_ALIASES = "mpgraph.module_aliases"
RANGE = "mpgraph.range"              # ValueRange written by Calibrate
SAFETY = "mpgraph.safety"            # tuple of SafetyFinding written by NumericSafety
# on gm.meta: Reference (the float32 graph's outputs on the first calibration batch), written by
# Calibrate for CheckConversion's value check, dropped when convert returns
REFERENCE = "mpgraph.reference"
# on gm.meta: names of the graph inputs that were constant (all zeros, one value) in every
# calibration batch, written by Calibrate: ranges from such data do not represent real inputs
CONSTANT_INPUTS = "mpgraph.constant_inputs"
# on gm.meta: what an inference conversion of a model in eval mode removed that training would
# need (PruneForInference: "3 dropout ops"); .train() on the converted module warns with it
EVAL_ONLY = "mpgraph.eval_only"
# on gm.meta: (module paths whose own forward reads self.training, the flag at capture), written
# by capture: a Python branch on it is fixed in the graph, and .train()/.eval() say so
READS_TRAINING = "mpgraph.reads_training"
# on gm.meta: (where a forward reads torch.is_grad_enabled() or is_inference_mode_enabled(), the
# grad mode at capture, the modes in which the model computes other values), written by capture:
# the converted module refuses calls in those modes (the graph keeps the captured branch)
GRAD_MODES = "mpgraph.grad_modes"
CAPTURED_TRAINING = "mpgraph.captured_training"  # gm.meta: the flag the graph was traced under
# on gm.meta: {module path: momentum} of the model's BatchNorms with running statistics, written
# by capture: a trace in eval holds 0.0 where the momentum is None (a cumulative average)
BATCH_NORM_MOMENTA = "mpgraph.batch_norm_momenta"
EVAL_OUTPUTS = "mpgraph.eval_outputs"  # gm.meta: an eval model's outputs, traced in training mode
EVAL_SWITCH = "mpgraph.eval_switch"  # gm.meta: a training model's eval outputs and buffers (reads self.training)
CHECK = "mpgraph.check"              # on gm.meta: {"error", "bound"} of CheckConversion's value check
# node.meta: tensor_stats of the example run (PropagateTensorInfo(observe=True)); gm.meta: that
# run (passes.calibrate.Observation). Calibrate takes the example batch from it, then drops it
OBSERVED = "mpgraph.observed"
# node.meta: True on the add MatVecLinear splits off a linear's product (``mv`` then the bias):
# its parameter is the layer's bias, a weight, not a value joined to activations
LINEAR_BIAS = "mpgraph.linear_bias"
# on gm.meta: FuseSiblingGemv's weights, [(fused tensor's path, ((member's path, first row,
# row after), ...))]: the members are row views of the fused tensor (``modules.FusedWeights``)
FUSED = "mpgraph.fused"
# node.meta: True on a bf16 linear PackCpuLinears marked: the converted module runs it through
# oneDNN over a weight packed once (``cpu_linear``)
PACKED = "mpgraph.packed"
# node.meta: the key its op's measured times are under (``cost.measured.measure``), kept by a
# deep copy of the graph whose rewritten nodes would key otherwise
COST_KEY = "mpgraph.cost_key"


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor value, recorded from a run on the example inputs."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @classmethod
    def of(cls, value) -> "TensorInfo":
        return cls(tuple(int(d) for d in value.shape), value.dtype)


ValueInfo = Union[TensorInfo, tuple, None]


@dataclass(frozen=True)
class OpInfo:
    """The op class of a node and why (one line from the op table)."""

    op_class: str
    reason: str
    key: str  # the table key that matched, e.g. "nn.Linear" or "aten.linear"
    params_as_values: bool = False  # see OpEntry.params_as_values
    low_io: tuple = ()              # see OpEntry.low_io: the target kinds that take the mix
    range_expanding: bool = False   # see OpEntry.range_expanding


@dataclass(frozen=True)
class Decision:
    """The dtype a node computes in, with the rule that decided it.

    ``dtype`` is None for nodes that touch no float32 tensor, and for parameters, whose stored
    dtype follows their readers.
    """

    dtype: Optional[torch.dtype]
    reason: str
    pinned: bool = False    # a hard rule decided it; refinements may not move it
    stored: bool = False    # a parameter, or computed from parameters only: materialised at
                            # conversion time in the dtype its readers need, never cast at run time
    reads_any: bool = False  # takes its inputs in whatever dtype they come (explicit casts)
    promotes: bool = False   # a float32 elementwise op that reads low inputs as they are:
                             # type promotion inside its kernel, exact, no cast kernel (training)
    param_dtype: Optional[torch.dtype] = None  # dtype its parameters are read in, if not ``dtype``


SHORT_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                     torch.float64: "f64"}  # cast node names, cast arrows in reports


def tensor_infos(info: ValueInfo) -> list[TensorInfo]:
    """The TensorInfos of a value: one, the tensor parts of a multi-output op, or none."""
    if isinstance(info, TensorInfo):
        return [info]
    if isinstance(info, tuple):
        return [i for i in info if isinstance(i, TensorInfo)]
    return []


def shape_of(info: ValueInfo) -> Optional[tuple[int, ...]]:
    """The shape of a value's (first) tensor, None when it has none."""
    infos = tensor_infos(info)
    return tuple(infos[0].shape) if infos else None


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """"bfloat16" for torch.bfloat16: how plans, reasons and reports name a dtype."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def cast_source(node):
    """The value a node stands for, looking through a cast InsertCasts put in front of it."""
    return node.args[0] if is_inserted_cast(node) else node


CAST_INSERTER = "InsertCasts"  # the pass whose casts plans list (INSERTED_BY of those nodes)


def is_inserted_cast(node) -> bool:
    """A precision cast the plan inserted (not the model's own ``.to()``)."""
    return node.meta.get(INSERTED_BY) == CAST_INSERTER


def is_float32_tensor(info: ValueInfo) -> bool:
    """True when the value is a float32 tensor, or a tuple holding one (these are what we may lower)."""
    if isinstance(info, TensorInfo):
        return info.dtype == torch.float32
    if isinstance(info, tuple):
        return any(is_float32_tensor(i) for i in info)
    return False


@dataclass(frozen=True)
class WeightRecord:
    """A parameter or buffer stored in low precision at conversion time."""

    name: str       # attribute path in the converted module
    source: str     # attribute path it was converted from
    dtype: torch.dtype
    numel: int
    shared: bool    # True when the float32 original is kept too (some readers stay float32)


def planned_dtype(info: ValueInfo, decision: Optional[Decision]):
    """The dtype(s) a value has in the converted graph: the decision for what was float32,
    the recorded dtype for everything else (a tuple of them for multi-output ops)."""
    if isinstance(info, tuple):
        return tuple(planned_dtype(i, decision) for i in info)
    if not isinstance(info, TensorInfo):
        return None
    if info.dtype == torch.float32 and decision is not None and decision.dtype is not None:
        return decision.dtype
    return info.dtype


@dataclass(frozen=True)
class ValueRange:
    """What calibration saw of one float value over all batches (tuple outputs: over all parts)."""

    absmax: float          # largest finite magnitude
    min_nonzero: float     # smallest non-zero magnitude (inf when the value was always zero)
    nonfinite: int         # inf/NaN elements seen in float32
    batch_absmax: tuple    # absmax per calibration batch, for evidence ("on 3/8 batches")

    def batches_over(self, limit: float) -> int:
        return sum(1 for m in self.batch_absmax if m > limit)


@dataclass(frozen=True)
class Reference:
    """What the float32 graph computed on one batch: the batch, and its flat float outputs."""

    args: tuple
    kwargs: dict
    outputs: tuple       # the graph's output values, flattened, detached


@dataclass(frozen=True)
class SafetyFinding:
    """A numeric-safety rule that keeps a node in float32, with its evidence."""

    rule: str        # "range", "underflow", "constant", "weight", "unproven_range"
    evidence: str    # e.g. "absmax 7.1e4 > limit 3.28e4 on 3/8 batches"
    cleared_by: Optional[str] = None  # a second low dtype in which the node has no finding


# the op classes (what ClassifyOps writes in OP_CLASS; passes/op_table.py maps each op to one)
TENSOR_CORE = "tensor_core"
FOLLOW = "follow"
FP32_COMPUTE = "fp32_compute"
FP32_ONLY = "fp32_only"
CAST = "cast"
UNKNOWN = "unknown"
OP_CLASSES = (TENSOR_CORE, FOLLOW, FP32_COMPUTE, FP32_ONLY, CAST, UNKNOWN)


class Kind(str, enum.Enum):
    """The kind of target a plan is made for: whose kernels run it (``DeviceSpec.kind``; ONNX
    for a file ONNX Runtime runs). A str enum, so ``Kind.CPU == "cpu"``."""

    CPU = "cpu"
    GPU = "gpu"
    ONNX = "onnx"

    def __str__(self) -> str:
        return self.value


# node.meta["custom"] key of a node the model computes inside its own
# torch.autocast(..., enabled=False) (capture's _AutocastOff): AssignPrecision keeps it float32
FP32_REGION = "mpgraph_fp32_region"


def fp32_region(node) -> Optional[str]:
    """The model's torch.autocast(enabled=False) region ``node`` was traced in, if any."""
    return (node.meta.get("custom") or {}).get(FP32_REGION)
