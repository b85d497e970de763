"""The ONNX IR edits that make an exported file state the plan, as onnx-ir passes.

The exporter writes what the converted graph computes, but some of its own choices contradict
the plan (a fusion that absorbs a cast, a weight it recomputed in float32, an attention op whose
softmax precision it leaves to the runtime). Each pass below fixes one of them, in place, and
counts what it changed (``count``); ``AnnotatePlanCasts`` then pairs the file's precision casts
with the plan's and labels each. They follow onnx-ir's pass contract (``ir.passes.InPlacePass``:
``call`` returns ``PassResult(model, modified)``), like onnxscript's own optimiser passes.
"""
from __future__ import annotations

import re
from typing import Optional

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch

from mpgraph.plans.plan import Plan
from mpgraph.tools.onnx_check import ir_dtype, is_precision_cast

ORIGIN = "mpgraph.origin"  # metadata key on nodes mpgraph added or annotated
_LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_DEFAULT = ("", "ai.onnx")


def cast_to(node) -> "ir.DataType":
    """The type a Cast node converts to."""
    return ir.DataType(node.attributes["to"].value)


class _CountingPass(ir.passes.InPlacePass):
    """An in-place pass that counts its edits: ``edit(graph)`` returns how many it made."""

    description = ""

    def __init__(self):
        super().__init__()
        self.count = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.count = self.edit(model.graph)
        return ir.passes.PassResult(model, modified=self.count > 0)

    def edit(self, graph) -> int:
        raise NotImplementedError


class RemoveNoopCasts(_CountingPass):
    """Casts to the type a value already has (the model's ``.to(float32)`` on a float32 value)."""

    description = "removed no-op casts"

    def edit(self, graph) -> int:
        removed = 0
        for node in list(graph):
            if node.op_type != "Cast" or node.domain not in _DEFAULT:
                continue
            src, out = node.inputs[0], node.outputs[0]
            if src is None or src.dtype is None or src.dtype != cast_to(node) \
                    or out.is_graph_output():
                continue
            out.replace_all_uses_with(src)
            graph.remove(node, safe=True)
            removed += 1
        return removed


class NormInputCasts(_CountingPass):
    """Put back the input Cast that the exporter's RMSNorm/LayerNorm fusion absorbed.

    The plan runs a norm in float32 on a cast of a low value; the onnxscript fusion (opset 23)
    folds ``Cast(fp16->fp32) -> pow -> mean -> ... -> mul`` into one RMSNormalization reading the
    fp16 value while declaring a float32 output, which ONNX forbids (X and Y share one type).
    The Cast goes back in front of the fused op: the file then computes what the plan says."""

    description = "norm input casts restored after fusion"

    def edit(self, graph) -> int:
        restored = 0
        for node in list(graph):
            if node.op_type not in ("RMSNormalization", "LayerNormalization") \
                    or node.domain not in _DEFAULT or node.inputs[0] is None:
                continue
            x, y = node.inputs[0], node.outputs[0]
            if x.dtype is None or y.dtype is None or x.dtype == y.dtype:
                continue
            cast = ir.node("Cast", [x], {"to": y.dtype}, name=f"{node.name}_input_cast")
            cast.outputs[0].dtype, cast.outputs[0].shape = y.dtype, x.shape
            graph.insert_before(node, cast)
            node.replace_input_with(0, cast.outputs[0])
            restored += 1
        return restored


