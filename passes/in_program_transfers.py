"""``in-program-transfers``: turn fragment-to-fragment transfers into send/recv pairs.

For backends with ``transfers="in-program"`` (``cuda``, ``rocm``) the ``lower`` pass
runs this first: a value moving between meshes is sent at the end of the fragment
that produces it and received at the start of each fragment that reads it, with the
same channel id on both sides. Channel ids are numbered from 1 in program order
(transfer, then value, then reader), so they are deterministic. A value no fragment
produces (a program input needed on a second mesh) or one that is a program output
keeps its ``transfer``: there is no fragment to send it from or receive it in.
"""

from __future__ import annotations

import itertools

from jax.extend import core as jcore
from mpmdc.lowering.send_recv import peer_transfer_effect, recv_p, send_p
from mpmdc.passes.base import FunctionPass
from mpmdc.passes.dce import dce

from mpmdc.ir import Program, is_var, make_closed_jaxpr
from mpmdc.primitives import fragment_p, transfer_p


def _rebuilt(eqn, body_eqns_before, body_eqns_after, invar_keep, new_invars):
    """Fragment ``eqn`` with recvs prepended, sends appended and received inputs dropped."""
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    invars = [v for v, keep in zip(body.invars, invar_keep) if keep]
    inner = make_closed_jaxpr(
        body.constvars,
        closed.consts,
        invars,
        body.outvars,
        [*body_eqns_before, *body.eqns, *body_eqns_after],
        name=eqn.params["name"],
    )
    in_specs = tuple(s for s, keep in zip(eqn.params["in_specs"], invar_keep) if keep)
    params = dict(eqn.params, jaxpr=inner, in_specs=in_specs)
    return eqn.replace(invars=new_invars, params=params, effects=inner.effects)


def in_program_transfers(program: Program) -> Program:
    """Replace every fragment-to-fragment transfer of a split program by send/recv pairs."""
    eqns = list(program.jaxpr.jaxpr.eqns)
    producer = {}
    for i, eqn in enumerate(eqns):
        if eqn.primitive is fragment_p:
            producer.update((v, (i, k)) for k, v in enumerate(eqn.outvars))
    readers: dict = {}
    for i, eqn in enumerate(eqns):
        for a in eqn.invars:
            if is_var(a):
                readers.setdefault(a, []).append(i)
    program_outputs = {v for v in program.jaxpr.jaxpr.outvars if is_var(v)}

    sends = {i: [] for i in range(len(eqns))}
    recvs = {i: {} for i in range(len(eqns))}
    kept_transfer_values = {}
    channels = itertools.count(1)
    for t, eqn in enumerate(eqns):
        if eqn.primitive is not transfer_p:
            continue
        src, dst = eqn.params["src"], eqn.params["dst"]
        keep = []
        for x, y in zip(eqn.invars, eqn.outvars):
            users = readers.get(y, [])
            movable = (
                is_var(x)
                and x in producer
                and y not in program_outputs
                and all(eqns[u].primitive is fragment_p for u in users)
            )
            keep.append(not movable)
            if not movable:
                continue
            f, k = producer[x]
            body_out = eqns[f].params["jaxpr"].jaxpr.outvars[k]
            for u in users:
                channel = next(channels)
                sends[f].append(
                    jcore.new_jaxpr_eqn(
                        [body_out], [], send_p, dict(channel=channel, src=src, dst=dst),
                        {peer_transfer_effect}, eqn.source_info,
                    )
                )
                recvs[u][y] = dict(channel=channel, src=src, dst=dst, aval=y.aval)
        kept_transfer_values[t] = keep

    new_eqns = []
    for i, eqn in enumerate(eqns):
        if eqn.primitive is transfer_p:
            keep = kept_transfer_values[i]
            if any(keep):
                new_eqns.append(_kept_transfer(eqn, keep))
            continue
        if not sends[i] and not recvs[i]:
            new_eqns.append(eqn)
            continue
        body = eqn.params["jaxpr"].jaxpr
        before, invar_keep, new_invars = [], [], []
        for outer, inner in zip(eqn.invars, body.invars):
            params = recvs[i].get(outer) if is_var(outer) else None
            invar_keep.append(params is None)
            if params is None:
                new_invars.append(outer)
            else:
                before.append(
                    jcore.new_jaxpr_eqn(
                        [], [inner], recv_p, params, {peer_transfer_effect}, eqn.source_info
                    )
                )
        new_eqns.append(_rebuilt(eqn, before, sends[i], invar_keep, new_invars))

    jaxpr = program.jaxpr.jaxpr
    closed = make_closed_jaxpr(
        jaxpr.constvars, program.jaxpr.consts, jaxpr.invars, jaxpr.outvars, new_eqns, jaxpr.debug_info
    )
    # Sent values nobody else reads are now dead fragment outputs.
    return dce(program.replace(jaxpr=closed))


def _kept_transfer(eqn, keep):
    def kept(values):
        return [v for v, k in zip(values, keep) if k]

    params = dict(
        eqn.params,
        src_specs=tuple(kept(eqn.params["src_specs"])),
        dst_specs=tuple(kept(eqn.params["dst_specs"])),
    )
    return eqn.replace(invars=kept(eqn.invars), outvars=kept(eqn.outvars), params=params)


class InProgramTransfers(FunctionPass):
    """Pass object for :func:`in_program_transfers`."""

    name = "in-program-transfers"
    summary = "replace fragment-to-fragment transfers by send/recv pairs with channel ids"
    body = staticmethod(in_program_transfers)
