"""Loading the weights into a converted module later (a plan made without them, on the meta
device: see mpgraph.ir.fake).

``load_weights`` fills a converted module with real weights, one tensor at a time, each
cast to the dtype the plan stored it in: from safetensors files (a checkpoint's shards, read
lazily) or state dicts. The result is what converting the materialised model gives.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Mapping, Union

import torch

from mpgraph.ir.fake import TRACED_ON, module_tensors, replace_tensor
from mpgraph.ir.meta import WEIGHTS

log = logging.getLogger(__name__)


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
    for path, t in list(module_tensors(gm)):
        key = renamed.get(path, path)
        found = next((s for s in sources if key in s), None)
        if found is None:
            if t.device.type == "meta":
                missing.append(path if key == path else f"{path} (from {key})")
            elif t.device != target:
                replace_tensor(gm, path, t.to(target))
            continue
        value = found[key]
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"weight {key}: shape {tuple(value.shape)}, the converted module "
                             f"has {tuple(t.shape)}")
        # in the planned dtype and layout (ChannelsLast stores conv weights NHWC)
        placed = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target)
        with torch.no_grad():
            placed.copy_(value)
        replace_tensor(gm, path, placed)
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
