"""``cond-fission``: cut a conditional into independent conditionals, one per group of
results that share work.

An optimizer wrapped in one ``lax.cond`` or ``lax.switch`` (``optax.MultiSteps``,
``optax.apply_if_finite``, a skip-step written by hand) is one equation computing every
parameter's update. Placed whole, it runs on one mesh and pulls every stage's
parameters and optimizer state there and back each step. Here its results are grouped:
two results share a group when some branch computes both from one intermediate value
that is not a scalar. Scalar work (a step count, a bias correction, a predicate) is
repeated in every group that needs it, as it costs nothing next to moving an array.
Each group becomes a conditional of its own on the same index operand, reading only
the operands its branches need, so ``partition`` places each next to its values and
each mesh runs the branches' work for its own values.

Arrays that share only scalar reductions (a global norm computed inside a branch:
every update needs every array's partial sum) cannot be cut into conditionals without
a cycle between them. Where their branches only compute elementwise and reduce (no
callback, loop or matrix product: an optimizer's), the group is predicated instead:
every branch's equations are inlined and each result is a ``select_n`` on the index,
so ``partition`` places each array's share of the work, and of the reduction, on that
array's mesh, and only partial sums move. A conditional inside a branch whose own branches
may all run (``optax.apply_if_finite`` inside ``optax.MultiSteps``) is written out so
first, and small values made from scalars alone (``jnp.array`` of one flag per
parameter) count as scalars. Both branches then run; for an optimizer's elementwise
work that costs less than moving its state. Results sharing costly work stay in one
conditional; ``partition`` warns where such a conditional reads several meshes'
arrays. A conditional with effects (callbacks, ordered effects) stays whole, so its
effects happen once.

A result every branch returns as the same operand, untouched (a weight JAX's
linearization passes through a conditional as a residual), is that operand: as a
conditional of its own its only placed operand would be the index, which would place it
and, through it, the differentiated conditional reading it.
"""

from __future__ import annotations

import itertools
import math

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims
from jax.interpreters import partial_eval as pe
from mpmdc.passes.base import Property, register

from mpmdc.ir.predication import predicable, selections
from mpmdc.ir.program import (
    Program,
    copy_eqn,
    fresh_like,
    is_var,
    make_closed_jaxpr,
    substituted,
)

# A value of at most this many elements computed from scalars alone counts as one: the
# vector ``jnp.array([...])`` makes of one scalar per parameter (``apply_if_finite``).
# (A model of more parameter arrays than this, unscanned, keeps such a conditional whole:
# ``partition`` then warns.)
SMALL = 4096


def _is_scalar(v) -> bool:
    return getattr(v.aval, "shape", None) == ()


def _scalar_like(jaxpr) -> set:
    """The values of ``jaxpr`` computed from scalars alone, each small: repeating their
    work in several groups is free."""
    found: set = set()
    for eqn in jaxpr.eqns:
        if (
            not eqn.effects
            and all(_is_scalar(a) or a in found for a in eqn.invars)
            and all(math.prod(v.aval.shape) <= SMALL for v in eqn.outvars)
        ):
            found.update(eqn.outvars)
    return found


def _result_groups(branches, scalars_shared: bool = False) -> list[list[int]]:
    """Result indices grouped so that no two groups need one non-scalar value.

    With ``scalars_shared``, a reduction to a scalar (a partial norm) does not join the
    results that read its value: it is a group of its own, as if its scalar could be
    handed to them. Results apart then but not otherwise share only such scalars."""
    import networkx as nx  # (here, not at the top: it is a tenth of `import mpmdc`)

    n = len(branches[0].jaxpr.outvars)
    groups = nx.utils.UnionFind(range(n))
    reductions = itertools.count(n)  # (ids of reductions' own groups, after the results)
    for branch in branches:
        needed_by: dict = {}
        scalar_like = _scalar_like(branch.jaxpr)
        for j, v in enumerate(branch.jaxpr.outvars):
            if is_var(v):
                needed_by.setdefault(v, set()).add(j)
        for eqn in reversed(branch.jaxpr.eqns):
            results = set().union(*(needed_by.get(v, ()) for v in eqn.outvars))
            if not results:
                continue
            if eqn.outvars and all(v in scalar_like for v in eqn.outvars):
                pass  # scalar work, repeated in every group that needs it
            elif scalars_shared and all(map(_is_scalar, eqn.outvars)):
                results = {next(reductions)}
            elif len(results) > 1:
                groups.union(*results)
            for a in eqn.invars:
                if is_var(a):
                    needed_by.setdefault(a, set()).update(results)
    found = (sorted(j for j in group if j < n) for group in groups.to_sets())
    return sorted(group for group in found if group)


def _branches_for(branches, results: list[int]) -> tuple[tuple, list[bool]]:
    """``(branches computing only ``results``, which operands they read)``: every
    branch keeps the operands any branch needs, so their signatures agree."""
    used_outputs = [j in results for j in range(len(branches[0].jaxpr.outvars))]
    reads = [False] * len(branches[0].jaxpr.invars)
    for branch in branches:
        _, used = pe.dce_jaxpr(branch.jaxpr, used_outputs)
        reads = [r or u for r, u in zip(reads, used)]
    new = tuple(
        jcore.ClosedJaxpr(pe.dce_jaxpr(b.jaxpr, used_outputs, instantiate=reads)[0], b.consts)
        for b in branches
    )
    return new, reads


