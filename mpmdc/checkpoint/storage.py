"""A checkpoint's files: Zarr v3 arrays through TensorStore, JSON documents, and the
renames that make a finished save appear at once."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import shutil
import stat
import threading
import uuid

import numpy as np
import tensorstore as ts

from mpmdc.checkpoint.layout import (
    CHECKSUM_BYTES,
    COMMITTED,
    MAX_DOCUMENT_BYTES,
    REMOVING_SUFFIX,
    REPLACED_SUFFIX,
    parse_document,
)
from mpmdc.errors import CheckpointError

LOCK_FILE = ".mpmdc-commit.lock"  # where folders cannot be locked (see commit_lock); kept


def array_spec(root: str, name: str, metadata: dict) -> dict:
    """The TensorStore spec of Zarr v3 array ``name`` under ``root`` with ``metadata``
    (:func:`~mpmdc.checkpoint.layout.array_metadata`). Every chunk is written (TensorStore
    leaves out chunks equal to the fill value by default, and a missing chunk could then
    not be told from one that was lost), and a read of a missing chunk fails rather than
    giving the fill value."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": os.path.join(root, name) + "/"},
        "metadata": metadata,
        "store_data_equal_to_fill_value": True,
        "fill_missing_data_reads": False,
    }


def supports(dtype: np.dtype) -> bool:
    """Whether Zarr arrays through TensorStore can hold ``dtype``."""
    return _supports(np.dtype(dtype).name)


@functools.cache
def _supports(name: str) -> bool:
    try:
        ts.dtype(name)
    except (TypeError, ValueError):
        return False
    return True


def create_arrays(specs: list[dict], context: ts.Context) -> None:
    """Write the metadata of every array in ``specs`` (no chunks yet)."""
    for future in [ts.open(spec, create=True, context=context) for spec in specs]:
        future.result()


def opened(spec: dict, context: ts.Context, **mode) -> ts.TensorStore:
    """Array ``spec`` opened with the metadata the spec gives, as checked or written
    already (by :func:`create_arrays`, perhaps in another process, or by a restore's
    checks): opening reads nothing, so what is read is read with exactly that metadata."""
    return ts.open(spec, open=True, assume_metadata=True, context=context, **mode).result()


def write_json(path: str, document: dict, *, sync: bool = True) -> None:
    """Write ``document`` to ``path`` whole or not at all (through a renamed temporary),
    on the disk before this returns unless ``sync=False``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(document, f)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def read_bytes(path: str) -> bytes:
    """The contents of file ``path``, which must be a regular file (not a link, a pipe or a
    device: nothing in a checkpoint is) of at most ``MAX_DOCUMENT_BYTES``; a
    ``CheckpointError`` naming it and why when it cannot be read or is anything else.
    Opening never waits (a pipe with no writer) and nothing larger is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CheckpointError(
                f"{path} is a link; a checkpoint holds only its own files."
            ) from None
        if isinstance(err, FileNotFoundError) and not os.path.isdir(os.path.dirname(path)):
            raise CheckpointError(
                f"cannot read {path}: its folder is gone, so the checkpoint was removed (or "
                f"replaced) while it was read: a CheckpointManager removes the steps beyond "
                f"its max_to_keep. Restore a newer one."
            ) from None
        if isinstance(err, FileNotFoundError):  # (in a checkpoint a save committed)
            raise CheckpointError(
                f"cannot read {path}: it is not there, so the checkpoint is damaged (a file "
                f"of it was removed after its save committed). Restore another checkpoint."
            ) from None
        raise CheckpointError(f"cannot read {path}: {reason(err)}.") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_DOCUMENT_BYTES:
        os.close(fd)
        if stat.S_ISDIR(info.st_mode):
            raise CheckpointError(f"cannot read {path}: it is a folder, not a file.")
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is not a regular file; a checkpoint holds only files.")
        raise CheckpointError(
            f"{path} holds {info.st_size:,} bytes, more than any checkpoint's JSON "
            f"({MAX_DOCUMENT_BYTES:,}): it is damaged or was not written by mpmdc."
        )
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(MAX_DOCUMENT_BYTES + 1)
        except OSError as err:
            raise CheckpointError(f"cannot read {path}: {reason(err)}.") from None


