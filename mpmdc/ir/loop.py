"""A split program's rolled ``accumulate`` loop, and stamping it out per microbatch.

Until ``schedule``, a split program holds one iteration of its loop: fragments whose
``microbatch`` is ``LOOP``, the transfers between them, and loop edges (see
:class:`~mpmdc.ir.primitives.LoopEdge`) where values enter and leave. Every other
value the iteration reads is loop-invariant. :func:`stamp` turns that into the
program that runs: each of the iteration's fragments and transfers once per
microbatch (the same body object, so they share one module), chaining each running
value from one microbatch to the next. The batch is laid out by microbatch once before
the loop (in a fragment that runs there on its mesh, where one comes after the batch)
and each microbatch taken from it inside the first fragment of the iteration that reads
it on that mesh, where the others reading it come after that one anyway (else by a call
of one small fragment of its own); stacked values are
concatenated by one fragment per mesh after it. It copies fragment *calls*, never
equations inside them: its cost is the iteration's fragment count times the microbatch
count.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from mpmdc import _jax_compat as compat
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


def _fragment(
    operands, outvars, body_fn, *, name, stage, mesh, in_specs, out_specs, microbatch=None
):
    """A forward fragment on ``mesh`` computing ``body_fn`` of ``operands`` (outside the
    loop, or in its iteration with ``microbatch=LOOP``)."""
    closed = jax.make_jaxpr(body_fn)(*[v.aval for v in operands])
    params = dict(
        jaxpr=closed,
        mesh=mesh,
        name=name,
        stage=stage,
        transpose=0,
        microbatch=microbatch,
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


def _stacked(microbatches: int, *batches) -> list:
    """Each batch as ``(microbatches, rows per microbatch, ...)``, microbatch ``i`` being
    rows ``[i*n, (i+1)*n)`` as ``accumulate`` slices them; then the first microbatch's
    index."""
    return [
        *(
            jax.numpy.reshape(
                x, (microbatches, -1, *x.shape[1:]), out_sharding=_leading_unsharded(x.aval)
            )
            for x in batches
        ),
        jax.numpy.zeros((), jax.numpy.int32),
    ]


def _leading_unsharded(aval):
    """The sharding in the type of ``aval`` stacked along a new leading axis, that axis
    unsharded (``Explicit`` axes stay on the dimensions they split), or ``None`` where
    the type holds none: a reshape splitting a sharded axis would put them on the
    leading one, so that microbatches, not their rows, were spread over devices."""
    sharding = aval.sharding
    if all(names is None for names in sharding.spec):
        return None
    return sharding.update(spec=PartitionSpec(None, *sharding.spec))


def _next_microbatch(*stacked_and_index) -> list:
    """Microbatch ``index`` of each stacked batch (an index along its unsharded leading
    axis: no data moves between devices), then the next index."""
    *stacked, index = stacked_and_index
    zero = index.dtype.type(0)  # (of the index's type: a Python 0 is 64-bit under x64)
    return [
        *(
            jax.lax.squeeze(
                jax.lax.dynamic_slice(x, (index,) + (zero,) * (x.ndim - 1), (1, *x.shape[1:])), (0,)
            )
            for x in stacked
        ),
        index + 1,
    ]


def _stack(microbatches: int, *values) -> list:
    """Every ``microbatches`` consecutive values concatenated, in order."""
    return [
        jax.numpy.concatenate(values[k : k + microbatches])
        for k in range(0, len(values), microbatches)
    ]


def _host_for_batches(before: list, mesh: int, batches: list) -> int | None:
    """The index in ``before`` of the last fragment on ``mesh`` that every one of
    ``batches`` is defined ahead of (not by: it reads them as operands): it can lay them
    out too, saving a module."""
    defined_at = {v: k for k, eqn in enumerate(before) for v in eqn.outvars}
    ready = max((defined_at.get(v, -1) for v in batches), default=-1)
    hosts = [
        k
        for k, eqn in enumerate(before)
        if k > ready and eqn.primitive is fragment_p and eqn.params["mesh"] == mesh
    ]
    return hosts[-1] if hosts else None


def _with_work(eqn, body_fn, operands: list, in_specs: list, outvars: list, out_specs: list):
    """Fragment ``eqn`` also computing ``body_fn`` of ``operands`` into ``outvars``."""
    closed, p = eqn.params["jaxpr"], eqn.params
    extra = jax.make_jaxpr(body_fn)(*[v.aval for v in operands])
    env = {v: fresh_like(v) for v in [*extra.jaxpr.constvars, *extra.jaxpr.invars]}
    body = closed.jaxpr
    extra_eqns = [copy_eqn(e, env) for e in extra.jaxpr.eqns]
    merged = make_closed_jaxpr(
        [*body.constvars, *(env[v] for v in extra.jaxpr.constvars)],
        [*closed.consts, *extra.consts],
        [*body.invars, *(env[v] for v in extra.jaxpr.invars)],
        [*body.outvars, *substituted(extra.jaxpr.outvars, env)],
        [*body.eqns, *extra_eqns],
        name=p["name"],
    )
    params = dict(
        p,
        jaxpr=merged,
        in_specs=(*p["in_specs"], *in_specs),
        out_specs=(*p["out_specs"], *out_specs),
    )
    return eqn.replace(
        invars=[*eqn.invars, *operands], outvars=[*eqn.outvars, *outvars], params=params
    )


def _taking_inside(taking, reader, read_later: set):
    """Fragment ``reader`` of the iteration also taking its microbatch of the batch, as
    the fragment ``taking`` does: it reads the laid-out batches and the index in place
    of the microbatch's rows, and returns after its own results the rows that
    ``read_later`` holds (what later equations read) and the next index."""
    taken = dict(zip(taking.outvars[:-1], taking.params["jaxpr"].jaxpr.outvars[:-1]))
    first, then = taking.params["jaxpr"], reader.params["jaxpr"]
    env = {v: fresh_like(v) for v in [*first.jaxpr.constvars, *first.jaxpr.invars]}
    eqns = [copy_eqn(e, env) for e in first.jaxpr.eqns]
    kept = [k for k, a in enumerate(reader.invars) if a not in taken]
    inner = dict(zip(then.jaxpr.invars, then.jaxpr.invars))
    inner.update(
        (then.jaxpr.invars[k], env.get(taken[a], taken[a]))
        for k, a in enumerate(reader.invars)
        if a in taken
    )
    eqns += [e.replace(invars=substituted(e.invars, inner)) for e in then.jaxpr.eqns]
    passed = [k for k, v in enumerate(taking.outvars[:-1]) if v in read_later]
    inner_out = first.jaxpr.outvars
    p, q = reader.params, taking.params
    merged = make_closed_jaxpr(
        [*(env[v] for v in first.jaxpr.constvars), *then.jaxpr.constvars],
        [*first.consts, *then.consts],
        [*(env[v] for v in first.jaxpr.invars), *(then.jaxpr.invars[k] for k in kept)],
        [
            *substituted(then.jaxpr.outvars, inner),
            *substituted([inner_out[k] for k in passed], env),
            *substituted(inner_out[-1:], env),
        ],
        eqns,
        name=p["name"],
    )
    params = dict(
        p,
        jaxpr=merged,
        in_specs=(*q["in_specs"], *(p["in_specs"][k] for k in kept)),
        out_specs=(*p["out_specs"], *(q["out_specs"][k] for k in passed), q["out_specs"][-1]),
    )
    return reader.replace(
        invars=[*taking.invars, *(reader.invars[k] for k in kept)],
        outvars=[*reader.outvars, *(taking.outvars[k] for k in passed), taking.outvars[-1]],
        params=params,
        effects=merged.effects,
    )


def _taken_inside(taking: list, iteration: list, exits: list) -> tuple[list, list]:
    """``(taking fragments left, iteration)``: each fragment taking a microbatch of the
    batch moved into the first of the iteration's fragments on its mesh that reads what
    it takes, where every other equation of the loop reading it depends on that one
    already (so no order between calls is added that the schedule does not know of)."""
    left, iteration = [], list(iteration)
    for eqn in taking:
        taken = set(eqn.outvars[:-1])
        readers = [k for k, e in enumerate(iteration) if not taken.isdisjoint(e.invars)]
        exit_reads = any(not taken.isdisjoint(e.invars) for e in exits)
        k = readers[0] if readers else None
        if (
            k is not None
            and not exit_reads
            and iteration[k].primitive is fragment_p
            and iteration[k].params["mesh"] == eqn.params["mesh"]
            and set(readers[1:]) <= _depending_on(iteration, k)
        ):
            later = {a for j in readers[1:] for a in iteration[j].invars if a in taken}
            iteration[k] = _taking_inside(eqn, iteration[k], later)
        else:
            left.append(eqn)
    return left, iteration


def _depending_on(eqns: list, k: int) -> set[int]:
    """The indices of ``eqns`` (in a dependency order) that read what ``eqns[k]`` makes,
    directly or through others."""
    made, found = set(eqns[k].outvars), set()
    for j in range(k + 1, len(eqns)):
        if not made.isdisjoint(eqns[j].invars):
            found.add(j)
            made.update(eqns[j].outvars)
    return found


class _Chain(NamedTuple):
    """A value carried from one microbatch to the next: ``inside`` the iteration,
    ``start`` before microbatch 0, and what the iteration leaves for the next as ``end``
    (``None`` where nothing does)."""

    inside: object
    start: object
    end: object


def _batches(before: list, entries, microbatches: int, read: set):
    """``(before, fragments to start each iteration with, chains)``: the batches entering
    the loop on each mesh (that the iteration ``read``s) laid out as
    ``(microbatches, rows, ...)`` before the loop (by a fragment before the loop on that
    mesh that comes after the batches, else by one of its own), and a fragment taking
    microbatch ``i`` of them, its index carried from one microbatch to the next. What
    this costs to compile is the same for any microbatch count."""
    out = list(before)
    taking, chains = [], []
    slices = [e for e in entries if is_loop_edge(e, LoopEdge.SLICE) and e.outvars[0] in read]
    for mesh, edges in sorted(_by_mesh(slices).items()):
        batches = [e.invars[0] for e in edges]
        stacked = [
            compat.Var(
                mb.update(
                    shape=(microbatches, *mb.shape), sharding=_leading_unsharded(mb) or mb.sharding
                )
            )
            for mb in (e.outvars[0].aval for e in edges)
        ]
        specs = [PartitionSpec(None, *e.params["out_spec"]) for e in edges]
        index = jax.core.ShapedArray((), jax.numpy.int32)
        start, inside, end = compat.Var(index), compat.Var(index), compat.Var(index)
        stage = min(e.params["stage"] for e in edges)
        lay_out = functools.partial(_stacked, microbatches)
        in_specs = [e.params["in_spec"] for e in edges]
        host = _host_for_batches(out, mesh, batches)
        if host is not None:
            out[host] = _with_work(
                out[host], lay_out, batches, in_specs, [*stacked, start], [*specs, PartitionSpec()]
            )
        else:
            out.append(
                _fragment(
                    batches,
                    [*stacked, start],
                    lay_out,
                    name=f"s{stage}_batch",
                    stage=stage,
                    mesh=mesh,
                    in_specs=in_specs,
                    out_specs=[*specs, PartitionSpec()],
                )
            )
        taking.append(
            _fragment(
                [*stacked, inside],
                [*(e.outvars[0] for e in edges), end],
                _next_microbatch,
                name=f"s{stage}_batch_loop",
                stage=stage,
                mesh=mesh,
                microbatch=LOOP,
                in_specs=[*specs, PartitionSpec()],
                out_specs=[*(e.params["out_spec"] for e in edges), PartitionSpec()],
            )
        )
        chains.append(_Chain(inside, start, end))
    return out, taking, chains


def _stackers(exits, envs: list[dict], made_after: set) -> tuple[list, list]:
    """``(early, late)``: one fragment per mesh concatenating (:func:`_stack`) the values
    each ``STACK`` edge there gathers, in microbatch order; and one per edge gathering a
    loop-invariant value made after the loop (``made_after``: in a fragment outside the
    loop that also reads the loop's results), to run once that value is made."""
    stacks = [e for e in exits if is_loop_edge(e, LoopEdge.STACK)]
    early = sorted(_by_mesh(e for e in stacks if e.invars[0] not in made_after).items())
    late = [(e.params["mesh"], [e]) for e in stacks if e.invars[0] in made_after]

    def stacker(mesh, edges):
        stage = min(e.params["stage"] for e in edges)
        return _fragment(
            [env.get(e.invars[0], e.invars[0]) for e in edges for env in envs],
            [e.outvars[0] for e in edges],
            functools.partial(_stack, len(envs)),
            name=f"s{stage}_stack",
            stage=stage,
            mesh=mesh,
            in_specs=[e.params["in_spec"] for e in edges for _ in envs],
            out_specs=[e.params["out_spec"] for e in edges],
        )

    return [stacker(*group) for group in early], [stacker(*group) for group in late]


def _with_late_stackers(after: list, late: list) -> list:
    """``after`` with each fragment of ``late`` right after the equation making the value
    it stacks (what reads its result comes later, as the edge did)."""
    at = {v: k for k, eqn in enumerate(after) for v in eqn.outvars}
    slots: list[list] = [[eqn] for eqn in after]
    for stacker in late:
        slots[at[stacker.invars[0]]].append(stacker)
    return [eqn for slot in slots for eqn in slot]


def stamp(closed: jcore.ClosedJaxpr, microbatches: int) -> jcore.ClosedJaxpr:
    """``closed`` (a split program's jaxpr with a rolled loop) with the loop stamped
    out: before-loop work (laying the batch out), the iteration once per microbatch,
    stacking fragments, after-loop work (stacking a value it makes once that is made);
    each in an order its data allows. A stamped fragment is named and tagged with its
    microbatch. Without a rolled loop, ``closed`` as it is."""
    jaxpr = closed.jaxpr
    loop = rolled_loop(jaxpr.eqns)
    if loop is None:
        return closed
    envs: list[dict] = [{} for _ in range(microbatches)]
    read = {a for eqn in loop.iteration + loop.exits for a in eqn.invars if is_var(a)}
    eqns, taking, chains = _batches(loop.before, loop.entries, microbatches, read)
    taking, iteration = _taken_inside(taking, loop.iteration, loop.exits)
    results = {
        e.params["carry"]: e.invars[0] for e in loop.exits if is_loop_edge(e, LoopEdge.RESULT)
    }
    chains += [
        _Chain(e.outvars[0], e.invars[0], results.get(e.params["carry"]))
        for e in loop.entries
        if is_loop_edge(e, LoopEdge.CARRY)
    ]
    for i, env in enumerate(envs):
        for chain in chains:
            if i == 0 or chain.end is None:
                env[chain.inside] = chain.start
            else:
                env[chain.inside] = envs[i - 1].get(chain.end, chain.end)
        # (Taking a microbatch of the batch is no action of the schedule's.)
        for group, action_microbatch in ((taking, None), (iteration, i)):
            for eqn in group:
                outvars = [fresh_like(v) for v in eqn.outvars]
                changes = {"invars": substituted(eqn.invars, env), "outvars": outvars}
                if eqn.primitive is fragment_p:
                    p = eqn.params
                    changes["params"] = dict(
                        p,
                        microbatch=action_microbatch,
                        name=p["name"].replace("_loop", f"_mb{i}", 1),
                    )
                eqns.append(eqn.replace(**changes))
                env.update((old, new) for old, new in zip(eqn.outvars, outvars) if is_var(old))
    # What reads a running value after the loop reads the last microbatch's.
    last = {
        e.outvars[0]: envs[-1].get(e.invars[0], e.invars[0])
        for e in loop.exits
        if is_loop_edge(e, LoopEdge.RESULT)
    }
    after = [e.replace(invars=substituted(e.invars, last)) for e in loop.after]
    early, late = _stackers(loop.exits, envs, {v for e in loop.after for v in e.outvars})
    eqns += early + _with_late_stackers(after, late)
    return make_closed_jaxpr(
        jaxpr.constvars,
        closed.consts,
        jaxpr.invars,
        substituted(jaxpr.outvars, last),
        eqns,
        jaxpr.debug_info,
    )
