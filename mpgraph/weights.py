"""Planning without weights, and loading the weights into a converted module later.

A model built on the meta device has shapes and dtypes but no values. Tracing it on meta tensors
works, but the traced graph is not always the one the real model gives: kernels pick output
layouts by device (CPU attention returns a (batch, sequence, heads, dim) layout, its meta function
a (batch, heads, sequence, dim) one), so a ``.contiguous()`` that is a no-op on the real tensors
becomes a node on meta ones, and node names shift. The plan must be the real model's plan, node by
node, so we trace fake tensors that claim the device the model will run on: every parameter,
buffer and example input becomes a ``FakeTensor`` on that device (no storage is allocated), and
torch.export runs the very kernels' fake implementations it runs for a real model (it traces real
models through fake tensors too). Conversion's passes run in the same fake mode; at the end the
converted module's tensors are meta again, except those the model had real values for.

``load_weights`` then fills a converted module with real weights, one tensor at a time, each
cast to the dtype the plan stored it in: from safetensors files (a checkpoint's shards, read
lazily) or state dicts. The result is what converting the materialised model gives.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Iterable, Mapping, Optional, Union

import torch

from .device_specs import DeviceSpec
from .graph_utils import fetch_attr, set_attr, with_data
from .meta import WEIGHTS

log = logging.getLogger(__name__)

TRACED_ON = "mpgraph.traced_on"  # gm.meta: the device an abstract (meta) model was traced for


def is_abstract(t: torch.Tensor) -> bool:
    """A tensor without values: on the meta device, or a FakeTensor."""
    from torch._subclasses.fake_tensor import is_fake
    return t.device.type == "meta" or is_fake(t)


def _tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and plain tensor attribute (export's lifted constants), by path."""
    seen = set()
    for path, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name, value in list(mod._parameters.items()) + list(mod._buffers.items()):
            if value is not None and prefix + name not in seen:
                seen.add(prefix + name)
                yield prefix + name, value
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and prefix + name not in seen:
                seen.add(prefix + name)
                yield prefix + name, value


def _replace(root: torch.nn.Module, path: str, value: torch.Tensor) -> None:
    """Put ``value`` at ``path``, as the same kind of attribute (Parameter, buffer, plain)."""
    set_attr(root, path, with_data(fetch_attr(root, path), value))


def has_meta_tensors(model: torch.nn.Module, args: tuple = (), kwargs: Optional[dict] = None) -> bool:
    from torch.utils import _pytree as pytree
    inputs = pytree.tree_leaves((args, kwargs or {}))
    return any(t.device.type == "meta" for _, t in _tensors(model)) or \
        any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in inputs)


def trace_device(spec: DeviceSpec) -> torch.device:
    """The device an abstract model is traced for: the target's kind where this machine can fake
    it (fake CUDA tensors need CUDA present), else the CPU."""
    if spec.kind == "gpu":
        if torch.cuda.is_available():
            return torch.device("cuda")
        log.info("planning for %s without CUDA here: tracing for the CPU (layout-only nodes "
                 "such as .contiguous() may differ from a CUDA trace)", spec.name)
    return torch.device("cpu")


class Abstract:
    """The fake mode an abstract model is traced and converted in, and the device it fakes."""

    def __init__(self, device: torch.device):
        from torch._subclasses.fake_tensor import FakeTensorMode
        self.device = device
        # small real tensors (a constant a pass builds) are welcome: they become fakes
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        with self.mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)

    def fake_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Fakes of the example inputs on the traced device (ones already faked stay as they are)."""
        from torch.utils import _pytree as pytree

        def fake(x):
            if not isinstance(x, torch.Tensor) or getattr(x, "fake_mode", None) is self.mode:
                return x
            return self.fake(x)

        return pytree.tree_map(fake, (args, kwargs))

    def fake_module_(self, module: torch.nn.Module) -> None:
        """Every tensor of ``module`` (a working copy) replaced by a fake on the traced device."""
        for path, t in list(_tensors(module)):
            _replace(module, path, self.fake(t))

    def finish_(self, gm: torch.nn.Module, model: torch.nn.Module) -> None:
        """Back from fakes: the converted module's tensors become meta, then take the values the
        model had (buffers built for real beside meta parameters, say), cast as the plan stored them."""
        for path, t in list(_tensors(gm)):
            if is_abstract(t) and t.device.type != "meta":
                _replace(gm, path, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                       device="meta"))
        gm.meta[TRACED_ON] = str(self.device)
        real = {name: t for name, t in _tensors(model) if not is_abstract(t)}
        if real:
            load_weights(gm, real, device=self.device, strict=False)


def fake_mode(abstract: Optional[Abstract]):
    """The context conversion's passes run in: the fake mode of an abstract model, else none."""
    return abstract.mode if abstract is not None else contextlib.nullcontext()


