"""``lower``: StableHLO for every fragment, through the backend registry.

Needs a split program. The modules are attached to the program in fragment order;
the stage called ``stablehlo`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpmdc.lowering import lower_fragment
from mpmdc.passes.base import FunctionPass

from mpmdc import backends
from mpmdc.errors import PassError
from mpmdc.ir import Program
from mpmdc.primitives import fragment_p


def lower(program: Program, backend: str | None = None) -> Program:
    """Attach one StableHLO module per fragment, lowered for ``backend``'s platform."""
    if not program.is_split:
        raise PassError("the `lower` pass needs a split program; run `split` before it.")
    platform = backends.get(backend or program.backend).platform
    modules = tuple(
        (eqn.params["name"], lower_fragment(program, eqn, platform))
        for eqn in program.jaxpr.jaxpr.eqns
        if eqn.primitive is fragment_p
    )
    return program.replace(modules=modules)


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
