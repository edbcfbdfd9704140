"""``partition``: give every equation a placement (stage and transpose count).

Rules, in the order they apply:

1. Seeds. A marker ``stage[s, t]`` runs in stage ``s``, and so does a scan that
   ``split-scans`` placed in stage ``s`` (one group of a layer stack), and a ``shard_map``
   built for the mesh of stage ``s`` (when only that stage uses the mesh; when several
   do, it ends up in one of them that its neighbours are in). A forward marker (even
   ``t``) is where values *enter* stage ``s``: its outputs tell their users where
   they are. A transposed marker (odd ``t``) is where cotangents *leave* the
   backward of stage ``s``: its inputs tell their producers where they are.
2. Operands forward. The pipeline's own work (equations that depend on a marker)
   runs with its operands: where moving the operands that other equations made costs
   the fewest bytes (program inputs, the parameters, never pull work: they go where
   they are used), ties going to the latest placement in pipeline order (forward
   stages ascending, then backward stages descending), so a sum of gradient
   contributions lands on the stage that holds the parameter. An equation waits while
   an operand at least as large as its placed ones is still unplaced, so that a sum is
   not decided by whichever contribution was placed first.
3. Users backward. Work that prepares a marker's input (an embedding lookup) runs
   with the earliest of its users. Rules 2 and 3 repeat until nothing changes, one
   transpose count at a time (forward first); then a cotangent leaving a transposed
   marker also counts, at its source and wherever else it is going (a bias gradient
   summed from the cotangent entering a stage runs in that stage), except that work
   reading it and a residual of an earlier stage's forward (a dropout mask) runs in
   that stage's backward: the cotangent leaves its marker's stage for it anyway.
4. The rest: work that reads program inputs and the pipeline's results, such as the
   optimizer update, runs where its operands (program inputs where they are used)
   and its users cost the fewest bytes to move, and joins the fragment of its earliest
   user. So a parameter, its optimizer state, its update and its new value share the
   mesh of the stage that uses the parameter, and a global gradient norm is reduced
   per mesh with only scalars crossing. What nothing places runs in the first stage.
   Before it, a cut of a program input (a smaller value made of that input alone, laid
   out otherwise or not: a stage's rows of a layer stack kept whole on one mesh, its
   layer axis first or not) runs where the input lives, so the cut moves, not the
   input (:func:`place_cuts`). After it, the work after the microbatch loop moves
   between each two meshes where a minimum cut of the bytes it moves says
   (:func:`place_by_min_cut`): placed an equation at a time, a chain can look as cheap
   on either mesh at each step and cost more in all (a stage's rows of a stack kept
   whole, updated where its gradient is, with the state's rows sent there and the new
   rows back); an optimizer state stays on its parameter's mesh through the cut.
   A skip-step conditional's update, which ``cond-fission`` makes a ``select_n``
   between the state and its update, counts as the update it returns.
5. Microbatches. Inside an ``mpmdc.accumulate`` loop, a ``microbatch[i]`` marker
   puts its outputs in microbatch ``i``, and ``microbatch[None]`` outside the loop
   (the start of a running sum, the loop's results). An equation reading values of several
   microbatches belongs to the latest of them (so the running sum of gradients
   moves from one microbatch's backward fragment to the next); one reading none
   belongs to the microbatch all its users agree on, or to none (work outside the
   loop, such as slicing the batch into microbatches, and a cut of a program input:
   computed once per step, not once per microbatch).
6. Cheap equations are cloned into every stage that uses them instead of being
   transferred: those computed from literals alone (constants, ``iota``, broadcasts
   of literals, a jitted helper building a mask from them), shape or type changes
   of a small value (broadcasting a global norm to a gradient's shape), and, outside
   the pipeline's own work, elementwise and shape work making a value larger than what
   it is computed from (an attention mask or a rotary position table built from a
   microbatch's tokens), which therefore move the small values, never the large result.

The rules are steps a test can run alone on a :func:`placement_state`:
:func:`follow_operands` (rule 2), :func:`follow_users` (rule 3), :func:`place_cuts`,
:func:`place_by_bytes` and :func:`place_by_min_cut` (rule 4: a cut of an input; the
optimizer, a tied weight's summed gradient) and :func:`clone_small_values` (rule 6);
program inputs (a tied weight too) then live with their earliest user.

The transpose count of an equation is the largest count among the markers it
depends on, so the last stage's backward shares a fragment with its forward and
every earlier stage gets separate forward and backward fragments.

Program inputs live on the mesh of their earliest user, outputs on the mesh of
their producer; before anything reads an input, it counts as being where the result
fed back for it is made, and once placed equations read it, as being on their meshes
too (it is sent to a mesh once, whatever reads it there).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims
from mpmdc.passes.base import Property, register

from mpmdc import _jax_compat as compat
from mpmdc.errors import PlacementWarning
from mpmdc.ir.calls import call_body
from mpmdc.ir.feedback import fed_back, place
from mpmdc.ir.graph import DefUse, def_use, relaid_input
from mpmdc.ir.primitives import (
    LOOP,
    LoopEdge,
    is_loop_edge,
    is_loop_entry,
    is_marker,
    is_microbatch_marker,
    is_transposed_marker,
)
from mpmdc.ir.program import (
    Phase,
    Placement,
    Program,
    copy_eqn,
    is_rematerialized,
    is_var,
    make_closed_jaxpr,
    nbytes,
    placed,
    placement_of,
    substituted,
    vars_of,
)
from mpmdc.ir.sharding import bound_mesh, spec_problem

# A value of at most this many elements costs less to move than anything expanding it.
_SMALL = 64
# Equations that only change a value's shape or type: a clone next to each user costs
# nothing, and moving their small operand beats moving their (maybe large) result.
_EXPANDING = frozenset(
    {jprims.broadcast_in_dim_p, jprims.convert_element_type_p, jprims.reshape_p, jprims.squeeze_p}
)


def _is_cheap(eqn, operands, from_literals) -> bool:
    """Cloned next to each user: computed from literals alone (``from_literals`` holds
    such values), or a shape/type change of a small value; no effects or bodies.
    ``operands``: the variables ``eqn`` reads."""
    constant = all(a in from_literals for a in operands)
    candidate = constant or (
        eqn.primitive in _EXPANDING
        and all(a in from_literals or math.prod(a.aval.shape) <= _SMALL for a in operands)
    )
    # (The structural tests last: few equations get past the first.) A call computing a
    # constant (a jitted helper building a causal mask) is recomputed where it is used,
    # like the constant it is, and so is a `shard_map` of no operands on no mesh of
    # devices (the constants JAX lifts out of one: `jax.nn.gelu`'s, per device); loops
    # and conditionals stay where they are placed, and work bound to a mesh (a
    # constraint on a constant cotangent) runs there alone.
    return (
        candidate
        and not (is_marker(eqn) or is_microbatch_marker(eqn) or is_loop_edge(eqn) or eqn.effects)
        and bound_mesh(eqn) is None
        and (
            (constant and (call_body(eqn) is not None or eqn.primitive is compat.shard_map_p))
            or not any(True for _ in jcore.jaxprs_in_params(eqn.params))
        )
    )


def _seed_stage(eqn) -> int | None:
    """The stage a marker names, or that ``split-scans`` placed one of its scans in."""
    if is_marker(eqn):
        return eqn.params["stage"]
    placement = placement_of(eqn)
    return None if placement is None else placement.stage


def _transpose_counts(eqns, flow: DefUse):
    reads, producer, users = flow.reads, flow.producer, flow.readers
    counts = []
    for i, eqn in enumerate(eqns):
        t = max((counts[producer[a]] for a in reads[i] if a in producer), default=0)
        if is_marker(eqn):
            t = max(t, eqn.params["transpose"])
        counts.append(t)
    # Recomputation from a checkpoint runs with the backward work that reads it, so a
    # checkpoint keeps saving only its inputs (and what its policy saves) across a stage.
    for i in reversed(range(len(eqns))):
        if is_rematerialized(eqns[i]) and not is_marker(eqns[i]):
            # (A marker's count is its own, not that of the work feeding it.)
            later = [
                counts[j]
                for v in eqns[i].outvars
                for j in users.get(v, ())
                if not is_marker(eqns[j])
            ]
            if later:
                counts[i] = max(counts[i], min(later))
    return counts


def _mesh_bound_stages(program: Program, eqns) -> dict[int, list[int]]:
    """For each top-level equation bound to a mesh (``bound_mesh``): the stages on it.

    Such an equation can only run on its mesh, but the placement rules follow data: its
    operand may come from another stage, and its transpose reads only cotangents, which
    may come from any stage. A mesh has stages even where no marker names them.
    """
    if program.stage_to_mesh:
        stages = range(len(program.stage_to_mesh))
    else:  # stage s runs on mesh s % len(meshes)
        marked = [s for s in map(_seed_stage, eqns) if s is not None]
        stages = range(max(len(program.meshes), max(marked, default=0) + 1))
    out = {}
    for i, eqn in enumerate(eqns):
        if (mesh := bound_mesh(eqn)) is not None:
            ids = mesh.device_ids.tolist()
            out[i] = [
                s
                for s in stages
                if program.meshes[program.mesh_of_stage(s)].device_ids.tolist() == ids
            ]
    return out


class PlacementState:
    """What the placement steps (:func:`follow_operands`, :func:`follow_users`,
    :func:`place_by_bytes`) read and decide: ``stage[i]`` is equation ``i``'s stage
    (``None`` until placed; always ``None`` for cheap equations, which
    :func:`clone_small_values` clones later); ``transpose[i]`` its transpose count.
    Markers and equations bound to one mesh (``shard_map``s) start placed (rule 1)."""

    def __init__(self, program, eqns, flow: DefUse, cheap, transpose, microbatch, mesh_bound):
        self.program, self.eqns, self.flow, self.reads = program, eqns, flow, flow.reads
        self.producer, self.users, self.cheap = flow.producer, flow.readers, cheap
        self.transpose, self.microbatch = transpose, microbatch
        # (index of an equation bound to a mesh -> the stages on it: one seeds its stage.)
        self.mesh_bound = mesh_bound
        seeds = {i: on_mesh[0] for i, on_mesh in mesh_bound.items() if len(on_mesh) == 1}
        self.seeded = list(map(_seed_stage, eqns))  # (the stage of each marker or stage scan)
        self.stage = [s if s is not None else seeds.get(i) for i, s in enumerate(self.seeded)]
        self.default = min((s for s in self.seeded if s is not None), default=0)
        self.returned = set(vars_of(program.jaxpr.jaxpr.outvars))
        self.fed_back = fed_back(program)
        self.feeds = {result: v for v, result in self.fed_back.items()}
        self.depends, self.prepares = self.pipeline_work()

    def mesh(self, stage: int) -> int:
        return self.program.mesh_of_stage(stage)

    def place(self, i, stage) -> bool:
        """Put equation ``i`` in ``stage`` (``None``: leave it unplaced); whether it was
        placed. An equation bound to a mesh (a ``shard_map``, a sharding constraint) can
        only run there: placed on a stage of another mesh, it goes to a stage of its own
        that its operands or users are in, else the first, before anything follows it
        there."""
        on_mesh = self.mesh_bound.get(i)
        if stage is not None and on_mesh and stage not in on_mesh:
            near = [self.stage[self.producer[a]] for a in self.reads[i] if a in self.producer]
            near += [self.stage[j] for v in self.eqns[i].outvars for j in self.users.get(v, ())]
            stage = next((s for s in near if s in on_mesh), on_mesh[0])
        self.stage[i] = stage
        return stage is not None

    @staticmethod
    @functools.cache
    def key(stage: int, transpose: int):
        return Placement(stage, transpose).order_key()

    def placed_users(self, v):
        """Placed equations reading ``v``, looking through cheap ones (their clones go
        where their users are)."""
        for j in self.users.get(v, ()):
            if j in self.cheap:
                for w in self.eqns[j].outvars:
                    yield from self.placed_users(w)
            elif self.stage[j] is not None:
                yield j

    def present(self, v) -> set[int]:
        """The meshes ``v`` is (or will be) on: its producer's and its placed users';
        a program input's is where it lives, with its earliest placed user, or before
        anything reads it where the result fed back for it
        (:func:`~mpmdc.ir.feedback.fed_back`) is made, and its placed users' (it is sent
        to a mesh once, whatever reads it there); a cotangent leaving a stage's backward
        is also where it goes (:meth:`sent_back_to`)."""
        j = self.producer.get(v)
        out = {self.mesh(self.stage[k]) for k in self.placed_users(v)}
        if j is None:
            home = self.lives_with(v)
            return out if home is None else out | {self.mesh(self.stage[home])}
        if self.stage[j] is not None:
            out.add(self.mesh(self.stage[j]))
        if is_transposed_marker(self.eqns[j]):  # (a cotangent goes where it is sent back to)
            out.update(self.mesh(self.stage[k]) for k in self.sent_back_to(j, v))
        return out

    def lives_with(self, v):
        """The placed equation whose mesh holds program input ``v``: its :meth:`home`, or
        before anything reads it the one making the result fed back for it
        (:func:`~mpmdc.ir.feedback.fed_back`); ``None`` if neither is placed."""
        home = self.home(v)
        if home is not None:
            return home
        j = self.producer.get(self.fed_back.get(v))
        return None if j is None or self.stage[j] is None else j

    def earliest(self, js):
        """The earliest in pipeline order of the placed equations ``js``, or ``None``."""
        return min(js, key=lambda j: self.key(self.stage[j], self.transpose[j]), default=None)

    def home(self, v):
        """The earliest placed user of program input ``v`` (whose mesh will hold it), or ``None``."""
        return self.earliest(self.placed_users(v))

    def operands(self, i, inputs: bool):
        """The values ``i`` reads that cost bytes to move, looking through cheap operands
        (a clone reads its own operands where it runs); program inputs and constants
        only if ``inputs``."""
        out = []
        for a in self.reads[i]:
            j = self.producer.get(a)
            if j in self.cheap:
                out += self.operands(j, inputs)
            elif j is not None or inputs:
                out.append(a)
        return list(dict.fromkeys(out))

    def cheapest(self, i, candidates: dict, with_users: bool):
        """The candidate stage where running ``i`` moves the fewest bytes: operands not
        already on its mesh and, ``with_users``, results its placed users read elsewhere.
        First, though, a returned update it makes stays where the next call reads it
        (:meth:`read_next`): moved back, it would hold up every call's start, where an
        operand moved inside the step overlaps other work. ``candidates`` maps each stage
        to the highest rank of the equations that suggested it; ties go to the higher
        rank, then to the latest placement in pipeline order (``i``'s transpose count in
        each candidate stage)."""
        if len(candidates) == 1:  # (most of the pipeline's work: nothing to weigh)
            return next(iter(candidates))
        operands = [(a, self.present(a)) for a in self.operands(i, inputs=with_users)]
        homes = [(v, self.read_next(i, v)) for v in self.eqns[i].outvars]
        outputs = [
            (
                v,
                ({self.mesh(self.stage[j]) for j in self.placed_users(v)} if with_users else set())
                | where,
            )
            for v, where in homes
        ]
        # Inside the microbatch loop a program input is moved once for every microbatch,
        # a result once per microbatch.
        shared = (self.program.microbatches or 1) if self.microbatch[i] is not None else 1

        def size(a):
            return nbytes(a.aval) / (shared if a not in self.producer else 1)

        def cost(s):
            m = self.mesh(s)
            moved = sum(size(a) for a, where in operands if m not in where)
            return moved + sum(nbytes(v.aval) * len(where - {m}) for v, where in outputs)

        def away(s):
            """Bytes of returned updates made away from where the next call reads them:
            moved before that call can start (nothing overlaps them), every call."""
            m = self.mesh(s)
            return sum(nbytes(v.aval) for v, where in homes if where and m not in where)

        def order(s):  # the later a placement comes in the pipeline, the smaller
            return tuple(-k for k in self.key(s, self.transpose[i]))

        return min(candidates, key=lambda s: (away(s), cost(s), -candidates[s], order(s)))

    def homes_read_next(self, i, v) -> list[int]:
        """The homes (:meth:`home`) of the inputs ``i`` reads (through cheap operands, such
        as a cast) whose new value ``v`` is: a result of ``i`` the program returns (or
        chooses to return, :meth:`returned_as`), of such an input's type (a parameter's
        update). The next call reads ``v`` there; placing ``i`` elsewhere moves ``v``
        back at every call."""
        result = self.returned_as(v)
        if result is None:
            return []
        homes = [
            home
            for a in self.operands(i, inputs=True)
            if a not in self.producer
            and (a.aval.shape, a.aval.dtype) == (v.aval.shape, v.aval.dtype)
            and (home := self.home_ahead(a)) is not None
        ]
        # A result made from pieces (a layer stack kept whole, its rows updated per
        # stage and joined) is read next where the input it is fed back for will live.
        fed = self.feeds.get(result)
        if not homes and fed is not None and (home := self.home_ahead(fed)) is not None:
            homes.append(home)
        return homes

    def returned_as(self, v):
        """The result the program returns for ``v``: ``v``, or what a ``select_n``
        choosing ``v`` returns (the update of a skip-step conditional, which
        ``cond-fission`` makes a choice between the state and its update); ``None``
        if neither."""
        while v not in self.returned:
            chosen = [
                j
                for j in self.users.get(v, ())
                if self.eqns[j].primitive is jprims.select_n_p and v in self.eqns[j].invars[1:]
            ]
            if len(chosen) != 1:
                return None
            (v,) = self.eqns[chosen[0]].outvars
        return v

    def home_ahead(self, v):
        """The :meth:`home` of program input ``v``, or while nothing reading it is placed,
        the earliest placed user of what those readers make (the rows of a stack kept
        whole, read by each stage), else the home of its kin (:func:`_input_kin`: the
        parameter of an optimizer state that only its update reads) where they agree:
        where it will live."""
        home = self.home(v)
        if home is not None:
            return home
        home = self.earliest(
            k
            for j in self.users.get(v, ())
            if j not in self.cheap and self.stage[j] is None
            for w in self.eqns[j].outvars
            for k in self.placed_users(w)
        )
        if home is not None:
            return home
        homes = self.kin_homes(v)
        return homes[0] if len({self.stage[h] for h in homes}) == 1 else None

    def settled_kin(self, v, unsettled) -> list[int]:
        """The :meth:`kin_homes` of ``v`` outside ``unsettled`` where they are all on one
        mesh, else ``[]``: where ``v`` belongs while the work on it is still being
        placed."""
        homes = self.kin_homes(v, unsettled)
        return homes if len({self.mesh(self.stage[h]) for h in homes}) == 1 else []

    def kin_homes(self, v, unsettled=()) -> list[int]:
        """The :meth:`home` s, outside ``unsettled``, of the kin of program input ``v``
        (:func:`_input_kin`: the parameter of an optimizer state)."""
        return [
            h for k in self.kin.get(v, ()) if (h := self.home(k)) is not None and h not in unsettled
        ]

    @functools.cached_property
    def kin(self) -> dict:
        """:func:`_input_kin` of the program (made when first asked for)."""
        return _input_kin(self.program)

    def homeless_state(self, i) -> int:
        """Bytes of the largest program input that ``i`` reads (itself or through unplaced
        work on program inputs alone, such as ``0.9 * momentum``), updates (returns a
        result of its type, :meth:`returned_as`) and no placed equation reads yet; 0 if
        none."""
        types = {
            (v.aval.shape, v.aval.dtype)
            for v in self.eqns[i].outvars
            if self.returned_as(v) is not None
        }
        if not types:
            return 0
        found, todo, seen = 0, [i], {i}
        while todo:
            for a in self.operands(todo.pop(), inputs=True):
                j = self.producer.get(a)
                if j is None:
                    if (a.aval.shape, a.aval.dtype) in types and self.home(a) is None:
                        found = max(found, nbytes(a.aval))
                elif self.stage[j] is None and j not in self.depends and j not in seen:
                    seen.add(j)
                    todo.append(j)
        return found

    def read_next(self, i, v) -> set[int]:
        """The meshes of :meth:`homes_read_next`."""
        return {self.mesh(self.stage[j]) for j in self.homes_read_next(i, v)}

    def suggest(self, candidates: dict, js, rank: int = 0) -> None:
        """Add the stages of the placed equations ``js`` to ``candidates``; on equal
        costs a higher ``rank`` wins (:meth:`cheapest`)."""
        for j in js:
            stage = self.stage[j]
            candidates[stage] = max(rank, candidates.get(stage, rank))

    def from_operands(self, i, through_boundaries: bool):
        """Rule 2: a stage for ``i`` from its placed operands, or ``None``. Before
        ``through_boundaries``, cotangents leaving a stage's backward suggest nothing;
        after, so do the other places their values go."""
        candidates: dict = {}
        sent = []  # (the transposed markers whose cotangents ``i`` reads, and each cotangent)
        residuals = []  # (the stages of values of an earlier transpose count ``i`` reads)
        operands = self.operands(i, inputs=False)
        placed = waiting = 0  # bytes of the largest operand placed / not placed yet
        for a in operands:
            j = self.producer[a]
            if self.stage[j] is None:
                if j in self.depends:  # (work reading inputs alone follows its users)
                    waiting = max(waiting, nbytes(a.aval))
            elif not is_transposed_marker(self.eqns[j]):
                self.suggest(candidates, [j])
                placed = max(placed, nbytes(a.aval))
                if self.transpose[j] < self.transpose[i]:
                    residuals.append(self.stage[j])
            elif through_boundaries:
                sent.append((j, a))
                placed = max(placed, nbytes(a.aval))
            else:  # a cotangent leaving a stage's backward: where it goes is not known yet
                waiting = max(waiting, nbytes(a.aval))
        # A cotangent leaves its marker's stage for earlier ones: work reading it and a
        # residual of an earlier stage's forward (a dropout mask) is that stage's
        # backward, where the cotangent goes anyway. Otherwise (a later stage's cotangent
        # summed with it: a skip connection, whose last-stage backward shares the
        # forward's transpose count) the stages compete by bytes.
        leaving = [j for j, _ in sent]
        if not (leaving and residuals and min(residuals) < min(self.stage[j] for j in leaving)):
            self.suggest(candidates, leaving)
            # ... and where it goes: with nothing else placed to weigh (a bare sharding
            # constraint's transpose, reading the cotangent alone), it runs there, not
            # as a fragment of its own in the later stage's backward.
            for j, a in sent:
                self.suggest(candidates, self.sent_back_to(j, a))
        # A small placed operand (a global norm) does not decide for a large one whose
        # place is not known yet, nor for the update of a state input nothing else
        # reads (the momentum of a parameter whose gradient is zero): that waits for
        # rule 4, which places it with its users (the parameter's update).
        if not candidates or waiting >= placed or self.homeless_state(i) > placed:
            return None
        if through_boundaries:
            for a in operands:
                self.suggest(candidates, (j for j in self.placed_users(a) if j != i))
        # A parameter's new value may go where the parameter lives, which the next call reads.
        for v in self.eqns[i].outvars:
            self.suggest(candidates, self.homes_read_next(i, v))
        return self.cheapest(i, candidates, with_users=False)

    def made_by(self, v) -> list[int]:
        """The placed equations ``v`` is made by, looking through cheap ones."""
        j = self.producer.get(v)
        if j is None:
            return []
        if j not in self.cheap:
            return [j]
        return [k for a in self.reads[j] for k in self.made_by(a)]

    @functools.cached_property
    def forward_markers(self) -> dict[int, list[int]]:
        """``{stage: the forward markers into it}``."""
        out: dict = {}
        for m, eqn in enumerate(self.eqns):
            if is_marker(eqn) and not is_transposed_marker(eqn):
                out.setdefault(eqn.params["stage"], []).append(m)
        return out

    def sent_back_to(self, j, v) -> list[int]:
        """The placed forward equations making the value whose cotangent ``v`` is, an
        output of transposed marker ``j``: what the forward markers of ``j``'s stage
        (of its operands' types) mark in ``v``'s place. ``v`` goes to their stages'
        backward."""
        outs = self.eqns[j].outvars
        position, types = outs.index(v), [(o.aval.shape, o.aval.dtype) for o in outs]
        found = []
        for m in self.forward_markers.get(self.eqns[j].params["stage"], ()):
            marked = self.eqns[m].invars
            if [(a.aval.shape, a.aval.dtype) for a in marked] == types and is_var(
                a := marked[position]
            ):
                found += [k for k in self.made_by(a) if self.transpose[k] % 2 == 0]
        return found

    def from_users(self, i):
        """Rule 3: the earliest stage among ``i``'s placed users, or ``None``."""
        j = self.earliest(j for v in self.eqns[i].outvars for j in self.placed_users(v))
        return None if j is None else self.stage[j]

    def settle(self, members, through_boundaries: bool) -> None:
        """Rule 2 over ``members`` and rule 3 over those preparing a marker's input,
        until nothing changes."""
        changed = True
        while changed:
            changed = follow_operands(self, members, through_boundaries)
            changed |= follow_users(self, members)

    def cuts(self) -> dict:
        """``{equation: program input}`` of the equations outside any loop that make a
        smaller value of one program input alone (:func:`_cuts_an_input`: a stage's rows
        of a layer stack kept whole on one mesh), and of those laying the input out
        otherwise for them (moving its layer axis first)."""
        out = {}
        for i, eqn in enumerate(self.eqns):
            if (
                self.stage[i] is None
                and self.microbatch[i] is None
                and i not in self.cheap
                and _cuts_an_input(eqn, self.reads[i], self.eqns, self.producer)
            ):
                out[i] = relaid_input(self.reads[i][0], self.eqns, self.producer)
                v = self.reads[i][0]
                while (j := self.producer.get(v)) is not None:
                    if self.stage[j] is None and j not in self.cheap:
                        out[j] = out[i]
                    v = self.reads[j][0]
        return out

    def pipeline_work(self) -> tuple[set[int], set[int]]:
        """The equations that depend on a marker (the pipeline's own work), and those
        whose results reach a forward marker without depending on one (what prepares
        its inputs, such as an embedding lookup)."""
        depends, depending = set(), set()  # (equations, and the values they define)
        for i, eqn in enumerate(self.eqns):
            if self.seeded[i] is not None or not depending.isdisjoint(self.reads[i]):
                depends.add(i)
                depending.update(eqn.outvars)
        # (A forward marker, or an equation reaching one.)
        reaching = {
            j for j, e in enumerate(self.eqns) if is_marker(e) and not is_transposed_marker(e)
        }
        prepares = set()
        for i in reversed(range(len(self.eqns))):
            if any(j in reaching for v in self.eqns[i].outvars for j in self.users.get(v, ())):
                prepares.add(i)
                reaching.add(i)
        return depends - self.cheap, prepares - depends - self.cheap

    def run(self) -> list:
        """Stage per equation index."""
        cuts = self.cuts()
        for t in sorted(set(self.transpose)):
            members = [
                i
                for i in sorted(self.depends | self.prepares)
                if self.stage[i] is None and self.transpose[i] == t and i not in cuts
            ]
            self.settle(members, through_boundaries=False)
            # Still unplaced: a cotangent leaving a stage's backward is the best hint left.
            self.settle(members, through_boundaries=True)
            # As soon as their users are placed (the forward's, for a parameter): where
            # an input lives must be known when its gradient's sum is placed.
            place_cuts(self, cuts)
        rest = [i for i, s in enumerate(self.stage) if s is None and i not in self.cheap]
        place_by_bytes(self, rest)
        for i in rest:
            if self.stage[i] is None:
                self.place(i, self.default)
        place_by_min_cut(self, self.after_loop())
        return self.stage

    def after_loop(self) -> list[int]:
        """The equations that may run on any mesh after the microbatch loop (the optimizer,
        a tied weight's summed gradient) and the work on program inputs that only they
        read (a state's rows): neither reaching a marker or the loop nor reading the
        pipeline's work but through the loop's results. (Without a loop, the pipeline's
        work reaches the step's end: a parameter's gradient is made there.)"""
        piped = set()  # (values the pipeline's work makes, up to the loop's results)
        for i, eqn in enumerate(self.eqns):
            if is_loop_edge(eqn) or is_microbatch_marker(eqn):
                continue
            if self.seeded[i] is not None or not piped.isdisjoint(self.reads[i]):
                piped.update(eqn.outvars)
        feeding = set()  # (equations whose results reach a marker or the loop)
        for i in reversed(range(len(self.eqns))):
            eqn = self.eqns[i]
            if (
                is_marker(eqn)
                or is_loop_edge(eqn)
                or self.seeded[i] is not None
                or self.microbatch[i] is not None
                or any(j in feeding for v in eqn.outvars for j in self.users.get(v, ()))
            ):
                feeding.add(i)
        return [
            i
            for i, eqn in enumerate(self.eqns)
            if i not in feeding
            and piped.isdisjoint(self.reads[i])
            and i not in self.cheap
            and i not in self.mesh_bound
            and not eqn.effects
        ]


def follow_operands(state: PlacementState, members, through_boundaries: bool) -> bool:
    """Rule 2, a step of :func:`partition`: each unplaced equation of ``members`` whose
    placed operands suggest a stage runs there (:meth:`PlacementState.from_operands`).
    One sweep; whether it placed anything."""
    changed = False
    for i in members:
        if state.stage[i] is None:
            changed |= state.place(i, state.from_operands(i, through_boundaries))
    return changed


def follow_users(state: PlacementState, members) -> bool:
    """Rule 3, a step of :func:`partition`: each unplaced equation of ``members`` that
    prepares a marker's input (an embedding lookup) runs with its earliest placed user.
    One sweep, last equation first; whether it placed anything."""
    changed = False
    for i in reversed(members):
        if state.stage[i] is None and i in state.prepares:
            changed |= state.place(i, state.from_users(i))
    return changed


def place_cuts(state: PlacementState, cuts: dict) -> None:
    """Rule 4's first step, a step of :func:`partition`: a cut of a program input not
    placed yet (``cuts``, of :meth:`PlacementState.cuts`) runs where the input lives,
    with its earliest user otherwise placed, or the earliest user of any of its cuts:
    the cut, smaller than the input, is what moves. So each mesh running stages of a
    layer stack kept whole on another receives its stages' rows once per step, not the
    stack."""
    by_input: dict = {}
    for i, a in cuts.items():
        if state.stage[i] is None:
            by_input.setdefault(a, []).append(i)
    for a, members in by_input.items():
        home = state.lives_with(a)
        if home is None:
            users = [
                j for i in members for v in state.eqns[i].outvars for j in state.placed_users(v)
            ]
            home = state.earliest(users)
        if home is not None:
            for i in members:
                state.place(i, state.stage[home])


def place_by_bytes(state: PlacementState, members) -> None:
    """Rule 4, a step of :func:`partition`: ``members`` (equations reading only program
    inputs and free-standing values: the optimizer, a tied weight's summed gradient)
    run where their operands and users cost the fewest bytes to move, a parameter's
    update where the parameter lives; they join the fragment of their earliest user
    (its transpose count)."""

    unsettled = frozenset(members)

    def candidates(i, patient: bool):
        out: dict = {}
        placed = waiting = 0  # bytes of the largest operand placed / not placed yet
        homed = False  # whether a program input it reads lives somewhere
        for a in state.operands(i, inputs=True):
            j = state.producer.get(a)
            if j is None:
                # On equal costs a parameter's update goes where the parameter lives (or,
                # before anything reads it, where its new value is made), and a state's
                # where its parameter lives...
                home = state.lives_with(a)
                homes = state.settled_kin(a, unsettled) if home is None else [home]
                state.suggest(out, homes, rank=2)
                homed |= bool(homes)
                continue
            if state.stage[j] is not None:
                state.suggest(out, [j])
                placed = max(placed, nbytes(a.aval))
            else:
                waiting = max(waiting, nbytes(a.aval))
            state.suggest(out, (k for k in state.placed_users(a) if k != i))
        # ...and other work to its users, like rule 3.
        users = [j for v in state.eqns[i].outvars for j in state.placed_users(v)]
        # A small placed operand (a global norm, a bias correction) does not decide for a
        # larger one whose place is not known yet, nor for an input only this work reads
        # (the momentum of a parameter whose gradient is zero): the work waits for its
        # users (the parameter's update, which goes where the parameter lives).
        held = max(waiting, state.homeless_state(i))
        if patient and not users and not homed and held > placed:
            return {}
        state.suggest(out, users, rank=1)
        return out

    for patient in (True, False):
        changed = True
        while changed:
            changed = False
            for order in (members, members[::-1]):
                for i in order:
                    if state.stage[i] is None and (found := candidates(i, patient)):
                        state.place(i, state.cheapest(i, found, with_users=True))
                        changed = True
    for i in reversed(members):
        # (A user inside the microbatch loop has a fragment per microbatch, which
        # all share one body: nothing from outside joins it.)
        later = [
            state.transpose[j]
            for v in state.eqns[i].outvars
            for j in state.users.get(v, ())
            if j not in state.cheap and state.microbatch[j] == state.microbatch[i]
        ]
        if later:
            state.transpose[i] = max(state.transpose[i], min(later))


class _Net(NamedTuple):
    """A value's bytes moved per step: to every mesh among its equations' (its producer
    and its users) and ``pins`` (meshes it must reach anyway) but the first, so
    ``weight * (meshes - 1)``; ``scalar`` if it has one element."""

    weight: int
    eqns: tuple[int, ...]
    pins: frozenset[int]
    scalar: bool


def _nets(state: PlacementState, members) -> list[_Net]:
    """The values the equations ``members`` read or make (looking through cheap
    equations, whose clones run beside their users), each as a :class:`_Net`. Where
    ``members`` make a result fed back for a program input (a parameter's new value) or
    read that input, one more joins its makers and the input's readers and weighs more
    than all the others together: made away from where the input lives, the result
    moves at the start of every call, where nothing overlaps it. An optimizer state's
    is pinned to its parameter's mesh: the cut would otherwise move a momentum to where
    its gradient is made to save a scalar, and the state would live away from its
    parameter."""
    values = {a: None for i in members for a in state.operands(i, inputs=True)}
    values.update((v, None) for i in members for v in state.eqns[i].outvars)
    wanted = state.program.wanted_out_meshes
    outputs = state.program.jaxpr.jaxpr.outvars
    pinned = {}
    if wanted is not None:
        pinned = {v: {m} for v, m in zip(outputs, wanted) if m is not None and is_var(v)}
    nets = []
    for v in values:
        j = state.producer.get(v)
        made = () if j is None else (j,)
        nets.append(
            _Net(
                nbytes(v.aval),
                made + tuple(state.placed_users(v)),
                frozenset(pinned.get(v, ())),
                math.prod(v.aval.shape) == 1,
            )
        )
    heavy = 1 + sum(net.weight for net in nets)
    for v, result in state.fed_back.items():
        makers, readers = state.made_by(result), list(state.placed_users(v))
        if members.isdisjoint(makers + readers):
            continue
        scalar = math.prod(v.aval.shape) == 1
        # The input lives with its earliest reader: where that stays put, the result is
        # tied to its mesh; where the cut may move it, to every reader, and an optimizer
        # state to the mesh where its parameter (its kin) stays put.
        home = state.earliest(readers)
        if home is not None and home not in members:
            pins, found = frozenset({state.mesh(state.stage[home])}), tuple(makers)
        else:
            kin = {state.mesh(state.stage[h]) for h in state.settled_kin(v, members)}
            pins, found = frozenset(kin), (*makers, *readers)
        nets.append(_Net(nbytes(v.aval) * heavy, found, pins, scalar))
    return nets


def place_by_min_cut(state: PlacementState, members) -> None:
    """Rule 4's last step, a step of :func:`partition`: the equations ``members`` (the work
    after the microbatch loop, :meth:`PlacementState.after_loop`) move between each two
    meshes wherever a minimum cut moves fewer bytes per step in all. Placed one
    equation at a time, a chain can look as cheap on either mesh at every step and
    cost more in all: a stage's rows of a layer stack kept whole, whose update reads
    the gradient's rows on the stage's mesh and the parameter's and optimizer state's
    rows where the stack lives, then sends the new rows back."""
    members = set(members)
    nets = _nets(state, members)
    touching: dict = {}
    for k, net in enumerate(nets):
        for j in net.eqns:
            touching.setdefault(j, []).append(k)
    # (One pass: a second finds little to move, at the cost of the first.)
    for pair, spanning in _spanned_pairs(state, members, nets).items():
        _swap(state, members, nets, touching, pair, spanning)


def _spanned_pairs(state: PlacementState, members, nets: list[_Net]) -> dict:
    """``{(a, b): nets}``: the pairs of meshes running stages that nets of more than one
    element span other than through equations that stay where they are (a parameter
    read on two meshes), and those nets: only there can a cut save more than scalars'
    bytes."""
    staged = {state.mesh(s) for s in state.stage if s is not None}
    pairs: dict = {}
    for k, net in enumerate(nets):
        if net.scalar:
            continue
        fixed = {state.mesh(state.stage[j]) for j in net.eqns if j not in members} | net.pins
        where = fixed | {state.mesh(state.stage[j]) for j in net.eqns if j in members}
        for pair in itertools.combinations(sorted(where & staged), 2):
            if not fixed.issuperset(pair):
                pairs.setdefault(pair, []).append(k)
    return pairs


def _swap(state: PlacementState, members, nets: list[_Net], touching: dict, pair, spanning):
    """Move ``members`` placed on the meshes ``pair`` between the two as a minimum cut of
    the :class:`_Net` s says, if that moves fewer bytes. Only those joined to the
    ``spanning`` nets through nets of more than one element take part (the rest, joined
    to them by scalars alone, could save scalars' bytes). A net of two equations is an
    edge of its weight; a larger one two nodes joined by its weight, each of its
    equations tied to both (Lawler's construction)."""
    import networkx as nx  # (here, not at the top: it is a tenth of `import mpmdc`)

    a, b = pair
    on_pair = {i for i in members if state.mesh(state.stage[i]) in pair}
    free = {j for k in spanning for j in nets[k].eqns if j in on_pair}
    todo = list(free)
    while todo:
        for k in touching.get(todo.pop(), ()):
            if not nets[k].scalar:
                found = [j for j in nets[k].eqns if j in on_pair and j not in free]
                free.update(found)
                todo += found
    graph = nx.DiGraph()
    graph.add_nodes_from(pair)
    before = 0  # (bytes of the nets the cut decides, as placed now)
    for k in {k for i in free for k in touching[i]}:
        net = nets[k]
        where = {state.mesh(state.stage[j]) for j in net.eqns if j not in free} | net.pins
        loose = [j for j in net.eqns if j in free]
        ends = [m for m in pair if m in where]
        if len(loose) + len(ends) < 2:
            continue
        split = {state.mesh(state.stage[j]) for j in loose} | set(ends) == set(pair)
        before += net.weight * split
        nodes = [("eqn", j) for j in loose] + ends
        if len(nodes) == 2:
            graph.add_edge(*nodes, capacity=net.weight)
            graph.add_edge(*nodes[::-1], capacity=net.weight)
            continue
        graph.add_edge(("in", k), ("out", k), capacity=net.weight)
        for node in nodes:
            graph.add_edge(node, ("in", k))
            graph.add_edge(("out", k), node)
    residual = nx.flow.boykov_kolmogorov(graph, a, b)
    if residual.graph["flow_value"] >= before:
        return
    # An equation the cut puts on either side at the same cost stays where it is: the
    # sides moved to are what ``a`` reaches and what reaches ``b`` by unsaturated edges.
    sides = {a: _unsaturated_reach(residual.succ, a), b: _unsaturated_reach(residual.pred, b)}
    for i in sorted(free):
        for m, side in sides.items():
            if ("eqn", i) in side and state.mesh(state.stage[i]) != m:
                state.stage[i] = _stage_on(state, i, m)


def _unsaturated_reach(edges, start) -> set:
    """The nodes ``start`` reaches by edges (``edges``: a residual network's successors,
    or its predecessors to go against them) with capacity left."""
    seen, todo = {start}, [start]
    while todo:
        for node, edge in edges[todo.pop()].items():
            if node not in seen and edge["flow"] < edge["capacity"]:
                seen.add(node)
                todo.append(node)
    return seen


def _stage_on(state: PlacementState, i: int, mesh: int) -> int:
    """The stage on ``mesh`` for equation ``i``: that of its operands' producers and
    users there latest in pipeline order, else the mesh's first."""
    near = [state.producer[a] for a in state.operands(i, inputs=False)]
    near += [j for v in state.eqns[i].outvars for j in state.placed_users(v)]
    stages = {state.stage[j] for j in near if state.mesh(state.stage[j]) == mesh}
    if stages:
        return max(stages, key=lambda s: state.key(s, state.transpose[i]))
    return min(s for s in set(state.stage) if s is not None and state.mesh(s) == mesh)


def _infer_microbatches(eqns, flow: DefUse, cheap):
    """Microbatch per equation index (``None`` outside an ``accumulate`` loop and for
    cheap ones; ``LOOP`` inside a rolled loop's iteration).

    A loop edge entering the loop (``SLICE``, ``CARRY``) is outside it and what reads its
    output is inside; one leaving it (``RESULT``, ``STACK``) belongs to what it reads (so
    a cheap value computed for it, a loss broadcast to be stacked, is cloned inside the
    loop), and so is an equation with effects (a callback)
    traced between the batch's slices and the first carry, where ``accumulate`` traced
    its function: it runs once per microbatch, as under ``jax.jit``, whatever it reads."""
    reads, producer, users = flow.reads, flow.producer, flow.readers
    microbatch: list[int | str | None] = [None] * len(eqns)
    slices = [i for i, e in enumerate(eqns) if is_loop_edge(e, LoopEdge.SLICE)]
    after = [i for i, e in enumerate(eqns) if is_loop_edge(e) and i > slices[-1]] if slices else []
    traced_inside = range(slices[-1], after[0] if after else len(eqns)) if slices else range(0)
    for i, eqn in enumerate(eqns):
        if is_microbatch_marker(eqn):
            microbatch[i] = eqn.params["index"]
        elif is_loop_entry(eqn):
            continue
        elif any(a in producer and is_loop_entry(eqns[producer[a]]) for a in reads[i]) or (
            eqn.effects and i in traced_inside
        ):
            microbatch[i] = LOOP
        else:  # cheap equations too, so values flow through them (their clones go with their users)
            # (What leaves the loop through an edge is outside it.)
            found = [
                microbatch[producer[a]]
                for a in reads[i]
                if a in producer and not is_loop_edge(eqns[producer[a]])
            ]
            microbatch[i] = max((m for m in found if m is not None), default=None, key=_order)
    for i in reversed(range(len(eqns))):
        if (
            microbatch[i] is None
            and i not in cheap
            and not is_microbatch_marker(eqns[i])
            and not is_loop_edge(eqns[i])
        ):
            # Slicing the batch stays before the loop, so every microbatch's forward
            # fragment has the same body (and shares one executable).
            of_users = {
                microbatch[j]
                for v in eqns[i].outvars
                for j in users.get(v, ())
                if not is_microbatch_marker(eqns[j])
            }
            if len(of_users) == 1 and not (
                LOOP in of_users and _cuts_an_input(eqns[i], reads[i], eqns, producer)
            ):
                microbatch[i] = of_users.pop()
    return microbatch


def _cuts_an_input(eqn, operands, eqns, producer: dict) -> bool:
    """Whether ``eqn`` makes a smaller value of one program input (or constant) alone, or
    of one laid out otherwise (:func:`relaid_input`, over ``eqns``, one of them): a
    stage's rows of a layer stack kept whole on one mesh, its layer axis first or not.
    It is computed once, before the loop, where the input is, and its result moves, not
    the input."""
    return (
        len(operands) == 1
        and relaid_input(operands[0], eqns, producer) is not None
        and not eqn.effects
        and sum(nbytes(v.aval) for v in eqn.outvars) < sum(nbytes(a.aval) for a in operands)
    )


def _order(microbatch) -> int:
    # (A loop's iteration holds every microbatch; it has no others beside it.)
    return 0 if microbatch == LOOP else microbatch


def _cheap_equations(eqns, reads) -> set[int]:
    """Indices of the equations cheap enough to clone next to each user: those of
    :func:`_is_cheap`, and elementwise or shape work outside the pipeline's own work
    (:func:`_recomputed`) whose result is larger than what it is computed from."""
    cheap, from_literals = set(), set()
    pipeline: set = set()  # values that depend on a marker
    origins: dict = {}  # a cheap equation's value -> the values it is computed from
    for i, eqn in enumerate(eqns):
        in_pipeline = is_marker(eqn) or not pipeline.isdisjoint(reads[i])
        if in_pipeline:
            pipeline.update(eqn.outvars)
        sources = frozenset().union(
            *(origins.get(a, {a}) for a in reads[i] if a not in from_literals)
        )
        if _is_cheap(eqn, reads[i], from_literals):
            if all(a in from_literals for a in reads[i]):
                from_literals.update(eqn.outvars)
        elif (in_pipeline and not _from_scalars(sources)) or not _recomputed(eqn, sources):
            continue
        cheap.add(i)
        origins.update((v, sources) for v in eqn.outvars)
    return cheap


# Elementwise and shape work: computing it again next to each user costs little.
_RECOMPUTABLE = frozenset(
    {
        *_EXPANDING,
        *(
            getattr(jprims, f"{name}_p")
            for name in (
                "add sub mul div max min neg abs sign floor ceil round exp log sqrt rsqrt sin "
                "cos tanh logistic integer_pow pow and or not xor eq ne lt le gt ge select_n "
                "iota clamp"
            ).split()
        ),
    }
)


def _recomputable(eqn) -> bool:
    """Elementwise or shape work, or a call (``jnp.where``, ``jnp.tril``) of nothing else."""
    if eqn.effects:
        return False
    body = call_body(eqn)
    if body is None:
        return eqn.primitive in _RECOMPUTABLE
    return all(map(_recomputable, body[0].eqns))


def _recomputed(eqn, sources) -> bool:
    """Whether ``eqn`` (:func:`_recomputable`) makes a larger value than the ``sources``
    it is computed from through other such work: an attention mask or a position table
    built from a microbatch's tokens. Moving those values and computing it again next to
    each user moves fewer bytes than moving it."""
    if not _recomputable(eqn):
        return False
    return sum(nbytes(a.aval) for a in sources) < sum(nbytes(v.aval) for v in eqn.outvars)


def _from_scalars(sources) -> bool:
    """Whether the ``sources`` an equation is computed from (through cheap work) are all
    small values: the pipeline's work on them (a zero gradient clipped by the global
    norm) is cheaper computed again next to each user than moved."""
    return all(math.prod(a.aval.shape) <= _SMALL for a in sources)


def placement_state(program: Program) -> PlacementState:
    """The placement state of ``program``'s top-level equations before any step: markers
    and ``shard_map``s on their stages (rule 1), transpose counts and microbatches known."""
    eqns = program.jaxpr.jaxpr.eqns
    flow = def_use(eqns)
    cheap = _cheap_equations(eqns, flow.reads)
    for eqn in eqns:
        if (stage := _seed_stage(eqn)) is not None:
            program.mesh_of_stage(stage, eqn)  # a stage without a mesh fails here
    transpose = _transpose_counts(eqns, flow)
    microbatch = _infer_microbatches(eqns, flow, cheap)
    mesh_bound = _mesh_bound_stages(program, eqns)
    return PlacementState(program, eqns, flow, cheap, transpose, microbatch, mesh_bound)


def _place(state: PlacementState) -> dict[int, Placement]:
    """Rules 1-5: a placement for every equation that is not cheap."""
    stage = state.run()
    return {
        i: Placement(stage[i], state.transpose[i], state.microbatch[i])
        for i in range(len(state.eqns))
        if i not in state.cheap
    }


def _output_placements(state: PlacementState, outvars, placement) -> list[Placement | None]:
    """Each output's placement: an output made by a cheap equation (a cast of a small
    gradient) stays with what it is made from (:meth:`PlacementState.made_by`); ``None``
    for one made from nothing placed (a constant, an input returned as is)."""
    found = [[placement[j] for j in state.made_by(v)] if is_var(v) else [] for v in outvars]
    return [max(s, key=Placement.order_key) if s else None for s in found]


def _ending(path: str, *, result: bool) -> tuple[str, ...]:
    """The keys of the :func:`~mpmdc.ir.feedback.place` of ``path``, last first
    (``args[1][0].mu['w']``: ``['w']``, ``.mu``, ``[0]``)."""
    return tuple(reversed(place(path, result=result)))


def _shared(a: tuple, b: tuple) -> int:
    """How many keys two :func:`_ending` s share from the end of their paths."""
    return next((d for d, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _input_kin(program: Program) -> dict:
    """``{input: its kin}``: for each program input, the other inputs of its shape and
    dtype whose places (:func:`_ending`, below the argument) share the longest ending
    with its own (``args[1][0]['w']``, a moment, and ``args[0]['w']``, its parameter,
    share ``['w']``; a batch ``args[1]`` has no place, and no kin); for a scalar, the
    other inputs of any shape (NovoGrad's second moment of ``w`` is a scalar kept at
    ``args[1][0].nu['w']``). Other states match only their own shape: SM3 keeps a list
    of accumulators at each parameter's place, so ``mu[0][1]``, an accumulator of
    parameter ``[0]``, ends as parameter ``[1]``'s path does."""
    # (Each ending of each path -> the inputs whose paths end so: a path's kin are those
    # under its longest ending shared with another, found without comparing every pair.)
    keyed = [
        (_ending(path, result=False), v)
        for path, v in zip(program.in_paths, program.jaxpr.jaxpr.invars)
    ]
    ending_with: dict = {}
    for key, v in keyed:
        for d in range(1, len(key) + 1):
            ending_with.setdefault(key[:d], []).append(v)
    kin = {}
    for key, v in keyed:
        kind = (v.aval.shape, v.aval.dtype)
        for d in range(len(key), 0, -1):
            found = [
                other
                for other in ending_with[key[:d]]
                if other is not v
                and (kind[0] == () or (other.aval.shape, other.aval.dtype) == kind)
            ]
            if found:
                kin[v] = found
                break
    return kin


def _kin(paths: Sequence[str], known: Sequence, merge, *, result: bool) -> list:
    """For each path (of an input, or a ``result``) whose ``known`` entry is ``None``, the
    entry of the known path whose place in its pytree shares the longest ending with its
    own (:func:`_ending`: ``out[2].v_row[1]['w']`` and ``out[1][1]['w']`` share
    ``[1]['w']``; a loss ``out[1]`` has no place); where the paths with the longest ending
    disagree, ``merge`` of their entries (``None`` leaves it unknown). An
    optimizer's state mirrors its parameters' pytree: a state leaf made from no
    parameter (adafactor's placeholder for a factored moment) belongs with the
    parameter at the same place."""
    keys = [_ending(p, result=result) for p in paths]
    found = [(k, x) for k, x in zip(keys, known) if x is not None]
    out = list(known)
    for i, x in enumerate(known):
        if x is not None or not keys[i]:
            continue
        best, chosen = 0, set()
        for k, y in found:
            n = _shared(k, keys[i])
            if n > best:
                best, chosen = n, {y}
            elif n == best and n:
                chosen.add(y)
        if len(chosen) == 1:
            out[i] = chosen.pop()
        elif chosen:
            out[i] = merge(chosen)
    return out


def _earliest_of_one_stage(placements: set[Placement]) -> Placement | None:
    """The earliest of ``placements`` if they are all of one stage (a parameter read in
    its forward and its moment in its update), else ``None``."""
    if len({p.stage for p in placements}) != 1:
        return None
    return min(placements, key=Placement.order_key)


def _with_kin(placements, paths, default, *, result: bool) -> list[Placement]:
    """``placements`` (of a program's inputs or outputs) where an unplaced one (an output
    made from nothing placed, an input nobody reads) goes with its kin (:func:`_kin`;
    kin of one stage read at several places count as that stage's earliest), else with
    the earliest stage."""
    kin = _kin(paths, placements, merge=_earliest_of_one_stage, result=result)
    return [default if p is None else p for p in kin]


def clone_small_values(eqns, reads, outvars, producer, cheap, placement, out_placement):
    """Rule 6, a step of :func:`partition`: ``(equations, outputs)`` with every equation
    placed and each cheap one cloned once per placement among its (transitive) users."""
    cheap_vars = {v for i in cheap for v in eqns[i].outvars}
    needed: dict[int, set[Placement]] = {i: set() for i in cheap}
    for i in placement:
        for a in reads[i]:
            if a in cheap_vars:
                needed[producer[a]].add(placement[i])
    for v, p in zip(outvars, out_placement):
        if is_var(v) and v in cheap_vars:
            needed[producer[v]].add(p)
    for i in sorted(cheap, reverse=True):
        for a in reads[i]:
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
            env = clone_env.get(p)
            new_eqns.append(
                placed(eqn, p, **({"invars": substituted(eqn.invars, env)} if env else {}))
            )
    new_outvars = [
        substituted([v], clone_env.get(p, {}))[0] for v, p in zip(outvars, out_placement)
    ]
    return new_eqns, new_outvars


def _io_meshes(
    program, new_eqns, out_placement, default, fed_back: dict
) -> tuple[list[int], list[int]]:
    """Each input lives on the mesh of its earliest user, each output where it is made
    (an input returned as is stays where it is), unless ``out_shardings`` says; an input
    nobody reads lives where the result fed back for it is made (``fed_back``, from
    :func:`~mpmdc.ir.feedback.fed_back`: a schedule's learning rate that the step
    recomputes), else with its kin; so does one of a few elements whose result fed back
    is made on another mesh than its earliest user's."""
    jaxpr = program.jaxpr.jaxpr
    in_index = {v: k for k, v in enumerate(jaxpr.invars)}
    input_users: dict = {}
    for eqn in new_eqns:
        if read := [a for a in vars_of(eqn.invars) if a in in_index]:
            p = placement_of(eqn)
            for a in read:
                input_users.setdefault(a, []).append(p)
    made = {v: p for v, p in zip(jaxpr.outvars, out_placement) if is_var(v)}
    for v, result in fed_back.items():
        if v not in input_users and result in made:
            input_users[v] = [made[result]]
    for v, p in zip(jaxpr.outvars, out_placement):
        if is_var(v) and v in in_index and v not in input_users:
            input_users[v] = [p]
    in_placement = _with_kin(
        [
            min(input_users[v], key=Placement.order_key) if v in input_users else None
            for v in jaxpr.invars
        ],
        program.in_paths,
        default,
        result=False,
    )
    in_meshes = [program.mesh_of_stage(p.stage) for p in in_placement]
    out_meshes = [
        in_meshes[in_index[v]] if is_var(v) and v in in_index else program.mesh_of_stage(p.stage)
        for v, p in zip(jaxpr.outvars, out_placement)
    ]
    # A few elements fed back from another mesh (a counter every stage's update reads,
    # optax.MultiSteps' mini_step, whose next value the rules made with its other
    # counter) live where they are made and go to their readers within the step, rather
    # than move before every call. (Larger inputs are where their readers are: the
    # rules run the work making their result there where they can, and say where not.)
    out_index = {v: i for i, v in enumerate(jaxpr.outvars) if is_var(v)}
    wanted = program.wanted_out_meshes or (None,) * len(jaxpr.outvars)
    for v, result in fed_back.items():
        i = out_index.get(result)
        if i is not None and wanted[i] is None and math.prod(v.aval.shape) <= _SMALL:
            in_meshes[in_index[v]] = out_meshes[i]
    if program.wanted_out_meshes is not None:  # the caller's out_shardings win
        out_meshes = [m if w is None else w for m, w in zip(out_meshes, program.wanted_out_meshes)]
    return in_meshes, out_meshes


# Conditionals and loops are one equation each: where ``cond-fission`` could not cut one
# per mesh, it runs where most of its bytes are and reads the rest across meshes.
_CONTROL_FLOW = frozenset({jprims.cond_p, jprims.while_p, jprims.scan_p})


def _warn_of_control_flow_across_meshes(program, eqns, in_meshes, staged) -> None:
    """A ``PlacementWarning`` for each conditional or loop reading arrays (of more than
    a few elements: scalars and an optimizer's few coefficients cost a transfer's
    latency, not its bytes) of several meshes, other than a stage marker's activation or
    cotangent (which cross meshes by design) and a stage's scan of a layer stack (whose
    first result is in ``staged``: its loop-invariant operands are sent to it by
    design), naming the largest it reads from another mesh: placement is a result,
    never silent."""
    if not any(eqn.primitive in _CONTROL_FLOW for eqn in eqns):
        return
    jaxpr = program.jaxpr.jaxpr
    mesh_of = dict(zip(jaxpr.invars, in_meshes))
    path_of = dict(zip(jaxpr.invars, program.in_paths))
    crossing = set()  # values entering a stage: moved between meshes by design
    for eqn in eqns:
        mesh = program.mesh_of_stage(placement_of(eqn).stage)
        if eqn.primitive in _CONTROL_FLOW and eqn.outvars[0] not in staged:
            # Gathering arrays of several meshes is what no cut could avoid; reading
            # one other mesh's array is what any equation placed with its user does.
            read: dict = {}  # mesh -> the arrays read from it
            for a in eqn.invars:
                if is_var(a) and a not in crossing and math.prod(a.aval.shape) > _SMALL:
                    read.setdefault(mesh_of.get(a, mesh), []).append(a)
            if len(read) > 1:
                others = sorted(set(read) - {mesh})
                largest = max((a for m in others for a in read[m]), key=lambda a: nbytes(a.aval))
                named = f"{path_of[largest]}, " if largest in path_of else ""
                warnings.warn(
                    f"`{eqn.primitive.name}` at {compat.source_line(eqn)} runs on mesh{mesh} "
                    f"and reads arrays living on {', '.join(f'mesh{m}' for m in others)} "
                    f"every call (the largest: {named}{largest.aval.str_short()}): a loop, "
                    f"or a conditional whose branches share costly work (a matrix product, "
                    f"a loop) or have effects, is one piece of work on one mesh. Compute "
                    f"what reads each stage's arrays outside it to keep each stage's work on "
                    f"its mesh.",
                    PlacementWarning,
                    stacklevel=compat.user_stacklevel(),
                )
        if is_marker(eqn):
            crossing.update(eqn.outvars)
        mesh_of.update((v, mesh) for v in eqn.outvars)


def _warn_of_shard_maps_off_their_marker(state: PlacementState) -> None:
    """A ``PlacementWarning`` for each forward ``shard_map`` built for another mesh than
    that of the stage whose values it reads (the latest stage entered upstream of it, at a
    marker or a layer stack's stage scan, by the entered value itself or work computed
    from it): it runs where it was built, so that stage's work reading its result goes to
    that mesh (the marker says otherwise)."""
    program, seeded = state.program, state.seeded
    # value -> the equation entering the latest stage it is computed in, through work not
    # bound to a mesh (a shard_map's results are where it runs, warned of or not).
    entered: dict = {}
    for i, eqn in enumerate(state.eqns):
        if state.transpose[i]:
            continue
        if seeded[i] is not None:
            entered.update((v, i) for v in eqn.outvars)
            continue
        sources = [entered[a] for a in state.reads[i] if a in entered]
        if not sources:
            continue
        latest = max(sources, key=seeded.__getitem__)
        on_mesh = state.mesh_bound.get(i)
        if on_mesh is None:
            entered.update((v, latest) for v in eqn.outvars)
            continue
        if not on_mesh:
            continue  # (built for no stage's mesh: a type error later)
        stage = seeded[latest]
        mesh, marked_mesh = program.mesh_of_stage(on_mesh[0]), program.mesh_of_stage(stage)
        if mesh == marked_mesh:
            entered.update((v, latest) for v in eqn.outvars)
        elif eqn.primitive is compat.shard_map_p:
            warnings.warn(
                f"shard_map at {compat.source_line(eqn)} was built for mesh{mesh} but reads "
                f"the values of stage {stage}, entered at "
                f"{compat.source_line(state.eqns[latest])}, whose mesh is mesh{marked_mesh}: "
                f"it runs on mesh{mesh}, and the work reading its result follows it there. "
                f"Build it for stage {stage}'s mesh (meshes[{marked_mesh}], or "
                f"meshes[{marked_mesh}].abstract_mesh).",
                PlacementWarning,
                stacklevel=compat.user_stacklevel(),
            )


@register(
    "partition",
    "place every equation on a stage and mesh",
    requires={Property.PLANNED, Property.INLINED},
    produces={Property.PLACED},
)
def partition(program: Program) -> Program:
    """Place every equation; clone cheap ones per user; choose input and output meshes.

    Runs after ``dce``: dead work would decide where values live (an input read only by
    it would live with it)."""
    jaxpr = program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    state = placement_state(program)
    _warn_of_shard_maps_off_their_marker(state)
    producer, reads, cheap = state.producer, state.reads, state.cheap
    placement = _place(state)
    default = min(placement.values(), key=Placement.order_key, default=Placement(0, 0))
    # A program's results are made after its microbatch loop, whatever their kin or
    # sources: a cheap value computed for one (a cast of a loop's result, the zeros of a
    # gradient that is zero) runs there, not in the loop's iteration.
    out_placement = [
        dataclasses.replace(p, microbatch=None)
        for p in _with_kin(
            _output_placements(state, jaxpr.outvars, placement),
            program.out_paths,
            default,
            result=True,
        )
    ]
    new_eqns, outvars = clone_small_values(
        eqns, reads, jaxpr.outvars, producer, cheap, placement, out_placement
    )
    in_meshes, out_meshes = _io_meshes(program, new_eqns, out_placement, default, state.fed_back)
    staged = {e.outvars[0] for e, s in zip(eqns, state.seeded) if s is not None and e.outvars}
    _warn_of_control_flow_across_meshes(program, new_eqns, in_meshes, staged)
    closed = make_closed_jaxpr(
        jaxpr.constvars, program.jaxpr.consts, jaxpr.invars, outvars, new_eqns, jaxpr.debug_info
    )
    return program.replace(
        jaxpr=closed,
        phase=Phase.PLACED,
        in_meshes=tuple(in_meshes),
        out_meshes=tuple(out_meshes),
        in_specs=_committed_specs_kept(program, in_meshes),
    )


def _committed_specs_kept(program: Program, in_meshes) -> tuple:
    """``program.in_specs`` less each committed argument's own spec (not the caller's
    ``in_specs``) that the mesh reading it cannot shard it by (an axis that mesh lacks,
    or one not dividing the rows of a stack's piece): the argument is laid out there as
    its computation gives it, as under ``jax.jit`` with an input on another mesh."""
    specs = list(program.in_specs)
    if program.committed_specs is None:
        return tuple(specs)
    for k, (spec, mesh, v) in enumerate(zip(specs, in_meshes, program.jaxpr.jaxpr.invars)):
        own = program.committed_specs[program.argument_leaf(k)]
        if own and spec_problem(spec, program.meshes[mesh], v.aval.shape):
            specs[k] = None
    return tuple(specs)
