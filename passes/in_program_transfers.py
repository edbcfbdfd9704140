"""``in-program-transfers``: turn fragment-to-fragment transfers into send/recv pairs.

For a backend with ``transfers="in-program"`` (on ``cuda`` or ``rocm``) the default
pipeline runs this right before ``lower``: a value moving between meshes is sent at the end of the fragment
that produces it and received at the start of the first fragment that reads it,
with the same channel id on both sides. Each value crosses once: later readers on
the destination mesh get it from the first one as an extra result. Channel ids are
numbered in program order (transfer, then value) from the first id JAX's
collectives do not use, so they are deterministic. A value that no fragment
produces (a program input needed on a second mesh), or that is a program output,
keeps its ``transfer``: there is no fragment to send it from or receive it in.
"""

from __future__ import annotations

import itertools

from jax.extend import core as jcore
from mpmdc.lowering.send_recv import (
    FIRST_CHANNEL_ID,
    peer_transfer_effect,
    recv_p,
    send_p,
)
from mpmdc.passes.base import Property, register
from mpmdc.passes.dce import dce

from mpmdc.ir.graph import def_use
from mpmdc.ir.primitives import fragment_p, transfer_p
from mpmdc.ir.program import Program, fresh_like, is_var, make_closed_jaxpr


def _with_peer_transfers(eqn, recvs, sends, forwards, renames):
    """Fragment ``eqn`` with its received inputs turned into ``recv``s and ``sends`` appended.

    ``recvs`` maps an outer input to the recv parameters replacing it; ``forwards`` maps
    such an input to the new outer variable under which this fragment passes the received
    value on to later readers on its mesh; ``renames`` redirects inputs already received
    by an earlier fragment.
    """
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    before, invars, outer_invars, in_specs = [], [], [], []
    for outer, inner, spec in zip(eqn.invars, body.invars, eqn.params["in_specs"]):
        params = recvs.get(outer) if is_var(outer) else None
        if params is None:
            invars.append(inner)
            outer_invars.append(renames.get(outer, outer) if is_var(outer) else outer)
            in_specs.append(spec)
        else:
            before.append(
                jcore.new_jaxpr_eqn(
                    [], [inner], recv_p, params, {peer_transfer_effect}, eqn.source_info
                )
            )
    received = {outer: inner for outer, inner in zip(eqn.invars, body.invars) if outer in forwards}
    passed_on = [(received[y], y_new, spec) for y, (y_new, spec) in forwards.items()]
    inner = make_closed_jaxpr(
        body.constvars,
        closed.consts,
        invars,
        [*body.outvars, *(v for v, _, _ in passed_on)],
        [*before, *body.eqns, *sends],
        name=eqn.params["name"],
    )
    # A donated operand keeps its donation under its new position.
    kept = [k for k, outer in enumerate(eqn.invars) if not (is_var(outer) and outer in recvs)]
    position = {old: new for new, old in enumerate(kept)}
    params = dict(
        eqn.params,
        jaxpr=inner,
        donate_argnums=tuple(position[k] for k in eqn.params["donate_argnums"] if k in position),
        in_specs=tuple(in_specs),
        out_specs=(*eqn.params["out_specs"], *(spec for _, _, spec in passed_on)),
    )
    outvars = [*eqn.outvars, *(v for _, v, _ in passed_on)]
    return eqn.replace(invars=outer_invars, outvars=outvars, params=params, effects=inner.effects)


def _between_fragments(eqns, producer, users, x, y, program_outputs) -> bool:
    """Whether the value ``x`` a transfer moves as ``y`` goes from a fragment to fragments
    only (read by ``users``): one a send/recv pair can carry."""
    return (
        is_var(x)
        and x in producer
        and eqns[producer[x]].primitive is fragment_p
        and y not in program_outputs
        and bool(users)
        and all(eqns[u].primitive is fragment_p for u in users)
    )


def transfers_left(program: Program) -> int:
    """How many values a transfer of ``program`` moves from a fragment to fragments: what
    this pass makes send/recv pairs (none once it has run)."""
    eqns = list(program.jaxpr.jaxpr.eqns)
    producer, readers, _ = def_use(eqns)
    outputs = {v for v in program.jaxpr.jaxpr.outvars if is_var(v)}
    return sum(
        _between_fragments(eqns, producer, readers.get(y, []), x, y, outputs)
        for eqn in eqns
        if eqn.primitive is transfer_p
        for x, y in zip(eqn.invars, eqn.outvars)
    )


def has_peer_transfers(program: Program) -> bool:
    """Whether a fragment of ``program`` sends or receives a value itself."""
    return any(
        peer_transfer_effect in eqn.effects
        for eqn in program.jaxpr.jaxpr.eqns
        if eqn.primitive is fragment_p
    )


@register(
    "in-program-transfers",
    "replace fragment-to-fragment transfers by send/recv pairs with channel ids",
    requires={Property.SPLIT, Property.SCHEDULED},  # a value is received by its first reader
)
def in_program_transfers(program: Program) -> Program:
    """Replace every fragment-to-fragment transfer of a split program by send/recv pairs."""
    eqns = list(program.jaxpr.jaxpr.eqns)
    producer, readers, _ = def_use(eqns)
    program_outputs = {v for v in program.jaxpr.jaxpr.outvars if is_var(v)}

    sends = {i: [] for i in range(len(eqns))}
    recvs = {i: {} for i in range(len(eqns))}
    forwards = {i: {} for i in range(len(eqns))}
    renames = {i: {} for i in range(len(eqns))}
    channels = itertools.count(FIRST_CHANNEL_ID)
    for eqn in eqns:
        if eqn.primitive is not transfer_p:
            continue
        src, dst = eqn.params["src"], eqn.params["dst"]
        for x, y, spec in zip(eqn.invars, eqn.outvars, eqn.params["dst_specs"]):
            users = readers.get(y, [])
            if not _between_fragments(eqns, producer, users, x, y, program_outputs):
                continue
            channel = {"channel": next(channels), "src": src, "dst": dst}
            f = producer[x]
            k = eqns[f].outvars.index(x)
            body_out = eqns[f].params["jaxpr"].jaxpr.outvars[k]
            sends[f].append(
                jcore.new_jaxpr_eqn(
                    [body_out], [], send_p, channel, {peer_transfer_effect}, eqn.source_info
                )
            )
            first, later = users[0], users[1:]
            recvs[first][y] = {**channel, "aval": y.aval}
            if later:
                y_new = fresh_like(y)
                forwards[first][y] = (y_new, spec)
                for u in later:
                    renames[u][y] = y_new

    new_eqns = []
    for i, eqn in enumerate(eqns):
        if recvs[i] or sends[i] or renames[i]:
            new_eqns.append(_with_peer_transfers(eqn, recvs[i], sends[i], forwards[i], renames[i]))
        else:
            new_eqns.append(eqn)

    # Moved values are now dead transfer results (pruned by the transfer DCE rule), and
    # sent values nobody else reads are dead fragment outputs.
    return dce(program.with_eqns(new_eqns))
