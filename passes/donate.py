"""``donate``: which program inputs each fragment call gives its buffer up to.

Needs a split program in its final order of calls (after ``schedule``, which reorders
them): each fragment's ``donate_argnums`` names the donated program inputs
(``compile(donate_argnums=...)``) it reads for the last time, and only once, since the
buffer must outlive every earlier reader, and whose buffer one of its results can take
over (same shape, dtype and spec): donating any other would only make JAX warn that a
donated buffer was not usable.
"""

from __future__ import annotations

from collections import Counter

from mpmdc.passes.base import Property, register

from mpmdc.errors import PassError
from mpmdc.ir.graph import release_plan
from mpmdc.ir.primitives import fragment_p
from mpmdc.ir.program import Phase, Program, make_closed_jaxpr
from mpmdc.ir.sharding import canonical_spec


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


@register(
    "donate",
    "donate each donated input's buffer to the fragment reading it last",
    requires={Property.SPLIT, Property.SCHEDULED},  # the last reader in the final order
    produces={Property.DONATED},
)
def donate(program: Program) -> Program:
    """``program`` with each fragment's ``donate_argnums``: the operands that are donated
    program inputs read for the last time there, and only once by that fragment, where
    a result of the fragment can take over their buffer."""
    if program.phase < Phase.SPLIT:
        raise PassError("the `donate` pass needs a split program; run `split` before it.")
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
