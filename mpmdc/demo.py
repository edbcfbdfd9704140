"""``mpmdc demo``: a 4-stage MLP gradient on 4 meshes of 2 virtual CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpmdc.api import compile
from mpmdc.ir import fragment_summary
from mpmdc.meshes import make_meshes
from mpmdc.primitives import stage


def mlp_loss(params, x, y):
    """Mean squared error of a tanh MLP whose layer ``i`` is pipeline stage ``i``."""
    for i, (w, b) in enumerate(params):
        x = stage(x, i)
        x = jnp.tanh(x @ w + b)
    return jnp.mean((x - y) ** 2)


def init_params(key, widths):
    """``[(w, b), ...]`` for consecutive ``widths``."""
    keys = jax.random.split(key, len(widths) - 1)
    return [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros((b,)))
        for k, a, b in zip(keys, widths[:-1], widths[1:])
    ]


def run(print_fn=print) -> float:
    """Run the demo, print its report and return the largest difference from ``jax.jit``."""
    meshes = make_meshes(4, {"data": 2})
    key = jax.random.key(0)
    params = init_params(key, [16, 32, 32, 32, 8])
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 8))

    step = compile(jax.value_and_grad(mlp_loss), meshes)
    loss, grads = step(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(mlp_loss))(params, x, y)
    diffs = [
        float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree_util.tree_leaves((loss, grads)), jax.tree_util.tree_leaves((ref_loss, ref_grads)))
    ]
    mesh_of = {tuple(d.id for d in m.devices.flat): i for i, m in enumerate(meshes)}

    def where(a):
        return f"mesh{mesh_of[tuple(d.id for d in a.sharding.mesh.devices.flat)]}"

    print_fn(f"mpmdc demo: 4-stage MLP value_and_grad on {len(meshes)} meshes x {meshes[0].size} CPU devices")
    print_fn(f"loss = {float(loss):.6f}  (on {where(loss)})")
    for i, (gw, gb) in enumerate(grads):
        print_fn(f"grad layer {i}: w{list(gw.shape)} on {where(gw)}, b{list(gb.shape)} on {where(gb)}")
    print_fn(f"max |mpmdc - jax.jit| = {max(diffs):.3g}")
    print_fn("fragments:")
    for line in fragment_summary(step.lower(params, x, y).program("after-split")):
        print_fn("  " + line)
    return max(diffs)