class WeightsInInputDtype(_CountingPass):
    """Float32 initializers of ops whose ONNX type constraint ties them to the activations'
    type go to that type, converted once, here: weights the exporter's optimiser recomputed in
    float32 (eval batch norm folded into a bf16 Conv), and the float32 scale/bias of a layer or
    group norm that a plan for a CPU runs with low I/O (CPU kernels take that mix, ONNX's do not:
    op_table's contract; ONNX keeps the statistics in float32, stash_type=1). An initializer the
    exporter shares with float32 readers gets a converted copy for the low ones."""

    description = "folded weights stored in the activation dtype"
    _OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "LayerNormalization", "GroupNormalization")

    def edit(self, graph) -> int:
        np_type = {ir.DataType.FLOAT16: np.float16, ir.DataType.BFLOAT16: ml_dtypes.bfloat16}
        fixed = 0
        copies = {}  # (initializer name, dtype) -> its converted copy
        for node in list(graph):
            if node.op_type not in self._OPS or node.inputs[0] is None:
                continue
            want = node.inputs[0].dtype
            if want not in np_type:
                continue
            for i, value in enumerate(node.inputs[1:], 1):
                if value is None or not value.is_initializer() or value.dtype != ir.DataType.FLOAT \
                        or value.const_value is None:
                    continue
                low = value.const_value.numpy().astype(np_type[want])
                if all(user.inputs[0] is not None and user.inputs[0].dtype == want
                       for user, _ in value.uses()):
                    value.const_value = ir.tensor(low, name=value.name)
                    value.dtype = want
                else:  # shared with float32 readers (the exporter merges equal initializers)
                    key = (value.name, want)
                    if key not in copies:
                        name = f"{value.name}_{want.name.lower()}"
                        copies[key] = ir.val(name, want, value.shape,
                                             const_value=ir.tensor(low, name=name))
                        graph.register_initializer(copies[key])
                    node.replace_input_with(i, copies[key])
                fixed += 1
        return fixed


class AttentionSoftmaxFp32(_CountingPass):
    """Attention with fp16/bf16 inputs computes its softmax in float32, as the plan says."""

    description = "attention softmax set to float32"

    def edit(self, graph) -> int:
        changed = 0
        for node in graph:
            if node.op_type == "Attention" and node.domain in _DEFAULT \
                    and node.inputs[0] is not None and node.inputs[0].dtype in _LOW:
                node.attributes["softmax_precision"] = ir.AttrInt64("softmax_precision",
                                                                    int(ir.DataType.FLOAT))
                changed += 1
        return changed


class SoftmaxFp32(_CountingPass):
    """Below opset 23 attention is decomposed; its Softmax gets float32 input and output casts."""

    description = "decomposed softmax wrapped in float32 casts"

    def edit(self, graph) -> int:
        wrapped = 0
        for node in list(graph):
            if node.op_type not in ("Softmax", "LogSoftmax") or node.domain not in _DEFAULT:
                continue
            low = node.inputs[0].dtype
            if low not in _LOW:
                continue
            meta = {ORIGIN: "softmax inside decomposed attention, computed in float32"}
            up = ir.node("Cast", [node.inputs[0]], {"to": ir.DataType.FLOAT},
                         name=f"{node.name}_in_fp32", metadata_props=dict(meta))
            up.outputs[0].dtype = ir.DataType.FLOAT
            up.outputs[0].shape = node.inputs[0].shape
            graph.insert_before(node, up)
            node.replace_input_with(0, up.outputs[0])
            out = node.outputs[0]
            down = ir.node("Cast", [out], {"to": low}, name=f"{node.name}_out_low",
                           metadata_props=dict(meta))
            graph.insert_after(node, down)
            out.replace_all_uses_with(down.outputs[0], replace_graph_outputs=True)
            down.replace_input_with(0, out)
            down.outputs[0].dtype, down.outputs[0].shape = low, out.shape
            out.dtype = ir.DataType.FLOAT
            wrapped += 1
        return wrapped


