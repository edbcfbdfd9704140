"""Per-fragment StableHLO with Shardy shardings, through JAX's own lowering.

A fragment's body is wrapped in ``jax.jit`` with the fragment's mesh shardings and
lowered for the requested platform; JAX can lower for a platform this machine does
not have, so every backend's modules can be produced (and golden-tested) anywhere.
"""

from __future__ import annotations

import jax
from jax.experimental import checkify

from mpmdc import _jax_compat as compat
from mpmdc.ir.program import Program, find_eqns
from mpmdc.ir.sharding import canonical_spec, named


def _throw(error) -> None:
    error.throw()


def _raising_checks(body):
    """``body`` with its ``checkify.check``s raising from inside the running fragment.

    ``jax.jit`` refuses a check that was not functionalized by ``checkify.checkify``;
    mpmdc functionalizes it per fragment and throws the error from a host callback, so
    a failed check surfaces like any other fragment failure: an ``MpmdRuntimeError``
    naming the fragment, mesh, stage and microbatch. (A function wrapped in
    ``checkify.checkify`` has no checks left here and returns its error as ``jax.jit``
    does.)
    """
    checked = checkify.checkify(body, errors=checkify.user_checks)

    def run(*args):
        error, outs = checked(*args)
        jax.debug.callback(_throw, error)
        return outs

    return run


def _as_traced(x, aval):
    """``x`` with the sharding its body's input was traced with, where its type states
    another (``Explicit`` axes put shardings in types). A program input given an
    ``in_specs`` entry arrives sharded so, but is traced replicated, as ``jax.jit``
    traces an argument given ``in_shardings``; the body's equations expect that type."""
    if not hasattr(aval, "sharding"):  # (a token has no sharding)
        return x
    traced = canonical_spec(aval.sharding.spec)
    if canonical_spec(jax.typeof(x).sharding.spec) == traced:
        return x
    return jax.sharding.reshard(x, traced)


def _fragment_function(eqn):
    """A Python callable running fragment ``eqn``'s body, named after the fragment."""
    body = compat.replaying_fun(eqn.params["jaxpr"])
    if any(find_eqns(eqn.params["jaxpr"].jaxpr.eqns, lambda e: e.primitive is compat.check_p)):
        body = _raising_checks(body)
    avals = [v.aval for v in eqn.params["jaxpr"].jaxpr.invars]

    def run(*args):
        return body(*map(_as_traced, args, avals))

    run.__name__ = run.__qualname__ = eqn.params["name"]
    return run


def _fragment_jit(eqn, program: Program, forms: dict):
    """``(jitted function, argument types)`` for fragment ``eqn`` on its mesh.

    The argument types keep their weak type: results computed from a weakly typed value
    are weakly typed too, as under ``jax.jit``.
    """
    mesh = program.meshes[eqn.params["mesh"]]
    args = [
        jax.ShapeDtypeStruct(
            v.aval.shape,
            v.aval.dtype,
            sharding=named(mesh, spec, v.aval.ndim, forms),
            weak_type=v.aval.weak_type,
        )
        for v, spec in zip(eqn.invars, eqn.params["in_specs"])
    ]
    jitted = jax.jit(
        _fragment_function(eqn),
        out_shardings=[
            named(mesh, spec, v.aval.ndim, forms)
            for v, spec in zip(eqn.outvars, eqn.params["out_specs"])
        ],
        donate_argnums=eqn.params["donate_argnums"],
    )
    return jitted, args


def export_fragment(program: Program, eqn, backend, forms: dict) -> jax.export.Exported:
    """Fragment ``eqn`` as ``jax.export`` exports it for ``backend``'s platform: the
    same jitted function, shardings and donation as :func:`lower_fragment`, in JAX's
    serializable form (a versioned StableHLO artifact). Each operation's location names
    the line that made it and no frame above it, and the module's own is its first
    operation's, so the bytes do not depend on where the function was traced or
    exported from. It is exported under its own mesh, as it is lowered."""
    jitted, args = _fragment_jit(eqn, program, forms)
    body = eqn.params["jaxpr"].jaxpr.eqns
    at = body[0].source_info.traceback if body else None
    with (
        compat.traceback_in_locations_limit(1),
        compat.user_context(at),
        jax.set_mesh(program.meshes[eqn.params["mesh"]]),
    ):
        return jax.export.export(jitted, platforms=(backend.platform,))(*args)


def lower_fragment(program: Program, eqn, backend, forms: dict):
    """Fragment ``eqn`` traced and lowered by ``backend`` (a ``jax.stages.Lowered``);
    ``forms`` (``program_spec_forms(program)``) writes its shardings as the caller did.

    It is traced and lowered under its own mesh (``jax.set_mesh``), whatever mesh the
    caller set: a fragment runs on its mesh's devices only, and JAX refuses arguments
    on devices other than the context mesh's."""
    jitted, args = _fragment_jit(eqn, program, forms)
    with jax.set_mesh(program.meshes[eqn.params["mesh"]]):
        return backend.lower_fragment(jitted.trace(*args))
