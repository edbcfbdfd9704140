"""A checkpoint's files: Zarr v3 arrays through TensorStore, JSON documents, and the
renames that make a finished save appear at once."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import tensorstore as ts

from mpmdc.checkpoint.layout import COMMITTED, REPLACED_SUFFIX


def _array(root: str, name: str) -> dict:
    """The part of a TensorStore spec naming Zarr v3 array ``name`` under ``root``."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": os.path.join(root, name) + "/"},
    }


def array_spec(root: str, name: str, shape, dtype: np.dtype, chunks) -> dict:
    """The TensorStore spec of array ``name`` under ``root``: Zarr v3, uncompressed
    little-endian chunks of shape ``chunks``, every chunk written (TensorStore leaves out
    chunks equal to the fill value by default, and a missing chunk could then not be
    told from one that was lost)."""
    return {
        **_array(root, name),
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "data_type": np.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        },
    }


def supports(dtype: np.dtype) -> bool:
    """Whether Zarr arrays through TensorStore can hold ``dtype``."""
    try:
        ts.dtype(np.dtype(dtype).name)
    except (TypeError, ValueError):
        return False
    return True


def create_arrays(specs: list[dict], context: ts.Context) -> None:
    """Write the metadata of every array in ``specs`` (no chunks yet)."""
    for future in [ts.open(spec, create=True, context=context) for spec in specs]:
        future.result()


def writer(spec: dict, context: ts.Context) -> ts.TensorStore:
    """Array ``spec`` opened for writing chunks, its metadata taken as written (by
    :func:`create_arrays`, perhaps in another process): opening reads nothing."""
    return ts.open(spec, open=True, assume_metadata=True, context=context).result()


def reader(root: str, name: str, context: ts.Context) -> ts.TensorStore:
    """Array ``name`` under ``root`` opened for reading, from its own metadata; reading a
    chunk that is not there fails rather than giving the fill value."""
    spec = {**_array(root, name), "fill_missing_data_reads": False}
    return ts.open(spec, open=True, read=True, context=context).result()


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


def read_json(path: str) -> dict | None:
    """The JSON document at ``path``, or ``None`` where there is none or it is no JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def located(directory: str) -> str | None:
    """Where the complete checkpoint saved to ``directory`` is: ``directory``, or while a
    save with ``overwrite=True`` swaps a new one in (or after it died doing so) the old
    one beside it at ``<directory>.replaced``; ``None`` where there is none."""
    for place in (directory, directory + REPLACED_SUFFIX):
        if os.path.isfile(os.path.join(place, COMMITTED)):
            return place
    return None


def first_existing_above(path: str) -> str:
    """The nearest folder (or file) above ``path`` that exists."""
    above = os.path.dirname(path)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    return above


def remove(path: str) -> None:
    """Remove the directory ``path`` and everything in it, if it is there."""
    shutil.rmtree(path, ignore_errors=True)


def publish(partial: str, final: str) -> None:
    """Rename the finished ``partial`` to ``final``, replacing a ``final`` that is there:
    the old one is moved aside first and removed after, so a complete checkpoint is always
    at ``final`` or, for that moment, beside it (which readers look for)."""
    aside = final + REPLACED_SUFFIX
    if os.path.exists(final):
        remove(aside)
        os.replace(final, aside)
    os.replace(partial, final)
    remove(aside)  # also one that a save which died in that moment left
    _sync_directory(os.path.dirname(final))


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
