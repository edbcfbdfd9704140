"""Stacked arrays held in pieces: the caller's one array, the program's one input per stage.

``slice-stacks`` takes a layer stack's stacked arrays (parameters, their optimizer state)
in one piece per stage, each on its stage's mesh. The caller still passes and gets one
``jax.Array`` per leaf: where the pieces' meshes have one shape and the pieces equal
rows, that array's sharding is the pieces' stacked, a ``NamedSharding`` on a mesh whose
leading ``stages`` axis runs over the stage meshes and divides the stacked axis (rows
``[k*i, k*(i+1))`` on the i-th stage's mesh). Handing such an array over, or assembling
one from the pieces, moves nothing: the pieces are the array's own shards. An argument
placed otherwise is cut into rows and moved. (``slice-stacks`` keeps whole what cannot be
one array so: uneven stages, several stages on one mesh, meshes of different shapes.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mpmdc import _jax_compat as compat
from mpmdc.ir.program import Piece
from mpmdc.ir.sharding import STAGES_AXIS, axes_of


def _stacked_mesh(meshes: list[Mesh]) -> Mesh:
    first = meshes[0]
    devices = np.stack([m.devices for m in meshes])
    types = (first.axis_types[0], *first.axis_types)
    return Mesh(devices, (STAGES_AXIS, *first.axis_names), axis_types=types)


def _stackable(shardings: list[NamedSharding], rows: list[tuple[int, int]]) -> bool:
    """Whether pieces of ``rows`` with ``shardings`` are one array's own shards: equal
    rows, each piece on a mesh of its own (no device twice), the meshes of one shape."""
    meshes = [s.mesh for s in shardings]
    devices = [d for m in meshes for d in m.devices.flat]
    return (
        len({hi - lo for lo, hi in rows}) == 1
        and len(set(devices)) == len(devices)
        and len({(m.axis_names, m.devices.shape) for m in meshes}) == 1
    )


def stacked_sharding(shardings: list[NamedSharding], axis: int):
    """The sharding of one array whose pieces along ``axis`` have ``shardings`` (one per
    stage, on meshes of one shape, equal rows: ``slice-stacks`` cuts no other way)."""
    if len(shardings) == 1:
        return shardings[0]
    spec = list(shardings[0].spec) + [None] * (axis + 1 - len(shardings[0].spec))
    spec[axis] = (STAGES_AXIS, *axes_of(spec[axis])) if spec[axis] is not None else STAGES_AXIS
    return NamedSharding(_stacked_mesh([s.mesh for s in shardings]), PartitionSpec(*spec))


class Pieces:
    """How a program's inputs and outputs relate to the caller's flat arguments and
    results (``Program.in_pieces``/``out_pieces``), given each input's and output's sharding."""

    def __init__(self, program, in_shardings, out_shardings, n_args: int, n_results: int):
        self.in_groups = _groups(program.in_pieces, len(in_shardings), n_args)
        self.out_groups = _groups(program.out_pieces, len(out_shardings), n_results)
        # Per program input, the caller's leaf it is read from and its rows, or None.
        self.in_sources = [None] * len(in_shardings)
        for leaf, group in enumerate(self.in_groups):
            for k, rows in group:
                self.in_sources[k] = (leaf, rows)
        self.trivial_in = program.in_pieces is None or all(len(g) == 1 for g in self.in_groups)
        self.in_stacked = [_stacked(g, in_shardings) for g in self.in_groups]
        self.out_stacked = [_stacked(g, out_shardings) for g in self.out_groups]
        self.arg_shardings = [
            _joined(g, in_shardings, s) for g, s in zip(self.in_groups, self.in_stacked)
        ]
        self.result_shardings = [
            _joined(g, out_shardings, s) for g, s in zip(self.out_groups, self.out_stacked)
        ]
        self._in_shardings = in_shardings

    def per_argument(self, values) -> list:
        """Of one value per program input, the first of each caller's argument."""
        return [values[group[0][0]] for group in self.in_groups]

    def arguments(self, leaves, here) -> list:
        """One value per program input, from the caller's flat arguments (``None`` for
        inputs not ``here``: on other processes' meshes)."""
        if self.trivial_in:
            return leaves
        out = [None] * sum(map(len, self.in_groups))
        for group, sharding, x, stacked in zip(
            self.in_groups, self.arg_shardings, leaves, self.in_stacked
        ):
            if len(group) == 1:  # (the whole array, or its one stage's rows: all of them)
                out[group[0][0]] = x
                continue
            own = (
                stacked
                and isinstance(x, jax.Array)
                and (x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim))
            )
            shards = {s.device: s.data for s in x.addressable_shards} if own else None
            for k, (axis, lo, hi) in group:
                if not here[k]:
                    continue
                target = self._in_shardings[k]
                out[k] = (
                    _own_piece(x, shards, target, axis, lo, hi) if own else _rows(x, axis, lo, hi)
                )
        return out

    def results(self, values) -> list:
        """The caller's flat results from one value per program output."""
        out = []
        for group, sharding, stacked in zip(
            self.out_groups, self.result_shardings, self.out_stacked
        ):
            if len(group) == 1:
                out.append(values[group[0][0]])
                continue
            pieces, axis = [values[k] for k, _ in group], group[0][1][0]
            out.append((_assembled if stacked else _concatenated)(pieces, sharding, axis))
        return out


