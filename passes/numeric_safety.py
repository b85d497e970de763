"""Numeric safety: the findings that keep a node in float32, each with its evidence.

Runs after ClassifyOps and Calibrate; the precision assignment treats every finding as a hard
constraint on a node that would otherwise compute in low precision. Rules:

- ``range``: a value whose calibrated absmax exceeds ``finfo(low).max / RANGE_MARGIN`` is produced
  and read in float32 (a low reader would overflow at its input cast). The margin of 2 is one
  binade of headroom: calibration sees a sample, and a value twice as large as any seen is the
  smallest excursion that still overflows an fp16 value already at half its range (one doubling,
  e.g. a residual add of two such values). bf16 shares float32's exponent, so this rule only
  fires there for values near float32's own limit.
- ``constant``: a float operand of an op that computes in the low dtype that overflows the low dtype (|c| > max, e.g. -1e9 masks,
  ``finfo(float32).min``) or underflows it to zero (0 < |c| < smallest subnormal: eps 1e-12 in fp16).
- ``weight``: a parameter or buffer read in low precision that overflows, or that underflows:
  a small tensor (<= 16 values, an eps or a scale) with any value flushed to zero, or a larger one
  with more than 1% of its non-zero values flushed.
- ``unproven_range``: range-expanding ops (exp, pow, ...) are float32-only in fp16 unless
  calibration proves them safe: their output stayed finite and under the limit on every batch,
  in which case ClassifyOps classes them ``follow`` (the class's reason is the evidence); the
  finding says why one that calibration did not prove stays float32.
- underflow (findings of rule ``range``, evidence "... underflows ..."): an op that cannot take a
  0 (``NO_ZERO``: log, log2, log10, rsqrt, reciprocal, a division's denominator; a power with a
  negative constant exponent) reading a value that is 0 in the low dtype, which turns the float32
  model's finite output into inf/NaN (a probability made in fp16, then logged). A value is 0 there
  when its calibrated smallest non-zero magnitude (``ValueRange.min_nonzero``) is below the limit
  ``smallest_subnormal(low) / 2 * margin``, or when it is made from such a value by ops that pass
  a 0 on (``PASSES_ZERO``: layout, mul, abs, sqrt, a numerator; ``REDUCTIONS`` only when their
  own output is below the limit): ``1 / sqrt(p)`` with p = 1e-9. The op, those small values and
  the ops between them keep float32, so no low node stores the 0 or makes it at its input cast; a
  division whose denominator underflows also keeps a numerator that does (p / q of two tiny
  probabilities: the quotient amplifies it). fp16 rounds magnitudes below half its smallest
  subnormal (2**-25, 3e-8) to 0; the margin of 2 is ``range``'s binade of headroom (a value half
  as small as any calibration saw), which puts the limit at the smallest subnormal, 6e-8 (bf16's
  is 9e-41: in practice the rule fires for fp16 only). The findings use the rule name ``range``:
  their contract is the same (the value is produced and read in float32, a low-I/O norm does not
  write it low), and the precision assignment acts on that name. Values that lose precision in
  fp16's subnormal range (6e-8 to 6e-5) without becoming 0 are the tolerance's to measure.

- ``periodic``: the argument of sin, cos or tan with a calibrated absmax above ``PERIODIC_LIMIT``
  (2 pi: more than one period). Rounding an argument x costs |x| times the dtype's rounding in
  absolute terms, so sin(20 x) of a value rounded to fp16 is off by ~1e-2 where its own output
  rounding is 5e-4 (Fourier features, rotary angles of long sequences, SIREN layers): the op, and
  the ops that compute its argument back to (and including) the first one that is not an
  elementwise ``follow`` op (the matmul that scales the input into frequencies), compute in
  float32. Not cleared by bf16, whose rounding is coarser.
- ``conditioning``: a matmul-class op reading a buffer or constant (not a parameter: a whitening
  matrix, Fourier frequencies kept as a buffer) is low only where calibration bounds how much it
  amplifies rounding: ``rho = absmax(x) * max column sum |W| / absmax(y)`` over sqrt(K) (about 1
  for random matrices, and the error grows with it: a whitening matrix of covariance condition
  1e3 measures 114 and errs by 2.5e-2 in fp16 against 3e-4) at most ``AMPLIFICATION_LIMIT``.
  Uncalibrated (a model on the meta device), such a reader stays float32. Parameters are weights
  the model was trained with in whatever precision; their readers are not held to this, and the
  value check measures them.
- ``written_buffer`` (fp16 only): an op that could compute low reading a float32 buffer the
  forward writes in place, or a value computed from one through any op up to one that bounds its
  output (``_BOUNDING``: ``h @ (embed_avg / cluster_size)``), except a cache written only by
  stores. Calibration restores the buffers between batches, so it sees their value at conversion
  only, never what the model's own updates make of them (a VQ-VAE's EMA codebook grows to 4e5 in
  one call: inf in fp16) nor what is computed from them. bf16 has float32's range: any float32
  value it is cast from fits, so it clears this.

Long reductions (sum, mean, var, norms, cumsum) are float32-only by op class in every low dtype,
so no rule is needed for them here; matmul and conv accumulate in float32 on every backend we
target (Tensor Cores, AVX512-BF16/AMX, ONNX Runtime), so large K is a precision cost the tolerance
search measures rather than an overflow rule.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.ir.graph import (CALLS, fetch_attr, input_nodes, is_inplace, is_view, mutated_nodes,
                              owner_of, stored_into_only, stored_through_views_only)
from mpgraph.ir.meta import (FUSED, OP_CLASS, RANGE, SAFETY, TENSOR, OpInfo, SafetyFinding, ValueRange,
                             dtype_name, is_float32_tensor)
from mpgraph.passes.op_table import CAST, FOLLOW, FP32_ONLY, TENSOR_CORE, table_op_name
from mpgraph.passes.infra import Pass, PassResult
from mpgraph.passes.calibrate import tensor_stats
from mpgraph.ir.fake import is_abstract
from mpgraph.ir.ops import MOVES, move_names

log = logging.getLogger(__name__)

RANGE_MARGIN = 2.0             # limit = finfo(low).max / margin (see the module docstring)
SMALL_TENSOR = 16              # up to this many values: any underflow counts
UNDERFLOW_FRACTION = 0.01      # larger tensors: this share of non-zero values flushed to zero
UNDERFLOW_RULE = "underflow"   # the rule name of underflow findings (see the module docstring)
# op -> the place of its angle among its arguments (torch.polar(abs, angle): a complex
# oscillator's phase)
PERIODIC = {"sin": 0, "sin_": 0, "cos": 0, "cos_": 0, "tan": 0, "tan_": 0, "polar": 1}
PERIODIC_LIMIT = 2 * math.pi   # an argument above one period: see ``periodic`` above
AMPLIFICATION_LIMIT = 8.0      # rho / sqrt(K) of a buffer's reader: see ``conditioning`` above

# Ops that cannot take a 0, by op name (the last part of the op-table key: "torch.log",
# "Tensor.log", "aten.log" -> "log"; "operator.truediv" -> "truediv"), each with the arguments,
# as (position, keyword), that must not be 0: log(0) = -inf, rsqrt(0) = 1/0 = inf, x/0 = inf/NaN.
# log1p, sqrt and the numerator of a division take a 0 as it comes.
_ARG0, _OTHER, _SELF = ((0, "input"),), ((1, "other"),), ((0, "self"),)
NO_ZERO: dict[str, tuple[tuple[int, str], ...]] = {
    **dict.fromkeys(("log", "log_", "log2", "log2_", "log10", "log10_"), _ARG0),
    **dict.fromkeys(("rsqrt", "rsqrt_", "reciprocal", "reciprocal_"), _ARG0),
    **dict.fromkeys(("div", "div_", "true_divide", "truediv", "itruediv", "__truediv__",
                     "__itruediv__"), _OTHER),
    "__rtruediv__": _SELF,  # x.__rtruediv__(c) is c / x
}
# x ** c with a constant c < 0 cannot take a 0 in x (0 ** -0.5 = inf); the exponent is argument 1
NEGATIVE_POWER = ("pow", "pow_", "__pow__", "__ipow__", "ipow", "float_power")
# Ops whose output is 0 where an input is (f(0) = 0 elementwise, or elements moved as they are),
# and which inputs (argument positions; None: every tensor input): a value rounded to 0 before
# them is still 0 after them, whatever their output's magnitude (sqrt of 1e-9 is 3e-5, and 0).
# Not clamp (its min keeps a 0 out), adds or matmuls (small by cancellation, not by an input).
_EVERY, _FIRST = None, (0,)
PASSES_ZERO: dict[str, Optional[tuple[int, ...]]] = {
    **dict.fromkeys(("mul", "mul_", "imul", "__mul__", "__rmul__", "cat", "concat", "stack"),
                    _EVERY),
    **dict.fromkeys(("neg", "__neg__", "abs", "relu", "relu_", "square", "sqrt", "pow", "pow_",
                     "__pow__", "div", "div_", "true_divide", "truediv", "itruediv",
                     "__truediv__", "__itruediv__"), _FIRST),  # a division: its numerator
    **dict.fromkeys(move_names(lambda move: move.passes_zero), _FIRST),  # moved as they are
}
# Reductions are 0 only where every value they reduce is: passed through only when their own
# output is below the limit (a sum of probabilities is >= their max, whatever rounds to 0).
REDUCTIONS = ("sum", "mean")


def smallest_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps  # 2**-24 for fp16, 2**-133 for bf16


def op_name(node: torch.fx.Node) -> str:
    """The op's name without its namespace, for every spelling of a call: "log" for torch.log,
    Tensor.log and aten.log.default; "truediv" for ``x / y``; "div" for torch.div and aten.div."""
    return node.meta[OP_CLASS].key.rpartition(".")[2]


# ops through which a value keeps elements of its inputs unchanged: a fill value a mask put in
# reaches the cast through them (T5: where(mask, position_bias, finfo.min), then + scores), and
# the reductions and poolings that select or sum elements (max pooling over a -1e9-filled
# padding: sentence-transformers' pooling of an all-padding item is the fill)
_BOUNDS = ("clamp", "clip", "clamp_min", "clamp_max", "hardtanh")
_CARRY = frozenset(MOVES) | {"add", "sub", "rsub", "neg", "where", "masked_fill", "to",
                             "_to_copy", "type_as", "cat", "stack", "full", "full_like",
                             "fill", "mul", "max", "min", "amax", "amin", "topk", "sort",
                             "msort", "median", "nanmedian", "kthvalue", "mode", "cummax",
                             "cummin", "maximum", "minimum", "fmax", "fmin", "max_pool1d",
                             "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
                             "max_pool3d_with_indices", "adaptive_max_pool1d",
                             "adaptive_max_pool2d", "adaptive_max_pool3d", "pad",
                             "constant_pad_nd", "index_fill", "new_full", "new_tensor",
                             "scalar_tensor", "sum", "nansum", "mean", "div", "truediv",
                             "true_divide", "cumsum", "logcumsumexp", "logsumexp", "quantile",
                             "nanquantile", "scatter_reduce", "scatter_add", "index_reduce",
                             "index_add", "interpolate", "upsample_nearest1d",
                             "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
                             "upsample_bilinear2d", "upsample_bicubic2d",
                             "upsample_trilinear3d", "_upsample_nearest_exact2d",
                             "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                             "adaptive_avg_pool2d", "adaptive_avg_pool3d", "nan_to_num",
                             *_BOUNDS}
_CARRY_DEPTH = 24  # nodes walked back from a cast

# The arguments, as (position, keyword), that are element values, by op (``_plain_name``: in-place
# spellings and Python's operators under the op's own name): an int there is a value, as a float
# is (masked_fill(m, -100000) is a fill beyond fp16's range, and an fp16 kernel refuses it on
# every call); ints elsewhere are sizes, dims and indices.
_BOTH = ((0, "input"), (1, "other"))
VALUE_ARGS: dict[str, tuple[tuple[int, str], ...]] = {
    "masked_fill": ((2, "value"),),
    "where": ((1, "input"), (2, "other")),
    **dict.fromkeys(("clamp", "clip"), ((1, "min"), (2, "max"))),
    "clamp_min": ((1, "min"),),
    "clamp_max": ((1, "max"),),
    **dict.fromkeys(("fill", "full_like", "new_full"), ((1, "fill_value"), (1, "value"))),
    "full": ((1, "fill_value"),),
    "index_fill": ((3, "value"),),
    "pad": ((3, "value"),),
    "constant_pad_nd": ((2, "value"),),
    "scalar_tensor": ((0, "s"),),
    "hardtanh": ((1, "min_val"), (2, "max_val")),
    "threshold": ((2, "value"),),
    "nan_to_num": ((1, "nan"), (2, "posinf"), (3, "neginf")),
    **dict.fromkeys(("add", "sub", "rsub", "mul", "maximum", "minimum", "fmax", "fmin"), _BOTH),
}


# modules that hold their element values as attributes (an fx call_module passes only tensors)
_MODULE_VALUES = ("min_val", "max_val", "value", "threshold")


def value_constants(node: torch.fx.Node) -> list[float]:
    """The finite numbers ``node`` takes as element values: every float constant, the ints in
    ``VALUE_ARGS``' slots, and a value module's own (nn.Hardtanh's min_val and max_val,
    nn.Threshold's, a constant pad's)."""
    found = [a for a in pytree.tree_leaves((node.args, node.kwargs))
             if isinstance(a, float) and math.isfinite(a)]
    owner = node.graph.owning_module
    if node.op == "call_module" and owner is not None:
        module = owner.get_submodule(node.target)
        if isinstance(module, (torch.nn.Hardtanh, torch.nn.Threshold,
                               torch.nn.modules.padding._ConstantPadNd)):
            found += [float(v) for v in (getattr(module, a, None) for a in _MODULE_VALUES)
                      if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v)]
    for position, keyword in VALUE_ARGS.get(_plain_name(node), ()):
        a = _arg(node, position, keyword)
        if isinstance(a, int) and not isinstance(a, bool):
            found.append(float(a))
    return found


def sentinel_source(value: torch.fx.Node, dtype: torch.dtype) -> Optional[torch.fx.Node]:
    """The node that may put a finite constant beyond ``dtype``'s range into ``value`` (a mask's
    ``finfo(float32).min``, a -1e9 fill for fp16) on its way through ops that carry elements
    unchanged, or None: calibration sees such a fill only where the example's mask has a
    masked position, and a plain cast makes it -inf (a fully masked row then computed 0 in
    place of float32's uniform attention: T5, relative L2 0.46)."""
    top = torch.finfo(dtype).max
    seen, todo = set(), [value]
    while todo and len(seen) < _CARRY_DEPTH:
        node = todo.pop()
        if node in seen or node.op not in ("call_function", "call_method", "call_module",
                                           "get_attr"):
            continue
        seen.add(node)
        if node.op == "get_attr":  # a scalar tensor constant: torch.export lifts the -1e9 of
            if _scalar_beyond(node, top):  # ``tok[mask == 0] = -1e9`` into one
                return node
            continue
        name = _plain_name(node) if OP_CLASS in node.meta else None
        if name not in _CARRY:
            continue
        constants = value_constants(node)
        if name in _BOUNDS:  # (a bound puts in no value; both inside the range stop
            if len(constants) == 2 and all(abs(c) <= top for c in constants):  # a fill)
                continue
        elif any(abs(c) > top for c in constants):
            return node
        todo.extend(input_nodes(node))
    return None


def _plain_name(node: torch.fx.Node) -> str:
    """The op's name for ``_CARRY`` and ``VALUE_ARGS``: the op table's (an nn.MaxPool1d module
    is max_pool1d, ``x / y`` div, ``100000 + h`` add), else its own without an in-place
    underscore (torch.export's detach_, ``h.masked_fill_``)."""
    name = table_op_name(node) or op_name(node)
    return name[:-1] if name.endswith("_") and not name.startswith("__") else name


def _scalar_beyond(node: torch.fx.Node, top: float) -> bool:
    """Whether a get_attr is a one-element float tensor holding a finite value beyond ``top``."""
    owner = node.graph.owning_module
    try:
        t = fetch_attr(owner, node.target) if owner is not None else None
    except AttributeError:
        return False
    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == 1
            and not is_abstract(t)):
        return False
    value = float(t.detach())  # (a parameter: float() of one with requires_grad warns)
    return math.isfinite(value) and abs(value) > top


