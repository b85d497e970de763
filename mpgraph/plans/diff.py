"""``diff(plan_a, plan_b)``: which nodes changed precision between two plans, and why.

For comparing targets (a T4 plan against an H100 one), dtypes, strategies or a plan against an
edited copy of it, or two versions of a model. Nodes are matched by their module, op and
place among that module's calls of that op, not by name: torch.export names nodes by op counter
(``linear_4``), so one layer more renames every later node, and a name would pair unrelated ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mpgraph.plans.plan import Plan


@dataclass(frozen=True)
class NodeChange:
    name: str                                # the node's name in the first plan
    dtype_a: str
    dtype_b: str
    reason_a: str
    reason_b: str
    name_b: str = ""                         # its name in the second, where that differs
    module: str = ""


@dataclass
class PlanDiff:
    a: str                                   # "float16 on NVIDIA T4 (optimal)"
    b: str
    changed: list[NodeChange] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)   # nodes only the first plan decides
    only_b: list[str] = field(default_factory=list)
    casts_a: int = 0
    casts_b: int = 0

    def __str__(self) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}",
                 f"{len(self.changed)} nodes changed precision; casts {self.casts_a} -> {self.casts_b}"]
        for c in self.changed:
            name = f"{c.name} (B: {c.name_b})" if c.name_b else c.name
            lines.append(f"  {name} [{c.module}]: {c.dtype_a} -> {c.dtype_b}" if c.module
                         else f"  {name}: {c.dtype_a} -> {c.dtype_b}")
            lines.append(f"      A: {c.reason_a}")
            lines.append(f"      B: {c.reason_b}")
        if self.only_a:
            lines.append("only in A: " + ", ".join(self.only_a))
        if self.only_b:
            lines.append("only in B: " + ", ".join(self.only_b))
        return "\n".join(lines)


def _title(plan: Plan) -> str:
    return f"{plan.headline_dtype} on {plan.target} ({plan.strategy})"


def diff(plan_a, plan_b) -> PlanDiff:
    """The node-by-node difference of two plans (or converted modules)."""
    a, b = Plan.of(plan_a, "diff"), Plan.of(plan_b, "diff")
    nodes_a, nodes_b = _keyed(a.compute_nodes), _keyed(b.compute_nodes)
    out = PlanDiff(_title(a), _title(b), casts_a=len(a.casts), casts_b=len(b.casts))
    for key, ra in nodes_a.items():
        rb = nodes_b.get(key)
        if rb is None:
            out.only_a.append(ra.name)
        elif ra.dtype != rb.dtype:
            out.changed.append(NodeChange(ra.name, ra.dtype, rb.dtype, ra.reason, rb.reason,
                                          "" if rb.name == ra.name else rb.name, ra.module))
    out.only_b = [rb.name for key, rb in nodes_b.items() if key not in nodes_a]
    return out


def _keyed(records) -> dict:
    """Each record by (module, op, its place among that module's calls of that op)."""
    seen: dict = {}
    keyed = {}
    for r in records:
        k = (r.module, r.target)
        seen[k] = seen.get(k, -1) + 1
        keyed[(*k, seen[k])] = r
    return keyed