def _groups(pieces: tuple[Piece, ...] | None, count: int, leaves: int) -> list[list]:
    """Per caller leaf, ``[(program position, rows or None), ...]``."""
    if pieces is None:
        return [[(k, None)] for k in range(count)]
    groups: list[list] = [[] for _ in range(leaves)]
    for k, piece in enumerate(pieces):
        groups[piece.leaf].append((k, piece.rows))
    return groups


def _stacked(group, shardings) -> bool:
    """Whether the pieces ``group`` of a caller's leaf are its own shards (:func:`_stackable`)."""
    return len(group) > 1 and _stackable(
        [shardings[k] for k, _ in group], [rows[1:] for _, rows in group]
    )


def _joined(group, shardings, stacked: bool):
    """The sharding of the caller's leaf whose pieces are ``group``: the pieces' stacked
    where they are its own shards (``stacked``), else the first piece's, the leaf whole
    there (placement put two on one mesh, say)."""
    if not stacked:
        return shardings[group[0][0]]
    return stacked_sharding([shardings[k] for k, _ in group], group[0][1][0])


def _own_piece(x: jax.Array, shards: dict, target: NamedSharding, axis: int, lo: int, hi: int):
    """Rows ``lo:hi`` of ``x``, whose shards (``shards``: device -> buffer, this process's)
    on ``target``'s devices are exactly them."""
    shards = [shards[d] for d in target.mesh.devices.flat if d in shards]
    shape = list(x.shape)
    shape[axis] = hi - lo
    return jax.make_array_from_single_device_arrays(tuple(shape), target, shards)


def _rows(x, axis: int, lo: int, hi: int):
    index = (slice(None),) * axis + (slice(lo, hi),)
    return x[index]


def _concatenated(pieces, sharding, axis: int):
    """One array from ``pieces`` (rows along ``axis``, in order) that are not its shards,
    joined whole on ``sharding``."""
    return jax.device_put(jnp.concatenate(jax.device_put(pieces, sharding), axis), sharding)


def _assembled(pieces, sharding, axis: int):
    """One array from ``pieces`` (rows along ``axis``, in order), their shards its own,
    weakly typed where they are (as ``jax.jit``'s result is)."""
    shape = list(pieces[0].shape)
    shape[axis] = sum(p.shape[axis] for p in pieces)
    shards = [s.data for p in pieces for s in p.addressable_shards]
    out = jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards)
    return compat.weakly_typed(out) if pieces[0].weak_type else out
