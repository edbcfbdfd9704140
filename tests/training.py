"""Training steps for the pipeline tests, each with a hand-written per-microbatch reference.

The references loop over microbatches in Python and never call ``mpmdc.accumulate``,
so a test comparing the two checks accumulate's unrolling, the schedule pass and the
runtime against plain JAX.
"""

import jax
import jax.numpy as jnp
import numpy as np

import mpmdc
from mpmdc.demo import mlp_loss


def mlp_data(batch=32):
    """Inputs and targets for the tanh MLP of ``mpmdc.demo``."""
    return jax.random.normal(jax.random.key(1), (batch, 16)), jax.random.normal(jax.random.key(2), (batch, 8))


def sgd_step(params, x, y, microbatches=8, schedule="1f1b"):
    """Mean loss and gradient over microbatches, then one SGD update."""
    loss, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(mlp_loss)(params, *mb),
        (x, y), microbatches=microbatches, schedule=schedule, reduce="mean",
    )
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def microbatch_mean(loss_fn, params, batch, microbatches):
    """Mean ``value_and_grad`` over leading-axis slices, summed in microbatch order."""
    size = jax.tree_util.tree_leaves(batch)[0].shape[0] // microbatches
    total = None
    for i in range(microbatches):
        part = jax.tree_util.tree_map(lambda a: a[i * size : (i + 1) * size], batch)
        value = jax.value_and_grad(loss_fn)(params, *part)
        total = value if total is None else jax.tree_util.tree_map(jnp.add, total, value)
    return jax.tree_util.tree_map(lambda a: a / microbatches, total)


def hand_written_sgd_step(params, x, y, microbatches=8):
    """``sgd_step`` as a plain per-microbatch Python loop."""
    loss, grads = microbatch_mean(mlp_loss, params, (x, y), microbatches)
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def assert_trees_close(got, want, rtol=2e-5, atol=1e-6):
    """Same structure, leaves equal within ``rtol``/``atol``."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


# ------------------------------------------------ a small decoder-only transformer

VOCAB, WIDTH, HEADS, HIDDEN = 32, 16, 2, 32


def init_transformer(key, layers=4):
    """Token embedding (tied with the output projection), ``layers`` blocks, final norm."""
    keys = jax.random.split(key, layers + 1)

    def dense(k, shape):
        return jax.random.normal(k, shape) / np.sqrt(shape[0])

    blocks = []
    for k in keys[1:]:
        kq, kk, kv, ko, k1, k2 = jax.random.split(k, 6)
        blocks.append(
            {
                "norm1": jnp.ones(WIDTH), "q": dense(kq, (WIDTH, WIDTH)), "k": dense(kk, (WIDTH, WIDTH)),
                "v": dense(kv, (WIDTH, WIDTH)), "o": dense(ko, (WIDTH, WIDTH)),
                "norm2": jnp.ones(WIDTH), "up": dense(k1, (WIDTH, HIDDEN)), "down": dense(k2, (HIDDEN, WIDTH)),
            }
        )
    return {"embed": 0.5 * jax.random.normal(keys[0], (VOCAB, WIDTH)), "blocks": blocks, "norm": jnp.ones(WIDTH)}


def _norm(x, scale):
    return scale * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _attention(x, p):
    b, t, _ = x.shape

    def heads(w):
        return (x @ w).reshape(b, t, HEADS, WIDTH // HEADS).transpose(0, 2, 1, 3)

    q, k, v = heads(p["q"]), heads(p["k"]), heads(p["v"])
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(WIDTH // HEADS)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, WIDTH) @ p["o"]


def transformer_loss(params, tokens):
    """Next-token cross entropy; block ``i`` is pipeline stage ``i``; logits reuse the embedding."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs]
    for i, p in enumerate(params["blocks"]):
        x = mpmdc.stage(x, i)
        x = x + _attention(_norm(x, p["norm1"]), p)
        x = x + jax.nn.gelu(_norm(x, p["norm2"]) @ p["up"]) @ p["down"]
    logits = _norm(x, params["norm"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def adam_init(params):
    """Adam's state: first and second moments, and the step count."""
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.float32)}


def adam_update(params, grads, state, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step."""
    t = state["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    new = jax.tree_util.tree_map(
        lambda p, m, v: p - lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), params, m, v
    )
    return new, {"m": m, "v": v, "t": t}


def transformer_step(params, state, tokens, microbatches=4, schedule="1f1b"):
    """Mean loss and gradient over microbatches with ``accumulate``, then Adam."""
    loss, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(transformer_loss)(params, mb),
        tokens, microbatches=microbatches, schedule=schedule, reduce="mean",
    )
    params, state = adam_update(params, grads, state)
    return params, state, loss


def hand_written_transformer_step(params, state, tokens, microbatches=4):
    """``transformer_step`` as a plain per-microbatch Python loop."""
    loss, grads = microbatch_mean(transformer_loss, params, (tokens,), microbatches)
    params, state = adam_update(params, grads, state)
    return params, state, loss
