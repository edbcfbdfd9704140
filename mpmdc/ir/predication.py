"""Work that may run whether or not its branch of a conditional is taken.

A conditional whose branches only do such work can be *predicated*: every branch runs
and a ``select_n`` on the index picks each result, so each share of the work can be
placed (or cut into a layer stack's pieces) like any other elementwise work. The
branches must neither fail nor call out, and cost little when their result is not
taken: arithmetic, comparisons, casts, shape changes and reductions, and calls made
of them; no callbacks, custom calls, platform-dependent branches, loops or matrix
products.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims

PREDICABLE = frozenset(
    getattr(jprims, f"{name}_p")
    for name in (
        "abs add and broadcast_in_dim ceil clamp concatenate convert_element_type copy cos div eq erf "
        "exp exp2 expm1 floor ge gt integer_pow iota is_finite le log log1p logistic lt max "
        "min mul ne neg not or pow reduce_and reduce_max reduce_min reduce_or reduce_prod "
        "reduce_sum rem reshape round rsqrt select_n sign sin sqrt square squeeze sub tanh xor"
    ).split()
)
PREDICABLE_CALLS = frozenset({jprims.jit_p, jprims.custom_jvp_call_p})


def predicable(jaxprs) -> bool:
    """Every equation of ``jaxprs`` (calls and conditionals followed) is in
    :data:`PREDICABLE`: a conditional inside may then be predicated too."""
    return all(
        eqn.primitive in PREDICABLE
        or (
            (eqn.primitive in PREDICABLE_CALLS or eqn.primitive is jprims.cond_p)
            and not eqn.effects
            and predicable(jcore.jaxprs_in_params(eqn.params))
        )
        for jaxpr in jaxprs
        for eqn in jaxpr.eqns
    )


def selections(eqn, cases, outvars) -> list:
    """For a conditional ``eqn`` whose branches, written out, give ``cases`` (per
    branch, its results): one ``select_n`` on its index per result in ``outvars`` that
    something reads."""
    # (``lax.cond`` and ``lax.switch`` clamp the index into range, where ``select_n`` and
    # XLA's case op would disagree on an index out of it.)
    return [
        eqn.replace(
            primitive=jprims.select_n_p,
            invars=[eqn.invars[0], *chosen],
            outvars=[out],
            params={},
            effects=jcore.no_effects,
        )
        for out, chosen in zip(outvars, zip(*cases))
        if not isinstance(out, jcore.DropVar)
    ]
