"""Restoring a checkpoint onto any layout: each process reads only the index ranges its
own devices need, and every array comes back with the sharding the target asks for.

Nothing on disk is trusted before it is checked: the index and every array's metadata
are validated (:mod:`mpmdc.checkpoint.layout`) and must agree, every array's folder must
lie inside the checkpoint, and every chunk read must match its checksum. Arrays are then
read with the metadata the index implies, never with what their own files say.
"""

from __future__ import annotations

import glob
import math
import os
import re
import stat

import jax
import numpy as np
import tensorstore as ts

from mpmdc import _jax_compat as compat
from mpmdc._text import a_type
from mpmdc.checkpoint import storage
from mpmdc.checkpoint.layout import (
    CHECKSUM_DIGITS,
    COMMITTED,
    INDEX_FILE,
    NUMBERS,
    PARTIAL_SUFFIX,
    REMOVING_SUFFIX,
    Index,
    LeafEntry,
    check_array,
    chunk_file_bytes,
    chunk_grid,
    chunk_number,
    nbytes,
    parse_index,
    path_text,
)
from mpmdc.errors import CheckpointError

_SHOWN = 4  # paths listed in an error about paths that do not match


def resolve(directory) -> tuple[str, Index, dict]:
    """The folder holding the complete checkpoint saved to ``directory``, its index and
    its commit marker; ``CheckpointError`` when there is none, or only a save that has not
    finished (or died), or its index or marker is damaged. A checkpoint being replaced
    (``overwrite=True``) is for a moment only beside ``directory``
    (:func:`~mpmdc.checkpoint.storage.located`): it is read there then.
    """
    wanted = os.path.realpath(os.fspath(directory))
    for suffix, what in ((PARTIAL_SUFFIX, "a save writes"), (REMOVING_SUFFIX, "a removal empties")):
        if wanted.endswith(suffix):  # (whatever it holds: a commit marker too, at times)
            raise CheckpointError(
                f"{wanted} is a folder {what}, not a checkpoint: restore the checkpoint's "
                f"own directory ({wanted.removesuffix(suffix).rsplit('.', 1)[0]}). A folder "
                f"no save or removal is working on may be removed."
            )
    place = storage.located(wanted)
    if place is None:
        raise CheckpointError(f"no checkpoint at {wanted}: {_why_none(wanted)}.")
    root = os.path.realpath(place)
    where = os.path.join(root, INDEX_FILE)
    index = parse_index(storage.read_json(where), where)
    for leaf in index.leaves:
        dtype = leaf.stored_type()[1]
        if not storage.supports(dtype):
            raise CheckpointError(
                f"{where} is damaged: leaf {leaf.path} has dtype {dtype}, which no checkpoint holds."
            )
    return root, index, storage.read_json(os.path.join(root, COMMITTED))


def _why_none(wanted: str) -> str:
    """Why there is no checkpoint at ``wanted`` (which exists or not)."""
    if os.path.isfile(wanted):
        return "it is a file, not a checkpoint's directory"
    partials = glob.glob(glob.escape(wanted) + ".*" + PARTIAL_SUFFIX) + glob.glob(
        glob.escape(wanted) + PARTIAL_SUFFIX
    )
    if partials and not os.path.exists(wanted):
        return (
            f"only {partials[0]} is there: a save to it has not finished, or died (its "
            f"process killed); a folder no save is writing may be removed"
        )
    if os.path.isdir(wanted):
        if not os.access(wanted, os.R_OK | os.X_OK):
            return "permission denied"
        return f"it has no {COMMITTED} marker: it was not written by mpmdc.checkpoint.save, or not to the end"
    return "the directory does not exist"


