"""Prove an exported file: ONNX checker, strict type inference, plan structure, and numbers.

What a CPU run proves: the file loads, every value has the type the plan gave it, fp16 storage
between nodes does not overflow on the example inputs, and the numbers match the converted
PyTorch module and float32. What it does not prove: fp16 accumulation inside GPU kernels (cuBLAS
and cuDNN choose their own), nor speed. onnxruntime's CPU provider has no bfloat16 MatMul/Gemm,
so a bf16 file is run as an emulation: the same graph with every bf16 value held in float32 and
rounded to bf16 after each node (storage-exact; arithmetic inside a node is float32).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch
from torch.utils import _pytree as pytree

from mpgraph.errors import ExportError
from mpgraph.ir.graph import run_kept
from mpgraph.ir.meta import dtype_name
from mpgraph.numerics import relative_l2
from mpgraph.tools import ort_io

log = logging.getLogger(__name__)

_FP32_ONLY_OPS = {"Softmax", "LogSoftmax", "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1",
                  "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceProd", "CumSum",
                  "LayerNormalization", "GroupNormalization", "InstanceNormalization",
                  "BatchNormalization"}
_MATMUL_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Attention"}


def _ir():
    import onnx_ir as ir
    return ir


def ir_dtype(dtype: torch.dtype):
    ir = _ir()
    return {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16,
            torch.bfloat16: ir.DataType.BFLOAT16, torch.float64: ir.DataType.DOUBLE,
            torch.int64: ir.DataType.INT64, torch.int32: ir.DataType.INT32,
            torch.bool: ir.DataType.BOOL, torch.uint8: ir.DataType.UINT8}.get(dtype)


@dataclass
class OnnxStats:
    """Structure of an ONNX file as far as precision goes (used for any file, ours or not)."""

    casts: int = 0
    matmul_flops: float = 0.0
    low_matmul_flops: float = 0.0
    matmul_nodes: int = 0
    low_matmul_nodes: int = 0
    low_fp32_ops: list[str] = field(default_factory=list)   # softmax/norm/reduction reading fp16/bf16
    runtime_weight_casts: list[str] = field(default_factory=list)
    round_trips: list[str] = field(default_factory=list)

    @property
    def low_flop_share(self) -> float:
        if self.matmul_flops > 0:
            return self.low_matmul_flops / self.matmul_flops
        return self.low_matmul_nodes / self.matmul_nodes if self.matmul_nodes else 0.0


def _dims(value) -> Optional[list[int]]:
    if value is None or value.shape is None:
        return None
    dims = list(value.shape)
    return dims if all(isinstance(d, int) for d in dims) else None


def _flops(node) -> Optional[float]:
    """2·M·N·K for matmuls, 2·out·Cin/g·k for convs, from static shapes; None when unknown."""
    out = _dims(node.outputs[0])
    a = _dims(node.inputs[0])
    if out is None or a is None:
        return None
    if node.op_type in ("MatMul", "Gemm"):
        k = a[-1] if node.op_type == "MatMul" or not node.attributes.get("transA") \
            or not node.attributes["transA"].value else a[0]
        return 2.0 * float(np.prod(out)) * k
    if node.op_type in ("Conv", "ConvTranspose"):
        w = _dims(node.inputs[1])
        if w is None:
            return None
        per_out = float(np.prod(w[1:]))  # Cin/groups x kernel
        return 2.0 * float(np.prod(out)) * per_out if node.op_type == "Conv" \
            else 2.0 * float(np.prod(a)) * w[1] * float(np.prod(w[2:]))
    if node.op_type == "Attention":
        q, k = a, _dims(node.inputs[1])
        if k is None:
            return None
        return 4.0 * float(np.prod(q)) * k[-2]  # QK^T and PV
    return None


def _float32_statistics(node) -> bool:
    """LayerNormalization (and GroupNormalization from opset 21) with stash_type=1, the default,
    compute mean and variance in float32 whatever their input type; BatchNormalization in
    inference mode (training_mode=0, the default) computes no statistics: it is a per-channel
    affine map with stored ones, which the plan runs in low precision like autocast does."""
    if node.op_type == "BatchNormalization":
        attr = node.attributes.get("training_mode")
        return attr is None or attr.value == 0
    if node.op_type == "LayerNormalization":
        attr = node.attributes.get("stash_type")
        return attr is None or attr.value == 1
    if node.op_type == "GroupNormalization":
        attr = node.attributes.get("stash_type")
        return attr is not None and attr.value == 1
    # a mean lies within its input's range, and onnxruntime accumulates an fp16 one in float32
    # (CUDA: cuDNN's reduction with a float32 compute type, or its row reduction's float
    # accumulator; CPU: no fp16 kernel, so it runs between casts to float32): what a global
    # average pool the plan runs in low precision, as PyTorch's GPU kernels do, exports to;
    # only that one (over every axis after batch and channels): another mean in low precision,
    # a norm's the plan kept in float32, is still the mismatch this check is for
    return node.op_type == "ReduceMean" and _global_pool_axes(node)


def _global_pool_axes(node) -> bool:
    """Whether a ReduceMean reduces exactly the axes after the first two (N, C, spatial...)."""
    x = node.inputs[0] if node.inputs else None
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 3:
        return False
    attr = node.attributes.get("axes")
    if attr is not None:
        axes = list(attr.value)
    elif len(node.inputs) > 1 and node.inputs[1] is not None \
            and node.inputs[1].const_value is not None:
        axes = [int(a) for a in node.inputs[1].const_value.numpy().reshape(-1)]
    else:
        return False
    rank = len(shape)
    return sorted(a % rank for a in axes) == list(range(2, rank))


def is_precision_cast(node) -> bool:
    """A Cast from one float type to another: not to or from integers, not to the same type."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or not node.inputs \
            or node.inputs[0] is None:
        return False
    ir = _ir()
    floats = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
    src, to = node.inputs[0].dtype, ir.DataType(node.attributes["to"].value)
    return src in floats and to in floats and src != to


