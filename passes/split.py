"""``split``: cut a placed program into fragments joined by transfers.

The contract of a ``split_module``: an assignment of every equation to a part
comes in, one sub-program per part comes out, and the graph of parts is acyclic.
Markers (``stage`` and ``microbatch``) are dropped here: they are identities and
their job was placement.

Equations of one placement (stage, transpose count, microbatch) form one fragment unless that
would make a cycle (or, with ``scans=shared``, unless one is a scan: see
:class:`ScanFragments`): each equation first gets a level, the number of placement
changes on the longest path reaching it, so every edge between parts climbs a
level and the parts are acyclic by construction; then parts of one placement are
merged back together wherever no path leads from one to the other through
another part. Values crossing meshes travel by ``transfer``; values crossing
fragments on one mesh are passed directly.

Every top-level value gets a static ``PartitionSpec`` inside its mesh: program
inputs their ``in_specs``, program outputs the caller's ``out_specs`` where given,
other fragment results (and outputs with no spec) the spec their inputs' sharded
dimensions carry to them (``mpmdc.ir.spec_rules``), as ``jax.jit``'s propagation would;
transferred values the source's spec as far as the destination mesh has those axes.
Fragments and transfers carry these specs, so the StableHLO that ``lower`` emits is
exactly what runs.
"""

from __future__ import annotations

import enum

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims
from jax.sharding import PartitionSpec
from mpmdc.passes.base import Property, register

from mpmdc.ir.feedback import fed_back
from mpmdc.ir.primitives import (
    LOOP,
    Carries,
    LoopEdge,
    fragment_p,
    is_loop_edge,
    is_loop_entry,
    is_marker,
    is_microbatch_marker,
    transfer_p,
)
from mpmdc.ir.program import (
    Phase,
    Placement,
    Program,
    fresh_like,
    is_var,
    make_closed_jaxpr,
    sub_jaxpr,
    substituted,
    vars_of,
)
from mpmdc.ir.sharding import fit_spec, named_spec, program_spec_forms
from mpmdc.ir.spec_rules import propagate_specs


class ScanFragments(enum.StrEnum):
    """Where a top-level scan (a stage's share of a layer stack) runs: the option
    ``scans`` of ``split``.

    ``FUSED`` (the default): in its placement's fragment with the work around it, so a
    stage's forward is one call per microbatch and its backward another, the running
    sum of its gradient inside. ``SHARED``: as a fragment of its own, so the stages'
    equal scans share one executable even where the work around them differs (an
    embedding before the first stage's, a loss after the last's): fewer XLA compiles
    of the scan's body, more calls per microbatch. *Why fused by default:* calls are
    paid every microbatch of every step, compiles once per run (see
    docs/performance.md).
    """

    FUSED = "fused"
    SHARED = "shared"


def _parts(eqns, reads, placements, scans: ScanFragments = ScanFragments.FUSED):
    """``(part of each equation, graph of the parts, values read in another part than
    their own, the placement of each part's first index)``: a part is ``(index into those
    placements, level)``; the parts are acyclic, one per placement where possible, and a
    loop edge (and, with ``scans`` shared, a scan) is a part of its own.
    ``reads[i]``: the variables equation ``i`` reads."""
    import networkx as nx  # (here, not at the top: it is a tenth of `import mpmdc`)

    ids: dict = {}
    distinct: list = []
    # (Small ints hash and compare much faster than placements.)
    placement_id = []
    for eqn, p in zip(eqns, placements):
        # (A loop edge stands for the whole loop, not for work in it.)
        own = is_loop_edge(eqn) or (
            scans is ScanFragments.SHARED and eqn.primitive is jprims.scan_p
        )
        k = len(distinct) if own else ids.setdefault(p, len(distinct))
        if k == len(distinct):
            distinct.append(p)
        placement_id.append(k)
    producer: dict = {}
    level = []
    for i, eqn in enumerate(eqns):
        lvl = 0
        for a in reads[i]:
            j = producer.get(a)
            if j is not None:
                lvl = max(lvl, level[j] + (placement_id[j] != placement_id[i]))
        level.append(lvl)
        producer.update((v, i) for v in eqn.outvars)

    part_of = list(zip(placement_id, level))
    graph = nx.DiGraph()
    graph.add_nodes_from(dict.fromkeys(part_of))
    candidates = []  # (value, producer, reader) where parts differ before merging
    for i in range(len(eqns)):
        for a in reads[i]:
            j = producer.get(a)
            if j is not None and part_of[j] != part_of[i]:
                graph.add_edge(part_of[j], part_of[i])
                candidates.append((a, j, i))

    merged_into = {}
    by_placement: dict[int, list] = {}
    for node in sorted(graph.nodes, key=lambda n: (distinct[n[0]].order_key(), n[1])):
        by_placement.setdefault(node[0], []).append(node)
    for nodes in by_placement.values():
        current = nodes[0]
        for node in nodes[1:]:
            if _can_merge(graph, current, node):
                nx.contracted_nodes(graph, current, node, self_loops=False, copy=False)
                merged_into[node] = current
            else:
                current = node
    part_of = [merged_into.get(p, p) for p in part_of]
    # (Merging only joins parts: what crosses now crossed before.)
    crossing = {a for a, j, i in candidates if part_of[j] != part_of[i]}
    return part_of, graph, crossing, distinct


