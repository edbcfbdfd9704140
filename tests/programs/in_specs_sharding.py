"""Golden program: batch-sharded inputs and outputs (``in_specs``/``out_specs`` over ``data``)."""

import jax.numpy as jnp
from _shapes import f32
from jax.sharding import PartitionSpec as P

import mpmdc


def predict(ws, x):
    """Two stages; the batch axis of ``x`` and of the result is split over ``data``."""
    x = mpmdc.stage(x, 0)
    x = jnp.tanh(x @ ws[0])
    x = mpmdc.stage(x, 1)
    return jnp.tanh(x @ ws[1])


def lowered():
    """The lowered forward pass with sharded batch in and out."""
    meshes = mpmdc.make_meshes(2, {"data": 2, "model": 2})
    compiled = mpmdc.compile(
        predict,
        meshes,
        in_specs=([P(None, "model"), P()], P("data")),
        out_specs=P("data"),
    )
    return compiled.lower([f32(16, 16)] * 2, f32(8, 16))
