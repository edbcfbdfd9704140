"""Pipeline schedules: which fragment each mesh runs next, as per-mesh action lists.

A schedule turns a :class:`~mpmdc.schedules.actions.Layout` (stages, microbatches,
stage-to-mesh map) into one list of :class:`~mpmdc.schedules.actions.Action` per mesh. Built in, also by name:

- ``GPipe()`` ("gpipe"): every forward, then every backward.
- ``OneFOneB()`` ("1f1b"): a warm-up of forwards, then one forward and one backward
  alternately, so a mesh holds at most as many microbatches as there are stages after it.
- ``Interleaved1F1B()`` ("interleaved-1f1b"): several stages per mesh (stage ``s`` on
  mesh ``s mod p``), forwards in groups of ``p`` microbatches per stage, 1F1B between.
- ``ZeroBubbleH1()`` ("zb-h1"): the backward split into ``I`` and ``W``; weight
  gradients wait to fill the bubbles 1F1B leaves, with 1F1B's memory limit.
- ``ActionLists([...])``: a user's own lists, e.g. ``["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]``.

Every schedule is checked against the data dependencies by :mod:`mpmdc.schedules.simulate`
before it runs.
"""

from __future__ import annotations

from typing import ClassVar

from mpmdc.errors import ScheduleError
from mpmdc.ir.primitives import ActionKind
from mpmdc.schedules.actions import Action, Layout


