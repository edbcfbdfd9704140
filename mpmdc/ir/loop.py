"""A split program's rolled ``accumulate`` loop, and stamping it out per microbatch.

Until ``schedule``, a split program holds one iteration of its loop: fragments whose
``microbatch`` is ``LOOP``, the transfers between them, and loop edges (see
:class:`~mpmdc.ir.primitives.LoopEdge`) where values enter and leave. Every other
value the iteration reads is loop-invariant. :func:`stamp` turns that into the
program that runs: each of the iteration's fragments and transfers once per
microbatch (the same body object, so they share one module), chaining each running
value from one microbatch to the next; the batch sliced and the stacked values
concatenated by one fragment per mesh (the slicing folded into a fragment that runs
before the loop on that mesh, where there is one). It copies fragment *calls*, never equations
inside them: its cost is the iteration's fragment count times the microbatch count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax.extend import core as jcore

from mpmdc.ir.primitives import LOOP, ActionKind, LoopEdge, fragment_p, is_loop_edge, is_loop_entry
from mpmdc.ir.program import copy_eqn, fresh_like, is_var, make_closed_jaxpr, substituted


class RolledLoop(NamedTuple):
    """A split program's top-level equations, told apart by where they run:
    ``before`` the loop, ``entries`` (slices, carries), one ``iteration``, ``exits``
    (results, stacks), and ``after`` (what reads the loop's results)."""

    before: list
    entries: list
    iteration: list
    exits: list
    after: list


def rolled_loop(eqns) -> RolledLoop | None:
    """``eqns`` told apart as :class:`RolledLoop`, or ``None`` without a rolled loop."""
    if not any(is_loop_edge(e) for e in eqns):
        return None
    parts = RolledLoop([], [], [], [], [])
    inside, after = set(), set()
    for eqn in eqns:
        reads = [a for a in eqn.invars if is_var(a)]
        if is_loop_entry(eqn):
            parts.entries.append(eqn)
            inside.update(eqn.outvars)
        elif is_loop_edge(eqn):
            parts.exits.append(eqn)
            after.update(eqn.outvars)
        elif (
            eqn.primitive is fragment_p and eqn.params["microbatch"] == LOOP
        ) or not inside.isdisjoint(reads):
            parts.iteration.append(eqn)
            inside.update(eqn.outvars)
        elif not after.isdisjoint(reads):
            parts.after.append(eqn)
            after.update(eqn.outvars)
        else:
            parts.before.append(eqn)
    return parts


def _fragment(operands, outvars, body_fn, *, name, stage, mesh, in_specs, out_specs):
    """A fragment outside the loop on ``mesh`` computing ``body_fn`` of ``operands``."""
    closed = jax.make_jaxpr(body_fn)(*[v.aval for v in operands])
    params = dict(
        jaxpr=closed,
        mesh=mesh,
        name=name,
        stage=stage,
        transpose=0,
        microbatch=None,
        kind=ActionKind.F,
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        donate_argnums=(),
    )
    return jcore.new_jaxpr_eqn(list(operands), list(outvars), fragment_p, params, closed.effects)


def _by_mesh(edges) -> dict[int, list]:
    out: dict[int, list] = {}
    for eqn in edges:
        out.setdefault(eqn.params["mesh"], []).append(eqn)
    return out


def _cut(microbatches: int, *batches) -> list:
    """Each batch's microbatches in order: rows ``[i*n, (i+1)*n)`` for microbatch ``i``,
    as ``accumulate`` slices them."""
    return [
        jax.lax.slice_in_dim(x, i * n, (i + 1) * n)
        for x in batches
        for n in [x.shape[0] // microbatches]
        for i in range(microbatches)
    ]


def _stack(microbatches: int, *values) -> list:
    """Every ``microbatches`` consecutive values concatenated, in order."""
    return [
        jax.numpy.concatenate(values[k : k + microbatches])
        for k in range(0, len(values), microbatches)
    ]


def _host_for_slices(before: list, mesh: int, batches: list) -> int | None:
    """The index in ``before`` of the last fragment on ``mesh`` that every one of
    ``batches`` is defined ahead of (or by): it can cut them too, saving a module."""
    defined_at = {v: k for k, eqn in enumerate(before) for v in eqn.outvars}
    ready = max((defined_at.get(v, -1) for v in batches), default=-1)
    hosts = [
        k
        for k, eqn in enumerate(before)
        if k >= ready and eqn.primitive is fragment_p and eqn.params["mesh"] == mesh
    ]
    return hosts[-1] if hosts else None


def _with_cut(eqn, batches: list, in_specs: list, outvars: list, out_specs: list):
    """Fragment ``eqn`` also taking ``batches`` and returning their microbatches."""
    closed, p = eqn.params["jaxpr"], eqn.params
    microbatches = len(outvars) // len(batches)
    cut = jax.make_jaxpr(functools.partial(_cut, microbatches))(*[v.aval for v in batches])
    env = {v: fresh_like(v) for v in cut.jaxpr.invars}
    body = closed.jaxpr
    cut_eqns = [copy_eqn(e, env) for e in cut.jaxpr.eqns]
    merged = make_closed_jaxpr(
        body.constvars,
        closed.consts,
        [*body.invars, *(env[v] for v in cut.jaxpr.invars)],
        [*body.outvars, *substituted(cut.jaxpr.outvars, env)],
        [*body.eqns, *cut_eqns],
        name=p["name"],
    )
    params = dict(
        p,
        jaxpr=merged,
        in_specs=(*p["in_specs"], *in_specs),
        out_specs=(*p["out_specs"], *out_specs),
    )
    return eqn.replace(
        invars=[*eqn.invars, *batches], outvars=[*eqn.outvars, *outvars], params=params
    )


def _sliced(before: list, entries, microbatches: int, envs: list[dict], read: set) -> list:
    """``before`` with the batches that enter the loop on each mesh (and that the
    iteration ``read``s) cut into their microbatches (:func:`_cut`): by a fragment
    before the loop on that mesh where one comes after the batches, else by a fragment
    of its own. Records microbatch ``i``'s slice in ``envs[i]``."""
    out = list(before)
    slices = [e for e in entries if is_loop_edge(e, LoopEdge.SLICE) and e.outvars[0] in read]
    for mesh, edges in sorted(_by_mesh(slices).items()):
        batches = [e.invars[0] for e in edges]
        outvars = []
        for e in edges:
            for env in envs:
                env[e.outvars[0]] = fresh_like(e.outvars[0])
                outvars.append(env[e.outvars[0]])
        in_specs = [e.params["in_spec"] for e in edges]
        out_specs = [e.params["out_spec"] for e in edges for _ in envs]
        host = _host_for_slices(out, mesh, batches)
        if host is not None:
            out[host] = _with_cut(out[host], batches, in_specs, outvars, out_specs)
            continue
        stage = min(e.params["stage"] for e in edges)
        out.append(
            _fragment(
                batches,
                outvars,
                functools.partial(_cut, microbatches),
                name=f"s{stage}_slices",
                stage=stage,
                mesh=mesh,
                in_specs=in_specs,
                out_specs=out_specs,
            )
        )
    return out


def _stackers(exits, envs: list[dict]) -> list:
    """One fragment per mesh concatenating (:func:`_stack`) the values each ``STACK``
    edge there gathers, in microbatch order."""
    out = []
    stacks = [e for e in exits if is_loop_edge(e, LoopEdge.STACK)]
    for mesh, edges in sorted(_by_mesh(stacks).items()):
        stage = min(e.params["stage"] for e in edges)
        out.append(
            _fragment(
                [env.get(e.invars[0], e.invars[0]) for e in edges for env in envs],
                [e.outvars[0] for e in edges],
                functools.partial(_stack, len(envs)),
                name=f"s{stage}_stack",
                stage=stage,
                mesh=mesh,
                in_specs=[e.params["in_spec"] for e in edges for _ in envs],
                out_specs=[e.params["out_spec"] for e in edges],
            )
        )
    return out


def stamp(
    closed: jcore.ClosedJaxpr, microbatches: int, iteration_of: Callable[[int], list] | None = None
) -> jcore.ClosedJaxpr:
    """``closed`` (a split program's jaxpr with a rolled loop) with the loop stamped
    out: before-loop work, slicing fragments, the iteration once per microbatch,
    stacking fragments, after-loop work; each in an order its data allows.

    ``iteration_of(i)``, where given, is the iteration's equations to stamp for
    microbatch ``i`` (a zero-bubble schedule splits some backwards), else the ones in
    ``closed``. A stamped fragment is named and tagged with its microbatch.
    """
    jaxpr = closed.jaxpr
    loop = rolled_loop(jaxpr.eqns)
    envs: list[dict] = [{} for _ in range(microbatches)]
    read = {a for eqn in loop.iteration + loop.exits for a in eqn.invars if is_var(a)}
    eqns = _sliced(loop.before, loop.entries, microbatches, envs, read)
    carries = {e.params["carry"]: e for e in loop.entries if is_loop_edge(e, LoopEdge.CARRY)}
    results = {e.params["carry"]: e for e in loop.exits if is_loop_edge(e, LoopEdge.RESULT)}
    for i, env in enumerate(envs):
        for k, entry in carries.items():
            if i == 0 or k not in results:
                env[entry.outvars[0]] = entry.invars[0]
            else:
                previous = results[k].invars[0]
                env[entry.outvars[0]] = envs[i - 1].get(previous, previous)
        for eqn in iteration_of(i) if iteration_of else loop.iteration:
            outvars = [fresh_like(v) for v in eqn.outvars]
            changes = {"invars": substituted(eqn.invars, env), "outvars": outvars}
            if eqn.primitive is fragment_p:
                p = eqn.params
                changes["params"] = dict(
                    p, microbatch=i, name=p["name"].replace("_loop", f"_mb{i}", 1)
                )
            eqns.append(eqn.replace(**changes))
            env.update((old, new) for old, new in zip(eqn.outvars, outvars) if is_var(old))
    # What reads a running value after the loop reads the last microbatch's.
    last = {
        e.outvars[0]: envs[-1].get(e.invars[0], e.invars[0])
        for e in loop.exits
        if is_loop_edge(e, LoopEdge.RESULT)
    }
    eqns += _stackers(loop.exits, envs)
    eqns += [e.replace(invars=substituted(e.invars, last)) for e in loop.after]
    return make_closed_jaxpr(
        jaxpr.constvars,
        closed.consts,
        jaxpr.invars,
        substituted(jaxpr.outvars, last),
        eqns,
        jaxpr.debug_info,
    )
