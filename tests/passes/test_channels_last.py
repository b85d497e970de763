import torch

from mpgraph.ir.meta import INSERTED_BY
from mpgraph.passes import ChannelsLast

from conftest import ConvBnReluPool, convert_rules, rel_err


def test_low_precision_convs_run_channels_last_with_the_same_values():
    model, x = ConvBnReluPool().eval(), torch.randn(2, 3, 16, 16)
    gm = convert_rules(model, x, dtype=torch.bfloat16)
    assert gm.conv.weight.dtype == torch.bfloat16
    assert gm.conv.weight.is_contiguous(memory_format=torch.channels_last)
    layout = [n for n in gm.graph.nodes if n.meta.get(INSERTED_BY) == "ChannelsLast"]
    assert [n.target for n in layout] == ["contiguous"] and [u.name for u in layout[0].users] == ["conv"]
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < 2e-2
    code = gm.code
    assert ChannelsLast()(gm).modified is False  # idempotent
    assert gm.code == code


def test_fp32_convs_keep_their_layout():
    model, x = ConvBnReluPool().eval(), torch.randn(2, 3, 16, 16)
    gm = convert_rules(model, x, dtype=torch.bfloat16, overrides={"conv": "fp32"})
    assert gm.conv.weight.is_contiguous()
    assert not any(n.meta.get(INSERTED_BY) == "ChannelsLast" for n in gm.graph.nodes)
