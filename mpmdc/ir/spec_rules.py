"""A ``PartitionSpec`` for every intermediate value, carried forward from the inputs' specs.

``split`` gives each value crossing a fragment boundary a static spec. A value a
batch-sharded input flows into (an activation, its cotangent) should stay sharded on
its batch dimension, or every device of the mesh would compute the whole batch. This
module follows each sharded dimension through the equations:

* a dimension an equation keeps (elementwise ops, markers, slices, concatenation,
  ``dot_general`` batch and free dimensions, broadcasts, transposes, squeezes, a
  reshape's dimensions that stay, merge or split, the batch dimensions of a gather)
  keeps its axis;
* a dimension an equation reduces or contracts loses it (XLA inserts the sum);
* a ``shard_map``'s outputs have its ``out_specs``, and a sharding constraint's (or a
  ``device_put``'s in the program) the spec of its sharding; calls (``pjit``, ``custom_jvp``,
  ``custom_vjp``) are followed into their bodies, as are loops (``scan``, ``while``:
  an iteration's slices and a carry that keeps its spec at every iteration) and the
  branches of a ``cond``; anything else gives an output, per dimension, the axis of
  the first operand of the same shape that shards it;
* a result that updates an input (the nearest input of its shape and dtype back through
  elementwise work, a conditional or a call) has that input's spec: a parameter or an
  optimizer state comes back as it went in, whatever its gradient's spec.

Any spec is correct (XLA moves data to match it); a poor one only costs speed. ``split``
then drops axes a value's mesh lacks or its size does not divide (``fit_spec``).

The rules live in :data:`spec_rules`, keyed by primitive as JAX keys its own rules. A
rule takes the equation and one spec per operand (a tuple with one entry per dimension:
``None`` or mesh axis name(s)) and returns one spec per result. A user's own primitive
gets a rule with :func:`register_spec_rule`; without one it falls back to "a result
takes, per dimension, the axis of the first operand of its shape sharding it".
"""

from __future__ import annotations

import math
from collections.abc import Callable

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims
from jax.sharding import AxisType, PartitionSpec

from mpmdc import _jax_compat as compat
from mpmdc.ir.calls import CALL_BODIES, call_body
from mpmdc.ir.primitives import loop_edge_p
from mpmdc.ir.program import is_var
from mpmdc.ir.sharding import axes_of

Spec = tuple  # one entry per dimension: None or mesh axis name(s)
SpecRule = Callable[[jcore.JaxprEqn, list], list]

spec_rules: dict[jcore.Primitive, SpecRule] = {}

# Primitives whose results can be sharded when no operand is (they state their specs).
_SPEC_SOURCES = frozenset({compat.shard_map_p, jprims.sharding_constraint_p, jprims.device_put_p})


def register_spec_rule(primitive: jcore.Primitive, rule: SpecRule) -> None:
    """Use ``rule(eqn, operand_specs) -> result_specs`` for equations of ``primitive``."""
    spec_rules[primitive] = rule


def _padded(spec: PartitionSpec | None, ndim: int) -> Spec:
    entries = tuple(spec) if spec is not None else ()
    return entries[:ndim] + (None,) * (ndim - len(entries))


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _replicated(v) -> Spec:
    return (None,) * len(_shape(v))


