"""Golden program: value_and_grad of a 2-stage tanh MLP on 2 meshes of 2 devices."""

import jax
from _model import mlp_loss
from _shapes import f32, mlp_params

import mpmdc


def lowered():
    """The lowered program (``mpmdc dump tests/programs/mlp2_grad.py:lowered``)."""
    meshes = mpmdc.make_meshes(2, {"data": 2})
    step = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes)
    return step.lower(mlp_params([16, 32, 8]), f32(8, 16), f32(8, 8))
