"""Checkpoints of a training state, saved from one process or many, restored onto any layout.

:func:`save` writes a pytree of arrays (every process its own shards) as a Zarr v3
hierarchy keyed by pytree path; :func:`restore` reads it back onto any shardings;
:class:`CheckpointManager` keeps numbered steps and saves in the background.

Layers, lowest first: ``layout`` (what is on disk), ``storage`` (files and TensorStore),
``saving`` and ``restoring``, ``manager``.
"""

from mpmdc.checkpoint.manager import CheckpointManager
from mpmdc.checkpoint.restoring import restore
from mpmdc.checkpoint.saving import save

__all__ = ["CheckpointManager", "restore", "save"]
