"""Call-like primitives: equations whose body is a plain function call.

Once differentiation is done, a ``jit``, ``closed_call``, ``checkpoint`` or
custom-derivative equation computes exactly its body on its operands. Passes that see
through calls (``inline`` flattens them, spec propagation follows values into them)
ask this table, so what counts as a call is decided once.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims

# The parameter holding each call primitive's body (a Jaxpr or ClosedJaxpr whose inputs
# and outputs are the equation's, one to one).
CALL_BODIES: dict[jcore.Primitive, str] = {
    jprims.jit_p: "jaxpr",
    jprims.closed_call_p: "call_jaxpr",
    jprims.call_p: "call_jaxpr",
    jprims.remat_p: "jaxpr",
    jprims.custom_jvp_call_p: "call_jaxpr",
    jprims.custom_vjp_call_p: "call_jaxpr",
}

# Checkpointed calls: their bodies are recomputed in the backward pass.
REMAT_CALLS = frozenset({jprims.remat_p})


def call_body(eqn) -> tuple[jcore.Jaxpr, list] | None:
    """``(jaxpr, consts)`` of a call equation's body, else ``None``."""
    param = CALL_BODIES.get(eqn.primitive)
    body = eqn.params.get(param) if param else None
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    if isinstance(body, jcore.Jaxpr):
        return body, []
    return None
