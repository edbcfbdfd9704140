"""Saving a pytree of arrays as a checkpoint, from one process or from many.

Every process calls :func:`save` with the same tree (the same structure, shapes and
dtypes, as for a compiled step). Each writes only the shards it holds (one copy of a
replicated shard: the replica numbered 0), in parallel, straight into the chunks that
shard covers; nothing is gathered to one process. Process 0 makes the save's own partial
folder with the metadata and, once every process has written, writes the index and the
commit marker and renames the folder into place, unless another save committed there
meanwhile (see :mod:`mpmdc.checkpoint.layout` and :func:`~mpmdc.checkpoint.storage.publish`).
A save that fails removes its partial folder; nothing else removes it.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

import jax
import numpy as np
import tensorstore as ts
from pydantic import Field, TypeAdapter, ValidationError

from mpmdc import _jax_compat as compat
from mpmdc import distributed, watchdog
from mpmdc._text import a_type
from mpmdc.checkpoint import storage
from mpmdc.checkpoint.layout import (
    CHECKSUM_DIGITS,
    COMMITTED,
    INDEX_FILE,
    NAME_MAX,
    NUMBERS,
    Index,
    LeafEntry,
    array_metadata,
    array_names,
    chunk_grid,
    chunk_number,
    chunk_shape,
    group_names,
    partial_name,
    path_text,
    stored_type,
)
from mpmdc.errors import CheckpointError, MpmdcError, MpmdRuntimeError
from mpmdc.ir.keys import is_key

# Threads reading chunk files' checksums back after a save: each read waits on the
# filesystem (a shared one above all), not on a core.
CHECKSUM_READERS = 16


@dataclass
class _LeafWrite:
    """One leaf's stored array (its name and metadata) and the shards this process writes
    of it: (index range in the stored array, value on the host)."""

    name: str
    metadata: dict
    shards: list[tuple[tuple[slice, ...], np.ndarray]]

    def spec(self, root: str) -> dict:
        """The array's TensorStore spec in the checkpoint folder ``root``."""
        return storage.array_spec(root, self.name, self.metadata)


