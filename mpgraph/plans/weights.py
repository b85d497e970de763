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
from typing import Callable, Mapping, Optional, Union

import torch

from mpgraph.ir.fake import TRACED_ON, is_abstract, module_tensors, replace_tensors, tensor_groups
from mpgraph.ir.meta import WEIGHTS
from mpgraph.ir.modules import check_fits, forward_constants, is_dtensor, refresh_fused

log = logging.getLogger(__name__)


class _Safetensors(Mapping):
    """Tensors of safetensors files by name, each read when asked for (one at a time in memory).
    ``files``: (path, the names to take from it: an index's weight_map; None, all of them)."""

    def __init__(self, files: list[tuple[str, Optional[list[str]]]]):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("load_weights reads checkpoints with the safetensors package: "
                              "pip install safetensors (or pass a state dict)") from e
        opened, self._where, found_in = {}, {}, {}
        for path, names in files:
            real = os.path.realpath(path)
            if real not in opened:
                opened[real] = safe_open(path, framework="pt")
            f = opened[real]
            held = set(f.keys())
            for key in (sorted(held) if names is None else names):
                if key not in held:
                    raise ValueError(f"the index names {path} as the file holding {key}, "
                                     "which it does not hold: the index and its shards are of "
                                     "different checkpoints")
                # a checkpoint's shards never repeat a name: a repeat is two checkpoints in one
                # place (an old export beside the new one), and which one wins is not ours to pick
                if found_in.get(key, real) != real:
                    raise ValueError(f"weight {key} is in two files, {found_in[key]} and {path}: "
                                     "they hold two checkpoints; pass the files of one (or its "
                                     ".index.json)")
                found_in[key], self._where[key] = real, f

    def __getitem__(self, key):
        return self._where[key].get_tensor(key)

    def shape(self, key) -> tuple:
        """A tensor's shape, from the file's header (nothing read)."""
        return tuple(self._where[key].get_slice(key).get_shape())

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


class _ModelOf(Mapping):
    """A causal LM's tensors under the names a decoder's graphs hold them: inside the step
    wrapper, ``model.`` first (``transformer.h.0...`` is ``model.transformer.h.0...``); a name
    the weights hold as it is is taken as it is."""

    PREFIX = "model."

    def __init__(self, source: Mapping):
        self.source = source

    def resolve(self, key: str):
        """The weights' name for a graph's ``key`` (the model's own name first), else None."""
        if key.startswith(self.PREFIX) and key[len(self.PREFIX):] in self.source:
            return key[len(self.PREFIX):]
        return key if key in self.source else None

    def __contains__(self, key):
        return isinstance(key, str) and self.resolve(key) is not None

    def __getitem__(self, key):
        found = self.resolve(key)
        if found is None:
            raise KeyError(key)
        return self.source[found]

    def __iter__(self):
        return iter(self.source)

    def __len__(self):
        return len(self.source)


def model_names(weights) -> Mapping:
    """``weights`` (what load_weights takes) under the names a decoder's graphs give a causal
    LM's tensors (``_ModelOf``), each file opened once."""
    return _ModelOf(_source(weights))


def _source(weights) -> Mapping:
    """A name -> tensor mapping from a path (a .safetensors file, a directory of them, a
    checkpoint's .index.json), a list of paths, or a mapping (a state dict)."""
    if isinstance(weights, Mapping):
        return weights
    if not isinstance(weights, (str, os.PathLike, list, tuple)):
        raise TypeError(f"load_weights takes safetensors files (paths, directories, a "
                        f"checkpoint's .index.json) or state dicts, got {type(weights).__name__}"
                        + (": pass model.state_dict()" if isinstance(weights, torch.nn.Module)
                           else ""))
    paths = [weights] if isinstance(weights, (str, os.PathLike)) else list(weights)
    files = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):  # a checkpoint's index, where it has one: else every file
            indexes = sorted(f for f in os.listdir(p) if f.endswith(".safetensors.index.json"))
            if len(indexes) > 1:
                raise ValueError(f"{p} holds {len(indexes)} checkpoint indexes "
                                 f"({', '.join(indexes)}): pass the one to load")
            if indexes:
                files += _indexed(os.path.join(p, indexes[0]))
                continue
            found = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
            if not found:
                raise FileNotFoundError(f"no .safetensors file in {p}")
            files += [(f, None) for f in found]
        elif p.endswith(".json"):
            files += _indexed(p)
        elif not os.path.exists(p):
            raise FileNotFoundError(f"weights file {p} does not exist")
        elif not p.endswith(".safetensors"):
            raise ValueError(f"{p} is not a .safetensors file: load a PyTorch checkpoint with "
                             "torch.load and pass its state dict (load_weights(module, "
                             "torch.load(path, weights_only=True)))")
        else:
            files.append((p, None))
    return _Safetensors(files)