def _typed(v) -> Spec | None:
    """The spec ``v``'s type states on a mesh of ``Explicit`` axes (JAX types values there
    with their shardings, and lowers them so), else ``None``: the rules decide."""
    sharding = getattr(getattr(v, "aval", None), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if not types or any(t != AxisType.Explicit for t in types):
        return None
    return _padded(sharding.spec, len(_shape(v)))


def _is_sharded(spec: Spec) -> bool:
    return any(e is not None for e in spec)


def _without_repeats(spec: Spec) -> Spec:
    """A mesh axis may shard one dimension only; later uses are dropped."""
    used, out = set(), []
    for entry in spec:
        if entry is not None and used & set(axes_of(entry)):
            entry = None
        used |= set(axes_of(entry))
        out.append(entry)
    return tuple(out)


# ------------------------------------------------------------------- the rules


def _same_shape(eqn, specs) -> list[Spec]:
    """Each result: the operands shaped like it merged, each dimension taking the axis of
    the first operand that shards it, unless an earlier operand already uses that axis
    on another dimension (the fallback). So an optimizer's moment
    ``b * mu + (1 - b) * grad`` keeps both the axis its gradient has and the one only
    its state has (a weight sharded over ``fsdp`` and ``tp`` whose gradient is sharded
    over ``tp`` alone), and operands split along different dimensions by one axis
    (``P(None, 'd')`` and ``P('d', None)``) give the first one's spec, not a mix."""
    out = []
    for v in eqn.outvars:
        merged = _replicated(v)
        for a, spec in zip(eqn.invars, specs):
            if _shape(a) == _shape(v):
                used = {axis for entry in merged for axis in axes_of(entry)}
                merged = tuple(
                    m if m is not None or used & set(axes_of(e)) else e
                    for m, e in zip(merged, spec)
                )
        out.append(merged)
    return out


def _first_operand(eqn, specs) -> list[Spec]:
    """Slicing, padding, concatenating: every dimension keeps the first operand's axis."""
    return [specs[0]]


def _dot_general(eqn, specs) -> list[Spec]:
    lhs, rhs = specs
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    batch = [lhs[i] if lhs[i] is not None else rhs[j] for i, j in zip(lb, rb)]
    lhs_free = [lhs[i] for i in range(len(lhs)) if i not in lc and i not in lb]
    rhs_free = [rhs[i] for i in range(len(rhs)) if i not in rc and i not in rb]
    return [(*batch, *lhs_free, *rhs_free)]


def _reduction(eqn, specs) -> list[Spec]:
    return [tuple(e for d, e in enumerate(specs[0]) if d not in eqn.params["axes"])]


def _broadcast_in_dim(eqn, specs) -> list[Spec]:
    out = [None] * len(_shape(eqn.outvars[0]))
    for i, d in enumerate(eqn.params["broadcast_dimensions"]):
        if _shape(eqn.invars[0])[i] == _shape(eqn.outvars[0])[d]:
            out[d] = specs[0][i]
    return [tuple(out)]


def _transpose(eqn, specs) -> list[Spec]:
    return [tuple(specs[0][d] for d in eqn.params["permutation"])]


def _squeeze(eqn, specs) -> list[Spec]:
    return [tuple(e for d, e in enumerate(specs[0]) if d not in eqn.params["dimensions"])]


def _reshape(eqn, specs) -> list[Spec]:
    """A sharded dimension keeps its axis on the result dimension that starts where it
    starts (the same number of elements before it) and is not a unit dimension: that
    dimension is the same one, it merged with the dimensions after it, or it is the
    outer part of a split (as XLA's propagation through a reshape)."""
    spec, old, new = specs[0], _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    starts = {}
    for j in range(len(new)):
        if new[j] != 1:
            starts.setdefault(math.prod(new[:j]), j)
    out = [None] * len(new)
    for i, entry in enumerate(spec):
        j = starts.get(math.prod(old[:i]))
        if entry is None or old[i] <= 1 or j is None:
            continue
        if new[j] % old[i] == 0 or old[i] % new[j] == 0:
            out[j] = entry
    return [tuple(out)]


def _gather(eqn, specs) -> list[Spec]:
    """Output dimensions that are not slice dimensions follow the index batch dimensions."""
    operand, indices = specs[0], specs[1]
    dnums = eqn.params["dimension_numbers"]
    out_ndim = len(_shape(eqn.outvars[0]))
    index_batch = [d for d in range(len(indices)) if d != len(indices) - 1]
    out = [None] * out_ndim
    batch_dims = [d for d in range(out_ndim) if d not in dnums.offset_dims]
    for d, k in zip(batch_dims, index_batch):
        out[d] = indices[k]
    offset_operand = [
        d
        for d in range(len(operand))
        if d not in dnums.collapsed_slice_dims and d not in dnums.operand_batching_dims
    ]
    for d, k in zip(dnums.offset_dims, offset_operand):
        out[d] = operand[k]
    return [tuple(out)]


def _shard_map(eqn, specs) -> list[Spec]:
    return [_padded(s, len(_shape(v))) for s, v in zip(eqn.params["out_specs"], eqn.outvars)]


def _stated(sharding, operand: Spec, ndim: int, unconstrained=()) -> Spec:
    """The spec a sharding states for a value (``with_sharding_constraint``,
    ``device_put`` in the program), the operand's where it states none (a dimension left
    unconstrained, or a sharding that is no ``NamedSharding``)."""
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return operand
    stated = _padded(spec, ndim)
    return tuple(
        operand[d] if d in unconstrained or e is PartitionSpec.UNCONSTRAINED else e
        for d, e in enumerate(stated)
    )


def _sharding_constraint(eqn, specs) -> list[Spec]:
    (v,) = eqn.outvars
    unconstrained = eqn.params.get("unconstrained_dims") or ()
    return [_stated(eqn.params["sharding"], specs[0], len(_shape(v)), unconstrained)]


def _device_put(eqn, specs) -> list[Spec]:
    return [
        _stated(sharding, spec, len(_shape(v)))
        for sharding, spec, v in zip(eqn.params["devices"], specs, eqn.outvars)
    ]


def _call(eqn, specs) -> list[Spec]:
    """Follow the values into the body and out again."""
    body, _ = call_body(eqn)
    found = _propagate(body, specs)
    return [_spec_of(found, v) for v in body.outvars]


def _body_specs(body: jcore.Jaxpr, specs: list[Spec]) -> list[Spec]:
    """The specs of ``body``'s results given its inputs' ``specs``."""
    found = _propagate(body, specs)
    return [_spec_of(found, v) for v in body.outvars]


def _loop_carry(body: jcore.Jaxpr, fixed: list[Spec], carry: list[Spec], results) -> list[Spec]:
    """The carry's specs at a fixed point of a loop ``body`` whose inputs are ``fixed``
    then the carry: an unsharded carry takes the spec the body gives it
    (``results(outs)`` picks the carry's out of the body's results), as propagation into
    a loop does. Specs only gain axes, so this ends within one round per carry value."""
    for _ in range(len(carry) + 1):
        outs = results(_body_specs(body, [*fixed, *carry]))
        grown = [c if _is_sharded(c) else o for c, o in zip(carry, outs)]
        if grown == carry:
            break
        carry = grown
    return carry


def _scan(eqn, specs) -> list[Spec]:
    """Each iteration sees the scanned operands without their leading (loop) dimension;
    the stacked results gain it back, unsharded. The carry keeps the spec that holds at
    every iteration (:func:`_loop_carry`). So a stacked residual of a batch-sharded
    activation stays batch-sharded."""
    body = eqn.params["jaxpr"].jaxpr
    consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    fixed = list(specs[:consts])
    xs = [s[1:] for s in specs[consts + n_carry :]]
    carry = _loop_carry(
        body, fixed, list(specs[consts : consts + n_carry]), lambda outs: outs[:n_carry]
    )
    outs = _body_specs(body, [*fixed, *carry, *xs])
    return [*carry, *((None, *s) for s in outs[n_carry:])]


def _while(eqn, specs) -> list[Spec]:
    """The carry keeps the spec that holds at every iteration (:func:`_loop_carry`)."""
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    fixed = list(specs[n_cond : n_cond + n_body])
    carry = list(specs[n_cond + n_body :])
    return _loop_carry(eqn.params["body_jaxpr"].jaxpr, fixed, carry, lambda outs: outs)


def _cond(eqn, specs) -> list[Spec]:
    """Each result: its spec in the first branch that shards it."""
    per_branch = [_body_specs(branch.jaxpr, list(specs[1:])) for branch in eqn.params["branches"]]
    return [
        next((s for s in candidates if _is_sharded(s)), candidates[0])
        for candidates in zip(*per_branch)
    ]


for _p in (
    jprims.reduce_sum_p,
    jprims.reduce_max_p,
    jprims.reduce_min_p,
    jprims.reduce_prod_p,
    jprims.reduce_and_p,
    jprims.reduce_or_p,
    jprims.argmax_p,
    jprims.argmin_p,
):
    register_spec_rule(_p, _reduction)
for _p in (
    jprims.slice_p,
    jprims.dynamic_slice_p,
    jprims.concatenate_p,
    jprims.pad_p,
    jprims.dynamic_update_slice_p,
):
    register_spec_rule(_p, _first_operand)
# (A loop edge keeps every dimension; a slice or stack changes only the leading one's size.)
register_spec_rule(loop_edge_p, _first_operand)
for _p in CALL_BODIES:
    register_spec_rule(_p, _call)
register_spec_rule(jprims.dot_general_p, _dot_general)
register_spec_rule(jprims.broadcast_in_dim_p, _broadcast_in_dim)
register_spec_rule(jprims.transpose_p, _transpose)
register_spec_rule(jprims.squeeze_p, _squeeze)
register_spec_rule(jprims.reshape_p, _reshape)
register_spec_rule(jprims.gather_p, _gather)
register_spec_rule(compat.shard_map_p, _shard_map)
register_spec_rule(jprims.sharding_constraint_p, _sharding_constraint)
register_spec_rule(jprims.device_put_p, _device_put)
register_spec_rule(jprims.scan_p, _scan)
register_spec_rule(jprims.while_p, _while)
register_spec_rule(jprims.cond_p, _cond)


# ----------------------------------------------------------------- propagation


def _spec_of(found: dict, v) -> Spec:
    return found.get(v, _replicated(v)) if is_var(v) else _replicated(v)


def _propagate(jaxpr: jcore.Jaxpr, in_specs: list[Spec]) -> dict:
    """The sharded values' specs (a value left out is replicated)."""
    found = {}
    for v, spec in zip(jaxpr.invars, in_specs):
        stated = _typed(v)
        spec = spec if stated is None else stated
        if _is_sharded(spec):
            found[v] = spec
    for eqn in jaxpr.eqns:
        typed = [_typed(v) for v in eqn.outvars]
        if (
            eqn.primitive not in _SPEC_SOURCES
            and not any(is_var(a) and a in found for a in eqn.invars)
            and not any(t is not None and _is_sharded(t) for t in typed)
        ):
            continue
        specs = [_spec_of(found, a) for a in eqn.invars]
        rule = spec_rules.get(eqn.primitive, _same_shape)
        for v, spec, stated in zip(eqn.outvars, rule(eqn, specs), typed):
            spec = _without_repeats(spec) if stated is None else stated
            if _is_sharded(spec):
                found[v] = spec
    return found


def _bodies_and_operands(eqn) -> list[tuple[jcore.Jaxpr, list]]:
    """The bodies a value wanted by an equation's results is followed into: each
    ``cond`` branch (reading the operands after the index) and a call's body, each with
    the operands its inputs are."""
    if eqn.primitive is jprims.cond_p:
        return [(branch.jaxpr, eqn.invars[1:]) for branch in eqn.params["branches"]]
    if eqn.primitive in CALL_BODIES and (found := call_body(eqn)) is not None:
        return [(found[0], eqn.invars)]
    return []


def _wanted_by_users(jaxpr: jcore.Jaxpr, found: dict, out_wanted: dict | None = None) -> dict:
    """``{variable: spec}`` for unsharded values combined elementwise (an equation with
    no rule of its own, the operand shaped like the result) into a sharded result: the
    spec that result has, carried back through chains of such equations and into the
    branches of a ``cond`` and the bodies of calls (a skip-step ``cond`` returning a
    parameter as is in one branch and updated in the other). ``out_wanted``: specs
    wanted for ``jaxpr``'s results. An optimizer's moment (``b * mu + (1 - b) * grad``)
    wants its gradient's spec."""
    wanted: dict = {
        v: spec for v, spec in (out_wanted or {}).items() if is_var(v) and v not in found
    }
    for eqn in reversed(jaxpr.eqns):
        specs = {out: found.get(out) or wanted.get(out) for out in eqn.outvars}
        for body, operands in _bodies_and_operands(eqn):
            inner = _wanted_by_users(
                body,
                _propagate(body, [_spec_of(found, a) for a in operands]),
                {v: spec for v, spec in zip(body.outvars, specs.values()) if spec is not None},
            )
            for a, v in zip(operands, body.invars):
                if is_var(a) and a not in found and v in inner:
                    wanted.setdefault(a, inner[v])
        if eqn.primitive in spec_rules or eqn.primitive in _SPEC_SOURCES:
            continue
        for out, spec in specs.items():
            if spec is None:
                continue
            for a in eqn.invars:
                if is_var(a) and a not in found and _shape(a) == _shape(out):
                    wanted.setdefault(a, spec)
    return wanted


def propagate_specs(jaxpr: jcore.Jaxpr, in_specs, fed_back: dict | None = None) -> dict:
    """``{variable: PartitionSpec}`` for every input of ``jaxpr`` and every sharded
    top-level value, given one spec per input; values left out are replicated.

    An input whose spec is ``None`` is free (no spec given, not committed): as
    ``jax.jit`` lets propagation choose an uncommitted argument's sharding, it takes the
    spec its elementwise users want (:func:`_wanted_by_users`), or stays replicated.
    A free input that the update of a sharded input is computed from (an optimizer
    state beside its parameter) takes that input's spec instead, whatever its own
    result's; another whose result fed back (``fed_back``: ``{input: result}``, a
    training loop's pairs) is sharded takes the result's (SM3's accumulator of a
    column-split weight, a maximum over its rows). So optimizer state created unsharded
    gets its parameter's spec on the first call, and the state fed back is placed as the
    program expects."""
    fed_back = fed_back or {}
    padded = [_padded(s, len(_shape(v))) for s, v in zip(in_specs, jaxpr.invars)]
    found = _propagate(jaxpr, padded)
    free = {v for s, v in zip(in_specs, jaxpr.invars) if s is None}
    updates = list(_updates(jaxpr))  # (the walks depend on the program alone)
    # A free input's choice can shard what another free input is combined with (a
    # parameter sharded by the batch it is added to shards its gradient, which its
    # momentum meets): choose again until no free input gains a spec.
    while free:
        # (Later entries win: a state's parameter's spec over its own result's, which
        # carries its gradient's.)
        wanted = {
            **_wanted_by_users(jaxpr, found),
            **{
                v: _spec_of(found, r)
                for v, r in fed_back.items()
                if v in free and _is_sharded(_spec_of(found, r))
            },
            **_state_of_updates(updates, found, free),
        }
        chosen = {v: wanted[v] for v in free if v in wanted}
        if not chosen:
            break
        free -= set(chosen)
        padded = [chosen.get(v, s) for s, v in zip(padded, jaxpr.invars)]
        found = _propagate(jaxpr, padded)
    found.update((v, s) for v, s in zip(jaxpr.invars, padded) if v not in found)
    # An input's update, and the result fed back for it, comes back sharded as the
    # input went in (a momentum given P(None, 'b') whose gradient is also split over
    # 'a'), so a loop feeding it back moves and compiles nothing.
    pairs = [(v, updated) for v, updated, _ in updates] + [(r, v) for v, r in fed_back.items()]
    for v, updated in pairs:
        spec = _spec_of(found, updated)
        if _is_sharded(spec):
            found[v] = spec
        else:
            found.pop(v, None)
    return {v: PartitionSpec(*spec) for v, spec in found.items()}


def _operands_kept(eqn) -> list:
    """The operands whose every dimension ``eqn``'s results of their shape keep as they
    are (elementwise work, a conditional's operands, a call's), or none."""
    rule = spec_rules.get(eqn.primitive)
    if rule is None or rule is _call:
        return list(eqn.invars)
    if eqn.primitive is jprims.cond_p:
        return list(eqn.invars[1:])
    return []


def _kept_cone(v, producer: dict):
    """The values ``v`` is computed from through work that keeps its shape
    (:func:`_operands_kept`), nearest first."""
    frontier, seen = [v], {v}
    while frontier:
        reached = []
        for w in frontier:
            eqn = producer.get(w)
            for a in _operands_kept(eqn) if eqn is not None else ():
                if is_var(a) and a not in seen and _shape(a) == _shape(v):
                    seen.add(a)
                    reached.append(a)
        yield from reached
        frontier = reached


def _updates(jaxpr: jcore.Jaxpr):
    """``(result, input it updates, the values it is computed from)`` for each of
    ``jaxpr``'s results that updates an input: the input of its shape and dtype nearest
    to it in its :func:`_kept_cone`."""
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    inputs = set(jaxpr.invars)
    for v in dict.fromkeys(v for v in jaxpr.outvars if is_var(v)):
        if v in inputs:
            continue
        cone = list(_kept_cone(v, producer))
        updated = next((a for a in cone if a in inputs and a.aval.dtype == v.aval.dtype), None)
        if updated is not None:
            yield v, updated, cone


def _state_of_updates(updates: list, found: dict, free: set) -> dict:
    """``{free input: spec}`` for free inputs that the update of a sharded input is
    computed from (its optimizer state: ``p - lr * (0.9 * m + g)`` reads ``m``; ``updates``
    from :func:`_updates`): that input's spec, so state created unsharded is sharded as
    its parameter."""
    out: dict = {}
    for _, updated, cone in updates:
        if updated in found and updated not in free:
            for a in cone:
                if a in free:
                    out.setdefault(a, found[updated])
    return out
