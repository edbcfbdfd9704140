"""The ``mpmdc`` command line and what it runs.

- ``main``: the commands and their arguments (``dump``, ``schedule``, ``demo``,
  ``launch``, ``backends``);
- ``parsing``: a ``file.py:target`` with ``--args``/``--meshes`` turned into a lowered
  program;
- ``dump``: stage headers, dump files and dump directories;
- ``demo``: ``mpmdc demo``, a pipelined training step against ``jax.jit``;
- ``launch``: ``mpmdc launch``, one local process per mesh group;
- ``models``: the example models the demo, benchmarks and tests train.

Layer 7, the top: may import anything in mpmdc; nothing in mpmdc imports it.
"""

from mpmdc.cli.main import main

__all__ = ["main"]
