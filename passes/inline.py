"""``inline``: flatten call sites that hide stage markers.

Nested ``jit``, ``closed_call``, ``checkpoint`` and custom-derivative calls whose
bodies contain a ``stage`` marker (or an ``accumulate`` loop's edges) are inlined so
the markers become top-level equations that ``partition`` can see. Calls without
markers stay whole (they are one unit of work on one mesh) here; ``slice-stacks``
writes in place those that read a layer stack. A scan holding
``stage(h, every=k)`` markers stays whole too, for ``split-scans`` to cut. Any other
marker inside a loop, conditional or ``shard_map`` body cannot be placed and is
reported with its source line.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims
from mpmdc.passes.base import Property, register

from mpmdc import _jax_compat as compat
from mpmdc.errors import PlacementError
from mpmdc.ir.calls import REMAT_CALLS, call_body
from mpmdc.ir.primitives import is_layer_marker, is_loop_edge, is_marker
from mpmdc.ir.program import (
    Program,
    copy_eqn,
    find_eqns,
    fresh_like,
    is_var,
    make_closed_jaxpr,
    rematerialized,
    substituted,
)


def _is_pipeline_marker(eqn) -> bool:
    """A stage marker, or the edge of an ``accumulate`` loop kept rolled."""
    return is_marker(eqn) or is_loop_edge(eqn)


def _has_marker(jaxpr: jcore.Jaxpr) -> bool:
    """Whether ``jaxpr`` holds a marker (``every=`` ones too: the scan holding one must
    reach the top level, where ``split-scans`` cuts it)."""
    found = find_eqns(jaxpr.eqns, lambda e: _is_pipeline_marker(e) or is_layer_marker(e))
    return next(found, None) is not None


def _misplaced_marker(eqn):
    """A marker in ``eqn``'s bodies that cannot be placed: any but the ``every=`` markers
    of a scan (which ``split-scans`` places), or ``None``."""
    if eqn.primitive is jprims.scan_p:
        misplaced = _is_pipeline_marker
    else:
        misplaced = lambda e: _is_pipeline_marker(e) or is_layer_marker(e)  # noqa: E731
    for sub in jcore.jaxprs_in_params(eqn.params):
        marker = next(find_eqns(sub.eqns, misplaced), None)
        if marker is not None:
            return marker
    return None


# What a user may have written for a loop primitive a marker is found in.
_LOOP_NAMES = {
    jprims.scan_p: "`scan` (jax.lax.scan, lax.map, or fori_loop with static bounds)",
    jprims.while_p: "`while` (jax.lax.while_loop, or fori_loop with traced bounds)",
}


def _marker_inside(eqn, marker) -> PlacementError:
    """The error for ``marker`` found in the body of ``eqn`` (a loop, conditional or
    ``shard_map``), naming the marker's line, and for a loop what works instead."""
    name = _LOOP_NAMES.get(eqn.primitive, f"`{eqn.primitive.name}`")
    if is_layer_marker(marker):
        return PlacementError(
            f"mpmdc.stage(..., every={marker.params['every']!r}) at {compat.source_line(marker)} "
            f"runs inside {name} (at {compat.source_line(eqn)}); `every=` cuts the iterations "
            f"of a scan over layers: call it in the scan's own body, outside conditionals, "
            f"while loops and shard_map bodies."
        )
    if is_loop_edge(marker):
        return PlacementError(
            f"mpmdc.accumulate at {compat.source_line(marker)} runs inside {name} (at "
            f"{compat.source_line(eqn)}); the microbatch loop must be outside loops, "
            f"conditionals and shard_map bodies. Call mpmdc.accumulate at the top level of "
            f"the compiled function."
        )
    message = (
        f"mpmdc.stage(..., {marker.params['stage']}) at {compat.source_line(marker)} runs "
        f"inside {name} (at {compat.source_line(eqn)}); a stage marker must be outside "
        f"loops, conditionals and shard_map bodies."
    )
    if eqn.primitive is jprims.scan_p:
        message += (
            " To pipeline a scan over layers, write mpmdc.stage(h, every=k) in its body: "
            "iteration j then enters stage j // k, and the scan runs as one scan per stage."
        )
    else:
        message += f" Move mpmdc.stage(...) before or after the {name}."
    return PlacementError(message)


@register(
    "inline",
    "inline nested calls that contain stage markers",
    produces={Property.INLINED},
    invalidates={Property.PLACED},  # inlined bodies' equations have no placement
)
def inline(program: Program) -> Program:
    """Inline every call site whose body contains a stage marker (recursively)."""
    closed = program.jaxpr
    constvars = list(closed.jaxpr.constvars)
    consts = list(closed.consts)
    eqns = []

    # Forward markers seen outside checkpoints, per stage: the values entering each stage.
    entering: dict[int, list] = {}
    recomputed: dict[int, int] = {}

    def reuse_entering(eqn, env) -> bool:
        """A checkpoint's recomputation of a value entering a stage reads the value that
        entered in the forward instead (the k-th recomputed marker of a stage is its k-th
        forward marker), so each stage keeps its own input and recomputes only its own work."""
        stage = eqn.params["stage"]
        k = recomputed.get(stage, 0)
        recomputed[stage] = k + 1
        forward = entering.get(stage, [])
        if k >= len(forward) or [v.aval for v in forward[k]] != [v.aval for v in eqn.outvars]:
            return False
        env.update(zip(eqn.outvars, forward[k]))
        return True

    def visit(body_eqns, env, remat: bool, top: bool = False):
        for eqn in body_eqns:
            if (
                remat
                and is_marker(eqn)
                and eqn.params["transpose"] == 0
                and reuse_entering(eqn, env)
            ):
                continue
            body = call_body(eqn)
            if body is not None and _has_marker(body[0]):
                inner, inner_consts = body
                inner_env = {}
                for var, value in zip(inner.constvars, inner_consts):
                    inner_env[var] = fresh_like(var)
                    constvars.append(inner_env[var])
                    consts.append(value)
                inner_env.update(zip(inner.invars, substituted(eqn.invars, env)))
                visit(inner.eqns, inner_env, remat or eqn.primitive in REMAT_CALLS)
                results = substituted(inner.outvars, inner_env)
                env.update({o: r for o, r in zip(eqn.outvars, results) if is_var(o)})
                continue
            marker = _misplaced_marker(eqn)
            if marker is not None:
                raise _marker_inside(eqn, marker)
            if top:  # (its variables are unique already: only renamed operands change)
                invars = substituted(eqn.invars, env)
                eqns.append(
                    eqn
                    if all(a is b for a, b in zip(invars, eqn.invars))
                    else eqn.replace(invars=invars)
                )
            else:
                eqns.append(rematerialized(copy_eqn(eqn, env), remat))
            if not remat and is_marker(eqn) and eqn.params["transpose"] == 0:
                entering.setdefault(eqn.params["stage"], []).append(eqns[-1].outvars)

    env = {}
    visit(closed.jaxpr.eqns, env, remat=False, top=True)
    new = make_closed_jaxpr(
        constvars,
        consts,
        closed.jaxpr.invars,
        substituted(closed.jaxpr.outvars, env),
        eqns,
        closed.jaxpr.debug_info,
    )
    return program.replace(jaxpr=new)
