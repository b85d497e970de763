"""Store parameters and buffers in the dtype their readers compute in, once, at conversion time.

autocast re-casts every weight on every call (its cache holds only leaf tensors that require grad,
and is cleared when the outermost autocast exits); at small batch that dominates. Here a weight
read only by low-precision nodes is replaced by its low-precision copy; one read by both
precisions keeps the float32 original and gets a low-precision sibling attribute. Buffers written
in place (batch-norm statistics in training) are never touched.
"""
from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.fx

from mpgraph.ir.edges import required_dtype
from mpgraph.ir.fake import held_counts, module_tensors
from mpgraph.ir.graph import (fetch_attr, free_attr_name, owner_of, read_transposed, set_attr,
                              with_data)
from mpgraph.ir.meta import (INSERTED_BY, OP_CLASS, PRECISION, TENSOR, WEIGHTS, Decision, TensorInfo,
                          WeightRecord, dtype_name)
from mpgraph.ir.modules import in_layout
from mpgraph.passes.infra import Pass, PassResult


def _converted(value: torch.Tensor, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
    """``value`` in ``dtype``; ``transposed``: a 2-D one stored column-major (``read_transposed``)."""
    return with_data(value, in_layout(value, dtype, "transposed" if transposed else ""))


def _add_copy(root: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    """A low-precision copy beside its original: a buffer that moves with ``.to()`` but is not
    in the state dict (the model's keys are; ConvertedModule refreshes the copy from its
    original when that is written)."""
    owner, leaf = owner_of(root, target)
    owner.register_buffer(leaf, value.detach(), persistent=False)


def _free_name(root: torch.nn.Module, target: str, dtype: torch.dtype) -> str:
    return free_attr_name(root, f"{target}_{dtype_name(dtype)}")


class StoreWeights(Pass):
    stage = "rewrite"
    rewrites = True
    reads, writes = (PRECISION, OP_CLASS), (WEIGHTS, TENSOR, PRECISION, INSERTED_BY, OP_CLASS)

    def __init__(self, low_dtype: torch.dtype, keep_io_types: bool = True):
        self.low = low_dtype
        self.keep_io_types = keep_io_types

    def call(self, gm):
        records: list[WeightRecord] = list(gm.meta.get(WEIGHTS, []))
        edits = self._get_attrs(gm, records) + self._modules(gm, records) + self._caches(gm, records)
        gm.meta[WEIGHTS] = records
        return PassResult(gm, edits > 0)

    def _get_attrs(self, gm, records) -> int:
        by_target = defaultdict(list)
        for node in gm.graph.nodes:
            d = node.meta.get(PRECISION)
            # dtype None: not yet stored; float32: kept by an earlier StoreWeights for other
            # readers (a second instance stores bf16 copies beside fp16 ones)
            # (a get_attr another pass added reads a parameter too: MatVecLinear's of nn.Linear)
            if node.op == "get_attr" and d is not None and d.stored \
                    and node.meta.get(INSERTED_BY) != self.name \
                    and (d.dtype is None or d.dtype == torch.float32):
                by_target[node.target].append(node)
        # tensors a module also reads in float32 (an embedding whose table an output projection
        # reads too) or held under another name: converting them in place would change them
        # for those readers
        held = held_counts(gm)
        called = set()
        for n in gm.graph.nodes:
            d = n.meta.get(PRECISION)
            if n.op == "call_module" and (d is None or d.dtype != self.low
                                          or d.param_dtype not in (None, self.low)):
                module = gm.get_submodule(n.target)
                called |= {id(t) for t in (*module.parameters(), *module.buffers())}
        edits = 0
        for target, nodes in by_target.items():
            original = fetch_attr(gm, target)
            low_users, other = [], id(original) in called or held.get(id(original), 0) > 1
            for node in nodes:
                for user in node.users:
                    need = required_dtype(user, node, gm, self.keep_io_types)
                    if need == self.low:
                        low_users.append((node, user))
                    else:
                        other = True
            if not low_users:
                for node in nodes:
                    node.meta[PRECISION] = Decision(torch.float32, "parameter read in float32",
                                                    stored=True)
                continue
            low_value = _converted(original, self.low, read_transposed(nodes))
            if not other:
                set_attr(gm, target, low_value)
                for node in nodes:
                    node.meta[TENSOR] = TensorInfo(node.meta[TENSOR].shape, self.low)
                    node.meta[PRECISION] = Decision(self.low, f"stored as {dtype_name(self.low)}",
                                                    stored=True)
                records.append(WeightRecord(target, target, self.low, original.numel(), False))
                edits += 1
                continue
            new_target = _free_name(gm, target, self.low)
            _add_copy(gm, new_target, low_value)
            records.append(WeightRecord(new_target, target, self.low, original.numel(), True))
            for node in nodes:
                node.meta[PRECISION] = Decision(torch.float32, "parameter read in float32 "
                                                f"(a {dtype_name(self.low)} copy serves low readers)",
                                                stored=True)
            copies = {}
            for node, user in low_users:
                if node not in copies:
                    with gm.graph.inserting_after(node):
                        new = gm.graph.get_attr(new_target)
                    new.meta.update({TENSOR: TensorInfo(node.meta[TENSOR].shape, self.low),
                                     PRECISION: Decision(self.low, f"{dtype_name(self.low)} copy of "
                                                         f"{target}", stored=True),
                                     OP_CLASS: node.meta[OP_CLASS], INSERTED_BY: self.name})
                    copies[node] = new
                user.replace_input_with(node, copies[node])
                edits += 1
        return edits

    def _caches(self, gm, records) -> int:
        """Buffers the plan keeps low although written in place (a KV cache): converted once."""
        done = set()
        for node in gm.graph.nodes:
            d = node.meta.get(PRECISION)
            if node.op != "get_attr" or d is None or d.dtype != self.low or d.stored \
                    or node.meta.get(INSERTED_BY) == self.name:
                continue
            original = fetch_attr(gm, node.target)
            if not isinstance(original, torch.Tensor):
                continue
            if original.dtype != self.low:
                set_attr(gm, node.target, _converted(original, self.low))
                records.append(WeightRecord(node.target, node.target, self.low, original.numel(),
                                            False))
                done.add(node.target)
            # (its TENSOR stays the captured float32: a float32 reader of the cache, a
            # cache.sum(0) after the write, then gets a cast of its own, just before it)
        return len(done)

    def _modules(self, gm, records) -> int:
        copied = {r.name for r in records if r.shared}  # low copies beside their originals
        calls = defaultdict(list)
        for node in gm.graph.nodes:
            if node.op == "call_module":
                calls[node.target].append(node)
        # tensors held in more than one place (tied weights) or also read by get_attr nodes:
        # converting them inside a module in place would change them for those other readers
        places = held_counts(gm)
        elsewhere = {id(t) for t in (fetch_attr(gm, n.target) for n in gm.graph.nodes
                                     if n.op == "get_attr") if isinstance(t, torch.Tensor)}

        def is_low(n):
            return n.meta[PRECISION].dtype == self.low \
                and n.meta[PRECISION].param_dtype in (None, self.low)

        # a tensor tied only between modules every call of which is low (two Linears sharing a
        # weight) is stored low once, for all its holders: a low copy per module beside float32
        # originals held 2x the float32 model's memory
        in_low = defaultdict(int)
        for target, nodes in calls.items():
            if all(is_low(n) for n in nodes):
                for _, t in module_tensors(gm.get_submodule(target)):
                    in_low[id(t)] += 1
        elsewhere |= {i for i, n in places.items() if n > 1 and (in_low[i] != n or i in elsewhere)}
        done: dict[int, torch.Tensor] = {}  # a tied tensor's one low value, by its original
        edits = 0
        for target, nodes in calls.items():
            low = [n for n in nodes if is_low(n)]
            if not low:
                continue
            module = gm.get_submodule(target)
            held = list(module.named_parameters()) + list(module.named_buffers())
            tensors = [(n, t) for n, t in held if t.dtype == torch.float32]
            if not tensors:
                continue
            shared = len(low) < len(nodes) or any(id(t) in elsewhere for _, t in tensors)
            source = target
            if shared:  # float32 readers elsewhere: a converted copy serves the low calls
                # (tensors _get_attrs already stored low in place, all their get_attr readers
                # being low, are copied too: a deep copy's own parameter was a state-dict key
                # the model lacks, and no write of the original reached it)
                tensors += [(n, t) for n, t in held
                            if t.dtype == self.low and f"{target}.{n}" not in copied]
                new_target = _free_name(gm, target, self.low)
                module = copy.deepcopy(module)
                for name, _ in list(module.named_buffers()):  # not _get_attrs' low copies
                    if f"{target}.{name}" in copied:
                        owner, leaf = owner_of(module, name)
                        owner._buffers.pop(leaf)
                gm.add_submodule(new_target, module)
                for n in low:
                    n.target = new_target
                target = new_target
            for name, t in tensors:
                if shared:  # the copy's tensors are copies too: out of the state dict
                    owner, leaf = owner_of(module, name)
                    owner._parameters.pop(leaf, None)
                    owner._buffers.pop(leaf, None)
                    _add_copy(module, name, t.detach().to(self.low))
                else:
                    if id(t) in done:  # (tied: stored and recorded once)
                        set_attr(module, name, done[id(t)])
                        continue
                    done[id(t)] = _converted(t, self.low)
                    set_attr(module, name, done[id(t)])
                records.append(WeightRecord(f"{target}.{name}", f"{source}.{name}", self.low,
                                            t.numel(), shared))
            edits += 1
        return edits
