"""The pass contract, enforced (issue 28): PassManager checks each pass's declared reads before it
runs and its writes after (the suite runs with MPGRAPH_CHECK_PASSES=1: every conversion in it is
checked), names the pass in every error, and times the pipeline."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.fx

import mpgraph
from conftest import GPU
from mpgraph.errors import PassError
from mpgraph.ir.meta import COST, TENSOR
from mpgraph.passes.infra import Pass, PassManager, PassResult, checking

transformers = pytest.importorskip("transformers")

DEFAULT = {"Functionalize", "FuseTanhGelu", "FollowTrainingFlag", "PruneForInference",
           "Calibrate", "ClassifyOps", "NumericSafety", "EstimateCost", "AssignPrecisionOptimal",
           "LintTensorCores", "StoreWeights", "InsertCasts", "ChannelsLast",
           "RetargetDtypeAsserts", "CheckConversion"}


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=100)
    return transformers.BertModel(config).eval(), (torch.randint(0, 100, (2, 16)),)


def _resnet():
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
    return transformers.ResNetModel(config).eval(), (torch.randn(2, 3, 32, 32),)


@pytest.mark.parametrize("build", [_bert, _resnet], ids=["bert", "resnet"])
@pytest.mark.parametrize("options", [dict(target=GPU), dict(target="cpu", dtype="bf16"),
                                     dict(target=GPU, mode="train")],
                         ids=["gpu", "cpu-bf16", "train"])
def test_every_pass_of_the_default_pipeline_keeps_its_declared_writes(build, options, caplog):
    assert checking()  # conftest: the suite checks
    model, inputs = build()
    with caplog.at_level(logging.DEBUG, logger="mpgraph.passes.infra"):
        mpgraph.convert(model, inputs, **options)
    ran = {r.getMessage().split()[1].rstrip(":") for r in caplog.records
           if r.getMessage().startswith("pass ")}
    expected = DEFAULT - ({"PruneForInference", "StoreWeights"} if "mode" in options else set())
    assert expected <= ran, expected - ran


class WritesCostQuietly(Pass):
    """Declares nothing and writes a fact another pass owns."""

    def call(self, gm):
        for node in gm.graph.nodes:
            node.meta[COST] = None
        return PassResult(gm, False)


class Breaks(Pass):
    writes = (COST,)

    def call(self, gm):
        raise ValueError("an internal failure")


def _graph():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    for node in gm.graph.nodes:
        node.meta[TENSOR] = None
    return gm


def test_an_undeclared_write_fails_naming_the_pass_and_the_fact():
    with pytest.raises(PassError, match=r"pass WritesCostQuietly failed: wrote facts it does not "
                                        r"declare in its writes: mpgraph\.cost \(on \w+\)"):
        PassManager([WritesCostQuietly()], check=True)(_graph())
    PassManager([WritesCostQuietly()], check=False)(_graph())  # production: not snapshotted


def test_a_failure_inside_a_pass_names_it_and_what_ran_before():
    class Fine(Pass):
        def call(self, gm):
            return PassResult(gm, False)

    with pytest.raises(PassError, match="pass Breaks failed: ValueError: an internal failure") \
            as err:
        PassManager([Fine(), Breaks()])(_graph())
    assert err.value.ran_before == ["Fine"]


def test_the_manager_times_each_pass():
    manager = PassManager([WritesCostQuietly(), WritesCostQuietly()], check=False)
    manager(_graph())
    manager(_graph())  # the last run's, not both runs'
    assert [name for name, _, _ in manager.timings] == ["WritesCostQuietly"] * 2
    assert all(seconds >= 0 and modified is False for _, seconds, modified in manager.timings)
