"""When the runtime frees each value, and what that means for memory per mesh.

The runtime runs a split program's top-level equations in order and drops every
intermediate value right after the equation that reads it last. Because that plan
is static, the live buffers on every mesh at every point of a step follow from the
program alone; :func:`memory_profile` replays the plan and reports each mesh's peak.

An *activation* is a value a microbatch's forward work produced (or a transfer of
one) that is waiting for more of the same microbatch's work on its mesh, typically its
backward. A running sum carried to the next microbatch, or a cotangent waiting to be
sent, is not one.
How many microbatches' activations a mesh holds at once is what a pipeline schedule
decides: all of them under GPipe, at most the number of stages under 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpmdc.ir.graph import def_use, release_plan
from mpmdc.ir.primitives import ActionKind, fragment_p
from mpmdc.ir.program import Program, is_var, nbytes, vars_of


@dataclass(frozen=True)
class MeshMemory:
    """Peaks over one step on one mesh, program inputs and constants left out."""

    peak_buffers: int
    peak_bytes: int
    peak_activation_buffers: int
    peak_activation_bytes: int
    peak_microbatches: int  # most microbatches with activations live at the same time


def memory_profile(program: Program) -> tuple[MeshMemory, ...]:
    """Each mesh's peak live intermediate buffers when ``program`` runs in order.

    Peaks are taken after an equation's results exist and before its operands are
    dropped, since both are live while it runs.
    """
    jaxpr = program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    readers = def_use(eqns).readers

    def waits_on_its_microbatch(v, mesh: int, microbatch) -> bool:
        return microbatch is not None and any(
            eqns[j].primitive is fragment_p
            and eqns[j].params["mesh"] == mesh
            and eqns[j].params["microbatch"] == microbatch
            for j in readers.get(v, ())
        )

    # value -> (mesh, bytes, microbatch it is an activation of, or None)
    live: dict = {}
    origin: dict = {}  # value -> microbatch of the forward work it comes from, or None
    peaks = [[0, 0, 0, 0, 0] for _ in program.meshes]
    for eqn, release in zip(eqns, release_plan(jaxpr)):
        if eqn.primitive is fragment_p:
            mesh = eqn.params["mesh"]
            forward_mb = eqn.params["microbatch"] if eqn.params["kind"] is ActionKind.F else None
            for v in vars_of(eqn.outvars):
                origin[v] = forward_mb
                held = forward_mb if waits_on_its_microbatch(v, mesh, forward_mb) else None
                live[v] = (mesh, nbytes(v.aval), held)
        else:
            mesh = eqn.params["dst"]
            for a, v in zip(eqn.invars, eqn.outvars):
                origin[v] = origin.get(a) if is_var(a) else None
                held = origin[v] if waits_on_its_microbatch(v, mesh, origin[v]) else None
                live[v] = (mesh, nbytes(v.aval), held)
        touched = {eqn.params["mesh"]} if eqn.primitive is fragment_p else {eqn.params["dst"]}
        for mesh in touched:
            held = [(b, mb) for m, b, mb in live.values() if m == mesh]
            acts = [(b, mb) for b, mb in held if mb is not None]
            now = (
                len(held),
                sum(b for b, _ in held),
                len(acts),
                sum(b for b, _ in acts),
                len({mb for _, mb in acts}),
            )
            peaks[mesh] = [max(p, n) for p, n in zip(peaks[mesh], now)]
        for v in release:
            live.pop(v, None)
    return tuple(MeshMemory(*p) for p in peaks)
