"""``diff(plan_a, plan_b)``: which nodes changed precision between two plans, and why.

For comparing targets (a T4 plan against an H100 one), dtypes, strategies or a plan against an
edited copy of it. Nodes are matched by name (the same model converts to the same node names).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mpgraph.plans.plan import Plan


@dataclass(frozen=True)
class NodeChange:
    name: str
    dtype_a: str
    dtype_b: str
    reason_a: str
    reason_b: str


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
            lines.append(f"  {c.name}: {c.dtype_a} -> {c.dtype_b}")
            lines.append(f"      A: {c.reason_a}")
            lines.append(f"      B: {c.reason_b}")
        if self.only_a:
            lines.append("only in A: " + ", ".join(self.only_a))
        if self.only_b:
            lines.append("only in B: " + ", ".join(self.only_b))
        return "\n".join(lines)


def _title(plan: Plan) -> str:
    return f"{plan.dtype} on {plan.target} ({plan.strategy})".replace("torch.", "")


def diff(plan_a, plan_b) -> PlanDiff:
    """The node-by-node difference of two plans (or converted modules)."""
    a, b = Plan.of(plan_a, "diff"), Plan.of(plan_b, "diff")
    nodes_a = {r.name: r for r in a.compute_nodes}
    nodes_b = {r.name: r for r in b.compute_nodes}
    out = PlanDiff(_title(a), _title(b), casts_a=len(a.casts), casts_b=len(b.casts))
    for name, ra in nodes_a.items():
        rb = nodes_b.get(name)
        if rb is None:
            out.only_a.append(name)
        elif ra.dtype != rb.dtype:
            out.changed.append(NodeChange(name, ra.dtype, rb.dtype, ra.reason, rb.reason))
    out.only_b = [name for name in nodes_b if name not in nodes_a]
    return out
