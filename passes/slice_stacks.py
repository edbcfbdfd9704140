"""``slice-stacks``: hold each stacked array cut over stages as per-stage pieces.

After ``split-scans`` each stage's scan reads rows of the layer stack's stacked
operands and its stacked results are concatenations of the stages' rows. This pass
makes the rows the values: a program input sliced into the stages' rows (a stacked
parameter) becomes one input per stage, a slice of a concatenation taking one stage's
rows is that stage's piece (the forward's residuals stay where the backward reads
them), and work on a stacked value runs per piece by the rules of
:mod:`mpmdc.ir.stack_rules` (an optimizer's update per stage; a global norm as
partial sums). An input that such work reads whole alongside a stacked value (an
optimizer state) is taken in pieces too, and results held in pieces are returned in
pieces. A stack that cannot be one array over the stage meshes stays whole; each
stage's rows of it are taken once, however many equations read them (its forward and
its backward), so they move to the stage's mesh once. ``Program.in_pieces`` and
``out_pieces`` record which rows of which argument or result each input or output is,
for the runtime to hand over and assemble.
"""

from __future__ import annotations

import warnings

from jax.extend.core import primitives as jprims
from mpmdc.passes.base import Property, register

from mpmdc import _jax_compat as compat
from mpmdc.errors import PlacementWarning
from mpmdc.ir.graph import def_use, relaid_input
from mpmdc.ir.program import (
    Piece,
    Program,
    find_eqns,
    is_var,
    make_closed_jaxpr,
    placement_of,
    substituted,
    vars_of,
)
from mpmdc.ir.stack_rules import Layout, Stack, StackWalk, group_rows, piece_aval


def _cut_inputs(jaxpr, producers) -> dict:
    """Program inputs read as rows by the per-stage scans of ``split-scans``, whose row
    spans along one axis tile the input: input -> :class:`Layout`."""
    readers: dict = {}
    for eqn in jaxpr.eqns:
        for a in vars_of(eqn.invars):
            readers.setdefault(a, []).append(eqn)
    spans: dict = {}
    for eqn in jaxpr.eqns:
        rows = group_rows(eqn)
        if rows is None or eqn.invars[0] in producers:
            continue
        placements = {placement_of(r) for r in readers.get(eqn.outvars[0], [])}
        if len(placements) == 1 and None not in placements:
            stage = placements.pop().stage
            spans.setdefault((eqn.invars[0], rows[0]), {})[rows[1:]] = stage
    out = {}
    for (x, axis), found in spans.items():
        ordered = sorted(found)
        bounds = [0]
        for lo, hi in ordered:
            if lo != bounds[-1]:
                break
            bounds.append(hi)
        if len(bounds) == len(ordered) + 1 and bounds[-1] == x.aval.shape[axis]:
            out.setdefault(x, Layout(axis, tuple(bounds), tuple(found[r] for r in ordered)))
    return out


def _stage_concatenation(eqn, producers) -> Layout | None:
    """The layout of a concatenation of results of the per-stage scans (which
    ``split-scans`` placed), or ``None`` for any other equation."""
    if eqn.primitive is not jprims.concatenate_p:
        return None
    made = [producers.get(a) for a in eqn.invars]
    if any(m is None or placement_of(m) is None for m in made):
        return None
    axis = eqn.params["dimension"]
    bounds = [0]
    for a in eqn.invars:
        bounds.append(bounds[-1] + a.aval.shape[axis])
    return Layout(axis, tuple(bounds), tuple(placement_of(m).stage for m in made))


# Why a stack is kept whole when every stage of it runs on one mesh: where it already
# is, so nothing moves and nothing is worth a warning.
ON_ONE_MESH = "all of its stages run on one mesh"


def layout_problem(program: Program, layout: Layout) -> str | None:
    """Why a value cut by ``layout`` cannot be one array whose shards are its pieces on
    their stages' meshes (see :mod:`mpmdc.runtime.pieces`), or ``None`` if it can be."""
    meshes = [program.meshes[program.mesh_of_stage(s)] for s in layout.stages]
    if len({id(m) for m in meshes}) == 1:
        return ON_ONE_MESH
    rows = [hi - lo for _, lo, hi in layout.spans()]
    if len(set(rows)) > 1:
        return f"its stages hold different numbers of rows ({rows})"
    if len({id(m) for m in meshes}) < len(meshes):
        return "several of its stages run on one mesh"
    if len({(m.axis_names, m.devices.shape) for m in meshes}) > 1:
        return "its stages' meshes differ in shape"
    return None


