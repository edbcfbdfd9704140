"""The data flow of a list of equations: who defines each variable, who reads it, and
when it is read for the last time.

Every pass that walks a program's data flow (placing equations, cutting fragments,
ordering them, planning when to free buffers) starts from these maps, so they are
built here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from jax.extend.core import primitives as jprims

from mpmdc.ir.program import is_var, vars_of

# Equations that lay a value's elements out otherwise and change nothing else.
_RELAYOUTS = frozenset({jprims.transpose_p, jprims.reshape_p, jprims.squeeze_p})


class DefUse(NamedTuple):
    """``producer[v]``: index of the equation defining ``v`` (program inputs and
    constants have none); ``readers[v]``: indices of the equations reading ``v``,
    ascending, each once; ``reads[i]``: the variables equation ``i`` reads, in operand
    order (literals left out)."""

    producer: dict
    readers: dict
    reads: list


def def_use(eqns: Sequence) -> DefUse:
    """Producer and readers of every variable of ``eqns``, and each one's operands."""
    producer: dict = {}
    readers: dict = {}
    reads: list = []
    for i, eqn in enumerate(eqns):
        reads.append(vars_of(eqn.invars))
        for a in reads[-1]:
            seen = readers.setdefault(a, [])
            if not seen or seen[-1] != i:
                seen.append(i)
        producer.update((v, i) for v in eqn.outvars if is_var(v))
    return DefUse(producer, readers, reads)


def relaid_input(v, eqns: Sequence, producer: dict):
    """The program input (or constant) that ``v`` is laid out from by transposes and
    reshapes alone (a stack's layer axis moved first: ``jnp.moveaxis(w, 1, 0)``), ``v``
    itself if it is one, else ``None``. ``producer``: :class:`DefUse`'s, of ``eqns``."""
    while v in producer:
        eqn = eqns[producer[v]]
        if eqn.primitive not in _RELAYOUTS or len(vars_of(eqn.invars)) != 1 or eqn.effects:
            return None
        v = eqn.invars[0]
    return v


def release_plan(jaxpr) -> list[list]:
    """Per top-level equation, the variables to drop once it has run (their last read).

    Program outputs are never dropped; neither is a value nobody reads (it was never
    stored past its producer's results).
    """
    last_use = {v: seen[-1] for v, seen in def_use(jaxpr.eqns).readers.items()}
    for v in vars_of(jaxpr.outvars):
        last_use.pop(v, None)
    releases = [[] for _ in jaxpr.eqns]
    for v, i in last_use.items():
        releases[i].append(v)
    return releases