def _indexed(index: str) -> list[tuple[str, list[str]]]:
    """A checkpoint's ``.index.json`` as (shard file, the names the index maps to it)."""
    with open(index) as f:
        shards = {}
        for key, shard in json.load(f)["weight_map"].items():
            shards.setdefault(shard, []).append(key)
    return [(os.path.join(os.path.dirname(index), s), keys) for s, keys in sorted(shards.items())]


def _retarget_devices(gm: torch.fx.GraphModule, old: str, new: torch.device) -> int:
    """Ops that create tensors on the traced device (arange(device=cpu) for a mask) must create
    them where the weights now are: in the graph, and in the bodies of its higher-order ops
    (torch.export puts a region under no_grad or autocast, HF's rotary embedding, in a submodule
    of its own, whose .to(cpu) was left behind)."""
    total = edits = 0

    def move(a):
        nonlocal edits
        if isinstance(a, torch.device) and str(a) == old:
            edits += 1
            return new
        return a

    for graph in [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]:
        edits = 0
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            node.args = torch.fx.node.map_aggregate(node.args, move)
            kwargs = dict(node.kwargs)
            if kwargs.get("device") is not None and str(kwargs["device"]) == old:
                kwargs["device"], edits = new, edits + 1  # (symbolic_trace keeps device="cpu")
            node.kwargs = torch.fx.node.map_aggregate(kwargs, move)
        if edits:
            graph.recompile()
        total += edits
    gm.meta[TRACED_ON] = str(new)
    return total


def load_weights(gm: torch.nn.Module, *weights, device: Union[None, str, torch.device] = None,
                 strict: bool = True) -> torch.nn.Module:
    """Fill a converted module (or a ``convert_decoder`` decoder) with real weights, in place;
    return it.

    ``weights``: safetensors file paths, directories of them, a checkpoint's ``.index.json``, or
    state dicts (name -> tensor), searched in order. Each of the module's tensors is looked up by
    the name it had in the model (a weight the plan stored in low precision under a new name is
    found by its original name; a tensor held under several names, a tied LM head, by whichever
    the weights hold, and it stays one tensor), checked for shape, cast to the dtype and memory
    layout the plan gave it, and moved to ``device`` (default: the device it was traced for, or
    the one its tensors are on). Tensors are read lazily from safetensors: one at a time in
    memory besides the result. A value that would be inf in the dtype the plan stored its
    tensor in (1e5 in float16) is a ``WeightOverflowError`` naming it; every error (a wrong
    shape, a missing tensor with ``strict``) is raised before anything is written. With
    ``strict``, a tensor of the module with no value (still meta) afterwards is an error naming
    it, and so are weights none of whose names the module
    has (a checkpoint under another prefix: nothing would be loaded). A decoder takes the causal LM's own names (its
    ``state_dict()``, its checkpoint), and its two graphs keep sharing what they shared
    (``ConvertedDecoder.load_weights``).
    """
    if not isinstance(gm, torch.nn.Module) and hasattr(gm, "load_weights"):
        return gm.load_weights(*weights, device=device, strict=strict)  # a ConvertedDecoder
    sources = [_source(w) for w in weights]
    if not sources:
        raise TypeError("load_weights needs at least one weights file or state dict")
    used = _load_into(gm, sources, _target(gm, device), strict)
    _nothing_matched(sources, used, strict)
    refresh_fused(gm)  # stacked sibling weights rebuilt from the members just loaded
    _warn_unused(sources, used)
    return gm


