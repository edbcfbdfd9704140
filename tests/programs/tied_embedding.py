"""Golden program: an embedding table read by the first and the last stage (tied weights).

The table lives on mesh 0 and is transferred to mesh 2 for the output projection;
its two gradient contributions are summed on mesh 0.
"""

import jax
import jax.numpy as jnp
from _shapes import f32

import mpmdc


def loss(embed, w, tokens, targets):
    """Cross entropy of a 3-stage model whose input and output share ``embed``."""
    x = mpmdc.stage(embed[tokens], 0)
    x = mpmdc.stage(jnp.tanh(x @ w), 1)
    x = mpmdc.stage(jnp.tanh(x), 2)
    logits = x @ embed.T
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=1))


def lowered():
    """The lowered gradient step."""
    meshes = mpmdc.make_meshes(3, {"data": 2})
    tokens = jax.ShapeDtypeStruct((8,), jnp.int32)
    step = mpmdc.compile(jax.value_and_grad(loss, argnums=(0, 1)), meshes)
    return step.lower(f32(32, 16), f32(16, 16), tokens, tokens)