def chunk_checksum(path: str) -> str:
    """The checksum that ends chunk file ``path`` (a regular file, checked already), in
    hex; an ``OSError`` when it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        return os.pread(fd, CHECKSUM_BYTES, os.fstat(fd).st_size - CHECKSUM_BYTES).hex()
    finally:
        os.close(fd)


def read_json(path: str) -> dict:
    """The JSON object in file ``path``; a ``CheckpointError`` naming the file and why when
    it cannot be read or holds anything else."""
    return parse_document(read_bytes(path), path)


def reason(err: OSError) -> str:
    """Why an ``OSError`` happened, in words for a message."""
    if isinstance(err, PermissionError):
        return "permission denied"
    if isinstance(err, IsADirectoryError):
        return "it is a folder, not a file"
    if isinstance(err, FileNotFoundError):
        return "it is not there"
    return err.strerror or type(err).__name__


def located(directory: str) -> str | None:
    """Where the complete checkpoint saved to ``directory`` is: ``directory``, or while a
    save with ``overwrite=True`` swaps a new one in (or after it died doing so) the old
    one beside it at ``<directory>.replaced``; ``None`` where there is none. A folder this
    process may not read is a ``CheckpointError`` saying so."""
    for place in (directory, directory + REPLACED_SUFFIX):
        marker = os.path.join(place, COMMITTED)
        try:
            mode = os.lstat(marker).st_mode
        except FileNotFoundError:
            continue
        except PermissionError:
            raise CheckpointError(f"cannot read {place}: permission denied.") from None
        except OSError as err:
            if err.errno == errno.ENOTDIR:
                continue
            raise CheckpointError(f"cannot read {place}: {reason(err)}.") from None
        if not stat.S_ISREG(mode):
            raise CheckpointError(
                f"{marker} is {'a link' if stat.S_ISLNK(mode) else 'not a regular file'}; a "
                f"checkpoint's marker is a file of its own. The checkpoint at {place} is damaged."
            )
        return place
    return None


def first_existing_above(path: str) -> str:
    """The nearest folder (or file) above ``path`` that exists."""
    above = os.path.dirname(path)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    return above


def remove(path: str) -> None:
    """Remove ``path`` if it is there: a folder with everything in it, or a symbolic link
    itself (never what it points to)."""
    if os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def remove_checkpoint(path: str) -> None:
    """Remove the checkpoint at ``path`` (if there) so that it is never seen half
    removed: it is renamed at once ``<path>.<id>.removing``, a name no reader or listing
    takes for a checkpoint, its commit marker removed, then everything else. A removal
    killed midway leaves such a folder, which :func:`remove_leftovers` clears. A link
    loses its link only."""
    if os.path.islink(path):
        remove(path)
        return
    doomed = f"{path}.{uuid.uuid4().hex}{REMOVING_SUFFIX}"
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(doomed, COMMITTED))
    remove(doomed)


def remove_leftovers(directory: str) -> None:
    """Remove what removals killed midway left in ``directory`` (``*.removing``)."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if name.endswith(REMOVING_SUFFIX):
                remove(os.path.join(directory, name))


def make_partial(partial: str) -> None:
    """Create the folder ``partial``, which must not exist: a save's partial folder is its
    own (a name nothing else has, made here or not at all; a link planted at that name is
    refused, not followed)."""
    os.makedirs(os.path.dirname(partial), exist_ok=True)
    try:
        os.mkdir(partial)
    except FileExistsError:
        raise CheckpointError(
            f"{partial} is already there; a save's partial folder must be new. Remove it if "
            f"no save is writing it."
        ) from None


def marker(place: str | None) -> dict | None:
    """The commit marker of the complete checkpoint at ``place`` (``None`` for none)."""
    return None if place is None else read_json(os.path.join(place, COMMITTED))


_COMMITS_HERE = threading.Lock()  # POSIX record locks are per process, not per thread


@contextlib.contextmanager
def commit_lock(folder: str):
    """Hold the lock that commits into ``folder`` take: an exclusive ``flock`` of the
    folder itself between processes, or where the filesystem locks only files (NFS,
    which turns ``flock`` into POSIX record locks) a POSIX record lock on
    ``folder/.mpmdc-commit.lock``, which works across hosts; and a lock of this process
    between its threads."""
    with _COMMITS_HERE:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                os.close(fd)
                fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


def publish(partial: str, final: str, expected: dict | None) -> None:
    """Rename the finished ``partial`` to ``final``, if the checkpoint saved to ``final`` is
    still the one whose commit marker is ``expected`` (``None``: no checkpoint at all);
    otherwise a ``CheckpointError``, and nothing changes. A checkpoint that is there is moved
    aside first and removed after, so a complete checkpoint is always at ``final`` or, for
    that moment, beside it (which readers look for).

    Commits into one folder take turns (:func:`commit_lock`), so the check and the renames
    are one step: of two saves racing to one directory, the second finds the first's
    checkpoint, not the one it expected, and fails. The last rename is one that cannot
    replace a checkpoint either way (a folder renamed onto a non-empty folder fails).
    """
    folder = os.path.dirname(final)
    aside = final + REPLACED_SUFFIX
    with commit_lock(folder):
        found = located(final)
        if marker(found) != expected:
            raise CheckpointError(
                f"another save committed a checkpoint to {final} while this one was writing; "
                f"this save is discarded and that checkpoint stays. Save each checkpoint from "
                f"one run, or to a directory of its own."
            )
        if found == final:
            remove(aside)  # left by a save that died after its commit, before removing it
            os.replace(final, aside)
        elif os.path.isdir(final):
            os.rmdir(final)  # an empty folder, which the save was allowed to fill
        try:
            os.rename(partial, final)
        except OSError as err:
            if found == final:
                os.rename(aside, final)
            raise CheckpointError(
                f"cannot commit {final}: {reason(err)} (something was put there while the "
                f"save was writing); this save is discarded."
            ) from None
        remove(aside)
        _sync_directory(folder)


def _sync_directory(path: str) -> None:
    """Make a rename in ``path`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
