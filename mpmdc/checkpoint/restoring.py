"""Restoring a checkpoint onto any layout: each process reads only the index ranges its
own devices need, and every array comes back with the sharding the target asks for."""

from __future__ import annotations

import os

import jax
import numpy as np
import tensorstore as ts

from mpmdc import _jax_compat as compat
from mpmdc.checkpoint import storage
from mpmdc.checkpoint.layout import (
    COMMITTED,
    INDEX_FILE,
    NUMBERS,
    PARTIAL_SUFFIX,
    Index,
    LeafEntry,
    path_text,
)
from mpmdc.errors import CheckpointError

_SHOWN = 4  # paths listed in an error about paths that do not match


def resolve(directory) -> tuple[str, Index, dict]:
    """The folder holding the complete checkpoint saved to ``directory``, its index and
    its commit marker; ``CheckpointError`` when there is none, or only a save that has not
    finished (or died). A checkpoint being replaced (``overwrite=True``) is for a moment
    only beside ``directory`` (:func:`~mpmdc.checkpoint.storage.located`): it is read
    there then.
    """
    wanted = os.path.abspath(os.fspath(directory))
    root = storage.located(wanted)
    if root is None:
        if os.path.isfile(wanted):
            why = "it is a file, not a checkpoint's directory"
        elif os.path.isdir(wanted + PARTIAL_SUFFIX) and not os.path.exists(wanted):
            why = f"only {wanted + PARTIAL_SUFFIX} is there: a save to it has not finished, or died"
        elif os.path.isdir(wanted):
            why = f"it has no {COMMITTED} marker: it was not written by mpmdc.checkpoint.save, or not to the end"
        else:
            why = "the directory does not exist"
        raise CheckpointError(f"no checkpoint at {wanted}: {why}.")
    document = storage.read_json(os.path.join(root, INDEX_FILE))
    index = Index.from_json(document) if document is not None else None
    marker = storage.read_json(os.path.join(root, COMMITTED))
    if index is None or marker is None:
        raise CheckpointError(
            f"{root} is no mpmdc checkpoint, or a damaged one: its index ({INDEX_FILE}) or its "
            f"{COMMITTED} marker cannot be read."
        )
    return root, index, marker


def restore(directory, target=None):
    """The checkpoint in ``directory``, put where ``target`` says.

    ``target`` is a pytree with the saved tree's paths whose leaves say where each array
    goes: a ``jax.ShapeDtypeStruct`` with a sharding, a bare ``Sharding`` (e.g. from
    ``compiled.input_shardings``: the saved shape and dtype), or an array whose shape,
    dtype and sharding to take (a numpy array or Python number comes back as a numpy
    array). A struct without a
    sharding goes to this process's first device. The sharding may be any layout:
    other meshes or stages, another number of processes, a plain ``jax.jit`` program's;
    each process reads only the parts its devices hold. Leaves are matched by pytree
    path; a path, shape or dtype that differs is a ``CheckpointError`` naming it.

    Without ``target``: ``{path: numpy array}`` of every leaf, whole, on the host.
    """
    root, index, marker = resolve(directory)
    context = ts.Context()
    try:
        if target is None:  # every read started before any is waited for
            reads = {
                leaf.path: storage.reader(root, leaf.array, context).read() for leaf in index.leaves
            }
            restored = {path: read.result() for path, read in reads.items()}
        else:
            flat, treedef = jax.tree_util.tree_flatten_with_path(target)
            saved = {leaf.path: leaf for leaf in index.leaves}
            wanted = [path_text(path) for path, _ in flat]
            _check_paths(root, list(saved), wanted)
            plans = [
                _Plan(root, saved[text], leaf, context) for text, (_, leaf) in zip(wanted, flat)
            ]
            for plan in plans:
                plan.start()
            restored = jax.tree_util.tree_unflatten(treedef, [plan.result() for plan in plans])
    except ValueError as err:  # TensorStore's: a chunk or an array's metadata is not there
        raise CheckpointError(
            f"the checkpoint at {root} is damaged or was removed while read: {str(err).splitlines()[0]}"
        ) from None
    if storage.read_json(os.path.join(root, COMMITTED)) != marker:
        raise CheckpointError(
            f"the checkpoint at {root} was replaced while it was read; restore it again."
        )
    return restored


