"""Schedule actions and pipeline layouts: the vocabulary schedules are written in.

An action is ``<stage><kind><microbatch>``: ``0F3`` is stage 0's forward of
microbatch 3; ``B`` is a whole backward, or ``I`` (input gradient) and ``W`` (weight
gradient) where a schedule splits it (:class:`~mpmdc.ir.primitives.ActionKind`). A
:class:`Layout` is the shape of a pipeline a schedule orders: stages, microbatches and
the mesh of each stage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mpmdc.errors import ScheduleError
from mpmdc.ir.primitives import ActionKind, fragment_p
from mpmdc.ir.program import LoopSchedule, Program

_ACTION = re.compile(rf"^(\d+)([{''.join(ActionKind)}])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One fragment call: ``stage``'s ``kind`` (F, B, I or W) on ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self):
        if type(self.kind) is not ActionKind:  # "F" works as well as ActionKind.F
            object.__setattr__(self, "kind", _kind(self.kind))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``Action`` from its text form, e.g. ``"2B5"``."""
        match = _ACTION.match(text.strip()) if isinstance(text, str) else None
        if not match:
            raise ScheduleError(
                f"{text!r} is not an action; write <stage><F|B|I|W><microbatch>, e.g. 0F1 or 3B0."
            )
        return cls(int(match[1]), ActionKind(match[2]), int(match[3]))


def _kind(kind) -> ActionKind:
    """``kind`` as an ``ActionKind``; anything but F, B, I or W is a ``ScheduleError``."""
    try:
        return ActionKind(kind)
    except ValueError:
        raise ScheduleError(
            f"{kind!r} is not an action kind; use one of {', '.join(ActionKind)} (forward, "
            f"backward, input gradient, weight gradient)."
        ) from None


@dataclass(frozen=True)
class Layout:
    """The shape of a pipeline: stages, microbatches and the mesh of each stage."""

    num_stages: int
    microbatches: int
    stage_to_mesh: tuple[int, ...]

    @classmethod
    def make(
        cls, num_stages: int, microbatches: int, stage_to_mesh=None, num_meshes=None
    ) -> Layout:
        """Stage ``s`` on mesh ``s mod num_meshes`` unless ``stage_to_mesh`` says otherwise."""
        if num_stages < 1 or microbatches < 1:
            raise ScheduleError(
                f"a schedule needs at least one stage and one microbatch, got {num_stages} "
                f"stage(s) and {microbatches} microbatch(es)."
            )
        if stage_to_mesh is None:
            stage_to_mesh = tuple(s % (num_meshes or num_stages) for s in range(num_stages))
        if len(stage_to_mesh) != num_stages:
            raise ScheduleError(
                f"stage_to_mesh has {len(stage_to_mesh)} entries for {num_stages} stages."
            )
        return cls(num_stages, microbatches, tuple(stage_to_mesh))

    @property
    def num_meshes(self) -> int:
        """Meshes the stages use (mesh indices are 0..num_meshes-1)."""
        return max(self.stage_to_mesh) + 1

    def stages_of(self, mesh: int) -> list[int]:
        """The stages mesh ``mesh`` runs, in order."""
        return [s for s, m in enumerate(self.stage_to_mesh) if m == mesh]

    @property
    def round_robin(self) -> bool:
        """Stage ``s`` on mesh ``s mod num_meshes`` and as many stages on every mesh: the
        layout interleaved schedules run."""
        p = self.num_meshes
        return self.num_stages % p == 0 and all(
            m == s % p for s, m in enumerate(self.stage_to_mesh)
        )


def action_of(eqn) -> Action | None:
    """The schedule action a fragment equation carries out (``None`` outside the loop)."""
    if eqn.primitive is not fragment_p or eqn.params["microbatch"] is None:
        return None
    return Action(eqn.params["stage"], eqn.params["kind"], eqn.params["microbatch"])


def layout_of(program: Program) -> Layout:
    """The layout of ``program``'s microbatch loop: stages, microbatches, mesh per stage."""
    plan = program.schedule
    return Layout(len(plan.stage_to_mesh), program.microbatches, plan.stage_to_mesh)


def actions_of(program: Program) -> tuple[tuple[Action, ...], ...]:
    """Each mesh's actions of ``program``'s microbatch loop, in order."""
    return tuple(tuple(map(Action.parse, row)) for row in program.schedule.actions)


def loop_schedule(schedule, layout: Layout) -> LoopSchedule:
    """``schedule`` (an ``mpmdc.schedules.Schedule``) run on ``layout``, as the plain data
    a program holds."""
    per_mesh = schedule.actions(layout)
    return LoopSchedule(
        repr(schedule), layout.stage_to_mesh, tuple(tuple(map(str, row)) for row in per_mesh)
    )
