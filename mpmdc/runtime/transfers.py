"""Moving values between meshes, also when the meshes belong to different processes.

JAX moves an array between processes with its cross-host ``device_put`` when the
source and destination shardings have the same number of devices and the same
layout (``HloSharding``). A transfer between meshes takes one of four routes:

- ``local``: both meshes are on this process: a plain ``device_put``;
- ``shardwise``: equal sizes, and device ``i`` of both meshes on the same process:
  each process copies its own shards; no process waits on another;
- ``cross``: equal sizes on different processes: the sender first lays the value
  out on its own devices as the destination will hold it (the *bridge* sharding),
  then JAX's cross-host ``device_put`` moves each shard to its twin device;
- ``via-device``: different sizes, each mesh on one process: the value goes whole
  from the source mesh's first device to the destination's, which spreads it.

JAX pairs a process's cross-host sends and receives by the order they are issued,
so every process issues every ``cross`` and ``via-device`` transfer of a program, in
program order, the processes not taking part with placeholders (arrays with no
shard here). Issuing never blocks, so no process waits on another to issue.

JAX moves only plain arrays between processes, so on every route but ``local`` a typed
PRNG key travels as its key data (``uint32``, the key's shape and then the
implementation's) and is wrapped again on arrival.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mpmdc import _jax_compat as compat
from mpmdc.errors import MeshError
from mpmdc.ir.keys import is_key, key_data_type


def processes_of(mesh: Mesh) -> tuple[int, ...]:
    """The process of each of ``mesh``'s devices, in the mesh's device order."""
    return tuple(d.process_index for d in mesh.devices.flat)


def is_here(mesh: Mesh) -> bool:
    """True when this process owns some of ``mesh``'s devices (it runs its fragments)."""
    return jax.process_index() in processes_of(mesh)


def placeholder(aval, sharding) -> jax.Array:
    """A global array of ``aval`` with ``sharding`` and none of its shards on this
    process: what stands for a value that lives elsewhere."""
    return jax.make_array_from_single_device_arrays(aval.shape, sharding, [], dtype=aval.dtype)


def key_data_on(aval, sharding: NamedSharding):
    """The type and sharding of the key data of typed keys of ``aval`` sharded so: the
    keys' dimensions split as they are, the implementation's whole."""
    data = key_data_type(aval)
    spec = (*sharding.spec, *[None] * (len(data.shape) - len(sharding.spec)))
    return data, NamedSharding(sharding.mesh, PartitionSpec(*spec))


def route(src: Mesh, dst: Mesh, where: str) -> str:
    """How values move from mesh ``src`` to mesh ``dst`` (see the module docstring)."""
    src_procs, dst_procs = processes_of(src), processes_of(dst)
    if set(src_procs) == set(dst_procs) and len(set(src_procs)) == 1:
        return "local"
    if src.size == dst.size:
        return "shardwise" if src_procs == dst_procs else "cross"
    if len(set(src_procs)) == 1 and len(set(dst_procs)) == 1:
        return "via-device"
    raise MeshError(
        f"{where}: mesh of {src.size} devices on processes {sorted(set(src_procs))} and mesh of "
        f"{dst.size} devices on processes {sorted(set(dst_procs))}: values can move between meshes "
        f"of different sizes only when each is inside one process. Use meshes of equal size, or "
        f"meshes that each fit in one process."
    )


class MeshTransfer:
    """One transfer equation, as a callable every process taking part calls in program
    order: it takes the values (``None`` where they live elsewhere) and returns them on
    the destination (placeholders where the destination is elsewhere)."""

    def __init__(
        self, backend, src: Mesh, dst: Mesh, dst_shardings, avals, where: str, donated_later=()
    ):
        self.kind = route(src, dst, where)
        self.key_impls = [
            compat.key_impl(a.dtype) if self.kind != "local" and is_key(a) else None for a in avals
        ]
        if any(self.key_impls):
            typed = [
                key_data_on(a, s) if impl else (a, s)
                for a, s, impl in zip(avals, dst_shardings, self.key_impls)
            ]
            avals, dst_shardings = [t[0] for t in typed], [t[1] for t in typed]
        # JAX sends a value to another process when that process asks for it, which may be
        # after a later fragment here took the buffer by donation; such values go as copies.
        self.copies = tuple(donated_later) or (False,) * len(avals)
        self.backend = backend
        self.sends, self.receives = is_here(src), is_here(dst)
        # Every process issues cross-process sends in one global order (module docstring).
        self.everyone = self.kind in ("cross", "via-device")
        self.dst_shardings = list(dst_shardings)
        self.avals = list(avals)
        if self.kind in ("shardwise", "cross"):
            bridge_mesh = Mesh(
                src.devices.reshape(dst.devices.shape), dst.axis_names, axis_types=dst.axis_types
            )
            self.bridges = [NamedSharding(bridge_mesh, s.spec) for s in self.dst_shardings]
            self.targets = self.dst_shardings
        elif self.kind == "via-device":
            one_src = Mesh(src.devices.flat[:1], ("one",))
            one_dst = Mesh(dst.devices.flat[:1], ("one",))
            self.whole = [NamedSharding(src, PartitionSpec()) for _ in avals]
            self.bridges = [NamedSharding(one_src, PartitionSpec()) for _ in avals]
            self.targets = [NamedSharding(one_dst, PartitionSpec()) for _ in avals]
        if self.everyone and not self.sends:
            self.stand_ins = [placeholder(a, b) for a, b in zip(self.avals, self.bridges)]

    def __call__(self, *values):
        if not any(self.key_impls):
            return self._move(values)
        data = [
            jax.random.key_data(x) if impl and x is not None else x
            for x, impl in zip(values, self.key_impls)
        ]
        return [
            jax.random.wrap_key_data(y, impl=impl) if impl else y
            for y, impl in zip(self._move(data), self.key_impls)
        ]

    def _move(self, values):
        if self.kind == "local":
            return self.backend.transfer(values, self.dst_shardings)
        if self.kind == "shardwise":
            return [
                self._shardwise(x, b, d)
                for x, b, d in zip(values, self.bridges, self.dst_shardings)
            ]
        if self.sends:
            if self.kind == "cross":
                sources = [
                    jax.device_put(x, b, may_alias=not c)
                    for x, b, c in zip(values, self.bridges, self.copies)
                ]
            else:
                sources = [
                    _first_shard(x, w, b, c)
                    for x, w, b, c in zip(values, self.whole, self.bridges, self.copies)
                ]
        else:
            sources = self.stand_ins
        moved = jax.device_put(sources, self.targets)
        if self.kind == "via-device" and self.receives:
            return jax.device_put(moved, self.dst_shardings)
        return moved

    @staticmethod
    def _shardwise(x, bridge, dst):
        laid_out = jax.device_put(x, bridge)
        twin = dict(zip(bridge.mesh.devices.flat, dst.mesh.devices.flat))
        shards = [jax.device_put(s.data, twin[s.device]) for s in laid_out.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, dst, shards)


def _first_shard(x, whole, bridge, copy: bool):
    """``x`` whole, as an array on the first device of its mesh (``bridge``)."""
    gathered = jax.device_put(x, whole, may_alias=not copy)
    first = bridge.mesh.devices.flat[0]
    data = next(s.data for s in gathered.addressable_shards if s.device == first)
    return jax.make_array_from_single_device_arrays(x.shape, bridge, [data])
