"""The default pipeline: a plain list of pass instances, readable top to bottom."""
from __future__ import annotations

from typing import Optional

import torch

from mpgraph.op_table import OpTable
from mpgraph.pass_infra import Pass
from mpgraph.passes import (AssignPrecision, CheckDtypes, ClassifyOps, FuseTanhGelu, InsertCasts,
                            RetargetDtypeAsserts, StoreWeights)


def default_pipeline(low_dtype: torch.dtype, example_args: tuple, example_kwargs: dict, *,
                     keep_io_types: bool = True, op_table: Optional[OpTable] = None,
                     overrides: Optional[dict] = None, check: bool = True) -> list[Pass]:
    """Passes after capture (which already recorded shapes and dtypes)."""
    passes: list[Pass] = [
        FuseTanhGelu(),                                        # rewrite: GPT-2's GELU as one op
        ClassifyOps(low_dtype, op_table),                      # analysis: op class per node
        AssignPrecision(low_dtype, keep_io_types, overrides),  # decision: dtype per node
        StoreWeights(low_dtype, keep_io_types),                # rewrite: weights stored once
        InsertCasts(keep_io_types),                            # rewrite: shared casts
        RetargetDtypeAsserts(),                                # rewrite: export's dtype asserts
    ]
    if check:
        passes.append(CheckDtypes(example_args, example_kwargs, keep_io_types))  # verify by running
    return passes
