"""``balance``: consecutive segments grouped into stages, checked against brute force."""

import itertools
import re

import numpy as np
import pytest

from mpmdc.errors import StageError
from mpmdc.ir.program import SegmentCost
from mpmdc.schedules.balance import balance, balance_v, stage_times


def groupings(n, k):
    """Every way to cut segments 0..n-1 into k consecutive non-empty stages."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(k))


def worst(groups, time):
    return max(time(g[0], g[-1] + 1) for g in groups)


def random_case(seed, max_segments):
    """``(segments, stages, costs, flow, rng)`` of a random problem."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, max_segments + 1))
    k = int(rng.integers(1, n + 1))
    costs = [
        SegmentCost(
            float(rng.uniform(0.1, 3)),
            float(rng.uniform(0.1, 6)),
            int(rng.integers(0, 100)),
            int(rng.integers(0, 50)),
        )
        for _ in range(n)
    ]
    # Mostly neighbour to neighbour, sometimes a skip (a tied weight, a residual).
    flow = np.zeros((n, n))
    for i in range(n - 1):
        flow[i, i + 1] = rng.uniform(0, 2)
    for _ in range(n // 3):
        i, j = sorted(rng.choice(n, 2, replace=False))
        flow[i, j] += rng.uniform(0, 2)
    return n, k, costs, flow, rng


@pytest.mark.parametrize("seed", range(40))
def test_balance_finds_the_best_grouping_that_brute_force_finds(seed):
    n, k, costs, flow, rng = random_case(seed, 10)
    time = stage_times(costs, flow, seconds_per_byte=float(rng.choice([0.0, 0.3])))
    got = balance(n, k, time)
    assert [s for g in got for s in g] == list(range(n)) and all(got)
    assert worst(got, time) == pytest.approx(min(worst(g, time) for g in groupings(n, k)))


@pytest.mark.parametrize("seed", range(40))
def test_balance_keeps_every_stage_within_its_memory(seed):
    n, k, costs, flow, rng = random_case(seed, 9)
    time = stage_times(costs, flow, seconds_per_byte=0.1)
    limit = [float(rng.uniform(60, 400)) for _ in range(k)]
    in_flight = [k - s for s in range(k)]  # 1F1B: stage s holds k - s microbatches

    def fits(stage, a, b):
        need = sum(c.held + c.activations * in_flight[stage] for c in costs[a:b])
        return need <= limit[stage]

    feasible = [g for g in groupings(n, k) if all(fits(s, g[s][0], g[s][-1] + 1) for s in range(k))]
    if not feasible:
        with pytest.raises(StageError, match="no grouping of the"):
            balance(n, k, time, fits)
        return
    got = balance(n, k, time, fits)
    assert all(fits(s, got[s][0], got[s][-1] + 1) for s in range(k))
    assert worst(got, time) == pytest.approx(min(worst(g, time) for g in feasible))


def test_stage_time_counts_compute_and_the_bytes_crossing_its_edges():
    costs = [SegmentCost(1, 2), SegmentCost(1, 1), SegmentCost(2, 2)]
    flow = np.zeros((3, 3))
    flow[0, 1], flow[1, 2], flow[0, 2] = 10, 20, 5  # 0 -> 2: a skip connection
    time = stage_times(costs, flow, seconds_per_byte=0.1)
    assert time(0, 3) == pytest.approx(9)  # nothing leaves the whole program
    assert time(1, 2) == pytest.approx(2 + (10 + 20) * 0.1)
    assert time(0, 2) == pytest.approx(5 + (20 + 5) * 0.1)


def test_a_heavy_last_segment_gets_a_stage_to_itself():
    costs = [SegmentCost(1, 2)] * 6 + [SegmentCost(4, 8)]  # six layers, then an LM head
    time = stage_times(costs, np.zeros((7, 7)), 0.0)
    assert balance(7, 4, time) == ((0, 1), (2, 3), (4, 5), (6,))


def test_fewer_segments_than_stages_is_an_error():
    with pytest.raises(
        StageError, match=re.escape("4 stages need at least 4 marked segments to group, but")
    ):
        balance(3, 4, lambda a, b: 1.0)


@pytest.mark.parametrize("seed", range(30))
def test_balance_v_finds_the_best_grouping_of_the_meshes_totals(seed):
    """In V order mesh d runs stages d and 2M-1-d: the slowest mesh's total is what brute
    force over every grouping finds, memory kept."""
    n, _, costs, flow, rng = random_case(seed, 9)
    meshes = int(rng.integers(1, n // 2 + 1))
    time = stage_times(costs, flow, seconds_per_byte=0.2)
    limit = float(rng.uniform(40, 300))

    def fits(stage, a, b):
        return sum(c.held + c.activations for c in costs[a:b]) <= limit

    def slowest_mesh(groups):
        k = len(groups)
        return max(
            time(groups[d][0], groups[d][-1] + 1)
            + time(groups[k - 1 - d][0], groups[k - 1 - d][-1] + 1)
            for d in range(k // 2)
        )

    feasible = [
        g
        for g in groupings(n, 2 * meshes)
        if all(fits(s, g[s][0], g[s][-1] + 1) for s in range(2 * meshes))
    ]
    if not feasible:
        with pytest.raises(StageError, match="in V order fits"):
            balance_v(n, meshes, time, fits)
        return
    got = balance_v(n, meshes, time, fits)
    assert [s for g in got for s in g] == list(range(n)) and all(got)
    assert all(fits(s, got[s][0], got[s][-1] + 1) for s in range(2 * meshes))
    assert slowest_mesh(got) == pytest.approx(min(slowest_mesh(g) for g in feasible))
