"""StableHLO emission for fragments, importable as ``mpmdc.lowering``.

- ``stablehlo``: a fragment's body through JAX's own ``jax.jit(...).trace().lower()``
  with its mesh shardings, for any backend's platform (the only place mpmdc lowers);
- ``send_recv``: the ``send``/``recv`` primitives of in-program transfers and their
  per-platform lowering rules.

Layer 3: imports :mod:`mpmdc.ir` and below.
"""

from mpmdc.lowering.stablehlo import export_fragment, lower_fragment

__all__ = ["export_fragment", "lower_fragment"]
