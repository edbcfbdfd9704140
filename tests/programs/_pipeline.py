"""The SGD step the pipeline golden programs share, lowered under a given schedule."""

import jax
from _model import mlp_loss
from _shapes import f32, mlp_params

import mpmdc


def lowered_under(schedule):
    """A 3-stage MLP's mean gradient over 4 microbatches, then SGD, on 3 meshes of 2 devices."""

    def step(params, x, y):
        grads = mpmdc.accumulate(
            lambda mb: jax.grad(mlp_loss)(params, *mb),
            (x, y),
            microbatches=4,
            schedule=schedule,
            reduce="mean",
        )
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    meshes = mpmdc.make_meshes(3, {"data": 2})
    return mpmdc.compile(step, meshes).lower(mlp_params([8, 16, 16, 4]), f32(16, 8), f32(16, 4))
