"""Golden program: 8 stages on 4 meshes (stage s on mesh s mod 4), value_and_grad."""

import jax
from _model import mlp_loss
from _shapes import f32, mlp_params

import mpmdc


def lowered():
    """The lowered program: every mesh runs two forward and two backward fragments."""
    meshes = mpmdc.make_meshes(4, {"data": 2})
    step = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes)
    return step.lower(mlp_params([8] * 9), f32(4, 8), f32(4, 8))