class MaskedRowsGiveZero(_CountingPass):
    """torch.onnx's decomposed attention (opset < 23) turns a bool mask into 0 / the dtype's
    lowest value and guards its softmax with ``Where(IsNaN(w), 0, w)``, as torch's SDPA gives 0
    for a fully masked row; the lowest value is finite, so the guard never fires and such a row
    (a fully padded item) attends to every key alike. With -inf it gives NaN, and the guard 0."""

    description = "decomposed attention's bool mask set to -inf (a fully masked row gives 0)"

    def edit(self, graph) -> int:
        changed, neg_inf = 0, {}
        for guard in list(graph):
            if guard.op_type != "Where" or guard.domain not in _DEFAULT:
                continue
            isnan = _producer(guard.inputs[0])
            if isnan is None or isnan.op_type != "IsNaN" or isnan.inputs[0] is not guard.inputs[2]:
                continue
            softmax = _through_casts(guard.inputs[2])
            add = _through_casts(softmax.inputs[0]) if softmax is not None \
                and softmax.op_type == "Softmax" else None
            if add is None or add.op_type != "Add":
                continue
            for where in (_producer(v) for v in add.inputs):
                if where is None or where.op_type != "Where" or not _is_lowest(where.inputs[2]):
                    continue
                lowest = where.inputs[2].const_value.numpy()
                if lowest.dtype not in neg_inf:
                    value = ir.Value(name=f"mpgraph_mask_neg_inf_{len(neg_inf)}",
                                     const_value=ir.tensor(np.full(lowest.shape, -np.inf,
                                                                   dtype=lowest.dtype)))
                    value.dtype, value.shape = where.inputs[2].dtype, where.inputs[2].shape
                    graph.register_initializer(value)
                    neg_inf[lowest.dtype] = value
                where.replace_input_with(2, neg_inf[lowest.dtype])
                changed += 1
        return changed


def _producer(value):
    return value.producer() if value is not None else None


def _through_casts(value):
    """The node that computes ``value``, past Casts (the float32 ones SoftmaxFp32 adds)."""
    node = _producer(value)
    while node is not None and node.op_type == "Cast":
        node = _producer(node.inputs[0])
    return node


def _is_lowest(value) -> bool:
    """A constant scalar that is its float dtype's lowest finite value."""
    const = value.const_value if value is not None else None
    if const is None or value.dtype not in (ir.DataType.FLOAT, *_LOW, ir.DataType.DOUBLE):
        return False
    array = const.numpy()
    return array.size == 1 and float(array.reshape(-1)[0]) == float(ml_dtypes.finfo(array.dtype).min)


