"""``vma-typecheck``: check types, meshes and shardings of a program.

* JAX's ``check_jaxpr`` over the whole program, fragment bodies and ``shard_map``
  bodies included (so varying / unreduced manual axes are checked by JAX itself).
* Every value is used on the mesh where it lives: a fragment's operands live on its
  mesh, a transfer's operands on its source mesh. This is the MPMD axis treated
  as one more manual axis.
* Every ``in_specs``/``out_specs`` entry names only axes of the mesh holding the
  value, and splits only dimensions its axes divide.
* A ``shard_map`` runs on the mesh of the stage it sits in, and so does a sharding
  constraint or ``device_put`` naming a mesh of devices.
* An ordered effect (``debug.print(..., ordered=True)``) runs on a one-device mesh.
* Between ``partition`` and ``split``, every equation has a placement.
* The program has the fields its phase promises, and none of a later phase
  (:meth:`~mpmdc.ir.program.Program.phase_problems`); before ``split`` no fragment or
  transfer is at the top level, from ``schedule`` on no loop edge.

The first, the placements, the phase and the locations are invariants every pass keeps
(:func:`verify`, which the pipeline runs after every pass when asked to verify); the
specs, ``shard_map`` meshes and effects are the user's choices, checked by the pass,
which leaves the costly ``check_jaxpr`` to verification.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.sharding import Mesh
from mpmdc.passes.base import register

from mpmdc import _jax_compat as compat
from mpmdc.errors import TypeCheckError
from mpmdc.ir.primitives import fragment_p, loop_edge_p, transfer_p
from mpmdc.ir.program import Phase, Program, find_eqns, is_var
from mpmdc.ir.sharding import bound_mesh, check_spec


def _check_specs(program: Program) -> None:
    jaxpr = program.jaxpr.jaxpr
    for v, spec, mesh, path in zip(
        jaxpr.invars, program.in_specs, program.in_meshes, program.in_paths
    ):
        check_spec(
            spec,
            program.meshes[mesh],
            v.aval.shape,
            f"in_specs for argument {path} (on mesh{mesh})",
        )
    given = program.wanted_out_meshes or (None,) * len(jaxpr.outvars)
    for v, spec, mesh, path, wanted in zip(
        jaxpr.outvars, program.out_specs, program.out_meshes, program.out_paths, given
    ):
        option = "out_specs" if wanted is None else "out_shardings"  # (where the spec came from)
        check_spec(
            spec, program.meshes[mesh], v.aval.shape, f"{option} for output {path} (on mesh{mesh})"
        )


def _check_shard_maps(eqns, mesh: Mesh, mesh_index: int, where: str) -> None:
    for eqn in find_eqns(eqns, lambda e: e.primitive is compat.shard_map_p):
        inner = eqn.params["mesh"]
        # Axes in order: a mesh of the same sizes under other names in another order lays
        # the shards out differently (JAX refuses it under a context mesh too).
        same_shape = tuple(inner.shape.items()) == tuple(mesh.shape.items())
        same_devices = (
            not isinstance(inner, Mesh) or inner.device_ids.tolist() == mesh.device_ids.tolist()
        )
        if not (same_shape and same_devices):
            other = f"{dict(inner.shape)}"
            if not same_shape and dict(inner.shape) == dict(mesh.shape):
                other += " (the same axes in another order)"
            if isinstance(inner, Mesh):
                other += f" on devices {inner.device_ids.flatten().tolist()}"
            raise TypeCheckError(
                f"shard_map at {compat.source_line(eqn)} is in {where}, which runs on "
                f"mesh{mesh_index} {dict(mesh.shape)} on devices {mesh.device_ids.flatten().tolist()}, "
                f"but it was built for the mesh {other}; build it with that stage's mesh "
                f"(meshes[{mesh_index}]), or with its axes alone, "
                f"mesh=meshes[{mesh_index}].abstract_mesh: then every stage on a mesh of those "
                f"axes can run it (a scan over layers needs that), and so can jax.jit under "
                f"jax.set_mesh."
            )


_SHARDING_NAMES = {"sharding_constraint": "with_sharding_constraint", "device_put": "device_put"}


def _check_shardings_in_program(eqns, mesh: Mesh, mesh_index: int, where: str) -> None:
    """A sharding constraint or ``device_put`` naming a mesh of devices runs on it
    (``partition`` puts it there); one left on another (in a scan over stages on several
    meshes, or naming devices no stage has) could not be compiled there."""
    for eqn in find_eqns(eqns, lambda e: e.primitive.name in _SHARDING_NAMES):
        bound = bound_mesh(eqn)
        devices = None if bound is None else bound.device_ids.flatten().tolist()
        if devices is not None and devices != mesh.device_ids.flatten().tolist():
            raise TypeCheckError(
                f"{_SHARDING_NAMES[eqn.primitive.name]} at {compat.source_line(eqn)} is in "
                f"{where}, which runs on mesh{mesh_index} {dict(mesh.shape)} on devices "
                f"{mesh.device_ids.flatten().tolist()}, but its sharding is on devices "
                f"{devices}; give it a sharding on that stage's mesh (NamedSharding("
                f"meshes[{mesh_index}], spec)), or a bare PartitionSpec under "
                f"jax.set_mesh(...) of a mesh with those axes, which every stage's mesh of "
                f"those axes can run (a scan over layers on several meshes needs that)."
            )


def _is_ordered(eqn) -> bool:
    return any(compat.ordered_effects.contains(e) for e in eqn.effects)


def _check_ordered_effects(eqns, mesh: Mesh, mesh_index: int, where: str) -> None:
    """XLA orders effects on one device only (``jax.jit`` refuses them on more, too)."""
    if mesh.devices.size == 1 or not any(_is_ordered(e) for e in eqns):
        return  # (an equation's effects include those of the bodies inside it)
    for eqn in find_eqns(
        eqns, lambda e: _is_ordered(e) and not list(jcore.jaxprs_in_params(e.params))
    ):
        raise TypeCheckError(
            f"`{eqn.primitive.name}` at {compat.source_line(eqn)} has an ordered effect and is "
            f"in {where}, which runs on mesh{mesh_index} of {mesh.devices.size} devices; XLA keeps "
            f"effects in order on one device only (jax.jit refuses this too). Drop ordered=True, "
            f"or give that stage a mesh of one device."
        )


def _check_locations(program: Program) -> None:
    jaxpr = program.jaxpr.jaxpr
    location = dict(zip(jaxpr.invars, program.in_meshes))
    consts = set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if eqn.primitive is fragment_p:
            here, what = eqn.params["mesh"], f"fragment {eqn.params['name']}"
        elif eqn.primitive is transfer_p:
            here, what = (
                eqn.params["src"],
                f"transfer mesh{eqn.params['src']}->mesh{eqn.params['dst']}",
            )
        elif eqn.primitive is loop_edge_p:
            here, what = eqn.params["mesh"], f"loop edge ({eqn.params['edge']})"
        else:
            raise TypeCheckError(
                f"after split only fragment, transfer and loop edge equations may appear at "
                f"the top level, found `{eqn.primitive.name}`."
            )
        for a in eqn.invars:
            if is_var(a) and a not in consts and location[a] != here:
                raise TypeCheckError(
                    f"{what} on mesh{here} reads a value living on mesh{location[a]} "
                    f"({a.aval.str_short()}); a transfer is missing."
                )
        dst = eqn.params["dst"] if eqn.primitive is transfer_p else here
        location.update((v, dst) for v in eqn.outvars if is_var(v))
    for v, mesh, path in zip(jaxpr.outvars, program.out_meshes, program.out_paths):
        if is_var(v) and v not in consts and location[v] != mesh:
            raise TypeCheckError(
                f"output {path} should live on mesh{mesh} but is on mesh{location[v]}."
            )


def verify(program: Program) -> Program:
    """Check what every pass must keep true, whatever the user wrote; raise
    ``TypeCheckError`` if a pass broke it.

    The program is well typed (JAX's ``check_jaxpr``, over every nested body: the
    costly part) and :func:`_check_structure` holds. The pipeline runs this after every
    pass when asked to verify (``MPMDC_VERIFY=1``, ``mpmdc dump``).
    """
    try:
        jcore.check_jaxpr(program.jaxpr.jaxpr)
    except jcore.JaxprTypeError as err:
        raise TypeCheckError(f"the program is ill-typed: {err}") from None
    _check_structure(program)
    return program


def _check_phase(program: Program) -> None:
    """The fields and top-level equations are those ``program.phase`` promises."""
    problems = program.phase_problems()
    eqns = program.jaxpr.jaxpr.eqns
    if program.phase < Phase.SPLIT:
        cut = next((e for e in eqns if e.primitive in (fragment_p, transfer_p)), None)
        if cut is not None:
            problems.append(f"a `{cut.primitive.name}` is at the top level before `split`")
    elif program.phase >= Phase.SCHEDULED and any(e.primitive is loop_edge_p for e in eqns):
        problems.append("a loop edge is at the top level: the loop is not stamped out")
    if problems:
        raise TypeCheckError(
            f"the {program.phase} program does not have what its phase promises: "
            f"{'; '.join(problems)}."
        )


def _check_structure(program: Program) -> None:
    """The program has what its phase promises, every equation of a placed program has
    a placement, and after ``split`` every value is read where it lives (one walk over
    the top-level equations)."""
    _check_phase(program)
    placements = program.placements
    if placements is not None:
        for eqn, p in zip(program.jaxpr.jaxpr.eqns, placements):
            if p is None:
                raise TypeCheckError(
                    f"`{eqn.primitive.name}` at {compat.source_line(eqn)} has no placement; "
                    f"every equation of a partitioned program must have one."
                )
    elif program.phase >= Phase.SPLIT:
        _check_locations(program)


def _check_fit_mesh(eqns, program: Program, mesh_index: int, where: str) -> None:
    """``eqns``, running in ``where`` on mesh ``mesh_index``, can run there: each
    ``shard_map`` was built for that mesh, and ordered effects need one device."""
    mesh = program.meshes[mesh_index]
    _check_shard_maps(eqns, mesh, mesh_index, where)
    _check_shardings_in_program(eqns, mesh, mesh_index, where)
    _check_ordered_effects(eqns, mesh, mesh_index, where)


def _check_user_choices(program: Program) -> None:
    """Specs fit their meshes, each ``shard_map`` runs on the mesh it was built for and
    ordered effects on one device: what a user's specs, meshes and effects decide."""
    _check_specs(program)
    jaxpr = program.jaxpr.jaxpr
    placements = program.placements
    if placements is not None:
        for eqn, p in zip(jaxpr.eqns, placements):
            _check_fit_mesh([eqn], program, program.mesh_of_stage(p.stage), f"stage {p.stage}")
        return
    for eqn in jaxpr.eqns:
        if eqn.primitive is fragment_p:
            body = eqn.params["jaxpr"].jaxpr.eqns
            _check_fit_mesh(body, program, eqn.params["mesh"], f"fragment {eqn.params['name']}")


@register("vma-typecheck", "check meshes, shardings, manual axes (and types, when verifying)")
def vma_typecheck(program: Program) -> Program:
    """Check ``program``: the user's specs, ``shard_map`` meshes and ordered effects, and
    its placements or locations. Returns it unchanged or raises ``TypeCheckError``.

    JAX's ``check_jaxpr`` of the whole program is left to verification (:func:`verify`,
    which the pipeline runs after every pass when asked): JAX checked the user's
    program as it traced it, and only a bug in a pass could make it ill-typed.
    """
    _check_structure(program)
    if program.phase >= Phase.PLACED:
        _check_user_choices(program)
    return program
