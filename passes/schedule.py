"""``schedule``: stamp out a split program's loop and order its fragment calls by the
pipeline schedule.

A program with an ``mpmdc.accumulate`` loop holds one iteration of it (a rolled loop,
:mod:`mpmdc.ir.loop`): one fragment per (stage, transpose count), each standing for a
schedule action of every microbatch: forward fragments for ``F``, backward ones for
``B`` (or ``I`` and ``W``, cut by ``split-backward``). (Under a transformation,
``accumulate`` unrolls its loop instead, and the program has those fragments per
microbatch already.) The pass

1. builds the pipeline's layout (stages, microbatches, mesh per stage) and asks the
   loop's schedule for its per-mesh action lists;
2. stamps the iteration's fragments and transfers out per microbatch
   (:func:`mpmdc.ir.loop.stamp`);
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

from mpmdc.passes.base import Property, register

from mpmdc.ir.graph import def_use
from mpmdc.ir.loop import stamp
from mpmdc.ir.program import Phase, Program
from mpmdc.schedules import Action, action_of, actions_of, layout_of, simulate


def _ordered(eqns, start: dict[Action, float]):
    """``eqns`` in dependency order, earliest time first among the ready ones: an
    action's simulated start; for other work read by actions, the first of their
    starts (a transfer, a slice of the batch, a running sum's start: issued where the
    mesh's own schedule needs them, so a mesh holds a microbatch's values from the
    work that needs them on, as the schedule counts); for the rest (work after the
    loop), as soon as its operands are."""
    import networkx as nx  # (here, not at the top: it is a tenth of `import mpmdc`)

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
    "schedule",
    "stamp the microbatch loop out and order fragment calls by the schedule",
    requires={Property.PLANNED, Property.SPLIT},
    produces={Property.SCHEDULED},
)
def schedule(program: Program) -> Program:
    """Order the fragments of ``program``'s microbatch loop by its schedule."""
    if program.schedule is None:  # (its calls are in the order they run already)
        return program.replace(phase=Phase.SCHEDULED)
    layout = layout_of(program)
    timeline = simulate(actions_of(program), layout)
    start = {slot.action: slot.start for row in timeline.meshes for slot in row}
    program = program.replace(jaxpr=stamp(program.jaxpr, layout.microbatches))
    ordered = program.with_eqns(_ordered(list(program.jaxpr.jaxpr.eqns), start))
    return ordered.replace(phase=Phase.SCHEDULED)
