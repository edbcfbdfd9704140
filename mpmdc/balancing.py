"""``partition="balanced"``: the marked segments grouped into the stages a schedule needs.

The markers' indices (and, with ``every="balanced"``, a layer stack's iterations) name
*segments*. To group them, mpmdc takes the program through ``split`` with every segment a
stage of its own, asks XLA's cost analysis for each fragment's flops and bytes, turns them
into seconds with the platform's :class:`Throughput` (a roofline: the larger of compute
and memory time), counts what flows between segments, and lets
:func:`mpmdc.schedules.balance.balance` choose consecutive groups whose slowest stage
(forward + backward + transfers in and out, per microbatch) is fastest, each stage within
the memory its mesh has for it (its devices' memory, where the platform reports it,
divided among the mesh's stages; what a stage holds is its inputs plus its activations
times the microbatches the schedule keeps in flight on it). The program then runs with its
markers renumbered to their stages, and carries the grouping
(:class:`~mpmdc.ir.program.StagePlan`) for ``Lowered`` and ``mpmdc dump`` to show.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from mpmdc import backends, schedules
from mpmdc.ir.layers import layer_stages, regrouped
from mpmdc.ir.primitives import BALANCED, LOOP, ActionKind, fragment_p, is_layer_marker
from mpmdc.ir.program import (
    Program,
    SegmentCost,
    StagePlan,
    find_eqns,
    is_var,
    make_closed_jaxpr,
    nbytes,
)
from mpmdc.ir.sharding import program_spec_forms
from mpmdc.lowering import lower_fragment
from mpmdc.pipeline import resolve, run_pipeline
from mpmdc.schedules.balance import balance, stage_times

# The passes that make a traced program's fragments, one per segment and kind.
_TO_FRAGMENTS = "inline,split-scans,slice-stacks,cond-fission,dce,partition,vma-typecheck,split"


@dataclass(frozen=True)
class Throughput:
    """What a device does per second: ``flops``, memory ``bytes`` and ``link`` bytes to
    another mesh. Rough public figures per platform; only their ratios steer the choice."""

    flops: float
    bytes: float
    link: float


THROUGHPUT = {
    "cpu": Throughput(flops=1e11, bytes=2e10, link=1e10),
    "cuda": Throughput(flops=4e14, bytes=2e12, link=5e10),
    "rocm": Throughput(flops=4e14, bytes=2e12, link=5e10),
    "tpu": Throughput(flops=2e14, bytes=1e12, link=1e11),
}


def wants_balancing(program: Program, partition) -> bool:
    """Whether ``compile(partition=...)`` or a layer stack's ``every="balanced"`` asks for
    the segments to be grouped."""
    return partition == BALANCED or any(
        e.params["every"] == BALANCED for e in find_eqns(program.jaxpr.jaxpr.eqns, is_layer_marker)
    )


def balanced(program: Program, schedule) -> Program:
    """``program`` with its segments grouped into the stages ``schedule`` runs on the
    program's meshes (one per mesh without a microbatch loop), markers renumbered, and the
    grouping kept as ``program.stage_plan``."""
    num_meshes = len(program.meshes)
    stages = schedule.stages_for(num_meshes) if program.microbatches else num_meshes
    with warnings.catch_warnings():
        # A trial layout with a stage per segment: what it would warn of never runs.
        warnings.simplefilter("ignore")
        fine = run_pipeline(program.replace(stage_to_mesh=None), resolve(_TO_FRAGMENTS))
    segments = _num_segments(fine)
    costs, flow = _segment_costs(fine, segments)
    throughput = THROUGHPUT[backends.get(program.backend).platform]
    time = stage_times(costs, flow, 1.0 / throughput.link)
    fits = _memory_rule(program, schedule, stages, costs)
    groups = balance(segments, stages, time, fits)
    plan = StagePlan(groups, tuple(time(g[0], g[-1] + 1) for g in groups), tuple(costs))
    jaxpr = program.jaxpr.jaxpr
    renumbered = regrouped(jaxpr, plan.stage_of)
    closed = make_closed_jaxpr(
        jaxpr.constvars,
        program.jaxpr.consts,
        jaxpr.invars,
        jaxpr.outvars,
        renumbered.eqns,
        jaxpr.debug_info,
    )
    return program.replace(jaxpr=closed, stage_plan=plan)


def _num_segments(fine: Program) -> int:
    eqns = fine.jaxpr.jaxpr.eqns
    marked = {e.params["stage"] for e in eqns if e.primitive is fragment_p}
    return max([*marked, *layer_stages(eqns)], default=0) + 1


def _segment_costs(fine: Program, segments: int) -> tuple[list[SegmentCost], np.ndarray]:
    """Per segment, its :class:`SegmentCost`; and ``flow[i, j]``, the bytes per microbatch
    segment ``i``'s loop fragments send to segment ``j``'s."""
    throughput = THROUGHPUT[backends.get(fine.backend).platform]
    chosen = backends.get(fine.backend)
    forms = program_spec_forms(fine)
    microbatches = fine.microbatches or 1
    forward, backward = np.zeros(segments), np.zeros(segments)
    held, activations = np.zeros(segments, dtype=np.int64), np.zeros(segments, dtype=np.int64)
    flow = np.zeros((segments, segments))
    producer: dict = {}  # value -> (segment, kind) of the fragment that made it
    inputs = set(fine.jaxpr.jaxpr.invars)
    read_inputs: set = set()
    for eqn in fine.jaxpr.jaxpr.eqns:
        if eqn.primitive is not fragment_p:
            for a, v in zip(eqn.invars, eqn.outvars):
                if is_var(a) and a in producer:
                    producer[v] = producer[a]
                elif a in inputs:
                    inputs.add(v)
            continue
        s, kind = eqn.params["stage"], eqn.params["kind"]
        in_loop = eqn.params["microbatch"] is LOOP
        cost = lower_fragment(fine, eqn, chosen, forms).cost_analysis() or {}
        seconds = max(
            cost.get("flops", 0.0) / throughput.flops,
            cost.get("bytes accessed", 0.0) / throughput.bytes,
        )
        share = seconds if in_loop else seconds / microbatches
        if kind is ActionKind.F:
            forward[s] += share
        else:
            backward[s] += share
        for a in eqn.invars:
            if not is_var(a):
                continue
            if a in inputs and (a, s) not in read_inputs:
                read_inputs.add((a, s))
                held[s] += nbytes(a.aval)
            source = producer.get(a)
            if source is None or not in_loop:
                continue
            if source[0] != s:
                flow[source[0], s] += nbytes(a.aval)
            elif source[1] is ActionKind.F and kind is not ActionKind.F:
                activations[s] += nbytes(a.aval)
        for v in eqn.outvars:
            producer[v] = (s, kind)
    costs = [
        SegmentCost(float(f), float(b), int(h), int(a))
        for f, b, h, a in zip(forward, backward, held, activations)
    ]
    return costs, flow


def _memory_rule(program: Program, schedule, stages: int, costs: list[SegmentCost]):
    """``fits(stage, a, b)``: whether segments ``a..b-1`` fit the memory stage ``stage``'s
    mesh has for it; everything fits where the platform reports no memory limit."""
    num_meshes = len(program.meshes)
    placement = schedule.placement(stages, num_meshes) if program.microbatches else None
    layout = schedules.Layout.make(
        stages, program.microbatches or 1, placement, num_meshes=num_meshes
    )
    per_mesh = schedule.actions(layout) if program.microbatches else None
    limits = []
    for mesh in range(num_meshes):
        devices = program.meshes[mesh].devices.flat
        stats = [d.memory_stats() or {} for d in devices]
        limit = sum(st.get("bytes_limit", 0) for st in stats)
        limits.append(limit / len(layout.stages_of(mesh)) if limit else None)
    in_flight = [
        schedules.in_flight([[a for a in row if a.stage == s] for row in per_mesh])[
            layout.stage_to_mesh[s]
        ]
        if per_mesh
        else 1
        for s in range(stages)
    ]
    held = np.concatenate([[0], np.cumsum([c.held for c in costs])])
    acts = np.concatenate([[0], np.cumsum([c.activations for c in costs])])

    def fits(stage: int, a: int, b: int) -> bool:
        limit = limits[layout.stage_to_mesh[stage]]
        need = held[b] - held[a] + (acts[b] - acts[a]) * in_flight[stage]
        return limit is None or need <= limit

    return fits
