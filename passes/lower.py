"""``lower``: StableHLO for every fragment, through the backend registry.

Needs a split program. For a backend with ``transfers="in-program"`` the
fragment-to-fragment transfers are first rewritten into send/recv pairs. Fragments
with the same body, mesh and specs (every microbatch's forward of a stage, say) are
lowered once and share a module, named after the first of them. The modules are
attached to the program in fragment order, with the backend they were lowered for
(the stage called ``stablehlo`` prints them), and the ``jax.stages.Lowered`` objects
are kept for the runtime, which compiles them without tracing again.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpmdc.lowering import lower_fragment
from mpmdc.passes.base import FunctionPass
from mpmdc.passes.in_program_transfers import in_program_transfers

from mpmdc import backends
from mpmdc.errors import PassError
from mpmdc.ir import Program, fragment_key
from mpmdc.primitives import fragment_p


def lower(program: Program, backend: str | None = None) -> Program:
    """Attach one StableHLO module per fragment, lowered for ``backend``'s platform."""
    if not program.is_split:
        raise PassError("the `lower` pass needs a split program; run `split` before it.")
    chosen = backends.get(backend or program.backend)
    if chosen.transfers == "in-program":
        program = in_program_transfers(program)
    lowerings, modules = {}, []
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive is fragment_p:
            key = fragment_key(eqn)
            if key not in lowerings:
                lowerings[key] = lower_fragment(program, eqn, chosen)
                modules.append((eqn.params["name"], lowerings[key].as_text()))
    return program.replace(modules=tuple(modules), backend=chosen.name, lowerings=lowerings)


@dataclass(frozen=True)
class Lower(FunctionPass):
    """Pass object for :func:`lower`; ``backend=None`` uses the program's backend."""

    name = "lower"
    summary = "emit StableHLO per fragment for the backend's platform"
    body = staticmethod(lower)
    backend: str | None = None

    def run(self, program: Program) -> Program:
        """Apply the pass."""
        return lower(program, self.backend)
