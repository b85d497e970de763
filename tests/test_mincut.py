"""The min-cut assignment is optimal: checked against brute force on random problems."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from mpgraph.cost.mincut import FP32, LOW, Problem, solve, total_cost


def brute_force(problem: Problem) -> float:
    nodes = problem.nodes()
    best = float("inf")
    for bits in itertools.product((FP32, LOW), repeat=len(nodes)):
        best = min(best, total_cost(problem, dict(zip(nodes, bits))))
    return best


@st.composite
def problems(draw, untimed=False):
    n = draw(st.integers(1, 9))
    costs = st.floats(0, 10, allow_nan=False, allow_infinity=False)
    if untimed:  # a dtype this CPU emulates is never timed: its cost is inf
        costs = st.one_of(costs, st.just(float("inf")))
    p = Problem()
    for i in range(n):
        p.cost[i] = (draw(costs), draw(costs))
    for i in range(n):  # a DAG: node i reads some earlier nodes
        for j in range(i):
            if draw(st.booleans()):
                p.reads.setdefault(j, []).append(i)
    for v in p.reads:
        p.cast_cost[v] = (draw(costs), draw(costs))
    for i in draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True)):
        p.fixed[i] = draw(st.sampled_from([FP32, LOW]))
    if n > 1 and draw(st.booleans()):
        a, b = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        if a != b and not (a in p.fixed and b in p.fixed):
            p.equal.append((a, b))
    return p


@settings(max_examples=300, deadline=None)
@given(problems())
def test_min_cut_matches_brute_force(problem):
    labels, value = solve(problem)
    assert abs(value - brute_force(problem)) <= 1e-9 * max(1.0, value)
    for n, lab in problem.fixed.items():
        assert labels[n] == lab


@settings(max_examples=300, deadline=None)
@given(problems(untimed=True))
def test_infinite_costs_leave_the_hard_constraints_hard(problem):
    """An inf cost made the constraints' weight inf too, and they were cut like any cost: a KV
    cache fixed to bf16 came out float32 from its writer's side (an internal error after)."""
    labels, value = solve(problem)
    for n, lab in problem.fixed.items():
        assert labels[n] == lab
    for a, b in problem.equal:
        assert labels[a] == labels[b]
    best = brute_force(problem)
    assert value == best if best == float("inf") else abs(value - best) <= 1e-9 * max(1.0, best)


def test_shared_cast_is_paid_once():
    # value 0 (fp32, fixed) read by three nodes that each save 1.0 in low precision; one cast costs 2
    p = Problem(cost={1: (2.0, 1.0), 2: (2.0, 1.0), 3: (2.0, 1.0)}, fixed={0: FP32},
                reads={0: [1, 2, 3]}, cast_cost={0: (2.0, 2.0)})
    labels, value = solve(p)
    assert [labels[i] for i in (1, 2, 3)] == [LOW, LOW, LOW]
    assert value == 3.0 + 2.0  # three low nodes plus a single shared cast


def test_ties_go_to_fp32():
    p = Problem(cost={1: (1.0, 1.0)}, fixed={0: FP32}, reads={0: [1]}, cast_cost={0: (0.0, 0.0)})
    labels, _ = solve(p)
    assert labels[1] == FP32


def test_isolated_cheap_op_between_fp32_ops_is_not_wrapped_in_casts():
    # fp32 -> relu -> fp32: low relu saves 0.1 but needs a cast down and a cast up of 1.0 each
    p = Problem(cost={"relu": (0.2, 0.1)}, fixed={"a": FP32, "b": FP32},
                reads={"a": ["relu"], "relu": ["b"]}, cast_cost={"a": (1.0, 1.0), "relu": (1.0, 1.0)})
    labels, value = solve(p)
    assert labels["relu"] == FP32 and value == 0.2
