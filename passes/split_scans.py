"""``split-scans``: cut each scan over a layer stack into one scan per stage.

A ``scan`` whose body holds ``mpmdc.stage(h, every=k)`` runs group ``g`` of its
iterations (:func:`mpmdc.ir.layers.scan_split`) in stage ``first + g``. This pass
replaces it by one scan per group, in the order the original runs them (descending
for a ``reverse`` scan, as the transposed scan of a gradient is): the carry is handed
from group to group, the loop-invariant operands are read by every group, each
per-iteration operand is sliced to the group's rows, and each per-iteration result is
the concatenation of the groups' results. Each new scan is placed in its stage (its
``every=`` markers removed, so all groups share one body), which ``partition`` takes as
a seed, as it takes a marker, and runs as a fragment of its own (so the stages' equal
scans share one executable on meshes of one shape); and the carry is marked where it crosses stages, with
``stage`` markers as ``mpmdc.stage(h, s)`` between per-stage scans would mark it: on
entering a forward group, on leaving a transposed one. A scan of no iterations has no
groups and no boundary to cut: it stays one scan, its markers removed, unplaced, so
``partition`` places it as any other equation, where its carry lives.

Slices of a value concatenated from the same groups, such as the forward's stacked
residuals read by the transposed scan, are left for ``slice-stacks`` to cancel, so each
group's residuals stay on its stage's mesh.
"""

from __future__ import annotations

import warnings

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims
from mpmdc.passes.base import Property, register

from mpmdc import _jax_compat as compat
from mpmdc.errors import PlacementWarning, StageError
from mpmdc.ir.layers import ScanSplit, layer_markers, scan_split, without_layer_markers
from mpmdc.ir.primitives import is_layer_marker, stage_p
from mpmdc.ir.program import (
    Placement,
    Program,
    derived_eqn,
    find_eqns,
    fresh_like,
    is_var,
    make_closed_jaxpr,
    nbytes,
    placed,
)
from mpmdc.ir.stack_rules import concatenation, piece_aval, rows_of


def _marker(operands, outvars, stage: int, transpose: int, like):
    """A ``stage`` marker equation defining ``outvars`` as ``operands``."""
    return derived_eqn(stage_p, operands, outvars, {"stage": stage, "transpose": transpose}, like)


def _split(eqn, split: ScanSplit) -> list:
    """The equations replacing the scan ``eqn``: slices, one scan per group, concatenations."""
    p = eqn.params
    body = jcore.ClosedJaxpr(without_layer_markers(p["jaxpr"].jaxpr), p["jaxpr"].consts)
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts = eqn.invars[:n_consts]
    carry = list(eqn.invars[n_consts : n_consts + n_carry])
    xs = eqn.invars[n_consts + n_carry :]
    carry_out, ys_out = eqn.outvars[:n_carry], eqn.outvars[n_carry:]
    groups = range(len(split.bounds) - 1)
    if not groups:  # no iterations, no boundaries to cut: the scan stays whole, unplaced
        return [eqn.replace(params={**p, "jaxpr": body})]
    pieces: list[list] = [[None] * len(groups) for _ in ys_out]
    out = []
    entering = split.transpose % 2 == 0
    for g in reversed(groups) if p["reverse"] else groups:
        lo, hi = split.bounds[g], split.bounds[g + 1]
        stage = split.first + g
        xs_g = []
        for x in xs:
            slicing, piece = rows_of(x, lo, hi, eqn)
            out.append(slicing)
            xs_g.append(piece)
        if entering and carry:  # (the carry enters the group's stage, as stage(h, s) says)
            marked = [fresh_like(v) for v in carry]
            out.append(_marker(carry, marked, stage, split.transpose, eqn))
            carry = marked
        last = g == (groups[0] if p["reverse"] else groups[-1])
        leaving = list(carry_out) if last else [fresh_like(v) for v in carry_out]
        carry_g = [fresh_like(v) for v in carry_out] if not entering else leaving
        ys_g = []
        for k, y in enumerate(ys_out):
            piece = (
                fresh_like(y)
                if isinstance(y, jcore.DropVar)
                else compat.Var(piece_aval(y.aval, 0, hi - lo))
            )
            pieces[k][g] = piece
            ys_g.append(piece)
        scan = eqn.replace(
            invars=[*consts, *carry, *xs_g],
            outvars=[*carry_g, *ys_g],
            params={**p, "length": hi - lo, "jaxpr": body},
        )
        out.append(placed(scan, Placement(stage, split.transpose)))
        if not entering and carry_g:  # (the cotangent leaves the group's stage's backward)
            out.append(_marker(carry_g, leaving, stage, split.transpose, eqn))
        carry = leaving
    for y, ys in zip(ys_out, pieces):
        if not isinstance(y, jcore.DropVar):
            out.append(concatenation(ys, y, eqn))
    return out


