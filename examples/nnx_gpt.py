"""Train a small GPT (Flax NNX) with pipeline parallelism: a script to copy.

The model is ordinary Flax NNX: token embedding tied with the output projection,
pre-norm blocks of causal self-attention and an MLP with biases, a final LayerNorm.
The only mpmdc-specific lines are the ``mpmdc.stage`` markers in ``GPT.__call__`` and
the ``mpmdc.compile``/``mpmdc.accumulate`` calls in ``main``. Under plain ``jax.jit``
the same step runs unchanged (markers are identities, ``accumulate`` is a scan).

Run it on CPU (8 virtual devices, 4 meshes of 2)::

    python examples/nnx_gpt.py

It prints the loss per step, what one step moves between meshes, and where every
parameter and optimizer-state leaf lives.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import mpmdc


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width, heads, hidden, *, dtype, rngs):
        self.norm1 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            heads, width, dtype=dtype, use_bias=False, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(width, hidden, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, width, dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(0.1)

    def __call__(self, x, rngs=None):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.norm1(x), mask=mask)
        h = self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return x + self.drop(h, deterministic=rngs is None, rngs=rngs)


class GPT(nnx.Module):
    """Decoder-only transformer; block ``i`` runs in pipeline stage ``i * stages // layers``."""

    def __init__(
        self, vocab=64, width=32, heads=4, hidden=64, layers=8, stages=4, *, dtype=None, rngs
    ):
        self.embed = nnx.Embed(vocab, width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(
            [Block(width, heads, hidden, dtype=dtype, rngs=rngs) for _ in range(layers)]
        )
        self.norm = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.stages = stages

    def __call__(self, tokens, rngs=None):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            stage = i * self.stages // len(self.blocks)
            if i == 0 or stage != (i - 1) * self.stages // len(self.blocks):
                x = mpmdc.stage(x, stage)  # the pipeline stage begins here
            x = block(x, rngs)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)  # tied output projection


def make_step(graphdef, optimizer, microbatches=4, schedule="1f1b", dropout=False):
    """``step(params, opt_state, tokens[, keys])`` -> ``(params, opt_state, loss)``."""

    def loss_fn(params, tokens, key=None):
        model = nnx.merge(graphdef, params)
        rngs = nnx.Rngs(dropout=key[0]) if dropout else None
        logits = model(tokens[:, :-1], rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens, keys=None):
        batch = (tokens, keys) if dropout else (tokens,)
        loss, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss_fn)(params, *mb),
            batch,
            microbatches=microbatches,
            schedule=schedule,
            reduce="mean",
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def default_optimizer():
    """Global-norm clipping and AdamW, as most GPT recipes do."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))


def where_leaves_live(tree, meshes) -> dict[str, int]:
    """``{path: mesh index}`` of every array leaf of ``tree``."""
    index = {tuple(sorted(d.id for d in m.devices.flat)): i for i, m in enumerate(meshes)}
    return {
        jax.tree_util.keystr(path): index[tuple(sorted(d.id for d in leaf.sharding.device_set))]
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def main(steps=5, batch=16, length=32, seed=0):
    """Train for ``steps`` steps on random tokens, printing what happens."""
    meshes = mpmdc.make_meshes(4, {"data": 2})
    model = GPT(rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = default_optimizer()
    opt_state = optimizer.init(params)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch, length + 1), 0, 64)

    step = mpmdc.compile(make_step(graphdef, optimizer), meshes, donate_argnums=(0, 1))
    print(step.lower(params, opt_state, tokens).transfer_report().as_text())
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, tokens)
        print(f"step {i}: loss {float(loss):.4f}")

    per_mesh: dict[int, int] = {}
    for tree in (params, opt_state):
        for mesh in where_leaves_live(tree, meshes).values():
            per_mesh[mesh] = per_mesh.get(mesh, 0) + 1
    print("parameter and optimizer-state leaves per mesh:", dict(sorted(per_mesh.items())))
    for path, mesh in where_leaves_live(params, meshes).items():
        print(f"  {path}: mesh{mesh}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    main()
