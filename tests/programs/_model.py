"""The model of the golden programs: a tanh MLP with one pipeline stage per layer."""

import jax.numpy as jnp

import mpmdc


def mlp_loss(params, x, y):
    """Mean squared error of a tanh MLP whose layer ``i`` is pipeline stage ``i``."""
    for i, (w, b) in enumerate(params):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(x @ w + b)
    return jnp.mean((x - y) ** 2)
