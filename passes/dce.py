"""``dce``: drop equations, fragments and transfers whose results are never used.

JAX's ``dce_jaxpr`` does the work (with mpmdc's rules for ``stage``, ``fragment``
and ``transfer``); every program input is kept so the signature does not change.
Placements follow their equations by output variable, since DCE rules may
rebuild an equation to prune its unused outputs.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.interpreters import partial_eval as pe
from mpmdc.passes.base import FunctionPass

from mpmdc.ir import Program, is_var


def dce(program: Program) -> Program:
    """Remove dead code, keeping all inputs and outputs."""
    closed = program.jaxpr
    jaxpr = closed.jaxpr
    new_jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    new_closed = jcore.ClosedJaxpr(new_jaxpr, closed.consts)
    if program.placements is None:
        return program.replace(jaxpr=new_closed)
    by_var = {}
    for eqn, placement in zip(jaxpr.eqns, program.placements):
        by_var.update((v, placement) for v in eqn.outvars if is_var(v))
        by_var[id(eqn)] = placement
    placements = []
    for eqn in new_jaxpr.eqns:
        live = next((v for v in eqn.outvars if is_var(v)), None)
        placements.append(by_var[live] if live is not None else by_var[id(eqn)])
    return program.replace(jaxpr=new_closed, placements=tuple(placements))


class Dce(FunctionPass):
    """Pass object for :func:`dce`."""

    name = "dce"
    summary = "remove equations, fragments and transfers nobody uses"
    body = staticmethod(dce)
