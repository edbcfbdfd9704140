"""Arguments committed to devices other than those the program reads them on.

A parameter fed back from a step that returned it on another mesh, or put on another
mesh's devices by hand, is moved before every call. The move is named once per
compiled program and argument in a ``PlacementWarning`` (``Lowered.transfer_report``
counts it too). Among several processes the owning process must send it: every process
issues such a move, in argument order, as it issues the program's own cross-process
transfers (:mod:`mpmdc.runtime.transfers`), and a move no route can make is an
``ArgumentError`` raised by every process before anything is issued. Each process
decides from the argument's sharding alone, which is the same on all processes (a
global array), so they all decide alike without meeting.
"""

from __future__ import annotations

import warnings

import jax
from jax.sharding import NamedSharding

from mpmdc import _jax_compat as compat
from mpmdc.errors import ArgumentError, MeshError, PlacementWarning
from mpmdc.ir.traffic import holders_of_rows, mesh_or_devices
from mpmdc.runtime.transfers import MeshTransfer


def mesh_holding(devices, meshes) -> int | None:
    """The index of the mesh among ``meshes`` holding every one of ``devices``, if any."""
    devices = set(devices)
    return next((i for i, m in enumerate(meshes) if devices <= set(m.devices.flat)), None)


def committed_where(leaf, meshes) -> int | tuple[int, ...] | None:
    """Where a committed ``jax.Array`` (or a ``ShapeDtypeStruct`` with a sharding) is, for
    the transfer report: the index of the mesh whose devices are the ones holding it,
    else its sorted device ids (on part of a mesh, spread over several, or outside
    them: moved even to the mesh it is part of); ``None`` for a leaf that is not
    committed."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or (isinstance(leaf, jax.Array) and not leaf.committed):
        return None
    return mesh_or_devices({d.id for d in sharding.device_set}, meshes)


def committed_blocks(leaf) -> tuple:
    """For a committed leaf spread over the devices of several meshes (a layer stack as
    another layout's step returned it), which block each device holds, for the transfer
    report: ``((device id, ((start, stop) per dimension)), ...)``."""
    blocks = []
    for device, index in leaf.sharding.devices_indices_map(tuple(leaf.shape)).items():
        spans = tuple(slice_.indices(size)[:2] for slice_, size in zip(index, leaf.shape))
        blocks.append((device.id, spans))
    return tuple(sorted(blocks))


def placed_as(x, sharding) -> bool:
    """Whether ``x`` is an array laid out as ``sharding`` already (nothing to move)."""
    return isinstance(x, jax.Array) and (
        x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim)
    )


def _where(devices, meshes) -> str:
    """Where an array held by ``devices`` is, in the user's words."""
    found = mesh_holding(devices, meshes)
    ids = sorted(d.id for d in devices)
    if found is not None and devices == set(meshes[found].devices.flat):
        return f"mesh{found}"
    return f"devices {ids}" + (f" (part of mesh{found})" if found is not None else "")


def _processes(sharding) -> frozenset[int]:
    return frozenset(d.process_index for d in sharding.device_set)


class ArgumentMoves:
    """Where a compiled program reads each argument, and what a call placed elsewhere
    costs: ``warn`` notes a moved argument once and ``flush`` warns of a call's notes;
    ``across_processes`` moves the arguments that only another process can send."""

    def __init__(self, meshes, backend, arg_shardings, arg_paths):
        self.meshes = tuple(meshes)
        self.backend = backend
        self.arg_shardings = list(arg_shardings)  # per caller leaf, where the program reads it
        self.arg_paths = list(arg_paths)
        self._warned: set[str] = set()
        self._noted: list[tuple[str, str, str, int]] = []  # (path, where, read, bytes)
        self._routes: dict = {}  # (leaf, its sharding) -> MeshTransfer, or the ArgumentError

    def warn(self, path: str, x, sharding, rows: tuple[int, int, int] | None = None) -> None:
        """Note argument ``path`` moved onto ``sharding`` before the call, once per
        argument of this program (:meth:`flush` warns of the call's notes): the caller's
        leaf ``x`` if committed, or its ``rows`` ``(axis, lo, hi)`` where the program reads
        a piece of it (a layer stack's stage), held by the devices holding those rows."""
        if path in self._warned or not isinstance(x, jax.Array) or not x.committed:
            return
        held, nbytes = x.sharding.device_set, x.nbytes
        if rows is not None:
            ids = holders_of_rows(committed_blocks(x), rows)
            held = {d for d in held if d.id in ids}
            axis, lo, hi = rows
            nbytes = nbytes // x.shape[axis] * (hi - lo)
        if held == sharding.device_set:
            return  # laid out anew on its own devices: nothing crosses between meshes
        self._warned.add(path)
        where, read = _where(held, self.meshes), _where(sharding.device_set, self.meshes)
        if not where.startswith("mesh") and read.startswith("mesh"):  # (part of a mesh)
            read += f" (devices {sorted(d.id for d in sharding.device_set)})"
        self._noted.append((path, where, read, nbytes))

    def flush(self) -> None:
        """One ``PlacementWarning`` naming the arguments :meth:`warn` noted in this call
        (a state committed to one device is one mistake, however many leaves it has)."""
        if not self._noted:
            return
        noted, self._noted = self._noted, []
        advice = (
            "(jax.device_put(args, step.input_shardings(*args)[0]) places them all), pass "
            "what the step returned for {it} (a result fed back is where the next call "
            "reads it), or, for a value new every call (a batch), load it there with the "
            "same shardings."
        )
        if len(noted) == 1:
            ((path, where, read, nbytes),) = noted
            message = (
                f"argument {path} is on {where}, but the program reads it on {read}: every "
                f"call moves it there first ({nbytes} bytes). Put it there once "
                f"{advice.format(it='it')}"
            )
        else:
            shown = "; ".join(
                f"{path} is on {where}, read on {read}" for path, where, read, _ in noted[:3]
            )
            more = f"; and {len(noted) - 3} more" if len(noted) > 3 else ""
            message = (
                f"{len(noted)} arguments are not where the program reads them, so every call "
                f"moves them there first ({sum(n for *_, n in noted)} bytes): {shown}{more}. "
                f"Put each there once {advice.format(it='each')}"
            )
        warnings.warn(message, PlacementWarning, stacklevel=compat.user_stacklevel())

    def across_processes(self, leaves) -> list:
        """``leaves`` with every argument another process must send moved where the
        program reads it (a placeholder where that is not here). Every process calls
        this with the same arrays, so all issue the same moves in the same order."""
        moves = []
        for k, x in enumerate(leaves):
            target = self.arg_shardings[k]
            if not isinstance(x, jax.Array) or not x.committed or placed_as(x, target):
                continue
            # Only a NamedSharding is surely one global sharding, the same on every process
            # (a single device's may be each process's own); an argument on the processes
            # that read it is moved by them alone, as within one process.
            if not isinstance(x.sharding, NamedSharding):
                continue
            if _processes(x.sharding) == _processes(target):
                continue
            moves.append((k, self._route(k, x, target)))
        for _, route in moves:  # every process fails alike before anything is issued
            if isinstance(route, ArgumentError):
                raise route
        if not moves:
            return leaves
        leaves = list(leaves)
        for k, transfer in moves:
            x = leaves[k]
            self.warn(self.arg_paths[k], x, self.arg_shardings[k])
            (leaves[k],) = transfer(x if transfer.sends else None)
        return leaves

    def _route(self, k: int, x, target):
        key = (k, x.sharding)
        if key not in self._routes:
            path, where = self.arg_paths[k], _where(x.sharding.device_set, self.meshes)
            read = _where(target.device_set, self.meshes)
            try:
                self._routes[key] = MeshTransfer(
                    self.backend,
                    x.sharding.mesh,
                    target.mesh,
                    [target],
                    [x.aval],
                    f"argument {path}",
                )
            except (MeshError, ValueError) as err:
                self._routes[key] = ArgumentError(
                    f"argument {path} is on {where} (processes {sorted(_processes(x.sharding))}), "
                    f"but the program reads it on {read} (processes "
                    f"{sorted(_processes(target))}), and it cannot be moved there between "
                    f"processes ({err}). Put it where the program reads it (jax.device_put("
                    f"args, step.input_shardings(*args)[0]) places them all), or pass what the "
                    f"step returned for it."
                )
        return self._routes[key]
