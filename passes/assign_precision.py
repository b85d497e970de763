"""Decide the dtype every node computes in: rule-based propagation, first version.

Hard rules first (Tensor-Core ops go low, fp32 classes stay fp32, user overrides, the
numeric-safety findings of NumericSafety, in-place writes), then ``follow`` ops take their inputs'
precision in one forward sweep (low only when every runtime float input is low, so a chain of
follow ops between two matmuls stays low and a low value never meets a float32 one unconverted).
A backward refinement then moves a low follow op to float32 when all its readers are float32 and
its inputs already have float32 casts: one cast fewer, none added. Parameters and values computed
from parameters alone are not decided here: they take the dtype their readers need, at
conversion time, so no weight is ever cast at run time.

A norm between low ops reads and writes the low dtype (``OpEntry.low_io``) with float32
parameters where the target's kernel takes that mix (CPU kernels, batch norm on CUDA), else with
parameters in the low dtype (CUDA's and ONNX's layer/group norm): the plan is the target's, not
this machine's (``kernels``: the target kind).

A parameter added to or concatenated with activations (a class token, a position embedding) is a
float32 value there, not a weight, as in autocast's type promotion; so a residual stream that
starts at such an op stays float32. A parameter that scales activations (a layer scale) is a
weight, stored in the dtype its reader computes in.

``AssignPrecisionOptimal`` runs this pass first and treats its float32 decisions as bounds
(same contract: reads ``mpgraph.op_class`` and ``mpgraph.tensor``, writes ``mpgraph.precision``).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import operator
import weakref
from typing import Optional

import torch
import torch.fx

from mpgraph.ir.edges import required_dtype
from mpgraph.ir.graph import (CALLS, alias_base, input_nodes, is_conversion, is_export_guard,
                              is_inplace, is_view, may_alias, module_names, module_path, mutated_nodes,
                              stored_into_only, target_name)
from mpgraph.ir.meta import (CAST_COST, COST, COST_MODEL, ESTIMATE, OP_CLASS, PRECISION, SAFETY,
                             TENSOR, Decision, TensorInfo, dtype_name, fp32_region,
                             is_float32_tensor)
from mpgraph.passes.op_table import (CAST, FOLLOW, OP_OF_SPELLING, TENSOR_CORE, mixed_params_ok,
                                     table_op_name)
from mpgraph.passes.infra import ALL_NODES, Pass, PassResult

log = logging.getLogger(__name__)
FP32 = torch.float32
# convert decides one captured graph several times (once per candidate dtype, then for the plan):
# an override that matches no node is warned about once per graph, not once per decision
_UNMATCHED_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> keys warned
# the reason of a node the tolerance search pinned (api reads it apart from the user's overrides)
PINNED_BY_SEARCH = "pinned to float32 by the tolerance search"
_METHOD_DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                  "bfloat16": torch.bfloat16, "int": torch.int32, "long": torch.int64,
                  "bool": torch.bool}


def _read_as_itself(node: torch.fx.Node, gm, mutated) -> Optional[str]:
    """Why a float32 value written in place keeps float32: read through a call that may return
    it (``a = h.float(); h.add_(1)``: a conversion with nothing to convert; a module that returns
    its input), the reader is ``h`` itself in the model and sees the write; from a low ``h``, or
    through a cast, it would be a copy made before it. (Views follow their input's dtype.)"""
    if node not in mutated or len(node.users) < 2:  # (read only through it: the write into
        return None                                 # the copy is the only one, e.g. an
    for user in node.users:                         # attention score's .float().masked_fill_)
        if user.args and user.args[0] is node and may_alias(user, gm) and not is_view(user) \
                and not is_inplace(user, gm):  # (the writer itself: aten.mul_ returns its self)
            return (f"written in place and read through {user.name}, which may be the same "
                    "tensor in the model: keeps float32 so that the write shows there")
    return None


def aliases_written(node: torch.fx.Node, gm, mutated) -> bool:
    """Whether ``node`` may be the storage of a value written in place, or is written through:
    a view of it must keep its dtype, as a cast between them would be a copy (taken before a
    later write, or taking the write through the view)."""
    return bool(node.args) and isinstance(node.args[0], torch.fx.Node) and may_alias(node, gm) \
        and not is_conversion(node) and (node in mutated or node.args[0] in mutated)


def _written_unsafely(order, gm, safety) -> dict:
    """{value: why it keeps float32} for the values an in-place op with a numeric-safety
    finding writes into, itself or through views (``h.view(-1).masked_fill_(m, -1e9)``): the
    op computes in the dtype of what it writes into, so only a float32 value takes that write
    (torch refuses -1e9 into fp16: "value cannot be converted ... without overflow")."""
    out = {}
    for node in order:
        if not (node.args and isinstance(node.args[0], torch.fx.Node) and is_inplace(node, gm)):
            continue
        why = safety(node)
        # (through views and modules that return their input, not a conversion: in a plan
        # that reads a low value it is a copy in the dtype it names, which the write lands in)
        value = alias_base(node.args[0], gm,
                           lambda n: is_inplace(n, gm) or not is_conversion(n))
        if why and value.op in CALLS:
            out.setdefault(value, f"written in place by {node.name}, which needs float32 "
                                  f"({why}): keeps float32 so that the write fits")
    return out


def _hooked_leaf(node: torch.fx.Node, gm: torch.fx.GraphModule, low: torch.dtype
                 ) -> Optional[str]:
    """Why a layer the graph calls whole stays float32, if its forward hooks or pre-hooks make it
    so: the converted module runs them on its calls, and in the model they see float32 tensors
    and may compute in float32 (activation steering's ``out + v``, ``out.float()``); in low
    precision such a hook would hand a float32 value to a reader planned low."""
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    # (torch's own: weight_norm's, spectral_norm's, prune's pre-hooks recompute the weight in
    # its dtype; transformers' keep it too: a pruned model was planned all float32)
    hooks = [h for h in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
             if not (getattr(h, "__module__", None) or type(h).__module__ or "").startswith(
                 ("torch.", "transformers."))]
    if not hooks:
        return None
    names = ", ".join(getattr(h, "__name__", None) or type(h).__name__ for h in hooks[:3])
    return (f"{type(module).__name__} {node.target!r} has forward hooks or pre-hooks ({names}) "
            f"that see float32 tensors in the model and may compute in float32: kept float32, "
            f"as the model runs it (overrides={{{node.target!r}: {dtype_name(low)!r}}} runs it in "
            f"{dtype_name(low)} where the hooks keep the dtype)")


def _torch_module(node: torch.fx.Node) -> str:
    """"nn.linear" for a torch.export node computed inside an nn.Linear (the innermost module
    of its ``nn_module_stack``, one of torch.nn's), "" otherwise: an ``op:nn.Linear`` override
    covers the Linear's aten ops as it covers the module call under torch.fx (it matched none
    in a torch.export graph: probe pC 9)."""
    stack = node.meta.get("nn_module_stack") if node.op == "call_function" else None
    if not stack:
        return ""
    kind = list(stack.values())[-1][1]
    name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
    return f"nn.{name.rpartition('.')[2]}".lower() if name.startswith("torch.nn.") else ""


# the ops the op table knows an ATen packet of by the same name ("gelu": aten.gelu)
_HAS_ATEN = {op for spelling, op in OP_OF_SPELLING.items()
             if isinstance(spelling, torch._ops.OpOverloadPacket) and str(spelling) == f"aten.{op}"}


def _aten_name(node: torch.fx.Node) -> str:
    """"aten.gelu" for a torch.fx node that calls F.gelu ("aten.linear" for an nn.Linear): the
    ATen op torch.export records for the same call, so that an "op:aten.gelu*" key (README's
    form) means the same op under either capture (it matched nothing under torch.fx, and the
    warning said so: probe pM 2). "" for an ATen node, or an op with no ATen packet."""
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ""
    op = table_op_name(node)
    return f"aten.{op}" if op in _HAS_ATEN else ""


def explicit_dtype(node: torch.fx.Node):
    """The dtype the node's own code asks for: a torch.dtype, ('like', node) for ``x.dtype``, or None."""
    if node.op == "call_method" and node.target in _METHOD_DTYPES:
        return _METHOD_DTYPES[node.target]
    for a in list(node.args[1:]) + list(node.kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
        if isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target is getattr \
                and len(a.args) == 2 and a.args[1] == "dtype":
            return ("like", a.args[0])
    return None


_PROMOTING = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor,
              torch.ops.aten.div.Tensor}


def _promotes(node, gm) -> bool:
    """A binary elementwise ATen op whose kernel promotes mixed float inputs to float32 itself
    (used in training, where no exported file has to spell the cast out). Not where an input is
    a 0-dim tensor: type promotion lets a tensor with dimensions decide over it, so a bf16
    activation times a float32 scalar parameter (ReZero, a learned temperature) is bf16, and the
    plan said float32 (a ConversionError in training, probe 41a)."""
    return node.op == "call_function" and node.target in _PROMOTING and not is_inplace(node, gm) \
        and all(isinstance(a, torch.fx.Node) for a in node.args[:2]) \
        and all(isinstance(a.meta.get(TENSOR), TensorInfo) and len(a.meta[TENSOR].shape) > 0
                for a in node.args[:2])


class AssignPrecision(Pass):
    """Decision pass: writes ``mpgraph.precision`` on every node; never edits the graph.

    ``overrides`` maps a key to a dtype ("fp32"/"float32"/torch.float32, "low" or the low dtype,
    and the range dtype where there is one). Keys, most specific first when several match: a node
    name; a module path or glob ("encoder.layer.*.attention.*"); "op:" and a glob over the op
    ("op:nn.Linear", "op:aten.softmax", "op:*gelu*"); "class:" and an op class
    ("class:tensor_core"); "node:" and a node name where a module has that name too. A module
    path covers its submodules. A key that matches no node is a warning naming it. ``from_plan`` maps
    node names to (dtype name, reason) of a saved plan: applied like node-name overrides.
    ``pins`` maps node names to the error the tolerance search attributed to them: float32 over
    any override, as the stated tolerance needs (merged into the overrides, a pin tied with a
    user's glob on a top-level layer and lost, and the search counted it pinned).
    """
    stage = "decide"
    reads, reads_on, writes = (TENSOR, OP_CLASS), ALL_NODES, (PRECISION, ESTIMATE)
    also_reads = (SAFETY, COST, CAST_COST, COST_MODEL)

    def __init__(self, low_dtype: torch.dtype, keep_io_types: bool = True,
                 overrides: Optional[dict] = None, keep_fp32: Optional[str] = None,
                 range_dtype: Optional[torch.dtype] = None, from_plan: Optional[dict] = None,
                 train: bool = False, kernels: Optional[str] = None,
                 pins: Optional[dict] = None):
        self.keep_fp32 = keep_fp32  # a reason to keep every node in float32 (dtype="auto")
        # the target kind whose kernel contracts the plan keeps ("cpu", "gpu", "onnx"; see
        # op_table.KERNEL_KINDS); None: a plan every target's kernels accept
        self.kernels = kernels
        self.low = low_dtype
        # bf16 beside fp16 (dtype="auto" on GPUs with both): for nodes fp16's range keeps out
        self.range_dtype = range_dtype
        self.keep_io_types = keep_io_types
        self.overrides = dict(overrides or {})
        self.from_plan = dict(from_plan or {})
        self.pins = dict(pins or {})
        # training: parameters stay float32 masters, cast once per forward for low readers
        self.train = train
        for key, value in self.overrides.items():
            self._dtype_of(key, value)  # a bad dtype is an error before anything runs

    # -- helpers ---------------------------------------------------------------------------
    def _dtype_of(self, key, value) -> torch.dtype:
        names = {"fp32": FP32, "float32": FP32, FP32: FP32, "low": self.low, self.low: self.low,
                 dtype_name(self.low): self.low, {torch.float16: "fp16", torch.bfloat16: "bf16"}[self.low]: self.low}
        if self.range_dtype is not None:
            names.update({self.range_dtype: self.range_dtype, dtype_name(self.range_dtype): self.range_dtype})
        try:
            return names[value]
        except (KeyError, TypeError):
            raise ValueError(f"override {key!r}: dtype must be float32 or {dtype_name(self.low)}, "
                             f"got {value!r}") from None

    def _override(self, node) -> Optional[tuple[torch.dtype, str]]:
        """(dtype, why) when a saved plan, a tolerance pin or a user override decides this node."""
        if node.name in self.from_plan:
            name, reason = self.from_plan[node.name]
            return self._dtype_of(node.name, name), f"saved plan: {reason.removeprefix('saved plan: ')}"
        # (its module's every name: an alias, self.shared = self.blocks[3], names it too)
        paths, info = module_names(node) - {""}, node.meta[OP_CLASS]
        # (and the op table's name of it, the same under either capture: nn.MaxPool2d under
        # torch.fx and aten.max_pool2d under torch.export are both 'max_pool2d')
        # (and its ATen op's name under torch.fx, as torch.export would record it: aten.gelu)
        ops = {info.key.lower(), target_name(node).lower(), table_op_name(node),
               _torch_module(node), _aten_name(node)}

        def specificity(key: str) -> Optional[tuple[int, int]]:
            if key == f"node:{node.name}" or (key == node.name and key not in self._modules):
                return 0, 0
            # a module path covers the module's own nodes and its submodules' ("layers.0" pins
            # layers.0.fc1 too); of two that match, the deeper one wins ("layers.0.fc1" over it)
            if any(fnmatch.fnmatchcase(p, key) or fnmatch.fnmatchcase(p, key + ".*")
                   for p in paths):
                return 1, -key.count(".")
            if key.startswith("op:") and any(fnmatch.fnmatchcase(o, key[3:].lower()) for o in ops):
                return 2, 0
            if key.startswith("class:") and key[6:] == info.op_class:
                return 3, 0
            return None

        hits = sorted((rank, i, key) for i, key in enumerate(self.overrides)
                      if (rank := specificity(key)) is not None)
        self._matched.update(k for _, _, k in hits)  # (a key a more specific one shadows matched)
        self._ops.add(table_op_name(node))
        key = hits[0][2] if hits else None
        dtype = self._dtype_of(key, self.overrides[key]) if hits else None
        if node.name in self.pins:
            why = f"{PINNED_BY_SEARCH} (attributed error {self.pins[node.name]:.2g})"
            if dtype is not None and dtype != FP32:
                why += f"; over the user override ({key!r}) to {dtype_name(dtype)}"
                log.info("%s: %s", node.name, why)
            return FP32, why
        if not hits:
            return None
        return dtype, f"user override ({key!r})"

    @staticmethod
    def _safety_reason(node, rules=("range", "underflow", "constant", "weight",
                                    "unproven_range", "periodic", "conditioning",
                                    "written_weight", "written_buffer")) -> Optional[str]:
        """The numeric-safety findings (NumericSafety) that keep this node float32, if any."""
        found = [f for f in node.meta.get(SAFETY, ()) if f.rule in rules]
        return "numeric safety: " + "; ".join(f.evidence for f in found) if found else None

    def _range_decision(self, node) -> Optional[Decision]:
        """``range_dtype`` for a node whose every safety finding it clears (bf16 has float32's
        exponent range) and which alone runs faster in low precision than in float32."""
        found = node.meta.get(SAFETY, ())
        if self.range_dtype is None or not found or not all(f.cleared_by for f in found):
            return None
        cost = node.meta.get(COST)
        if cost is None or not cost.t_low < cost.t_fp32:
            return None
        return Decision(self.range_dtype, f"{self._safety_reason(node)}; "
                                          f"{dtype_name(self.range_dtype)} has the range", pinned=True)

    # -- the decision ----------------------------------------------------------------------
    def call(self, gm):
        self._matched: set[str] = set()
        self._ops: set[str] = set()  # the table names of the ops that decide a precision
        # every module path the graph's nodes live in, and its parents: a key that names one is
        # a module key, also where a node has that name (torch.export names the first
        # aten.linear "linear", whichever module calls it; "node:linear" is that node)
        self._modules = {".".join(parts[:i]) for n in gm.graph.nodes for path in module_names(n)
                         for parts in [path.split(".")] if parts != [""]
                         for i in range(1, len(parts) + 1)}
        names = {n.name: module_path(n) for n in gm.graph.nodes}
        for key in self.overrides:
            if key in self._modules and key in names and names[key] != key \
                    and not names[key].startswith(key + "."):
                log.warning("override %r is a module path and also the name of node %r (of "
                            "module %r): applied to the module's nodes; 'node:%s' is the node",
                            key, key, names[key] or "the top level", key)
        order = list(gm.graph.nodes)
        mutated = self._mutated = mutated_nodes(gm.graph, gm)
        self._written_unsafely = _written_unsafely(order, gm, self._safety_reason)
        # Layer/group norms reading low values first try low I/O; one whose readers then want
        # float32 anyway is pinned to float32 and the sweep rerun (at most once per norm).
        self._norms_fp32: set[torch.fx.Node] = set()
        while True:
            dec, stored = self._sweep(order, gm, mutated)
            self._refine(order, gm, dec, stored)
            unwanted = {n for n in order if dec[n].param_dtype is not None
                        and any(required_dtype(u, n, gm, self.keep_io_types, dec.get) == FP32
                                for u in n.users)}
            if not unwanted:
                break
            self._norms_fp32 |= unwanted
        self._decide_stored(order, gm, dec, stored)
        for node in order:
            node.meta[PRECISION] = dec[node]
        warned = _UNMATCHED_WARNED.setdefault(gm, set())
        for key in self.overrides:
            if key not in self._matched and key not in warned:
                warned.add(key)
                log.warning("override %r matched no node that decides a precision (keys: node "
                            "names, 'node:<name>', module paths or globs, 'op:<glob>', "
                            "'class:<op class>')%s", key, self._ops_named(key))
        self._estimate(gm)
        return PassResult(gm, False)

    def _ops_named(self, key: str) -> str:
        """For an unmatched "op:" key, the ops there are, by the names that match under either
        capture (the user does not choose the capture, nor see it before the warning)."""
        ops = sorted(self._ops - {""})
        if not key.startswith("op:") or not ops:
            return ""
        return (f"; the graph's ops, by the names an 'op:' key takes under either capture: "
                f"{', '.join(ops[:12])}{', ...' if len(ops) > 12 else ''}")

    def _estimate(self, gm) -> None:
        """The plan's time by the cost model: each node at its decided dtype, one cast for each
        value and dtype its readers need. What a rules plan's summary states (before, it stated
        what the dtype choice's optimal plan would take); the optimal pass replaces it with its
        cut's exact total."""
        gm.meta.pop(ESTIMATE, None)
        if COST_MODEL not in gm.meta:
            return
        fp32_s = plan_s = 0.0
        for n in gm.graph.nodes:
            cost, d = n.meta.get(COST), n.meta[PRECISION]
            if cost is not None:
                fp32_s += cost.t_fp32
                plan_s += cost.t_fp32 if d.dtype in (None, FP32) else cost.t_low
        for v in gm.graph.nodes:
            have, cast = v.meta[PRECISION], v.meta.get(CAST_COST)
            if cast is None or have.dtype is None or (have.stored and v.op == "get_attr"):
                continue
            needs = {required_dtype(u, v, gm, self.keep_io_types) for u in v.users}
            plan_s += sum(cast[1] if need == FP32 else cast[0]
                          for need in needs - {None, have.dtype})
        gm.meta[ESTIMATE] = {"target": gm.meta[COST_MODEL]["target"], "fp32_s": fp32_s,
                             "plan_s": plan_s, "source": gm.meta[COST_MODEL]["source"]}

    def _cache(self, node, gm) -> Optional[str]:
        """Why a buffer written in place can be stored low (a KV cache: inference, written only
        by stores, no safety finding on what is written), or None: it keeps its dtype."""
        writers = stored_into_only(node, gm)
        if self.train or self.keep_fp32 or not writers \
                or any(w.meta.get(SAFETY) for w in writers):
            return None
        # an override of the buffer or of what writes it ("key_cache_0", "*", "op:index_copy*")
        # to float32 keeps it float32: each (dtype, why) is also the override's match
        pinned = [o for o in map(self._override, [node, *writers]) if o is not None]
        if any(dtype == FP32 for dtype, _ in pinned):
            return None
        return (f"a cache written only by stores ({', '.join(sorted({target_name(w) for w in writers}))}"
                f"): stored in {dtype_name(self.low)}, each write cast to it once")

    def _sweep(self, order, gm, mutated):
        """One forward pass over the graph: every node's decision from its inputs' decisions."""
        dec: dict[torch.fx.Node, Decision] = {}
        stored: set[torch.fx.Node] = set()
        convertible = (FP32, self.low) + ((self.range_dtype,) if self.range_dtype else ())
        for node in order:
            info = node.meta[TENSOR]
            if node.op == "placeholder":
                dec[node] = Decision(FP32, "graph input keeps its dtype", pinned=True) \
                    if is_float32_tensor(info) else Decision(None, "not a float32 tensor")
            elif node.op == "get_attr":
                cache = self._cache(node, gm) if is_float32_tensor(info) and node in mutated \
                    else None
                if cache:
                    dec[node] = Decision(self.low, cache, pinned=True)
                elif is_float32_tensor(info) and node in mutated:
                    dec[node] = Decision(FP32, "buffer written in place: keeps its dtype", pinned=True)
                elif is_float32_tensor(info) and self.train:
                    dec[node] = Decision(FP32, "float32 master weight (training): cast once per "
                                               "forward, shared by its low-precision readers",
                                         pinned=True)
                elif is_float32_tensor(info):
                    stored.add(node)
                    dec[node] = Decision(None, "parameter: stored in the dtype its readers need",
                                         stored=True)
                else:
                    dec[node] = Decision(None, "not a float32 tensor")
            elif node.op == "output":
                dec[node] = Decision(None, "graph output")
            else:
                dec[node] = self._decide(node, gm, dec, stored, convertible)
        return dec, stored

    def _decide(self, node, gm, dec, stored, convertible) -> Decision:
        if is_export_guard(node):
            return Decision(None, "torch.export's input guard: checks the inputs' shapes, "
                                  "computes nothing of the model's")
        op_info = node.meta[OP_CLASS]
        cls = op_info.op_class
        inputs = input_nodes(node)
        runtime = [a for a in inputs if a not in stored and is_float32_tensor(a.meta[TENSOR])
                   and dec[a].dtype in convertible]
        touches = is_float32_tensor(node.meta[TENSOR]) or runtime \
            or any(a in stored for a in inputs)
        if not touches:
            return Decision(None, "no float32 tensors")

        if self.keep_fp32:
            self._override(node)  # (a key that matches is not warned about as matching nothing)
            return Decision(FP32, self.keep_fp32, pinned=True)
        forced, why = self._override(node) or (None, "")
        # an item of a multi-output op (chunk, split, max) is that op's output as it is, in its
        # dtype: a cast of one item is a decision about the op or about the item's readers
        item = node.target is operator.getitem and inputs and inputs[0] not in stored \
            and isinstance(inputs[0].meta.get(TENSOR), (tuple, list)) \
            and is_float32_tensor(node.meta[TENSOR])
        if forced is not None and item and dec[inputs[0]].dtype != forced:
            made = dec[inputs[0]].dtype
            # (a saved plan's items follow an edit of their op without a word)
            if node.name not in self.from_plan or "edited to" in self.from_plan[node.name][1]:
                log.warning("%s: %s to %s not applied: an item of %s comes out in its dtype (%s); "
                            "decide %s or the item's readers instead", node.name, why,
                            dtype_name(forced), inputs[0].name, dtype_name(made), inputs[0].name)
            return Decision(made, f"an item of {inputs[0].name}, in its dtype ({why} to "
                                  f"{dtype_name(forced)} not applied)", pinned=True)
        kept = (self._written_unsafely.get(node) or _read_as_itself(node, gm, self._mutated)) \
            if is_float32_tensor(node.meta[TENSOR]) else None
        if kept:
            if forced == self.low:
                log.warning("%s: %s to %s refused: %s", node.name, why, dtype_name(self.low), kept)
            return Decision(FP32, kept, pinned=True)
        safety = self._safety_reason(node) if forced == self.low else None
        if safety:
            log.warning("%s: %s to %s refused: %s", node.name, why, dtype_name(self.low), safety)
            return Decision(FP32, f"{safety} ({why} to {dtype_name(self.low)} refused)", pinned=True)
        if forced is not None:
            if node.name in self.from_plan:  # a saved plan's dtype: how the rules would read it
                saved = self.from_plan.pop(node.name)
                try:  # (a low norm's float32 parameters: cast, the batch statistics it writes
                    # would land in a copy and be lost; promotion in training's kernels)
                    natural = self._decide(node, gm, dec, set(stored), convertible)
                finally:  # (a copy of stored: a parameter-only node the plan decides stays out)
                    self.from_plan[node.name] = saved
                if natural.dtype == forced and not natural.stored:
                    return dataclasses.replace(natural, reason=why, pinned=True)
            return Decision(forced, why, pinned=True)
        region = fp32_region(node)
        if region is not None and not item:  # (an item: its readers in the region are float32)
            return Decision(FP32, f"in the model's {region} region: float32, as its author "
                                  "keeps it", pinned=True)

        hooked = _hooked_leaf(node, gm, self.low)
        if hooked and not item:
            return Decision(FP32, hooked, pinned=True)

        if node.args and isinstance(node.args[0], torch.fx.Node) and is_inplace(node, gm):
            self_dtype = dec[node.args[0]].dtype
            if self_dtype in convertible:
                reason = f"in place on a {dtype_name(self_dtype)} value"
                if cls != FOLLOW and self_dtype != FP32:
                    reason += f" (its class {cls} asks for float32, but it writes into a low value)"
                    log.warning("%s: %s", node.name, reason)
                return Decision(self_dtype, reason, pinned=True)

        asked = explicit_dtype(node) if cls in (CAST, FOLLOW) else None
        if cls == CAST or (cls == FOLLOW and isinstance(asked, torch.dtype) and "dtype" in node.kwargs):
            if isinstance(asked, torch.dtype):
                out = FP32 if is_float32_tensor(node.meta[TENSOR]) else None
                return Decision(out, f"explicit cast to {dtype_name(asked)} in the model", pinned=True,
                                reads_any=True)
            if isinstance(asked, tuple):
                like = dec[asked[1]].dtype
                return Decision(like, f"casts to the dtype of {asked[1].name}", pinned=True,
                                reads_any=True)
            first = dec[inputs[0]].dtype if inputs else None
            return Decision(first, "dtype-preserving conversion (device/layout)", pinned=True,
                            reads_any=True)

        if cls == TENSOR_CORE:
            why = self._safety_reason(node)
            if why:
                return self._range_decision(node) or Decision(FP32, why, pinned=True)
            return Decision(self.low, op_info.reason)
        activations = [a for a in runtime if a.op != "get_attr"]  # training: weights are runtime
        if op_info.low_io and activations and node not in self._norms_fp32 \
                and all(dec[a].dtype == self.low for a in activations) \
                and not self._safety_reason(node, rules=("range", "underflow", "periodic")):
            low = dtype_name(self.low)
            if mixed_params_ok(op_info.low_io, self.kernels):
                return Decision(self.low, f"reads and writes {low}, computes in float32 inside "
                                          "with float32 parameters (the values of casting around "
                                          "it, without the casts)", param_dtype=FP32)
            # the target's kernel wants the parameters in the input's dtype (CUDA's layer norm):
            # stored low, as autocast-free fp16 models do; the statistics stay float32 inside
            if not self._safety_reason(node, rules=("weight",)):
                return Decision(self.low, f"reads and writes {low}, computes in float32 inside "
                                          f"with {low} parameters (the {self.kernels or 'portable'} "
                                          f"kernel takes no float32 parameters with a {low} input)",
                                param_dtype=self.low)
        if cls != FOLLOW:  # fp32_compute, fp32_only, unknown
            why = self._safety_reason(node, rules=("unproven_range", "periodic"))
            in_range_dtype = self._range_decision(node) if why else None
            if in_range_dtype:  # exp/pow: follow ops in bf16
                return in_range_dtype
            return Decision(FP32, f"{op_info.reason}; {why}" if why else op_info.reason, pinned=True)

        # follow
        if inputs and all(a in stored for a in inputs):
            if node in self._mutated:
                # (stored, it took each reader's dtype: a low clone for F.linear, a float32
                # view of it for the write, which then landed in a cast copy)
                return Decision(FP32, "computed from parameters only, then written in place (a "
                                      "pruned w = weight.clone()): float32 at run time, as in "
                                      "the model, each low reader's cast after the write",
                                pinned=True)
            stored.add(node)
            return Decision(None, "computed from parameters only: takes its readers' dtype",
                            stored=True)
        if not runtime:
            return Decision(FP32, "no low-precision input: stays float32")
        kinds = {dec[a].dtype for a in runtime}
        # the model's own values in another float dtype beside ours (a bf16 base model's Linear
        # added to a float32 LoRA branch planned fp16: torch promotes bf16 with fp16 to float32;
        # a float64 scale: float64): the node cannot compute in ours
        theirs = {info.dtype for a in inputs if a not in stored and a not in runtime
                  and isinstance(info := a.meta.get(TENSOR), TensorInfo) and info.shape != ()
                  and info.dtype.is_floating_point and info.dtype != FP32  # (0-dim: takes ours)
                  and torch.promote_types(info.dtype, self.low) != self.low}
        if theirs:
            own = "/".join(sorted(dtype_name(d) for d in theirs))
            made = "/".join(sorted({dtype_name(torch.promote_types(d, self.low)) for d in theirs}))
            return Decision(FP32, f"reads the model's own {own} value: with "
                                  f"{dtype_name(self.low)} inputs torch computes it in {made} "
                                  "(type promotion): not planned low")
        if op_info.params_as_values and any(a in stored for a in inputs):
            return Decision(FP32, "adds or joins a float32 parameter to activations (a position "
                                  "embedding, a class token): stays float32")
        if kinds != {self.low}:
            other = "/".join(sorted(dtype_name(k) for k in kinds - {self.low}))
            if self.train and self.low in kinds and _promotes(node, gm):
                return Decision(FP32, f"reads a {other} input: stays float32; reads its "
                                      f"{dtype_name(self.low)} inputs as they are (type promotion "
                                      "in the kernel, exact, no cast kernel)", promotes=True)
            return Decision(FP32, f"reads a {other} input: stays float32")
        why = self._safety_reason(node)
        if why:
            return self._range_decision(node) or Decision(FP32, why, pinned=True)
        return Decision(self.low, f"all float inputs are {dtype_name(self.low)}")

    def _refine(self, order, gm, dec, stored) -> None:
        """Move low follow ops to float32 where that removes a cast and adds none."""
        def need(consumer, producer):
            return required_dtype(consumer, producer, gm, self.keep_io_types, dec.get)

        changed = True
        while changed:
            changed = False
            for node in reversed(order):
                d = dec[node]
                if node.op not in CALLS or d.pinned or d.stored or d.dtype != self.low \
                        or node.meta[OP_CLASS].op_class != FOLLOW \
                        or aliases_written(node, gm, self._mutated):
                    continue
                needs = [need(u, node) for u in node.users]
                if FP32 not in needs or self.low in needs:
                    continue
                low_inputs = [a for a in input_nodes(node) if a not in stored
                              and is_float32_tensor(a.meta[TENSOR]) and dec[a].dtype == self.low]
                if all(any(need(u, a) == FP32 for u in a.users if u is not node) for a in low_inputs):
                    dec[node] = Decision(FP32, "readers are float32 and its inputs already have "
                                               "float32 casts: one cast fewer in float32")
                    changed = True

    def _decide_stored(self, order, gm, dec, stored) -> None:
        """Values computed from parameters alone take the dtype their readers need."""
        for node in reversed(order):
            if node not in stored or node.op == "get_attr":
                continue
            # a multi-output op's items (chunk(in_proj_weight, 3)[i]) come out in its dtype,
            # with no cast between: what the items' readers need is what the op's readers need;
            # items read in float32 and in low precision keep float32 (the low readers' cast
            # then runs per call: a float32 reader never gets a rounded weight)
            items = [u for u in node.users if u.op == "call_function"
                     and u.target is operator.getitem and u in stored]
            needs = {required_dtype(u, node, gm, self.keep_io_types, dec.get)
                     for u in node.users if u not in items} | {dec[u].dtype for u in items}
            mixed = items and {self.low, FP32} <= needs
            dtype = self.low if self.low in needs and not mixed else FP32
            dec[node] = Decision(dtype, f"computed from parameters only: {dtype_name(dtype)} for its "
                                        "readers", stored=True)
            for item in items:
                dec[item] = Decision(dtype, f"an item of {node.name}, computed from parameters "
                                            f"only: {dtype_name(dtype)} as it is", stored=True)
