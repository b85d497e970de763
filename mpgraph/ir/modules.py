"""Small modules that rewritten graphs call, so that ``.train()``/``.eval()`` keep their meaning.

torch.export bakes the training flag into the graph (``aten.dropout(x, p, True)``,
``aten.batch_norm(..., training=True, ...)``, ``num_batches_tracked.add_(1)``); these modules read
``self.training`` at run time instead, as nn.Dropout and nn.BatchNorm do.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


class TrainingBatchNorm(torch.nn.Module):
    """``F.batch_norm`` with the statistics of the batch in training, the running ones in eval;
    the running statistics (arguments 3 and 4) are updated in place in training."""

    def __init__(self, momentum: float, eps: float):
        super().__init__()
        self.momentum, self.eps = momentum, eps

    def forward(self, x, weight, bias, running_mean, running_var):
        return F.batch_norm(x, running_mean, running_var, weight, bias, self.training,
                            self.momentum, self.eps)

    @property
    def mutates_args(self) -> tuple:
        """For mpgraph.ir.graph.mutated_nodes: the running statistics, written in training only."""
        return (3, 4) if self.training else ()



class CountBatches(torch.nn.Module):
    """``num_batches_tracked += 1`` in training only, as nn.BatchNorm does."""

    @property
    def mutates_args(self) -> tuple:
        return (0,) if self.training else ()

    def forward(self, counter):
        if self.training:
            counter.add_(1)
        return counter


class DropoutRate(torch.nn.Module):
    """The dropout probability of a fused op (attention's ``dropout_p``): ``p`` in training,
    0 in eval, as nn.MultiheadAttention passes it."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self) -> float:
        return self.p if self.training else 0.0


class ConvertedModule(torch.fx.GraphModule):
    """The class of what capture and convert return: a GraphModule whose parameters carry the
    plan's dtypes (low ones for low nodes, float32 for the rest, read through the graph's
    casts), so a module-wide dtype change (``.half()``, ``.to(torch.float16)``) is refused with
    what to do instead; moving it to a device (``.to("cuda")``) is what ``to`` is for."""

    @classmethod
    def wrap(cls, gm: torch.fx.GraphModule) -> "ConvertedModule":
        """``gm`` as a ConvertedModule: same graph, attributes, pytree specs and meta."""
        new = cls(gm, gm.graph, class_name=type(gm).__name__)
        for key in ("_in_spec", "_out_spec"):
            if hasattr(gm, key):
                setattr(new, key, getattr(gm, key))
        new.meta = gm.meta
        return new

    def __deepcopy__(self, memo):
        # torch 2.13's pytree warns from copyreg while copying the in/out specs (its own
        # deprecated LeafSpec check, nothing the caller did): kept off the user's screen
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                    category=FutureWarning)
            return super().__deepcopy__(memo)

    def recompile(self):
        """GraphModule's code, with each parameter and buffer read as a lookup in the dict that
        holds it (``self._modules['encoder']._modules['0']._parameters['weight']``) instead of a
        chain of ``nn.Module.__getattr__`` calls: the same objects, read from where
        ``load_state_dict``, ``.to()``, FSDP and ``setattr`` put them, at ~0.3 us less per
        module level per weight per call (eager GPU runs are host-bound: tiny-width ConvNeXt,
        126 weights, 2.75 -> 2.21 ms per call on a CPU). Reads that are neither (a submodule, a
        plain attribute) keep fx's own code."""
        with self.graph.on_generate_code(lambda previous: _direct_reads(self, previous)):
            return super().recompile()

    def _refuse(self, call: str):
        plan = getattr(self, "plan", None)
        planned = str(plan.dtype).replace("torch.", "") if plan is not None else "its low dtype"
        return TypeError(f"{call} on a converted module would change the dtypes its plan gave "
                         f"each parameter ({planned} where nodes compute in {planned}, float32 "
                         "elsewhere) under the graph's casts. Convert the model again with the "
                         "dtype you want: mpgraph.convert(model, ..., dtype=...); .to(device) "
                         "moves it")

    def half(self):
        raise self._refuse(".half()")

    def float(self):
        raise self._refuse(".float()")

    def bfloat16(self):
        raise self._refuse(".bfloat16()")

    def double(self):
        raise self._refuse(".double()")

    def type(self, dst_type):
        raise self._refuse(f".type({dst_type})")

    def to(self, *args, **kwargs):
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            raise self._refuse(f".to({dtype})")
        return super().to(*args, **kwargs)


def _direct_reads(root: torch.fx.GraphModule, previous):
    """A code transformer for ``Graph.on_generate_code``: see ``ConvertedModule.recompile``."""
    def transform(body: list) -> list:
        body = previous(body) if previous is not None else body
        nodes = {n.name: n for n in root.graph.nodes if n.op in ("get_attr", "call_module")}
        out = []
        for line in body:
            name, sep, rhs = line.partition(" = ")
            node = nodes.get(name) if sep else None
            if node is not None and node.op == "get_attr":
                expr = _lookup(root, node.target)
                line = f"{name} = {expr}" if expr else line
            elif node is not None:  # a submodule call: fx writes getattr(self.body, "0")(x)
                called, found = _fx_path(node.target) + "(", _module_path(root, node.target)
                if found and rhs.startswith(called):
                    line = f"{name} = {found[1]}({rhs[len(called):]}"
            out.append(line)
        return out
    return transform


def _fx_path(target: str) -> str:
    """How fx's code generator writes the object at a dotted target (torch.fx.graph)."""
    expr = "self"
    for part in target.split("."):
        expr = f"{expr}.{part}" if part.isidentifier() else f'getattr({expr}, "{part}")'
    return expr


def _module_path(root: torch.nn.Module, target: str):
    """(the submodule, ``self._modules[..]._modules[..]``) for a dotted target ('' for the
    root), or None when it is not a submodule."""
    module, expr = root, "self"
    for part in filter(None, target.split(".")):
        module = module._modules.get(part) if isinstance(module, torch.nn.Module) else None
        if module is None:
            return None
        expr += f"._modules[{part!r}]"
    return module, expr


def _lookup(root: torch.nn.Module, target: str):
    """``self._modules[..]._parameters[..]`` (or ``_buffers``) for a dotted target, or None."""
    path, _, leaf = target.rpartition(".")
    found = _module_path(root, path)
    if found is None:
        return None
    module, expr = found
    for store in ("_parameters", "_buffers"):
        if getattr(module, store, {}).get(leaf) is not None:
            return f"{expr}.{store}[{leaf!r}]"
    return None