class _Safetensors(Mapping):
    """Tensors of safetensors files by name, each read when asked for (one at a time in memory)."""

    def __init__(self, paths: list[str]):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("load_weights reads checkpoints with the safetensors package: "
                              "pip install safetensors (or pass a state dict)") from e
        self._files = [safe_open(p, framework="pt") for p in paths]
        self._where = {}
        for f in self._files:
            for key in f.keys():
                self._where[key] = f

    def __getitem__(self, key):
        return self._where[key].get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def _source(weights) -> Mapping:
    """A name -> tensor mapping from a path (a .safetensors file, a directory of them, a
    checkpoint's .index.json), a list of paths, or a mapping (a state dict)."""
    if isinstance(weights, Mapping):
        return weights
    paths = [weights] if isinstance(weights, (str, os.PathLike)) else list(weights)
    files = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
            if not found:
                raise FileNotFoundError(f"no .safetensors file in {p}")
            files += found
        elif p.endswith(".json"):
            with open(p) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            files += [os.path.join(os.path.dirname(p), s) for s in shards]
        elif not os.path.exists(p):
            raise FileNotFoundError(f"weights file {p} does not exist")
        else:
            files.append(p)
    return _Safetensors(files)


def _retarget_devices(gm: torch.fx.GraphModule, old: str, new: torch.device) -> int:
    """Ops that create tensors on the traced device (arange(device=cpu) for a mask) must create
    them where the weights now are."""
    edits = 0

    def move(a):
        nonlocal edits
        if isinstance(a, torch.device) and str(a) == old:
            edits += 1
            return new
        return a

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        node.args = torch.fx.node.map_aggregate(node.args, move)
        kwargs = dict(node.kwargs)
        if kwargs.get("device") is not None and str(kwargs["device"]) == old:
            kwargs["device"], edits = new, edits + 1
        node.kwargs = torch.fx.node.map_aggregate(kwargs, move)
    if edits:
        gm.recompile()
    gm.meta[TRACED_ON] = str(new)
    return edits


def load_weights(gm: torch.nn.Module, *weights, device: Union[None, str, torch.device] = None,
                 strict: bool = True) -> torch.nn.Module:
    """Fill a converted module with real weights, in place; return it.

    ``weights``: safetensors file paths, directories of them, a checkpoint's ``.index.json``, or
    state dicts (name -> tensor), searched in order. Each of the module's tensors is looked up by
    the name it had in the model (a weight the plan stored in low precision under a new name is
    found by its original name), checked for shape, cast to the dtype and memory layout the plan
    gave it, and moved to ``device`` (default: the device it was traced for). Tensors are read
    lazily from safetensors: one at a time in memory besides the result. With ``strict``, a
    tensor of the module with no value (still meta) afterwards is an error naming it.
    """
    sources = [_source(w) for w in weights]
    if not sources:
        raise TypeError("load_weights needs at least one weights file or state dict")
    traced = gm.meta.get(TRACED_ON) if hasattr(gm, "meta") else None
    target = torch.device(device) if device is not None else torch.device(traced or "cpu")
    renamed = {r.name: r.source for r in getattr(gm, "meta", {}).get(WEIGHTS, [])}
    missing, loaded, used = [], 0, set()
    for path, t in list(_tensors(gm)):
        key = renamed.get(path, path)
        found = next((s for s in sources if key in s), None)
        if found is None:
            if t.device.type == "meta":
                missing.append(path if key == path else f"{path} (from {key})")
            elif t.device != target:
                _replace(gm, path, t.to(target))
            continue
        value = found[key]
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"weight {key}: shape {tuple(value.shape)}, the converted module "
                             f"has {tuple(t.shape)}")
        # in the planned dtype and layout (ChannelsLast stores conv weights NHWC)
        placed = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target)
        with torch.no_grad():
            placed.copy_(value)
        _replace(gm, path, placed)
        used.add(key)
        loaded += 1
    if traced is not None and isinstance(gm, torch.fx.GraphModule) and str(target) != traced:
        _retarget_devices(gm, traced, target)
    unused = [k for s in sources if isinstance(s, _Safetensors) for k in s if k not in used]
    if unused:
        log.warning("%d tensors of the weights are not in the module (first: %s)", len(unused),
                    ", ".join(unused[:5]))
    if missing and strict:
        raise ValueError(f"{len(missing)} tensors of the converted module have no value in the "
                         f"weights: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else "")
                         + " (non-persistent buffers, such as rotary inv_freq, are not in "
                           "checkpoints: build them for real beside meta parameters, or pass "
                           "them in a dict)")
    log.info("loaded %d tensors onto %s", loaded, target)
    return gm