def carries_sentinel(value: torch.fx.Node, dtype: torch.dtype) -> bool:
    """Whether ``sentinel_source`` finds a fill beyond ``dtype``'s range on ``value``'s way."""
    return sentinel_source(value, dtype) is not None


def _arg(node: torch.fx.Node, position: int, keyword: str):
    return node.args[position] if len(node.args) > position else node.kwargs.get(keyword)


def zero_intolerant_inputs(node: torch.fx.Node) -> list[tuple[torch.fx.Node, str]]:
    """(input, how ``node`` reads it: "before log_1", "as the denominator of truediv") for each
    input of ``node`` that must not be 0 (``NO_ZERO``, ``NEGATIVE_POWER``)."""
    name = op_name(node)
    slots = NO_ZERO.get(name, ())
    role = f"as the denominator of {node.name}" if slots in (_OTHER, _SELF) \
        else f"before {node.name}"
    if name in NEGATIVE_POWER:
        exponent = _arg(node, 1, "exponent")
        if isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent < 0:
            slots, role = _ARG0, f"before {node.name} (power {exponent:g})"
    found = [(_arg(node, position, keyword), role) for position, keyword in slots]
    return [(a, role) for a, role in found if isinstance(a, torch.fx.Node)]


def _listed(items: list[str], most: int = 3) -> str:
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _tensor_findings(name: str, t: torch.Tensor, low: torch.dtype,
                     stats: tuple[float, float, int]) -> list[SafetyFinding]:
    """Findings for one weight, from its ``tensor_stats``; the values are read again only when
    some of them underflow (to count them)."""
    absmax, smallest, nonfinite = stats
    top, tiny = torch.finfo(low).max, smallest_subnormal(low)
    if absmax > top:
        return [SafetyFinding("weight", f"{name} absmax {absmax:.3g} overflows "
                                        f"{dtype_name(low)} (max {top:.5g})")]
    if smallest >= tiny / 2:
        return []
    zeros = flushed = 0
    for chunk in t.detach().reshape(-1).split(1 << 22):  # 16 MB temporaries, however big t is
        a = chunk.abs().float()
        # counted, not gathered with a boolean mask (0.9 -> 0.6-0.7 s for 134M values)
        flushed += int(torch.count_nonzero(a < tiny / 2))  # zeros and what rounds to zero
        zeros += int(torch.count_nonzero(a == 0))
    flushed -= zeros  # the values that round to zero in the low dtype
    nonzero = t.numel() - zeros - nonfinite
    if flushed and (t.numel() <= SMALL_TENSOR or flushed > UNDERFLOW_FRACTION * nonzero):
        return [SafetyFinding("weight", f"{name}: {flushed} of {nonzero} non-zero values "
                                        f"(smallest {smallest:.3g}) underflow "
                                        f"{dtype_name(low)} to zero")]
    return []


