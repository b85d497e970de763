import torch

from mpgraph.ir.meta import INSERTED_BY
from mpgraph.passes import ChannelsLast

from conftest import ConvBnReluPool, convert_rules, rel_err


def test_low_precision_convs_run_channels_last_with_the_same_values():
    model, x = ConvBnReluPool().eval(), torch.randn(2, 3, 16, 16)
    gm = convert_rules(model, x, dtype=torch.bfloat16)
    assert gm.conv.weight.dtype == torch.bfloat16
    assert gm.conv.weight.is_contiguous(memory_format=torch.channels_last)
    # the input's cast writes NHWC itself (a layout copy after it read its output once more)
    assert not [n for n in gm.graph.nodes if n.meta.get(INSERTED_BY) == "ChannelsLast"]
    cast = gm.graph.find_nodes(op="call_module", target="conv")[0].args[0]
    assert cast.target == "to" and cast.kwargs == {"memory_format": torch.channels_last}
    seen = []
    gm.conv.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        gm(x)
    assert seen[0].dtype == torch.bfloat16 and seen[0].is_contiguous(memory_format=torch.channels_last)
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


class LeNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 6, 5), torch.nn.Conv2d(6, 16, 5)
        self.fc = torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.c1(x)), 2)
        features = torch.nn.functional.max_pool2d(torch.relu(self.c2(x)), 2)
        return self.fc(features.view(features.size(0), -1)), features


def test_the_model_s_own_view_and_the_returned_feature_map_see_its_layout():
    """NHWC strides reached the model's own ``x.view(B, -1)`` after a conv (the conversion
    failed in its check) and the returned feature map (a user's ``out.view`` failed)."""
    torch.manual_seed(0)
    model, x = LeNet().eval(), torch.randn(4, 3, 28, 28)
    gm = convert_rules(model, x, dtype=torch.bfloat16)
    assert gm.c2.weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        (logits, features), (want_logits, want_features) = gm(x), model(x)
    assert features.is_contiguous() and features.view(4, -1).shape == (4, 256)
    assert rel_err(logits, want_logits) < 2e-2 and rel_err(features, want_features) < 2e-2
    added = sorted(n.name for n in gm.graph.nodes if n.meta.get(INSERTED_BY) == "ChannelsLast")
    assert [n for n in added if n.endswith("_nchw")] == \
        sorted(n for n in added if n.endswith("_nchw"))
    assert len([n for n in added if n.endswith("_nchw")]) == 2  # the view's input, the output
    code = gm.code
    assert ChannelsLast()(gm).modified is False and gm.code == code  # idempotent
    # channels_last examples: torch's convs return NHWC in the model too, and so does gm
    convs = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3)).eval()
    xl = x.contiguous(memory_format=torch.channels_last)
    gl = convert_rules(convs, xl, dtype=torch.bfloat16)
    with torch.no_grad():
        assert convs(xl).is_contiguous(memory_format=torch.channels_last)
        assert gl(xl).is_contiguous(memory_format=torch.channels_last)
        assert convert_rules(convs, x, dtype=torch.bfloat16)(x).is_contiguous()
