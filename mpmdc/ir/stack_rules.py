"""How work on a stacked array runs on its pieces, one rule per primitive.

A layer stack cut into stages (``split-scans``) is read as slices and written as a
concatenation of per-stage results. A *stack* is such a value held as pieces along one
axis (``Stack``: the axis, the row bounds, a variable per piece). The ``slice-stacks``
pass walks the program with a :class:`StackWalk`; for an equation reading a stack, the
rule registered for its primitive in :data:`STACK_RULES` writes the same work per piece,
so an optimizer's elementwise update of a stacked parameter runs where each piece lives,
and a reduction over the stack (a global norm) adds per-piece partial results. A call
reading a stack (``jnp.where``'s ``jit``) is walked through, its body's equations
written in its place, and a conditional reading one whose branches may all run (a
skip-step guard: see :mod:`mpmdc.ir.predication`) becomes its branches and a
``select_n`` per result, so the stack stays in pieces through both. Every
value held in pieces keeps a definition (a concatenation of the pieces), so work no rule
knows still reads the whole array; ``dce`` drops what nothing reads.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
from jax.extend import core as jcore
from jax.extend.core import primitives as jprims

from mpmdc import _jax_compat as compat
from mpmdc.ir.calls import call_body
from mpmdc.ir.predication import predicable, selections
from mpmdc.ir.primitives import LoopEdge, is_loop_edge, loop_edge_p
from mpmdc.ir.program import derived_eqn, is_var, substituted


@dataclass(frozen=True)
class Layout:
    """How a stacked value is cut: piece ``g`` is rows ``bounds[g]:bounds[g + 1]`` along
    ``axis`` and belongs to stage ``stages[g]``."""

    axis: int
    bounds: tuple[int, ...]
    stages: tuple[int, ...]

    def along(self, axis: int) -> Layout:
        """The same cut along another axis."""
        return Layout(axis, self.bounds, self.stages)

    def spans(self):
        """``(g, lo, hi)`` per piece."""
        return [(g, lo, hi) for g, (lo, hi) in enumerate(itertools.pairwise(self.bounds))]


@dataclass(frozen=True)
class Stack:
    """A value held as ``pieces`` cut by ``layout``."""

    layout: Layout
    pieces: tuple


def piece_aval(aval, axis: int, rows: int):
    """``aval`` with ``rows`` rows along ``axis``."""
    shape = list(aval.shape)
    shape[axis] = rows
    return aval.update(shape=tuple(shape))


def rows_of(x, lo: int, hi: int, like, axis: int = 0):
    """``(equation, result)``: rows ``lo:hi`` of ``x`` along ``axis`` (``like``: the
    equation whose source line and context the slice takes)."""
    out = compat.Var(piece_aval(x.aval, axis, hi - lo))
    start, limit = [0] * x.aval.ndim, list(x.aval.shape)
    start[axis], limit[axis] = lo, hi
    params = {"start_indices": tuple(start), "limit_indices": tuple(limit), "strides": None}
    return derived_eqn(jax.lax.slice_p, [x], [out], params, like), out


def concatenation(pieces, out, like, axis: int = 0):
    """The equation defining ``out`` as ``pieces`` joined along ``axis``."""
    return derived_eqn(jax.lax.concatenate_p, pieces, [out], {"dimension": axis}, like)


class StackWalk:
    """The state of one walk over a program's equations: what is stacked (``stacks``),
    the equations written so far (``eqns``) and renamings (``env``).

    Values that work on a stack reads whole (an optimizer state beside a gradient, the
    running sum of a gradient in an ``accumulate`` loop, work computing such values) are
    ``demands`` (variable -> :class:`Layout`); the next walk takes what it can of them in
    pieces where they begin (``wanted``): program inputs, running values, and the results
    of work a rule runs per piece."""

    def __init__(self, eqns, producers: dict, wanted: dict, names: dict):
        self.producers = producers  # variable -> the equation of ``eqns`` defining it
        self.wanted = wanted
        # (call site, body variable) -> its variable when written in place, the same in
        # every walk, so a demand for it names a value the next walk makes too. A site
        # is where the equation is: its index in the program, then in each body.
        self.names = names
        self.site: tuple = ()
        self.stacks: dict = {}
        self.eqns: list = []
        self.env: dict = {}
        self.demands: dict = {}
        # (carry number, piece) -> the carry number of that piece's running value
        numbers = [e.params["carry"] for e in eqns if is_loop_edge(e)]
        self._next_carry = max(numbers, default=-1) + 1
        self.carry_numbers: dict = {}
        self.split_carries: dict = {}  # carry number -> layout, for carries held in pieces

    def carry_number(self, carry: int, piece: int) -> int:
        """The carry number of ``piece`` of the running value numbered ``carry``."""
        if (carry, piece) not in self.carry_numbers:
            self.carry_numbers[carry, piece] = self._next_carry
            self._next_carry += 1
        return self.carry_numbers[carry, piece]

    def stack_of(self, atom) -> Stack | None:
        """The stack ``atom`` is held as, or ``None``."""
        return self.stacks.get(atom) if is_var(atom) else None

    def emit(self, eqn) -> None:
        self.eqns.append(eqn)

    def visit(self, eqn, site: tuple) -> None:
        """Write ``eqn`` (its operands renamed), found at ``site``: per piece where its
        rule can, else whole."""
        invars = substituted(eqn.invars, self.env)
        if any(a is not b for a, b in zip(invars, eqn.invars)):
            eqn = eqn.replace(invars=invars)
        self.site = site
        rule = STACK_RULES.get(eqn.primitive)
        if rule is None or not rule(eqn, self):
            self.emit(eqn)

    def inline(self, site: tuple, body: jcore.Jaxpr, operands) -> list:
        """Write the equations of ``body`` on ``operands`` in place of the call at
        ``site``; its results."""
        env = dict(zip(body.invars, operands))
        for j, eqn in enumerate(body.eqns):
            invars = substituted(eqn.invars, env)
            outvars = [self._name(site, v) for v in eqn.outvars]
            env.update((v, new) for v, new in zip(eqn.outvars, outvars) if is_var(v))
            self.visit(eqn.replace(invars=invars, outvars=outvars), (*site, j))
        return substituted(substituted(body.outvars, env), self.env)

    def _name(self, site: tuple, var):
        if not is_var(var):
            return var  # (a dropped output: nothing reads it)
        key = (site, var)
        if key not in self.names:
            self.names[key] = compat.Var(var.aval)
        return self.names[key]

    def stacked(self, outvar, layout: Layout, pieces, like) -> None:
        """Record ``outvar`` as held in ``pieces``, and define it as their concatenation."""
        self.stacks[outvar] = Stack(layout, tuple(pieces))
        self.emit(concatenation(pieces, outvar, like, layout.axis))

    def pieces_of(self, atom, layout: Layout, like) -> list:
        """Per piece of ``layout``, the operand standing for ``atom``: its own pieces if it
        is stacked so, a broadcast per piece if it is a broadcast along other axes, else a
        slice (an input read so is a demand)."""
        axis = layout.axis
        found = self.stack_of(atom)
        if found is not None and found.layout == layout:
            return list(found.pieces)
        if atom not in self.wanted:
            self.demands.setdefault(atom, layout)
        made = self.producers.get(atom)
        fill = self._fill(made)
        if fill is not None:  # every piece the same broadcast: equal pieces, equal modules
            made = fill
        out = []
        for _, lo, hi in layout.spans():
            if (
                made is not None
                and made.primitive is jprims.broadcast_in_dim_p
                and _broadcast_from(made, axis) is None
            ):
                piece = compat.Var(piece_aval(atom.aval, axis, hi - lo))
                params = {**made.params, "shape": piece.aval.shape}
                self.emit(derived_eqn(made.primitive, made.invars, [piece], params, like))
            else:
                slicing, piece = rows_of(atom, lo, hi, like, axis)
                self.emit(slicing)
            out.append(piece)
        return out

    def _fill(self, made):
        """The broadcast of a scalar that ``made`` is (through reshapes: the zeros a
        running sum starts from), or ``None``."""
        while made is not None and made.primitive is jprims.reshape_p:
            made = self.producers.get(made.invars[0])
        if (
            made is not None
            and made.primitive is jprims.broadcast_in_dim_p
            and not made.params["broadcast_dimensions"]
        ):
            return made
        return None


Rule = Callable[[jcore.JaxprEqn, StackWalk], bool]

# primitive -> rule(eqn, walk): write ``eqn`` per piece and return True, or return False
# (``eqn`` then runs as it is, on whole values).
STACK_RULES: dict[jcore.Primitive, Rule] = {}


def _broadcasts_to(operand_shape, shape) -> bool:
    """Whether an elementwise operand of ``operand_shape`` broadcasts to ``shape``: a
    scalar, or of its rank with each dimension equal or 1 (``lax`` broadcasts those)."""
    return operand_shape == () or (
        len(operand_shape) == len(shape) and all(d in (1, n) for d, n in zip(operand_shape, shape))
    )


def _elementwise(eqn, walk: StackWalk) -> bool:
    """Per piece; an operand of one row along the stacked axis (or a scalar) is read
    whole by every piece, as ``lax`` broadcasts it (``v_row / mean(v_row, -1,
    keepdims=True)``, Adafactor's factored moments)."""
    shape = eqn.outvars[0].aval.shape
    if not all(_broadcasts_to(a.aval.shape, shape) for a in eqn.invars):
        return False
    layouts = [
        found.layout
        for a in eqn.invars
        if (found := walk.stack_of(a)) is not None
        and a.aval.shape[found.layout.axis] == shape[found.layout.axis]
    ] + [walk.wanted[v] for v in eqn.outvars if v in walk.wanted]
    if not layouts:
        return False
    layout = layouts[0]
    operands = [
        walk.pieces_of(a, layout, eqn)
        if a.aval.shape and a.aval.shape[layout.axis] == shape[layout.axis]
        else [a] * len(layout.stages)
        for a in eqn.invars
    ]
    outs = [[] for _ in eqn.outvars]
    for g, lo, hi in layout.spans():
        piece_out = [compat.Var(piece_aval(v.aval, layout.axis, hi - lo)) for v in eqn.outvars]
        walk.emit(
            derived_eqn(eqn.primitive, [ops[g] for ops in operands], piece_out, eqn.params, eqn)
        )
        for k, v in enumerate(piece_out):
            outs[k].append(v)
    for v, pieces in zip(eqn.outvars, outs):
        walk.stacked(v, layout, pieces, eqn)
    return True


_COMBINE = {
    jprims.reduce_sum_p: jprims.add_p,
    jprims.reduce_max_p: jprims.max_p,
    jprims.reduce_min_p: jprims.min_p,
    jprims.reduce_and_p: jprims.and_p,
    jprims.reduce_or_p: jprims.or_p,
}


def _reduction(eqn, walk: StackWalk) -> bool:
    """Reduce each piece; across the stacked axis, combine the partial results in order
    (so a global norm moves one scalar per piece)."""
    found = walk.stack_of(eqn.invars[0])
    if found is None:
        return False
    axis = found.layout.axis
    axes = eqn.params["axes"]
    (out,) = eqn.outvars
    if axis in axes:
        partial = []
        for piece in found.pieces:
            result = compat.Var(out.aval)
            walk.emit(derived_eqn(eqn.primitive, [piece], [result], eqn.params, eqn))
            partial.append(result)
        _combine(walk, partial, out, _COMBINE[eqn.primitive], eqn)
        return True
    layout = found.layout.along(axis - sum(a < axis for a in axes))
    pieces = []
    for g, lo, hi in layout.spans():
        result = compat.Var(piece_aval(out.aval, layout.axis, hi - lo))
        walk.emit(derived_eqn(eqn.primitive, [found.pieces[g]], [result], eqn.params, eqn))
        pieces.append(result)
    walk.stacked(out, layout, pieces, eqn)
    return True


def _combine(walk: StackWalk, partial: list, out, combine, like) -> None:
    """Define ``out`` as the per-piece ``partial`` results combined in order."""
    total = partial[0]
    for k, piece in enumerate(partial[1:], 1):
        result = out if k == len(partial) - 1 else compat.Var(out.aval)
        walk.emit(derived_eqn(combine, [total, piece], [result], {}, like))
        total = result
    if len(partial) == 1:
        walk.env[out] = total


def _dot(eqn, walk: StackWalk) -> bool:
    """A dot product of two vectors, one stacked (``jnp.vdot`` of flattened stacks, as
    Prodigy and D-Adaptation take over every parameter): per piece, the partial
    products added in order, so each stage sends a scalar."""
    contracting, batch = eqn.params["dimension_numbers"]
    vectors = [a for a in eqn.invars if a.aval.ndim == 1]
    found = next((f for a in vectors if (f := walk.stack_of(a)) is not None), None)
    if len(vectors) != 2 or contracting != ((0,), (0,)) or batch != ((), ()) or found is None:
        return False
    operands = [walk.pieces_of(a, found.layout, eqn) for a in eqn.invars]
    (out,) = eqn.outvars
    partial = []
    for g, _, _ in found.layout.spans():
        result = compat.Var(out.aval)
        pair = [pieces[g] for pieces in operands]
        walk.emit(derived_eqn(eqn.primitive, pair, [result], eqn.params, eqn))
        partial.append(result)
    _combine(walk, partial, out, jprims.add_p, eqn)
    return True


def _moving_axes(eqn, walk: StackWalk, out_axis_of, operand_axis_of) -> bool:
    """A one-operand equation that moves axes (``transpose``, ``broadcast_in_dim``), run
    per piece of its stacked operand, or of its wanted result: ``out_axis_of(a)`` is the
    result's axis of operand axis ``a``, ``operand_axis_of(r)`` the operand's axis of
    result axis ``r`` (``None``: the result's rows along ``r`` repeat the operand)."""
    (x,), (out,) = eqn.invars, eqn.outvars
    found = walk.stack_of(x)
    if found is not None:
        layout = found.layout.along(out_axis_of(found.layout.axis))
        operands = list(found.pieces)
    elif out in walk.wanted:
        layout = walk.wanted[out]
        from_axis = operand_axis_of(layout.axis)
        if from_axis is None:
            operands = [x] * len(layout.stages)
        elif x.aval.shape[from_axis] == out.aval.shape[layout.axis]:
            operands = walk.pieces_of(x, layout.along(from_axis), eqn)
        else:
            return False
    else:
        return False
    pieces = []
    for g, lo, hi in layout.spans():
        operand = operands[g]
        result = compat.Var(piece_aval(out.aval, layout.axis, hi - lo))
        params = dict(eqn.params)
        for size in ("shape", "new_sizes"):
            if size in params:
                params[size] = result.aval.shape
        walk.emit(derived_eqn(eqn.primitive, [operand], [result], params, eqn))
        pieces.append(result)
    walk.stacked(out, layout, pieces, eqn)
    return True


def _transpose(eqn, walk: StackWalk) -> bool:
    permutation = eqn.params["permutation"]
    return _moving_axes(eqn, walk, permutation.index, permutation.__getitem__)


def _broadcast_from(eqn, axis: int) -> int | None:
    """The operand's axis of result axis ``axis`` of ``broadcast_in_dim`` ``eqn``, or
    ``None`` where the result repeats the operand along it (an axis the operand lacks,
    or has of size 1: a mask ``jnp.where`` broadcasts from ``bool[1, 1, 1]``)."""
    dims = eqn.params["broadcast_dimensions"]
    if axis not in dims or eqn.invars[0].aval.shape[dims.index(axis)] == 1:
        return None
    return dims.index(axis)


def _broadcast(eqn, walk: StackWalk) -> bool:
    dims = eqn.params["broadcast_dimensions"]
    return _moving_axes(eqn, walk, dims.__getitem__, functools.partial(_broadcast_from, eqn))


def _reshape(eqn, walk: StackWalk) -> bool:
    """A reshape that only adds or drops axes of size 1 (``m.reshape(8, 1, 1)``: SM3's
    accumulators broadcast against each other), per piece: the stacked axis is the same
    axis of another number on either side. A stack flattened whole, its stacked axis
    first (``jnp.vdot``, ``ravel``), is a stack of consecutive elements."""
    (x,), (out,) = eqn.invars, eqn.outvars
    if eqn.params.get("dimensions") is not None:
        return False
    found = walk.stack_of(x)
    if found is not None and found.layout.axis == 0 and out.aval.ndim == 1:
        row = math.prod(x.aval.shape[1:])
        bounds = tuple(b * row for b in found.layout.bounds)
        layout = Layout(0, bounds, found.layout.stages)
        pieces = []
        for g, lo, hi in layout.spans():
            piece = compat.Var(piece_aval(out.aval, 0, hi - lo))
            params = {**eqn.params, "new_sizes": piece.aval.shape}
            walk.emit(derived_eqn(eqn.primitive, [found.pieces[g]], [piece], params, eqn))
            pieces.append(piece)
        walk.stacked(out, layout, pieces, eqn)
        return True
    sized = [[d for d, n in enumerate(v.aval.shape) if n != 1] for v in (x, out)]
    if [x.aval.shape[d] for d in sized[0]] != [out.aval.shape[d] for d in sized[1]]:
        return False
    to_out, to_operand = dict(zip(*sized)), dict(zip(sized[1], sized[0]))
    if found is not None and found.layout.axis not in to_out:
        return False
    return _moving_axes(eqn, walk, to_out.get, to_operand.get)


def group_rows(eqn) -> tuple[int, int, int] | None:
    """``(axis, lo, hi)`` for a ``slice`` taking rows ``lo:hi`` along one axis, all of the
    others, with unit strides; else ``None``."""
    if eqn.primitive is not jprims.slice_p or any(
        s not in (None, 1) for s in eqn.params["strides"] or ()
    ):
        return None
    shape = eqn.invars[0].aval.shape
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    cut = [d for d in range(len(shape)) if (start[d], limit[d]) != (0, shape[d])]
    if len(cut) != 1:
        return None
    (d,) = cut
    return d, start[d], limit[d]


def _slice(eqn, walk: StackWalk) -> bool:
    """A slice taking exactly one piece of a stack is that piece."""
    found = walk.stack_of(eqn.invars[0])
    rows = group_rows(eqn)
    if found is None or rows is None or rows[0] != found.layout.axis:
        return False
    spans = [(lo, hi) for _, lo, hi in found.layout.spans()]
    if rows[1:] not in spans:
        return False
    walk.env[eqn.outvars[0]] = found.pieces[spans.index(rows[1:])]
    return True


def _loop_edge(eqn, walk: StackWalk) -> bool:
    """A running value wanted in pieces starts as one carry per piece (from its start
    value's pieces) and ends as one result per piece."""
    edge, carry = eqn.params["edge"], eqn.params["carry"]
    (out,) = eqn.outvars
    if edge is LoopEdge.CARRY:
        layout = walk.wanted.get(out)
        if layout is not None:
            walk.split_carries[carry] = layout
    elif edge is LoopEdge.RESULT:
        layout = walk.split_carries.get(carry)
    else:
        return False
    if layout is None:
        return False
    operands = walk.pieces_of(eqn.invars[0], layout, eqn)
    pieces = []
    for g, lo, hi in layout.spans():
        piece = compat.Var(piece_aval(out.aval, layout.axis, hi - lo))
        params = {**eqn.params, "carry": walk.carry_number(carry, g)}
        walk.emit(derived_eqn(loop_edge_p, [operands[g]], [piece], params, eqn))
        pieces.append(piece)
    walk.stacked(out, layout, pieces, eqn)
    return True


def _reads_stack(eqn, walk: StackWalk) -> bool:
    return any(walk.stack_of(a) is not None for a in eqn.invars)


def _call(eqn, walk: StackWalk) -> bool:
    """A plain call reading a stack (``jnp.where`` and ``jnp.clip`` are ``jit`` calls):
    its body, written in its place."""
    body = call_body(eqn)
    if body is None or body[1] or eqn.effects or not _reads_stack(eqn, walk):
        return False
    results = walk.inline(walk.site, body[0], eqn.invars)
    walk.env.update((o, r) for o, r in zip(eqn.outvars, results) if is_var(o))
    return True


def _cond(eqn, walk: StackWalk) -> bool:
    """A conditional reading a stack whose branches may all run (a skip-step guard on a
    stacked parameter's update): every branch, and a ``select_n`` on the index per
    result, each run per piece by its rule."""
    branches = eqn.params["branches"]
    if (
        eqn.effects
        or any(b.effects or b.consts for b in branches)
        or not _reads_stack(eqn, walk)
        or not predicable(b.jaxpr for b in branches)
    ):
        return False
    site = walk.site
    operands = eqn.invars[1:]
    cases = [walk.inline((*site, k), b.jaxpr, operands) for k, b in enumerate(branches)]
    for k, selection in enumerate(selections(eqn, cases, eqn.outvars)):
        walk.visit(selection, (*site, len(branches), k))
    return True


ELEMENTWISE = (
    "abs acos acosh add add_jaxvals and asin asinh atan atan2 atanh cbrt ceil clamp "
    "convert_element_type copy cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt "
    "integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow "
    "reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor"
).split()

for _name in ELEMENTWISE:
    STACK_RULES[getattr(jprims, f"{_name}_p")] = _elementwise
for _primitive in _COMBINE:
    STACK_RULES[_primitive] = _reduction
STACK_RULES[jprims.transpose_p] = _transpose
STACK_RULES[jprims.broadcast_in_dim_p] = _broadcast
STACK_RULES[jprims.reshape_p] = _reshape
STACK_RULES[jprims.dot_general_p] = _dot
STACK_RULES[jprims.slice_p] = _slice
STACK_RULES[loop_edge_p] = _loop_edge
for _primitive in (jprims.jit_p, jprims.closed_call_p, jprims.custom_jvp_call_p):
    STACK_RULES[_primitive] = _call
STACK_RULES[jprims.cond_p] = _cond
