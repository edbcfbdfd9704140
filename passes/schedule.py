"""``schedule``: stamp out a split program's loop and order its fragment calls by the
pipeline schedule.

A program with an ``mpmdc.accumulate`` loop holds one iteration of it (a rolled loop,
:mod:`mpmdc.ir.loop`): one fragment per (stage, transpose count), each standing for a
schedule action of every microbatch: forward fragments for ``F``, backward ones for
``B``. (Under a transformation, ``accumulate`` unrolls its loop instead, and the
program has those fragments per microbatch already.) The pass

1. builds the pipeline's layout (stages, microbatches, mesh per stage) and asks the
   loop's schedule for its per-mesh action lists;
2. stamps the iteration's fragments and transfers out per microbatch; for a
   schedule with ``I``/``W`` actions (zero-bubble), each backward fragment it splits
   is cut in two once: the input-gradient part computes what earlier stages read (the
   cotangents) and whatever that needs; the weight-gradient part is the rest and
   reads what it needs of the first part's values;
3. checks the action lists against the data dependencies and times them with
   :func:`mpmdc.simulate.simulate` (a broken or deadlocking schedule is a
   :class:`~mpmdc.errors.ScheduleError` here, before anything runs);
4. reorders the top-level equations: a dependency-respecting order that, among the
   equations ready to run, always takes the one whose action starts first in the
   simulated timeline. Transfers and other work that actions read go right before
   the first action reading them; work after the loop as early as its operands allow.
   So each mesh calls its fragments in the schedule's order, and receives a
   microbatch's values when its own schedule needs them, which is what decides how
   many microbatches' activations it holds at once.

The last stage's backward shares a fragment with its forward (see ``partition``),
so its ``B`` action is run as part of its ``F`` action, as 1F1B does anyway.
A program without an ``accumulate`` loop passes through unchanged.
"""

from __future__ import annotations

import math

import networkx as nx
from jax.extend import core as jcore
from jax.sharding import PartitionSpec
from mpmdc.passes.base import register

from mpmdc.ir.graph import def_use
from mpmdc.ir.loop import rolled_loop, stamp
from mpmdc.ir.primitives import ActionKind, fragment_p, transfer_p
from mpmdc.ir.program import (
    Program,
    fresh_like,
    is_var,
    make_closed_jaxpr,
    sub_jaxpr,
    vars_of,
)
from mpmdc.schedules import Action, Layout, action_of, simulate


def layout_of(program: Program) -> Layout:
    """Stages, microbatches and stage-to-mesh map of a split program with a loop."""
    stages = [e.params["stage"] for e in program.jaxpr.jaxpr.eqns if e.primitive is fragment_p]
    num_stages = max(stages, default=0) + 1
    return Layout.make(
        num_stages,
        program.microbatches,
        tuple(program.mesh_of_stage(s) for s in range(num_stages)),
    )


def _final_readers(eqns):
    """For each variable, the fragment equations that read it, directly or via transfers."""
    direct = def_use(eqns).readers
    out: dict = {}

    def readers(v):
        if v not in out:
            found = []
            for r in (eqns[i] for i in direct.get(v, ())):
                if r.primitive is transfer_p:
                    found += readers(r.outvars[r.invars.index(v)])
                else:
                    found.append(r)
            out[v] = found
        return out[v]

    return readers


def _sub_fragment(eqn, members, outs, outer_in, name, kind):
    """``(operands, params)`` of a fragment running ``members`` of ``eqn``'s body, returning
    body values ``outs``; ``outer_in`` maps body variables to (top-level value, spec)."""
    closed = eqn.params["jaxpr"]
    const_of = dict(zip(closed.jaxpr.constvars, closed.consts))
    inputs, inner = sub_jaxpr(members, outs, const_of, name)
    params = dict(
        eqn.params,
        jaxpr=inner,
        name=name,
        kind=kind,
        in_specs=tuple(outer_in[v][1] for v in inputs),
        donate_argnums=(),
    )
    return [outer_in[v][0] for v in inputs], params


def _part_name(name: str, kind: ActionKind) -> str:
    """``s1_bwd_mb3`` becomes ``s1_igrad_mb3`` or ``s1_wgrad_mb3``."""
    part = f"_{kind.lower()}grad"
    return name.replace("_bwd", part, 1) if "_bwd" in name else name + part


def split_backward(eqn, is_cotangent: list[bool]) -> list:
    """Cut backward fragment ``eqn`` into input-gradient (``I``) and weight-gradient (``W``) parts.

    ``is_cotangent[k]`` says whether output ``k`` is read by another stage. A part
    with no equations and no outputs is left out.
    """
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    needed = {v for v, c in zip(body.outvars, is_cotangent) if c and is_var(v)}
    in_input_part = [False] * len(body.eqns)
    for k in reversed(range(len(body.eqns))):
        if any(v in needed for v in body.eqns[k].outvars):
            in_input_part[k] = True
            needed.update(vars_of(body.eqns[k].invars))
    input_eqns = [e for e, i in zip(body.eqns, in_input_part) if i]
    weight_eqns = [e for e, i in zip(body.eqns, in_input_part) if not i]
    weight_defined = {v for e in weight_eqns for v in e.outvars if is_var(v)}
    input_defined = {v for e in input_eqns for v in e.outvars if is_var(v)}

    # Input-part values the weight part reads cross between the two as replicated values.
    bridges = []
    for a in [a for e in weight_eqns for a in vars_of(e.invars)]:
        if a in input_defined and a not in bridges:
            bridges.append(a)
    outer_in = {v: (o, s) for v, o, s in zip(body.invars, eqn.invars, eqn.params["in_specs"])}
    bridge_outer = {v: fresh_like(v) for v in bridges}
    outer_in.update((v, (bridge_outer[v], PartitionSpec())) for v in bridges)

    in_weight = [is_var(v) and v in weight_defined for v in body.outvars]
    parts = []
    for kind, members, chosen, extra in (
        (ActionKind.I, input_eqns, [not w for w in in_weight], bridges),
        (ActionKind.W, weight_eqns, in_weight, []),
    ):
        outs = [v for v, c in zip(body.outvars, chosen) if c] + extra
        if not members and not outs:
            continue
        name = _part_name(eqn.params["name"], kind)
        invars, params = _sub_fragment(eqn, members, outs, outer_in, name, kind)
        outvars = [o for o, c in zip(eqn.outvars, chosen) if c] + [bridge_outer[v] for v in extra]
        params["out_specs"] = tuple(s for s, c in zip(eqn.params["out_specs"], chosen) if c) + (
            PartitionSpec(),
        ) * len(extra)
        parts.append(
            jcore.new_jaxpr_eqn(
                invars, outvars, fragment_p, params, params["jaxpr"].effects, eqn.source_info
            )
        )
    return parts


