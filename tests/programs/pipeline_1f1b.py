"""Golden program: an SGD step over 4 microbatches of a 3-stage MLP under 1F1B.

``after-split`` has one fragment per (stage, forward/backward, microbatch);
``after-schedule`` orders them so each mesh runs its warm-up forwards, then one
forward and one backward in turn. Modules are pinned for CPU only: the fragments
are the same ops as in ``mlp2_grad``, whose modules are pinned for every platform.
"""

import jax
from _shapes import f32, mlp_params

import mpmdc
from mpmdc.demo import mlp_loss

GOLDEN_PLATFORMS = ("cpu",)


def step(params, x, y):
    """Mean gradient over 4 microbatches, then SGD."""
    grads = mpmdc.accumulate(
        lambda mb: jax.grad(mlp_loss)(params, *mb), (x, y), microbatches=4, schedule="1f1b", reduce="mean"
    )
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def lowered():
    """The lowered program (``mpmdc dump tests/programs/pipeline_1f1b.py:lowered``)."""
    meshes = mpmdc.make_meshes(3, {"data": 2})
    return mpmdc.compile(step, meshes).lower(mlp_params([8, 16, 16, 4]), f32(16, 8), f32(16, 4))
