"""Exported programs: a compiled pipeline as bytes that run without the Python that built it.

- ``exported``: :func:`export`, :func:`deserialize` and :class:`Exported`, shaped as
  ``jax.export``;
- ``recorded``: the plain data an export holds (the scheduled program's fragments,
  transfers, donation, pieces, meshes and pytrees) and the program rebuilt from it;
- ``plain``: specs, types, arrays and pytree structures as JSON-able values;
- ``container``: the bytes: a zip of a versioned header, the plain data, one
  ``jax.export`` artifact per distinct module and the text of every stage.

Layer 6, beside :mod:`mpmdc.api` (whose ``Lowered`` it exports): imports the runtime,
the passes and below.
"""

from mpmdc.exporting.exported import Exported, deserialize, export

__all__ = ["Exported", "deserialize", "export"]
