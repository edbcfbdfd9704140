"""``partition="balanced"``: the marked segments grouped into the stages a schedule needs.

The markers' indices (and, with ``every="balanced"``, a layer stack's iterations) name
*segments*. To group them, mpmdc takes the program through ``split`` with every segment a
stage of its own, estimates each segment's forward and backward time, memory and the
bytes segments send each other (:mod:`mpmdc.planning.estimates`), and lets
:func:`mpmdc.schedules.balance.balance` choose consecutive groups whose slowest stage
(forward + backward + transfers in and out, per microbatch) is fastest (under a V placement,
whose meshes run two stages each, the slowest mesh), each stage within
the memory its mesh has for it (its devices' memory, where the platform reports it,
divided among the mesh's stages; what a stage holds is its inputs plus its activations
times the microbatches the schedule keeps in flight on it). The program then runs with its
markers renumbered to their stages, and carries the grouping
(:class:`~mpmdc.ir.program.StagePlan`) for ``Lowered`` and ``mpmdc dump`` to show.
"""

from __future__ import annotations

import numpy as np

from mpmdc import schedules
from mpmdc.errors import StageError
from mpmdc.ir.layers import layer_stages, regrouped
from mpmdc.ir.primitives import BALANCED, ActionKind, fragment_p, is_layer_marker
from mpmdc.ir.program import Program, SegmentCost, StagePlan, find_eqns
from mpmdc.pipeline import Pass
from mpmdc.planning.estimates import Estimate, estimate, memory_limit, trial_split
from mpmdc.schedules.balance import balance, balance_v, check_enough, stage_times


def wants_balancing(program: Program, partition) -> bool:
    """Whether ``compile(partition=...)`` or a layer stack's ``every="balanced"`` asks for
    the segments to be grouped."""
    return partition == BALANCED or any(
        e.params["every"] == BALANCED for e in find_eqns(program.jaxpr.jaxpr.eqns, is_layer_marker)
    )


def balanced(program: Program, schedule, through: list[Pass]) -> Program:
    """``program`` with its segments grouped into the stages ``schedule`` runs on the
    program's meshes (one per mesh without a microbatch loop), markers renumbered, and the
    grouping kept as ``program.stage_plan``; estimated on the program taken through
    ``through`` (the pipeline's passes up to ``split``) with every segment a stage."""
    num_meshes = len(program.meshes)
    stages = schedule.stages_for(num_meshes) if program.microbatches else num_meshes
    if program.stage_to_mesh is not None and len(program.stage_to_mesh) != stages:
        raise StageError(
            f"stage_to_mesh has {len(program.stage_to_mesh)} entries, but balancing groups "
            f"the marked segments into {stages} stages: with partition='balanced' it maps "
            f"those stages, one entry each."
        )
    fine = trial_split(program.replace(stage_to_mesh=None), through)
    eqns = fine.jaxpr.jaxpr.eqns
    marked = {e.params["stage"] for e in eqns if e.primitive is fragment_p}
    segments = max([*marked, *layer_stages(eqns)], default=0) + 1
    check_enough(segments, stages)
    found = estimate(fine, segments)
    costs = segment_costs(found, fine.microbatches or 1)
    time = stage_times(costs, found.flow, found.link)
    placement = program.stage_to_mesh
    if placement is None and program.microbatches:
        placement = schedule.placement(stages, num_meshes)
    fits = _memory_rule(program, schedule, placement, stages, costs)
    if placement == schedules.v_placement(num_meshes):
        # A mesh runs stages s and 2M-1-s: balance the meshes' totals.
        groups = balance_v(segments, num_meshes, time, fits)
    else:
        groups = balance(segments, stages, time, fits)
    plan = StagePlan(groups, tuple(time(g[0], g[-1] + 1) for g in groups), tuple(costs))
    renumbered = regrouped(program.jaxpr.jaxpr, plan.stage_of)
    return program.with_eqns(renumbered.eqns).replace(stage_plan=plan)


def segment_costs(found: Estimate, microbatches: int) -> list[SegmentCost]:
    """Each segment's :class:`SegmentCost` from the estimate of a program whose stages are
    the segments: the update after the loop spread over the microbatches."""
    return [
        SegmentCost(
            found.cost(s, ActionKind.F),
            found.cost(s, ActionKind.B) + float(found.after_loop[s]) / microbatches,
            int(found.held[s]),
            int(found.activations[s]),
        )
        for s in range(found.num_stages)
    ]


def _memory_rule(program: Program, schedule, placement, stages: int, costs: list[SegmentCost]):
    """``fits(stage, a, b)``: whether segments ``a..b-1`` fit the memory stage ``stage``'s
    mesh has for it (the mesh's memory shared by its stages in ``placement``, ``None``
    for stage ``s`` on mesh ``s mod M``); everything fits where the platform reports no
    memory limit."""
    num_meshes = len(program.meshes)
    layout = schedules.Layout.make(
        stages, program.microbatches or 1, placement, num_meshes=num_meshes
    )
    per_mesh = schedule.actions(layout) if program.microbatches else None
    share = []
    for mesh in range(num_meshes):
        limit, placed = memory_limit(program.meshes[mesh]), len(layout.stages_of(mesh))
        share.append(None if limit is None or not placed else limit / placed)
    in_flight = [1.0] * stages
    if per_mesh:
        for s in range(stages):
            rows = [[a for a in row if a.stage == s] for row in per_mesh]
            in_flight[s] = max(schedules.in_flight(rows))
    held = np.concatenate([[0], np.cumsum([c.held for c in costs])])
    acts = np.concatenate([[0], np.cumsum([c.activations for c in costs])])

    def fits(stage: int, a: int, b: int) -> bool:
        limit = share[layout.stage_to_mesh[stage]]
        need = held[b] - held[a] + (acts[b] - acts[a]) * in_flight[stage]
        return limit is None or need <= limit

    return fits
