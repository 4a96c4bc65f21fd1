"""Property tests (hypothesis): `eplb.plan` always returns a valid placement for valid
sizes and any non-negative finite load, is deterministic, and refuses invalid input with
ValueError only; `Placement` validation agrees with a reference check."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eplb import plan  # noqa: E402
from eplb.core.placement import Placement  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def sizes(draw):
    """Valid (L, N, M, P, nodes, groups): P in [N, 2N], M divides P, nodes | M, groups | N."""
    L = draw(st.integers(1, 4))
    N = draw(st.integers(1, 64))
    P = draw(st.integers(N, 2 * N))
    M = draw(st.sampled_from(_divisors(P)))
    nodes = draw(st.sampled_from(_divisors(M)))
    groups = draw(st.sampled_from(_divisors(N)))
    return L, N, M, P, nodes, groups


VALUES = st.one_of(
    st.just(0.0), st.just(1.0), st.integers(0, 10).map(float),  # zeros and ties
    st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
    st.floats(1e100, 1e308, allow_nan=False, allow_infinity=False),  # huge
)


@st.composite
def loads(draw, L, N):
    kind = draw(st.sampled_from(["random", "zeros", "ties", "huge", "one_hot"]))
    if kind == "zeros":
        return np.zeros((L, N))
    if kind == "ties":
        return np.full((L, N), float(draw(st.integers(1, 5))))
    if kind == "huge":
        return np.full((L, N), 1e308)
    if kind == "one_hot":
        load = np.zeros((L, N))
        load[:, draw(st.integers(0, N - 1))] = draw(VALUES)
        return load
    flat = draw(st.lists(VALUES, min_size=L * N, max_size=L * N))
    return np.array(flat, dtype=np.float64).reshape(L, N)


def check_valid(p, L, N, M, P):
    p2l = p.physical_to_logical
    assert p2l.shape == (L, P)
    assert p2l.min() >= 0 and p2l.max() < N  # ids in range
    assert (p.replica_count() >= 1).all()  # every expert has a replica
    assert p.num_gpus == M and p.slots_per_gpu == P // M  # P/M slots per GPU
    Placement(p2l, N, M, p.num_nodes, shares=p.shares)  # passes validation again


@st.composite
def plan_case(draw):
    L, N, M, P, nodes, groups = draw(sizes())
    load = draw(loads(L, N))
    policy = draw(st.sampled_from(["default", "deepseek"]))
    weighted = draw(st.booleans())
    return load, M, P, nodes, groups, policy, weighted


@SETTINGS
@given(plan_case())
def test_plan_is_valid_and_deterministic(case):
    load, M, P, nodes, groups, policy, weighted = case
    L, N = load.shape
    p = plan(load, M, P, nodes, groups, policy=policy, weighted=weighted)
    check_valid(p, L, N, M, P)
    # no two replicas of an expert on one GPU while a GPU has no more slots than experts it
    # may hold: all N, or with node-limited groups (groups % nodes == 0, nodes > 1: every
    # replica stays on its group's node) the N / nodes experts of its node
    hierarchical = nodes > 1 and groups % nodes == 0
    if policy == "default" and P // M <= (N // nodes if hierarchical else N):
        assert p.num_duplicates_on_gpu() == 0
    q = plan(load.copy(), M, P, nodes, groups, policy=policy, weighted=weighted)
    assert np.array_equal(p.physical_to_logical, q.physical_to_logical)
    assert (p.shares is None) == (q.shares is None)
    if p.shares is not None:
        assert np.array_equal(p.shares, q.shares)
    # replanning with the result as `previous` is valid too
    r = plan(load, M, P, nodes, groups, policy=policy, previous=p, weighted=weighted)
    check_valid(r, L, N, M, P)


@st.composite
def bad_plan_case(draw):
    L, N, M, P, nodes, groups = draw(sizes())
    args = dict(load=np.ones((L, N)), num_gpus=M, num_slots=P, num_nodes=nodes, num_groups=groups)
    what = draw(st.sampled_from(["P<N", "P%M", "nodes", "groups", "nonpos", "bool", "float",
                                 "nan", "neg", "inf", "shape", "huge", "empty"]))
    if what == "P<N":
        assume(N > 1)
        args["num_slots"] = draw(st.integers(1, N - 1))
        args["num_gpus"] = 1
    elif what == "P%M":
        m = draw(st.integers(2, 2 * N + 1))
        assume(P % m)
        args["num_gpus"], args["num_nodes"] = m, 1
    elif what == "nodes":
        n = draw(st.integers(2, 9))
        assume(M % n)
        args["num_nodes"] = n
    elif what == "groups":
        g = draw(st.integers(2, 65))
        assume(N % g)
        args["num_groups"] = g
    elif what == "nonpos":
        key = draw(st.sampled_from(["num_gpus", "num_slots", "num_nodes", "num_groups"]))
        args[key] = draw(st.integers(-5, 0))
    elif what == "bool":
        key = draw(st.sampled_from(["num_gpus", "num_slots", "num_nodes", "num_groups"]))
        args[key] = True
    elif what == "float":
        key = draw(st.sampled_from(["num_gpus", "num_slots", "num_nodes", "num_groups"]))
        args[key] = float(args[key])
    elif what in ("nan", "neg", "inf"):
        load = np.ones((L, N))
        load[draw(st.integers(0, L - 1)), draw(st.integers(0, N - 1))] = {
            "nan": np.nan, "neg": -draw(st.floats(1e-9, 1e9)), "inf": np.inf}[what]
        args["load"] = load
    elif what == "shape":
        args["load"] = np.ones(draw(st.sampled_from([(N,), (1, L, N, 1), ()])))
    elif what == "huge":
        args["num_slots"] = draw(st.integers(10**6, 10**15)) * M
    elif what == "empty":
        args["load"] = np.ones((L, 0))
    policy = draw(st.sampled_from(["default", "deepseek"]))
    return args, policy


@SETTINGS
@given(bad_plan_case())
def test_plan_invalid_input_raises_valueerror(case):
    args, policy = case
    with pytest.raises(ValueError):
        plan(args.pop("load"), policy=policy, **args)


@st.composite
def placement_case(draw):
    """Random [L, P] ids (some valid placements, some not) with sizes, some invalid."""
    L = draw(st.integers(1, 4))
    N = draw(st.integers(1, 64))
    P = draw(st.integers(max(1, N - 2), 2 * N + 2))
    M = draw(st.sampled_from(_divisors(P) + [draw(st.integers(1, P + 1))]))
    nodes = draw(st.integers(1, 4))
    if draw(st.booleans()):  # a valid placement, maybe corrupted below
        rows = [np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(
            np.concatenate([np.arange(N), draw(st.lists(st.integers(0, N - 1), min_size=max(0, P - N),
                                                        max_size=max(0, P - N)))]))[:P]
                for _ in range(L)]
        p2l = np.array(rows, dtype=np.int64)
    else:
        p2l = np.array(draw(st.lists(st.lists(st.integers(-1, N), min_size=P, max_size=P),
                                     min_size=L, max_size=L)), dtype=np.int64)
    return p2l, N, M, nodes


def _reference_valid(p2l, N, M, nodes):
    L, P = p2l.shape
    if M % nodes or P % M or P < N:
        return False
    if p2l.min() < 0 or p2l.max() >= N:
        return False
    return all(set(range(N)) <= set(row.tolist()) for row in p2l)


@SETTINGS
@given(placement_case())
def test_placement_validation_matches_reference(case):
    p2l, N, M, nodes = case
    if _reference_valid(p2l, N, M, nodes):
        p = Placement(p2l, N, M, nodes)
        assert (p.replica_count() >= 1).all() and p.slots_per_gpu == p2l.shape[1] // M
    else:
        with pytest.raises(ValueError):
            Placement(p2l, N, M, nodes)
