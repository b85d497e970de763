import dataclasses

import pytest
import torch

import mpgraph
from mpgraph.ir.meta import PRECISION
from mpgraph.passes import CheckConversion

from conftest import convert_rules, MLP

convert = convert_rules  # these tests pin the rules, planned for conftest.GPU


def test_passes_on_a_correct_conversion_and_changes_nothing():
    x = torch.randn(4, 16)
    gm = convert(MLP(), x, dtype=torch.bfloat16)
    code = gm.code
    assert CheckConversion((x,)).__call__(gm).modified is False
    assert gm.code == code


def test_a_plan_that_disagrees_with_the_graph_is_an_error():
    x = torch.randn(4, 16)
    gm = convert(MLP(), x, dtype=torch.bfloat16)
    act = next(n for n in gm.graph.nodes if n.name == "act")
    act.meta[PRECISION] = dataclasses.replace(act.meta[PRECISION], dtype=torch.float32)
    with pytest.raises(mpgraph.ConversionError, match="act: produced torch.bfloat16"):
        CheckConversion((x,))(gm)
