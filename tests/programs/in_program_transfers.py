"""Golden program: cross-mesh transfers as send/recv pairs for CUDA and ROCm.

Registers two backends with ``transfers="in-program"``; their modules carry a
``stablehlo.send`` in the producing fragment and a ``stablehlo.recv`` with the same
channel id in each consuming one.
"""

import jax
from _model import mlp_loss
from _shapes import f32, mlp_params

import mpmdc
from mpmdc import backends

IN_PROGRAM = ("cuda-in-program", "rocm-in-program")
GOLDEN_BACKENDS = ("cpu", "cuda", "rocm", "tpu", *IN_PROGRAM)

for _name, _platform in zip(IN_PROGRAM, ("cuda", "rocm")):
    backends.register(backends.Backend(_name, _platform, transfers="in-program"))


def lowered():
    """A 3-stage MLP gradient lowered for CUDA with in-program transfers."""
    meshes = mpmdc.make_meshes(3, {"data": 2})
    step = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes, backend="cuda-in-program")
    return step.lower(mlp_params([8, 16, 16, 8]), f32(4, 8), f32(4, 8))