def _can_merge(graph, a, b) -> bool:
    """Merging ``a`` and ``b`` keeps the graph acyclic: no path joins them via a third part."""
    import networkx as nx

    for src, dst in ((a, b), (b, a)):
        if any(nx.has_path(graph, c, dst) for c in graph.successors(src) if c != dst):
            return False
    return True


_SUMS = frozenset({jprims.add_p, jprims.add_jaxvals_p})


def _what_values_carry(jaxpr, env):
    """What a transferred value is, for the transfer report (``mpmdc.ir.traffic``):
    ``activation``/``cotangent`` where it crosses a stage marker (or is the sum of
    values crossing markers, of one kind: a skip connection's cotangent added to the
    one crossing with it, wherever placement put the sum), ``state`` where it is
    computed from program inputs alone, ``other`` otherwise."""
    crossing = {}
    depends = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive in _SUMS:
            kinds = {crossing.get(a) if is_var(a) else None for a in substituted(eqn.invars, env)}
            if len(kinds) == 1 and None not in kinds:
                crossing.update((v, kinds.pop()) for v in eqn.outvars)
        if (
            is_marker(eqn)
            or is_microbatch_marker(eqn)
            or is_loop_edge(eqn)
            or not depends.isdisjoint(vars_of(eqn.invars))
        ):
            depends.update(eqn.outvars)
        if is_marker(eqn):
            kind = Carries.COTANGENT if eqn.params["transpose"] % 2 else Carries.ACTIVATION
            crossing.update((v, kind) for v in substituted(eqn.invars, env) if is_var(v))

    def carries(v):
        return crossing.get(v) or (Carries.OTHER if v in depends else Carries.STATE)

    return carries


def _without_markers(jaxpr, placements):
    """``(equations, their placements, renaming)``: the markers dropped (they are
    identities), their outputs renamed to their inputs."""
    env = {}
    eqns, kept = [], []
    for eqn, placement in zip(jaxpr.eqns, placements):
        if is_marker(eqn) or is_microbatch_marker(eqn):
            env.update(zip(eqn.outvars, substituted(eqn.invars, env)))
        else:
            reads_marker = any(is_var(a) and a in env for a in eqn.invars)
            eqns.append(eqn.replace(invars=substituted(eqn.invars, env)) if reads_marker else eqn)
            kept.append(placement)
    return eqns, kept, env


def _ordered_parts(eqns, reads, placements, outvars, scans: ScanFragments):
    """``(parts in a topological order, the equation indices of each, the values a part
    defines and something outside it reads)``: a part is ``(placement, level)``, the
    values are the fragments' results."""
    import networkx as nx

    part_of, graph, crossing, distinct = _parts(eqns, reads, placements, scans)
    members: dict = {}
    for i, part in enumerate(part_of):
        members.setdefault(part, []).append(i)
    order = list(nx.lexicographical_topological_sort(graph, key=lambda p: members[p][0]))
    used_outside = crossing | {v for v in outvars if is_var(v)}
    return [(distinct[k], level) for k, level in order], [members[p] for p in order], used_outside


def _fragment_names(order, is_edge) -> list[str | None]:
    """Each part's fragment name: its placement's label, numbered where a placement has
    several parts (``s1_fwd_0``, ``s1_fwd_1``); ``None`` for a loop edge's part."""
    counts: dict[Placement, int] = {}
    for part, edge in zip(order, is_edge):
        if not edge:
            counts[part[0]] = counts.get(part[0], 0) + 1
    seen: dict[Placement, int] = {}
    names = []
    for part, edge in zip(order, is_edge):
        if edge:
            names.append(None)
            continue
        name = part[0].label
        if counts[part[0]] > 1:
            name += f"_{seen.get(part[0], 0)}"
        seen[part[0]] = seen.get(part[0], 0) + 1
        names.append(name)
    return names


