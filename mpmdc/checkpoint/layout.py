"""What a checkpoint is on disk: a Zarr v3 hierarchy with one array per pytree leaf.

::

    <directory>/
      zarr.json          the root group; attributes["mpmdc"] is the index: the format's
                         version and, per leaf, its pytree path, its array's name, shape,
                         dtype, chunk shape and chunks' checksums, and the PRNG
                         implementation of a typed key
      params/w/zarr.json one Zarr v3 array per leaf, at the leaf's full logical shape,
      params/w/c/0/0     in chunks that each saved shard covers whole, each ending in its
                         CRC32C checksum (Zarr v3's ``crc32c`` codec), which the index
                         records too: a chunk put in another's place is found
      COMMITTED          written last: the save completed, and which save it was

A save writes ``<directory>.<id>.partial`` (a name of its own) and renames it
``<directory>`` once every process has written its part, so ``<directory>`` is never seen
half-written; a removal renames it ``<directory>.<id>.removing`` before removing
anything, so it is never seen half-removed. Any Zarr v3 reader (TensorStore,
zarr-python) reads the arrays; the index says which leaf each one is.

Everything read back is checked here before any array is opened (:func:`parse_index`,
:func:`check_array`): a damaged or hostile file is a ``CheckpointError`` naming it, never
a crash or wrong values.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Annotated, Any, Literal
from urllib.parse import quote

import jax
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mpmdc.errors import CheckpointError
from mpmdc.ir.keys import is_key, key_data_type

FORMAT = "mpmdc-checkpoint"
# 2: chunk shapes in the index, a CRC32C checksum after every chunk; 3: every chunk's
# checksum in the index too (a chunk swapped with another holds a checksum of its own bytes)
VERSION = 3
READABLE = (1, 2, 3)  # versions this code reads: 1 has no checksums, which it reads as they are
COMMITTED = "COMMITTED"
PARTIAL_SUFFIX = ".partial"
REMOVING_SUFFIX = ".removing"  # a checkpoint being removed (``CheckpointManager``)
REPLACED_SUFFIX = ".replaced"  # a checkpoint being replaced by ``overwrite=True``
NUMBERS = (bool, int, float, complex, np.ndarray, np.generic)  # leaves kept on the host
INDEX_FILE = "zarr.json"
MAX_RANK = 32  # TensorStore's limit on an array's dimensions
# The largest chunk a save makes where its shards allow smaller ones. A chunk's bytes and
# its checksum are one piece of work for TensorStore: smaller chunks spread a large
# array's writes, reads and checksums over every core (measured in docs/performance.md).
CHUNK_BYTES = 16 * 2**20
CHECKSUM_BYTES = 4  # the CRC32C that ends each chunk from version 2
CHECKSUM_DIGITS = 2 * CHECKSUM_BYTES  # its hex digits in the index, from version 3
NAME_MAX = 255  # bytes of one file name on the filesystems checkpoints live on
MAX_DOCUMENT_BYTES = 2**30  # the largest JSON file a restore reads (an index of ~3M leaves)
# The characters of an array's node names (:func:`_segment` writes no others), so that a
# name is a plain relative path on every filesystem.
_ARRAY_NAME = re.compile(r"[A-Za-z0-9._~%-]{1,255}(/[A-Za-z0-9._~%-]{1,255})*")


@dataclass(frozen=True)
class LeafEntry:
    """One saved leaf: ``path`` is ``jax.tree_util.keystr`` of its pytree path, ``array`` the
    name of its Zarr array under the checkpoint, ``shape`` and ``dtype`` the leaf's own (a
    typed PRNG key, ``key<fry>``, is stored as its key data, with ``key_impl`` naming the
    implementation that wraps it again); ``weak_type`` is the saved array's weak type, as
    JAX promotes it; ``chunks`` the stored array's chunk shape (``None`` in version 1,
    which did not record it); ``checksums`` the checksum ending each chunk's file, 8 hex
    digits per chunk in the grid's row-major order (:func:`chunk_number`; ``None`` before
    version 3)."""

    path: str
    array: str
    shape: tuple[int, ...]
    dtype: str
    key_impl: str | None = None
    weak_type: bool = False
    chunks: tuple[int, ...] | None = None
    checksums: str | None = None

    def stored_type(self) -> tuple[tuple[int, ...], np.dtype]:
        """The shape and dtype of the stored array (:func:`stored_type` of the leaf)."""
        if self.key_impl is None:
            return self.shape, np.dtype(self.dtype)
        key = jax.eval_shape(lambda: jax.random.key(0, impl=self.key_impl))
        return stored_type(jax.ShapeDtypeStruct(self.shape, key.dtype))


@dataclass(frozen=True)
class Index:
    """Every leaf of a checkpoint, in the saved tree's order, and the format version it was
    written in."""

    leaves: tuple[LeafEntry, ...]
    version: int = VERSION

    def with_checksums(self, found: dict[str, dict[int, str]]) -> Index:
        """This index with every chunk's checksum recorded: ``found[array][number]`` is
        the checksum of chunk ``number`` (:func:`chunk_number`) of array ``array``. A
        chunk no process found is a ``CheckpointError``."""
        leaves = []
        for leaf in self.leaves:
            count = math.prod(chunk_grid(leaf.stored_type()[0], leaf.chunks))
            mine = found.get(leaf.array, {})
            missing = next((k for k in range(count) if k not in mine), None)
            if missing is not None:
                raise CheckpointError(
                    f"no process wrote chunk {missing} of leaf {leaf.path} ({count} chunks); "
                    f"every chunk of a saved array is written by the process holding it."
                )
            checksums = "".join(mine[k] for k in range(count))
            leaves.append(replace(leaf, checksums=checksums))
        return Index(tuple(leaves), self.version)

    def as_json(self) -> dict:
        """The root group's ``zarr.json``, with this index as the ``mpmdc`` attribute."""
        return {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {
                "mpmdc": {
                    "format": FORMAT,
                    "version": self.version,
                    "leaves": [asdict(leaf) for leaf in self.leaves],
                }
            },
        }


