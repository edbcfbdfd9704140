"""Golden program: an SGD step over a scanned stack of 4 layers, 2 per stage, on 2 meshes.

``after-split-scans`` shows the forward scan and the transposed (reverse) scan of the
gradient each cut into one scan per stage, placed in its stage, reading its rows of the
stacked weights and the forward's stacked residuals, with the carry marked where it
crosses stages; ``after-slice-stacks`` holds the stacked weights as one input per stage
(``args[0]['layers'][0:2]``), cancels the slices of the residuals' concatenation and runs
the SGD update per piece, so each mesh's fragments read and write only its own rows.
Each stage's scan is a fragment of its own (``s0_fwd_1``, ``s1_fwd_0``...), so the stages'
equal scans compile once for meshes of one shape; as with a marker between stages, the
last stage's backward shares its forward's placement (``s1_fwd``).
"""

import jax
import jax.numpy as jnp
from _shapes import f32

import mpmdc

GOLDEN_BACKENDS = ("cpu",)


def loss(params, x, y):
    def layer(h, w):
        h = mpmdc.stage(h, every=2)
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, x @ params["embed"], params["layers"])
    return jnp.mean((h - y) ** 2)


def step(params, x, y):
    grads = jax.grad(loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def lowered():
    """The lowered program (``mpmdc dump tests/programs/scanned_stack.py:lowered``)."""
    meshes = mpmdc.make_meshes(2, {"data": 2})
    params = {"embed": f32(8, 16), "layers": f32(4, 16, 16)}
    return mpmdc.compile(step, meshes).lower(params, f32(8, 8), f32(8, 16))