def _with_given_feedback(program: Program, pairs: dict) -> list:
    """``program.in_specs`` with each free input (no spec given, not committed) whose
    result fed back (``pairs``) has the caller's ``out_specs`` on the input's own mesh
    taking that spec. *Why:* the second call reads that result as it comes back, so an
    input laid out otherwise on the first call would make the second compile again
    (``jax.jit`` compiles twice there)."""
    jaxpr = program.jaxpr.jaxpr
    given = {
        v: (mesh, spec)
        for v, mesh, spec in zip(jaxpr.outvars, program.out_meshes, program.out_specs)
        if is_var(v) and spec is not None
    }
    in_specs = list(program.in_specs)
    for k, (v, spec) in enumerate(zip(jaxpr.invars, in_specs)):
        mesh, out_spec = given.get(pairs.get(v), (None, None))
        if spec is None and out_spec is not None and mesh == program.in_meshes[k]:
            in_specs[k] = out_spec
    return in_specs


class _Emitter:
    """Builds the split program's top-level equations, remembering where each value
    lives and its spec there, so a value moves to a mesh by one transfer at most."""

    def __init__(self, program: Program, const_values: dict, carries, outvars):
        jaxpr = program.jaxpr.jaxpr
        self.program, self.const_values, self.carries = program, const_values, carries
        self.location = {v: program.in_meshes[k] for k, v in enumerate(jaxpr.invars)}
        pairs = fed_back(program)
        in_specs = _with_given_feedback(program, pairs)
        self.propagated = propagate_specs(jaxpr, in_specs, pairs)
        # An input with no spec (not given, not committed) takes the one propagation
        # chose for it, as far as its mesh supports it.
        self.spec_of = {
            v: spec
            if spec is not None
            else fit_spec(self.propagated[v], program.meshes[mesh], v.aval.shape)
            for v, spec, mesh in zip(jaxpr.invars, in_specs, program.in_meshes)
        }
        # Program outputs have the caller's out_specs where given; every other value
        # crossing fragments, and an output with no spec, keeps the sharding its
        # computation gives it (as under jax.jit).
        self.out_spec_of = {
            (v, m): spec
            for v, m, spec in zip(outvars, program.out_meshes, program.out_specs)
            if is_var(v) and spec is not None
        }
        self.copies: dict = {}
        self.eqns: list = []
        # Values inside a rolled loop's iteration: moved once per microbatch, so never
        # in one transfer with a loop-invariant value (moved once).
        self.in_loop: set = set()
        self.carry_stage: dict[int, int] = {}
        self._seed_carry_specs(jaxpr, program.placements)

    def _seed_carry_specs(self, jaxpr, placements) -> None:
        """A rolled loop's running value has one spec throughout, the one its update
        gives it (a gradient's), so iteration ``i + 1`` reads what iteration ``i``
        wrote as it is: its start value is made with that spec too."""
        result_of = {
            e.params["carry"]: e.invars[0] for e in jaxpr.eqns if is_loop_edge(e, LoopEdge.RESULT)
        }
        for eqn, placement in zip(jaxpr.eqns, placements):
            if is_loop_edge(eqn, LoopEdge.CARRY) and eqn.params["carry"] in result_of:
                mesh = self.program.mesh_of_stage(placement.stage)
                updated = result_of[eqn.params["carry"]]
                spec = fit_spec(
                    self.propagated.get(updated), self.program.meshes[mesh], updated.aval.shape
                )
                for v in (eqn.invars[0], eqn.outvars[0], updated):
                    if is_var(v):
                        self.out_spec_of.setdefault((v, mesh), spec)

    def bring(self, values, mesh: int) -> list:
        """``values`` as variables living on ``mesh``, adding transfers as needed."""
        by_src: dict[tuple[int, bool], list] = {}
        for v in values:
            if (
                is_var(v)
                and v not in self.const_values
                and self.location[v] != mesh
                and (v, mesh) not in self.copies
            ):
                by_src.setdefault((self.location[v], v in self.in_loop), []).append(v)
        for (src, in_loop), vs in sorted(by_src.items()):
            src_specs = tuple(self.spec_of[v] for v in vs)
            dst_specs = tuple(
                fit_spec(spec, self.program.meshes[mesh], v.aval.shape)
                for v, spec in zip(vs, src_specs)
            )
            outs = [fresh_like(v) for v in vs]
            params = dict(
                src=src,
                dst=mesh,
                src_specs=src_specs,
                dst_specs=dst_specs,
                carries=tuple(self.carries(v) for v in vs),
            )
            self.eqns.append(jcore.new_jaxpr_eqn(vs, outs, transfer_p, params, jcore.no_effects))
            for v, out, spec in zip(vs, outs, dst_specs):
                self.copies[(v, mesh)] = out
                self.location[out] = mesh
                self.spec_of[out] = spec
            if in_loop:
                self.in_loop.update(outs)
        return [self.copies.get((v, mesh), v) for v in values]

    def edge(self, eqn, placement: Placement) -> None:
        """A loop edge on its placement's mesh (a ``RESULT`` on its ``CARRY``'s, so the
        running value stays where it is), recording its stage, mesh and the specs on
        each side."""
        edge, carry, stage = eqn.params["edge"], eqn.params["carry"], placement.stage
        if edge is LoopEdge.RESULT:
            stage = self.carry_stage.get(carry, stage)
        elif edge is LoopEdge.CARRY:
            self.carry_stage[carry] = stage
        mesh = self.program.mesh_of_stage(stage)
        [operand] = self.bring(eqn.invars, mesh)
        [out] = eqn.outvars
        spec = self.out_spec_of.get((out, mesh), self.propagated.get(out))
        out_spec = fit_spec(spec, self.program.meshes[mesh], out.aval.shape)
        in_spec = self.spec_of[operand] if is_var(operand) else PartitionSpec()
        params = dict(eqn.params, mesh=mesh, stage=stage, in_spec=in_spec, out_spec=out_spec)
        self.eqns.append(eqn.replace(invars=[operand], params=params))
        self.location[out] = mesh
        self.spec_of[out] = out_spec
        if is_loop_entry(eqn):
            self.in_loop.add(out)

    def fragment(self, placement: Placement, name: str, body: list, used_outside: set) -> None:
        """One fragment running ``body`` on its placement's mesh, its operands brought there."""
        mesh = self.program.mesh_of_stage(placement.stage)
        defined = {v for e in body for v in e.outvars if is_var(v)}
        outputs = [v for e in body for v in e.outvars if v in defined and v in used_outside]
        inputs, inner = sub_jaxpr(body, outputs, self.const_values, name)
        operands = self.bring(inputs, mesh)
        out_specs = tuple(
            fit_spec(
                self.out_spec_of.get((v, mesh), self.propagated.get(v)),
                self.program.meshes[mesh],
                v.aval.shape,
            )
            for v in outputs
        )
        params = dict(
            jaxpr=inner,
            mesh=mesh,
            name=name,
            stage=placement.stage,
            transpose=placement.transpose,
            microbatch=placement.microbatch,
            kind=placement.kind,
            in_specs=tuple(self.spec_of[v] for v in operands),
            out_specs=out_specs,
            donate_argnums=(),  # decided by `lower`, once the order of calls is final
        )
        self.eqns.append(jcore.new_jaxpr_eqn(operands, outputs, fragment_p, params, inner.effects))
        self.location.update((v, mesh) for v in outputs)
        self.spec_of.update(zip(outputs, out_specs))
        if placement.microbatch == LOOP:
            self.in_loop.update(outputs)

    def outputs(self, outvars) -> list:
        """The program's outputs, each brought to the mesh it is returned on."""
        return [
            self.bring([v], mesh)[0] if is_var(v) and v not in self.const_values else v
            for v, mesh in zip(outvars, self.program.out_meshes)
        ]