def _walk(jaxpr, cut: dict, producers: dict, first_reader: dict, names: dict):
    """One walk: ``(walk, new inputs per original input)`` with the inputs and running
    values in ``cut`` in pieces (``first_reader``: input -> the first equation reading it;
    ``names``: see :class:`StackWalk`)."""
    walk = StackWalk(jaxpr.eqns, producers, cut, names)
    new_inputs = {}
    for v in jaxpr.invars:
        if v not in cut:
            new_inputs[v] = [v]
            continue
        layout = cut[v]
        pieces = [
            compat.Var(piece_aval(v.aval, layout.axis, hi - lo)) for _, lo, hi in layout.spans()
        ]
        walk.stacked(v, layout, pieces, first_reader[v])
        new_inputs[v] = pieces
    for i, eqn in enumerate(jaxpr.eqns):
        layout = _stage_concatenation(eqn, producers)
        if layout is None:
            walk.visit(eqn, (i,))
            continue
        # (its operands are the per-stage scans' results, which no rule renames)
        walk.stacks[eqn.outvars[0]] = Stack(layout, tuple(eqn.invars))
        walk.emit(eqn)
    return walk, new_inputs


def _rows_text(path: str, axis: int, lo: int, hi: int) -> str:
    return f"{path}[{', '.join([':'] * axis + [f'{lo}:{hi}'])}]"


@register(
    "slice-stacks",
    "hold stacked arrays cut over stages as one piece per stage",
    requires={Property.SCANS_SPLIT},  # the pieces are the rows of the per-stage scans
    invalidates={Property.PLACED},  # the per-piece work it writes has no placement
)
def slice_stacks(program: Program) -> Program:
    """Take stacked inputs in pieces, run work on stacked values per piece, return pieces."""
    jaxpr = program.jaxpr.jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    first_reader = {}
    for eqn in reversed(jaxpr.eqns):
        first_reader.update((a, eqn) for a in vars_of(eqn.invars))
    cut = _cut_inputs(jaxpr, producers)
    if not cut and not any(_stage_concatenation(e, producers) for e in jaxpr.eqns):
        return program
    paths = dict(zip(jaxpr.invars, program.in_paths))
    whole = set()  # inputs whose pieces cannot make one array: they stay whole
    names: dict = {}  # the variables of calls written in place, the same in every walk
    kept_whole: dict = {}  # why -> the arguments and results kept whole for that reason
    whole_layouts: dict = {}  # an input kept whole -> its stack's layout
    whole_results: list = []  # (position, its stack's layout, aval) of results kept whole
    # Work reading a value whole beside a stacked one (an optimizer state beside a
    # gradient) asks for it in pieces; a walk with more in pieces may ask for more (what
    # computed it). Each walk asks for new values or is the last. What a walk asks for is
    # an input or a value named by its position, the same in every walk, so the walks are
    # no more than the program's values; more would mean a rule asks each walk for a
    # value of that walk's own making, which no later walk can give.
    values = len(jaxpr.invars) + sum(len(e.outvars) for e in find_eqns(jaxpr.eqns, lambda e: True))
    for _ in range(values + 1):
        for v in [v for v in cut if v in paths and v not in whole]:
            if (why := layout_problem(program, cut[v])) is not None:
                kept_whole.setdefault(why, []).append(f"argument {paths[v]}")
                whole_layouts[v] = cut[v]
                whole.add(v)
        cut = {v: layout for v, layout in cut.items() if v not in whole}
        walk, new_inputs = _walk(jaxpr, cut, producers, first_reader, names)
        asked = {v: layout for v, layout in walk.demands.items() if v not in whole}
        if not asked:
            break
        cut.update(asked)
    else:
        raise RuntimeError(
            f"the values asked for in pieces never settle: after {values + 1} walks the "
            f"last still asked for {_named(asked, producers)}, values no walk gives"
        )
    invars, in_pieces, in_specs, in_paths, donated = [], [], [], [], []
    whole_inputs = []  # (position, its stack's layout, aval) of inputs kept whole
    for i, v in enumerate(jaxpr.invars):
        pieces = new_inputs[v]
        if v in whole_layouts:
            whole_inputs.append((len(invars), whole_layouts[v], v.aval))
        invars += pieces
        spans = [None] if v not in cut else _spans(cut[v])
        for rows in spans:
            in_pieces.append(Piece(i, rows))
            in_specs.append(program.in_specs[i])
            in_paths.append(
                program.in_paths[i] if rows is None else _rows_text(program.in_paths[i], *rows)
            )
            donated.append(program.donated[i])
    eqns, taken = _rows_taken_once(walk.eqns)
    outvars, out_pieces, out_specs, out_paths, wanted = [], [], [], [], []
    for i, v in enumerate(substituted(substituted(jaxpr.outvars, walk.env), taken)):
        found = walk.stack_of(v)
        if found is not None and (why := layout_problem(program, found.layout)):
            kept_whole.setdefault(why, []).append(f"result {program.out_paths[i]}")
            whole_results.append((len(outvars), found.layout, v.aval))
            found = None
        pieces = [v] if found is None else list(found.pieces)
        spans = [None] if found is None else _spans(found.layout)
        for piece, rows in zip(pieces, spans):
            outvars.append(piece)
            out_pieces.append(Piece(i, rows))
            out_specs.append(program.out_specs[i])
            out_paths.append(
                program.out_paths[i] if rows is None else _rows_text(program.out_paths[i], *rows)
            )
            if program.wanted_out_meshes is not None:
                wanted.append(program.wanted_out_meshes[i])
    scans = [e for e in jaxpr.eqns if placement_of(e) is not None]
    for why, what in kept_whole.items():
        if why != ON_ONE_MESH:
            _warn(scans[0] if scans else None, what, why)
    feedback = _stack_feedback(whole_inputs, whole_results)
    debug = jaxpr.debug_info._replace(arg_names=tuple(in_paths), result_paths=tuple(out_paths))
    closed = make_closed_jaxpr(jaxpr.constvars, program.jaxpr.consts, invars, outvars, eqns, debug)
    return program.replace(
        jaxpr=closed,
        in_pieces=tuple(in_pieces),
        out_pieces=tuple(out_pieces),
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        in_paths=tuple(in_paths),
        out_paths=tuple(out_paths),
        donated=tuple(donated),
        wanted_out_meshes=tuple(wanted) if program.wanted_out_meshes is not None else None,
        stack_feedback=feedback or None,
    )