def _predicated(eqn, branches, operands, outvars, consts: dict) -> list:
    """Every branch's equations, inlined, and one ``select_n`` on the index per result:
    the branches' elementwise work runs whichever is taken, so ``partition`` places each
    value's share of it (and of any reduction across values) on that value's mesh.
    ``consts`` gathers the branches' constants as new top-level constants."""
    eqns, cases = [], []
    for branch in branches:
        env = {}
        for var, value in zip(branch.jaxpr.constvars, branch.consts):
            env[var] = fresh_like(var)
            consts[env[var]] = value
        env.update(zip(branch.jaxpr.invars, operands))
        eqns += [copy_eqn(e, env) for e in branch.jaxpr.eqns]
        cases.append(substituted(branch.jaxpr.outvars, env))
    return eqns + selections(eqn, cases, outvars)


def _without_nested_conds(branch):
    """``branch`` with each conditional inside it whose branches may all run written out
    (:func:`_predicated`), so that its results group by their own work rather than as
    one equation's (``optax.MultiSteps`` around ``optax.apply_if_finite``)."""
    jaxpr = branch.jaxpr

    def nested(e) -> bool:
        return e.primitive is jprims.cond_p and predicable(b.jaxpr for b in e.params["branches"])

    if not any(map(nested, jaxpr.eqns)):
        return branch
    consts = dict(zip(jaxpr.constvars, branch.consts))
    eqns = []
    for e in jaxpr.eqns:
        if nested(e):
            inner = [_without_nested_conds(b) for b in e.params["branches"]]
            eqns += _predicated(e, inner, e.invars[1:], e.outvars, consts)
        else:
            eqns.append(e)
    return make_closed_jaxpr(
        list(consts), list(consts.values()), jaxpr.invars, jaxpr.outvars, eqns, jaxpr.debug_info
    )


def _forwarded(branches) -> dict[int, int]:
    """``{result: operand}`` for the results every branch returns as one operand, the
    same in each, untouched (a residual JAX's linearization passes through a
    conditional: a weight the branches read)."""
    found = {}
    for j in range(len(branches[0].jaxpr.outvars)):
        operands = {
            b.jaxpr.invars.index(b.jaxpr.outvars[j]) if b.jaxpr.outvars[j] in b.jaxpr.invars else -1
            for b in branches
        }
        if len(operands) == 1 and -1 not in operands:
            found[j] = operands.pop()
    return found


def _fissioned(eqn, consts: dict, renamed: dict) -> list:
    """``eqn`` (a ``cond``) as one conditional per group of its results, or as selects
    where a group shares only scalar reductions between its arrays. A result every
    branch returns as one of its operands is that operand (recorded in ``renamed``): a
    conditional of its own would be placed by its index alone, away from its users."""
    branches = eqn.params["branches"]
    if eqn.effects or any(b.effects for b in branches):
        return [eqn]
    index, operands = eqn.invars[0], eqn.invars[1:]
    branches = tuple(_without_nested_conds(b) for b in branches)
    forwarded = _forwarded(branches)
    for j, k in forwarded.items():
        renamed[eqn.outvars[j]] = operands[k]
    groups = _result_groups(branches)
    finer = _result_groups(branches, scalars_shared=True)
    if len(groups) == len(finer) == 1 and not forwarded:
        return [eqn]
    out = []
    for results in groups:
        if all(isinstance(eqn.outvars[j], jcore.DropVar) or j in forwarded for j in results):
            continue  # nothing reads these results, or they are operands: no conditional
        new_branches, reads = _branches_for(branches, results)
        used = [a for a, r in zip(operands, reads) if r]
        outvars = [eqn.outvars[j] for j in results]
        split_further = sum(1 for g in finer if g[0] in results) > 1
        if split_further and predicable(b.jaxpr for b in new_branches):
            out += _predicated(eqn, new_branches, used, outvars, consts)
        else:
            out.append(
                eqn.replace(
                    invars=[index, *used],
                    outvars=outvars,
                    params={**eqn.params, "branches": new_branches},
                )
            )
    return out


@register(
    "cond-fission",
    "cut conditionals into independent ones, one per group of results",
    invalidates={Property.PLACED},  # the conditionals it writes have no placement
)
def cond_fission(program: Program) -> Program:
    """Replace each top-level ``cond`` by one conditional per group of results that share
    no non-scalar work (see the module docstring)."""
    closed = program.jaxpr
    eqns, consts, renamed, changed = [], {}, {}, False
    for eqn in closed.jaxpr.eqns:
        if renamed:
            eqn = eqn.replace(invars=substituted(eqn.invars, renamed))
        replaced = _fissioned(eqn, consts, renamed) if eqn.primitive is jprims.cond_p else [eqn]
        changed |= len(replaced) != 1 or replaced[0] is not eqn
        eqns.extend(replaced)
    if not changed:
        return program
    jaxpr = closed.jaxpr
    new = make_closed_jaxpr(
        [*jaxpr.constvars, *consts],
        [*closed.consts, *consts.values()],
        jaxpr.invars,
        substituted(jaxpr.outvars, renamed),
        eqns,
        jaxpr.debug_info,
    )
    return program.replace(jaxpr=new)
