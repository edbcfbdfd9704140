"""Per-fragment StableHLO with Shardy shardings, through JAX's own lowering.

A fragment's body is wrapped in ``jax.jit`` with the fragment's mesh shardings and
lowered for the requested platform; JAX can lower for a platform this machine does
not have, so every backend's modules can be produced (and golden-tested) anywhere.
"""

from __future__ import annotations

import jax
from jax.extend import core as jcore

from mpmdc.ir import Program
from mpmdc.sharding import named


def fragment_function(eqn):
    """A Python callable running fragment ``eqn``'s body, named after the fragment."""
    body = jcore.jaxpr_as_fun(eqn.params["jaxpr"])

    def run(*args):
        return body(*args)

    run.__name__ = run.__qualname__ = eqn.params["name"]
    return run


def fragment_jit(eqn, program: Program, donate_argnums=()):
    """``(jitted function, argument types)`` for fragment ``eqn`` on its mesh."""
    mesh = program.meshes[eqn.params["mesh"]]
    args = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=named(mesh, spec))
        for v, spec in zip(eqn.invars, eqn.params["in_specs"])
    ]
    jitted = jax.jit(
        fragment_function(eqn),
        out_shardings=[named(mesh, spec) for spec in eqn.params["out_specs"]],
        donate_argnums=donate_argnums,
    )
    return jitted, args


def lower_fragment(program: Program, eqn, platform: str) -> str:
    """StableHLO text of fragment ``eqn`` for ``platform``."""
    jitted, args = fragment_jit(eqn, program)
    return jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()