class AnnotatePlanCasts(ir.passes.InPlacePass):
    """Pair the file's precision casts with the plan's and label each with its origin
    (``metadata_props``); ``in_file``, ``expected`` and ``differences`` say how they matched.

    A Cast is paired with the plan cast it was traced from: ``origins`` maps the exporter's
    torch.fx node names (each ONNX node's ``pkg.torch.onnx.fx_node``) to the converted graph's
    node names. The rest (a Cast a pass put back, an exporter without provenance) are aligned
    in order by their types: a Cast the exporter dropped is reported alone, where pairing by
    position mislabelled every later one."""

    def __init__(self, plan: Plan, origins: Optional[dict] = None):
        super().__init__()
        self.plan = plan
        self.origins = origins or {}
        self.in_file, self.expected, self.differences, self.folded = 0, 0, [], 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        import difflib
        ours = [n for n in model.graph if is_precision_cast(n) and ORIGIN not in n.metadata_props]
        expected = self.plan.cast_sequence()
        unused: dict[str, list[int]] = {}  # plan cast name -> its places in expected, unpaired
        for j, rec in enumerate(expected):
            unused.setdefault(rec.name, []).append(j)
        pairs: dict[int, int] = {}  # ours index -> expected index
        for i, node in enumerate(ours):
            places = unused.get(self.origins.get(_fx_name(node)), [])
            if places:
                pairs[i] = places.pop(0)
        rest = [i for i in range(len(ours)) if i not in pairs]
        left = sorted(set(range(len(expected))) - set(pairs.values()))
        aligned = difflib.SequenceMatcher(None, [_types(ours[i]) for i in rest],
                                          [_plan_types(expected[j]) for j in left], autojunk=False)
        for a, b, size in aligned.get_matching_blocks():
            pairs.update((rest[a + k], left[b + k]) for k in range(size))
        differences = []
        for i, node in enumerate(ours):
            if i not in pairs:
                got = _types(node)
                differences.append(f"extra Cast {node.name} ({got[0]}->{got[1]}) not in the plan")
                continue
            rec = expected[pairs[i]]
            got, want = _types(node), _plan_types(rec)
            if got != want:
                differences.append(f"Cast {node.name} is {got[0]}->{got[1]}, plan cast {rec.name} "
                                   f"is {want[0]}->{want[1]}")
            node.metadata_props[ORIGIN] = ("plan cast" if rec.inserted_by != "model"
                                           else "model's own cast")
            node.metadata_props["mpgraph.cast"] = rec.name
            node.metadata_props["mpgraph.value"] = rec.value
            node.metadata_props["mpgraph.inserted_by"] = rec.inserted_by
        paired = set(pairs.values())
        missing = [rec for j, rec in enumerate(expected) if j not in paired]
        gone = self._folded(model, missing) if missing else []
        differences += [f"plan cast {rec.name} ({rec.src}->{rec.dst} of {rec.value}) has no Cast "
                        "in the file" for rec in missing if rec not in gone]
        self.in_file, self.expected, self.differences = len(ours), len(expected), differences
        self.folded = len(gone)
        return ir.passes.PassResult(model, modified=bool(ours))


    def _folded(self, model, missing: list) -> list:
        """The plan casts of ``missing`` the exporter folded into a constant of the cast's
        dtype: a value computed from weights alone (weight_norm's weight cast to fp16), the
        plan carried out before the file runs, not a missing Cast (probe pB F5). Under its own
        name, or another the exporter gave a constant it shares (Swin's two biases): then the
        cast's readers read a constant of the cast's dtype."""
        folded = {self.origins.get(name, name): v.dtype.name
                  for name, v in model.graph.initializers.items() if v.dtype is not None}
        readers: dict = {}
        for node in model.graph:
            fx = _fx_name(node)
            readers.setdefault(self.origins.get(fx, fx), []).append(node)

        def folded_away(rec) -> bool:
            dtype = _plan_types(rec)[1]
            if folded.get(rec.name) == dtype:
                return True
            if not self._from_weights_alone(rec.value):  # (an input's: its Cast is missing)
                return False
            return any(
                v is not None and v.const_value is not None and v.dtype is not None
                and v.dtype.name == dtype
                for reader in rec.consumers for node in readers.get(reader, ())
                for v in node.inputs)
        return [rec for rec in missing if folded_away(rec)]

    def _from_weights_alone(self, name: str) -> bool:
        """Whether the plan's value ``name`` reads no input of the graph, however far back:
        what an exporter may fold into a constant (Swin's relative position bias, a
        weight_norm weight). A walk, not a recursion: an 80-layer model is deeper than
        Python's stack."""
        todo, seen = [name], {name}
        while todo:
            try:
                record = self.plan.node(todo.pop())
            except KeyError:
                return False
            if record.op == "placeholder":
                return False
            todo += [i for i in record.inputs if i not in seen]
            seen.update(record.inputs)
        return True


def _fx_name(node) -> Optional[str]:
    """The torch.fx node the exporter translated ``node`` from (its ``pkg.torch.onnx.fx_node``
    metadata: ``%_to_copy_3 : [num_users=1] = ...``)."""
    found = re.match(r"%(\S+) :", node.metadata_props.get("pkg.torch.onnx.fx_node", ""))
    return found.group(1) if found else None


def _types(node) -> tuple[str, str]:
    return node.inputs[0].dtype.name, cast_to(node).name


def _plan_types(rec) -> tuple[str, str]:
    return ir_dtype(getattr(torch, rec.src)).name, ir_dtype(getattr(torch, rec.dst)).name


def plan_passes() -> list[_CountingPass]:
    """The edits, in the order they run (removing no-op casts first: later ones read types)."""
    return [RemoveNoopCasts(), NormInputCasts(), WeightsInInputDtype(), AttentionSoftmaxFp32(),
            SoftmaxFp32(), MaskedRowsGiveZero()]