class Schedule:
    """Base class: a rule that gives each mesh its list of actions."""

    name: ClassVar[str] = ""

    def actions(self, layout: Layout) -> tuple[tuple[Action, ...], ...]:
        """One tuple of actions per mesh, in the order that mesh runs them."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _one_stage_per_mesh(schedule: Schedule, layout: Layout) -> None:
    """A ``ScheduleError`` saying which schedule runs ``layout`` unless every mesh has one stage."""
    p = layout.num_meshes
    for mesh in range(p):
        if len(layout.stages_of(mesh)) != 1:
            # The schedule is chosen with the layout (compile's `schedule=`), so the
            # message names the call that runs this layout.
            if layout.round_robin:
                instead = (
                    f"for {layout.num_stages} stages on {p} mesh{'es' * (p > 1)} use "
                    f"mpmdc.compile(..., schedule='interleaved-1f1b'), or schedule='gpipe', "
                    f"which takes any stage-to-mesh map"
                )
            else:
                instead = (
                    "use mpmdc.compile(..., schedule='gpipe'), which takes any stage-to-mesh "
                    f"map (interleaved-1f1b needs stage s on mesh s mod {p})"
                )
            raise ScheduleError(
                f"{schedule.name} runs exactly one stage per mesh, but mesh {mesh} has stages "
                f"{layout.stages_of(mesh)}; {instead}."
            )


class GPipe(Schedule):
    """All forwards, then all backwards (each mesh holds every microbatch's activations)."""

    name = "gpipe"

    def actions(self, layout):
        out = []
        for mesh in range(layout.num_meshes):
            stages = layout.stages_of(mesh)
            forwards = [
                Action(s, ActionKind.F, b) for s in stages for b in range(layout.microbatches)
            ]
            backwards = [
                Action(s, ActionKind.B, b)
                for s in reversed(stages)
                for b in range(layout.microbatches)
            ]
            out.append(tuple(forwards + backwards))
        return tuple(out)


def _one_f_one_b(forwards, backwards, warmup):
    """Warm-up forwards, then one forward and one backward alternately, then the rest."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return tuple(order + list(backwards[len(forwards) - warmup :]))


class OneFOneB(Schedule):
    """1F1B: stage ``s`` of ``p`` runs ``p - 1 - s`` forwards, then alternates F and B."""

    name = "1f1b"

    def actions(self, layout):
        _one_stage_per_mesh(self, layout)
        out = []
        for mesh in range(layout.num_meshes):
            (s,) = layout.stages_of(mesh)
            m = layout.microbatches
            forwards = [Action(s, ActionKind.F, b) for b in range(m)]
            backwards = [Action(s, ActionKind.B, b) for b in range(m)]
            out.append(_one_f_one_b(forwards, backwards, layout.num_stages - 1 - s))
        return tuple(out)


class Interleaved1F1B(Schedule):
    """Interleaved 1F1B: ``v`` stages per mesh, microbatches in groups of ``p`` per stage.

    Needs stage ``s`` on mesh ``s mod p`` and a microbatch count divisible by ``p``.
    """

    name = "interleaved-1f1b"

    def actions(self, layout):
        p, n, m = layout.num_meshes, layout.num_stages, layout.microbatches
        if not layout.round_robin:
            raise ScheduleError(
                f"interleaved-1f1b needs stage s on mesh s mod {p} and a whole number of stages "
                f"per mesh; got stage_to_mesh={list(layout.stage_to_mesh)}."
            )
        if m % p:
            raise ScheduleError(
                f"interleaved-1f1b runs microbatches in groups of {p} (one per mesh); "
                f"{m} microbatches is not a multiple of {p}."
                + (
                    f" (With {n} stages on {n} meshes nothing interleaves: put several stages on each mesh.)"
                    if n == p
                    else ""
                )
            )
        v = n // p
        total = m * v

        def chunk(k):
            return (k % (p * v)) // p

        def microbatch(k):
            return (k // (p * v)) * p + k % p

        out = []
        for r in range(p):
            forwards = [Action(chunk(k) * p + r, ActionKind.F, microbatch(k)) for k in range(total)]
            backwards = [
                Action((v - 1 - chunk(k)) * p + r, ActionKind.B, microbatch(k))
                for k in range(total)
            ]
            out.append(_one_f_one_b(forwards, backwards, (p - r - 1) * 2 + (v - 1) * p))
        return tuple(out)


class ZeroBubbleH1(Schedule):
    """ZB-H1: the backward split into input (I) and weight (W) gradients.

    Each mesh runs 1F1B's order with ``I`` in place of ``B``; the weight gradient of
    microbatch ``j`` on stage ``s`` waits until after ``I`` of microbatch ``j + s``
    (the rest come last). The deferred ``W``s fill the bubbles the backward wave leaves
    in 1F1B, while at most ``p`` microbatches are in flight on any mesh.
    """

    name = "zb-h1"

    def actions(self, layout):
        _one_stage_per_mesh(self, layout)
        p, m = layout.num_stages, layout.microbatches
        out = [()] * layout.num_meshes
        for s in range(p):
            forwards = [Action(s, ActionKind.F, b) for b in range(m)]
            inputs = [Action(s, ActionKind.I, b) for b in range(m)]
            order = []
            for action in _one_f_one_b(forwards, inputs, p - 1 - s):
                order.append(action)
                if action.kind is ActionKind.I and action.microbatch >= s:
                    order.append(Action(s, ActionKind.W, action.microbatch - s))
            order += [Action(s, ActionKind.W, b) for b in range(max(0, m - s), m)]
            out[layout.stage_to_mesh[s]] = tuple(order)
        return tuple(out)


class ActionLists(Schedule):
    """A user-defined schedule: one action list per mesh (strings or ``Action`` sequences)."""

    name = "custom"

    def __init__(self, per_mesh):
        lists = []
        for mesh_actions in per_mesh:
            if isinstance(mesh_actions, str):
                mesh_actions = mesh_actions.split()
            lists.append(
                tuple(a if isinstance(a, Action) else Action.parse(a) for a in mesh_actions)
            )
        self.lists = tuple(lists)

    def actions(self, layout):
        if len(self.lists) != layout.num_meshes:
            raise ScheduleError(
                f"the schedule has {len(self.lists)} action list(s) but the pipeline uses "
                f"{layout.num_meshes} meshes; give one list per mesh."
            )
        return self.lists

    def __repr__(self) -> str:
        return f"ActionLists({[' '.join(map(str, a)) for a in self.lists]!r})"


SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1)
}


def get(schedule) -> Schedule:
    """A schedule object from a name, a ``Schedule`` or per-mesh action lists."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ScheduleError(
                f"unknown schedule {schedule!r}; known schedules: {', '.join(SCHEDULES)} "
                f"(or a list of per-mesh action strings)."
            )
        return SCHEDULES[schedule]()
    if isinstance(schedule, (list, tuple)):
        return ActionLists(schedule)
    raise ScheduleError(
        f"schedule must be a name ({', '.join(SCHEDULES)}), an mpmdc.schedules.Schedule or "
        f"per-mesh action lists, got {type(schedule).__name__}."
    )
