"""The bytes of an exported program: a zip archive, checked before anything is read.

Entries (format version :data:`FORMAT_VERSION`):

- ``header.json``: what the bytes are (``format``), the format version, and the
  versions of JAX, jaxlib and mpmdc that wrote them;
- ``program.json``: the recorded program (:mod:`mpmdc.exporting.recorded`);
- ``modules/<k>``: the ``jax.export`` serialization of distinct module ``k``;
- ``arrays/<k>``: the raw bytes of constant ``k`` (its type is in ``program.json``);
- ``stages/<k>``: the text of recorded stage ``k``.

A zip keeps a CRC-32 of every entry, which reading checks, so damaged bytes are found
before they are used; entries are stored with a fixed date, so one program exports to
the same bytes every time.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from importlib import metadata

import jax
import jaxlib

from mpmdc.errors import ExportError

FORMAT = "mpmdc-export"
FORMAT_VERSION = 1
_DATE = (2020, 1, 1, 0, 0, 0)  # every entry's date, so the bytes depend on the program alone


def versions() -> dict[str, str]:
    """The versions of JAX, jaxlib and mpmdc running here."""
    try:
        mine = metadata.version("mpmdc")
    except metadata.PackageNotFoundError:
        mine = "unknown"
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "mpmdc": mine}


def write(program: dict, modules: list[bytes], arrays: list[bytes], stages: list[str]) -> bytes:
    """The archive of a recorded ``program`` (JSON-able) and its entries."""
    header = {"format": FORMAT, "version": FORMAT_VERSION, **versions()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:

        def put(name: str, data: bytes) -> None:
            info = zipfile.ZipInfo(name, date_time=_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)

        put("header.json", json.dumps(header, sort_keys=True).encode())
        put("program.json", json.dumps(program, sort_keys=True).encode())
        for k, data in enumerate(modules):
            put(f"modules/{k}", data)
        for k, data in enumerate(arrays):
            put(f"arrays/{k}", data)
        for k, text in enumerate(stages):
            put(f"stages/{k}", text.encode())
    return out.getvalue()


class Archive:
    """The entries of an exported program's bytes, each read (and its CRC checked) once
    asked for. Opening checks the header: the format and its version."""

    def __init__(self, data: bytes):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ExportError(
                f"mpmdc.deserialize takes the bytes of Exported.serialize(), got a "
                f"{type(data).__name__}."
            )
        try:
            self._zip = zipfile.ZipFile(io.BytesIO(bytes(data)))
            self._names = set(self._zip.namelist())
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
            raise ExportError(
                f"these {len(data)} bytes are no exported mpmdc program, or they are truncated "
                f"or damaged ({err}); serialize the program again."
            ) from None
        header = self.json("header.json")
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ExportError(
                f"these bytes are a zip archive but no exported mpmdc program (their header "
                f"says {header!r:.120}); pass what Exported.serialize() returned."
            )
        self.header = header
        self.written_by = {k: str(header.get(k)) for k in ("jax", "jaxlib", "mpmdc")}
        if header.get("version") != FORMAT_VERSION:
            raise ExportError(
                f"the program was exported in format version {header.get('version')!r} (by "
                f"mpmdc {self.written_by['mpmdc']}); this mpmdc "
                f"{versions()['mpmdc']} reads version {FORMAT_VERSION}. Export it again with "
                f"this version, or load it with the mpmdc that wrote it."
            )

    def read(self, name: str) -> bytes:
        """Entry ``name``'s bytes; a missing or damaged entry is an ``ExportError``."""
        if name not in self._names:
            raise ExportError(
                f"the exported program has no entry {name!r}: the bytes are damaged or were "
                f"not written by Exported.serialize(); serialize the program again."
            )
        try:
            return self._zip.read(name)
        except (
            zipfile.BadZipFile,
            zlib.error,
            NotImplementedError,  # (a damaged compression method)
            ValueError,
            OSError,
            EOFError,
            RuntimeError,
        ) as err:
            raise ExportError(
                f"entry {name!r} of the exported program is damaged ({err}); serialize the "
                f"program again."
            ) from None

    def json(self, name: str):
        """Entry ``name`` parsed as JSON."""
        try:
            return json.loads(self.read(name))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ExportError(
                f"entry {name!r} of the exported program is no JSON ({err}); the bytes are "
                f"damaged: serialize the program again."
            ) from None
