"""``split-backward``: cut backward fragments into input- and weight-gradient parts.

A zero-bubble schedule (ZB-H1, or action lists naming ``I`` and ``W``) runs a stage's
backward in two actions: ``I`` computes what the stage before waits for (the
cotangents) and whatever that needs; ``W`` is the rest (the weight gradients), free to
run later, reading what it needs of ``I``'s values. This pass makes the fragments for
them: each backward fragment the schedule splits becomes an ``igrad`` and a ``wgrad``
fragment (``s1_bwd_loop`` becomes ``s1_igrad_loop`` and ``s1_wgrad_loop``). A rolled
loop's backward is cut once, for every microbatch, so a schedule splits a stage's
backward for all microbatches or for none. A program whose schedule names no ``I``
passes through unchanged.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.sharding import PartitionSpec
from mpmdc.passes.base import Property, register

from mpmdc.errors import ScheduleError
from mpmdc.ir.calls import REMAT_CALLS, call_body
from mpmdc.ir.graph import def_use
from mpmdc.ir.primitives import LOOP, ActionKind, fragment_p, transfer_p
from mpmdc.ir.program import (
    Program,
    copy_eqn,
    fresh_like,
    is_var,
    make_closed_jaxpr,
    sub_jaxpr,
    substituted,
    vars_of,
)
from mpmdc.schedules import actions_of


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


def _without_checkpoints(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """``jaxpr`` with each checkpointed call's body in its place. JAX differentiates a
    ``jax.checkpoint`` into one call computing the recomputation and every cotangent of
    its inputs, weights' and activation's alike; whole, it would put the weight
    gradients in the input part. (In a backward fragment nothing of the forward is left
    for the recomputation to be merged with.)"""
    if not any(e.primitive in REMAT_CALLS for e in jaxpr.eqns):
        return jaxpr
    eqns = []

    def visit(body_eqns, env, top: bool):
        for eqn in body_eqns:
            body = call_body(eqn) if eqn.primitive in REMAT_CALLS else None
            if body is None or body[1]:  # (a body with constants of its own stays a call)
                # A body's equations get fresh variables: one body may be inlined twice.
                eqns.append(
                    eqn.replace(invars=substituted(eqn.invars, env)) if top else copy_eqn(eqn, env)
                )
                continue
            inner = dict(zip(body[0].invars, substituted(eqn.invars, env)))
            visit(body[0].eqns, inner, top=False)  # (a checkpoint nested in it too)
            env.update(zip(eqn.outvars, substituted(body[0].outvars, inner)))

    env: dict = {}
    visit(jaxpr.eqns, env, top=True)
    return jaxpr.replace(eqns=eqns, outvars=substituted(jaxpr.outvars, env))


def cut_backward(eqn, is_cotangent: list[bool]) -> list:
    """Cut backward fragment ``eqn`` into input-gradient (``I``) and weight-gradient (``W``) parts.

    ``is_cotangent[k]`` says whether output ``k`` is read by another stage. A part
    with no equations and no outputs is left out.
    """
    closed = eqn.params["jaxpr"]
    body = _without_checkpoints(closed.jaxpr)
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
    """``parts(eqn)``: backward fragment ``eqn`` of ``eqns`` cut by :func:`cut_backward`,
    its outputs read by another stage (directly or through transfers) being cotangents."""
    readers = _final_readers(eqns)

    def parts(eqn) -> list:
        stage = eqn.params["stage"]
        is_cotangent = [any(r.params["stage"] != stage for r in readers(v)) for v in eqn.outvars]
        return cut_backward(eqn, is_cotangent)

    return parts


def _split_stages(program: Program) -> dict[int, set]:
    """The microbatches for which the schedule runs each stage's backward as ``I`` and ``W``."""
    out: dict[int, set] = {}
    for row in actions_of(program):
        for action in row:
            if action.kind is ActionKind.I:
                out.setdefault(action.stage, set()).add(action.microbatch)
    return out


@register(
    "split-backward",
    "cut backward fragments into input- and weight-gradient parts where the schedule splits them",
    requires={Property.PLANNED, Property.SPLIT},
)
def split_backward(program: Program) -> Program:
    """Cut every backward fragment of ``program`` that its schedule runs as ``I`` and ``W``."""
    if program.schedule is None:
        return program
    split = _split_stages(program)
    if not split:
        return program
    eqns = list(program.jaxpr.jaxpr.eqns)
    parts = _backward_splitter(eqns)
    out = []
    for eqn in eqns:
        p = eqn.params
        if eqn.primitive is not fragment_p or p["kind"] is not ActionKind.B:
            out.append(eqn)
            continue
        microbatches = split.get(p["stage"], set())
        if p["microbatch"] == LOOP and microbatches and len(microbatches) < program.microbatches:
            raise ScheduleError(
                f"the schedule runs stage {p['stage']}'s backward as I and W for microbatches "
                f"{sorted(microbatches)} and as B for the others; the microbatch loop has one "
                f"backward per stage, so list I and W for every microbatch of a stage, or B "
                f"for every one."
            )
        cut = (p["microbatch"] == LOOP and microbatches) or p["microbatch"] in microbatches
        out += parts(eqn) if cut else [eqn]
    jaxpr = program.jaxpr.jaxpr
    closed = make_closed_jaxpr(
        jaxpr.constvars, program.jaxpr.consts, jaxpr.invars, jaxpr.outvars, out, jaxpr.debug_info
    )
    return program.replace(jaxpr=closed)
