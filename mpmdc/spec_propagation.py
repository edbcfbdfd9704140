"""A ``PartitionSpec`` for every intermediate value, carried forward from the inputs' specs.

``split`` gives each value crossing a fragment boundary a static spec. A value a
batch-sharded input flows into (an activation, its cotangent) should stay sharded on
its batch dimension, or every device of the mesh would compute the whole batch. This
module follows each sharded dimension through the equations:

* a dimension an equation keeps (elementwise ops, markers, slices, concatenation,
  ``dot_general`` batch and free dimensions, broadcasts, transposes, squeezes, the
  leading dimension of a reshape, the batch dimensions of a gather) keeps its axis;
* a dimension an equation reduces or contracts loses it (XLA inserts the sum);
* a ``shard_map``'s outputs have its ``out_specs``; calls (``pjit``, ``custom_jvp``,
  ``custom_vjp``) are followed into their bodies; anything else gives an output the
  spec of an operand of the same shape, if any.

Any spec is correct (XLA moves data to match it); a poor one only costs speed. ``split``
then drops axes a value's mesh lacks or its size does not divide (``fit_spec``).
"""

from __future__ import annotations

import math

from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from mpmdc.ir import is_var

Spec = tuple  # one entry per dimension: None or mesh axis name(s)

_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
               "argmax", "argmin"}


def _padded(spec: PartitionSpec | None, ndim: int) -> Spec:
    entries = tuple(spec) if spec is not None else ()
    return entries[:ndim] + (None,) * (ndim - len(entries))


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _axes(entry) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _replicated(v) -> Spec:
    return (None,) * len(_shape(v))


def _is_sharded(spec: Spec) -> bool:
    return any(e is not None for e in spec)


def _without_repeats(spec: Spec) -> Spec:
    """A mesh axis may shard one dimension only; later uses are dropped."""
    used, out = set(), []
    for entry in spec:
        if entry is not None and used & set(_axes(entry)):
            entry = None
        used |= set(_axes(entry))
        out.append(entry)
    return tuple(out)


def _same_shape(eqn, specs, out) -> Spec:
    """The spec of the first operand shaped like ``out`` that is sharded at all."""
    candidates = [s for a, s in zip(eqn.invars, specs) if _shape(a) == _shape(out)]
    return next((s for s in candidates if _is_sharded(s)), _replicated(out))


def _dot_general(eqn, lhs: Spec, rhs: Spec) -> Spec:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    batch = [lhs[i] if lhs[i] is not None else rhs[j] for i, j in zip(lb, rb)]
    lhs_free = [lhs[i] for i in range(len(lhs)) if i not in lc and i not in lb]
    rhs_free = [rhs[i] for i in range(len(rhs)) if i not in rc and i not in rb]
    return (*batch, *lhs_free, *rhs_free)


def _reshape(spec: Spec, old: tuple, new: tuple) -> Spec:
    """Keeps the leading dimension's axis where the leading dimension is kept, merged
    with the ones after it, or split with its outer part leading."""
    out = [None] * len(new)
    if spec and new and spec[0] is not None:
        merged = new[0] in {math.prod(old[:k]) for k in range(1, len(old) + 1)}
        split = old[0] in {math.prod(new[:k]) for k in range(1, len(new) + 1)}
        if merged or split:
            out[0] = spec[0]
    return tuple(out)


def _gather(eqn, operand: Spec, indices: Spec) -> Spec:
    """Output dimensions that are not slice dimensions follow the index batch dimensions."""
    dnums = eqn.params["dimension_numbers"]
    out_ndim = len(_shape(eqn.outvars[0]))
    index_batch = [d for d in range(len(indices)) if d != len(indices) - 1]
    out = [None] * out_ndim
    batch_dims = [d for d in range(out_ndim) if d not in dnums.offset_dims]
    for d, k in zip(batch_dims, index_batch):
        out[d] = indices[k]
    offset_operand = [d for d in range(len(operand)) if d not in dnums.collapsed_slice_dims
                      and d not in dnums.operand_batching_dims]
    for d, k in zip(dnums.offset_dims, offset_operand):
        out[d] = operand[k]
    return tuple(out)


def _call_body(eqn):
    """The body of a call-like equation whose inputs and outputs map one to one, if any."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        if body is None:
            continue
        inner = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
        if isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(eqn.invars) \
                and len(inner.outvars) == len(eqn.outvars):
            return inner
    return None


def _outputs(eqn, specs: list[Spec]) -> list[Spec]:
    name = eqn.primitive.name
    outs = eqn.outvars
    if name == "shard_map":
        return [_padded(s, len(_shape(v))) for s, v in zip(eqn.params["out_specs"], outs)]
    body = _call_body(eqn)
    if body is not None:
        found = _propagate(body, specs)
        return [_spec_of(found, v) for v in body.outvars]
    if name == "dot_general":
        return [_dot_general(eqn, *specs)]
    if name in _REDUCTIONS:
        return [tuple(e for d, e in enumerate(specs[0]) if d not in eqn.params["axes"])]
    if name == "broadcast_in_dim":
        out = [None] * len(_shape(outs[0]))
        for i, d in enumerate(eqn.params["broadcast_dimensions"]):
            if _shape(eqn.invars[0])[i] == _shape(outs[0])[d]:
                out[d] = specs[0][i]
        return [tuple(out)]
    if name == "transpose":
        return [tuple(specs[0][d] for d in eqn.params["permutation"])]
    if name == "squeeze":
        return [tuple(e for d, e in enumerate(specs[0]) if d not in eqn.params["dimensions"])]
    if name == "reshape":
        return [_reshape(specs[0], _shape(eqn.invars[0]), _shape(outs[0]))]
    if name in ("slice", "dynamic_slice", "concatenate", "pad", "dynamic_update_slice"):
        return [specs[0]]
    if name == "gather":
        return [_gather(eqn, specs[0], specs[1])]
    return [_same_shape(eqn, specs, v) for v in outs]


def _spec_of(found: dict, v) -> Spec:
    return found.get(v, _replicated(v)) if is_var(v) else _replicated(v)


def _propagate(jaxpr: jcore.Jaxpr, in_specs: list[Spec]) -> dict:
    found = dict(zip(jaxpr.invars, in_specs))
    for eqn in jaxpr.eqns:
        specs = [_spec_of(found, a) for a in eqn.invars]
        if not any(map(_is_sharded, specs)) and eqn.primitive.name != "shard_map":
            continue
        for v, spec in zip(eqn.outvars, _outputs(eqn, specs)):
            if _is_sharded(spec):
                found[v] = _without_repeats(spec)
    return found


def propagate_specs(jaxpr: jcore.Jaxpr, in_specs) -> dict:
    """``{variable: PartitionSpec}`` for the sharded top-level values of ``jaxpr`` (inputs
    included), given one spec (or ``None``) per input; values left out are replicated."""
    padded = [_padded(s, len(_shape(v))) for s, v in zip(in_specs, jaxpr.invars)]
    return {v: PartitionSpec(*spec) for v, spec in _propagate(jaxpr, padded).items()}
