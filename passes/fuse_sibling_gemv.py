"""Sibling GEMVs on one row (a decoder step's q, k and v projections; an MLP's gate and up) as
one GEMV over their weights stacked: ``mv(cat(Wq, Wk, Wv), x)``, then a row slice per product.

One larger GEMV streams the same bytes with one kernel call instead of three. Timed on a 2-core
AMX Xeon in bf16, each variant on 12 weights of its own read in turn from memory
(examples/bench/bench_fuse_gemv.py, two runs): q/k/v as one 2304x768 GEMV 320-343 us against
384-394 us for three 768x768 ones, gate/up as one 4096x768 527-555 us against 572-602. A 6-layer
Llama's decode step (convert_decoder, batch 1), with and without this pass, called alternately
300 times each: median of the paired ratios 1.026x and 1.031x; a slice per member costs 2.3 us.

The stacked weight is built once, at conversion, and the model's own weights become row views of
it: the state dict keeps the model's keys and tensors, ``load_state_dict`` writes through them,
and nothing is held twice. What replaces a member (``load_state_dict(assign=True)``, ``.to()``,
``load_weights``) is copied back into the stacked tensor before the next call
(``modules.FusedWeights``). Runs after MatVecLinear (its ``mv`` nodes and the one row view it
gives all linears of a value), before the costs are measured, so the plan prices and decides the
stacked GEMV as the graph runs it.
"""
from __future__ import annotations

import fnmatch
from collections import defaultdict
from typing import Iterable

import torch
import torch.fx

from mpgraph.ir.fake import held_counts
from mpgraph.ir.graph import (fetch_attr, free_attr_name, module_path, mutated_nodes, set_attr,
                              with_data)
from mpgraph.ir.meta import FUSED, INSERTED_BY, OBSERVED, TENSOR, TensorInfo
from mpgraph.passes.infra import Pass, PassResult

aten = torch.ops.aten


def _named(node: torch.fx.Node, keys: tuple) -> bool:
    """Whether a user override names this node or its module (a node name, a module path or
    glob: AssignPrecision's keys); "op:" and "class:" keys name every member alike."""
    path = module_path(node)
    return any(key == node.name or (path and (key == path or fnmatch.fnmatchcase(path, key)))
               for key in keys if not key.startswith(("op:", "class:")))


def _member(node: torch.fx.Node, gm, held: dict, written: set, keep_apart: tuple = ()):
    """(weight's get_attr node, its tensor) of an ``mv(W, x)`` that can join a stack, else None:
    W a 2-D floating tensor of the module, contiguous rows, held under one name, read only here
    and never written, and no override naming the layer (its own dtype: it runs alone)."""
    if node.op != "call_function" or node.target is not aten.mv.default or node.kwargs \
            or _named(node, keep_apart):
        return None
    w = node.args[0]
    if not isinstance(w, torch.fx.Node) or w.op != "get_attr" or w in written or len(w.users) != 1:
        return None
    t = fetch_attr(gm, w.target)
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.dtype.is_floating_point \
            or not t.is_contiguous() or held.get(id(t), 0) != 1:
        return None
    return w, t


def _stack_name(gm, targets: list[str]) -> str:
    """``<owner>.fused_<names>``: beside the members, named for them (``...self_attn.fused_q_proj_
    weight_k_proj_weight_v_proj_weight``)."""
    parts = [t.split(".") for t in targets]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    owner = ".".join(parts[0][:common])
    leaf = "fused_" + "_".join("_".join(p[common:]) for p in parts[:-1]) + "_" \
        + "_".join(parts[-1][common:])
    return free_attr_name(gm, f"{owner}.{leaf}" if owner else leaf)


class FuseSiblingGemv(Pass):
    """``keep_apart``: the user's override keys (a layer an override names keeps its own GEMV,
    so that its dtype is its own)."""
    stage = "prepare"
    rewrites = True
    writes = (FUSED, INSERTED_BY, TENSOR, OBSERVED)  # (OBSERVED: dropped, Calibrate runs again)

    def __init__(self, keep_apart: Iterable[str] = ()):
        self.keep_apart = tuple(str(k) for k in keep_apart)

    def call(self, gm):
        graph = gm.graph
        written = mutated_nodes(graph, gm)
        held = held_counts(gm)
        groups = defaultdict(list)
        for node in graph.nodes:
            found = _member(node, gm, held, written, self.keep_apart)
            if found is not None:
                w, t = found
                groups[(node.args[1], t.dtype, t.device, t.shape[1])].append((node, w, t))
        records = list(gm.meta.get(FUSED, []))
        for members in groups.values():
            if len({id(t) for _, _, t in members}) != len(members) or len(members) < 2:
                continue
            records.append(self._fuse(gm, members))
        if len(records) == len(gm.meta.get(FUSED, [])):
            return PassResult(gm, False)
        gm.meta[FUSED] = records
        gm.meta.pop(OBSERVED, None)  # the stacked product's statistics: Calibrate runs the graph
        for node in graph.nodes:
            node.meta.pop(OBSERVED, None)
        return PassResult(gm, True)

    def _fuse(self, gm, members) -> tuple:
        graph = gm.graph
        first, row = members[0][0], members[0][0].args[1]
        target = _stack_name(gm, [w.target for _, w, _ in members])
        stacked = torch.cat([t.detach() for _, _, t in members])
        # a buffer out of the state dict (which holds the members), moved by .to()
        owner_path, _, leaf = target.rpartition(".")
        (gm.get_submodule(owner_path) if owner_path else gm).register_buffer(
            leaf, stacked, persistent=False)
        with graph.inserting_before(first):
            get = graph.get_attr(target)
            product = graph.call_function(aten.mv.default, (get, row))
        get.meta[TENSOR] = TensorInfo(tuple(stacked.shape), stacked.dtype)
        product.meta[TENSOR] = TensorInfo((stacked.shape[0],), first.meta[TENSOR].dtype)
        for v in (get, product):
            v.meta[INSERTED_BY] = self.name
            v.meta["nn_module_stack"] = first.meta.get("nn_module_stack")
        spans, start = [], 0
        for node, w, t in members:
            stop = start + t.shape[0]
            set_attr(gm, w.target, with_data(t, stacked[start:stop]))  # a row view of the stack
            with graph.inserting_before(node):  # (one slice each: 2.3 us a call, where one
                # split_with_sizes took 11.9 us, profiled in the Llama's step)
                part = graph.call_function(aten.slice.Tensor, (product, 0, start, stop))
            part.meta.update({TENSOR: node.meta[TENSOR], INSERTED_BY: self.name,
                              "nn_module_stack": node.meta.get("nn_module_stack")})
            node.replace_all_uses_with(part)
            graph.erase_node(node)
            graph.erase_node(w)
            spans.append((w.target, start, stop))
            start = stop
        return target, tuple(spans)