def _rows_taken_once(eqns) -> tuple[list, dict]:
    """``(eqns, renaming)``: ``eqns`` with the rows of a program input (a layer stack
    kept whole), or of one laid out otherwise (:func:`relaid_input`: its layer axis moved
    first), taken once however many equations take them (a stage's forward and
    backward), each later take renamed to the first, so a mesh receives a stage's rows
    once."""
    producer = def_use(eqns).producer
    first: dict = {}
    renaming: dict = {}
    out = []
    for eqn in eqns:
        invars = substituted(eqn.invars, renaming)
        if (
            (rows := group_rows(eqn)) is not None
            and is_var(eqn.invars[0])
            and relaid_input(eqn.invars[0], eqns, producer) is not None
        ):
            key = (eqn.invars[0], rows)
            if key in first:
                renaming[eqn.outvars[0]] = first[key]
                continue
            first[key] = eqn.outvars[0]
        out.append(eqn if invars == list(eqn.invars) else eqn.replace(invars=invars))
    return out, renaming


def _stack_feedback(inputs: list, results: list) -> tuple:
    """The inputs and results kept whole (each ``(position, layout, aval)``) grouped by
    stack, shape and dtype, as ``(input positions, result positions)`` per group that
    has both (:attr:`Program.stack_feedback`)."""
    groups: dict = {}
    for side, found in enumerate((inputs, results)):
        for k, layout, aval in found:
            groups.setdefault((layout, aval.shape, aval.dtype), ([], []))[side].append(k)
    return tuple((tuple(ins), tuple(outs)) for ins, outs in groups.values() if ins and outs)


def _named(asked: dict, producers: dict) -> str:
    """Up to three of the values ``asked`` for, each with the equation that made it
    where the program has one."""
    named = [
        f"a {v.aval.str_short()} value"
        + (
            f" (from {producers[v].primitive} at {compat.source_line(producers[v])})"
            if v in producers
            else ""
        )
        for v in list(asked)[:3]
    ]
    return ", ".join(named) + (f" and {len(asked) - 3} more" if len(asked) > 3 else "")


def _spans(layout: Layout) -> list:
    return [(layout.axis, lo, hi) for _, lo, hi in layout.spans()]


def _warn(scan, what: list[str], why: str) -> None:
    """One warning for the stacked arguments and results ``what`` kept whole for ``why``."""
    where = f" (the scan at {compat.source_line(scan)})" if scan is not None else ""
    named = ", ".join(what[:4]) + (f" and {len(what) - 4} more" if len(what) > 4 else "")
    warnings.warn(
        f"a layer stack{where} cannot be one array over the stage meshes: {why}. Its "
        f"stacked arrays ({named}) are kept whole on one mesh: each step sends every "
        f"other mesh running one of their stages those stages' rows, and their gradients' "
        f"rows come back (an update after the microbatch loop runs where the stack is). "
        f"Give every stage the same number of layers (a fixed every=k dividing the stack, "
        f"where every='balanced' splits it unevenly), one stage per mesh, and meshes of "
        f"one shape to keep each stage's rows on its mesh.",
        PlacementWarning,
        stacklevel=compat.user_stacklevel(),
    )