class _Files:
    """Checks the files of the checkpoint at ``root`` (its real path) before TensorStore
    reads them. A save writes only folders and regular files, so anything else inside is
    refused: a link (which could lead out of the checkpoint, or swap another array in), a
    pipe or a device (which a read could wait on, or never finish). Each folder on the way
    to an array is looked at once (``lstat``); each array's folder is listed, its chunk
    files must have the size its metadata implies, and a file that is neither its
    ``zarr.json`` nor a chunk is refused. From format version 3 each chunk must end in
    the checksum the index records for it, so a chunk put in another's place (which ends
    in the checksum of its own bytes) is found too."""

    def __init__(self, root: str):
        self.root = root
        self.seen: set[str] = set()

    def _refuse(
        self,
        entry: LeafEntry,
        path: str,
        what: str,
        writes: str = "a save writes only folders and regular files",
    ) -> CheckpointError:
        return CheckpointError(
            f"the checkpoint at {self.root} is damaged: leaf {entry.path}: "
            f"{os.path.relpath(path, self.root)} {what}; {writes}."
        )

    def check_folders(self, entry: LeafEntry) -> None:
        """Every folder from the checkpoint's to ``entry``'s array is a folder, not a link."""
        path = self.root
        for part in entry.array.split("/"):
            path = os.path.join(path, part)
            if path in self.seen:
                continue
            self.seen.add(path)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                return  # not there: reading its metadata says so
            if stat.S_ISLNK(mode):
                raise self._refuse(entry, path, f"is a link to {os.path.realpath(path)}")
            if not stat.S_ISDIR(mode):
                raise self._refuse(entry, path, "is not a folder")

    def check_chunks(self, entry: LeafEntry, metadata: dict) -> None:
        """The entries of ``entry``'s array folder: its ``zarr.json`` and its chunks,
        every chunk a regular file of :func:`chunk_file_bytes`."""
        size = chunk_file_bytes(metadata)
        grid = chunk_grid(metadata["shape"], metadata["chunk_grid"]["configuration"]["chunk_shape"])
        only = f"a save writes only zarr.json and the chunks of its grid {grid} there"
        folder = os.path.join(self.root, entry.array)
        # (folder, the dimension its entries index, -1 for the array's; the chunk
        # position its path has named so far)
        pending: list[tuple[str, int, tuple[int, ...]]] = [(folder, -1, ())]
        while pending:
            path, dim, position = pending.pop()
            try:
                listed = list(os.scandir(path))
            except OSError as err:
                raise CheckpointError(f"cannot read {path}: {storage.reason(err)}.") from None
            for item in listed:
                kind = item.stat(follow_symlinks=False).st_mode
                if dim < 0 and item.name == INDEX_FILE:
                    continue  # (read and checked already)
                if dim < 0 and item.name != "c":
                    raise self._refuse(entry, item.path, "is no part of a Zarr array", only)
                # A chunk's key: c/<index>/<index>..., an index per dimension, in the grid.
                if dim >= 0 and not (
                    item.name.isdigit() and dim < len(grid) and int(item.name) < grid[dim]
                ):
                    raise self._refuse(entry, item.path, "is no chunk of this array", only)
                at = position if dim < 0 else (*position, int(item.name))
                if stat.S_ISDIR(kind):
                    pending.append((item.path, dim + 1, at))
                elif not stat.S_ISREG(kind):
                    raise self._refuse(entry, item.path, f"is {_kind(kind)}")
                elif item.stat(follow_symlinks=False).st_size != size:
                    raise CheckpointError(
                        f"the checkpoint at {self.root} is damaged: leaf {entry.path}, chunk "
                        f"{os.path.relpath(item.path, self.root)} holds "
                        f"{item.stat(follow_symlinks=False).st_size:,} bytes, not the "
                        f"{size:,} of its chunk (cut short, or not written by mpmdc)."
                    )
                elif entry.checksums is not None and len(at) == len(grid):
                    self._check_checksum(entry, item.path, chunk_number(grid, at))

    def _check_checksum(self, entry: LeafEntry, path: str, number: int) -> None:
        """Chunk file ``path`` (chunk ``number`` of ``entry``'s array) ends in the checksum
        the index records for that chunk."""
        want = entry.checksums[CHECKSUM_DIGITS * number : CHECKSUM_DIGITS * (number + 1)]
        chunk = os.path.relpath(path, self.root)
        try:
            found = storage.chunk_checksum(path)
        except OSError as err:
            raise CheckpointError(
                f"cannot read the checkpoint at {self.root}: leaf {entry.path}, chunk {chunk}: "
                f"{storage.reason(err)}."
            ) from None
        if found != want:
            raise CheckpointError(
                f"the checkpoint at {self.root} is damaged: leaf {entry.path}, chunk {chunk} is "
                f"not the chunk saved there: it ends in checksum {found}, the index records "
                f"{want} (another chunk, of this array or of another checkpoint, was put in "
                f"its place). Restore another checkpoint."
            )


