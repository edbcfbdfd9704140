"""StableHLO emission for fragments, importable as ``mpmdc.lowering``."""

from mpmdc.lowering.stablehlo import (
    fragment_function,
    fragment_jit,
    lower_fragment,
)

__all__ = ["fragment_function", "fragment_jit", "lower_fragment"]