# An invariant operand of at least this many bytes, stacked as long as the scan, is worth
# a warning: every stage reads all of it.
_WHOLE_STACK_BYTES = 1 << 16


def _warn_of_whole_stacks(eqn, paths: dict) -> None:
    """A ``PlacementWarning`` for a loop-invariant operand of the scan ``eqn`` that looks
    like a stack of per-layer parameters (a program input as long as the scan, large):
    the body indexes it (``w[i]``), so every stage reads it whole instead of its rows."""
    p = eqn.params
    for x in eqn.invars[: p["num_consts"]]:
        shape = getattr(x.aval, "shape", ())
        if (
            is_var(x)
            and x in paths
            and shape
            and shape[0] == p["length"]
            and nbytes(x.aval) >= _WHOLE_STACK_BYTES
        ):
            name = paths[x]
            warnings.warn(
                f"the scan at {compat.source_line(eqn)} is cut into stages, but its body reads "
                f"{name} whole, as a value indexed inside it (w[i]): every stage receives "
                f"all of it, and its gradient is summed whole. Pass stacked parameters as "
                f"the scan's xs, jax.lax.scan(body, h, params), to give each stage its rows.",
                PlacementWarning,
                stacklevel=compat.user_stacklevel(),
            )


def _check_no_layer_markers(eqn, own) -> None:
    """A ``StageError`` for an ``every=`` marker in ``eqn``'s bodies other than its ``own``
    (those of the scan ``eqn`` is): in a scan nested in another loop, which cannot be cut
    into stages."""
    mine = {id(m) for m in own}
    for sub in jcore.jaxprs_in_params(eqn.params):
        found = (m for m in find_eqns(sub.eqns, is_layer_marker) if id(m) not in mine)
        marker = next(found, None)
        if marker is not None:
            raise StageError(
                f"mpmdc.stage(..., every={marker.params['every']!r}) at "
                f"{compat.source_line(marker)} is in a scan nested in the "
                f"`{eqn.primitive.name}` at {compat.source_line(eqn)}; only a scan at the top "
                f"of the step (or of the microbatch's work) is cut into stages. Mark the "
                f"iterations of the scan over layers, outside any other loop."
            )


@register(
    "split-scans",
    "cut scans marked with stage(every=...) into one scan per stage",
    requires={Property.INLINED},  # a scan in a nested call is cut only at the top level
    produces={Property.SCANS_SPLIT},
    invalidates={Property.PLACED},  # the slices and concatenations it writes have no placement
)
def split_scans(program: Program) -> Program:
    """Replace every top-level scan holding ``every=`` markers by one scan per stage."""
    closed = program.jaxpr
    eqns, changed = [], False
    for eqn in closed.jaxpr.eqns:
        if is_layer_marker(eqn):
            raise StageError(
                f"mpmdc.stage(..., every={eqn.params['every']!r}) at "
                f"{compat.source_line(eqn)} is not inside a scan: `every=` numbers a scan's "
                f"iterations. Call it first thing in the scan's body, or give a stage index "
                f"outside one."
            )
        split = scan_split(eqn) if eqn.primitive is jprims.scan_p else None
        if split is None:
            _check_no_layer_markers(eqn, ())
        else:
            _check_no_layer_markers(eqn, layer_markers(eqn))
            _warn_of_whole_stacks(eqn, dict(zip(closed.jaxpr.invars, program.in_paths)))
        eqns.extend([eqn] if split is None else _split(eqn, split))
        changed |= split is not None
    if not changed:
        return program
    jaxpr = closed.jaxpr
    new = make_closed_jaxpr(
        jaxpr.constvars, closed.consts, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.debug_info
    )
    return program.replace(jaxpr=new)
