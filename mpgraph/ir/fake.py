"""Planning without weights: a model on the meta device is traced and converted as fakes.

A model built on the meta device has shapes and dtypes but no values. Tracing it on meta tensors
works, but the traced graph is not always the one the real model gives: kernels pick output
layouts by device (CPU attention returns a (batch, sequence, heads, dim) layout, its meta function
a (batch, heads, sequence, dim) one), so a ``.contiguous()`` that is a no-op on the real tensors
becomes a node on meta ones, and node names shift. The plan must be the real model's plan, node by
node, so we trace fake tensors that claim the device the model will run on: every parameter,
buffer and example input becomes a ``FakeTensor`` on that device (no storage is allocated), and
torch.export runs the very kernels' fake implementations it runs for a real model (it traces real
models through fake tensors too). Conversion's passes run in the same fake mode; at the end the
converted module's tensors are meta again, and ``mpgraph.load_weights`` fills them.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Optional

import torch

from mpgraph.ir.graph import fetch_attr, set_attr, with_data

log = logging.getLogger(__name__)

TRACED_ON = "mpgraph.traced_on"  # gm.meta: the device an abstract (meta) model was traced for


def is_abstract(t: torch.Tensor) -> bool:
    """A tensor without values: on the meta device, or a FakeTensor."""
    from torch._subclasses.fake_tensor import is_fake
    return t.device.type == "meta" or is_fake(t)


def module_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and plain tensor attribute (export's lifted constants), by path:
    once per module attribute (a submodule held under two names, ``self.alias = self.fc``, is
    one holder of its weight; a weight tied into two modules has two)."""
    seen = set()
    for path, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name, value in list(mod._parameters.items()) + list(mod._buffers.items()):
            if value is not None and (id(mod), name) not in seen:
                seen.add((id(mod), name))
                yield prefix + name, value
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and (id(mod), name) not in seen:
                seen.add((id(mod), name))
                yield prefix + name, value


def replace_tensor(root: torch.nn.Module, path: str, value: torch.Tensor) -> None:
    """Put ``value`` at ``path``, as the same kind of attribute (Parameter, buffer, plain)."""
    set_attr(root, path, with_data(fetch_attr(root, path), value))


def tensor_groups(root: torch.nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    """``module_tensors`` by tensor: each tensor with every path holding it (a tied LM head and
    its embedding: one tensor, two paths)."""
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for path, t in module_tensors(root):
        groups.setdefault(id(t), (t, []))[1].append(path)
    return list(groups.values())


def held_counts(root: torch.nn.Module) -> dict[int, int]:
    """How many names each tensor of ``root`` is held under, by ``id`` (tied weights: more
    than one)."""
    return {id(t): len(paths) for t, paths in tensor_groups(root)}


def replace_tensors(root: torch.nn.Module, paths: list[str], value: torch.Tensor) -> None:
    """``value`` at each of ``paths`` as one object (what the first path held decides its kind),
    so that a tensor held under several names stays one."""
    replace_tensor(root, paths[0], value)
    shared = fetch_attr(root, paths[0])
    for path in paths[1:]:
        set_attr(root, path, shared)


def has_meta_tensors(model: torch.nn.Module, args: tuple = (), kwargs: Optional[dict] = None) -> bool:
    from torch.utils import _pytree as pytree
    inputs = pytree.tree_leaves((args, kwargs or {}))
    return any(t.device.type == "meta" for _, t in module_tensors(model)) or \
        any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in inputs)


def has_abstract_tensors(model: torch.nn.Module, args: tuple = (),
                         kwargs: Optional[dict] = None) -> bool:
    """Whether the model or its inputs hold tensors without values (meta or fake)."""
    from torch.utils import _pytree as pytree
    return any(is_abstract(t) for _, t in module_tensors(model)) or any(
        isinstance(t, torch.Tensor) and is_abstract(t)
        for t in pytree.tree_leaves((args, kwargs or {})))


def trace_device(args: tuple, kwargs: Optional[dict] = None) -> torch.device:
    """The device an abstract model is traced for: where its example inputs are, as the
    materialised model given them runs there (whatever the target: an A100 plan made from CPU
    inputs is a CPU trace on a machine with a GPU as on one without); inputs all on meta say
    nothing, so torch's default device, where the forward's own tensors (``torch.ones(n)``) are
    made. The plan then is the materialised model's node by node, device constants included,
    and never depends on whether this machine has CUDA."""
    from torch.utils import _pytree as pytree
    given = next((t.device for t in pytree.tree_leaves((args, kwargs or {}))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"), None)
    if given is None:
        given = torch.get_default_device()
    return given if given.type != "meta" else torch.device("cpu")  # (with torch.device("meta"))


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
        for t, paths in tensor_groups(module):
            replace_tensors(module, paths, self.fake(t))

    def finish_(self, gm: torch.nn.Module) -> None:
        """Back from fakes: the converted module's tensors become meta (``load_weights`` then
        gives them values, the model's real tensors first: buffers built beside meta parameters)."""
        for t, paths in tensor_groups(gm):
            if is_abstract(t) and t.device.type != "meta":
                replace_tensors(gm, paths, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                               device="meta"))
        gm.meta[TRACED_ON] = str(self.device)


def fake_mode(abstract: Optional[Abstract]):
    """The context conversion's passes run in: the fake mode of an abstract model, else none."""
    return abstract.mode if abstract is not None else contextlib.nullcontext()
