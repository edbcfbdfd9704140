"""The noise floor of "equal to jax.jit", per dtype.

A 4-stage tanh MLP's loss and gradients (batch 32, width 64) three ways: ``jax.jit``;
``jax.jit`` of the same loss summed as two half-batches (another reduction order, the
floor: what rounding alone moves); mpmdc on 4 meshes, with and without a 2-microbatch
``accumulate``. Each figure is the largest difference over the results, relative to
the largest magnitude of that result. docs/design.md quotes these figures; each test's
tolerance comes from a floor measured on that test's own program, stated next to it.

    python benchmarks/noise_floor.py
"""

import _common
import jax
import jax.numpy as jnp
import numpy as np

import mpmdc

BATCH, WIDTH, STAGES = 32, 64, 4


def loss(ws, x, y):
    for i, w in enumerate(ws):
        x = jnp.tanh(mpmdc.stage(x, i) @ w)
    return jnp.mean((x - y) ** 2)


def loss_in_halves(ws, x, y):
    half = BATCH // 2
    return (loss(ws, x[:half], y[:half]) + loss(ws, x[half:], y[half:])) / 2


def accumulated(ws, x, y):
    return mpmdc.accumulate(
        lambda b: jax.value_and_grad(loss)(ws, *b), (x, y), microbatches=2, reduce="mean"
    )


def worst(got, want) -> float:
    """The largest difference over the leaves, each relative to its largest magnitude."""
    out = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        out = max(out, float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)))
    return out


def main():
    meshes = mpmdc.make_meshes(STAGES, {"data": 2})
    keys = jax.random.split(jax.random.key(0), STAGES + 1)
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        ws = [(jax.random.normal(k, (WIDTH, WIDTH)) / 8).astype(dtype) for k in keys[:STAGES]]
        x = jax.random.normal(keys[-1], (BATCH, WIDTH)).astype(dtype)
        y = jnp.sin(x)
        reference = jax.jit(jax.value_and_grad(loss))(ws, x, y)
        rows.append(
            {
                "dtype": jnp.dtype(dtype).name,
                "floor: jax.jit, halves vs whole": worst(
                    jax.jit(jax.value_and_grad(loss_in_halves))(ws, x, y), reference
                ),
                "mpmdc vs jax.jit": worst(
                    mpmdc.compile(jax.value_and_grad(loss), meshes)(ws, x, y), reference
                ),
                "mpmdc accumulate vs jax.jit of it": worst(
                    mpmdc.compile(accumulated, meshes)(ws, x, y), jax.jit(accumulated)(ws, x, y)
                ),
            }
        )
    _common.report("noise_floor", rows, list(rows[0]))


if __name__ == "__main__":
    main()
