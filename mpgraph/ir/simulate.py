"""Run a converted graph as its target computes it, where this machine would emulate it slowly.

A plan for a GPU, checked on a CPU without fast fp16 (an AVX2-only one runs fp16 and bf16 matmuls
at ~1% of float32), would spend minutes in emulated kernels. What a GPU computes is known: its
Tensor Core and elementwise kernels read fp16/bf16 values, compute in float32, and round what they
store to the low dtype. So this interpreter holds every value in float32 storage, rounded to the
dtype the plan gives it (what fp16/bf16 storage keeps: overflow to inf, flush below the
subnormals), and computes each op in float32 from those values. Accumulation order differs from
any real kernel; what is stored between ops is exact. Dtype semantics (which op returns which
dtype) come from a run on fake tensors instead (``fake_dtypes``), which costs no arithmetic.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from mpgraph.ir.graph import (RecordingInterpreter, flat_inputs, fresh, input_nodes, overlapping,
                             owned, seeded, state_kept, storage_key)
from mpgraph.ir.fake import module_tensors
from mpgraph.ir.meta import PACKED, PRECISION, TENSOR, is_inserted_cast, planned_dtype

log = logging.getLogger(__name__)

_LOW = (torch.float16, torch.bfloat16)
_CHECKS = {getattr(torch.ops.aten, name, None) for name in
           ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size")} - {None}


def _up(value):
    """Low-precision tensors as float32 (exact), anything else as it is."""
    return pytree.tree_map(
        lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype in _LOW else v, value)


def _round_(value, dtypes):
    """Float32 results rounded, in place, to the dtype the plan gives them: in place so that a
    view and its base, or an in-place op and what it wrote into, stay one storage."""
    if isinstance(value, torch.Tensor):
        # an expanded view (stride 0) holds its source's values: rounded where the source is
        if dtypes in _LOW and value.dtype == torch.float32 and not overlapping(value):
            value.copy_(value.to(dtypes))
        return
    if isinstance(value, (tuple, list)) and isinstance(dtypes, tuple) and len(dtypes) == len(value):
        for v, d in zip(value, dtypes):
            _round_(v, d)


class SimulatingInterpreter(RecordingInterpreter):
    """Runs a converted graph with float32 arithmetic and low-precision storage (see above).

    Every value in it is a float32 tensor of its own or a view of one: parameters and buffers
    are read as copies (float32 from stored fp16/bf16 weights), so rounding in place never
    touches the module."""

    def __init__(self, gm: torch.fx.GraphModule, on_node, rounding: bool = True):
        super().__init__(gm, on_node)
        self.copies: dict = {}
        # False: nothing is rounded, every op computes in float32 from the stored weights: what
        # the plan's graph gives in float32 (the run-time guard's reference)
        self.rounding = rounding

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "call_function" and getattr(n.target, "overloadpacket", n.target) in _CHECKS:
            return None  # export's dtype asserts: the values are float32 here by design
        if n.op in ("output", "placeholder"):
            return super().run_node(n)
        if n.op == "get_attr":  # one copy per attribute: every read sees what was written into it
            if n.target not in self.copies:
                value = self.fetch_attr(n.target)
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value = value.float() if value.dtype in _LOW else value.clone()
                self.copies[n.target] = value  # (a submodule of torch.cond: as it is)
            result = self.copies[n.target]
        elif not self.rounding and is_inserted_cast(n):
            # float32's own value: the cast itself would overflow a value beyond fp16's range
            # to inf here, as the converted run does, and hide it from the guard
            result = fresh(_up(self.env[n.args[0]]))
        else:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            low = planned_dtype(n.meta.get(TENSOR), n.meta.get(PRECISION))
            low = next((d for d in pytree.tree_leaves(low) if d in _LOW), None) \
                if self.rounding else None
            if low is not None and n.op in ("call_function", "call_method"):
                self._refused(n, low, args, kwargs)
            # a recurrent layer in its planned low dtype: by this machine's kernel (_recurrent)
            result = None
            if low is not None and n.op == "call_module":
                result = _recurrent(self.fetch_attr(n.target), low, args, kwargs)
            elif low is not None and n.op == "call_function":
                result = _recurrent_op(n.target, low, args, kwargs)
            if result is None and n.op == "call_module":
                module = self.fetch_attr(n.target)
                key = ("module", n.target)  # one copy of its state per run, as for attributes
                if key not in self.copies:
                    self.copies[key] = {
                        k: v.float() if v.dtype in _LOW else v.clone() for k, v in
                        list(module.named_parameters()) + list(module.named_buffers())}
                result = torch.func.functional_call(module, self.copies[key], tuple(_up(args)),
                                                    _up(kwargs))
            elif result is None:
                args = tuple(self._body(a) for a in args)  # (a higher-order op's: simulated)
                result = getattr(self, n.op)(n.target, _up(args), _up(kwargs))
            result = _up(result)  # an explicit cast to a low dtype: a fresh float32 copy
            result = self._apart(n, result)
            if self.rounding:
                _round_(result, planned_dtype(n.meta.get(TENSOR), n.meta.get(PRECISION)))
        self._on_node(n, result)
        return result

    def _body(self, value):
        """A higher-order op's body (torch.export's submodule for a region under no_grad or
        autocast: transformers 5.17's rotary embedding) run by this interpreter too: its own
        dtype asserts name the dtypes it was traced with, which the float32 values here are
        not (a bf16 Llama's GPU plan failed its check with "Tensor dtype mismatch")."""
        if not isinstance(value, torch.fx.GraphModule):
            return value

        def run(*args):
            inner = SimulatingInterpreter(value, lambda node, result: None, self.rounding)
            return inner.run(*args, enable_io_processing=False)
        return run

    def _refused(self, n: torch.fx.Node, low: torch.dtype, args, kwargs) -> None:
        """torch's error where the converted run raises it: a constant beyond ``low``'s range
        written into a low value (``masked_fill_(m, -1e9)``, ``fill_``, ``clamp_(min=-1e9)`` in
        fp16: "value cannot be converted to type c10::Half without overflow"), which float32
        storage takes. The op runs once more, on copies in the dtypes the converted run has."""
        top = torch.finfo(low).max

        def beyond(v):  # (an int too: masked_fill_(m, -100000) is refused alike)
            if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.dtype.is_complex:
                v = v.item()
            return isinstance(v, (int, float)) and not isinstance(v, bool) \
                and top < abs(v) < math.inf

        if not any(beyond(v) for v in pytree.tree_leaves((args, kwargs))):
            return

        def as_run(a: torch.fx.Node):
            value, dtype = self.env[a], planned_dtype(a.meta.get(TENSOR), a.meta.get(PRECISION))
            if not isinstance(value, torch.Tensor):
                return value
            return value.to(dtype, copy=True) if dtype in _LOW else value.clone()

        try:  # (its own random numbers: the run's stream goes on as the converted run's)
            with torch.random.fork_rng(devices=[]):
                getattr(self, n.op)(n.target, *torch.fx.node.map_arg((n.args, n.kwargs), as_run))
        except RuntimeError as e:
            if "without overflow" in str(e):
                raise
        except Exception:  # (any other failure: this machine's, the simulation goes on)
            pass

    def _apart(self, n: torch.fx.Node, result):
        """``result`` copied where it is its input's storage here but not in the converted run:
        values of two dtypes there (``h_to_f32 = h.to(float32)`` of an fp16 ``h``) are two
        tensors, here both float32 and one (``.to`` returns its input); a write into one would
        show in the other, and the check report a write the converted module loses."""
        if not isinstance(result, torch.Tensor) or storage_key(result) is None:
            return result
        mine = planned_dtype(n.meta.get(TENSOR), n.meta.get(PRECISION))
        for a in input_nodes(n):
            value = self.env.get(a)
            if isinstance(value, torch.Tensor) and storage_key(value) == storage_key(result) \
                    and planned_dtype(a.meta.get(TENSOR), a.meta.get(PRECISION)) != mine:
                return result.clone()
        return result


def _recurrent(module: torch.nn.Module, low: torch.dtype, args, kwargs):
    """A low-precision recurrent layer (LSTM, GRU, RNN) run in ``low`` by this machine's own
    kernel: a GPU's keeps the hidden state in the low dtype from step to step, which rounding
    only what the layer returns misses (a 2-layer GRU's error was 1.75x the simulation's).
    None for any other module, or where this machine has no such kernel."""
    if not isinstance(module, (torch.nn.RNNBase, torch.nn.RNNCellBase)):
        return None
    copy = {k: v.to(low) if v.is_floating_point() else v for k, v in
            (*module.named_parameters(), *module.named_buffers())}
    return _in_low(lambda *a, **k: torch.func.functional_call(module, copy, a, k), low, args,
                   kwargs)


# the cells, and the whole layers as torch.export keeps an nn.GRU/LSTM/RNN (``aten.gru.input``;
# ``.data``: a PackedSequence): the op the module's own forward calls, its flat weights arguments
_RECURRENT_OPS = {getattr(torch.ops.aten, name).default for name in
                  ("gru_cell", "lstm_cell", "rnn_tanh_cell", "rnn_relu_cell")} | \
                 {getattr(getattr(torch.ops.aten, name), overload) for overload in ("input", "data")
                  for name in ("gru", "lstm", "rnn_tanh", "rnn_relu")}


def _recurrent_op(target, low: torch.dtype, args, kwargs):
    """A recurrent layer or cell as torch.export keeps it (``aten.gru.input``: an nn.GRU;
    ``aten.gru_cell``: a hand-written loop over ``nn.GRUCell``) run in ``low`` by this machine's
    kernel, as ``_recurrent`` runs the modules (the state, and a cell's gates' pre-activations,
    are stored low: a 2-layer GRU erred 2x the simulation's, a 30-step LSTMCell loop 2x); None
    for any other op, or where this machine has no such kernel."""
    return _in_low(target, low, args, kwargs) if target in _RECURRENT_OPS else None


def _in_low(fn, low: torch.dtype, args, kwargs):
    """``fn`` on the float arguments in ``low``; None where this machine has no such kernel
    (then simulated as any node)."""
    def down(v):
        return v.to(low) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    try:
        return fn(*pytree.tree_map(down, tuple(args)), **pytree.tree_map(down, kwargs))
    except RuntimeError:
        return None


def run_simulated(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, on_node,
                  rounding: bool = True) -> Any:
    """``run_recording``, with the target's arithmetic instead of this machine's (see above);
    ``rounding=False``: float32 throughout, nothing rounded to the plan's dtypes."""
    flat = fresh(flat_inputs(gm, args, kwargs))
    with torch.no_grad(), seeded(), state_kept(gm):
        return owned(SimulatingInterpreter(gm, on_node, rounding).run(
            *flat, enable_io_processing=False), gm)


def _dtypes(value):
    """A value's dtype, or a tuple of its parts' (nested: nn.LSTM returns (out, (h, c)))."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (tuple, list)) and any(isinstance(v, (torch.Tensor, tuple, list))
                                                for v in value):
        return tuple(_dtypes(v) for v in value)
    return None


def fake_dtypes(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> dict:
    """The dtype every node really produces (a tuple for multi-output nodes), from a run without
    arithmetic: torch's own type rules. On meta tensors first (the kernels fake tensors run too,
    2-2.5x faster without their bookkeeping: BERT-base 8x128's 0.57 -> 0.22 s), then, where that
    run is refused (``_meta_dtypes``) or fails (an op without a meta kernel, a value read, a
    tensor the graph makes on the CPU), on fake tensors."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    # a model without values (mpgraph.ir.fake) already runs under a fake mode, its weights
    # fakes of it: that mode, so that they are not converted again on every op
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    flat = flat_inputs(gm, args, kwargs)
    mode = detect_fake_mode(flat)
    if mode is None:
        try:
            return _meta_dtypes(gm, flat)
        except Exception as e:  # noqa: BLE001 - any failure of the fast run: the fake one says
            log.debug("dtypes from fake tensors: the run on meta tensors failed (%s: %s)",
                      type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    # (a shape environment gives a value read from a tensor, ``.item()``, a symbol: the dtypes
    # after it are still known)
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    dtypes = {}

    def record(node, value):
        dtypes[node] = _dtypes(value)

    with mode, torch.no_grad():
        fakes = [mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v
                 for v in flat]
        RecordingInterpreter(gm, record).run(*fakes, enable_io_processing=False)
    return dtypes


_META = torch.device("meta")
# ops whose meta kernels give CUDA's dtypes where the CPU's differ (torch's meta kernels take a
# meta tensor for a CUDA one): these norms' mean and rstd outputs are float32 on meta, the
# input's fp16/bf16 on the CPU (native_layer_norm, native_batch_norm,
# _native_batch_norm_legit*, _batch_norm_with_update*)
_CUDA_RULED = ("native_layer_norm", "native_batch_norm", "batch_norm_with_update",
               "batch_norm_no_update")


def _meta_dtypes(gm: torch.fx.GraphModule, flat: list) -> dict:
    """``fake_dtypes`` from a run on meta tensors: the inputs, weights and constants as meta
    tensors of their shapes, strides and dtypes, every device an op is given the meta device;
    nothing of the graph is changed. Refused (raises, and the fake run takes it): a graph with an
    autocast region (autocast rules by device: a meta tensor is on none), an op of
    ``_CUDA_RULED``, a linear over a packed weight (an opaque CPU tensor), or a submodule holding
    tensors (it would run with its own, and swapping them in place is a change to a module the
    user may hold)."""
    for g in [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]:  # (with bodies)
        for n in g.graph.nodes:
            if "autocast" in str(n.target).lower() or n.meta.get(PACKED) or (
                    n.op == "call_module"
                    and next(iter(module_tensors(g.get_submodule(n.target))), None) is not None
            ) or getattr(n.target, "__name__", "").lstrip("_").startswith(_CUDA_RULED):
                raise NotImplementedError(f"no meta run for {n.format_node()}")

    memo = {}

    def meta(v):
        if not isinstance(v, torch.Tensor) or v.device.type == "meta":
            return v
        got = memo.get(id(v))
        if got is None:  # (the tensor kept beside its meta copy: its id stays its own)
            got = memo[id(v)] = (torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                                     device=_META)
                                 if v.layout == torch.strided else v.to(_META), v)
        return got[0]

    def on_meta(v):
        return _META if isinstance(v, torch.device) else v

    class MetaInterpreter(RecordingInterpreter):
        def fetch_attr(self, target):
            return pytree.tree_map(meta, super().fetch_attr(target))

        def call_function(self, target, args, kwargs):
            if "device" in kwargs:
                kwargs = {**kwargs, "device": _META}
            return super().call_function(target, pytree.tree_map(on_meta, args), kwargs)

    dtypes = {}

    def record(node, value):
        dtypes[node] = _dtypes(value)

    with torch.no_grad():
        MetaInterpreter(gm, record).run(*[meta(v) for v in flat], enable_io_processing=False)
    return dtypes
