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
pieces. ``Program.in_pieces``/``out_pieces`` record which rows of which argument or
result each input or output is, for the runtime to hand over and assemble.
"""

from __future__ import annotations

import itertools

from jax.extend.core import primitives as jprims
from mpmdc.passes.base import register

from mpmdc import _jax_compat as compat
from mpmdc.ir.program import Piece, Program, make_closed_jaxpr, placement_of, substituted, vars_of
from mpmdc.ir.stack_rules import STACK_RULES, Stack, StackWalk, group_rows


def _cut_inputs(jaxpr, producers) -> dict:
    """Program inputs read as rows by the per-stage scans of ``split-scans``, whose row
    spans along one axis tile the input: input -> (axis, bounds)."""
    readers: dict = {}
    for eqn in jaxpr.eqns:
        for a in vars_of(eqn.invars):
            readers.setdefault(a, []).append(eqn)
    spans: dict = {}
    for eqn in jaxpr.eqns:
        rows = group_rows(eqn)
        (x,) = eqn.invars if eqn.primitive is jprims.slice_p else (None,)
        if rows is None or x not in readers or x in producers:
            continue
        if all(placement_of(r) is not None for r in readers.get(eqn.outvars[0], [None])):
            spans.setdefault((x, rows[0]), set()).add(rows[1:])
    out = {}
    for (x, axis), found in spans.items():
        ordered = sorted(found)
        bounds = [ordered[0][0]]
        for lo, hi in ordered:
            if lo != bounds[-1]:
                break
            bounds.append(hi)
        if len(bounds) == len(ordered) + 1 and bounds[0] == 0 and bounds[-1] == x.aval.shape[axis]:
            out.setdefault(x, (axis, tuple(bounds)))
    return out


def _is_stage_concatenation(eqn, producers) -> bool:
    """A concatenation of results of the per-stage scans (which ``split-scans`` placed)."""
    return eqn.primitive is jprims.concatenate_p and all(
        a in producers and placement_of(producers[a]) is not None for a in eqn.invars
    )


def _walk(jaxpr, cut: dict, producers: dict):
    """One walk: ``(walk, new inputs per original input)`` with the inputs and running
    values in ``cut`` in pieces."""
    walk = StackWalk(jaxpr.eqns, cut)
    first_reader = {}
    for eqn in reversed(jaxpr.eqns):
        first_reader.update((a, eqn) for a in vars_of(eqn.invars))
    new_inputs = {}
    for v in jaxpr.invars:
        if v not in cut:
            new_inputs[v] = [v]
            continue
        axis, bounds = cut[v]
        shape = list(v.aval.shape)
        pieces = []
        for lo, hi in itertools.pairwise(bounds):
            shape[axis] = hi - lo
            pieces.append(compat.Var(v.aval.update(shape=tuple(shape))))
        walk.stacked(v, axis, bounds, pieces, first_reader[v])
        new_inputs[v] = pieces
    for eqn in jaxpr.eqns:
        invars = substituted(eqn.invars, walk.env)
        if any(a is not b for a, b in zip(invars, eqn.invars)):
            eqn = eqn.replace(invars=invars)
        if _is_stage_concatenation(eqn, producers):
            axis = eqn.params["dimension"]
            bounds = [0]
            for a in eqn.invars:
                bounds.append(bounds[-1] + a.aval.shape[axis])
            walk.stacks[eqn.outvars[0]] = Stack(axis, tuple(bounds), tuple(eqn.invars))
            walk.emit(eqn)
            continue
        rule = STACK_RULES.get(eqn.primitive)
        if rule is None or not rule(eqn, walk):
            walk.emit(eqn)
    return walk, new_inputs


def _rows_text(path: str, axis: int, lo: int, hi: int) -> str:
    return f"{path}[{', '.join([':'] * axis + [f'{lo}:{hi}'])}]"


@register("slice-stacks", "hold stacked arrays cut over stages as one piece per stage")
def slice_stacks(program: Program) -> Program:
    """Take stacked inputs in pieces, run work on stacked values per piece, return pieces."""
    jaxpr = program.jaxpr.jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    cut = _cut_inputs(jaxpr, producers)
    if not cut and not any(_is_stage_concatenation(e, producers) for e in jaxpr.eqns):
        return program
    # Work reading a value whole beside a stacked one (an optimizer state beside a
    # gradient) asks for it in pieces; a walk with more in pieces may ask for more (what
    # computed it). Each walk asks for new values or is the last.
    while True:
        walk, new_inputs = _walk(jaxpr, cut, producers)
        if not walk.demands:
            break
        cut.update(walk.demands)
    invars, in_pieces, in_specs, in_paths, donated = [], [], [], [], []
    for i, v in enumerate(jaxpr.invars):
        pieces = new_inputs[v]
        invars += pieces
        spans = [None] if v not in cut else _spans(cut[v])
        for rows in spans:
            in_pieces.append(Piece(i, rows))
            in_specs.append(program.in_specs[i])
            in_paths.append(
                program.in_paths[i] if rows is None else _rows_text(program.in_paths[i], *rows)
            )
            donated.append(program.donated[i])
    outvars, out_pieces, out_specs, out_paths, wanted = [], [], [], [], []
    for i, v in enumerate(substituted(jaxpr.outvars, walk.env)):
        found = walk.stacks.get(v)
        pieces = [v] if found is None else list(found.pieces)
        spans = [None] if found is None else _spans(found.layout())
        for piece, rows in zip(pieces, spans):
            outvars.append(piece)
            out_pieces.append(Piece(i, rows))
            out_specs.append(program.out_specs[i])
            out_paths.append(
                program.out_paths[i] if rows is None else _rows_text(program.out_paths[i], *rows)
            )
            if program.wanted_out_meshes is not None:
                wanted.append(program.wanted_out_meshes[i])
    debug = jaxpr.debug_info._replace(arg_names=tuple(in_paths), result_paths=tuple(out_paths))
    closed = make_closed_jaxpr(
        jaxpr.constvars, program.jaxpr.consts, invars, outvars, walk.eqns, debug
    )
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
    )


def _spans(layout) -> list:
    axis, bounds = layout
    return [(axis, lo, hi) for lo, hi in itertools.pairwise(bounds)]
