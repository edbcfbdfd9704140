"""Golden program: an SGD step over 4 microbatches of a 3-stage MLP under the zero-bubble ZB-H1 schedule.

``after-split`` has one fragment per (stage, forward/backward, microbatch);
``after-schedule`` cuts each backward into an input-gradient fragment (``igrad``,
what the stage before needs) and a weight-gradient one (``wgrad``), and delays the
weight gradients into 1F1B's bubbles. Modules are pinned for CPU only: the fragments
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
        lambda mb: jax.grad(mlp_loss)(params, *mb), (x, y), microbatches=4, schedule="zb-h1", reduce="mean"
    )
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def lowered():
    """The lowered program (``mpmdc dump tests/programs/pipeline_zb_h1.py:lowered``)."""
    meshes = mpmdc.make_meshes(3, {"data": 2})
    return mpmdc.compile(step, meshes).lower(mlp_params([8, 16, 16, 4]), f32(16, 8), f32(16, 4))