class Save:
    """One save in progress.

    Creating it does what must happen before the caller may change or donate the saved
    arrays, and nothing on disk: checking the tree, agreeing on it with the other
    processes, taking this process's shards to the host (``copy=True`` also copies the
    tree's numpy arrays, which the caller could change while the save goes on).
    :meth:`finish` does the rest, and may run on another thread: process 0 makes the
    partial directory and every array's metadata, every process writes its shards, and
    once all have, process 0 commits. ``after_commit`` runs on process 0 once the
    checkpoint is in place (a manager removes old steps there).
    """

    def __init__(
        self,
        directory,
        tree,
        *,
        overwrite: bool = False,
        copy: bool = False,
        after_commit: Callable[[], None] | None = None,
    ):
        # A link to a checkpoint's folder saves into the folder it names; the link stays.
        self.directory = os.path.realpath(os.fspath(directory))
        self.after_commit = after_commit
        self.many = distributed.is_multiprocess()
        self.first = jax.process_index() == 0
        self.topic = distributed.topic("checkpoint", self.directory) if self.many else ""
        self.expected = None  # what the commit may replace: the checkpoint there now, or none
        if self.first:
            # Process 0 alone looks at what is there (it alone commits), so that processes
            # seeing a shared filesystem at different moments cannot decide differently;
            # its refusal ends the others' wait for the tree below.
            self._attempt(lambda: self._check_target(overwrite))
        self.save_id = uuid.uuid4().hex[:16]
        self.partial: str | None = None  # made by process 0 when the save starts
        self.index, writes = _planned(tree, self.directory)
        if self.many:
            distributed.check_agreement(
                f"{self.topic}/tree",
                [(leaf.path, f"{leaf.dtype}{list(leaf.shape)}") for leaf in self.index.leaves],
                f"the save to {self.directory} (every process saves the same tree to the "
                f"same directory)",
                exchange=self.topic,
            )
        self.writes = _on_host(writes, copy)
        self.bytes_written = sum(v.nbytes for w in self.writes for _, v in w.shards)

    def _check_target(self, overwrite: bool) -> None:
        """Refuse what may not be saved over (:func:`_check_replaceable`); with
        ``overwrite``, note which checkpoint the commit may replace."""
        _check_replaceable(self.directory, overwrite)
        if overwrite:
            self.expected = storage.marker(storage.located(self.directory))

    def _start(self) -> None:
        """Process 0 makes the save's partial folder with every group's and array's
        metadata and tells the others its name; they check that they see it."""
        made = ""
        if self.first:
            made = partial_name(self.directory, self.save_id)
            storage.make_partial(made)
            self.partial = made  # this save's from here on: removed if it fails
            names = [leaf.array for leaf in self.index.leaves]
            for group in group_names(names):
                # Not synced one by one: groups serve readers that walk the hierarchy;
                # restoring opens arrays by the index, which is synced.
                storage.write_json(
                    os.path.join(self.partial, group, INDEX_FILE),
                    {"zarr_format": 3, "node_type": "group", "attributes": {}},
                    sync=False,
                )
            storage.create_arrays([w.spec(self.partial) for w in self.writes], ts.Context())
        self.partial = self._meet("started", f"the start of the save to {self.directory}", made)[0]
        if not os.path.isdir(self.partial):
            raise CheckpointError(
                f"process {jax.process_index()} does not see {self.partial}, which process 0 made to save "
                f"{self.directory}: every process must save to one shared filesystem."
            )

    def finish(self) -> None:
        """Make the partial folder, write this process's shards, wait for every process,
        then commit; a save that fails removes its partial folder (:meth:`_discard`). The
        peers' meetings wait for this process as long as it is in here
        (:func:`mpmdc.watchdog.working_on`)."""
        with watchdog.working_on(self.topic):
            try:
                self._attempt(self._start)
                self._attempt(self._finish)
            except BaseException as err:
                self._discard(meet=isinstance(err, Exception))
                raise

    def _discard(self, meet: bool) -> None:
        """After this save failed, process 0 (which made it) removes its partial folder,
        once every process has stopped writing into it: with several processes, only
        when all of them meet here within the fault timeout (``meet``). A process that
        died or hangs may still write, so the folder then stays, read by nothing."""
        if self.many:
            if not meet:
                return
            try:
                distributed.rendezvous(f"{self.topic}/ended", "the end of a failed save")
            except MpmdcError:
                return
        if self.first and self.partial is not None:
            storage.remove(self.partial)

    def _finish(self) -> None:
        context = ts.Context()
        pending = []
        for write in self.writes:
            if write.shards:
                store = storage.opened(write.spec(self.partial), context, write=True)
                pending += [store[index].write(value) for index, value in write.shards]
        for future in pending:
            future.result()
        found = _checksums(self.partial, self.writes)
        if not self.first:
            storage.write_json(self._checksum_file(jax.process_index()), _as_json(found))
        self._meet("written", f"the end of its writes to {self.partial}")
        if self.first:
            for peer in range(1, jax.process_count()):
                path = self._checksum_file(peer)
                _merge(found, storage.read_json(path), path)
                os.remove(path)
            index = self.index.with_checksums(found)
            storage.write_json(os.path.join(self.partial, INDEX_FILE), index.as_json())
            storage.write_json(
                os.path.join(self.partial, COMMITTED),
                {"time": time.time(), "processes": jax.process_count(), "save": self.save_id},
            )
            storage.publish(self.partial, self.directory, self.expected)
            self.partial = None  # committed: no longer this save's to remove
            if self.after_commit is not None:
                self.after_commit()
        self._meet("committed", f"the commit of {self.directory}")
        self._forget()

    def _checksum_file(self, process: int) -> str:
        """Where ``process`` (not 0) leaves the checksums of the chunks it wrote for
        process 0, which records them in the index and removes the file before the
        commit. A name no array or group takes (a key starting ``__`` is escaped)."""
        return os.path.join(self.partial, f"__checksums.{process}.json")

    def _meet(self, stage: str, what: str, value: str = "") -> dict[int, str]:
        """Wait for every process to reach ``stage``; each process's ``value``, by process."""
        # Patient: writing may take longer than the fault timeout; a peer that fails its
        # part of the save, or has not been working on it for the fault timeout, ends the wait.
        if not self.many:
            return {0: value}
        return distributed.rendezvous(
            f"{self.topic}/{stage}", what, patient=True, exchange=self.topic, value=value
        )

    def _forget(self) -> None:
        """Drop this save's keys from the key-value store, but the last meeting's (a peer
        may still be reading those)."""
        if self.many:
            for name in ("tree", "started", "written"):
                distributed.forget(f"{self.topic}/{name}")

    def _attempt(self, work: Callable[[], None]) -> None:
        """Run ``work``; with several processes, a failure is first told to the others
        taking part in this save, so that they stop waiting for this process at once and
        name it (the run may go on: a failed save need not end training)."""
        try:
            work()
        except MpmdRuntimeError:
            raise
        except (CheckpointError, OSError, ValueError) as err:
            message = f"process {jax.process_index()} failed to save {self.directory}: {err}"
            if self.many:
                distributed.announce_exchange_failure(self.topic, message)
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(message) from err