def load_weights_shared(first: torch.nn.Module, second: torch.nn.Module, weights: tuple,
                        share: Callable[[], list], device=None, strict: bool = True) -> None:
    """load_weights for two modules holding some tensors in common (a decoder's graphs):
    ``first`` loaded, then ``share()`` points ``second``'s tensors at ``first``'s and returns
    the paths it could not, which alone are loaded into ``second``. The causal LM's names."""
    sources = [model_names(w) for w in weights]  # each file opened once
    if not sources:
        raise TypeError("load_weights needs at least one weights file or state dict")
    target, there = _target(first, device), _target(second, None)
    if there != target:
        raise ValueError(f"the decoder's graphs are on {there}: load_weights cannot move them "
                         f"to {target} (convert_decoder on that device)")
    # every check of both graphs before anything is written: the tensors ``second`` will
    # likely keep of its own (absent from ``first``, or another shape or dtype there) too
    mine = dict(module_tensors(first))
    likely = {path for path, t in module_tensors(second)
              if path not in mine or mine[path].shape != t.shape or mine[path].dtype != t.dtype}
    if likely:  # (``first``'s own load checks all of its tensors before writing one)
        _load_into(second, sources, target, strict, only=likely, check_only=True)
    used = _load_into(first, sources, target, strict)
    _nothing_matched(sources, used, strict)  # (before the graphs part: nothing changed yet)
    own = set(share()) & {path for path, _ in module_tensors(second)}
    if own:
        used |= _load_into(second, sources, target, strict, only=own)
    refresh_fused(first)
    refresh_fused(second)
    _warn_unused(sources, used)


def _target(gm: torch.nn.Module, device) -> torch.device:
    """Where loaded tensors go: ``device``, else the device gm was traced for (a plan on meta),
    else the one its tensors are on. ``device`` as tensors name it ("cuda" is the current CUDA
    device, cuda:0 unless set; "cpu:0" the CPU): the traced device it is compared with is, and
    the device constants moved to it would differ from the materialised model's by name alone."""
    if device is not None:
        return torch.empty(0, device=device).device
    traced = _traced_on(gm)
    if traced:
        return torch.device(traced)
    real = next((t.device for _, t in module_tensors(gm) if t.device.type != "meta"), None)
    return real or torch.device("cpu")


def _traced_on(gm: torch.nn.Module):
    """The device a plan on meta was traced for (``finish_``), else None."""
    return gm.meta.get(TRACED_ON) if isinstance(getattr(gm, "meta", None), dict) else None


def _nothing_matched(sources: list, used: set, strict: bool) -> None:
    """Weights of which no tensor has a name of the module (a checkpoint of the model under a
    head, every key under 'bert.') loaded nothing, quietly: with strict, an error (nothing was
    loaded; a load that matches part of the weights is not one, each shard of a checkpoint
    loaded by a call of its own included)."""
    if used or not strict:
        return
    first = next((k for src in sources for k in src), None)
    if first is None:
        raise ValueError("the weights are empty: nothing to load")
    raise ValueError(f"no tensor of the weights has a name of the converted module (the "
                     f"weights' first key: {first!r}): load weights named as the model's own "
                     "state_dict() names them (strip or add a prefix), or pass strict=False")


def _warn_unused(sources: list, used: set) -> None:
    unused = [k for s in sources for base in [s.source if isinstance(s, _ModelOf) else s]
              for k in base if k not in used]
    if unused:
        log.warning("%d tensors of the weights are not in the module (first: %s)", len(unused),
                    ", ".join(unused[:5]))