def _backward_splitter(eqns):
    """``parts(eqn)``: backward fragment ``eqn`` of ``eqns`` cut by :func:`split_backward`,
    its outputs read by another stage (directly or through transfers) being cotangents."""
    readers = _final_readers(eqns)

    def parts(eqn) -> list:
        stage = eqn.params["stage"]
        is_cotangent = [any(r.params["stage"] != stage for r in readers(v)) for v in eqn.outvars]
        return split_backward(eqn, is_cotangent)

    return parts


def _is_split(eqn, microbatch, wanted: set[Action]) -> bool:
    """Whether the schedule runs backward fragment ``eqn`` on ``microbatch`` as I and W."""
    return (
        eqn.primitive is fragment_p
        and eqn.params["kind"] is ActionKind.B
        and Action(eqn.params["stage"], ActionKind.I, microbatch) in wanted
    )


def _with_split_backwards(eqns, wanted: set[Action]):
    """An unrolled loop's ``eqns`` with the backwards the schedule splits cut in two."""
    parts = _backward_splitter(eqns)
    out = []
    for eqn in eqns:
        action = action_of(eqn)
        if action is not None and _is_split(eqn, action.microbatch, wanted):
            out += parts(eqn)
        else:
            out.append(eqn)
    return out


def _stamped(closed, microbatches: int, wanted: set[Action]):
    """A rolled loop's program stamped out per microbatch (:func:`stamp`), each
    microbatch's backwards cut in two where the schedule splits them; each backward
    of the iteration is cut once, whatever the microbatch count."""
    iteration = rolled_loop(closed.jaxpr.eqns).iteration
    splitter = _backward_splitter(closed.jaxpr.eqns)
    cut: dict[int, list] = {}

    def iteration_of(i: int) -> list:
        out = []
        for k, eqn in enumerate(iteration):
            if _is_split(eqn, i, wanted):
                if k not in cut:
                    cut[k] = splitter(eqn)
                out += cut[k]
            else:
                out.append(eqn)
        return out

    return stamp(closed, microbatches, iteration_of)


def _ordered(eqns, start: dict[Action, float]):
    """``eqns`` in dependency order, earliest time first among the ready ones: an
    action's simulated start; for other work read by actions, the first of their
    starts (a transfer, a slice of the batch, a running sum's start: issued where the
    mesh's own schedule needs them, so a mesh holds a microbatch's values from the
    work that needs them on, as the schedule counts); for the rest (work after the
    loop), as soon as its operands are."""
    producer, readers, reads = def_use(eqns)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(eqns)))
    ready = []
    for i, eqn in enumerate(eqns):
        deps = {producer[a] for a in reads[i] if a in producer}
        graph.add_edges_from((j, i) for j in deps)
        action = action_of(eqn)
        if action is not None and action in start:
            ready.append(start[action])
        else:
            ready.append(max((ready[j] for j in deps), default=-math.inf))
    needed: list[float | None] = [None] * len(eqns)
    for i in reversed(range(len(eqns))):
        action = action_of(eqns[i])
        if action is not None and action in start:
            needed[i] = start[action]
            continue
        later = [needed[j] for v in eqns[i].outvars for j in readers.get(v, ())]
        if later and None not in later:
            needed[i] = min(later)
    time = [ready[i] if t is None else t for i, t in enumerate(needed)]
    order = nx.lexicographical_topological_sort(graph, key=lambda i: (time[i], i))
    return [eqns[i] for i in order]


@register(
    "schedule", "split backwards for zero-bubble schedules and order fragments by the schedule"
)
def schedule(program: Program) -> Program:
    """Order the fragments of ``program``'s microbatch loop by its schedule."""
    if program.schedule is None:
        return program
    layout = layout_of(program)
    per_mesh = program.schedule.actions(layout)
    timeline = simulate(per_mesh, layout)
    start = {slot.action: slot.start for row in timeline.meshes for slot in row}
    if rolled_loop(program.jaxpr.jaxpr.eqns) is not None:
        program = program.replace(jaxpr=_stamped(program.jaxpr, layout.microbatches, set(start)))
        eqns = list(program.jaxpr.jaxpr.eqns)
    else:
        eqns = _with_split_backwards(list(program.jaxpr.jaxpr.eqns), set(start))
    jaxpr = program.jaxpr.jaxpr
    closed = make_closed_jaxpr(
        jaxpr.constvars,
        program.jaxpr.consts,
        jaxpr.invars,
        jaxpr.outvars,
        _ordered(eqns, start),
        jaxpr.debug_info,
    )
    return program.replace(jaxpr=closed)
