"""Meshes that span processes; run it under ``mpmdc launch -n 4`` (one device each).

``make_meshes(2, {"data": 2})`` puts processes 0 and 1 in mesh 0 and processes 2 and 3
in mesh 1: each mesh's fragments run as SPMD over two processes (their collectives
through gloo), and transfers go between process pairs. A 2-stage MLP step with its
batch split over ``data`` must equal ``jax.jit`` (within its noise floor); every process prints ``ok`` and its
meshes' processes.
"""

import mpmdc

mpmdc.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def loss(params, x):
    for i, w in enumerate(params):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


def step(params, x):
    value, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(loss)(params, mb), x, microbatches=2, reduce="mean"
    )
    return value, [p - 0.1 * g for p, g in zip(params, grads)]


meshes = mpmdc.make_meshes(2, {"data": 2})
params = [jnp.full((8, 8), 0.1), jnp.linspace(-1, 1, 64).reshape(8, 8)]
x = jnp.arange(64.0).reshape(8, 8) / 64
compiled = mpmdc.compile(step, meshes, in_specs=(None, P("data")))
got = mpmdc.fetch(compiled(params, x))
want = jax.jit(step)(params, x)
# The loss is a mean reduced across processes (gloo) in another order than jax.jit's:
# noise floor 1.5e-08 absolute (jax.jit against eager), margin 10x.
for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, np.asarray(b), rtol=0, atol=1.5e-7)
print(f"ok {[sorted({d.process_index for d in m.devices.flat}) for m in meshes]}", flush=True)
