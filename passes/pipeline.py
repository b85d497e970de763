"""The default pipeline: a plain list of pass instances, readable top to bottom."""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch

from mpgraph.cost.model import CostModel
from mpgraph.cost.specs import DeviceSpec
from mpgraph.passes.op_table import OpTable
from mpgraph.passes.infra import Pass
from mpgraph.passes import (AssignPrecision, AssignPrecisionOptimal, Calibrate, ChannelsLast,
                            ContiguousAttentionMask, ContiguousLinearInputs,
                            FoldDtypeReads, FollowTrainingFlag, Functionalize, PruneForInference,
                            CheckConversion, ClassifyOps, EstimateCost, FuseTanhGelu, InsertCasts,
                            FuseSiblingGemv, LintTensorCores, MatVecLinear, NumericSafety, PackCpuLinears, RetargetDtypeAsserts, StoreWeights)
from mpgraph.ir.graph import Call
from mpgraph.ir.meta import Kind


STRATEGIES = ("optimal", "rules")


def prepare_pipeline(example_args: tuple, example_kwargs: dict,
                     calibration: Optional[Iterable] = None,
                     progress: Optional[bool] = None, train: bool = False,
                     kind: Kind = Kind.GPU, overrides: Optional[dict] = None,
                     fuse: bool = True, one_row_mv: Union[bool, Callable] = True,
                     simulate: bool = False, contiguous: bool = True,
                     mask_copy: bool = True) -> list[Pass]:
    """Passes that run once on the captured graph, whatever is decided later: rewrites that
    do not depend on the dtype (``kind``: the target's kernels), and calibration (the example
    inputs when no batches are given). ``overrides``: the layers they name keep their own GEMV;
    ``fuse``: False for a saved plan made without FuseSiblingGemv (its nodes are the plan's);
    ``one_row_mv``: MatVecLinear's, True, False (a saved plan without its nodes) or the measured
    question whether it pays here (``MatVecLinear.pays``); ``simulate``: the plan is checked
    as its target computes (``Calibrate.simulate``); ``contiguous``: False for a saved plan
    made without ContiguousLinearInputs' copies (its nodes are the plan's); ``mask_copy``:
    likewise for ContiguousAttentionMask's."""
    batches = calibration if calibration is not None else [Call(example_args, example_kwargs)]
    return [
        FoldDtypeReads(),                     # rewrite: x.to(w.dtype) reads the model's dtype
        Functionalize(),                      # rewrite: in-place ops on intermediates out of place
        FuseTanhGelu(),                       # rewrite: GPT-2's GELU as one op
        FollowTrainingFlag(),                 # rewrite: export's baked-in dropout/BN modes
        *([] if train else [PruneForInference()]),  # rewrite: eval dropout, asserts, guards
        *([ContiguousLinearInputs()] if kind == Kind.CPU and not train and contiguous
          else []),                           # rewrite: a linear's strided input copied once
        *([ContiguousAttentionMask()] if kind == Kind.GPU and mask_copy
          else []),                           # rewrite: a broadcast attention mask copied once
        *([MatVecLinear(None if one_row_mv is True else one_row_mv)]
          if kind == Kind.CPU and not train and one_row_mv is not False else []),  # 1-row linears
        *([FuseSiblingGemv(overrides or {})] if kind == Kind.CPU and not train and fuse
          else []),                           # rewrite: q/k/v's GEMVs as one
        Calibrate(batches, progress, example=(example_args, example_kwargs),
                  simulate=simulate),             # analysis: ranges
    ]


def decide_pipeline(low_dtype: torch.dtype, *, costs: CostModel, spec: DeviceSpec,
                    strategy: str = "optimal", keep_io_types: bool = True,
                    op_table: Optional[OpTable] = None, overrides: Optional[dict] = None,
                    keep_fp32: Optional[str] = None, range_dtype: Optional[torch.dtype] = None,
                    from_plan: Optional[dict] = None, train: bool = False,
                    pins: Optional[dict] = None) -> list[Pass]:
    """The analysis and decision passes: op classes, safety findings, costs, a dtype per node.
    They write node meta only, so a caller can run them once per candidate dtype. ``pins``: the
    tolerance search's (node name -> attributed error), float32 over any override."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "optimal":
        decide: Pass = AssignPrecisionOptimal(low_dtype, costs.kind, keep_io_types, overrides, keep_fp32,
                                              range_dtype=range_dtype, from_plan=from_plan,
                                              train=train, pins=pins)
    else:
        decide = AssignPrecision(low_dtype, keep_io_types, overrides, keep_fp32, range_dtype,
                                 from_plan, train, kernels=costs.kind, pins=pins)
    return [
        ClassifyOps(low_dtype, op_table),     # analysis: op class per node
        NumericSafety(low_dtype, range_dtype=range_dtype),  # analysis: fp32 findings, evidence
        EstimateCost(costs, low_dtype),       # analysis: time per node, both dtypes (cost model)
        decide,                               # decision: dtype per node (min-cut or rules)
        LintTensorCores(spec, costs),         # analysis: Tensor Core alignment findings
    ]


def default_pipeline(low_dtype: torch.dtype, example_args: tuple, example_kwargs: dict, *,
                     costs: CostModel, spec: DeviceSpec, strategy: str = "optimal",
                     keep_io_types: bool = True, op_table: Optional[OpTable] = None,
                     overrides: Optional[dict] = None, keep_fp32: Optional[str] = None,
                     check: Union[bool, str] = True, range_dtype: Optional[torch.dtype] = None,
                     from_plan: Optional[dict] = None, train: bool = False,
                     simulate: bool = False, tolerance: Optional[float] = None,
                     pins: Optional[dict] = None) -> list[Pass]:
    """Passes after capture and ``prepare_pipeline``: decide, then rewrite, then verify.
    ``range_dtype`` (bf16 beside fp16) computes the nodes fp16's range keeps out of fp16;
    ``simulate``: the check computes as the target would (a GPU plan checked on a CPU);
    ``tolerance``: the value check's bound, met by the tolerance search that follows; ``pins``:
    the nodes that search keeps float32 (decide_pipeline)."""
    passes = decide_pipeline(low_dtype, costs=costs, spec=spec, strategy=strategy,
                             keep_io_types=keep_io_types, op_table=op_table, overrides=overrides,
                             keep_fp32=keep_fp32, range_dtype=range_dtype, from_plan=from_plan,
                             train=train, pins=pins)
    passes += [
        *([] if train else [StoreWeights(low_dtype, keep_io_types)]),  # rewrite: weights stored once
        *([StoreWeights(range_dtype, keep_io_types)] if range_dtype and not train else []),  # bf16
        InsertCasts(keep_io_types),           # rewrite: shared casts
        ChannelsLast(),                       # rewrite: NHWC layout for low-precision 2-D convs
        RetargetDtypeAsserts(),               # rewrite: export's dtype asserts
        *([PackCpuLinears(costs)] if spec.kind == Kind.CPU and not train else []),  # packed bf16 weights
    ]
    if check:
        passes.append(CheckConversion(example_args, example_kwargs, keep_io_types,  # verify by running
                                  simulate=simulate, values={"values": True, "dtypes": False}.get(check),
                                  tolerance=tolerance))
    return passes
