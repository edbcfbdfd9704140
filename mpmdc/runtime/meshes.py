"""Device meshes: ``make_meshes`` and the checks every list of meshes must pass."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from mpmdc import _jax_compat as compat
from mpmdc._text import a_type
from mpmdc.distributed import ENV_COORDINATOR
from mpmdc.errors import MeshError


@compat.api_boundary
def make_meshes(
    n: int,
    axes: Mapping[str, int],
    *,
    devices: Sequence | None = None,
    axis_types: AxisType | Sequence[AxisType] | None = None,
) -> tuple[Mesh, ...]:
    """``n`` disjoint meshes of shape ``axes`` over ``devices`` (default: ``jax.devices()``).

    Axes are ``AxisType.Auto`` (classic sharding propagation inside each mesh) unless
    ``axis_types`` says otherwise: one type for every axis, or one per axis in the order
    of ``axes`` (as ``jax.make_mesh`` takes them).

    With several processes each mesh stays inside one process when the counts allow,
    meshes spread evenly over the processes in process order: with one mesh per
    process, mesh ``i`` is process ``i``'s; with two per process, meshes ``2i`` and
    ``2i+1``. Otherwise (a mesh larger than a process's devices) meshes take devices in
    process order and may span processes; every process owning a device of a mesh then
    runs that mesh's fragments, as SPMD.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise MeshError(f"make_meshes: n must be a positive int, got {n!r}.")
    axes = dict(axes)
    if not axes or any(not isinstance(s, int) or s < 1 for s in axes.values()):
        raise MeshError(f"make_meshes: axes must map axis names to positive sizes, got {axes!r}.")
    types = _axis_types(axis_types, axes)
    devices = list(jax.devices() if devices is None else devices)
    per_mesh = math.prod(axes.values())
    if n * per_mesh > len(devices):
        hint = "use fewer or smaller meshes"
        if all(d.platform == "cpu" for d in devices) and jax.process_count() == 1:
            # JAX fixes the CPU device count when it starts, which it has by now.
            hint += (
                f", or get {n * per_mesh} virtual CPU devices: put "
                f'jax.config.update("jax_num_cpu_devices", {n * per_mesh}) right after '
                f"`import jax`, before anything starts JAX (or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n * per_mesh})"
            )
        if os.environ.get(ENV_COORDINATOR) and jax.distributed.is_initialized():
            per_process = -(-n * per_mesh // jax.process_count())
            hint += (
                f", or give each of the {jax.process_count()} processes {per_process} devices: "
                f"`mpmdc launch -n {jax.process_count()} --devices-per-process {per_process} -- ...`"
            )
        elif os.environ.get(ENV_COORDINATOR):
            hint = (
                "this process was started by `mpmdc launch`, but jax.distributed is not running: call "
                "mpmdc.distributed.initialize() first thing in the script, before anything starts JAX"
            )
        raise MeshError(
            f"make_meshes: {n} meshes of {axes} need {n * per_mesh} devices but only "
            f"{len(devices)} are available; {hint}."
        )
    return tuple(
        Mesh(np.array(group).reshape(tuple(axes.values())), tuple(axes), axis_types=types)
        for group in _device_groups(devices, n, per_mesh)
    )


def _axis_types(axis_types, axes: dict) -> tuple[AxisType, ...]:
    """One ``AxisType`` per axis of ``axes`` from ``make_meshes``' ``axis_types``."""
    if axis_types is None:
        return (AxisType.Auto,) * len(axes)
    if isinstance(axis_types, AxisType):
        return (axis_types,) * len(axes)
    types = tuple(axis_types) if isinstance(axis_types, Sequence) else None
    if types is None or len(types) != len(axes) or not all(isinstance(t, AxisType) for t in types):
        raise MeshError(
            f"make_meshes: axis_types must be one jax.sharding.AxisType for every axis or "
            f"one per axis of {list(axes)} ({len(axes)}), got {axis_types!r}."
        )
    return types


def _device_groups(devices: list, n: int, size: int) -> list[list]:
    """``n`` disjoint groups of ``size`` devices, each within one process where possible."""
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    chunks = [devices[i * size : (i + 1) * size] for i in range(n)]
    if len(by_process) == 1 or size > min(len(ds) for ds in by_process.values()):
        return chunks
    owned = list(by_process.values())
    if n % len(owned) == 0 and all(len(ds) >= n // len(owned) * size for ds in owned):
        per_process = [n // len(owned)] * len(owned)
    else:
        per_process = [len(ds) // size for ds in owned]
    groups = [
        ds[k * size : (k + 1) * size] for ds, count in zip(owned, per_process) for k in range(count)
    ]
    return groups[:n] if len(groups) >= n else chunks


def check_meshes(meshes) -> tuple[Mesh, ...]:
    """Validate a user's meshes: a non-empty sequence of disjoint, same-platform ``Mesh``es."""
    if isinstance(meshes, Mesh):
        meshes = (meshes,)
    if not isinstance(meshes, Sequence) or isinstance(meshes, str) or len(meshes) == 0:
        raise MeshError(
            f"meshes must be a non-empty sequence of jax.sharding.Mesh, got {meshes!r}; "
            f"mpmdc.make_meshes(n, axes) builds one."
        )
    owner = {}
    platforms = {}
    for i, mesh in enumerate(meshes):
        if not isinstance(mesh, Mesh):
            raise MeshError(f"meshes[{i}] is {a_type(mesh)}, not a jax.sharding.Mesh with devices.")
        if mesh.size == 0:
            raise MeshError(f"meshes[{i}] has no devices.")
        for d in mesh.devices.flat:
            if d in owner:
                raise MeshError(
                    f"meshes[{owner[d]}] and meshes[{i}] share device {d.id}; "
                    f"meshes must be disjoint."
                )
            owner[d] = i
            platforms.setdefault(d.platform, i)
    if len(platforms) > 1:
        found = ", ".join(f"{p} (meshes[{i}])" for p, i in platforms.items())
        raise MeshError(f"meshes mix platforms: {found}; all meshes must be on one platform.")
    return tuple(meshes)