# What is read back, as pydantic models: strict (no "5" for 5), so that any document that
# is not what a save writes fails validation instead of reaching TensorStore or numpy.
_STRICT = ConfigDict(strict=True, frozen=True, extra="forbid")
# A length TensorStore can index (its domains end below 2**62); negative ones are refused
# with their own message.
_Length = Annotated[int, Field(lt=2**62)]


class _LeafModel(BaseModel):
    model_config = _STRICT
    path: str
    array: str
    shape: list[_Length] = Field(max_length=MAX_RANK)
    dtype: str
    key_impl: str | None = None
    weak_type: bool = False
    chunks: list[_Length] | None = Field(default=None, max_length=MAX_RANK)
    checksums: str | None = Field(default=None, pattern="^[0-9a-f]*$")


class _IndexModel(BaseModel):
    model_config = _STRICT
    format: Literal["mpmdc-checkpoint"]
    version: int
    leaves: list[_LeafModel]


class _Attributes(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="allow")
    mpmdc: dict


class _RootModel(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="allow")
    zarr_format: Literal[3]
    node_type: Literal["group"]
    attributes: _Attributes


class _Grid(BaseModel):
    model_config = _STRICT
    name: Literal["regular"]
    configuration: dict[str, list[_Length]]


class _KeyEncoding(BaseModel):
    model_config = _STRICT
    name: Literal["default"]
    configuration: dict[Literal["separator"], Literal["/"]] | None = None


class _Codec(BaseModel):
    model_config = _STRICT
    name: str
    configuration: dict[str, Any] | None = None


