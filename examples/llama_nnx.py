"""Train a small Llama (Flax NNX) whose scanned layer stack is pipelined by one line.

The model is ordinary Flax NNX: token embedding, pre-norm blocks of grouped-query causal
attention with rotary position embeddings and a SwiGLU MLP, RMSNorm, an untied output
projection. The blocks are created stacked (``nnx.vmap``) and run as one ``nnx.scan``, as
the Flax docs write layer stacks. The only mpmdc-specific line in the model is
``mpmdc.stage(h, every=...)`` in the scan's body; ``main`` adds ``mpmdc.compile`` and
``mpmdc.accumulate``. Under plain ``jax.jit`` the same step runs unchanged (the marker
is an identity, ``accumulate`` is a scan).

Run it on CPU (8 virtual devices, 4 meshes of 2)::

    python examples/llama_nnx.py

It prints what one step moves between meshes, the loss per step, which rows of the
stacked block parameters each mesh holds, and the bytes of state each mesh holds.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import mpmdc


def rope(x, base=10000.0):
    """Rotary position embedding of ``x`` (batch, length, heads, dim), from positions."""
    half = x.shape[-1] // 2
    positions = jnp.arange(x.shape[1], dtype=jnp.float32)
    angles = positions[:, None] * base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query attention: ``heads`` query heads share ``kv_heads`` keys/values."""

    def __init__(self, width, heads, kv_heads, *, dtype, rngs):
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, rngs=rngs)
        self.q = linear(width, heads * self.dim)
        self.k = linear(width, kv_heads * self.dim)
        self.v = linear(width, kv_heads * self.dim)
        self.o = linear(heads * self.dim, width)

    def __call__(self, x):
        b, n, _ = x.shape
        groups = self.heads // self.kv_heads
        q = rope(self.q(x).reshape(b, n, self.heads, self.dim))
        q = q.reshape(b, n, self.kv_heads, groups, self.dim)  # query heads by their kv head
        k = rope(self.k(x).reshape(b, n, self.kv_heads, self.dim))
        v = self.v(x).reshape(b, n, self.kv_heads, self.dim)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k).astype(jnp.float32) / self.dim**0.5
        causal = jnp.tril(jnp.ones((n, n), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
        return self.o(out.reshape(b, n, self.heads * self.dim))


class Block(nnx.Module):
    """Pre-norm Llama block: attention, then a SwiGLU MLP, each added to the residual."""

    def __init__(self, width, heads, kv_heads, hidden, *, dtype, rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.attn = Attention(width, heads, kv_heads, dtype=dtype, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.gate, self.up = linear(width, hidden), linear(width, hidden)
        self.down = linear(hidden, width)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    """Decoder-only Llama; its blocks are one stacked module run by ``nnx.scan``."""

    def __init__(
        self, vocab=64, width=32, heads=4, kv_heads=2, hidden=64, layers=8, stages=4, *,
        dtype=None, rngs,
    ):  # fmt: skip
        self.embed = nnx.Embed(vocab, width, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(width, heads, kv_heads, hidden, dtype=dtype, rngs=rngs)

        self.blocks = create(rngs)  # every parameter has a leading axis of length `layers`
        self.norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(width, vocab, use_bias=False, dtype=dtype, rngs=rngs)
        self.layers_per_stage = layers // stages

    def __call__(self, tokens):
        every = self.layers_per_stage

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, h):
            # This one line pipelines the scanned stack: iteration j runs in stage j // every.
            h = mpmdc.stage(h, every=every)
            return block(h)

        return self.head(self.norm(run(self.blocks, self.embed(tokens)))).astype(jnp.float32)


def make_step(graphdef, optimizer, microbatches=4, schedule="1f1b"):
    """``step(params, opt_state, tokens)`` -> ``(params, opt_state, loss)``."""

    def loss_fn(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        loss, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss_fn)(params, *mb),
            (tokens,),
            microbatches=microbatches,
            schedule=schedule,
            reduce="mean",
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def default_optimizer():
    """Global-norm clipping and AdamW, as most Llama recipes do."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))


def main(steps=5, batch=16, length=32, seed=0):
    """Train for ``steps`` steps on random tokens, printing what happens."""
    meshes = mpmdc.make_meshes(4, {"data": 2})
    model = Llama(rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = default_optimizer()
    opt_state = optimizer.init(params)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch, length + 1), 0, 64)

    step = mpmdc.compile(make_step(graphdef, optimizer), meshes, donate_argnums=(0, 1))
    print(step.lower(params, opt_state, tokens).transfer_report().as_text())
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, tokens)
        print(f"step {i}: loss {float(loss):.4f}")

    mesh_of = {d: i for i, m in enumerate(meshes) for d in m.devices.flat}
    print("rows of the stacked block parameters on each mesh:")
    for path, leaf in jax.tree_util.tree_leaves_with_path(params["blocks"]):
        rows = {mesh_of[s.device]: s.index[0] for s in leaf.addressable_shards}
        where = ", ".join(f"mesh{m} [{r.start}, {r.stop})" for m, r in sorted(rows.items()))
        print(f"  {jax.tree_util.keystr(path)} {leaf.shape}: {where}")

    held: dict[tuple, int] = {}  # each piece a mesh holds, once however many devices hold it
    for n, leaf in enumerate(jax.tree_util.tree_leaves((params, opt_state))):
        for s in leaf.addressable_shards:
            held[mesh_of[s.device], n, repr(s.index)] = s.data.nbytes
    per_mesh = [sum(b for (m, *_), b in held.items() if m == i) for i in range(len(meshes))]
    print("bytes of parameters and optimizer state per mesh:", per_mesh)


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    main()