def _is_parameter(gm: torch.nn.Module, target: str) -> bool:
    """A parameter, or a stack of them (FuseSiblingGemv's: the layers' weights, not a constant)."""
    owner, leaf = owner_of(gm, target)
    return leaf in owner._parameters or any(
        t == target for t, _ in getattr(gm, "meta", {}).get(FUSED, ()))


# matmul-class ops whose stored operand's contraction dimension mpgraph knows: op name ->
# {argument position of the operand: its contraction dimension}
_CONTRACTION = {"linear": {1: -1}, "matmul": {0: -1, 1: -2}, "mm": {0: -1, 1: -2},
                "bmm": {0: -1, 1: -2}, "__matmul__": {0: -1, 1: -2},
                "__rmatmul__": {0: -2, 1: -1}}


def amplification(node: torch.fx.Node, gm) -> list[tuple[str, Optional[float]]]:
    """(buffer, rho / sqrt(K)) for each buffer or constant a matmul-class node reads as an operand
    (``conditioning`` above); None where calibration or the op's form does not bound it."""
    out = []
    dims = _CONTRACTION.get(op_name(node), {})
    for position, arg in enumerate(node.args):
        if not isinstance(arg, torch.fx.Node) or arg.op != "get_attr" \
                or _is_parameter(gm, arg.target):
            continue
        w = fetch_attr(gm, arg.target)
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 2:
            continue
        other = [a for a in input_nodes(node) if a is not arg and a.op != "get_attr"]
        seen = [a.meta.get(RANGE) for a in other] + [node.meta.get(RANGE)]
        dim = dims.get(position)
        if dim is None or is_abstract(w) or len(other) != 1 or None in seen or not seen[-1].absmax:
            out.append((str(arg.target), None))
            continue
        k = w.shape[dim]
        column = float(w.detach().abs().float().sum(dim).max())
        out.append((str(arg.target), seen[0].absmax * column / seen[-1].absmax / math.sqrt(k)))
    return out


