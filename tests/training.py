"""Training steps for the pipeline tests, each with a hand-written per-microbatch reference.

The references loop over microbatches in Python and never call ``mpmdc.accumulate``,
so a test comparing the two checks accumulate's unrolling, the schedule pass and the
runtime against plain JAX.
"""

import jax
import jax.numpy as jnp
import numpy as np

import mpmdc
from mpmdc.cli.demo import mlp_loss
from mpmdc.cli.models import adam_update, transformer_loss


def mlp_data(batch=32):
    """Inputs and targets for the tanh MLP of ``mpmdc.cli.demo``."""
    return jax.random.normal(jax.random.key(1), (batch, 16)), jax.random.normal(
        jax.random.key(2), (batch, 8)
    )


def sgd_step(params, x, y, microbatches=8, schedule="1f1b", loss_fn=mlp_loss):
    """Mean loss and gradient of ``loss_fn`` over microbatches, then one SGD update."""
    loss, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(loss_fn)(params, *mb),
        (x, y),
        microbatches=microbatches,
        schedule=schedule,
        reduce="mean",
    )
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def scanned_params(key, layers=8, width=16):
    """A tanh MLP's stack of ``layers`` square layers, stacked on a leading axis, between an
    input and an output layer."""
    k = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k[0], (16, width)) * 0.3,
        "layers": jax.random.normal(k[1], (layers, width, width)) * 0.3,
        "head": jax.random.normal(k[2], (width, 8)) * 0.3,
    }


def scanned_loss(params, x, y, every=2):
    """Mean squared error of the stack run as one ``scan``, ``every`` layers per stage."""

    def layer(h, w):
        return jnp.tanh(mpmdc.stage(h, every=every) @ w), None

    h, _ = jax.lax.scan(layer, jnp.tanh(x @ params["embed"]), params["layers"])
    return jnp.mean((h @ params["head"] - y) ** 2)


def microbatch_mean(loss_fn, params, batch, microbatches):
    """Mean ``value_and_grad`` over leading-axis slices, summed in microbatch order."""
    size = jax.tree_util.tree_leaves(batch)[0].shape[0] // microbatches
    total = None
    for i in range(microbatches):
        part = jax.tree_util.tree_map(lambda a, i=i: a[i * size : (i + 1) * size], batch)
        value = jax.value_and_grad(loss_fn)(params, *part)
        total = value if total is None else jax.tree_util.tree_map(jnp.add, total, value)
    return jax.tree_util.tree_map(lambda a: a / microbatches, total)


def hand_written_sgd_step(params, x, y, microbatches=8):
    """``sgd_step`` as a plain per-microbatch Python loop."""
    loss, grads = microbatch_mean(mlp_loss, params, (x, y), microbatches)
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def assert_trees_close(got, want, rtol=0, atol=0):
    """Same structure, leaves equal: bit for bit unless the caller passes ``rtol``/``atol``
    measured for its program."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def hand_written_transformer_step(params, state, tokens, microbatches=4):
    """``mpmdc.cli.models.transformer_step`` as a plain per-microbatch Python loop."""
    loss, grads = microbatch_mean(transformer_loss, params, (tokens,), microbatches)
    params, state = adam_update(params, grads, state)
    return params, state, loss
