"""Exact two-precision assignment as a minimum s-t cut.

Every variable node is either float32 (source side) or low precision (sink side). A node costs
``cost[n] = (t_fp32, t_low)``. A value read by a consumer that computes in the other precision
needs a cast, paid once per (value, target dtype) however many consumers share it; an auxiliary
node per value and direction makes that sharing exact (a consumer on the far side forces the
auxiliary node across, which cuts the value's one cast edge). Fixed labels and equalities are
infinite edges. Among all minimum cuts we take the one with the largest float32 side, so ties go
to float32.

The module knows nothing of torch.fx: ``Problem`` is plain data, so the solver is tested against
brute force on random problems.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

FP32, LOW = 0, 1
_INF = float("inf")


@dataclass
class Problem:
    cost: dict[Hashable, tuple[float, float]] = field(default_factory=dict)       # node -> (fp32, low)
    fixed: dict[Hashable, int] = field(default_factory=dict)                       # node -> FP32/LOW
    equal: list[tuple[Hashable, Hashable]] = field(default_factory=list)           # same label
    reads: dict[Hashable, list[Hashable]] = field(default_factory=dict)            # value -> readers
    cast_cost: dict[Hashable, tuple[float, float]] = field(default_factory=dict)   # value -> (down, up)

    def nodes(self) -> list[Hashable]:
        seen = dict.fromkeys(self.cost)
        for n in self.fixed:
            seen.setdefault(n)
        for a, b in self.equal:
            seen.setdefault(a)
            seen.setdefault(b)
        for v, readers in self.reads.items():
            seen.setdefault(v)
            for r in readers:
                seen.setdefault(r)
        return list(seen)


def total_cost(problem: Problem, labels: dict[Hashable, int]) -> float:
    """The objective, evaluated directly: node times plus one cast per (value, needed dtype)."""
    if any(labels[n] != lab for n, lab in problem.fixed.items()):
        return _INF
    if any(labels[a] != labels[b] for a, b in problem.equal):
        return _INF
    total = sum(c[labels[n]] for n, c in problem.cost.items())
    for value, readers in problem.reads.items():
        down, up = problem.cast_cost.get(value, (0.0, 0.0))
        wanted = {labels[r] for r in readers}
        if labels[value] == FP32 and LOW in wanted:
            total += down
        if labels[value] == LOW and FP32 in wanted:
            total += up
    return total


class _Flow:
    """Dinic's max-flow on float capacities (exact enough: capacities are sums of the inputs)."""

    def __init__(self, n: int):
        self.n = n
        self.head: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add(self, u: int, v: int, c: float) -> None:
        if c <= 0:
            return
        self.head[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(c)
        self.head[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)

    def _bfs(self, s: int, t: int) -> list[int] | None:
        level = [-1] * self.n
        level[s] = 0
        q = deque([s])
        while q:
            u = q.popleft()
            for e in self.head[u]:
                if self.cap[e] > 1e-15 and level[self.to[e]] < 0:
                    level[self.to[e]] = level[u] + 1
                    q.append(self.to[e])
        return level if level[t] >= 0 else None

    def max_flow(self, s: int, t: int) -> float:
        flow = 0.0
        while True:
            level = self._bfs(s, t)
            if level is None:
                return flow
            it = [0] * self.n
            while True:
                pushed = self._dfs(s, t, _INF, level, it)
                if pushed <= 1e-15:
                    break
                flow += pushed
            if flow == _INF:
                return flow

    def _dfs(self, s: int, t: int, limit: float, level: list[int], it: list[int]) -> float:
        # iterative DFS along the level graph, pushing one augmenting path
        path: list[int] = []
        u = s
        while True:
            if u == t:
                push = min([limit] + [self.cap[e] for e in path])
                for e in path:
                    self.cap[e] -= push
                    self.cap[e ^ 1] += push
                return push
            advanced = False
            while it[u] < len(self.head[u]):
                e = self.head[u][it[u]]
                v = self.to[e]
                if self.cap[e] > 1e-15 and level[v] == level[u] + 1:
                    path.append(e)
                    u = v
                    advanced = True
                    break
                it[u] += 1
            if not advanced:
                if not path:
                    return 0.0
                level[u] = -1  # dead end: prune
                e = path.pop()
                u = self.to[e ^ 1]
                it[u] += 1

    def reaches_sink(self, t: int) -> list[bool]:
        """Nodes that can still reach t in the residual graph (the minimal sink side)."""
        seen = [False] * self.n
        seen[t] = True
        q = deque([t])
        while q:
            v = q.popleft()
            for e in self.head[v]:
                u = self.to[e]  # e is v->u; its twin u->v has residual cap[e ^ 1]
                if not seen[u] and self.cap[e ^ 1] > 1e-15:
                    seen[u] = True
                    q.append(u)
        return seen


def solve(problem: Problem) -> tuple[dict[Hashable, int], float]:
    """(labels, objective) of an optimal assignment, ties broken towards float32."""
    nodes = problem.nodes()
    index = {n: i for i, n in enumerate(nodes)}
    values = [v for v, readers in problem.reads.items() if readers]
    s, t = len(nodes) + 2 * len(values), len(nodes) + 2 * len(values) + 1
    g = _Flow(t + 1)
    # an infinite cost (a dtype this CPU emulates, never timed) is finite here, above every
    # finite cost together, and the hard constraints above all of them: an inf capacity made
    # ``big`` inf too, and a fixed node or a tie was cut like any cost (a KV cache pinned to
    # bf16 whose writer came out float32, an internal error in the check)
    finite = [x for c in (*problem.cost.values(), *problem.cast_cost.values()) for x in c
              if math.isfinite(x)]
    soft = 1.0 + 2.0 * sum(finite)

    def capped(x: float) -> float:
        return x if math.isfinite(x) else soft
    big = 1.0 + 2.0 * (sum(max(map(capped, c)) for c in problem.cost.values())
                       + sum(sum(map(capped, c)) for c in problem.cast_cost.values()))
    for n, (c32, clow) in problem.cost.items():
        c32, clow = capped(c32), capped(clow)
        base = min(c32, clow)  # only the difference matters for the cut
        g.add(s, index[n], clow - base)   # cut when n is low
        g.add(index[n], t, c32 - base)    # cut when n is fp32
    for n, lab in problem.fixed.items():
        g.add(s, index[n], big) if lab == FP32 else g.add(index[n], t, big)
    for a, b in problem.equal:
        g.add(index[a], index[b], big)
        g.add(index[b], index[a], big)
    for k, v in enumerate(values):
        down, up = map(capped, problem.cast_cost.get(v, (0.0, 0.0)))
        a_down, a_up = len(nodes) + 2 * k, len(nodes) + 2 * k + 1
        g.add(index[v], a_down, down)          # fp32 value with a low reader: one cast down
        g.add(a_up, index[v], up)              # low value with an fp32 reader: one cast up
        for r in problem.reads[v]:
            g.add(a_down, index[r], big)
            g.add(index[r], a_up, big)
    g.max_flow(s, t)
    low_side = g.reaches_sink(t)
    labels = {n: LOW if low_side[index[n]] else FP32 for n in nodes}
    return labels, total_cost(problem, labels)