# exp-like ops: a model input twice as large doubles their argument, and squares their output
# (exp(2a) = exp(a)**2); the margin of 2 on their output was +0.69 on their input (8% of a
# calibrated 8.6: held-out batches of the same distribution overflowed)
_EXP_LIKE = ("exp", "exp_", "expm1", "expm1_", "exp2", "exp2_", "sinh", "sinh_", "cosh", "cosh_")


def expanding_limit(node: torch.fx.Node, low: torch.dtype, margin: float,
                    name: Optional[str] = None) -> tuple[float, str]:
    """(the largest output a range-expanding op may have been calibrated at, how it is made):
    ``margin`` of headroom on its input."""
    name = name or op_name(node)
    top = torch.finfo(low).max
    exponent = _arg(node, 1, "exponent")
    base = _arg(node, 0, "self")
    if name in ("sinh", "sinh_", "cosh", "cosh_"):  # (cosh(2a) ~ 2 cosh(a)**2)
        return (top / 2) ** (1 / margin), f"(max / 2) ** (1/{margin:g}): its input x {margin:g}"
    if name in _EXP_LIKE or name in ("pow", "pow_", "__pow__", "__rpow__", "float_power") \
            and isinstance(base, (int, float)) and not isinstance(base, bool):
        # (exp(margin a) <= max; 2 ** h, a constant base, is exp-like too)
        return top ** (1 / margin), f"max ** (1/{margin:g}): its input x {margin:g}"
    if name in ("pow", "pow_", "__pow__", "float_power") and isinstance(exponent, (int, float)) \
            and not isinstance(exponent, bool) and exponent > 1:  # (margin x)**p = margin**p x**p
        return top / margin ** exponent, f"max / {margin:g}**{exponent:g}: its input x {margin:g}"
    return top / margin, f"max / {margin:g}"


