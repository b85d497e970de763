"""Make an exported graph follow ``.train()``/``.eval()`` like the model it came from.

torch.export records the training flag as constants: ``aten.dropout(x, p, train)``, batch norm
with ``training=True/False`` and, in training, ``num_batches_tracked.add_(1)``. In the model,
nn.Dropout and nn.BatchNorm read ``self.training`` at run time. This pass puts modules that do
the same in their place (nn.Dropout, mpgraph.ir.modules.TrainingBatchNorm and CountBatches; for
attention with ``dropout_p``, a DropoutRate module gives the rate at run time), so a
converted module trains with dropout and batch statistics, and evaluates without, whichever mode
it was captured in. Graphs from symbolic_trace call nn modules that read the flag, but
functional dropout there, ``F.dropout(h, p, self.training)``, was traced with the flag as a
constant: captured in training mode (``training=True``), it becomes the module as well; torch's
other functions that take the flag (``torch.dropout``, ``F.rrelu``, ``F.batch_norm``) read it
from a TrainingFlag, as the exported ops do.
"""
from __future__ import annotations

import torch
import torch.fx

from mpgraph.ir.graph import free_attr_name
from mpgraph.ir.meta import (BATCH_NORM_MOMENTA, CAPTURED_TRAINING, INSERTED_BY, LAYOUT, OBSERVED,
                             TENSOR, TensorInfo)
from mpgraph.ir.modules import CountBatches, DropoutRate, TrainingBatchNorm, TrainingFlag
from mpgraph.passes.infra import Pass, PassResult

aten = torch.ops.aten
F = torch.nn.functional
# functional dropout (symbolic_trace) -> the module that reads the flag; the training argument's
# position after the input and p
_FUNCTIONAL_DROPOUT = {F.dropout: torch.nn.Dropout, F.dropout1d: torch.nn.Dropout1d,
                       F.dropout2d: torch.nn.Dropout2d, F.dropout3d: torch.nn.Dropout3d,
                       F.alpha_dropout: torch.nn.AlphaDropout,
                       F.feature_alpha_dropout: torch.nn.FeatureAlphaDropout}


def _functional_dropout(node):
    """(module, args) for ``F.dropout(x, p, training=True)`` traced in training mode, else None."""
    if node.target not in _FUNCTIONAL_DROPOUT:
        return None
    args = list(node.args) + [None] * 3
    p = node.kwargs.get("p", args[1] if args[1] is not None else 0.5)
    training = node.kwargs.get("training", args[2] if args[2] is not None else True)
    if training is not True or node.kwargs.get("inplace") or not isinstance(p, float):
        return None
    return _FUNCTIONAL_DROPOUT[node.target](p), (node.args[0],)


# ops whose training flag is an argument (its position), read from a TrainingFlag: nn.Dropout1d
# to 3d, AlphaDropout, FeatureAlphaDropout, RReLU, GRU/LSTM/RNN's dropout between layers,
# InstanceNorm with running statistics (use_input_stats)
_TRAIN_ARGUMENT = {aten.feature_dropout.default: 2, aten.alpha_dropout.default: 2,
                   aten.feature_alpha_dropout.default: 2, aten.rrelu.default: 3,
                   aten.gru.input: 6, aten.lstm.input: 6, aten.rnn_tanh.input: 6,
                   aten.rnn_relu.input: 6, aten.instance_norm.default: 5}


# the same in graphs from symbolic_trace, which call torch's functions: (position, keyword) of
# the flag, followed where the call passes it (``torch.dropout(h, p, self.training)``,
# ``F.batch_norm(..., self.training, ...)``: timm's BatchNormAct2d), not where it is left to
# its default
_FX_TRAIN_ARGUMENT = {torch.dropout: (2, "train"), torch.feature_dropout: (2, "train"),
                      torch.alpha_dropout: (2, "train"), torch.feature_alpha_dropout: (2, "train"),
                      F.rrelu: (3, "training"), torch.rrelu: (3, "training"),
                      F.batch_norm: (5, "training"), torch.batch_norm: (5, "training")}
# batch norm's running mean (position, keyword): without running statistics it always
# normalises by the batch's, whatever the flag
_RUNNING_MEAN = {F.batch_norm: (1, "running_mean"), torch.batch_norm: (3, "running_mean")}


def _fx_train_argument(node, captured: bool):
    """(position, keyword) of the training flag of a torch function traced with the flag the
    model had, else None."""
    if node.target not in _FX_TRAIN_ARGUMENT:
        return None
    position, keyword = _FX_TRAIN_ARGUMENT[node.target]

    def given(at, name, missing=None):
        return node.kwargs[name] if name in node.kwargs else \
            node.args[at] if len(node.args) > at else missing

    if node.target in _RUNNING_MEAN and given(*_RUNNING_MEAN[node.target]) is None:
        return None
    return (position, keyword) if given(position, keyword) is captured else None


def _dropout_p(node):
    if "dropout_p" in node.kwargs:
        return node.kwargs["dropout_p"]
    return node.args[4] if len(node.args) > 4 else None


