"""Per-fragment StableHLO with Shardy shardings, through JAX's own lowering.

A fragment's body is wrapped in ``jax.jit`` with the fragment's mesh shardings and
lowered for the requested platform; JAX can lower for a platform this machine does
not have, so every backend's modules can be produced (and golden-tested) anywhere.
"""

from __future__ import annotations

import jax
from jax.extend import core as jcore

from mpmdc.ir import Program, is_var
from mpmdc.primitives import transfer_p
from mpmdc.sharding import named


def fragment_function(eqn):
    """A Python callable running fragment ``eqn``'s body, named after the fragment."""
    body = jcore.jaxpr_as_fun(eqn.params["jaxpr"])

    def run(*args):
        return body(*args)

    run.__name__ = run.__qualname__ = eqn.params["name"]
    return run


def value_specs(program: Program) -> dict:
    """Statically known ``PartitionSpec`` of top-level values: inputs, transfers, outputs."""
    jaxpr = program.jaxpr.jaxpr
    specs = {v: s for v, s in zip(jaxpr.invars, program.in_specs) if s is not None}
    for eqn in jaxpr.eqns:
        if eqn.primitive is transfer_p:
            specs.update((v, s) for v, s in zip(eqn.outvars, eqn.params["dst_specs"]) if s is not None)
    for v, s in zip(jaxpr.outvars, program.out_specs):
        if is_var(v) and s is not None:
            specs.setdefault(v, s)
    return specs


def lower_fragment(program: Program, eqn, platform: str, specs: dict) -> str:
    """StableHLO text of fragment ``eqn`` for ``platform``, shardings from ``specs``."""
    mesh = program.meshes[eqn.params["mesh"]]
    args = [
        jax.ShapeDtypeStruct(
            v.aval.shape,
            v.aval.dtype,
            sharding=named(mesh, specs[v]) if is_var(v) and v in specs else None,
        )
        for v in eqn.invars
    ]
    out_shardings = [named(mesh, specs[v]) if v in specs else None for v in eqn.outvars]
    jitted = jax.jit(fragment_function(eqn), out_shardings=out_shardings)
    return jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()
