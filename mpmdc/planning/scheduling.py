"""The microbatch loop's schedule on the program's stages: given outright, or chosen by
a chooser (``schedule="auto"`` or a function) from the pipeline's estimated costs."""

from __future__ import annotations

import dataclasses

from mpmdc import schedules
from mpmdc.errors import ScheduleError
from mpmdc.ir.layers import layer_stages
from mpmdc.ir.primitives import ActionKind, fragment_p, is_marker
from mpmdc.ir.program import Program, find_eqns
from mpmdc.passes.split_backward import split_backward
from mpmdc.pipeline import Pass
from mpmdc.planning.estimates import estimate, memory_limit, trial_split


def scheduled(program: Program, schedule, microbatches: int, choice=None) -> Program:
    """``program`` with ``schedule`` run on the layout its stage markers make: the mesh of
    each stage (``stage_to_mesh``, else the schedule's own placement, else stage ``s`` on
    mesh ``s mod M``; a ``StageError`` names the marker of a stage without one) and each
    mesh's actions, as the plain data the program holds."""
    markers: dict = {}
    for eqn in find_eqns(program.jaxpr.jaxpr.eqns, is_marker):
        markers.setdefault(eqn.params["stage"], eqn)
    marked = {*markers, *layer_stages(program.jaxpr.jaxpr.eqns)}
    stages = max(marked, default=0) + 1
    if program.stage_to_mesh is None:
        placement = schedule.placement(stages, len(program.meshes))
        if placement is not None:
            program = program.replace(stage_to_mesh=placement)
    for stage, marker in sorted(markers.items()):
        program.mesh_of_stage(stage, marker)
    layout = schedules.Layout.make(
        stages, microbatches, tuple(map(program.mesh_of_stage, range(stages)))
    )
    try:
        plan = schedules.loop_schedule(schedule, layout)
    except ScheduleError as err:
        # Said where an unmarked stage shares a mesh with another: a layout the schedule
        # refuses for its empty stages alone.
        unmarked = sorted(set(range(stages)) - marked) if marked else []
        crowded = any(
            len(on) > 1 and not marked.issuperset(on)
            for on in map(layout.stages_of, range(layout.num_meshes))
        )
        if not (unmarked and crowded):
            raise
        raise ScheduleError(
            f"{err} Stages {unmarked} have no marker (the marked indices skip them), and "
            f"a schedule runs every stage up to the highest marked, {stages - 1}, empty or "
            f"not: number the stages without gaps (stage_to_mesh still puts each on any "
            f"mesh), or use schedule='gpipe'."
        ) from None
    return program.replace(schedule=dataclasses.replace(plan, choice=choice))


def pipeline_of(
    program: Program, chooser, microbatches: int, through: list[Pass]
) -> schedules.Pipeline:
    """What ``chooser`` (``schedule="auto"`` or a function) chooses from for the traced
    ``program``: its stages, meshes and placement, each action's seconds (``chooser.costs``
    where measured, else estimated with every backward cut into ``I`` and ``W``), each
    stage's activation bytes and each mesh's memory cap (``chooser.memory_cap``, else its
    devices' memory less the inputs its stages read)."""
    trial = trial_split(program, through)
    eqns = trial.jaxpr.jaxpr.eqns
    stages = 1 + max(e.params["stage"] for e in eqns if e.primitive is fragment_p)
    num_meshes = len(program.meshes)
    layout = schedules.Layout.make(
        stages, microbatches, tuple(map(trial.mesh_of_stage, range(stages)))
    )
    cut = schedules.ActionLists(
        [
            [b for a in row for b in ([a] if a.kind is ActionKind.F else _input_then_weight(a))]
            for row in schedules.GPipe().actions(layout)
        ]
    )
    found = estimate(
        split_backward(trial.replace(schedule=schedules.loop_schedule(cut, layout))), stages
    )
    if isinstance(chooser.costs, schedules.Timeline):
        timed = {s.action.stage for row in chooser.costs.meshes for s in row if s.action}
        if timed != set(range(stages)):
            raise ScheduleError(
                f"the measured timeline has actions of stages {sorted(timed)}, but this "
                f"program runs stages 0..{stages - 1}; time this program (with the stages "
                f"it will run) with Compiled.run_timed."
            )
    cost = schedules.measured(chooser.costs) or found.action_cost
    cap = chooser.memory_cap
    if isinstance(cap, tuple) and len(cap) != num_meshes:
        raise ScheduleError(
            f"memory_cap has {len(cap)} entries for {num_meshes} meshes; give one per mesh "
            f"or one number for all."
        )
    return schedules.Pipeline(
        num_stages=stages,
        num_meshes=num_meshes,
        microbatches=microbatches,
        stage_to_mesh=program.stage_to_mesh,
        cost=cost,
        activations=tuple(float(a) for a in found.activations),
        memory_cap=cap if isinstance(cap, tuple) else (cap,) * num_meshes,
        held=tuple(float(h) for h in found.held),
        memory=tuple(memory_limit(mesh) for mesh in program.meshes),
    )


def _input_then_weight(action: schedules.Action) -> list[schedules.Action]:
    return [
        schedules.Action(action.stage, ActionKind.I, action.microbatch),
        schedules.Action(action.stage, ActionKind.W, action.microbatch),
    ]