class _Plan:
    """One leaf's restore: its reads (one per distinct index range this process's devices
    hold), started for every leaf before any is waited for."""

    def __init__(self, root: str, entry: LeafEntry, leaf, context: ts.Context):
        self.root, self.entry, self.context = root, entry, context
        shape, dtype, self.sharding, self.weak_type = _target_type(leaf, entry, root)
        if shape != entry.shape or str(dtype) != entry.dtype:
            raise CheckpointError(
                f"leaf {entry.path} of the checkpoint at {root} is {entry.dtype}{list(entry.shape)}; "
                f"the target asks for {dtype}{list(shape)}. Restore into a target of the saved "
                f"shape and dtype, and convert after."
            )
        if self.sharding is not None:
            _check_fits(self.sharding, entry, root)
        self.reads: dict[str, object] = {}

    def start(self) -> None:
        store = storage.reader(self.root, self.entry.array, self.context)
        if self.sharding is None:
            self.reads["whole"] = store.read()
            return
        self.places = []
        for device, index in self.sharding.addressable_devices_indices_map(
            self.entry.shape
        ).items():
            key = repr(index)
            if key not in self.reads:
                self.reads[key] = store[index].read()
            self.places.append((device, key))

    def result(self):
        if self.sharding is None:
            return self.reads["whole"].result()
        values = {key: read.result() for key, read in self.reads.items()}
        devices = [device for device, _ in self.places]
        parts = jax.device_put([values[key] for _, key in self.places], devices)
        if self.entry.key_impl is not None:
            parts = [jax.random.wrap_key_data(p, impl=self.entry.key_impl) for p in parts]
        dtype = parts[0].dtype if parts else _logical_dtype(self.entry)
        array = jax.make_array_from_single_device_arrays(
            self.entry.shape, self.sharding, parts, dtype=dtype
        )
        return compat.weakly_typed(array) if self.weak_type else array


def _logical_dtype(entry: LeafEntry):
    """The dtype of a leaf this process holds no part of (arrays of no local shard)."""
    if entry.key_impl is not None:
        return jax.eval_shape(lambda: jax.random.key(0, impl=entry.key_impl)).dtype
    return np.dtype(entry.dtype)


def _target_type(leaf, entry: LeafEntry, root: str):
    """``(shape, dtype, sharding, weak type)`` a target leaf asks for (a bare sharding asks
    for the saved shape, dtype and weak type); sharding ``None`` for a leaf restored on
    the host (a numpy array or Python number)."""
    text = entry.path
    if isinstance(leaf, jax.sharding.Sharding):
        leaf = jax.ShapeDtypeStruct(
            entry.shape, _logical_dtype(entry), sharding=leaf, weak_type=entry.weak_type
        )
    if isinstance(leaf, jax.ShapeDtypeStruct | jax.Array):
        sharding = leaf.sharding
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        if not isinstance(sharding, jax.sharding.Sharding) or not _has_devices(sharding):
            raise CheckpointError(
                f"target leaf {text} for the checkpoint at {root} has sharding {sharding!r}, which "
                f"names no devices: give a NamedSharding on a concrete mesh (jax.sharding.Mesh)."
            )
        weak = (
            leaf.weak_type if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf).weak_type
        )
        return tuple(leaf.shape), leaf.dtype, sharding, bool(weak)
    if isinstance(leaf, NUMBERS):
        value = np.asarray(leaf)
        return value.shape, value.dtype, None, False
    raise CheckpointError(
        f"target leaf {text} for the checkpoint at {root} is a {type(leaf).__name__}: give a "
        f"jax.ShapeDtypeStruct with a sharding, or an array, for every leaf."
    )


def _check_fits(sharding, entry: LeafEntry, root: str) -> None:
    """A ``CheckpointError`` unless ``entry`` can be a device array of ``sharding``: JAX
    would store its dtype as such (64-bit types need ``jax_enable_x64``) and the sharding
    splits its shape evenly."""
    if entry.key_impl is None:
        dtype = np.dtype(entry.dtype)
        if jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise CheckpointError(
                f"leaf {entry.path} of the checkpoint at {root} is {dtype}, which JAX holds as "
                f"{jax.dtypes.canonicalize_dtype(dtype)} while 64-bit types are off: its values "
                f"would change. Turn on jax_enable_x64, or restore it onto the host (a numpy "
                f"array as its target leaf)."
            )
    try:
        sharding.shard_shape(entry.shape)
    except Exception as err:  # JAX's own error names neither the leaf nor the checkpoint
        raise CheckpointError(
            f"target leaf {entry.path} for the checkpoint at {root}: {sharding} does not fit its "
            f"shape {list(entry.shape)} ({str(err).splitlines()[0]})."
        ) from None


def _has_devices(sharding) -> bool:
    try:
        return bool(sharding.device_set)
    except (AttributeError, ValueError, RuntimeError):
        return False


def _check_paths(root: str, saved: list[str], wanted: list[str]) -> None:
    saved_set, wanted_set = set(saved), set(wanted)
    missing = [p for p in wanted if p not in saved_set]
    extra = [p for p in saved if p not in wanted_set]
    if not missing and not extra:
        return
    lines = [
        f"the target does not match the checkpoint at {root} (leaves are matched by pytree path):"
    ]
    if missing:
        lines.append(f"  in the target, not in the checkpoint: {_listed(missing)}")
    if extra:
        lines.append(f"  in the checkpoint, not in the target: {_listed(extra)}")
    lines.append("Restore into a target built like the tree that was saved.")
    raise CheckpointError("\n".join(lines))


def _listed(paths: list[str]) -> str:
    shown = ", ".join(paths[:_SHOWN])
    return shown + (f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")