def proven_in_range(node: torch.fx.Node, low: torch.dtype, margin: float = RANGE_MARGIN,
                    name: Optional[str] = None) -> Optional[str]:
    """Calibration's proof that a node's values stay in ``low``'s range with ``margin`` of
    headroom on its input (what lets ClassifyOps give a range-expanding op ``follow`` in fp16),
    or None. ``name``: the op's name (``op_name``), where OP_CLASS is not yet set."""
    r = node.meta.get(RANGE)
    limit, how = expanding_limit(node, low, margin, name)
    if r is not None and r.nonfinite == 0 and r.absmax <= limit:
        return f"calibration: absmax {r.absmax:.3g} <= limit {limit:.3g} ({how}) on all " \
               f"{len(r.batch_absmax)} batches"
    return None


class NumericSafety(Pass):
    """Analysis: writes ``mpgraph.safety`` (a tuple of SafetyFinding) on nodes that must stay
    float32 in the low dtype, each with its evidence; with ``range_dtype`` (bf16 beside fp16,
    dtype="auto") a finding the second dtype does not have is marked ``cleared_by`` it."""
    stage = "decide"
    reads, writes, also_reads = (OP_CLASS,), (SAFETY,), (RANGE,)

    def __init__(self, low_dtype: torch.dtype, margin: float = RANGE_MARGIN,
                 range_dtype: Optional[torch.dtype] = None):
        if margin < 1:
            raise ValueError(f"margin must be >= 1, got {margin}")
        if range_dtype not in (None, torch.bfloat16):
            raise ValueError(f"the second low dtype can only be bfloat16, got {range_dtype}")
        self.low, self.range_dtype, self.margin = low_dtype, range_dtype, margin

    def call(self, gm):
        seen: dict = {}  # dtype-independent weight statistics: scanned once for both dtypes
        rules = _Rules(self.low, self.margin, seen)
        alt = _Rules(self.range_dtype, self.margin, seen) if self.range_dtype is not None else None
        findings: dict[torch.fx.Node, list[SafetyFinding]] = {}
        for node in gm.graph.nodes:
            node.meta.pop(SAFETY, None)
        for node in gm.graph.nodes:
            if node.op in CALLS and node.meta[OP_CLASS].op_class != CAST:
                findings[node] = rules.node_findings(node, gm)
        for node, found in rules.underflow_findings(gm).items():
            findings.setdefault(node, []).extend(found)
        if rules.narrow:  # (bf16 has float32's range: a cast of any float32 value fits)
            for node, (names, via) in written_buffer_readers(gm).items():
                what = _listed(names) if via is None else f"{via}, computed from {_listed(names)}"
                findings.setdefault(node, []).append(SafetyFinding("written_buffer", (
                    f"reads {what}, which the forward writes in place: calibration saw only "
                    f"its value at conversion, so the values the model's updates make of it "
                    f"are not proven to fit {dtype_name(self.low)}")))
        periodic = periodic_findings(gm)  # the same in every dtype: never cleared
        alt_underflow = alt.underflow_findings(gm) if alt is not None else {}
        for node, found in list(findings.items()):
            if not found:
                del findings[node]
            elif alt is not None and not alt_underflow.get(node) and node not in periodic \
                    and not alt.node_findings(node, gm):
                findings[node] = [replace(f, cleared_by=dtype_name(alt.low)) for f in found]
        for node, found in (*periodic.items(), *written_weight_findings(gm).items()):
            findings.setdefault(node, []).extend(found)
        for node, found in findings.items():
            node.meta[SAFETY] = tuple(found)
            log.debug("%s: %s", node.name, "; ".join(f.evidence for f in found))
        return PassResult(gm, False)


