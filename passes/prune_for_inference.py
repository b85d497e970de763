"""Drop the nodes that do nothing in an inference conversion of a model in eval mode.

Eager execution on a GPU is host-bound at ordinary sizes: every node costs ~5-10 us of Python and
dispatch whatever its FLOPs, so a node that computes nothing is pure loss. An inference
conversion of a model in eval mode has some: dropout (the identity in eval; an attention's
``dropout_p`` is 0), torch.export's ``_assert_tensor_metadata`` checks, and ``sym_size`` reads
nothing uses any more. torch.export's ``_guards_fn`` input guard stays: it holds the conditions
the graph is right under (a branch on a size the model took at capture, a dimension fixed at
the example's size), and a call that breaks one is an error, not a wrong answer. They go; what is left computes. A model
converted in training mode keeps them (dropout follows ``.train()``/``.eval()`` there), and so does
``mode="train"``, which does not run this pass.
"""
from __future__ import annotations

import torch
import torch.fx

from mpgraph.ir.meta import EVAL_ONLY
from mpgraph.ir.modules import DropoutRate, TrainingFlag
from mpgraph.passes.infra import Pass, PassResult

_ASSERTS = {getattr(torch.ops.aten, name, None) for name in ("_assert_tensor_metadata",)} - {None}
_SIZES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default}


def _dropout(module) -> bool:
    """Dropout in eval (a module the model set to train itself, MC dropout, stays)."""
    return isinstance(module, torch.nn.modules.dropout._DropoutNd) and not module.training


class PruneForInference(Pass):
    """Rewrite: eval-mode dropout, export's dtype asserts, unused shape reads removed."""

    stage = "prepare"
    rewrites = True
    writes = (EVAL_ONLY,)  # on gm.meta

    def call(self, gm):
        if gm.training:
            return PassResult(gm, False)  # captured in training mode: the flag still matters
        graph, removed, dropouts, flags = gm.graph, 0, 0, 0
        for node in list(graph.nodes):
            module = gm.get_submodule(node.target) if node.op == "call_module" else None
            if module is not None and _dropout(module) and len(node.args) == 1:
                node.replace_all_uses_with(node.args[0])  # the identity in eval mode
                dropouts += 1
            elif isinstance(module, DropoutRate):
                for user in list(node.users):  # attention's dropout_p in eval mode
                    user.replace_input_with(node, 0.0)
                dropouts += 1
            elif isinstance(module, TrainingFlag):
                for user in list(node.users):  # an op's training argument in eval mode
                    user.replace_input_with(node, False)
                flags += 1
            elif not (node.op == "call_function"
                      and getattr(node.target, "overloadpacket", None) in _ASSERTS):
                continue
            if not node.users:
                graph.erase_node(node)
                removed += 1
        for node in reversed(list(graph.nodes)):  # shape reads that fed only what went
            if node.op == "call_function" and node.target in _SIZES and not node.users:
                graph.erase_node(node)
                removed += 1
        if dropouts or flags:  # what .train() on the converted module cannot bring back: said
            gm.meta[EVAL_ONLY] = ", ".join(
                ([f"{dropouts} dropout op{'s' if dropouts > 1 else ''} removed"] if dropouts else [])
                + ([f"{flags} training flag{'s' if flags > 1 else ''} fixed to eval"]
                   if flags else []))
        if removed:
            gm.delete_all_unused_submodules()
        return PassResult(gm, removed > 0)
