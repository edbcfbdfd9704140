"""StableHLO emission for fragments, importable as ``mpmdc.lowering``."""

from mpmdc.lowering.stablehlo import fragment_function, lower_fragment, value_specs

__all__ = ["fragment_function", "lower_fragment", "value_specs"]
