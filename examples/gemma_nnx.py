"""Train a small Gemma-shaped model (Flax NNX), pipelined by stage markers alone.

The model is written as Gemma is: a token embedding scaled by ``sqrt(width)`` and tied
with the output projection, pre- and post-norm blocks (RMSNorm with a ``1 + scale``
gain) of grouped-query attention with rotary position embeddings, alternating local
(sliding-window) and global attention, soft-capped attention and output logits, and a
gated GELU MLP. Positions and the attention mask come from the tokens (``0`` is
padding). Its blocks are either a list, each called in turn, or one stacked module run
by ``nnx.scan`` with each layer's local/global flag as a scanned operand (a scanned
stack needs identical layers: what differs per layer is data).

The only mpmdc-specific lines in the model are the stage markers in ``Gemma.__call__``;
``make_step`` adds ``mpmdc.accumulate`` around the gradient. Under plain ``jax.jit`` the
same step runs unchanged.

Run it on CPU (8 virtual devices, 4 meshes of 2)::

    python examples/gemma_nnx.py            # blocks in a list
    python examples/gemma_nnx.py --scanned  # one scanned stack

It prints what one step moves between meshes and the loss per step.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import mpmdc

PAD = 0


def rope(x, positions, base=10_000.0):
    """Rotary position embedding of ``x`` (batch, length, heads, dim) at ``positions``."""
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None, None].astype(jnp.float32) * frequencies
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def soft_cap(x, cap):
    return jnp.tanh(x / cap) * cap


class RMSNorm(nnx.Module):
    """Root-mean-square normalization with a gain of ``1 + scale`` (``scale`` starts at 0)."""

    def __init__(self, width):
        self.scale = nnx.Param(jnp.zeros((width,)))

    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x * (1 + self.scale[...])


class Attention(nnx.Module):
    """Grouped-query attention: ``heads`` query heads share ``kv_heads`` keys and values."""

    def __init__(self, width, heads, kv_heads, dim, *, rngs):
        init = nnx.initializers.normal(width**-0.5)
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = nnx.Param(init(rngs.params(), (width, heads, dim)))
        self.kv = nnx.Param(init(rngs.params(), (2, width, kv_heads, dim)))
        self.out = nnx.Param(init(rngs.params(), (heads, dim, width)))

    def __call__(self, x, positions, mask):
        q = rope(jnp.einsum("bnd,dhk->bnhk", x, self.q[...]), positions) * self.dim**-0.5
        k, v = jnp.einsum("bnd,cdhk->cbnhk", x, self.kv[...])
        k = rope(k, positions)
        b, n = x.shape[:2]
        q = q.reshape(b, n, self.kv_heads, self.heads // self.kv_heads, self.dim)
        logits = soft_cap(jnp.einsum("bqhgk,bshk->bhgqs", q, k), 50.0)
        logits = jnp.where(mask[:, None, None], logits, -2.3819763e38)
        probs = jax.nn.softmax(logits, axis=-1)
        encoded = jnp.einsum("bhgqs,bshk->bqhgk", probs, v).reshape(b, n, self.heads, self.dim)
        return jnp.einsum("bnhk,hkd->bnd", encoded, self.out[...])


class Block(nnx.Module):
    """Attention then a gated GELU MLP, each between a pre- and a post-norm, each added to
    the residual. ``local`` (a scalar boolean) limits attention to a sliding window."""

    def __init__(self, width, heads, kv_heads, dim, hidden, window, *, rngs):
        init = nnx.initializers.normal(width**-0.5)
        self.window = window
        self.pre_attention, self.post_attention = RMSNorm(width), RMSNorm(width)
        self.attention = Attention(width, heads, kv_heads, dim, rngs=rngs)
        self.pre_mlp, self.post_mlp = RMSNorm(width), RMSNorm(width)
        self.gating = nnx.Param(init(rngs.params(), (2, width, hidden)))
        self.down = nnx.Param(init(rngs.params(), (hidden, width)))

    def __call__(self, x, positions, mask, local):
        distance = positions[:, :, None] - positions[:, None, :]
        mask = jnp.where(local, mask & (distance < self.window), mask)
        x = x + self.post_attention(self.attention(self.pre_attention(x), positions, mask))
        gate, up = jnp.einsum("bnd,cdh->cbnh", self.pre_mlp(x), self.gating[...])
        return x + self.post_mlp((jax.nn.gelu(gate) * up) @ self.down[...])


class Gemma(nnx.Module):
    """Decoder-only Gemma; even layers attend locally, odd ones globally."""

    def __init__(
        self, vocab=64, width=32, heads=4, kv_heads=2, dim=8, hidden=64, layers=8, stages=4,
        window=8, scanned=False, *, rngs,
    ):  # fmt: skip
        def block(rngs):
            return Block(width, heads, kv_heads, dim, hidden, window, rngs=rngs)

        self.embedding = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (vocab, width)))
        if scanned:
            self.blocks = nnx.split_rngs(splits=layers)(nnx.vmap(block, in_axes=0, out_axes=0))(
                rngs
            )
        else:
            self.blocks = nnx.List([block(rngs) for _ in range(layers)])
        self.final_norm = RMSNorm(width)
        self.layers_per_stage = layers // stages
        self.local = tuple(layer % 2 == 0 for layer in range(layers))
        self.scanned = scanned

    def __call__(self, tokens):
        real = tokens != PAD
        positions = jnp.cumsum(real, axis=-1) - 1
        causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
        mask = real[:, None, :] & causal
        x = self.embedding[...][tokens] * jnp.sqrt(self.embedding.shape[1]).astype(jnp.float32)
        every = self.layers_per_stage
        if self.scanned:

            @nnx.scan(in_axes=(0, 0, nnx.Carry), out_axes=nnx.Carry)
            def run(block, local, h):
                h = mpmdc.stage(h, every=every)  # iteration j runs in stage j // every
                return block(h, positions, mask, local)

            x = run(self.blocks, jnp.array(self.local), x)
        else:
            for layer, block in enumerate(self.blocks):
                if layer % every == 0:
                    x = mpmdc.stage(x, layer // every)  # a stage begins here
                x = block(x, positions, mask, self.local[layer])
        logits = self.final_norm(x) @ self.embedding[...].T  # tied output projection
        return soft_cap(logits, 30.0)


def make_step(graphdef, optimizer, microbatches=4, schedule="1f1b"):
    """``step(params, opt_state, tokens)`` -> ``(params, opt_state, loss)``."""

    def loss_fn(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        labels = tokens[:, 1:]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        weights = labels != PAD
        return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1)

    def step(params, opt_state, tokens):
        loss, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss_fn)(params, mb),
            tokens,
            microbatches=microbatches,
            schedule=schedule,
            reduce="mean",
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def default_optimizer():
    """Global-norm clipping and AdamW."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))


def data(seed, batch=16, length=32, vocab=64):
    """Random tokens, each sequence ending in padding of random length."""
    keys = jax.random.split(jax.random.key(seed), 2)
    tokens = jax.random.randint(keys[0], (batch, length + 1), 1, vocab)
    ends = jax.random.randint(keys[1], (batch, 1), length // 2, length + 2)
    return jnp.where(jnp.arange(length + 1) < ends, tokens, PAD)


def main(argv=None):
    """Train for a few steps on random tokens, printing what one step moves and the loss."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scanned", action="store_true", help="one scanned stack of blocks")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    meshes = mpmdc.make_meshes(4, {"data": 2})
    model = Gemma(scanned=args.scanned, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = default_optimizer()
    opt_state = optimizer.init(params)
    tokens = data(1)
    step = mpmdc.compile(make_step(graphdef, optimizer), meshes, donate_argnums=(0, 1))
    print(step.lower(params, opt_state, tokens).transfer_report().as_text())
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, tokens)
        print(f"step {i}: loss {float(loss):.4f}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    main()