def _kind(mode: int) -> str:
    """What a file that is neither a folder nor a regular file is, in words."""
    if stat.S_ISLNK(mode):
        return "a link"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def _opened(
    root: str, entry: LeafEntry, version: int, context: ts.Context, files: _Files
) -> ts.TensorStore:
    """``entry``'s array, opened for reading with the metadata the index implies once its
    own ``zarr.json`` agrees and its files are what a save writes (``files``)."""
    files.check_folders(entry)
    where = os.path.join(root, entry.array, INDEX_FILE)
    metadata = check_array(storage.read_bytes(where), entry, version, where)
    files.check_chunks(entry, metadata)
    try:
        return storage.opened(storage.array_spec(root, entry.array, metadata), context, read=True)
    except ValueError as err:  # TensorStore's: a shape or chunking it cannot hold
        raise CheckpointError(
            f"{where} cannot be read for leaf {entry.path}: {str(err).splitlines()[0]}"
        ) from None


def _read(root: str, entry: LeafEntry, future):
    """The value of a read of ``entry``'s array, or a ``CheckpointError`` naming the leaf and
    the chunk that failed (a checksum that does not match, a chunk that is not there)."""
    try:
        return future.result()
    except ValueError as err:  # TensorStore's
        text = str(err).splitlines()[0]
        found = re.search(r'local file "([^"]+)"', text)
        chunk = f", chunk {os.path.relpath(found.group(1), root)}" if found else ""
        if "PERMISSION_DENIED" in text:
            raise CheckpointError(
                f"cannot read the checkpoint at {root}: leaf {entry.path}{chunk}: permission denied."
            ) from None
        if "mismatch" in text and "DATA_LOSS" in text:
            raise CheckpointError(
                f"the checkpoint at {root} is damaged: leaf {entry.path}{chunk} does not match "
                f"its checksum (changed after it was written). Restore another checkpoint."
            ) from None
        raise CheckpointError(
            f"the checkpoint at {root} is damaged or was removed while read: leaf "
            f"{entry.path}{chunk}: {text}"
        ) from None


@compat.api_boundary
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

    A checkpoint replaced (``overwrite=True``) while it is read is read again, once,
    where it is then: what comes back is one whole checkpoint, the old or the new, never
    a mix; replaced during that reading too, it is a ``CheckpointError``.
    """
    return restore_committed(directory, target)[0]


class _Replaced(Exception):
    """The checkpoint being read was moved or replaced meanwhile."""


def restore_committed(directory, target=None):
    """:func:`restore`'s value and the commit marker of the checkpoint it read."""
    wanted = os.path.realpath(os.fspath(directory))
    try:
        return _restore_once(wanted, target, last=False)
    except _Replaced:
        pass
    try:
        return _restore_once(wanted, target, last=True)
    except _Replaced:
        raise CheckpointError(
            f"the checkpoint at {wanted} was replaced while it was read, and again while it was "
            f"read a second time; restore it again."
        ) from None


def _restore_once(wanted: str, target, last: bool):
    """:func:`restore_committed`, raising ``_Replaced`` where the checkpoint found first
    is, once read (or failing to be), not where it was or not the same commit; or, unless
    this is the ``last`` try, where it could not be found whole but is there now."""
    try:
        root, index, marker = resolve(wanted)
    except CheckpointError:
        if not last and storage.located(wanted) is not None:
            raise _Replaced from None  # moved between finding it and reading its index?
        raise
    try:
        restored = _read_all(root, index, target)
    except (CheckpointError, OSError) as err:
        if _moved(wanted, root, marker):
            raise _Replaced from None
        if isinstance(err, OSError):
            raise CheckpointError(f"cannot read the checkpoint at {root}: {err}") from None
        raise
    if _moved(wanted, root, marker):
        raise _Replaced
    return restored, marker


def _moved(wanted: str, root: str, marker: dict) -> bool:
    """Whether the complete checkpoint saved to ``wanted`` is no longer the one read at
    ``root`` with commit ``marker``."""
    place = storage.located(wanted)
    if place is None or os.path.realpath(place) != root:
        return True
    try:
        return storage.read_json(os.path.join(root, COMMITTED)) != marker
    except CheckpointError:
        return True


def _read_all(root: str, index: Index, target):
    """Every leaf of the checkpoint at ``root`` with ``index``, put where ``target`` says."""
    context, files = ts.Context(), _Files(root)
    if target is None:  # every read started before any is waited for
        _check_memory(root, [(leaf, nbytes(*leaf.stored_type())) for leaf in index.leaves], None)
        reads = {
            leaf: _opened(root, leaf, index.version, context, files).read() for leaf in index.leaves
        }
        restored = {leaf.path: _read(root, leaf, read) for leaf, read in reads.items()}
    else:
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        saved = {leaf.path: leaf for leaf in index.leaves}
        wanted = [path_text(path) for path, _ in flat]
        _check_paths(root, list(saved), wanted)
        plans = [_Plan(root, saved[text], leaf) for text, (_, leaf) in zip(wanted, flat)]
        _check_memory(root, [(plan.entry, plan.nbytes()) for plan in plans], target)
        for plan in plans:
            plan.start(_opened(root, plan.entry, index.version, context, files))
        restored = jax.tree_util.tree_unflatten(treedef, [plan.result() for plan in plans])
    return restored


