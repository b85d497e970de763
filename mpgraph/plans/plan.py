"""The Plan: the record of every precision decision, every cast and every stored weight.

It is what ``convert(...).plan`` carries, what reports show and what the ONNX export must
reproduce. Built from the converted graph's meta, so it cannot drift from what runs.
"""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.fx

from mpgraph.ir.graph import module_path, target_name
from mpgraph.ir.meta import (CAPTURE, CHECK, COST, ESTIMATE, INSERTED_BY, OP_CLASS, PRECISION,
                             RANGE, SAFETY, STATIC_SHAPES, TENSOR, TC_FINDING, TensorInfo, WEIGHTS,
                             WeightRecord, cast_source, dtype_name, is_inserted_cast,
                             planned_dtype, shape_of)


@dataclass(frozen=True)
class NodeRecord:
    name: str
    op: str
    target: str
    module: str
    op_class: str
    dtype: Optional[str]
    reason: str
    t_fp32: Optional[float] = None   # estimated seconds on the target, in float32
    t_low: Optional[float] = None    # ... and in the low dtype
    tensor_core: str = ""            # Tensor Core alignment finding for matmuls and convs
    safety: tuple[str, ...] = ()     # numeric-safety findings ("rule: evidence") keeping it float32
    absmax: Optional[float] = None   # calibrated absmax of its output
    inputs: tuple[str, ...] = ()     # the nodes it reads (through our casts), for pictures
    shape: Optional[tuple[int, ...]] = None  # output shape at the example inputs
    flops: Optional[float] = None    # estimated FLOPs per run
    kind: str = ""                   # the op-table key it matched: "nn.Linear", "aten.softmax", ...
    inserted_by: str = ""            # the pass that added it (not the model's own op), if one did


@dataclass(frozen=True)
class CastRecord:
    name: str
    value: str
    src: str
    dst: str
    consumers: tuple[str, ...]
    numel: int
    inserted_by: str
    items: int = 1  # the tensors it converts: a multi-output value's float items (cast_leaves)


