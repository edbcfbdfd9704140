"""mpmdc: an MPMD compiler middle-end for JAX.

Mark pipeline stages with :func:`stage`, compile with :func:`compile` over a list of
meshes (:func:`make_meshes`), and get per-mesh programs joined by explicit
transfers that run with the same numbers as ``jax.jit``.
"""

from mpmdc import backends, errors, schedules
from mpmdc.accumulate import accumulate
from mpmdc.api import Compiled, Lowered, compile
from mpmdc.errors import MpmdcError
from mpmdc.meshes import make_meshes
from mpmdc.primitives import stage
from mpmdc.runtime import Executable

__all__ = [
    "Compiled",
    "Executable",
    "Lowered",
    "MpmdcError",
    "accumulate",
    "backends",
    "compile",
    "errors",
    "make_meshes",
    "schedules",
    "stage",
]