class _Plan:
    """One leaf's restore: its reads (one per distinct index range this process's devices
    hold), started for every leaf before any is waited for."""

    def __init__(self, root: str, entry: LeafEntry, leaf):
        self.root, self.entry = root, entry
        shape, dtype, self.sharding, self.weak_type = _target_type(leaf, entry, root)
        if shape != entry.shape or str(dtype) != entry.dtype:
            raise CheckpointError(
                f"leaf {entry.path} of the checkpoint at {root} is {entry.dtype}{list(entry.shape)}; "
                f"the target asks for {dtype}{list(shape)}. Restore into a target of the saved "
                f"shape and dtype, and convert after."
            )
        whole = (slice(None),) * len(entry.shape)
        self.indices = {None: whole}  # what this process reads, by device (None: the host)
        if self.sharding is not None:
            _check_fits(self.sharding, entry, root)
            self.indices = self.sharding.addressable_devices_indices_map(entry.shape)
        self.reads: dict[str, object] = {}

    def nbytes(self) -> int:
        """Bytes of the distinct index ranges this process reads of the leaf (on the host,
        before they go to its devices)."""
        stored, dtype = self.entry.stored_type()
        per_element = math.prod(stored[len(self.entry.shape) :]) * dtype.itemsize
        ranges = {repr(index): index for index in self.indices.values()}.values()
        return per_element * sum(
            math.prod(len(range(*s.indices(n))) for s, n in zip(index, self.entry.shape))
            for index in ranges
        )

    def start(self, store: ts.TensorStore) -> None:
        """Start reading what this process needs of ``store``, the leaf's array."""
        if self.sharding is None:
            self.reads["whole"] = store.read()
            return
        self.places = []
        for device, index in self.indices.items():
            key = repr(index)
            if key not in self.reads:
                self.reads[key] = store[index].read()
            self.places.append((device, key))

    def result(self):
        """The restored leaf, once its reads are done."""
        if self.sharding is None:
            return _read(self.root, self.entry, self.reads["whole"])
        values = {key: _read(self.root, self.entry, read) for key, read in self.reads.items()}
        devices = [device for device, _ in self.places]
        parts = jax.device_put([values[key] for _, key in self.places], devices)
        if self.entry.key_impl is not None:
            parts = [jax.random.wrap_key_data(p, impl=self.entry.key_impl) for p in parts]
        dtype = parts[0].dtype if parts else _logical_dtype(self.entry)
        array = jax.make_array_from_single_device_arrays(
            self.entry.shape, self.sharding, parts, dtype=dtype
        )
        return compat.weakly_typed(array) if self.weak_type else array


def _check_memory(root: str, leaves: list[tuple[LeafEntry, int]], target) -> None:
    """Refuse to read ``leaves`` (each with the bytes this process would read of it) when
    together they are larger than this machine's memory: a damaged index could claim any
    shape, and a target of bare shardings takes the index's. Checked before any read, so
    nothing that large is ever allocated."""
    total = sum(size for _, size in leaves)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total <= memory:
        return
    entry, size = max(leaves, key=lambda leaf: leaf[1])
    largest = f"leaf {entry.path}, {entry.dtype}{list(entry.shape)}, {size:,} bytes"
    if target is None:
        what = "restore it onto shardings (a target) so that each device reads its part"
    else:
        what = (
            "check its index (a damaged one can claim any shape), or spread the target's "
            "shardings over more processes"
        )
    raise CheckpointError(
        f"restoring the checkpoint at {root} would read {total:,} bytes into this process "
        f"(the largest: {largest}), more than this machine's memory ({memory:,} bytes): {what}."
    )


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
        _check_shape_fits(leaf, entry, root)
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
        f"target leaf {text} for the checkpoint at {root} is {a_type(leaf)}: give a "
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
    _check_shape_fits(sharding, entry, root)


def _check_shape_fits(sharding, entry: LeafEntry, root: str) -> None:
    """A ``CheckpointError`` unless ``sharding`` splits ``entry``'s shape evenly (its
    rank included)."""
    try:
        jax.ShapeDtypeStruct(entry.shape, np.uint8, sharding=sharding)  # checks the rank
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