class _Rules:
    """The findings that depend on the low dtype (its range and its smallest subnormal), for
    one dtype; NumericSafety asks one for the low dtype and one for the second."""

    def __init__(self, low: torch.dtype, margin: float, seen: dict):
        self.low = low
        self._seen = seen  # weight statistics of the current run, by tensor
        self.limit = torch.finfo(low).max / margin
        self.top = torch.finfo(low).max
        # a range narrower than float32's (fp16): a fill beyond it, clamped at its cast (the
        # casts' saturation), no longer swamps what is added to it (-65504 + a score of 20
        # keeps the score, where finfo(float32).min + 20 does not; bf16's min does too)
        self.narrow = torch.finfo(low).max < 1e38
        self.tiny = smallest_subnormal(low)
        self.margin = margin
        # magnitudes below tiny / 2 round to 0; the margin is the headroom, as for ``range``
        self.floor = self.tiny / 2 * margin

    def _range_evidence(self, node) -> Optional[str]:
        r = node.meta.get(RANGE)
        source = sentinel_source(node, self.low) if self.narrow else None
        if source is not None:
            return (f"{node.name} may hold {source.name}'s constant, beyond "
                    f"{dtype_name(self.low)}'s range (as a mask's fill: calibration sees one "
                    "only where its batches masked something)")
        if r is None or r.absmax <= self.limit:
            return None
        return (f"{node.name} absmax {r.absmax:.3g} > limit {self.limit:.3g} "
                f"({dtype_name(self.low)} max / {self.top / self.limit:g}) on "
                f"{r.batches_over(self.limit)}/{len(r.batch_absmax)} batches")

    def _constant_findings(self, node) -> list[SafetyFinding]:
        out = []
        for a in value_constants(node):
            # floats, and ints only where they are values: other int arguments are indices and
            # sizes (slice ends of 2**63 - 1)
            if abs(a) > self.top:
                out.append(SafetyFinding("constant", f"constant {a:g} overflows {dtype_name(self.low)} "
                                                     f"(max {self.top:.5g})"))
            elif 0 < abs(a) < self.tiny / 2:
                out.append(SafetyFinding("constant", f"constant {a:g} underflows {dtype_name(self.low)} "
                                                     f"to 0 (smallest {self.tiny:.3g})"))
        return out

    def _weight_findings(self, node, gm) -> list[SafetyFinding]:
        weights = []
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            weights += [(f"{node.target}.{name}", t)
                        for name, t in list(mod.named_parameters()) + list(mod.named_buffers())]
        weights += [(str(a.target), fetch_attr(gm, a.target), a.meta.get(RANGE))
                    for a in input_nodes(node) if a.op == "get_attr"]
        out = []
        for name, t, *seen in weights:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() \
                    and not is_abstract(t):
                out += _tensor_findings(name, t, self.low, self._stats(t, seen[0] if seen else None))
        return out

    def _stats(self, t: torch.Tensor, seen: Optional[ValueRange]) -> tuple[float, float, int]:
        """tensor_stats of a weight: what Calibrate recorded for its get_attr node, else scanned
        once per run of this pass (and shared with the bf16 check)."""
        if seen is not None:
            return seen.absmax, seen.min_nonzero, seen.nonfinite
        key = (id(t), t._version)
        if key not in self._seen:
            self._seen[key] = tensor_stats(t)
        return self._seen[key]

    def _unproven(self, node) -> SafetyFinding:
        """A range-expanding op ClassifyOps left fp32_only in fp16: calibration did not prove it."""
        if proven_in_range(node, self.low, self.margin):  # it did: ClassifyOps ran before it
            raise ValueError(f"{node.name} is calibrated inside {dtype_name(self.low)}'s range "
                             "but classed fp32_only: ClassifyOps ran before Calibrate (run "
                             "Calibrate first: the class of a range-expanding op rests on it)")
        r = node.meta.get(RANGE)
        limit, how = expanding_limit(node, self.low, self.margin)
        seen = "not calibrated" if r is None else (
            f"absmax {r.absmax:.3g} > limit {limit:.3g} ({how}) on "
            f"{r.batches_over(limit)}/{len(r.batch_absmax)} batches" if r.absmax > limit
            else f"{r.nonfinite} inf/NaN values in float32")
        return SafetyFinding("unproven_range", f"range-expanding op not proven safe: {seen}")

    def node_findings(self, node, gm) -> list[SafetyFinding]:
        info: OpInfo = node.meta[OP_CLASS]
        found = []
        if info.op_class == FP32_ONLY and info.range_expanding and self.low == torch.float16:
            found.append(self._unproven(node))
        if info.op_class in (TENSOR_CORE, FOLLOW):  # the others compute in float32 inside
            found += self._constant_findings(node)
        if info.op_class == TENSOR_CORE:
            for name, rho in amplification(node, gm):
                if rho is None:
                    found.append(SafetyFinding("conditioning", f"reads buffer {name}: calibration "
                                                               "does not bound its rounding error"))
                elif rho > AMPLIFICATION_LIMIT:
                    found.append(SafetyFinding("conditioning", (
                        f"reads buffer {name}, amplifying rounding {rho:.3g}x (rho/sqrt(K) > "
                        f"{AMPLIFICATION_LIMIT:g}: cancellation, as a whitening matrix's)")))
        found += self._weight_findings(node, gm)
        own = self._range_evidence(node)
        if own:
            found.append(SafetyFinding("range", f"output {own}"))
        for a in input_nodes(node):
            ev = self._range_evidence(a) if a.op != "get_attr" else None
            if ev:
                found.append(SafetyFinding("range", f"input {ev}"))
        return found

    def _underflow_evidence(self, value: torch.fx.Node) -> Optional[str]:
        r = value.meta.get(RANGE)
        if r is None or r.min_nonzero >= self.floor:
            return None
        return (f"{value.name} min non-zero {r.min_nonzero:.3g} underflows {dtype_name(self.low)} "
                f"(< limit {self.floor:.3g}: smallest subnormal {self.tiny:.3g} / 2 x "
                f"{self.margin:g})")

    def _passed_on(self, node: torch.fx.Node, small: bool) -> list[torch.fx.Node]:
        """The inputs whose 0 ``node`` passes on (``PASSES_ZERO``; a reduction's when its own
        output is below the limit, ``small``)."""
        name = op_name(node)
        if name in REDUCTIONS and small:
            return input_nodes(node)
        if name not in PASSES_ZERO:
            return []
        positions = PASSES_ZERO[name]
        if positions is None:
            return input_nodes(node)
        return [node.args[i] for i in positions
                if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)]

    def underflow_findings(self, gm) -> dict[torch.fx.Node, list[SafetyFinding]]:
        """Ops that cannot take a 0 reading a value that is 0 in the low dtype: one below the
        limit, or one made from such a value by ops that pass a 0 on. The op, those values and
        the ops between them keep float32 (a low op would store the 0 or make it at its input
        cast). A division whose denominator is 0 in the low dtype also keeps a numerator that is:
        the quotient amplifies it (p / q of two tiny probabilities), and a numerator of 0 is a
        quotient of 0."""
        # per value, in graph order: the nearest value below the limit whose 0 reaches it
        source: dict[torch.fx.Node, Optional[torch.fx.Node]] = {}
        paths: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in gm.graph.nodes:
            small = self._underflow_evidence(node) is not None
            if node.op in CALLS and node.meta[OP_CLASS].op_class == CAST:
                source[node] = None  # the model's own cast: what it asks for
                continue
            paths[node] = [a for a in self._passed_on(node, small) if source.get(a)] \
                if node.op in CALLS else []
            source[node] = node if small else (source[paths[node][0]] if paths[node] else None)

        out: dict[torch.fx.Node, dict[str, dict[str, None]]] = {}  # node -> why -> roles

        def keep(value: torch.fx.Node, role: str) -> None:
            stack, seen = [value], set()
            while stack:
                v = stack.pop()
                if v in seen or v.op not in CALLS:
                    continue
                seen.add(v)
                src = source[v]
                ev = self._underflow_evidence(src)
                why = f"output {ev}" if src is v else \
                    f"output {v.name} is 0 where {src.name} is; {ev}"
                out.setdefault(v, {}).setdefault(why, {})[role] = None
                stack += paths[v]

        for node in gm.graph.nodes:
            if node.op not in CALLS:
                continue
            for value, role in zero_intolerant_inputs(node):
                src = source.get(value)
                if src is None:
                    continue
                ev = self._underflow_evidence(src)
                why = f"input {ev}" if src is value else \
                    f"input {value.name} is 0 where {src.name} is; {ev}"
                out.setdefault(node, {}).setdefault(why, {})[role] = None
                keep(value, role)
                for numerator in self._passed_on(node, False):
                    if numerator is not value and source.get(numerator):
                        keep(numerator, f"as the numerator of {node.name}, whose denominator "
                                        f"underflows too")
        return {n: [SafetyFinding(UNDERFLOW_RULE, f"{why}: 0 {_listed(list(roles))}")
                    for why, roles in found.items()] for n, found in out.items()}