def inspect_model(model) -> OnnxStats:
    """Count precision casts, matmul FLOPs by dtype, fp32-only ops in low precision, bad casts."""
    ir = _ir()
    low = {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
    stats = OnnxStats()
    for node in model.graph.all_nodes() if hasattr(model.graph, "all_nodes") else model.graph:
        x = node.inputs[0] if node.inputs else None
        dtype = x.dtype if x is not None else None
        if is_precision_cast(node):
            to = ir.DataType(node.attributes["to"].value)
            stats.casts += 1
            prev = x.producer()
            if x.is_initializer() or (prev is not None and prev.op_type == "Constant"):
                stats.runtime_weight_casts.append(node.name)
            if prev is not None and prev.op_type == "Cast" and prev.inputs[0] is not None \
                    and prev.inputs[0].dtype == to:
                stats.round_trips.append(f"{prev.name} -> {node.name}")
        if node.op_type in _MATMUL_OPS:
            f = _flops(node)
            stats.matmul_nodes += 1
            stats.low_matmul_nodes += dtype in low
            if f is not None:
                stats.matmul_flops += f
                stats.low_matmul_flops += f if dtype in low else 0.0
            if node.op_type == "Attention" and dtype in low:
                attr = node.attributes.get("softmax_precision")
                if attr is None or attr.value != int(ir.DataType.FLOAT):
                    stats.low_fp32_ops.append(f"{node.name} (Attention softmax in {dtype.name})")
        if node.op_type in _FP32_ONLY_OPS and dtype in low and not _float32_statistics(node):
            stats.low_fp32_ops.append(f"{node.name} ({node.op_type} reads {dtype.name})")
    return stats


def load_with_types(path: str, inferred: Optional[str] = None):
    """The file as onnx_ir, after ONNX shape inference (types for every value), data left on disk.

    The inference runs file to file (``inferred``: a file that already holds its result): the
    in-memory API copies the whole protobuf, weights included, through Python four times."""
    import onnx
    ir = _ir()
    if inferred is not None:
        return ir.from_proto(onnx.load(inferred, load_external_data=False))
    workdir = tempfile.mkdtemp(prefix=".mpgraph-types-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        typed = os.path.join(workdir, "typed.onnx")
        onnx.shape_inference.infer_shapes_path(os.fspath(path), typed, data_prop=True)
        return ir.from_proto(onnx.load(typed, load_external_data=False))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class ValidationResult:
    checks: list[str]
    provider: str
    emulated: bool
    err_vs_converted: list[float]
    err_vs_fp32: Optional[list[float]]
    stats: OnnxStats
    reference: str = "float32"  # what err_vs_fp32 compares with (a model given in fp16: itself)

    def summary(self) -> str:
        how = f"onnxruntime {self.provider}" + (" (bf16 emulation)" if self.emulated else "")
        errs = ", ".join(f"{e:.2e}" for e in self.err_vs_converted)
        text = f"validated: {'; '.join(self.checks)}; {how}: rel. L2 vs converted module {errs}"
        if self.err_vs_fp32 is not None:
            text += f", vs {self.reference} " + ", ".join(f"{e:.2e}" for e in self.err_vs_fp32)
        text += f"; {self.stats.low_flop_share:.1%} of matmul FLOPs in low precision"
        return text


def _tensors(value) -> list[torch.Tensor]:
    """The outputs' leaves as the file has them, in order: tensors, and a Python int, float or
    bool (``x.shape[0]``, a symbolic size the exporter makes a graph output) as a 0-d tensor
    (None has no leaf, and no output). Tensors alone would pair the file's outputs after an int
    with the wrong PyTorch value."""
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return [t if isinstance(t, torch.Tensor) else torch.tensor(t)
            for t in pytree.tree_leaves(value)
            if isinstance(t, (torch.Tensor, bool, int, float))]


def _named_inputs(converted, args: tuple, kwargs: dict
                  ) -> list[tuple[Optional[str], torch.Tensor]]:
    """Each input tensor, in the order the exporter flattens (args, kwargs), with the name of the
    argument that is it (None for an item of a container, or a ``*args`` argument)."""
    signature = converted.__dict__.get("call_signature")
    names = signature.names if signature is not None and not signature.varargs else ()
    given = [(names[i] if i < len(names) else None, a) for i, a in enumerate(args)]
    given += list(kwargs.items())
    return [(name if isinstance(value, torch.Tensor) else None, t) for name, value in given
            for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _fed(graph_inputs, named) -> list[torch.Tensor]:
    """The tensor fed to each of the file's inputs: by name where the file names each input after
    its argument (the order of the file's inputs is the exporter's, not necessarily the call's),
    else in order."""
    by_name = {n: t for n, t in named if n is not None}
    if len(graph_inputs) == len(named) and all(v.name in by_name for v in graph_inputs):
        return [by_name[v.name] for v in graph_inputs]
    return [t for _, t in named]


def _feed(t: torch.Tensor):
    """A tensor as numpy, a bfloat16 one as its uint16 bits (numpy has no bfloat16; ort_io.run
    feeds them as BFLOAT16)."""
    t = t.detach().cpu()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _scratch_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the user's model to run: its buffers, written parameters (an embedding's
    max_norm) and Python attributes its own, the other parameters shared (no second copy of the
    weights). Running the model itself advanced a step counter or an EMA buffer on every
    export. Where it cannot be copied, the model itself (its buffers are put back after)."""
    import copy
    from mpgraph.frontend.capture import computed_attributes
    from mpgraph.ir.graph import written_parameters
    written = {id(p) for p in written_parameters(model)}
    memo = {id(p): p for p in model.parameters() if id(p) not in written}
    memo.update(computed_attributes(model))
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - run under state_kept instead
        log.info("validating on the model itself: it cannot be copied (%s)", e)
        return model


def tolerance_of(plan) -> float:
    """The plan's own bound on its outputs' relative L2 error against float32 (the bound its
    check used: 32 units of the dtype's rounding, or the tolerance it was converted to), which
    the file is held to as well: a stricter one refused files closer to float32 than the
    module itself."""
    from mpgraph.passes.check_conversion import value_bound
    bound = (plan.check or {}).get("bound")
    return float(bound) if bound else value_bound(plan.dtype)


def _bf16_emulation(path: str, out_path: str) -> str:
    """The same graph with bf16 values held in float32 and rounded to bf16 after every node."""
    ir = _ir()
    model = ir.load(path)
    g = model.graph
    BF16, F32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    for name, v in list(g.initializers.items()):
        if v.dtype == BF16:
            v.const_value = ir.tensor(v.const_value.numpy().astype(np.float32), name=name)
            v.dtype = F32
    for node in list(g):
        attr = node.attributes.get("value")
        if node.op_type in ("Constant", "ConstantOfShape") and attr is not None \
                and getattr(attr.value, "dtype", None) == BF16:
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(attr.value.numpy().astype(np.float32)))
        for out in node.outputs:
            if out.dtype != BF16:
                continue
            is_cast = node.op_type == "Cast"
            if not is_cast:
                out.dtype = F32
                down = ir.node("Cast", [out], {"to": BF16})
                up = ir.node("Cast", [down.outputs[0]], {"to": F32})
                g.insert_after(node, [down, up])
            else:
                up = ir.node("Cast", [out], {"to": F32})
                g.insert_after(node, up)
            out.replace_all_uses_with(up.outputs[0], replace_graph_outputs=True)
            (down if not is_cast else up).replace_input_with(0, out)
            up.outputs[0].dtype, up.outputs[0].shape = F32, out.shape
    ir.save(model, out_path, external_data=os.path.basename(out_path) + ".data")
    return out_path


def _with_all_outputs(path: str, out_path: str) -> list[str]:
    """A copy of the model returning every float intermediate value too; returns their names."""
    ir = _ir()
    model = ir.load(path)
    floats = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
    existing = {v.name for v in model.graph.outputs}
    names = []
    for node in model.graph:
        for out in node.outputs:
            if out.dtype in floats and out.name not in existing:
                model.graph.outputs.append(out)
                names.append(out.name)
    ir.save(model, out_path, external_data=os.path.basename(out_path) + ".data")
    return names


def _locate(path: str, feeds: dict, workdir: str, torch_values: Optional[dict], tol: float,
            run_path_fn) -> str:
    """Name the first node whose output goes non-finite, or first diverges from PyTorch."""
    ir = _ir()
    probe = os.path.join(workdir, "probe.onnx")
    names = _with_all_outputs(path, probe)
    session = run_path_fn(probe)
    outs = ort_io.run(session, feeds)
    values = dict(zip([o.name for o in session.get_outputs()], outs))
    model = ir.load(path)
    for node in model.graph:
        ins = [values.get(v.name) for v in node.inputs if v is not None and v.name in values]
        for out in node.outputs:
            val = values.get(out.name)
            if val is None or out.name not in names:
                continue
            if not _finite(val) and all(_finite(i) for i in ins):
                largest = max((_absmax(i) for i in ins), default=0.0)
                return _describe(node, f"first produces inf/NaN (inputs' largest |x| {largest:.3g})")
            if torch_values and out.name in torch_values:
                ref = torch_values[out.name]
                if tuple(ref.shape) == tuple(val.shape):
                    err = relative_l2(val, ref.detach().float().numpy())
                    if err > tol:
                        return _describe(node, f"first differs from PyTorch (rel. L2 {err:.2e})")
    return "no single node found; the difference builds up over the graph"


def _finite(x) -> bool:
    return bool(np.isfinite(np.asarray(x, dtype=np.float64)).all())


def _absmax(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.abs(x).max()) if x.size else 0.0


def _describe(node, what: str) -> str:
    fx = node.metadata_props.get("pkg.torch.onnx.fx_node", "")
    fx = fx.split("=", 1)[-1].strip()[:120] if fx else ""
    scope = node.metadata_props.get("pkg.torch.onnx.name_scopes", "")
    text = f"node {node.name} ({node.op_type}) {what}"
    if fx:
        text += f"; from {fx}"
    if scope:
        text += f" in {scope}"
    return text


def _hint(error: Exception, path: str) -> str:
    """The way out of an op ONNX types without bfloat16 at the file's opset: the opset that
    admits it, if any (Einsum: none up to 23; it said "export with opset=23" to a file at 23)."""
    import onnx
    import onnx.defs
    text = str(error)
    found = re.search(r"op_type:(\w+)", text)
    if "bfloat16" not in text or "unsupported type" not in text or found is None:
        return ""
    op = found.group(1)
    try:
        opset = next((o.version for o in onnx.load(path, load_external_data=False).opset_import
                      if o.domain in ("", "ai.onnx")), None)
        since = next((v for v in range(1, onnx.defs.onnx_opset_version() + 1)
                      if _takes_bf16(op, v)), None)
    except Exception:  # noqa: BLE001 (a hint only)
        return ""
    torch_op = _TORCH_OPS.get(op)  # (overrides name torch's ops: 'op:*maxpool*' matched none)
    keep = (f"keep it float32 (mpgraph.convert with overrides={{'op:*{torch_op}*': 'fp32'}}, "
            "then export_onnx of the module it returns)" if torch_op else
            f"keep the ops it comes from float32 (mpgraph.convert with overrides= naming them, "
            "then export_onnx of the module it returns)")
    if since is None:
        return (f"\n  (ONNX's {op} takes no bfloat16 at any opset: export with dtype='fp16', or "
                f"{keep})")
    return (f"\n  (ONNX's {op} takes bfloat16 from opset {since}, this file is opset {opset}: "
            f"export with opset={since} or later where your runtime runs a bfloat16 {op}, with "
            f"dtype='fp16', or {keep})")


# ONNX ops without bfloat16 at some opsets, by the torch op an override names ('op:<glob>')
_TORCH_OPS = {"Einsum": "einsum", "MaxPool": "max_pool", "AveragePool": "avg_pool",
              "GlobalAveragePool": "adaptive_avg_pool", "Conv": "conv", "ConvTranspose":
              "conv_transpose", "LpNormalization": "normalize"}


def _takes_bf16(op: str, version: int) -> bool:
    import onnx.defs
    try:
        schema = onnx.defs.get_schema(op, version)
    except Exception:  # noqa: BLE001 (no such op at that opset)
        return False
    return schema.since_version <= version and any(
        "tensor(bfloat16)" in c.allowed_type_strs for c in schema.type_constraints)


def validate_onnx(path: str, converted: torch.nn.Module, args: tuple, kwargs: dict, *,
                  reference: Optional[torch.nn.Module] = None, exported_program=None,
                  device: Optional[str] = None, tolerance: Optional[float] = None,
                  display_name: Optional[str] = None) -> ValidationResult:
    """Check ``path`` structurally and numerically; raise ExportError naming the node on a mismatch.

    ``display_name`` is the path to name in messages (export validates a file before moving it).
    """
    import onnx

    path = os.fspath(path)
    shown = display_name or path
    plan = converted.plan
    options = _validation_options()
    tol = tolerance if tolerance is not None else tolerance_of(plan)
    # the feeds first, from the caller's tensors as given: every PyTorch run below reads fresh
    # copies of them, and the user's model is run as a copy (its state as export began)
    named = _named_inputs(converted, args, kwargs)
    checks = []
    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as e:
        raise ExportError(f"onnx.checker rejects {shown}: {e}{_hint(e, path)}") from e
    checks.append("onnx.checker full_check")
    workdir = tempfile.mkdtemp(prefix=".mpgraph-check-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        inferred = os.path.join(workdir, "inferred.onnx")
        try:  # with data propagation: the typed model inspected below comes from this pass
            onnx.shape_inference.infer_shapes_path(path, inferred, check_type=True, strict_mode=True,
                                                   data_prop=True)
        except Exception as e:
            raise ExportError(f"strict ONNX type inference fails on {shown}: {e}") from e
        checks.append("strict type inference")

        model = load_with_types(path, inferred)
        stats = inspect_model(model)
        problems = [f"runtime weight cast {n}" for n in stats.runtime_weight_casts]
        problems += [f"cast round trip {n}" for n in stats.round_trips]
        problems += [f"fp32 op in low precision: {n}" for n in stats.low_fp32_ops]
        # (a forward that writes its input, x.mul_(2), or a buffer leaves the caller's alone)
        torch_out = _tensors(run_kept(converted, args, kwargs))
        ref_out = _tensors(run_kept(_scratch_model(reference), args, kwargs)) \
            if reference is not None else None
        graph_inputs = [v for v in model.graph.inputs if not v.is_initializer()]
        fed = _fed(graph_inputs, named)
        feeds = {v.name: _feed(t) for v, t in zip(graph_inputs, fed)}
        ir = _ir()
        graph_outputs = list(model.graph.outputs)
        if len(graph_outputs) != len(torch_out):
            problems.append(f"the file has {len(graph_outputs)} outputs, PyTorch's module returns "
                            f"{len(torch_out)} values")
        for kind, values, tensors in (
                ("input", graph_inputs, fed),
                ("output", graph_outputs, torch_out)):
            for v, t in zip(values, tensors):
                if v.dtype != ir_dtype(t.dtype):
                    problems.append(f"graph {kind} {v.name} is {v.dtype.name}, PyTorch has {t.dtype}")
        if problems:
            raise ExportError(f"{shown} does not match the plan:\n  " + "\n  ".join(problems))
        checks.append("plan structure (I/O types, fp32 ops, no weight casts, no round trips)")

        emulated = False
        run_path = path
        try:  # as users run it: a default session (ORT_ENABLE_ALL), in a process of its own
            outs, provider = run_isolated(run_path, feeds, workdir, device)
        except OrtLoadError as e:
            has_bf16 = any(v.dtype == ir.DataType.BFLOAT16 for v in model.graph.initializers.values())
            if not has_bf16 and "NOT_IMPLEMENTED" not in str(e):
                raise OrtRunError(f"onnxruntime cannot load {shown}: {e}") from e
            log.info("onnxruntime cannot run the bf16 file natively (%s); using the emulation", e)
            run_path = _bf16_emulation(path, os.path.join(workdir, "emulated.onnx"))
            outs, provider = run_isolated(run_path, feeds, workdir, "cpu")
            emulated = True
        except OrtRunError as e:
            raise OrtRunError(f"{shown}: {e}") from None
        # integer outputs (topk's indices, an argmax) as the share of values that differ: two
        # runtimes may break a tie in the low dtype differently, so they count against float32's
        discrete = [not np.issubdtype(np.asarray(o).dtype, np.floating) for o in outs]
        err_conv = [_difference(o, t) for o, t in zip(outs, torch_out)]
        err_ref = None
        if ref_out is not None:
            err_ref = [_difference(o, r) for o, r in zip(outs, ref_out)]
            own = [_difference(_numpy(t), r) for t, r in zip(torch_out, ref_out)]
        # a float output is the plan's when it is within the plan's bound of float32; without
        # float32 (a converted module exported), of the converted module
        bad = [i for i, e in enumerate(err_conv) if e > tol and not (
            ref_out is not None and (discrete[i] or err_ref[i] <= tol))]
        if ref_out is not None:
            bad += [i for i, (e, o) in enumerate(zip(err_ref, own)) if e > max(tol, 2 * o) and i not in bad]
        if bad:
            torch_values = None
            if exported_program is not None:
                from mpgraph.ir.graph import run_recording
                torch_values = {}
                try:
                    run_recording(exported_program.module(), args, kwargs,
                                  lambda n, v: torch_values.__setitem__(n.name, v)
                                  if isinstance(v, torch.Tensor) else None)
                except Exception as e:  # localisation is best effort; the mismatch stands
                    log.info("could not rerun the exported program for localisation: %s", e)
                    torch_values = None
            where = _locate(run_path, feeds, workdir, torch_values, tol,
                            lambda p: ort_session(p, device="cpu", **options))
            detail = ", ".join(f"output {i}: rel. L2 {err_conv[i]:.2e} vs converted"
                               + (f", {err_ref[i]:.2e} vs float32" if err_ref else "") for i in bad)
            raise ExportError(f"onnxruntime results of {shown} do not match ({detail}; tolerance "
                              f"{tol:.3g}, the plan's bound): {where}")
        checks.append("onnxruntime numbers")
        dtypes = {p.dtype for p in reference.parameters() if p.is_floating_point()} \
            if reference is not None else set()
        given = "float32" if not dtypes or torch.float32 in dtypes else \
            f"the model as given ({', '.join(sorted(dtype_name(d) for d in dtypes))})"
        return ValidationResult(checks, provider, emulated, err_conv, err_ref, stats, given)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _numpy(t: torch.Tensor):
    """A tensor's values in numpy (float16/bfloat16 as float32: numpy has no bfloat16)."""
    t = t.detach().cpu()
    return (t.float() if t.is_floating_point() else t).numpy()


def _difference(value, reference) -> float:
    """How far an output is from a reference: ``relative_l2`` for floats; for integers and bools
    the share of the values that differ (no relative error describes an index)."""
    ref = _numpy(reference) if isinstance(reference, torch.Tensor) else np.asarray(reference)
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.floating) and value.shape == ref.shape:
        return float((value != ref).mean()) if value.size else 0.0
    return relative_l2(value.astype(np.float32), np.asarray(ref, dtype=np.float32))


class OrtRunError(ExportError):
    """onnxruntime failed running the file: an error while running it, or a crash of its
    process. ``export_onnx`` answers some of these with a file it can run (and says so)."""


class OrtLoadError(OrtRunError):
    """onnxruntime refused to create a session for the file (an op or type it lacks)."""


# what the validating process runs: onnxruntime and numpy only (no torch: ~0.3 s to start), a
# default session (graph optimisation ORT_ENABLE_ALL, what users' sessions use)
_RUNNER = r"""
import importlib.util, json, sys
import numpy as np
import onnxruntime as ort
path, feeds, out, providers = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
names = json.loads(sys.argv[5])
spec = importlib.util.spec_from_file_location("ort_io", sys.argv[6])
ort_io = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ort_io)
options = ort.SessionOptions()
options.log_severity_level = 3
ort.set_default_logger_severity(3)
try:
    session = ort.InferenceSession(path, options, providers=providers)
except Exception as e:
    print("LOAD:" + str(e), file=sys.stderr)
    sys.exit(3)
data = np.load(feeds)
outs = ort_io.run(session, {name: data[f"arr_{i}"] for i, name in enumerate(names)})
np.savez(out, *outs)
print(session.get_providers()[0])
"""


def run_isolated(path: str, feeds: dict, workdir: str, device: Optional[str] = None):
    """(outputs, provider) of ``path`` run on ``feeds`` by onnxruntime in a child process with a
    default session: a crash of onnxruntime (a segfault in a kernel) is an OrtRunError naming the
    signal, not the end of this process."""
    import json
    import subprocess
    import sys
    import onnxruntime as ort
    want_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    providers = ["CPUExecutionProvider"]
    if want_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    names = list(feeds)
    given, got = os.path.join(workdir, "feeds.npz"), os.path.join(workdir, "outputs.npz")
    np.savez(given, *[feeds[n] for n in names])
    proc = subprocess.run([sys.executable, "-c", _RUNNER, path, given, got, ",".join(providers),
                           json.dumps(names), ort_io.__file__], capture_output=True, text=True)
    if proc.returncode == 3:
        raise OrtLoadError(proc.stderr.rpartition("LOAD:")[2].strip())
    if proc.returncode != 0:
        import signal
        if proc.returncode < 0:
            try:
                how = f"crashed ({signal.Signals(-proc.returncode).name})"
            except ValueError:
                how = f"crashed (signal {-proc.returncode})"
        else:
            lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            last = re.sub(r"^onnxruntime\.capi\.\w+\.\w+: (\[ONNXRuntimeError\] : \d+ : \w+ : )?",
                          "", lines[-1]) if lines else f"exit status {proc.returncode}"
            how = f"failed: {last}"
        raise OrtRunError(f"onnxruntime {ort.__version__}, in a default session (ORT_ENABLE_ALL, "
                          f"as users run it), {how}")
    with np.load(got) as data:
        outs = [data[f"arr_{i}"] for i in range(len(data.files))]
    return outs, proc.stdout.strip().splitlines()[-1]


def _validation_options() -> dict:
    """The in-process session that locates a mismatch node by node (the file validated already
    ran in a default session, ``run_isolated``): the provider-independent graph optimisations
    only, which keep every node's output a value of its own."""
    import onnxruntime as ort
    return {"graph_optimization_level": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}


def ort_session(path: Union[str, os.PathLike], device: Optional[str] = None, **session_options):
    """An onnxruntime InferenceSession on CUDA when that is usable, else on the CPU.

    CUDA is only asked for when torch sees a GPU (or ``device="cuda"``), and onnxruntime's own
    logging is silenced while the provider loads, so a machine without the CUDA libraries gets no
    screen of library errors. ``device="cpu"`` forces the CPU.
    """
    import onnxruntime as ort

    want_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for key, value in session_options.items():
        setattr(options, key, value)
    path = os.fspath(path)
    if want_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        ort.set_default_logger_severity(4)
        try:
            session = ort.InferenceSession(path, options, providers=["CUDAExecutionProvider",
                                                                     "CPUExecutionProvider"])
        except Exception as e:  # CUDA libraries missing or mismatched: fall back quietly
            log.info("onnxruntime CUDA provider unusable (%s); using the CPU", str(e).splitlines()[0][:300])
            session = None
        finally:
            ort.set_default_logger_severity(2)
        if session is not None and "CUDAExecutionProvider" in session.get_providers():
            return session
        if device == "cuda":
            raise RuntimeError("device='cuda' asked for, but onnxruntime's CUDA provider is not usable "
                               "here (check the CUDA/cuDNN libraries onnxruntime-gpu needs)")
    elif device == "cuda":
        raise RuntimeError("device='cuda' asked for, but onnxruntime has no CUDA provider here "
                           "(install onnxruntime-gpu on a machine with a GPU)")
    try:
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as e:
        if "NOT_IMPLEMENTED" in str(e) and "bfloat16" in _value_types(path):
            # (the CPU provider has no bf16 MatMul/Gemm/Conv: the file is for a GPU)
            raise RuntimeError(
                f"{path} computes in bfloat16, which onnxruntime's CPU provider cannot run "
                f"({str(e).splitlines()[0][:160]}): run it on a GPU (onnxruntime-gpu, CUDA "
                "provider), or export it for the CPU in float16 (export_onnx(..., "
                "dtype='fp16'))") from e
        raise


def _value_types(path: str) -> set:
    """The element types of a file's initializers and typed values, by name ("bfloat16", ...)."""
    try:
        import onnx
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 (unreadable: no types to name)
        return set()
    types = {t.data_type for t in model.graph.initializer}
    types |= {v.type.tensor_type.elem_type for v in (*model.graph.value_info, *model.graph.input,
                                                      *model.graph.output)}
    return {onnx.helper.tensor_dtype_to_np_dtype(t).name if t != onnx.TensorProto.BFLOAT16
            else "bfloat16" for t in types if t}