@dataclass
class Plan:
    dtype: torch.dtype
    capture: str
    keep_io_types: bool
    target: str = ""
    strategy: str = ""
    kept_fp32: Optional[str] = None  # why everything stayed float32 (dtype="auto"), if it did
    # an explicit dtype that converted little of the matmul/conv work: why, and the way out
    # (also a UserWarning from convert, and the summary's first line)
    warning: Optional[str] = None
    # calibration data that does not represent real inputs (constant inputs; one batch for an
    # fp16 plan, whose overflow rules rest on the ranges it saw): why, and the way out (also a
    # UserWarning from convert, and a line of the summary)
    calibration_warning: Optional[str] = None
    estimate: dict = field(default_factory=dict)  # {"fp32_s", "plan_s"} on the target
    nodes: list[NodeRecord] = field(default_factory=list)
    casts: list[CastRecord] = field(default_factory=list)
    weights: list[WeightRecord] = field(default_factory=list)
    # the model's own dtype conversions (``x.float()``, ``.to(dtype)``) that change a float dtype
    # in the converted graph: not ours, but an exported file contains them too
    model_casts: list[CastRecord] = field(default_factory=list)
    order: list[str] = field(default_factory=list, repr=False)  # node names in graph order
    calibration_batches: int = 0     # batches the value ranges were calibrated on
    # the tolerance search's report: tolerance, error, pinned [(node, attributed error)],
    # rounds, estimated seconds before/after pinning (the speed given up); None without one
    tolerance: Optional[dict] = None
    mode: str = "inference"          # or "train": float32 master weights, cast once per forward
    # the value check: {"error": relative L2 of the outputs vs float32 on the first calibration
    # batch, "bound": what a plan in this dtype may have}; with "error" None and "skipped" (why)
    # when only dtypes were (a large plan for another device); None when not checked (check=False, meta)
    check: Optional[dict] = None
    # how the low dtype was chosen when none was named: {"candidates": [...], "estimates_s":
    # {dtype: the cost-optimal plan's estimated seconds}}; None where the dtype was named
    dtype_choice: Optional[dict] = None
    # nodes whose "dtype" a hand edit of the saved file changed: {name: the dtype it was decided
    # in}. The casts, weights, estimate and check above are those of the plan before the edit
    edited: dict = field(default_factory=dict)
    # the model's own low dtype where its parameters are low (loaded in bf16; or a bf16 base
    # model with float32 LoRA adapters: "bfloat16 where its parameters are (6 of 10)"), as the
    # summary says it: those parts compute as the model has them, and the check compares with
    # the model as it computes, not float32
    computes_in: Optional[str] = None
    # the grad mode the model was captured in, where a saved plan is applied again: torch.export
    # keeps a forward's no_grad region as one node with gradients on and inlines it with them
    # off, and torch.fx sees such a region only with them on (None: a plan saved before it)
    grad_enabled: Optional[bool] = None

    @classmethod
    def from_graph(cls, gm: torch.fx.GraphModule, dtype: torch.dtype, keep_io_types: bool = True,
                   target: str = "", strategy: str = "", kept_fp32: Optional[str] = None,
                   mode: str = "inference", tolerance: Optional[dict] = None,
                   dtype_choice: Optional[dict] = None) -> "Plan":
        capture = gm.meta.get(CAPTURE, "unknown")
        if gm.meta.get(STATIC_SHAPES):
            capture += " at the example's shapes"
        plan = cls(dtype=dtype, capture=capture, keep_io_types=keep_io_types,
                   weights=list(gm.meta.get(WEIGHTS, [])), target=target, strategy=strategy,
                   kept_fp32=kept_fp32, estimate=dict(gm.meta.get(ESTIMATE, {})),
                   check=dict(gm.meta[CHECK]) if gm.meta.get(CHECK) else None, mode=mode,
                   tolerance=tolerance, dtype_choice=jsonable(dtype_choice))
        plan.order = [n.name for n in gm.graph.nodes]
        for node in gm.graph.nodes:
            decision = node.meta.get(PRECISION)
            if is_inserted_cast(node):
                info = node.args[0].meta.get(TENSOR)
                plan.casts.append(CastRecord(
                    name=node.name, value=node.args[0].name,
                    src=dtype_name(node.args[0].meta[PRECISION].dtype),
                    dst=dtype_name(decision.dtype),
                    consumers=tuple(u.name for u in node.users),
                    numel=_float32_numel(info),
                    inserted_by=node.meta[INSERTED_BY],
                    items=len(_float32_infos(info)) if isinstance(info, tuple) else 1))
                continue
            if node.meta.get(INSERTED_BY) == "StoreWeights":
                continue  # low-precision weight copies: listed under weights
            op_info = node.meta.get(OP_CLASS)
            model_cast = _model_cast(node)
            if model_cast is not None:
                plan.model_casts.append(model_cast)
            cost = node.meta.get(COST)
            finding = node.meta.get(TC_FINDING)
            plan.nodes.append(NodeRecord(
                name=node.name, op=node.op, target=target_name(node), module=module_path(node),
                op_class=op_info.op_class if op_info else "unknown",
                dtype=dtype_name(decision.dtype) if decision else None,
                reason=decision.reason if decision else "",
                t_fp32=cost.t_fp32 if cost is not None else None,
                t_low=cost.t_low if cost is not None else None,
                tensor_core=finding.text if finding is not None else "",
                safety=tuple(f"{f.rule}: {f.evidence}" for f in node.meta.get(SAFETY, ())),
                absmax=rng.absmax if (rng := node.meta.get(RANGE)) is not None else None,
                inputs=tuple(cast_source(a).name for a in node.all_input_nodes),
                shape=shape_of(node.meta.get(TENSOR)),
                flops=cost.flops if cost is not None else None,
                kind=op_info.key if op_info else "",
                inserted_by=node.meta.get(INSERTED_BY) or ""))
        plan.calibration_batches = int(gm.meta.get(RANGE, 0))
        return plan

    @classmethod
    def of(cls, obj, who: str = "this") -> "Plan":
        """The plan of a converted module, or a Plan itself; anything else is a TypeError."""
        plan = getattr(obj, "plan", obj)
        if not isinstance(plan, cls):
            raise TypeError(f"{who} expects a converted module or a Plan, got {type(obj).__name__}")
        return plan

    # -- saving and loading ----------------------------------------------------------------
    def save(self, path) -> None:
        """Write the plan as JSON (``Plan.load`` reads it; ``convert(..., plan=)`` applies it)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> "Plan":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no plan file at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a plan: invalid JSON ({e})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not a plan: not a text (UTF-8 JSON) file") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "the data") -> "Plan":
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(f"{source} is not an mpgraph plan (format {PLAN_FORMAT!r} expected)")
        _validate(data, source)

        edited = {}

        def node(d):
            d = dict(d)
            decided = d.pop("decided", d.get("dtype"))
            if d.get("dtype") != decided:  # edited by hand: its reason was for the other dtype
                edited[d["name"]] = decided
                if not d.get("reason", "").startswith("edited to "):
                    d["reason"] = f"edited to {d.get('dtype')} (decided {decided}: {d.get('reason')})"
            for key in ("safety", "inputs"):
                d[key] = tuple(d.get(key) or ())
            d["shape"] = tuple(d["shape"]) if d.get("shape") is not None else None
            return NodeRecord(**d)

        plan = cls(dtype=getattr(torch, data["dtype"]), capture=data["capture"],
                   keep_io_types=data["keep_io_types"], target=data["target"],
                   strategy=data["strategy"], kept_fp32=data.get("kept_fp32"),
                   warning=data.get("warning"),
                   calibration_warning=data.get("calibration_warning"),
                   estimate=dict(data.get("estimate") or {}),
                   nodes=[node(d) for d in data["nodes"]],
                   casts=[CastRecord(**{**c, "consumers": tuple(c["consumers"])}) for c in data["casts"]],
                   weights=[_weight(w, source) for w in data["weights"]],
                   model_casts=[CastRecord(**{**c, "consumers": tuple(c["consumers"])})
                                for c in data.get("model_casts", [])],
                   order=list(data.get("order", [])),
                   calibration_batches=data.get("calibration_batches", 0),
                   tolerance=data.get("tolerance"), mode=data.get("mode", "inference"),
                   check=data.get("check"), dtype_choice=data.get("dtype_choice"),
                   edited=edited, computes_in=data.get("computes_in"),
                   grad_enabled=data.get("grad_enabled"))
        return plan

    def cast_sequence(self) -> list[CastRecord]:
        """Every float-to-float conversion of the converted graph, ours and the model's, in
        graph order: what an exported file must contain, one Cast each."""
        order = {name: i for i, name in enumerate(self.order)}
        return [c for c in sorted(self.casts + self.model_casts, key=lambda c: order.get(c.name, 0))
                for _ in range(c.items)]  # (a multi-output value's cast: a Cast per item)

    # -- queries ---------------------------------------------------------------------------
    def node(self, name: str) -> NodeRecord:
        """The record of node ``name`` (an index by name, rebuilt when the records change)."""
        key = (id(self.nodes), len(self.nodes))
        if getattr(self, "_index_key", None) != key:
            self._index = {r.name: r for r in self.nodes}
            self._index_key = key
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no node {name!r} in the plan") from None

    @property
    def range_nodes(self) -> list[NodeRecord]:
        """Nodes in a second low dtype (bf16 beside fp16, dtype="auto"): fp16's range excluded them."""
        low = dtype_name(self.dtype)
        return [r for r in self.compute_nodes if r.dtype not in (None, "float32", low)]

    @property
    def safety_nodes(self) -> list[NodeRecord]:
        """Float32 nodes with numeric-safety findings (``safety`` says which rules and why)."""
        return [r for r in self.nodes if r.dtype == "float32" and r.safety]

    @property
    def compute_nodes(self) -> list[NodeRecord]:
        """Call nodes that touch float32 values: the ones a precision was chosen for (not the
        layout copies and clamps mpgraph adds, which compute nothing of the model's: counted,
        a CNN's node count changed with its batch size)."""
        return [r for r in self.nodes if r.op.startswith("call_") and r.dtype is not None
                and r.inserted_by not in _BOOKKEEPING]

    @property
    def low_nodes(self) -> list[NodeRecord]:
        low = dtype_name(self.dtype)
        return [r for r in self.compute_nodes if r.dtype == low]

    @property
    def headline_dtype(self) -> str:
        """The plan's low dtype, or float32 where it converted nothing (a plan keeps a low dtype
        even then: the one it was asked for or would have chosen); the report and diff head it so."""
        return dtype_name(self.dtype) if self.low_nodes or self.range_nodes or self.weights \
            else "float32"

    @property
    def unknown_nodes(self) -> list[NodeRecord]:
        return [r for r in self.compute_nodes if r.op_class == "unknown"]

    def summary(self) -> str:
        low = dtype_name(self.dtype)
        stored = sum(w.numel for w in self.weights)
        text = "".join(f"warning: {w}\n" for w in (self.warning, self.calibration_warning) if w)
        if self.edited:
            shown = ", ".join(f"{n} {d} -> {self.node(n).dtype}" for n, d in
                              list(self.edited.items())[:3])
            more = f" and {len(self.edited) - 3} more" if len(self.edited) > 3 else ""
            text += (f"edited by hand: {shown}{more}; the casts, weights, estimate and check "
                     "below are the plan's before the edit (convert(model, inputs, plan=this) "
                     "makes and checks the edited plan)\n")
        kinds = sorted({dtype_name(w.dtype) for w in self.weights}) or [low]
        all_fp32 = bool(self.compute_nodes) and not (self.low_nodes or self.casts or self.weights)
        # a model that computes in fp16/bf16 itself: none of its nodes has a float32 value (it
        # said "converted 0/0 nodes", "vs float32 (all float32)")
        ops = sum(r.op_class not in ("input", "output") for r in self.nodes)
        if (not self.compute_nodes or (self.computes_in and not self.low_nodes)) and ops:
            own = (f"it computes in {self.computes_in} (the "
                   f"{len(self.compute_nodes)} of its {ops} nodes that compute in float32 kept "
                   "there; " if self.compute_nodes else
                   f"none of its {ops} nodes computes in float32 (")
            text += (f"kept the model's own dtypes: {own}no casts, no weight stored); captured "
                     f"with {self.capture}")
            if self.check and self.check.get("error") is not None:
                text += (f"; checked: error {self.check['error']:.2g} vs the model as it "
                         "computes")
            return text
        text += (f"kept all {len(self.compute_nodes)} nodes in float32 (no casts, no weight stored "
                 "low); " if all_fp32 else
                 f"converted {len(self.low_nodes)}/{len(self.compute_nodes)} nodes to {low} "
                 f"with {len(self.casts)} casts; {len(self.weights)} weights "
                 f"({stored / 1e6:.2f}M values) stored as {' and '.join(kinds)}; ")
        text += f"captured with {self.capture}"
        if self.kept_fp32:
            text += f"; kept float32: {self.kept_fp32}"
        if self.mode == "train":
            text += "; training: float32 master weights, cast once per forward"
        if self.range_nodes:  # the range rule's, and the ones an override or an edit put there
            by_range = [r for r in self.range_nodes if r.reason.endswith(" has the range")]
            if by_range:
                text += f"; {len(by_range)} nodes in {by_range[0].dtype} where {low} overflows"
            if len(by_range) < len(self.range_nodes):
                text += (f"; {len(self.range_nodes) - len(by_range)} nodes in "
                         f"{self.range_nodes[0].dtype} by overrides or edits")
        if self.safety_nodes:
            text += (f"; {len(self.safety_nodes)} float32 node{'s' if len(self.safety_nodes) > 1 else ''}"
                     " with numeric-safety findings "
                     + (f"(calibrated on {self.calibration_batches} batch"
                        f"{'es' if self.calibration_batches != 1 else ''})"
                        if self.calibration_batches else
                        "(not calibrated: planned without values, on the meta device)"))
        if self.check and self.check.get("error") is None:
            text += "; dtypes checked, " + self.check.get("skipped", "values not checked")
        elif self.check and self.check.get("bound") is None:  # (no node low)
            text += (f"; checked: error {self.check['error']:.2g} vs "
                     + ("the model as it computes" if self.computes_in else
                        "float32 (all float32)"))
        elif self.check:
            text += (f"; checked: error {self.check['error']:.2g} vs "
                     f"{'the model as it computes' if self.computes_in else 'float32'} (bound "
                     f"{self.check['bound']:.2g})")
            differ = self.check.get("discrete") or {}
            if differ:
                text += ("; integer/bool outputs: " + ", ".join(
                    f"{_percent(d)}% of output {i}'s values" for i, d in differ.items()) +
                    " differ from float32's")
        if self.tolerance:
            t = self.tolerance
            text += (f"; tolerance {t['tolerance']:g}: error {t['error']:.3g} with "
                     f"{len(t['pinned'])} nodes pinned to float32")
        plan_s = self.estimate.get("plan_s", 0)
        if "plan_s" in self.estimate and not all_fp32 and (plan_s is None or math.isinf(plan_s)):
            # (a low dtype this CPU emulates, forced with strategy="rules": never timed)
            text += (f"; no speed estimate: {low} is emulated on this {self.target} and was not "
                     "timed (slower than float32 here; without dtype= the plan keeps float32)")
        elif self.estimate.get("plan_s") and not all_fp32:  # (all float32: 1.00x, said above)
            source = self.estimate.get("source")
            what = " of the forward, priced without autograd (the backward is not)" \
                if self.mode == "train" else ""
            text += (f"; estimated {self.estimate['fp32_s'] / self.estimate['plan_s']:.2f}x float32 "
                     f"speed{what} on {self.target} ({self.strategy}"
                     + (f"; {source}" if source else "") + ")")
        if self.dtype_choice and self.low_nodes:  # (none low: no low dtype was chosen)
            estimates = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in
                                  self.dtype_choice.get("estimates_s", {}).items())
            if self.tolerance and self.tolerance.get("pinned"):  # (the choice came first)
                estimates = f"before the tolerance search's pins: {estimates}"
            fallback = self.dtype_choice.get("fallback")
            named = self.dtype_choice.get("named_by")
            text += (f"; {dtype_name(self.dtype)} because {fallback} (the cost model estimated "
                     f"{estimates})" if fallback else
                     f"; {dtype_name(self.dtype)} named by {named} (estimated {estimates})"
                     if named else
                     f"; float16 as on every GPU, not the estimate's choice ({estimates}): its "
                     "Tensor Cores run fp16 at bf16's rate with 3 more mantissa bits, bf16 beside "
                     "it where fp16's range keeps a node out; dtype='bf16' plans with bf16"
                     if self.dtype_choice.get("rule") == "gpu_fp16" else
                     f"; {dtype_name(self.dtype)} chosen by the cost model (estimated {estimates})")
        misaligned = [r for r in self.nodes if r.tensor_core.startswith("eligible but misaligned")]
        if misaligned:
            text += (f"; {len(misaligned)} matmul{'s' if len(misaligned) > 1 else ''} misaligned "
                     "for Tensor Cores")
        off = [r for r in self.nodes if r.tensor_core.startswith("not on Tensor Cores")]
        if off:  # (a depthwise conv, a dtype the GPU has no Tensor Cores for): padding is no fix
            text += f"; {len(off)} matmul{'s' if len(off) > 1 else ''} not on Tensor Cores"
        if self.unknown_nodes:
            names = ", ".join(sorted({r.target for r in self.unknown_nodes}))
            many = len(self.unknown_nodes) > 1
            text += (f"; {len(self.unknown_nodes)} node{'s' if many else ''} of unknown "
                     f"op{'s' if many else ''} kept in float32 ({names})")
        return text

    def format_casts(self) -> str:
        if not self.casts:
            return "no casts"
        rows = [f"{'cast':<32} {'value':<28} {'from->to':<20} {'elements':>10}  readers"]
        for c in self.casts:
            rows.append(f"{c.name:<32} {c.value:<28} {c.src + '->' + c.dst:<20} {c.numel:>10}  "
                        f"{', '.join(c.consumers)}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        """The plan as JSON-ready data: what ``report(format="json")`` and ``save`` write."""
        return {
            "format": PLAN_FORMAT,
            "dtype": dtype_name(self.dtype), "capture": self.capture,
            "keep_io_types": self.keep_io_types, "target": self.target, "strategy": self.strategy,
            "kept_fp32": self.kept_fp32, "warning": self.warning, "computes_in": self.computes_in,
            "calibration_warning": self.calibration_warning, "estimate": jsonable(self.estimate),
            "summary": self.summary(),
            "mode": self.mode, "grad_enabled": self.grad_enabled,
            "calibration_batches": self.calibration_batches, "check": jsonable(self.check),
            "dtype_choice": jsonable(self.dtype_choice),
            "tolerance": jsonable(self.tolerance),
            # "decided": the dtype its reason is for (a hand edit of "dtype" leaves it)
            "nodes": [jsonable({**asdict(r), "decided": self.edited.get(r.name, r.dtype)})
                      for r in self.nodes],
            "casts": [jsonable(asdict(c)) for c in self.casts],
            "model_casts": [jsonable(asdict(c)) for c in self.model_casts],
            # (a weight is stored in its readers' dtype: "decided" tells an edit of it apart)
            "weights": [{**asdict(w), "dtype": dtype_name(w.dtype), "decided": dtype_name(w.dtype)}
                        for w in self.weights],
            "order": list(self.order),
        }


# passes whose nodes carry a value as it is (a layout, a clamp to the low dtype's range)
_BOOKKEEPING = ("ChannelsLast", "InsertCasts (saturate)")
PLAN_FORMAT = "mpgraph-plan-1"
LOW_DTYPES = ("float16", "bfloat16")
NODE_DTYPES = (None, "float32") + LOW_DTYPES
MODES = ("inference", "train")


# records of nodes whose dtype no plan decides: why, and the way out (an edit of one was dropped)
_IO = ("Convert without plan= and with keep_io_types=False for outputs in the low dtype "
       "(mpgraph.convert(model, inputs, dtype=..., keep_io_types=False)), or edit the \"dtype\" "
       "of the nodes that compute")
_NOT_DECIDED = {
    "placeholder": "a graph input is taken in the dtype it is given and cast where the nodes "
                   f"reading it need: a plan does not decide it. {_IO}",
    "output": "the graph output returns what its nodes compute (in the model's dtypes with "
              f"keep_io_types): a plan does not decide it. {_IO}",
    "get_attr": "a parameter or buffer is stored in the dtype of the nodes that read it: a plan "
                "does not decide it. Edit the \"dtype\" of the nodes that read it instead",
}

_TEXT_FIELDS = tuple(f.name for f in dataclasses.fields(NodeRecord) if f.type in ("str", str))


def _validate(data: dict, source: str) -> None:
    """A ValueError naming the first field of a plan file that cannot be applied (a hand edit
    gone wrong): the plan's dtype, mode, and every node's, weight's and cast's record."""
    def fail(what: str):
        raise ValueError(f"{source} is not a valid plan: {what}")

    if data.get("dtype") not in LOW_DTYPES:
        fail(f"dtype {data.get('dtype')!r} is not one of {', '.join(LOW_DTYPES)}")
    if data.get("mode", "inference") not in MODES:
        fail(f"mode {data.get('mode')!r} is not one of {', '.join(MODES)}")
    for key in ("capture", "target", "strategy"):
        if not isinstance(data.get(key), str):
            fail(f"{key} must be a string, got {data.get(key)!r}")
    if not isinstance(data.get("keep_io_types"), bool):
        fail(f"keep_io_types must be true or false, got {data.get('keep_io_types')!r}")
    if data.get("grad_enabled") not in (None, True, False):
        fail(f"grad_enabled must be true, false or null, got {data.get('grad_enabled')!r}")
    fields = {f.name for f in dataclasses.fields(NodeRecord)} | {"decided"}
    for key, kind in (("nodes", "node"), ("casts", "cast"), ("weights", "weight")):
        records = data.get(key)
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            fail(f"{key} must be a list of {kind} records, got {type(records).__name__}")
    for i, d in enumerate(data["nodes"]):
        name = d.get("name", f"#{i}")
        unknown, missing = set(d) - fields, {"name", "op", "target", "dtype"} - set(d)
        if unknown or missing:
            fail(f"node {name}: " + (f"unknown fields {sorted(unknown)}" if unknown
                                      else f"missing fields {sorted(missing)}"))
        if d["dtype"] not in NODE_DTYPES:
            fail(f"node {name}: dtype {d['dtype']!r} is not one of "
                 f"{', '.join(str(t) for t in NODE_DTYPES[1:])} (or null)")
        for key in _TEXT_FIELDS:  # (what the passes read as text: a reason the plan applies)
            if key in d and not isinstance(d[key], str) and not (key == "module" and d[key] is None):
                fail(f"node {name}: {key} must be a string, got {d[key]!r}")
        if d["dtype"] is None and d.get("decided") is not None:  # (the conversion decided it)
            fail(f"node {name}: dtype edited to null from {d['decided']!r}: a node that computes "
                 "in floating point is float32 or the plan's low dtype")
        if "decided" in d and d["dtype"] != d["decided"] and d["op"] in _NOT_DECIDED:
            fail(f"node {name}: dtype edited to {d['dtype']!r} from {d['decided']!r}, but "
                 + _NOT_DECIDED[d["op"]])
    names = [d["name"] for d in data["nodes"]]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        fail(f"node {twice} has {names.count(twice)} records (one a node)")
    for w in data["weights"]:
        if w.get("dtype") not in LOW_DTYPES + ("float32",):
            fail(f"weight {w.get('name')!r}: dtype {w.get('dtype')!r} is not a float dtype")
    # a plan's low nodes are in its dtype, or bfloat16 beside float16 (dtype="auto"'s range nodes)
    allowed = {data["dtype"], "float32", None} | ({"bfloat16"} if data["dtype"] == "float16" else set())
    other = next((d for d in data["nodes"] if d["dtype"] not in allowed), None)
    if other is not None:
        fail(f"dtype is {data['dtype']!r} but node {other.get('name')} is {other['dtype']!r} "
             f"(a plan's low nodes are in its dtype; a float16 plan may hold bfloat16 nodes "
             f"beside it): edit the nodes' \"dtype\" too, or convert the model with "
             f"dtype={data['dtype']!r} instead of this plan")


def _weight(w: dict, source: str) -> WeightRecord:
    """A weight record; an edit of its dtype is said and ignored: a weight is stored in the
    dtype of the nodes that read it, so the nodes are what to edit."""
    w = dict(w)
    decided = w.pop("decided", w["dtype"])
    if decided != w["dtype"]:
        warnings.warn(f"{source}: weight {w.get('name')}'s dtype was edited to {w['dtype']}, which "
                      f"changes nothing: a weight is stored in the dtype of the nodes that read it "
                      f"({decided} here); edit the \"dtype\" of those nodes instead", UserWarning,
                      stacklevel=4)
        w["dtype"] = decided
    return WeightRecord(**{**w, "dtype": getattr(torch, w["dtype"])})


def jsonable(value):
    """Tuples to lists (recursively), so a saved and loaded plan compares equal to its dict; a
    non-finite number (a time never measured: inf) as null, which strict JSON readers take
    (``Infinity`` is no JSON: JavaScript's JSON.parse refused the file)."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _real_dtype(node: torch.fx.Node) -> Optional[torch.dtype]:
    info = node.meta.get(TENSOR)
    return planned_dtype(info, node.meta.get(PRECISION)) if isinstance(info, TensorInfo) else None


def _float32_infos(info) -> list[TensorInfo]:
    """A value's float32 tensors (every item of a multi-output value, nested ones too)."""
    if isinstance(info, TensorInfo):
        return [info] if info.dtype == torch.float32 else []
    return [i for item in info for i in _float32_infos(item)] if isinstance(info, tuple) else []


def _float32_numel(info) -> int:
    """Elements of a value's float32 tensors."""
    return sum(i.numel for i in _float32_infos(info))


def _model_cast(node: torch.fx.Node) -> Optional[CastRecord]:
    op_info = node.meta.get(OP_CLASS)
    if op_info is None or op_info.op_class != "cast" or not node.all_input_nodes:
        return None
    src, dst = _real_dtype(node.all_input_nodes[0]), _real_dtype(node)
    if src not in _FLOATS or dst not in _FLOATS or src == dst:
        return None
    info = node.meta.get(TENSOR)
    return CastRecord(name=node.name, value=node.all_input_nodes[0].name, src=dtype_name(src),
                      dst=dtype_name(dst), consumers=tuple(u.name for u in node.users),
                      numel=info.numel, inserted_by="model")


def _percent(fraction: float) -> str:
    """Two significant digits, 100 as "100" ("1e+02" in the g format), 99.6 as it is."""
    if fraction == 1:
        return "100"
    return f"{100 * fraction:.2g}" if 100 * fraction < 99.5 else f"{100 * fraction:.3g}"