def periodic_findings(gm) -> dict[torch.fx.Node, list[SafetyFinding]]:
    """sin/cos/tan of arguments beyond one period, and the ops that compute the argument
    (``periodic`` above)."""
    out: dict[torch.fx.Node, list[SafetyFinding]] = {}
    for node in gm.graph.nodes:
        at = PERIODIC.get(op_name(node)) if node.op in CALLS else None
        angle = node.args[at] if at is not None and len(node.args) > at else None
        if not isinstance(angle, torch.fx.Node):
            continue
        r = angle.meta.get(RANGE)
        if r is not None and r.absmax <= PERIODIC_LIMIT:
            continue
        seen = "not calibrated" if r is None else f"absmax {r.absmax:.3g}"
        why = (f"{op_name(node)} of {angle.name} ({seen} > {PERIODIC_LIMIT:.3g}, one "
               f"period): rounding the argument costs |x| times the dtype's rounding")
        out.setdefault(node, []).append(SafetyFinding("periodic", why))
        stack, done = [angle], set()
        while stack:  # the argument's producers, through elementwise follow ops
            v = stack.pop()
            if v in done or v.op not in CALLS:
                continue
            done.add(v)
            out.setdefault(v, []).append(SafetyFinding("periodic", f"computes the argument "
                                                                   f"of {node.name}: {why}"))
            if v.meta[OP_CLASS].op_class == FOLLOW:
                stack += [a for a in input_nodes(v) if a.op != "get_attr"]
    return out


