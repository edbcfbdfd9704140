"""Example models for the demo, the tests and the benchmarks: a small decoder-only
transformer with a tied embedding, and Adam.

Plain JAX plus ``mpmdc.stage`` markers, which are identities under ``jax.jit``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mpmdc.ir.primitives import stage
from mpmdc.schedules.accumulate import accumulate


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of the transformer; block ``i`` runs in stage ``i * stages // layers``."""

    vocab: int = 32
    width: int = 16
    heads: int = 2
    hidden: int = 32
    layers: int = 4
    stages: int | None = None  # default: one stage per block

    def stage_of(self, block: int) -> int:
        """The pipeline stage of block ``block``."""
        return block * (self.stages or self.layers) // self.layers


def init_transformer(key, config: TransformerConfig = TransformerConfig()):
    """Token embedding (tied with the output projection), the blocks, a final norm."""
    keys = jax.random.split(key, config.layers + 1)
    w, h = config.width, config.hidden

    def dense(k, shape):
        return jax.random.normal(k, shape) / np.sqrt(shape[0])

    blocks = []
    for k in keys[1:]:
        kq, kk, kv, ko, k1, k2 = jax.random.split(k, 6)
        blocks.append(
            {
                "norm1": jnp.ones(w),
                "q": dense(kq, (w, w)),
                "k": dense(kk, (w, w)),
                "v": dense(kv, (w, w)),
                "o": dense(ko, (w, w)),
                "norm2": jnp.ones(w),
                "up": dense(k1, (w, h)),
                "down": dense(k2, (h, w)),
            }
        )
    embed = 0.5 * jax.random.normal(keys[0], (config.vocab, w))
    return {"embed": embed, "blocks": blocks, "norm": jnp.ones(w)}


def _norm(x, scale):
    return scale * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _attention(x, p, heads: int):
    b, t, w = x.shape

    def split_heads(m):
        return (x @ m).reshape(b, t, heads, w // heads).transpose(0, 2, 1, 3)

    q, k, v = split_heads(p["q"]), split_heads(p["k"]), split_heads(p["v"])
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(w // heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, w) @ p["o"]


def transformer_loss(params, tokens, config: TransformerConfig = TransformerConfig()):
    """Next-token cross entropy of ``tokens`` (``[batch, length + 1]`` ints)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs]
    for i, p in enumerate(params["blocks"]):
        if i == 0 or config.stage_of(i) != config.stage_of(i - 1):
            x = stage(x, config.stage_of(i))
        x = x + _attention(_norm(x, p["norm1"]), p, config.heads)
        x = x + jax.nn.gelu(_norm(x, p["norm2"]) @ p["up"]) @ p["down"]
    logits = _norm(x, params["norm"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def adam_init(params):
    """Adam's state: first and second moments, and the step count."""
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.float32)}


def adam_update(params, grads, state, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step; returns the new parameters and state."""
    t = state["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    new = jax.tree_util.tree_map(
        lambda p, m, v: p - lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), params, m, v
    )
    return new, {"m": m, "v": v, "t": t}


def transformer_step(
    params, state, tokens, config=TransformerConfig(), microbatches=4, schedule="1f1b"
):
    """Mean loss and gradient over microbatches (``mpmdc.accumulate``), then Adam."""
    loss, grads = accumulate(
        lambda mb: jax.value_and_grad(transformer_loss)(params, mb, config),
        tokens,
        microbatches=microbatches,
        schedule=schedule,
        reduce="mean",
    )
    params, state = adam_update(params, grads, state)
    return params, state, loss
