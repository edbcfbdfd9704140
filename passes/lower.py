"""``lower``: StableHLO for every fragment, through the backend registry.

Needs a split program, in its final order of calls. Three phases:

1. for a backend with ``transfers="in-program"``, fragment-to-fragment transfers
   become send/recv pairs;
2. donation: each fragment's ``donate_argnums`` names the donated program inputs it
   reads last (and only once), since the buffer must outlive every earlier reader,
   and whose buffer one of its results can take over (same shape, dtype and spec);
3. fragments with the same body, mesh, specs and donation (every microbatch's
   forward of a stage, say) are lowered once and share a module, named after the
   first of them.

The ``jax.stages.Lowered`` objects are attached to the program, in fragment order
and with the backend they were lowered for: the runtime compiles exactly these, and
the stage called ``stablehlo`` prints their text, so what it shows is what runs.
With the option ``meshes`` (mesh indices, ``lower{meshes=(0,2)}`` in a pass list) it
lowers only those meshes' fragments: a process of a multi-process run compiles only
its own meshes' fragments, so its call path lowers only those.
Within :func:`handing_modules_to` each new module is also handed on as soon as it is
lowered (the call path's compiler starts XLA on it while this pass lowers the next);
the pass's result does not depend on it.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar

from mpmdc.lowering import lower_fragment
from mpmdc.passes.base import register
from mpmdc.passes.in_program_transfers import in_program_transfers

from mpmdc import backends
from mpmdc.errors import PassError
from mpmdc.ir.graph import release_plan
from mpmdc.ir.loop import rolled_loop
from mpmdc.ir.primitives import fragment_p
from mpmdc.ir.program import Program, fragment_key, make_closed_jaxpr
from mpmdc.ir.sharding import canonical_spec, program_spec_forms

_module_sink: ContextVar = ContextVar("mpmdc_module_sink", default=None)


@contextmanager
def handing_modules_to(sink):
    """Within the block, ``lower`` calls ``sink(key, eqn, mesh, backend, lowered)`` for
    each distinct module right after lowering it (``key`` its fragment key, ``eqn`` the
    first fragment with it, ``mesh`` that fragment's mesh)."""
    token = _module_sink.set(sink)
    try:
        yield
    finally:
        _module_sink.reset(token)


@register("lower", "emit StableHLO per fragment for the backend's platform")
def lower(
    program: Program, *, backend: str | None = None, meshes: tuple[int, ...] | None = None
) -> Program:
    """Attach one StableHLO module per fragment, lowered for ``backend``'s platform
    (per fragment of ``meshes`` only, when given: indices into the program's meshes)."""
    if not program.is_split:
        raise PassError("the `lower` pass needs a split program; run `split` before it.")
    if rolled_loop(program.jaxpr.jaxpr.eqns) is not None:
        raise PassError(
            "the `lower` pass needs the microbatch loop stamped out; run `schedule` before it."
        )
    chosen = backends.get(backend or program.backend)
    if chosen.transfers == "in-program":
        program = in_program_transfers(program)
    program = with_donations(program)
    sink = _module_sink.get()
    lowerings, module_keys = {}, []
    forms = program_spec_forms(program)
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive is fragment_p and (meshes is None or eqn.params["mesh"] in meshes):
            key = fragment_key(eqn)
            if key not in lowerings:
                lowerings[key] = lower_fragment(program, eqn, chosen, forms)
                if sink is not None:
                    sink(key, eqn, program.meshes[eqn.params["mesh"]], chosen, lowerings[key])
                module_keys.append((eqn.params["name"], key))
    return program.replace(module_keys=tuple(module_keys), backend=chosen.name, lowerings=lowerings)


def _buffer_key(v, spec) -> tuple:
    """What XLA needs equal to reuse an input's buffer for a result: the per-device
    shape follows from the shape, dtype and spec."""
    return v.aval.shape, v.aval.dtype, canonical_spec(spec)


def _reusable(eqn, candidates: list[int]) -> tuple[int, ...]:
    """The ``candidates`` (operand indices) whose buffer a result of fragment ``eqn``
    can take over, each result taken once: donating any other would only make JAX warn
    that a donated buffer was not usable."""
    free = Counter(_buffer_key(v, s) for v, s in zip(eqn.outvars, eqn.params["out_specs"]))
    chosen = []
    for k in candidates:
        key = _buffer_key(eqn.invars[k], eqn.params["in_specs"][k])
        if free[key]:
            free[key] -= 1
            chosen.append(k)
    return tuple(chosen)


def with_donations(program: Program) -> Program:
    """``program`` with each fragment's ``donate_argnums``: the operands that are donated
    program inputs read for the last time there, and only once by that fragment, where
    a result of the fragment can take over their buffer."""
    jaxpr = program.jaxpr.jaxpr
    donated = {v for v, d in zip(jaxpr.invars, program.donated) if d}
    last_use = {v: i for i, vs in enumerate(release_plan(jaxpr)) for v in vs}
    eqns = []
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is fragment_p:
            candidates = [
                k
                for k, a in enumerate(eqn.invars)
                if a in donated and last_use.get(a) == i and eqn.invars.count(a) == 1
            ]
            donate = _reusable(eqn, candidates)
            eqn = eqn.replace(params={**eqn.params, "donate_argnums": donate})
        eqns.append(eqn)
    closed = make_closed_jaxpr(
        jaxpr.constvars, program.jaxpr.consts, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.debug_info
    )
    return program.replace(jaxpr=closed)
