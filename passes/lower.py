"""``lower``: StableHLO for every fragment, through the backend registry.

Needs a split program, in its final order of calls, its donation decided (the
``donate`` pass) and, for a backend with ``transfers="in-program"``, its
fragment-to-fragment transfers made send/recv pairs (the ``in-program-transfers`` pass,
which the default pipeline runs before this one for such a backend). Fragments with
the same body, mesh, specs and donation (every microbatch's forward of a stage, say)
are lowered once and share a module, named after the first of them.

The ``jax.stages.Lowered`` objects are attached to the program, in fragment order
and with the backend they were lowered for: the runtime compiles exactly these, and
the stage called ``stablehlo`` prints their text, so what it shows is what runs.
With the option ``meshes`` (mesh indices, ``lower{meshes=(0,2)}`` in a pass list) it
lowers only those meshes' fragments: a process of a multi-process run compiles only
its own meshes' fragments, so its call path lowers only those.
With the option ``on_module`` each new module is also handed on as soon as it is
lowered (the call path's compiler starts XLA on it while this pass lowers the next);
the pass's result does not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable

from mpmdc.lowering import lower_fragment
from mpmdc.passes.base import Property, register
from mpmdc.passes.in_program_transfers import has_peer_transfers, transfers_left

from mpmdc import backends
from mpmdc.errors import PassError
from mpmdc.ir.loop import rolled_loop
from mpmdc.ir.primitives import fragment_p
from mpmdc.ir.program import Phase, Program, fragment_key
from mpmdc.ir.sharding import program_spec_forms


@register(
    "lower",
    "emit StableHLO per fragment for the backend's platform",
    requires={Property.SPLIT, Property.SCHEDULED},
    produces={Property.LOWERED},
)
def lower(
    program: Program,
    *,
    backend: str | None = None,
    meshes: tuple[int, ...] | None = None,
    on_module: Callable | None = None,
) -> Program:
    """Attach one StableHLO module per fragment, lowered for ``backend``'s platform
    (per fragment of ``meshes`` only, when given: indices into the program's meshes).

    ``on_module(key, eqn, mesh, backend, lowered)``, where given, is called for each
    distinct module right after it is lowered (``key`` its fragment key, ``eqn`` the
    first fragment with it, ``mesh`` that fragment's mesh): the call path's compiler
    starts XLA on it while this pass lowers the next. The result does not depend on it."""
    if program.phase < Phase.SPLIT:
        raise PassError("the `lower` pass needs a split program; run `split` before it.")
    if rolled_loop(program.jaxpr.jaxpr.eqns) is not None:
        raise PassError(
            "the `lower` pass needs the microbatch loop stamped out; run `schedule` before it."
        )
    chosen = backends.get(backend or program.backend)
    in_program = chosen.transfers is backends.TransferMode.IN_PROGRAM
    left = transfers_left(program) if in_program else 0
    if left:
        raise PassError(
            f"backend {chosen.name!r} moves values between meshes inside its programs, but "
            f"{left} value(s) still move by `transfer`: run "
            f"`in-program-transfers` right before `lower` (its default pipeline does)."
        )
    if not in_program and has_peer_transfers(program):
        raise PassError(
            f"backend {chosen.name!r} moves values between meshes outside its programs, but "
            f"the program's fragments send and receive them (`in-program-transfers` ran): "
            f"leave that pass out for this backend."
        )
    lowerings, module_keys = {}, []
    forms = program_spec_forms(program)
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive is fragment_p and (meshes is None or eqn.params["mesh"] in meshes):
            key = fragment_key(eqn)
            if key not in lowerings:
                lowerings[key] = lower_fragment(program, eqn, chosen, forms)
                if on_module is not None:
                    on_module(key, eqn, program.meshes[eqn.params["mesh"]], chosen, lowerings[key])
                module_keys.append((eqn.params["name"], key))
    return program.replace(
        phase=Phase.LOWERED,
        module_keys=tuple(module_keys),
        backend=chosen.name,
        lowerings=lowerings,
    )