@compat.api_boundary
def save(directory, tree, *, overwrite: bool = False) -> None:
    """Save ``tree`` (a pytree of arrays) as a checkpoint in ``directory``.

    Every process calls it with the same tree; each writes only the arrays, or the
    slices of arrays, that it holds. Leaves are ``jax.Array`` (any sharding, typed PRNG
    keys included), numpy arrays and Python numbers, each stored at its full logical
    shape and keyed by its pytree path, so :func:`~mpmdc.checkpoint.restore` can put it
    onto any layout. The checkpoint appears only once complete: a save that dies
    leaves ``directory`` as it was. ``overwrite=True`` replaces a checkpoint that is
    there; without it that is a ``CheckpointError``. Returns when the checkpoint is
    complete on every process.
    """
    Save(directory, tree, overwrite=overwrite).finish()


def _check_replaceable(directory: str, overwrite: bool) -> None:
    """Refuse to save over anything but a complete checkpoint (with ``overwrite``) or an
    empty directory: a folder of other files is never replaced, whatever ``overwrite`` says.
    Every existing folder above ``directory`` must be a folder, and its name short enough
    for the save's partial folder and an overwrite's aside folder to have names too."""
    name = len(os.fsencode(os.path.basename(directory)))
    added = len(os.fsencode(os.path.basename(partial_name(directory, "0" * 16)))) - name
    if name + added > NAME_MAX:
        raise CheckpointError(
            f"cannot save to {directory}: its name ({name} bytes) is too long for the folder "
            f"a save makes beside it, {added} bytes longer, as a file name has at most "
            f"{NAME_MAX}; use a name of at most {NAME_MAX - added} bytes."
        )
    above = storage.first_existing_above(directory)
    if not os.path.isdir(above):
        raise CheckpointError(f"cannot save to {directory}: {above} is a file, not a directory.")
    if storage.located(directory) is not None:
        if not overwrite:
            raise CheckpointError(
                f"a checkpoint is already at {directory}; save to a new directory, or pass "
                f"overwrite=True to replace it (the old one stays whole until the new one is complete)."
            )
    elif os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise CheckpointError(
            f"{directory} exists and is no checkpoint; save to a new or empty directory "
            f"(overwrite=True replaces only a complete checkpoint)."
        )


def _planned(tree, directory: str) -> tuple[Index, list[_LeafWrite]]:
    """The checkpoint's index and, per leaf, what this process writes of it (values still
    on their devices)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        raise CheckpointError(
            f"the tree saved to {directory} has no leaves; there is nothing to save."
        )
    names = array_names([path for path, _ in flat])
    leaves, writes = [], []
    here = jax.process_index()
    for (path, x), name in zip(flat, names):
        text = path_text(path)
        shape, dtype = _checked_type(x, text, directory)
        key = is_key(x)
        if isinstance(x, jax.Array):
            extra = (slice(None),) * (len(shape) - x.ndim)
            indices = x.sharding.devices_indices_map(x.shape)
            chunks = chunk_shape(shape, [i + extra for i in indices.values()], dtype.itemsize)
            shards = [
                (indices[s.device] + extra, jax.random.key_data(s.data) if key else s.data)
                for s in x.addressable_shards
                if s.replica_id == 0
            ]
        else:
            whole = (slice(None),) * len(shape)
            chunks = chunk_shape(shape, [whole], dtype.itemsize)
            shards = [(whole, np.asarray(x))] if here == 0 else []
        key_impl = str(jax.random.key_impl(x)) if key else None
        logical = str(x.dtype) if hasattr(x, "dtype") else str(dtype)
        weak = isinstance(x, jax.Array) and jax.typeof(x).weak_type
        entry = LeafEntry(text, name, tuple(np.shape(x)), logical, key_impl, weak, chunks)
        leaves.append(entry)
        writes.append(_LeafWrite(name, array_metadata(entry), shards))
    return Index(tuple(leaves)), writes


def _checked_type(x, text: str, directory: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype leaf ``x`` is stored with (:func:`stored_type`), or a
    ``CheckpointError`` naming it where it cannot be saved."""
    if isinstance(x, jax.Array):
        if x.is_deleted():
            raise CheckpointError(
                f"leaf {text} saved to {directory} was deleted (donated to a call?): save the "
                f"arrays a step returned, or save before the call that donates them."
            )
    elif not isinstance(x, NUMBERS):
        raise CheckpointError(
            f"leaf {text} saved to {directory} is {a_type(x)}, not an array: a checkpoint "
            f"holds jax.Array, numpy arrays and Python numbers. Leave it out of the tree."
        )
    shape, dtype = stored_type(x)
    if not storage.supports(dtype):
        raise CheckpointError(
            f"leaf {text} saved to {directory} has dtype {dtype}, which Zarr arrays cannot hold; "
            f"cast it (e.g. to a wider type) before saving."
        )
    return shape, dtype