def written_weight_findings(gm) -> dict[torch.fx.Node, list[SafetyFinding]]:
    """Modules whose own weights the forward writes in place (WGAN's clipping,
    ``self.fc.weight.clamp_(...)`` before ``self.fc(x)``): a low-precision copy of such a
    module, made before the call, would compute with the weights from before the write (the
    first call after new weights: off by 3x), so it computes in float32 (a weight read by a
    function is instead cast where read, after the write: StoreWeights)."""
    written = {str(n.target) for n in mutated_nodes(gm.graph, gm) if n.op == "get_attr"}
    out: dict[torch.fx.Node, list[SafetyFinding]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not written:
            continue
        module = gm.get_submodule(node.target)
        names = [f"{node.target}.{name}" for name, _ in (*module.named_parameters(),
                                                          *module.named_buffers())]
        hit = [name for name in names if name in written]
        if hit:
            out[node] = [SafetyFinding("written_weight", (
                f"the forward writes {_listed(hit)} in place: computed in float32 with the "
                "values written (a low copy made before the call would not see them)"))]
    return out


# ops whose output is bounded whatever their input holds (softmax sums to 1, a norm divides by
# its own statistics, a clamp with two constant bounds): a value computed from a written buffer
# through them is in range again
_BOUNDING = frozenset({"softmax", "_softmax", "_safe_softmax", "softmin", "sigmoid", "tanh",
                       "hardsigmoid", "hardtanh", "softsign", "sin", "cos", "layer_norm",
                       "native_layer_norm", "group_norm", "native_group_norm", "rms_norm"})


def _bounds_output(node: torch.fx.Node) -> bool:
    if node.op not in CALLS or OP_CLASS not in node.meta:
        return False
    name = op_name(node)
    if name in ("clamp", "clip", "clamp_", "clip_"):
        bounds = (_arg(node, 1, "min"), _arg(node, 2, "max"))
        return all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
    return name in _BOUNDING


def _declares_writing(node: torch.fx.Node, buffers: set, gm) -> bool:
    """A module that declares it writes one of ``buffers`` (a batch norm's running statistics)."""
    if node.op != "call_module":
        return False
    written = getattr(gm.get_submodule(node.target), "mutates_args", ())
    return any(i < len(node.args) and node.args[i] in buffers for i in written)


def written_buffer_readers(gm) -> dict[torch.fx.Node, tuple[list[str], Optional[str]]]:
    """Nodes that could compute low reading a float32 buffer the forward writes in place, or a
    value computed from one (``h @ (self.embed_avg / self.cluster_size)``: through any op up to
    one that bounds its output, ``_BOUNDING``), with the buffers' names and the value read when
    it is not the buffer: calibration restores the buffers between batches, so it only sees
    their values at conversion, not those the model's own updates make of them (a VQ-VAE's EMA
    codebook: 4e5 after one call, inf in fp16), nor what is computed from them. A buffer written
    only by stores (a KV cache) holds computed values calibration does see: it is stored low,
    its readers are not listed."""
    carried: dict[torch.fx.Node, dict[str, None]] = {}  # value -> the written buffers it is from
    for buffer in mutated_nodes(gm.graph, gm):
        if buffer.op == "get_attr" and is_float32_tensor(buffer.meta.get(TENSOR)) \
                and not stored_into_only(buffer, gm) \
                and not stored_through_views_only(buffer, gm):  # (a cache written by slices)
            carried[buffer] = {str(buffer.target): None}
    aliases = set(carried)  # the buffers and their views: an in-place op on one is its writer
    out: dict[torch.fx.Node, tuple[list[str], Optional[str]]] = {}
    for node in gm.graph.nodes:  # (in order: a value comes after those it is computed from)
        read = [a for a in input_nodes(node) if a in carried]
        if not read or node in aliases:
            continue
        first = node.args[0] if node.args else None
        if first in aliases and is_inplace(node, gm) or _declares_writing(node, aliases, gm):
            continue  # (its writer, in float32 as the buffer; a training batch norm's output
            # is normalised by the batch's statistics, not the running ones it writes)
        if is_view(node) and first in aliases:
            aliases.add(node)
        names = list(dict.fromkeys(name for a in read for name in carried[a]))
        if node.op in CALLS and OP_CLASS in node.meta \
                and node.meta[OP_CLASS].op_class in (TENSOR_CORE, FOLLOW):
            direct = any(a in aliases for a in read)
            out[node] = (names, None if direct else read[0].name)
        info = node.meta.get(TENSOR)
        if not _bounds_output(node) and (info is None or is_float32_tensor(info)):
            carried[node] = dict.fromkeys(names)
    return out
