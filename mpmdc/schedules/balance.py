"""Balanced stages: consecutive segments grouped into stages so the slowest is fastest.

A program marked for ``partition="balanced"`` names *segments* (its markers' indices, or a
layer stack's iterations with ``every="balanced"``). Given each segment's estimated time
(forward and backward of one microbatch), the bytes that flow between segments, and what
each segment holds in memory, :func:`balance` groups consecutive segments into a given
number of stages so that the largest stage time, transfers in and out of the stage
counted, is as small as possible, and every stage fits the memory its mesh has for it.
It is a dynamic program over (stages, last segment): ``O(stages * segments**2)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mpmdc.errors import StageError
from mpmdc.ir.program import SegmentCost


def stage_times(
    segments: Sequence[SegmentCost], flow: np.ndarray, seconds_per_byte: float
) -> Callable[[int, int], float]:
    """``time(a, b)``: the estimated seconds of a stage of segments ``a..b-1``: their
    forwards and backwards plus the bytes ``flow`` says enter or leave the range (``flow[i,
    j]``: bytes segment ``i`` sends segment ``j``, forward and backward) at
    ``seconds_per_byte``."""
    n = len(segments)
    compute = np.concatenate([[0.0], np.cumsum([s.forward + s.backward for s in segments])])
    # prefix[i, j] = sum of flow[:i, :j]
    prefix = np.zeros((n + 1, n + 1))
    prefix[1:, 1:] = np.cumsum(np.cumsum(flow, axis=0), axis=1)

    def block(r0, r1, c0, c1):
        return prefix[r1, c1] - prefix[r0, c1] - prefix[r1, c0] + prefix[r0, c0]

    def time(a: int, b: int) -> float:
        inside = block(a, b, a, b)
        rows, cols = block(a, b, 0, n), block(0, n, a, b)
        crossing = rows + cols - 2 * inside
        return float(compute[b] - compute[a] + crossing * seconds_per_byte)

    return time


def check_enough(num_segments: int, num_stages: int) -> None:
    """A ``StageError`` unless there are at least as many segments as stages."""
    if num_segments < num_stages:
        raise StageError(
            f"{num_stages} stages need at least {num_stages} marked segments to group, but "
            f"the program marks {num_segments}; mark more segments (one per layer, say) or "
            f"use fewer meshes."
        )


def balance(
    num_segments: int,
    num_stages: int,
    time: Callable[[int, int], float],
    fits: Callable[[int, int, int], bool] = lambda stage, a, b: True,
) -> tuple[tuple[int, ...], ...]:
    """Segments ``0..num_segments-1`` grouped into ``num_stages`` consecutive, non-empty
    stages minimizing the largest ``time(a, b)`` (a stage of segments ``a..b-1``) among
    groupings where ``fits(stage, a, b)`` holds for every stage. Ties go to the grouping
    with the earliest last cut. A ``StageError`` if none fits."""
    n, k = num_segments, num_stages
    check_enough(n, k)
    inf = float("inf")
    # best[s][j]: the smallest largest time of stages 0..s-1 holding segments 0..j-1
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or not fits(s - 1, i, j):
                    continue
                value = max(best[s - 1][i], time(i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if best[k][n] == inf:
        raise StageError(
            f"no grouping of the {n} segments into {k} stages fits each mesh's memory; "
            f"give the meshes more memory, use more meshes, or a schedule holding fewer "
            f"microbatches at once (1f1b, zb-h1, zb-v)."
        )
    bounds = [n]
    for s in range(k, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(k))


def balance_v(
    num_segments: int,
    num_meshes: int,
    time: Callable[[int, int], float],
    fits: Callable[[int, int, int], bool] = lambda stage, a, b: True,
) -> tuple[tuple[int, ...], ...]:
    """Segments grouped into ``2 * num_meshes`` consecutive stages placed in V order
    (stages ``s`` and ``2M-1-s`` on mesh ``s``), minimizing the largest *mesh* time: the
    sum of its two stages' ``time``. A dynamic program from both ends inward over the
    pair of boundaries, ``O(M * segments**4)`` element operations in NumPy."""
    n, k = num_segments, 2 * num_meshes
    check_enough(n, k)
    inf = np.inf
    span = np.full((n + 1, n + 1), inf)  # span[a, b]: time of a stage of segments a..b-1
    for a in range(n):
        for b in range(a + 1, n + 1):
            span[a, b] = time(a, b)
    a_idx = np.arange(n + 1)
    ordered = a_idx[:, None] <= a_idx[None, :]  # [i', j']: the left boundary before the right
    best = np.full((n + 1, n + 1), inf)  # best[i, j]: pairs so far cover [0, i) and [j, n)
    best[0, n] = 0.0
    came_from: list[dict] = []
    for d in range(num_meshes):
        left = np.array([[fits(d, a, b) for b in range(n + 1)] for a in range(n + 1)])
        right = np.array([[fits(k - 1 - d, a, b) for b in range(n + 1)] for a in range(n + 1)])
        last = d == num_meshes - 1
        nxt = np.full((n + 1, n + 1), inf)
        origin: dict = {}
        for i, j in zip(*np.nonzero(np.isfinite(best))):
            # cand[i', j'] = max(best[i, j], span[i, i'] + span[j', j])
            cand = np.maximum(best[i, j], span[i, :, None] + span[None, :, j])
            allowed = left[i, :, None] & right[None, :, j] & ordered
            if last:
                allowed &= np.eye(n + 1, dtype=bool)
            cand = np.where(allowed, cand, inf)
            better = cand < nxt
            nxt = np.where(better, cand, nxt)
            for pair in zip(*np.nonzero(better)):
                origin[pair] = (i, j)
        best = nxt
        came_from.append(origin)
    finite = np.isfinite(np.diag(best))
    if not finite.any():
        raise StageError(
            f"no grouping of the {n} segments into {k} stages in V order fits each mesh's "
            f"memory; give the meshes more memory or use more meshes."
        )
    middle = int(np.argmin(np.where(finite, np.diag(best), inf)))
    lefts, rights, pair = [], [], (middle, middle)
    for origin in reversed(came_from):
        lefts.append(pair[0])
        rights.append(pair[1])
        pair = origin[pair]
    bounds = [0, *reversed(lefts[1:]), middle, *rights[1:], n]
    return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(k))
