"""Insert the casts the plan needs: one per (value, dtype), shared by all readers.

A cast is placed just before its first reader, so a value is converted once however many nodes
read it, and never earlier than needed. A value that is written in place somewhere gets a fresh
cast before each reader instead, so no reader sees a stale copy. Casts are ordinary
``Tensor.to`` call_method nodes (a multi-output value read whole, ``cast_leaves`` over its items):
they run eagerly, under torch.compile and through torch.export.
"""
from __future__ import annotations

import torch

from mpgraph.ir.edges import cast_info, cast_leaves, required_dtype
from mpgraph.ir.graph import input_nodes, mutated_nodes
from mpgraph.ir.meta import (INSERTED_BY, OP_CLASS, PRECISION, SHORT_DTYPE_NAMES, TENSOR, Decision,
                          OpInfo)
from mpgraph.passes.numeric_safety import carries_sentinel
from mpgraph.passes.op_table import CAST
from mpgraph.passes.infra import ALL_NODES, Pass, PassResult



class InsertCasts(Pass):
    stage = "rewrite"
    rewrites = True
    reads, reads_on = (PRECISION,), ALL_NODES
    writes = (PRECISION, TENSOR, OP_CLASS, INSERTED_BY)

    def __init__(self, keep_io_types: bool = True):
        self.keep_io_types = keep_io_types

    def call(self, gm):
        graph = gm.graph
        mutated = mutated_nodes(graph, gm)
        cache: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                continue
            for arg in input_nodes(node):
                have_decision = arg.meta.get(PRECISION)
                if have_decision is None or have_decision.dtype is None:
                    continue
                if have_decision.stored and arg.op == "get_attr":
                    continue  # StoreWeights materialises parameters in the right dtype
                need = required_dtype(node, arg, gm, self.keep_io_types)
                have = have_decision.dtype
                if need is None or need == have:
                    continue
                key = (arg, need, node) if arg in mutated else (arg, need)
                cast = cache.get(key)
                if cast is None:
                    cast = self._make_cast(graph, arg, need, have, before=node)
                    cache[key] = cast
                node.replace_input_with(arg, cast)
        return PassResult(gm, bool(cache))

    def _make_cast(self, graph, value, dtype, have, before):
        name = f"{value.name}_to_{SHORT_DTYPE_NAMES.get(dtype, 'x')}"
        info = value.meta.get(TENSOR)
        with graph.inserting_before(before):
            if isinstance(info, tuple):  # a multi-output value read whole: each item cast
                cast = graph.create_node("call_function", cast_leaves, (value, dtype, have), {},
                                         name=name)
            else:
                source = value
                if dtype.is_floating_point and have.is_floating_point \
                        and torch.finfo(dtype).max < torch.finfo(have).max \
                        and carries_sentinel(value, dtype):
                    source = self._saturate(graph, value, dtype, have)
                cast = graph.create_node("call_method", "to", (source, dtype), {}, name=name)
        cast.meta[TENSOR] = cast_info(info, dtype)
        cast.meta[OP_CLASS] = OpInfo(CAST, "inserted by mpgraph",
                                     "Tensor.to" if cast.op == "call_method" else "cast_leaves")
        short = SHORT_DTYPE_NAMES
        cast.meta[PRECISION] = Decision(dtype, f"cast {short.get(have)}->{short.get(dtype)} of "
                                               f"{value.name}", pinned=True, reads_any=True)
        cast.meta[INSERTED_BY] = self.name
        return cast

    def _saturate(self, graph, value, dtype, have):
        """``value`` clamped to ``dtype``'s finite range before its cast: the fill stays the
        most negative (positive) value there, as a model computing in that dtype writes its
        mask (``finfo(dtype).min``), not -inf. NaN passes; an inf in the same value becomes the
        range's end too (still a zero weight after softmax)."""
        info = torch.finfo(dtype)
        node = graph.create_node("call_method", "clamp", (value, info.min, info.max), {},
                                 name=f"{value.name}_saturated")
        node.meta[TENSOR] = value.meta.get(TENSOR)
        node.meta[OP_CLASS] = OpInfo(CAST, "inserted by mpgraph", "Tensor.clamp")
        short = SHORT_DTYPE_NAMES
        node.meta[PRECISION] = Decision(have, f"{short.get(have)} clamped to the range of "
                                              f"{short.get(dtype)} before its cast: it may hold a "
                                              "mask's fill value beyond it", pinned=True)
        node.meta[INSERTED_BY] = f"{self.name} (saturate)"  # (not one of the plan's casts)
        return node

    def ensures(self, gm):
        for node in gm.graph.nodes:
            if node.meta.get(INSERTED_BY) == self.name:
                src = node.args[0]
                if src.meta.get(INSERTED_BY) == self.name:
                    raise self.fail("a cast reads another cast (round trip)", node)
            for arg in input_nodes(node):
                if node.op in ("placeholder", "get_attr"):
                    continue
                need = required_dtype(node, arg, gm, self.keep_io_types)
                have = arg.meta.get(PRECISION)
                if need is not None and have is not None and have.dtype is not None \
                        and have.dtype != need:
                    raise self.fail(f"reads {arg.name} as {have.dtype}, needs {need}", node)
