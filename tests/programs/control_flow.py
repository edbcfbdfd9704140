"""Golden program: scan, cond and fori_loop inside stages, differentiated."""

import jax
import jax.numpy as jnp
from _shapes import f32

import mpmdc


def loss(ws, x):
    """A scan in stage 0, a cond in stage 1 and a fori_loop in stage 2."""
    x = mpmdc.stage(x, 0)
    x, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, jnp.stack([ws[0], ws[0].T]))
    x = mpmdc.stage(x, 1)
    x = jax.lax.cond(x.sum() > 0, lambda v: v @ ws[1], lambda v: -v @ ws[1], x)
    x = mpmdc.stage(x, 2)
    x = jax.lax.fori_loop(0, 3, lambda i, v: jnp.sin(v @ ws[2]), x)
    return jnp.sum(x**2)


def lowered():
    """The lowered gradient step on 3 meshes."""
    meshes = mpmdc.make_meshes(3, {"data": 2})
    return mpmdc.compile(jax.value_and_grad(loss), meshes).lower([f32(8, 8)] * 3, f32(4, 8))
