"""PartitionSpecs inside one mesh: validation, and carrying a spec to another mesh."""

from __future__ import annotations

import functools
import math

from jax.extend.core import primitives as jprims
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mpmdc import _jax_compat as compat
from mpmdc.errors import SpecError

# The leading axis of the mesh a stacked array held in per-stage pieces is sharded on
# (``mpmdc.runtime.pieces``): it runs over the stage meshes.
STAGES_AXIS = "stages"


def within_stage(spec: PartitionSpec) -> PartitionSpec:
    """A stacked array's spec with the ``stages`` axis left out: each piece's spec on its mesh."""
    entries = []
    for entry in spec:
        kept = tuple(a for a in axes_of(entry) if a != STAGES_AXIS)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` names (``None``, a name, or a tuple)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@functools.lru_cache(maxsize=4096)  # the call path asks this per argument leaf
def canonical_spec(spec: PartitionSpec | None) -> PartitionSpec | None:
    """``spec`` without trailing replicated dimensions: ``P("x")``, ``P("x", None)`` and
    ``P(("x",))`` shard alike, and cache keys and program specs must not tell them apart.
    ``None`` (no spec) stays ``None``."""
    if spec is None:
        return None
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries, unreduced=spec.unreduced, reduced=spec.reduced)


compat.register_cache(canonical_spec, "mpmdc: canonical partition specs")


def spec_problem(spec: PartitionSpec | None, mesh: Mesh, shape) -> str | None:
    """Why ``spec`` cannot shard an array of ``shape`` on ``mesh``, or ``None`` if it can."""
    if spec is None:
        return None
    # (An axis the mesh lacks first: a spec for another mesh is the likelier mistake.)
    missing = [a for entry in spec for a in axes_of(entry) if a not in mesh.shape]
    if missing:
        return f"{spec} names axis {missing[0]!r}, which the mesh {dict(mesh.shape)} does not have"
    if len(spec) > len(shape):
        return f"{spec} has {len(spec)} entries but the value has only {len(shape)} dimensions"
    used: set[str] = set()
    for dim, entry in enumerate(spec):
        axes = axes_of(entry)
        if twice := used.intersection(axes):
            return (
                f"{spec} splits two dimensions over axis {sorted(twice)[0]!r}; an axis "
                f"shards one dimension at most"
            )
        used.update(axes)
        size = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % size:
            return (
                f"{spec} splits dimension {dim} (size {shape[dim]}) over {axes} "
                f"(size {size}), which does not divide it"
            )
    return None


def check_spec(spec, mesh: Mesh, shape, what: str) -> None:
    """Raise ``SpecError`` naming ``what`` when ``spec`` does not fit."""
    problem = spec_problem(spec, mesh, shape)
    if problem:
        raise SpecError(f"{what}: {problem}. Fix the PartitionSpec for this value.")


def fit_spec(spec: PartitionSpec | None, mesh: Mesh, shape) -> PartitionSpec:
    """``spec`` as far as ``mesh`` supports it: unknown or non-dividing axes become replicated."""
    if spec is None:
        return PartitionSpec()
    entries = []
    for dim, entry in enumerate(spec):
        axes = axes_of(entry)
        ok = (
            all(a in mesh.shape for a in axes)
            and shape[dim] % math.prod(mesh.shape[a] for a in axes) == 0
        )
        entries.append(entry if ok and axes else None)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def spec_forms(specs, values) -> dict:
    """``{(canonical spec, rank): the spec as written}`` for the sharded ``specs`` of
    ``values`` (a program's inputs, then its outputs: ``in_specs``, committed arguments,
    ``out_specs``, the first one written wins): :func:`named` writes an equal spec of a
    value of that rank the same way."""
    forms: dict = {}
    for spec, v in zip(specs, values):
        canonical = canonical_spec(spec)
        if canonical is not None and any(e is not None for e in canonical):
            forms.setdefault((canonical, v.aval.ndim), spec)
    return forms


def full_rank(spec: PartitionSpec | None, ndim: int) -> PartitionSpec:
    """``spec`` naming every dimension of a value of ``ndim`` dimensions where it shards
    something (``P("x", None)`` for a matrix), else ``P()``."""
    spec = canonical_spec(spec)
    if spec is None or all(e is None for e in spec):
        return PartitionSpec()
    entries = (*spec, *(None,) * (ndim - len(spec)))
    return PartitionSpec(*entries, unreduced=spec.unreduced, reduced=spec.reduced)


def named(
    mesh: Mesh, spec: PartitionSpec | None, ndim: int, forms: dict | None = None
) -> NamedSharding:
    """``NamedSharding`` on ``mesh`` for a value of ``ndim`` dimensions; ``None`` means
    replicated. A spec the caller wrote (in ``forms``, see :func:`spec_forms`) is
    written as they wrote it, any other that shards something names every dimension
    (``P("x", None)`` for a matrix): as ``jax.jit`` writes its shardings, so a weight
    updated by a step compares equal to the one passed in."""
    return NamedSharding(mesh, named_spec(spec, ndim, forms))


def named_spec(spec: PartitionSpec | None, ndim: int, forms: dict | None = None) -> PartitionSpec:
    """The spec :func:`named` writes: as the caller wrote an equal one (``forms``), else
    :func:`full_rank`."""
    form = (forms or {}).get((canonical_spec(spec), ndim))
    return form if form is not None else full_rank(spec, ndim)


def program_spec_forms(program) -> dict:
    """:func:`spec_forms` of a program's inputs and outputs (their specs as given, or as
    ``split`` resolved them)."""
    jaxpr = program.jaxpr.jaxpr
    return spec_forms([*program.in_specs, *program.out_specs], [*jaxpr.invars, *jaxpr.outvars])


def bound_mesh(eqn) -> Mesh | None:
    """The mesh an equation can only run on: a ``shard_map``'s, a sharding constraint's
    or a ``device_put``'s in the program, where it names a mesh of devices (not an
    abstract one, which any stage with its axes can run)."""
    if eqn.primitive is compat.shard_map_p:
        meshes = [eqn.params["mesh"]]
    elif eqn.primitive is jprims.sharding_constraint_p:
        meshes = [getattr(eqn.params["sharding"], "mesh", None)]
    elif eqn.primitive is jprims.device_put_p:
        meshes = [getattr(d, "mesh", None) for d in eqn.params["devices"]]
    else:
        return None
    return next((m for m in meshes if isinstance(m, Mesh)), None)
