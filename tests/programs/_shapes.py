"""Shared argument types of the golden programs (``jax.ShapeDtypeStruct``s, no data)."""

import itertools

import jax
import jax.numpy as jnp


def f32(*shape):
    """A float32 argument type of ``shape``."""
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def mlp_params(widths):
    """``[(w, b), ...]`` argument types for consecutive ``widths``."""
    return [(f32(a, b), f32(b)) for a, b in itertools.pairwise(widths)]