def _load_into(gm: torch.nn.Module, sources: list, target: torch.device, strict: bool,
               only: Optional[set] = None, check_only: bool = False) -> set:
    """load_weights' work on one module (the paths in ``only``, where given); returns the keys
    of the weights it used, as the weights name them. ``check_only``: every check (values of
    tensors without one read for it), nothing written."""
    sharded = [path for path, t in module_tensors(gm) if is_dtensor(t)]
    if sharded:  # (a plain tensor in place of FSDP's DTensor breaks its forward)
        raise ValueError(f"the module's tensors are sharded by FSDP (DTensors: {sharded[0]}, ...): "
                         "load_weights cannot write into shards; call load_weights before "
                         "fully_shard, or load with torch.distributed.checkpoint.state_dict's "
                         "set_model_state_dict; nothing was loaded")
    traced = _traced_on(gm)
    renamed = {r.name: r.source for r in getattr(gm, "meta", {}).get(WEIGHTS, [])}
    missing, loaded, used = [], 0, set()
    # a tensor held under several names (a tied LM head and embedding) is one tensor: loaded
    # from whichever name the weights hold (HF checkpoints keep one), put back at every name;
    # a low-precision copy from its original's names
    groups = tensor_groups(gm)
    mates = {p: paths for _, paths in groups for p in paths}
    fused = gm.__dict__.get("fused_weights")
    stacks = fused.stacks if fused is not None else set()  # built from their members after
    entries, moves = [], []  # (tensor, paths, keys, weights, key) found; (paths, tensor) not
    for t, paths in groups:
        paths = [p for p in paths if (only is None or p in only) and p not in stacks]
        if not paths:
            continue
        keys = list(dict.fromkeys([renamed.get(p, p) for p in paths] + [
            m for p in paths if p in renamed for m in mates.get(renamed[p], ())]))
        found = next(((s, k) for k in keys for s in sources if k in s), None)
        if found is None:
            if t.device.type == "meta":
                missing += [p if renamed.get(p, p) == p else f"{p} (from {renamed[p]})"
                            for p in paths]
            elif t.device != target:
                moves.append((paths, t))
            continue
        entries.append((t, paths, keys, *found))
    # an error is raised before anything is written (a module left holding two checkpoints'
    # tensors would compute neither's answer): a tensor left without a value, a wrong shape ...
    made = forward_constants(missing)
    if made:
        raise ValueError(f"{made}; nothing was loaded")
    if missing and strict:
        raise ValueError(f"{len(missing)} tensors of the converted module have no value in the "
                         f"weights: {', '.join(missing[:10])}"
                         + (" ..." if len(missing) > 10 else "")
                         + " (non-persistent buffers, such as rotary inv_freq, are not in "
                           "checkpoints: build them for real beside meta parameters, or pass "
                           "them in a dict; a checkpoint's shards: pass them all in one call, or "
                           "load them one call each with strict=False); nothing was loaded")
    for t, paths, keys, source, key in entries:
        shape = _shape_of(source, key)
        if shape != tuple(t.shape):
            raise ValueError(f"weight {key}: shape {shape}, the converted module has "
                             f"{tuple(t.shape)}; nothing was loaded")
    # ... a value that would be inf in the dtype the plan stored its tensor in (1e5 in float16):
    # tensors with values are checked first (a low one's
    # weights read twice: the check, then the load); tensors without (meta: the plan made
    # without weights) as they are read, set only once all of them are
    check_fits(((_named(key, paths), source[key], t.dtype) for t, paths, keys, source, key
                in entries if not is_abstract(t) and _low(t)), "load_weights",
               "nothing was loaded")  # (a generator: one tensor read at a time)
    if check_only:
        check_fits(((_named(key, paths), source[key], t.dtype) for t, paths, keys, source, key
                    in entries if is_abstract(t) and _low(t)), "load_weights",
                   "nothing was loaded")
        return set()
    pending = []
    for t, paths, keys, source, key in sorted(entries, key=lambda e: not is_abstract(e[0])):
        value = source[key]
        if is_abstract(t):
            check_fits([(_named(key, paths), value, t.dtype)], "load_weights",
                       "nothing was loaded")
        # in the planned dtype and layout (ChannelsLast stores conv weights NHWC)
        placed = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target)
        with torch.no_grad():
            placed.copy_(value)
        if is_abstract(t):
            pending.append((paths, placed))
        else:
            replace_tensors(gm, paths, placed)
        used.update(s.resolve(k) if isinstance(s, _ModelOf) else k
                    for k in keys for s in sources if k in s)
        loaded += 1
    for paths, placed in pending + [(paths, t.to(target)) for paths, t in moves]:
        replace_tensors(gm, paths, placed)
    if traced is not None and isinstance(gm, torch.fx.GraphModule) and str(target) != traced:
        _retarget_devices(gm, traced, target)
    log.info("loaded %d tensors onto %s", loaded, target)
    return used


def _shape_of(source: Mapping, key: str) -> tuple:
    """The shape of ``source[key]``, without reading a safetensors file's tensor."""
    if isinstance(source, _ModelOf):
        return _shape_of(source.source, source.resolve(key))
    if isinstance(source, _Safetensors):
        return source.shape(key)
    return tuple(source[key].shape)


def _low(t: torch.Tensor) -> bool:
    """A floating tensor in a dtype of narrower range than float32's (float16, bfloat16)."""
    return t.is_floating_point() and torch.finfo(t.dtype).max < torch.finfo(torch.float32).max


def _named(key: str, paths: list) -> str:
    """A tensor as the weights name it, and as the module does where that differs."""
    return key if paths[0] == key else f"{key} (the module's {paths[0]})"