def _checksums(root: str, writes: list[_LeafWrite]) -> dict[str, dict[int, str]]:
    """The checksum ending each chunk file this process wrote into ``root``, by array
    name and chunk number (:func:`~mpmdc.checkpoint.layout.chunk_number`), read back from
    the files, where TensorStore put them as it wrote: four bytes a chunk."""
    chunks = []  # (array name, chunk number, file)
    for write in writes:
        shape = write.metadata["shape"]
        sizes = write.metadata["chunk_grid"]["configuration"]["chunk_shape"]
        grid = chunk_grid(shape, sizes)
        for index, _ in write.shards:
            bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
            spans = [range(a // c, -(-b // c)) for (a, b), c in zip(bounds, sizes)]
            for position in itertools.product(*spans):
                where = os.path.join(root, write.name, "c", *map(str, position))
                chunks.append((write.name, chunk_number(grid, position), where))
    found: dict[str, dict[int, str]] = {}
    with ThreadPoolExecutor(max_workers=CHECKSUM_READERS) as pool:
        tails = pool.map(storage.chunk_checksum, [where for _, _, where in chunks])
        for (name, number, _), tail in zip(chunks, tails):
            found.setdefault(name, {})[number] = tail
    return found


def _as_json(found: dict[str, dict[int, str]]) -> dict:
    """``found`` (:func:`_checksums`) as a JSON object: chunk numbers as text."""
    return {name: {str(k): tail for k, tail in tails.items()} for name, tails in found.items()}


# What a peer leaves process 0 (:func:`_as_json`): chunk numbers as text, 8 hex digits each.
_PEER_CHECKSUMS = TypeAdapter(
    dict[str, dict[int, Annotated[str, Field(pattern=f"^[0-9a-f]{{{CHECKSUM_DIGITS}}}$")]]]
)


def _merge(found: dict[str, dict[int, str]], document: dict, path: str) -> None:
    """Add the checksums another process left in ``path`` (``document``, as
    :func:`_as_json` writes them) to ``found``."""
    try:
        theirs = _PEER_CHECKSUMS.validate_python(document)
    except ValidationError as err:
        raise CheckpointError(
            f"{path}, written by another process of this save, is damaged "
            f"({err.errors(include_url=False)[0]['msg']}); save again."
        ) from None
    for name, tails in theirs.items():
        found.setdefault(name, {}).update(tails)


def _on_host(writes: list[_LeafWrite], copy: bool) -> list[_LeafWrite]:
    """``writes`` with every shard's value on the host, fetched from the devices at once.

    ``copy`` copies the tree's numpy arrays, which the caller may change in place while a
    save goes on. A device array's host value needs no copy: on an accelerator it is a
    copy already, and on CPU it is a view that keeps the device buffer alive (a donation
    of that array then copies the buffer instead of reusing it).
    """
    values = [value for w in writes for _, value in w.shards]
    fetched = iter(
        np.array(f, copy=True) if copy and not isinstance(v, jax.Array) else np.asarray(f)
        for v, f in zip(values, jax.device_get(values))
    )
    return [
        _LeafWrite(w.name, w.metadata, [(index, next(fetched)) for index, _ in w.shards])
        for w in writes
    ]
