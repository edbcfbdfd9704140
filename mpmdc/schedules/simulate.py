"""Checking a schedule against its data dependencies, and timing it.

:func:`simulate` runs every mesh's action list in order, each action starting when its
mesh is free and the actions it depends on have finished:

- ``sF b`` needs ``(s-1)F b``;
- ``sB b`` and ``sI b`` need ``sF b`` and the backward (``B`` or ``I``) of ``s+1`` on ``b``;
- ``sW b`` needs ``sI b``.

A schedule that lists an action twice, misses one, puts one on the wrong mesh, or
orders a mesh's actions so that no mesh can go on (a deadlock, or an action before
one it depends on) is a :class:`~mpmdc.errors.ScheduleError` naming the actions.
Otherwise the result is a :class:`~mpmdc.schedules.timeline.Timeline`: start and end
of every action per mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from mpmdc.errors import ScheduleError
from mpmdc.ir.primitives import ActionKind
from mpmdc.schedules.actions import Action, Layout
from mpmdc.schedules.timeline import Slot, Timeline

UNIT_COSTS = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}


Costs = Mapping[str, float] | Callable[[Action], float]


def measured_costs(timeline: Timeline) -> Callable[[Action], float]:
    """Costs for :func:`simulate` from a measured run (``Compiled.run_timed``).

    Each action costs what its fragment took; an action without a fragment of its own
    (the last stage's backward, done inside its forward) costs nothing.
    """
    took = {
        slot.action: slot.end - slot.start for row in timeline.meshes for slot in row if slot.action
    }
    return lambda action: took.get(action, 0.0)


def by_kind(seconds: Callable[[int, ActionKind], float | None]) -> Callable[[Action], float]:
    """A cost function from ``seconds(stage, kind)`` (``None`` where unknown): a ``B``
    known only in halves costs ``I + W``, an ``I`` or ``W`` known only whole half the
    ``B``, anything else unknown nothing."""

    def cost(action: Action) -> float:
        s, kind = action.stage, action.kind
        known = seconds(s, kind)
        if known is not None:
            return float(known)
        if kind is ActionKind.B:
            return sum(seconds(s, k) or 0.0 for k in (ActionKind.I, ActionKind.W))
        if kind in (ActionKind.I, ActionKind.W):
            return (seconds(s, ActionKind.B) or 0.0) / 2
        return 0.0

    return cost


def cost_of(costs: Costs | None, action: Action) -> float:
    """``action``'s cost: by its label (``"0F1"``), else by its kind (``"F"``)."""
    if costs is None:
        costs = UNIT_COSTS
    if callable(costs):
        return float(costs(action))
    label = str(action)
    if label in costs:
        return float(costs[label])
    if action.kind not in costs:
        raise ScheduleError(
            f"no cost for {label}: give costs for kind {action.kind!r} or for {label}."
        )
    return float(costs[action.kind])


def _dependencies(action: Action, layout: Layout, split: set) -> list[Action]:
    s, b = action.stage, action.microbatch
    if action.kind is ActionKind.F:
        return [Action(s - 1, ActionKind.F, b)] if s > 0 else []
    if action.kind is ActionKind.W:
        return [Action(s, ActionKind.I, b)]
    deps = [Action(s, ActionKind.F, b)]
    if s + 1 < layout.num_stages:
        deps.append(Action(s + 1, ActionKind.I if (s + 1, b) in split else ActionKind.B, b))
    return deps


def _check_coverage(per_mesh, layout: Layout) -> set:
    """Every action once, on its stage's mesh; returns the (stage, microbatch) split into I/W."""
    seen: dict[Action, int] = {}
    for mesh, actions in enumerate(per_mesh):
        for a in actions:
            if not (0 <= a.stage < layout.num_stages and 0 <= a.microbatch < layout.microbatches):
                raise ScheduleError(
                    f"mesh {mesh} lists {a}, but the pipeline has stages 0..{layout.num_stages - 1} "
                    f"and microbatches 0..{layout.microbatches - 1}."
                )
            if a in seen:
                where = f"on mesh {mesh}" if seen[a] == mesh else f"on meshes {seen[a]} and {mesh}"
                raise ScheduleError(f"{a} is listed twice ({where}); list each action once.")
            if layout.stage_to_mesh[a.stage] != mesh:
                raise ScheduleError(
                    f"{a} is listed on mesh {mesh}, but stage {a.stage} runs on mesh "
                    f"{layout.stage_to_mesh[a.stage]}; list it there, or say where each stage "
                    f"runs with compile(..., stage_to_mesh=...)."
                )
            seen[a] = mesh
    split = {(a.stage, a.microbatch) for a in seen if a.kind in (ActionKind.I, ActionKind.W)}
    for s in range(layout.num_stages):
        for b in range(layout.microbatches):
            needed = (
                [ActionKind.F, ActionKind.I, ActionKind.W]
                if (s, b) in split
                else [ActionKind.F, ActionKind.B]
            )
            for kind in needed:
                if Action(s, kind, b) not in seen:
                    raise ScheduleError(f"the schedule never runs {Action(s, kind, b)}.")
            if (s, b) in split and Action(s, ActionKind.B, b) in seen:
                raise ScheduleError(
                    f"stage {s} microbatch {b} has both B and I/W; list one or the other."
                )
    return split


def simulate(per_mesh, layout: Layout, costs: Costs | None = None) -> Timeline:
    """Validate ``per_mesh`` action lists against the dependencies and time them."""
    per_mesh = [tuple(actions) for actions in per_mesh]
    if len(per_mesh) != layout.num_meshes:
        raise ScheduleError(
            f"the schedule has {len(per_mesh)} action list(s) for {layout.num_meshes} meshes."
        )
    split = _check_coverage(per_mesh, layout)
    position = {
        a: (mesh, i) for mesh, actions in enumerate(per_mesh) for i, a in enumerate(actions)
    }
    end: dict[Action, float] = {}
    free = [0.0] * len(per_mesh)
    heads = [0] * len(per_mesh)
    slots: list[list[Slot]] = [[] for _ in per_mesh]
    progress = True
    while progress:
        progress = False
        for mesh, actions in enumerate(per_mesh):
            while heads[mesh] < len(actions):
                action = actions[heads[mesh]]
                deps = _dependencies(action, layout, split)
                if any(d not in end for d in deps):
                    break
                start = max([free[mesh], *(end[d] for d in deps)])
                end[action] = start + cost_of(costs, action)
                free[mesh] = end[action]
                slots[mesh].append(Slot(action, start, end[action]))
                heads[mesh] += 1
                progress = True
    stuck = [
        (mesh, actions[heads[mesh]])
        for mesh, actions in enumerate(per_mesh)
        if heads[mesh] < len(actions)
    ]
    if stuck:
        raise ScheduleError(_stuck_message(stuck, layout, split, position, end))
    return Timeline(tuple(tuple(row) for row in slots))


def _stuck_message(stuck, layout, split, position, end) -> str:
    for mesh, action in stuck:
        for dep in _dependencies(action, layout, split):
            dep_mesh, dep_index = position[dep]
            if dep not in end and dep_mesh == mesh and dep_index > position[action][1]:
                return (
                    f"the schedule breaks a dependency: mesh {mesh} runs {action} before {dep}, "
                    f"which {action} needs; put {dep} first."
                )
    waits = "; ".join(
        f"mesh {mesh} waits at {action} for "
        + ", ".join(str(d) for d in _dependencies(action, layout, split) if d not in end)
        for mesh, action in stuck
    )
    return f"the schedule deadlocks: {waits}. Reorder the lists so each wait can be met."


def bubble_formula(
    schedule_name: str, num_meshes: int, microbatches: int, stages_per_mesh: int = 1
) -> float:
    """The textbook bubble fraction of one step: ``(p-1)/(v*m+p-1)`` (``v = 1`` for GPipe
    and 1F1B)."""
    p, m, v = num_meshes, microbatches, stages_per_mesh
    if schedule_name not in ("gpipe", "1f1b", "interleaved-1f1b"):
        raise ScheduleError(f"no closed-form bubble fraction for {schedule_name!r}.")
    return (p - 1) / (v * m + p - 1)


def back_to_back(per_mesh, layout: Layout, steps: int):
    """``(per_mesh, layout)`` of ``steps`` steps run one after the other: step ``k``'s
    microbatch ``b`` is microbatch ``k*m + b``, and each mesh starts a step's actions when
    its own part of the step before is done (its parameters' update needs nothing else)."""
    m = layout.microbatches
    lists = tuple(
        tuple(Action(a.stage, a.kind, a.microbatch + k * m) for k in range(steps) for a in row)
        for row in per_mesh
    )
    return lists, Layout(layout.num_stages, m * steps, layout.stage_to_mesh)


def step_time(per_mesh, layout: Layout, costs: Costs | None = None) -> float:
    """How long a step takes in steady training, steps back to back (:func:`back_to_back`):
    the third step's end minus the second's. This is the time the zero-bubble and
    DualPipe papers' bubble formulas count; one step alone also idles while the pipeline
    fills and drains (:attr:`Timeline.bubble_time`)."""
    return steady(per_mesh, layout, costs)[0]


def steady_bubble(per_mesh, layout: Layout, costs: Costs | None = None) -> float:
    """Idle time per mesh and step in steady training: :func:`step_time` minus the mean
    busy time of a step."""
    took, busy = steady(per_mesh, layout, costs)
    return took - busy


def steady(per_mesh, layout: Layout, costs: Costs | None = None) -> tuple[float, float]:
    """``(step time, mean busy time per mesh and step)`` from one simulation of three steps:
    each mesh runs a later step's actions after an earlier one's, so the first two steps'
    times are what two steps alone would take."""
    timeline = simulate(*back_to_back(per_mesh, layout, 3), costs)
    m = layout.microbatches
    ends = [0.0, 0.0]
    for row in timeline.meshes:
        for slot in row:
            step = slot.action.microbatch // m
            if step:
                ends[step - 1] = max(ends[step - 1], slot.end)
    busy = timeline.busy_times
    return ends[1] - ends[0], sum(busy) / len(busy) / 3


def in_flight(per_mesh, weight: Callable[[int], float] | None = None) -> tuple[float, ...]:
    """Per mesh, the most microbatches' activations it holds at once as its list runs: a
    forward takes one, the weight gradient (or the whole backward) frees it. ``weight(stage)``
    counts a stage's activations (bytes, say); one each without it."""
    split = {(a.stage, a.microbatch) for row in per_mesh for a in row if a.kind is ActionKind.W}
    peaks = []
    for row in per_mesh:
        held = peak = 0.0
        for a in row:
            size = weight(a.stage) if weight else 1.0
            if a.kind is ActionKind.F:
                held += size
            elif a.kind is (ActionKind.W if (a.stage, a.microbatch) in split else ActionKind.B):
                held -= size
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def bubble_time_formula(schedule_name: str, num_meshes: int, costs: Mapping[str, float]) -> float:
    """A schedule's bubble per mesh and step in steady training (:func:`steady_bubble`),
    from the costs of one stage's ``F``, ``I`` and ``W`` (``B`` defaults to ``I + W``).

    - GPipe, 1F1B, interleaved 1F1B (per stage of ``1/v`` of a mesh's layers):
      ``(p-1)(F+B)``;
    - ZB-H1: ``(p-1)(F+I-W)`` (the paper's, for ``W <= F``);
    - ZB-H2: ``(p-1) max(F+I-2W, I-F, 0)``: the paper's ``(p-1)(F+I-2W)`` where that is
      the largest;
    - ZB-V: ``(p-1)(F+I-2W)`` for ``F = I >= W`` (the paper's equal forward and backward
      chunks), zero at equal costs;
    - DualPipeV: ``(p-1)(F&B+B-3W)`` with ``F&B = F+B``, for ``W <= F <= I``. The formula
      is derived for a pair's forward and backward overlapped in one call; mpmdc runs them
      one after the other, each as soon as its own inputs are there, and its bubble there
      is at most this.

    :func:`formula_holds` says whether costs lie in a formula's domain.
    """
    if schedule_name not in BUBBLE_FORMULAS:
        raise ScheduleError(
            f"no published bubble formula for {schedule_name!r}; known: "
            f"{', '.join(BUBBLE_FORMULAS)}."
        )
    f, i, w = (float(costs[k]) for k in "FIW")
    b = float(costs.get("B", i + w))
    return (num_meshes - 1) * BUBBLE_FORMULAS[schedule_name](f, b, i, w)


def formula_holds(
    schedule_name: str,
    costs: Mapping[str, float],
    num_meshes: int | None = None,
    microbatches: int | None = None,
) -> bool:
    """Whether ``costs`` lie where the schedule's published formula holds (``W <= F`` for
    ZB-H1, ``F = I >= W`` for ZB-V, ``W <= F <= I`` for DualPipeV; everywhere for the
    others) and, given the meshes ``p`` and ``microbatches`` ``m``, whether there are
    enough microbatches to fill the pipeline as the formula assumes (``m >= p`` for
    interleaved 1F1B and ZB-H1, ``m >= 2p - 1`` for ZB-H2 and ZB-V; any ``m`` for the
    others: measured by the simulator for ``p`` up to 5)."""
    f, i, w = (float(costs[k]) for k in "FIW")
    if not {"zb-h1": w <= f, "zb-v": f == i and w <= f, "dualpipev": w <= f <= i}.get(
        schedule_name, True
    ):
        return False
    if num_meshes is None or microbatches is None:
        return True
    p = num_meshes
    least = {"interleaved-1f1b": p, "zb-h1": p, "zb-h2": 2 * p - 1, "zb-v": 2 * p - 1}
    return microbatches >= least.get(schedule_name, 1)


# Per schedule, the bubble per mesh and step over ``p - 1`` (see ``bubble_time_formula``).
BUBBLE_FORMULAS: dict[str, Callable[[float, float, float, float], float]] = {
    "gpipe": lambda f, b, i, w: f + b,
    "1f1b": lambda f, b, i, w: f + b,
    "interleaved-1f1b": lambda f, b, i, w: f + b,
    "zb-h1": lambda f, b, i, w: f + i - w,
    "zb-h2": lambda f, b, i, w: max(0.0, f + i - 2 * w, i - f),
    "zb-v": lambda f, b, i, w: f + i - 2 * w,
    "dualpipev": lambda f, b, i, w: (f + b) + b - 3 * w,
}
