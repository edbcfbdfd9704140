"""``dce``: drop equations, fragments and transfers whose results are never used.

JAX's ``dce_jaxpr`` does the work (with mpmdc's rules for ``stage``, ``fragment``
and ``transfer``); every program input is kept so the signature does not change.
Placements need no care: they are part of each equation, which JAX's DCE rules keep
when they rebuild an equation to prune its unused outputs.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.interpreters import partial_eval as pe
from mpmdc.passes.base import register

from mpmdc.ir.program import Program


@register("dce", "remove equations, fragments and transfers nobody uses")
def dce(program: Program) -> Program:
    """Remove dead code, keeping all inputs and outputs."""
    closed = program.jaxpr
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return program.replace(jaxpr=jcore.ClosedJaxpr(jaxpr, closed.consts))