@register(
    "split",
    "cut the placed program into fragments and transfers",
    requires={Property.PLACED},
    produces={Property.SPLIT},
    invalidates={Property.PLACED},  # fragment bodies carry no placements
)
def split(program: Program, *, scans: ScanFragments = ScanFragments.FUSED) -> Program:
    """Turn a placed program into ``fragment`` and ``transfer`` equations (each top-level
    scan in its placement's fragment, or with ``scans=shared`` a fragment of its own)."""
    closed = program.jaxpr
    jaxpr = closed.jaxpr
    eqns, placements, env = _without_markers(jaxpr, program.placements)
    outvars = substituted(jaxpr.outvars, env)
    reads = [vars_of(e.invars) for e in eqns]
    order, members, used_outside = _ordered_parts(eqns, reads, placements, outvars, scans)
    emitter = _Emitter(
        program, dict(zip(jaxpr.constvars, closed.consts)), _what_values_carry(jaxpr, env), outvars
    )
    is_edge = [is_loop_edge(eqns[indices[0]]) for indices in members]
    for part, indices, name, edge in zip(order, members, _fragment_names(order, is_edge), is_edge):
        if edge:
            emitter.edge(eqns[indices[0]], part[0])
        else:
            emitter.fragment(part[0], name, [eqns[i] for i in indices], used_outside)
    final = emitter.outputs(outvars)
    new = make_closed_jaxpr(
        jaxpr.constvars, closed.consts, jaxpr.invars, final, emitter.eqns, jaxpr.debug_info
    )
    # Every output's spec is now known: the caller's as written, or the one its
    # computation gave it, written as the caller wrote an equal spec, else naming every
    # dimension as jax.jit writes computed shardings.
    in_specs = tuple(emitter.spec_of[v] for v in jaxpr.invars)
    forms = program_spec_forms(program.replace(in_specs=in_specs))
    out_specs = tuple(
        given
        if given is not None
        else named_spec(emitter.spec_of.get(v) if is_var(v) else None, v.aval.ndim, forms)
        for v, given in zip(final, program.out_specs)
    )
    return program.replace(jaxpr=new, in_specs=in_specs, out_specs=out_specs, phase=Phase.SPLIT)
