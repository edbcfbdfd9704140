"""Golden program: a stage graph that branches and joins (0 -> 1, 0 -> 2, 1 + 2 -> 3) with a skip."""

import jax
import jax.numpy as jnp
from _shapes import f32

import mpmdc


def loss(ws, x):
    """Two branches from stage 0 meet in stage 3, which also reads stage 0's output."""
    h = mpmdc.stage(x, 0)
    h = jnp.tanh(h @ ws[0])
    left = jnp.tanh(mpmdc.stage(h, 1) @ ws[1])
    right = jnp.sin(mpmdc.stage(h, 2) @ ws[2])
    out = mpmdc.stage((left, right, h), 3)
    return jnp.sum((out[0] * out[1] + out[2]) @ ws[3])


def lowered():
    """The lowered gradient step on 4 meshes."""
    meshes = mpmdc.make_meshes(4, {"data": 2})
    return mpmdc.compile(jax.grad(loss), meshes).lower([f32(8, 8)] * 4, f32(4, 8))
