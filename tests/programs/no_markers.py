"""Golden program: no stage markers at all; everything is one fragment on mesh 0."""

import jax
import jax.numpy as jnp
from _shapes import f32

import mpmdc


def loss(w, x):
    """A plain one-layer loss."""
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def lowered():
    """The lowered gradient step; the second mesh stays unused."""
    meshes = mpmdc.make_meshes(2, {"data": 2})
    return mpmdc.compile(jax.value_and_grad(loss), meshes).lower(f32(8, 8), f32(4, 8))