class _ArrayModel(BaseModel):
    """A Zarr v3 array's ``zarr.json`` as a save writes it; anything else (another chunk
    grid or key encoding, storage transformers, extension fields) is refused."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")
    zarr_format: Literal[3]
    node_type: Literal["array"]
    shape: list[_Length] = Field(max_length=MAX_RANK)
    data_type: str
    chunk_grid: _Grid
    chunk_key_encoding: _KeyEncoding
    codecs: list[_Codec]
    fill_value: Any = None
    attributes: dict[str, Any] | None = None
    dimension_names: list[str | None] | None = None
    storage_transformers: list[Any] = Field(default_factory=list, max_length=0)


def _invalid(where: str, err: ValidationError) -> CheckpointError:
    """The first thing wrong in a document that failed validation, as a ``CheckpointError``."""
    first = err.errors(include_url=False)[0]
    at = ".".join(map(str, first["loc"]))
    what = first["msg"] + (f" at {at}" if at else "")
    return CheckpointError(
        f"{where} is damaged or was not written by mpmdc.checkpoint.save: {what}."
    )


def parse_document(raw: bytes, where: str) -> dict:
    """The JSON object in ``raw``, the contents of file ``where``; a ``CheckpointError``
    naming it when it is not UTF-8 JSON holding an object."""
    try:
        document = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise CheckpointError(
            f"{where} is damaged or was not written by mpmdc.checkpoint.save: its JSON is "
            f"nested deeper than any checkpoint's."
        ) from None
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(
            f"{where} is damaged or was not written by mpmdc.checkpoint.save: it is not "
            f"JSON text ({type(err).__name__}: {str(err).splitlines()[0]})."
        ) from None
    if not isinstance(document, dict):
        raise CheckpointError(
            f"{where} is damaged or was not written by mpmdc.checkpoint.save: it holds a "
            f"{type(document).__name__}, not a JSON object."
        )
    return document


def parse_index(document: dict, where: str) -> Index:
    """The index in the root group's ``zarr.json`` (file ``where``), checked whole: every
    field of the type a save writes, a version this code reads, every array name a
    relative path inside the checkpoint, every dtype, PRNG implementation, shape and chunk
    shape one that a save could have written. Anything else is a ``CheckpointError``
    naming the file and what is wrong."""
    try:
        root = _RootModel.model_validate(document)
    except ValidationError as err:
        raise _invalid(where, err) from None
    if root.attributes.mpmdc.get("format") != FORMAT:
        raise CheckpointError(
            f"{where} is no mpmdc checkpoint's index: its attributes hold no "
            f"mpmdc index (format {FORMAT!r})."
        )
    version = root.attributes.mpmdc.get("version")
    if version not in READABLE:
        raise CheckpointError(
            f"{where} is a checkpoint of format version {version!r}; this mpmdc reads versions "
            f"{', '.join(map(str, READABLE))}. Restore it with the mpmdc that wrote it (a newer one?)."
        )
    try:
        index = _IndexModel.model_validate(root.attributes.mpmdc)
    except ValidationError as err:
        raise _invalid(where, err) from None
    if not index.leaves:  # a save of no leaves is refused, so an empty list lost them
        raise CheckpointError(
            f"{where} is damaged: its index lists no leaves, and every save writes at least one."
        )
    leaves = tuple(_checked_leaf(leaf, version, where) for leaf in index.leaves)
    for kind, names in (("path", [e.path for e in leaves]), ("array", [e.array for e in leaves])):
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise CheckpointError(
                f"{where} is damaged: the index lists the leaf {kind} {twice!r} twice."
            )
    return Index(leaves, version)


def _checked_leaf(leaf: _LeafModel, version: int, where: str) -> LeafEntry:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where} is damaged: leaf {leaf.path}: {what}.")

    parts = leaf.array.split("/")
    if (
        not _ARRAY_NAME.fullmatch(leaf.array)
        or any(part in (".", "..") for part in parts)
        or len(leaf.array) > 4096
    ):
        raise bad(
            f"its array name {leaf.array[:200]!r} is not a relative path inside the checkpoint "
            f"of the names a save writes (letters, digits and ._~%- between slashes)"
        )
    if any(n < 0 for n in leaf.shape):
        raise bad(f"its shape {leaf.shape} has a negative length")
    if version >= 2 and leaf.chunks is None:
        raise bad("it has no chunk shape")
    if version >= 3 and leaf.checksums is None:
        raise bad("it has no chunk checksums")
    if version < 3 and leaf.checksums is not None:
        raise bad(f"it has chunk checksums, which format version {version} does not record")
    if leaf.chunks is not None and (
        any(c < 1 for c in leaf.chunks) or len(leaf.chunks) < len(leaf.shape)
    ):
        raise bad(f"its chunk shape {leaf.chunks} does not fit its shape {leaf.shape}")
    entry = LeafEntry(
        leaf.path,
        leaf.array,
        tuple(leaf.shape),
        leaf.dtype,
        leaf.key_impl,
        leaf.weak_type,
        None if leaf.chunks is None else tuple(leaf.chunks),
        leaf.checksums,
    )
    try:
        stored = entry.stored_type()
    except (TypeError, ValueError, KeyError):
        what = (
            f"PRNG implementation {leaf.key_impl!r}" if leaf.key_impl else f"dtype {leaf.dtype!r}"
        )
        raise bad(f"its {what} is not one JAX knows") from None
    if leaf.key_impl is not None and leaf.dtype != str(
        jax.eval_shape(lambda: jax.random.key(0, impl=leaf.key_impl)).dtype
    ):
        raise bad(f"its dtype {leaf.dtype!r} is not the dtype of {leaf.key_impl} keys")
    if leaf.key_impl is None and str(stored[1]) != leaf.dtype:
        raise bad(f"its dtype {leaf.dtype!r} is not spelled as a save writes it ({stored[1]})")
    if entry.chunks is not None and len(entry.chunks) != len(stored[0]):
        raise bad(f"its chunk shape {leaf.chunks} does not fit its stored shape {list(stored[0])}")
    if entry.checksums is not None:
        count = math.prod(chunk_grid(stored[0], entry.chunks))
        if len(entry.checksums) != CHECKSUM_DIGITS * count:
            raise bad(
                f"its chunk checksums are {len(entry.checksums)} hex digits, not the "
                f"{CHECKSUM_DIGITS * count} of the {count} chunks of its grid"
            )
    return entry


def array_metadata(entry: LeafEntry, version: int = VERSION, chunks=None) -> dict:
    """The ``zarr.json`` fields a save writes for ``entry``'s array (format ``version``),
    which a restore requires of it: shape, data type, a regular grid of ``entry.chunks``
    (or ``chunks``), little-endian bytes and, from version 2, a CRC32C checksum."""
    shape, dtype = entry.stored_type()
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if version >= 2:
        codecs.append({"name": "crc32c"})
    return {
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {
            "name": "regular",
            "configuration": {
                "chunk_shape": list(chunks if entry.chunks is None else entry.chunks)
            },
        },
        "codecs": codecs,
    }


def check_array(raw: bytes, entry: LeafEntry, version: int, where: str) -> dict:
    """The metadata (:func:`array_metadata`) to read ``entry``'s array with, after checking
    that its ``zarr.json`` (``raw``, the contents of file ``where``) says exactly that: the
    index's shape, dtype and chunk shape, and the codecs a save writes. A difference is a
    ``CheckpointError`` naming the file and the field."""
    try:
        stored = _ArrayModel.model_validate_json(raw)
    except ValidationError as err:
        raise _invalid(where, err) from None
    chunks = stored.chunk_grid.configuration.get("chunk_shape")
    if chunks is None or len(chunks) != len(stored.shape) or any(c < 1 for c in chunks):
        raise CheckpointError(
            f"{where} is damaged: its chunk shape {chunks} does not fit its shape {stored.shape}."
        )
    wanted = array_metadata(entry, version, chunks)
    codecs = [_codec(c, np.dtype(wanted["data_type"]).itemsize) for c in stored.codecs]
    found = {
        "shape": stored.shape,
        "data_type": stored.data_type,
        "chunk_grid": {"name": stored.chunk_grid.name, "configuration": {"chunk_shape": chunks}},
        "codecs": codecs,
    }
    for field in wanted:
        if found[field] != wanted[field]:
            raise CheckpointError(
                f"{where} does not match the checkpoint's index for leaf {entry.path}: it "
                f"says {field} {json.dumps(found[field])}, the index implies "
                f"{json.dumps(wanted[field])}. The checkpoint is damaged; restore another."
            )
    return wanted


def _codec(codec: _Codec, itemsize: int) -> dict:
    """A stored codec as :func:`array_metadata` spells it: single bytes need no byte order
    (TensorStore writes none for them)."""
    if codec.name == "bytes" and codec.configuration is None and itemsize == 1:
        return {"name": "bytes", "configuration": {"endian": "little"}}
    if codec.configuration is None:
        return {"name": codec.name}
    return {"name": codec.name, "configuration": codec.configuration}


def chunk_file_bytes(metadata: dict) -> int:
    """The size of every chunk file of an array stored with ``metadata``
    (:func:`array_metadata`): its chunk's bytes, then the checksum where there is one
    (Zarr stores chunks at the grid's edge whole too)."""
    chunks = metadata["chunk_grid"]["configuration"]["chunk_shape"]
    checksum = any(c["name"] == "crc32c" for c in metadata["codecs"])
    return nbytes(chunks, metadata["data_type"]) + (CHECKSUM_BYTES if checksum else 0)


def chunk_grid(shape, chunks) -> list[int]:
    """Chunks per dimension of an array of ``shape`` in chunks of ``chunks`` (a chunk at
    the edge may reach past the array)."""
    return [-(-n // c) for n, c in zip(shape, chunks)]


def chunk_number(grid, position) -> int:
    """The row-major number of the chunk at ``position`` (an index per dimension) in a
    ``grid`` (:func:`chunk_grid`): where the index records its checksum."""
    number = 0
    for i, n in zip(position, grid):
        number = number * n + i
    return number


def nbytes(shape, dtype) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` (exact, however large)."""
    return math.prod(shape) * np.dtype(dtype).itemsize


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


def chunk_shape(shape: tuple[int, ...], indices, itemsize: int) -> tuple[int, ...]:
    """Chunks that every shard in ``indices`` (tuples of slices of ``shape``) covers whole,
    of at most :data:`CHUNK_BYTES` where the shards allow: per dimension the greatest common
    divisor of its length and every shard's bounds, so each process writes whole chunks and
    no two processes write one, then divided further, leading dimensions first (so a chunk
    stays one contiguous block), until a chunk fits."""
    chunks = []
    for d, n in enumerate(shape):
        size = n
        for index in indices:
            s = index[d] if d < len(index) else slice(None)
            size = math.gcd(size, s.start or 0, n if s.stop is None else s.stop)
        chunks.append(max(size, 1))
    for d in range(len(chunks)):
        inner = math.prod(chunks[d + 1 :]) * itemsize
        if chunks[d] * inner <= CHUNK_BYTES:
            break
        chunks[d] = max(k for k in _divisors(chunks[d]) if k * inner <= CHUNK_BYTES or k == 1)
    return tuple(chunks)


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in small]


def stored_type(x) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype ``x`` is stored with: its own, or for typed PRNG keys their key
    data's (the key's shape, then the implementation's, in ``uint32``)."""
    if is_key(x):
        data = key_data_type(x)
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(np.shape(x)), np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def partial_name(directory: str, save_id: str) -> str:
    """Where the save numbered ``save_id`` writes ``directory`` until it commits: a folder
    of that save alone, beside ``directory``."""
    return f"{directory}.{save_id}{PARTIAL_SUFFIX}"


def step_name(name: str) -> int | None:
    """The step a manager's folder ``name`` holds: the step's decimal digits exactly as
    ``str(step)`` writes them (``7``, not ``007`` or ``²``); ``None`` for any other name."""
    if name.isascii() and name.isdigit() and str(int(name)) == name:
        return int(name)
    return None
