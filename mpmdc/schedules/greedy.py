"""Schedules built by list scheduling: each mesh, whenever it is free, runs the action
that can start soonest, ties broken by a priority, under a cap on in-flight microbatches.

This is how the zero-bubble papers define their schedules beyond the hand-drawn ones: an
action may run once its dependencies (:mod:`mpmdc.schedules.simulate`) have finished; a
forward may run only while its mesh holds less than its cap of activations (a forward
takes its stage's share, the weight gradient, or a whole backward, frees it). At unit
costs (``F = I = W = 1``, the default) the orders it finds are the ones the papers draw
(ZB-H2); ``schedule="auto"`` runs it at a program's own costs.
"""

from __future__ import annotations

from collections.abc import Callable

from mpmdc.errors import ScheduleError
from mpmdc.ir.primitives import ActionKind
from mpmdc.schedules.actions import Action, Layout
from mpmdc.schedules.simulate import UNIT_COSTS


def list_schedule(
    layout: Layout,
    *,
    cap: Callable[[int], float],
    priority: Callable[[Action], tuple],
    split: bool = True,
    cost: Callable[[Action], float] | None = None,
    weight: Callable[[int], float] | None = None,
) -> tuple[tuple[Action, ...], ...]:
    """Per-mesh action lists of the greedy list schedule of ``layout``.

    ``cap(mesh)``: how much ``mesh`` may hold of the activations of stages between their
    forward and weight gradient, a stage's microbatch weighing ``weight(stage)`` (one
    without it); ``priority(action)``: the sort key among actions that can start
    at the same time (smallest first); ``split``: backwards as ``I`` and ``W`` (else a
    whole ``B``); ``cost(action)``: its duration (unit costs without it).
    """
    m, n = layout.microbatches, layout.num_stages
    back = ActionKind.I if split else ActionKind.B
    frees = ActionKind.W if split else ActionKind.B  # the action after which nothing is held
    kinds = (ActionKind.F, back, ActionKind.W) if split else (ActionKind.F, back)
    # Per stage and kind, the next microbatch to run: every kind runs in microbatch order.
    following = {(s, k): 0 for s in range(n) for k in kinds}
    end: dict[tuple[int, ActionKind, int], float] = {}
    free = [0.0] * layout.num_meshes
    held = [0.0] * layout.num_meshes
    cost = cost or (lambda action: UNIT_COSTS[action.kind])
    weight = weight or (lambda stage: 1.0)
    out: list[list[Action]] = [[] for _ in range(layout.num_meshes)]

    def ready_at(s: int, kind: ActionKind, b: int) -> float | None:
        """When stage ``s``'s ``kind`` of ``b`` may start, ``None`` while a dependency has
        not been scheduled."""
        if kind is ActionKind.F:
            deps = [(s - 1, kind, b)] if s > 0 else []
        elif kind is ActionKind.W:
            deps = [(s, back, b)]
        else:
            deps = [(s, ActionKind.F, b)] + ([(s + 1, back, b)] if s + 1 < n else [])
        if any(d not in end for d in deps):
            return None
        return max((end[d] for d in deps), default=0.0)

    def best_of(s: int):
        """``((start, priority), action)`` of stage ``s``'s first action among those that
        can start soonest, ``None`` if none can be scheduled yet."""
        mesh = layout.stage_to_mesh[s]
        best = None
        for kind in kinds:
            b = following[s, kind]
            if b == m or (kind is ActionKind.F and held[mesh] + weight(s) > cap(mesh)):
                continue
            at = ready_at(s, kind, b)
            if at is None:
                continue
            action = Action(s, kind, b)
            key = (max(at, free[mesh]), priority(action))
            if best is None or key < best[0]:
                best = (key, action)
        return best

    # Each stage's best action, recomputed only where a scheduled action changes it: its
    # mesh's stages (the mesh is busy longer, holds more or less) and its neighbours
    # (a forward readies the next stage's, a backward the previous stage's).
    ready = [best_of(s) for s in range(n)]
    for _ in range(n * m * len(kinds)):
        best = min(filter(None, ready), default=None)
        if best is None:
            raise ScheduleError(
                f"no action can run: every mesh holding a forward is at its cap of "
                f"{[cap(mesh) for mesh in range(layout.num_meshes)]}; raise the cap."
            )
        (start, _), action = best
        s, kind, b = action.stage, action.kind, action.microbatch
        mesh = layout.stage_to_mesh[s]
        end[s, kind, b] = free[mesh] = start + cost(action)
        following[s, kind] += 1
        held[mesh] += weight(s) * ((kind is ActionKind.F) - (kind is frees))
        out[mesh].append(action)
        for t in {*layout.stages_of(mesh), s - 1, s + 1} & set(range(n)):
            ready[t] = best_of(t)
    return tuple(map(tuple, out))
