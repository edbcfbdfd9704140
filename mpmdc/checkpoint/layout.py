"""What a checkpoint is on disk: a Zarr v3 hierarchy with one array per pytree leaf.

::

    <directory>/
      zarr.json          the root group; attributes["mpmdc"] is the index: the format's
                         version and, per leaf, its pytree path, its array's name, shape
                         and dtype, and the PRNG implementation of a typed key
      params/w/zarr.json one Zarr v3 array per leaf, at the leaf's full logical shape,
      params/w/c/0/0     in chunks that each saved shard covers whole
      COMMITTED          written last: the save completed

A save writes ``<directory>.partial`` and renames it ``<directory>`` once every process has
written its part, so ``<directory>`` is never seen half-written. Any Zarr v3 reader
(TensorStore, zarr-python) reads the arrays; the index says which leaf each one is.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from urllib.parse import quote

import jax
import numpy as np

FORMAT = "mpmdc-checkpoint"
VERSION = 1
COMMITTED = "COMMITTED"
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"  # a checkpoint being replaced by ``overwrite=True``
NUMBERS = (bool, int, float, complex, np.ndarray, np.generic)  # leaves kept on the host
INDEX_FILE = "zarr.json"


@dataclass(frozen=True)
class LeafEntry:
    """One saved leaf: ``path`` is ``jax.tree_util.keystr`` of its pytree path, ``array`` the
    name of its Zarr array under the checkpoint, ``shape`` and ``dtype`` the leaf's own (a
    typed PRNG key, ``key<fry>``, is stored as its key data, with ``key_impl`` naming the
    implementation that wraps it again); ``weak_type`` is the saved array's weak type, as
    JAX promotes it."""

    path: str
    array: str
    shape: tuple[int, ...]
    dtype: str
    key_impl: str | None = None
    weak_type: bool = False


@dataclass(frozen=True)
class Index:
    """Every leaf of a checkpoint, in the saved tree's order."""

    leaves: tuple[LeafEntry, ...]

    def as_json(self) -> dict:
        """The root group's ``zarr.json``, with this index as the ``mpmdc`` attribute."""
        return {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {
                "mpmdc": {
                    "format": FORMAT,
                    "version": VERSION,
                    "leaves": [asdict(leaf) for leaf in self.leaves],
                }
            },
        }

    @classmethod
    def from_json(cls, document: dict) -> Index | None:
        """The index in a root ``zarr.json``; ``None`` when it holds none of this format."""
        index = document.get("attributes", {}).get("mpmdc")
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            return None
        return cls(
            tuple(
                LeafEntry(
                    path=leaf["path"],
                    array=leaf["array"],
                    shape=tuple(leaf["shape"]),
                    dtype=leaf["dtype"],
                    key_impl=leaf.get("key_impl"),
                    weak_type=leaf.get("weak_type", False),
                )
                for leaf in index["leaves"]
            )
        )


def path_text(path) -> str:
    """A pytree path as messages and the index show it: ``['params']['w']``."""
    return jax.tree_util.keystr(path) or "(the tree itself)"


_RESERVED = {INDEX_FILE, COMMITTED}  # file names a node name must not take
_LONGEST = 96  # bytes of a node name; longer keys are cut and end in a digest


def _segment(key) -> str:
    """One pytree key as a Zarr node name: text, with ``/`` and other odd characters
    percent-escaped; never ``.``, ``..``, a name Zarr reserves (``__`` first), a file name
    of the format (``zarr.json``, ``COMMITTED``, a ``.tmp``), nor longer than a file name
    may be (the index keeps the key whole)."""
    if isinstance(key, jax.tree_util.DictKey):
        text = str(key.key)
    elif isinstance(key, jax.tree_util.GetAttrKey):
        text = key.name
    elif isinstance(key, jax.tree_util.SequenceKey):
        text = str(key.idx)
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
        text = str(key.key)
    else:
        text = str(key)
    text = quote(text, safe="-_.")
    if (
        text in ("", ".", "..")
        or text.startswith("__")
        or text in _RESERVED
        or text.endswith(".tmp")
    ):
        text = "%" + text.encode().hex()
    if len(text) > _LONGEST:
        text = text[: _LONGEST - 17] + "~" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return text


def array_names(paths) -> list[str]:
    """The Zarr array name of each pytree path (``params/layers/0/w``), distinct: keys that
    escape to the same text (``1`` and ``"1"`` in one dict) get ``~2``, ``~3`` appended."""
    names, taken = [], set()
    for path in paths:
        name = "/".join(_segment(k) for k in path) or "value"
        if name in taken:
            name = next(
                f"{name}~{k}" for k in range(2, len(taken) + 3) if f"{name}~{k}" not in taken
            )
        taken.add(name)
        names.append(name)
    return names


def group_names(arrays: list[str]) -> list[str]:
    """The groups above ``arrays`` (``params``, ``params/layers``), parents first."""
    groups = {
        "/".join(name.split("/")[:k]) for name in arrays for k in range(1, name.count("/") + 1)
    }
    return sorted(groups, key=lambda g: (g.count("/"), g))


def chunk_shape(shape: tuple[int, ...], indices) -> tuple[int, ...]:
    """Chunks that every shard in ``indices`` (tuples of slices of ``shape``) covers whole:
    per dimension the greatest common divisor of its length and every shard's bounds, so
    each process writes whole chunks and no two processes write one."""
    chunks = []
    for d, n in enumerate(shape):
        size = n
        for index in indices:
            s = index[d] if d < len(index) else slice(None)
            size = math.gcd(size, s.start or 0, n if s.stop is None else s.stop)
        chunks.append(max(size, 1))
    return tuple(chunks)


def is_key(x) -> bool:
    """Whether ``x`` (an array or ``jax.ShapeDtypeStruct``) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def stored_type(x) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype ``x`` is stored with: its own, or for typed PRNG keys their key
    data's (the key's shape, then the implementation's, in ``uint32``)."""
    if is_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(np.shape(x)), np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def is_partial_name(name: str) -> bool:
    """Whether a directory entry is a save in progress, or one that died."""
    return name.endswith(PARTIAL_SUFFIX)
