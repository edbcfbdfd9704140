"""mpmdc: an MPMD compiler middle-end for JAX.

Mark pipeline stages with :func:`stage`, compile with :func:`compile` over a list of
meshes (:func:`make_meshes`), and get per-mesh programs joined by explicit
transfers that run with the same numbers as ``jax.jit``.
"""

import importlib.util as _importlib_util
import os as _os

from mpmdc import (
    _jax_compat,
    backends,
    checkpoint,
    distributed,
    errors,
    lowering,
    passes,
    schedules,
)
from mpmdc.api import Lowered, Traced, Wrapped, compile
from mpmdc.distributed import fetch
from mpmdc.errors import ExportError, MpmdcError
from mpmdc.exporting import Exported, deserialize, export
from mpmdc.ir.primitives import stage
from mpmdc.runtime.executable import Compiled
from mpmdc.runtime.meshes import make_meshes
from mpmdc.schedules.accumulate import accumulate

# An equation's source line should be the user's call of mpmdc.stage or
# mpmdc.accumulate, not the line inside mpmdc that binds the primitive; and an error's
# traceback ends in the user's code, as one raised through jax.jit does.
for _package in (_jax_compat, lowering, passes):
    _folder = _os.path.dirname(_os.path.abspath(_package.__file__)) + _os.sep
    _jax_compat.exclude_from_source_lines(_folder)
    _jax_compat.exclude_from_tracebacks(_folder)
# Nor a library's line that calls JAX for the user (``nnx.scan`` calls ``lax.scan``):
# the model's line is. Found without importing them.
for _library in ("flax", "optax"):
    _spec = _importlib_util.find_spec(_library)
    for _location in (_spec.submodule_search_locations or []) if _spec else []:
        _jax_compat.exclude_from_source_lines(_os.path.abspath(_location) + _os.sep)

__all__ = [
    "Compiled",
    "ExportError",
    "Exported",
    "Lowered",
    "MpmdcError",
    "Traced",
    "Wrapped",
    "accumulate",
    "backends",
    "checkpoint",
    "compile",
    "deserialize",
    "distributed",
    "errors",
    "export",
    "fetch",
    "make_meshes",
    "schedules",
    "stage",
]