class FollowTrainingFlag(Pass):
    stage = "prepare"
    rewrites = True
    writes = (INSERTED_BY, TENSOR, OBSERVED, LAYOUT)  # the new nodes' facts (as captured)

    def _argument(self, gm, node, module, suffix: str, position: int, keyword: str = "") -> None:
        """The op keeps its place; its argument at ``position`` (or ``keyword``) comes from
        ``module`` at run time: attention's dropout_p from a DropoutRate, an op's training flag
        from a TrainingFlag."""
        module.train(gm.training)
        name = free_attr_name(gm, f"{node.name}_{suffix}")
        gm.add_submodule(name, module)
        with gm.graph.inserting_before(node):
            value = gm.graph.call_module(name, ())
        value.meta.update({INSERTED_BY: self.name, TENSOR: None})  # a float or bool, no tensor
        if keyword in node.kwargs:
            node.update_kwarg(keyword, value)
        else:
            node.update_arg(position, value)

    def _eval_traced(self, gm, running_mean, momentum):
        """(momentum, batch counter node or None) of a batch norm traced in eval: its momentum
        argument is 0.0 where the model's BatchNorm has None (a cumulative average over the
        counter), and no node counts batches; a BatchNorm's own counter makes training count."""
        owner = str(running_mean.target).rpartition(".")[0] if running_mean.op == "get_attr" else None
        counter = f"{owner}.num_batches_tracked"
        buffers = dict(gm.named_buffers())
        if owner not in gm.meta.get(BATCH_NORM_MOMENTA, {}) or counter not in buffers:
            return momentum, None  # (F.batch_norm over the model's own buffers: as traced)
        node = next((n for n in gm.graph.find_nodes(op="get_attr") if n.target == counter), None)
        if node is None:
            with gm.graph.inserting_before(running_mean):
                node = gm.graph.get_attr(counter)
            node.meta.update({INSERTED_BY: self.name, TENSOR: TensorInfo.of(buffers[counter])})
        return gm.meta[BATCH_NORM_MOMENTA][owner], node

    def call(self, gm):
        graph, changed = gm.graph, 0
        stale = False  # an op ran with a baked flag other than the module's: its value changes
        # the flag the model had when it was traced: an op whose baked flag is another one did
        # not follow the model's (a submodule frozen in eval, F.dropout(training=False), MC
        # dropout's F.dropout(x) in eval) and keeps it
        captured = gm.meta.get(CAPTURED_TRAINING, gm.training)
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten.dropout.default:
                x, p = node.args[0], node.args[1]
                if (node.args[2] if len(node.args) > 2 else True) != captured:
                    continue
                stale |= bool(p) and captured != gm.training
                module = torch.nn.Dropout(p)
                args = (x,)
            elif node.target is aten.batch_norm.default:
                x, w, b, rm, rv, _, momentum, eps = node.args[:8]
                if rm is None or rv is None or node.args[5] != captured:
                    continue  # no running statistics: the flag is not baked in
                stale |= captured != gm.training
                module, args = TrainingBatchNorm(momentum, eps), (x, w, b, rm, rv)
                if not captured:
                    module.momentum, counter = self._eval_traced(gm, rm, momentum)
                    args += (counter,) if counter is not None else ()
            elif node.target in _TRAIN_ARGUMENT:
                position = _TRAIN_ARGUMENT[node.target]
                if len(node.args) <= position or node.args[position] is not captured or (
                        node.target is aten.instance_norm.default and node.args[3] is None) or (
                        position == 6 and not (node.args[5] and node.args[4] > 1)):
                    continue  # (instance norm without running statistics: always batch's; an
                    # RNN without dropout between layers: the flag changes nothing)
                stale |= captured != gm.training
                self._argument(gm, node, TrainingFlag(), "training", position)
                changed += 1
                continue
            elif node.target is aten.scaled_dot_product_attention.default \
                    and _dropout_p(node) not in (None, 0.0):
                if not captured:
                    continue  # (a rate given in eval: the model's own choice)
                self._argument(gm, node, DropoutRate(float(_dropout_p(node))), "dropout_p", 4,
                               "dropout_p")
                stale |= not gm.training
                changed += 1
                continue
            elif (flag := _fx_train_argument(node, captured)) is not None:
                position, keyword = flag
                stale |= captured != gm.training
                self._argument(gm, node, TrainingFlag(), "training", position, keyword)
                changed += 1
                continue
            elif captured and _functional_dropout(node) is not None:
                module, args = _functional_dropout(node)
            elif node.target is aten.add_.Tensor and isinstance(node.args[0], torch.fx.Node) \
                    and node.args[0].op == "get_attr" \
                    and str(node.args[0].target).endswith("num_batches_tracked") and node.args[1] == 1:
                if not captured:
                    continue
                module, args = CountBatches(), (node.args[0],)
                stale |= not gm.training
            else:
                continue
            module.train(gm.training)
            name = free_attr_name(gm, f"{node.name}_mode")
            gm.add_submodule(name, module)
            with graph.inserting_before(node):
                new = graph.call_module(name, args)
            new.meta.update(node.meta)
            new.meta[INSERTED_BY] = self.name
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            changed += 1
        if stale:  # capture's run on the example inputs is not this graph's: calibrate runs it
            gm.meta.pop(OBSERVED, None)
        return PassResult(gm, changed > 0)
