"""Golden program: a shard_map with a psum inside stage 1 (the collective stays in its fragment)."""

import jax
import jax.numpy as jnp
from _shapes import f32
from jax.sharding import PartitionSpec as P

import mpmdc


def lowered():
    """The lowered gradient step on 2 meshes; stage 1's shard_map runs on mesh 1."""
    meshes = mpmdc.make_meshes(2, {"data": 2})

    def row_sum(x):
        return jax.lax.psum(jnp.sum(x, axis=0, keepdims=True), "data")

    summed = jax.shard_map(row_sum, mesh=meshes[1], in_specs=P("data"), out_specs=P())

    def loss(w, x):
        x = mpmdc.stage(x, 0)
        x = jnp.tanh(x @ w)
        x = mpmdc.stage(x, 1)
        return jnp.sum(summed(x) ** 2)

    return mpmdc.compile(jax.value_and_grad(loss), meshes).lower(f32(8, 8), f32(8, 8))
