"""``partition``: give every equation a placement (stage and transpose count).

Rules, in the order they apply:

1. Seeds. A marker ``stage[s, t]`` runs in stage ``s``, and so does a ``shard_map``
   built for the mesh of stage ``s`` (when only that stage uses the mesh; when several
   do, it ends up in one of them that its neighbours are in). A forward marker (even
   ``t``) is where values *enter* stage ``s``: its outputs tell their users where
   they are. A transposed marker (odd ``t``) is where cotangents *leave* the
   backward of stage ``s``: its inputs tell their producers where they are.
2. Operands forward. An unplaced equation whose operands come from placed
   equations runs with the latest of them in pipeline order (forward stages
   ascending, then backward stages descending), so a sum of gradient
   contributions lands on the stage that holds the parameter.
3. Users backward. An equation still unplaced (it reads program inputs only) runs
   with the earliest of its users, a marker counting as a user in its own stage, so
   work before the first marker (an embedding lookup) runs in the first stage; a
   value several stages need (a tied weight) is produced once and transferred.
   Rules 2 and 3 repeat until nothing changes, one transpose count at a time
   (forward first); then a cotangent leaving a transposed marker counts as an
   operand in that marker's stage; what is left runs in the first stage.
4. Microbatches. Inside an ``mpmdc.accumulate`` loop, a ``microbatch[i]`` marker
   puts its outputs in microbatch ``i``, and ``microbatch[None]`` outside the loop
   (the start of a running sum, the loop's results). An equation reading values of several
   microbatches belongs to the latest of them (so the running sum of gradients
   moves from one microbatch's backward fragment to the next); one reading none
   belongs to the microbatch all its users agree on, or to none (work outside the
   loop, such as slicing the batch into microbatches).
5. Cheap equations, computed from literals alone (constants, ``iota``, broadcasts
   of literals), are cloned into every stage that uses them instead of being
   transferred.

The transpose count of an equation is the largest count among the markers it
depends on, so the last stage's backward shares a fragment with its forward and
every earlier stage gets separate forward and backward fragments.

Program inputs live on the mesh of their earliest user, outputs on the mesh of
their producer.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.sharding import Mesh
from mpmdc.passes.base import FunctionPass

from mpmdc.ir import (
    Placement,
    Program,
    copy_eqn,
    is_var,
    make_closed_jaxpr,
    placed,
    placement_of,
    substituted,
    vars_of,
)
from mpmdc.primitives import (
    is_marker,
    is_microbatch_marker,
    is_transposed_marker,
)


def _is_cheap(eqn, cheap_vars) -> bool:
    """Computed from literals (or other cheap values) alone, with no effects or bodies."""
    return (
        not is_marker(eqn)
        and not is_microbatch_marker(eqn)
        and not eqn.effects
        and not list(jcore.jaxprs_in_params(eqn.params))
        and all(not is_var(a) or a in cheap_vars for a in eqn.invars)
    )


def _transpose_counts(eqns, producer):
    counts = []
    for i, eqn in enumerate(eqns):
        t = max((counts[producer[a]] for a in vars_of(eqn.invars) if a in producer), default=0)
        if is_marker(eqn):
            t = max(t, eqn.params["transpose"])
        counts.append(t)
    return counts


def _shard_map_stages(program: Program, eqns) -> dict[int, list[int]]:
    """For each top-level ``shard_map`` built for one of the meshes: the stages on that mesh.

    A ``shard_map`` can only run on the mesh it was built for, but the placement rules
    follow data: its operand may come from another stage, and its transpose reads only
    cotangents, which may come from any stage. A mesh has stages even where no marker
    names them.
    """
    if program.stage_to_mesh:
        stages = range(len(program.stage_to_mesh))
    else:  # stage s runs on mesh s % len(meshes)
        marked = [e.params["stage"] for e in eqns if is_marker(e)]
        stages = range(max(len(program.meshes), max(marked, default=0) + 1))
    out = {}
    for i, eqn in enumerate(eqns):
        if eqn.primitive.name == "shard_map" and isinstance(eqn.params["mesh"], Mesh):
            ids = eqn.params["mesh"].device_ids.tolist()
            out[i] = [s for s in stages if program.meshes[program.mesh_of_stage(s)].device_ids.tolist() == ids]
    return out


def _pin_shard_maps(stage, candidates, eqns, producer, users) -> None:
    """Move each ``shard_map`` placed on a stage of another mesh to a stage of its own mesh:
    one its operands or users are in if there is one, else the first."""
    for i, on_mesh in candidates.items():
        if not on_mesh or stage[i] in on_mesh:
            continue
        near = [stage[producer[a]] for a in vars_of(eqns[i].invars) if a in producer]
        near += [stage[j] for v in eqns[i].outvars for j in users.get(v, ())]
        stage[i] = next((s for s in near if s in on_mesh), on_mesh[0])


def _infer_stages(eqns, producer, users, cheap, transpose, seeds):
    """Stage per equation index (``None`` for cheap equations); ``seeds`` are fixed ones.

    Placement runs one transpose count at a time (forward first), so the backward
    of the code before the first marker follows its forward's residuals instead of
    whichever gradient happens to be summed into it.
    """
    stage = [eqn.params["stage"] if is_marker(eqn) else seeds.get(i) for i, eqn in enumerate(eqns)]
    default = min((eqn.params["stage"] for eqn in eqns if is_marker(eqn)), default=0)

    def key(i):
        return Placement(stage[i], transpose[i]).order_key()

    def from_operands(i, through_boundaries):
        for a in vars_of(eqns[i].invars):
            j = producer.get(a)
            if j is not None and stage[j] is not None:
                if through_boundaries or not is_transposed_marker(eqns[j]):
                    yield j

    def from_users(i):
        for v in eqns[i].outvars:
            for j in users.get(v, ()):
                if stage[j] is not None:
                    yield j

    def settle(members, through_boundaries):
        changed = True
        while changed:
            changed = False
            for i in members:
                if stage[i] is None:
                    found = max(from_operands(i, through_boundaries), key=key, default=None)
                    if found is not None:
                        stage[i], changed = stage[found], True
            for i in reversed(members):
                if stage[i] is None:
                    found = min(from_users(i), key=key, default=None)
                    if found is not None:
                        stage[i], changed = stage[found], True

    for t in sorted(set(transpose)):
        members = [i for i, s in enumerate(stage) if s is None and i not in cheap and transpose[i] == t]
        settle(members, through_boundaries=False)
        # Still unplaced: a cotangent leaving a stage's backward is the best hint left.
        settle(members, through_boundaries=True)
        for i in members:
            if stage[i] is None:
                stage[i] = default
    return stage


def _infer_microbatches(eqns, producer, users, cheap):
    """Microbatch per equation index (``None`` outside an ``accumulate`` loop and for cheap ones)."""
    microbatch: list[int | None] = [None] * len(eqns)
    for i, eqn in enumerate(eqns):
        if is_microbatch_marker(eqn):
            microbatch[i] = eqn.params["index"]
        elif i not in cheap:
            found = [microbatch[producer[a]] for a in vars_of(eqn.invars) if a in producer]
            microbatch[i] = max((m for m in found if m is not None), default=None)
    for i in reversed(range(len(eqns))):
        if microbatch[i] is None and i not in cheap and not is_microbatch_marker(eqns[i]):
            # Slicing the batch stays before the loop, so every microbatch's forward
            # fragment has the same body (and shares one executable).
            of_users = {
                microbatch[j]
                for v in eqns[i].outvars
                for j in users.get(v, ())
                if not is_microbatch_marker(eqns[j])
            }
            if len(of_users) == 1:
                microbatch[i] = of_users.pop()
    return microbatch


def partition(program: Program) -> Program:
    """Place every equation; clone cheap ones per user; choose input and output meshes."""
    jaxpr = program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    producer, users = {}, {}
    cheap, cheap_vars = set(), set()
    for i, eqn in enumerate(eqns):
        for a in vars_of(eqn.invars):
            users.setdefault(a, []).append(i)
        producer.update((v, i) for v in eqn.outvars if is_var(v))
        if _is_cheap(eqn, cheap_vars):
            cheap.add(i)
            cheap_vars.update(eqn.outvars)
    for eqn in eqns:
        if is_marker(eqn):
            program.mesh_of_stage(eqn.params["stage"], eqn)

    transpose = _transpose_counts(eqns, producer)
    candidates = _shard_map_stages(program, eqns)
    seeds = {i: on_mesh[0] for i, on_mesh in candidates.items() if len(on_mesh) == 1}
    stage = _infer_stages(eqns, producer, users, cheap, transpose, seeds)
    _pin_shard_maps(stage, candidates, eqns, producer, users)
    microbatch = _infer_microbatches(eqns, producer, users, cheap)
    placement = {
        i: Placement(stage[i], transpose[i], microbatch[i])
        for i in range(len(eqns))
        if i not in cheap
    }

    default = min(placement.values(), key=Placement.order_key, default=Placement(0, 0))
    out_placement = []
    for v in jaxpr.outvars:
        if is_var(v) and v in producer and producer[v] not in cheap:
            out_placement.append(placement[producer[v]])
        else:
            out_placement.append(default)

    # Cheap equations: one clone per placement among their (transitive) users.
    needed: dict[int, set[Placement]] = {i: set() for i in cheap}
    for i, eqn in enumerate(eqns):
        if i in placement:
            for a in vars_of(eqn.invars):
                if a in cheap_vars:
                    needed[producer[a]].add(placement[i])
    for v, p in zip(jaxpr.outvars, out_placement):
        if is_var(v) and v in cheap_vars:
            needed[producer[v]].add(p)
    for i in sorted(cheap, reverse=True):
        for a in vars_of(eqns[i].invars):
            if a in cheap_vars:
                needed[producer[a]] |= needed[i]

    # Only clones get fresh names: clone_env[p] renames a cheap value to its copy in p.
    new_eqns = []
    clone_env: dict[Placement, dict] = {}
    for i, eqn in enumerate(eqns):
        if i in cheap:
            for p in sorted(needed[i], key=Placement.order_key):
                new_eqns.append(placed(copy_eqn(eqn, clone_env.setdefault(p, {})), p))
        else:
            p = placement[i]
            new_eqns.append(placed(eqn.replace(invars=substituted(eqn.invars, clone_env.get(p, {}))), p))
    outvars = [
        substituted([v], clone_env.get(p, {}))[0] for v, p in zip(jaxpr.outvars, out_placement)
    ]

    def mesh_of(p: Placement) -> int:
        return program.mesh_of_stage(p.stage)

    input_users: dict = {}
    for eqn in new_eqns:
        for a in vars_of(eqn.invars):
            input_users.setdefault(a, []).append(placement_of(eqn))
    in_index = {v: k for k, v in enumerate(jaxpr.invars)}
    for v, p in zip(jaxpr.outvars, out_placement):
        if is_var(v) and v in in_index and v not in input_users:
            input_users[v] = [p]
    in_meshes = [
        mesh_of(min(input_users.get(v, [default]), key=Placement.order_key)) for v in jaxpr.invars
    ]
    out_meshes = [
        in_meshes[in_index[v]] if is_var(v) and v in in_index else mesh_of(p)
        for v, p in zip(jaxpr.outvars, out_placement)
    ]

    closed = program.jaxpr
    new = make_closed_jaxpr(
        jaxpr.constvars, closed.consts, jaxpr.invars, outvars, new_eqns, jaxpr.debug_info
    )
    return program.replace(
        jaxpr=new,
        in_meshes=tuple(in_meshes),
        out_meshes=tuple(out_meshes),
    )


class Partition(FunctionPass):
    """Pass object for :func:`partition`."""

    name = "partition"
    summary = "place every equation on a stage and mesh"
    body = staticmethod(partition)
