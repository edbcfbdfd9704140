"""Train with pipeline parallelism, save a checkpoint every few steps, and resume after
being stopped or killed: a script to copy.

The model is a stack of residual MLP blocks written as one ``lax.scan`` over stacked
weights, pipelined by one ``mpmdc.stage(h, every=k)`` line; Optax's AdamW updates it.
:class:`mpmdc.checkpoint.CheckpointManager` saves the parameters and optimizer state
every ``--save-every`` steps in the background, each process writing only what its
meshes hold, and keeps the newest ``--keep``. Started again with the same directory,
the script restores the newest complete step onto the meshes it runs on now (their
number and the number of processes may differ) and trains on from there; the data of
step ``n`` depends only on ``n``, so a resumed run continues the same run.

One process (8 CPU devices, 4 meshes of 2)::

    python examples/resume_training.py /tmp/run --steps 12

Four processes of one device each, resuming the same run on 4 meshes of 1::

    mpmdc launch -n 4 -- python examples/resume_training.py /tmp/run --steps 24

Under ``mpmdc launch --max-restarts 3`` a run whose process fails starts again by
itself, as often as three times, and resumes here. A ``SIGTERM`` to one process (a
scheduler's preemption notice) stops every process at the next step they can all reach,
saved; started again, the run resumes there.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

import mpmdc

LAYERS, WIDTH, BATCH, MICROBATCHES = 8, 32, 32, 4


TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))


def loss_fn(params, x, y, every):
    """Mean squared error of the residual MLP stack, ``every`` layers per pipeline stage."""

    def block(h, w):
        h = mpmdc.stage(h, every=every)
        return h + jnp.tanh(h @ w["up"] + w["bias"]) @ w["down"], None

    h, _ = jax.lax.scan(block, x @ params["embed"], params["layers"])
    return jnp.mean((h @ params["head"] - y) ** 2)


def train_step(params, opt_state, x, y, *, every):
    """One step: the mean loss and gradient over microbatches, then an AdamW update."""
    loss, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(loss_fn)(params, *mb, every),
        (x, y),
        microbatches=MICROBATCHES,
        reduce="mean",
    )
    updates, opt_state = TX.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def init_params(key):
    k = jax.random.split(key, 4)
    scale = WIDTH**-0.5
    return {
        "embed": jax.random.normal(k[0], (16, WIDTH)) * scale,
        "layers": {
            "up": jax.random.normal(k[1], (LAYERS, WIDTH, 2 * WIDTH)) * scale,
            "bias": jnp.zeros((LAYERS, 2 * WIDTH)),
            "down": jax.random.normal(k[2], (LAYERS, 2 * WIDTH, WIDTH)) * scale * 0.5,
        },
        "head": jax.random.normal(k[3], (WIDTH, 4)) * scale,
    }


def batch(step: int):
    """Step ``step``'s inputs and targets: the same in every run and every process."""
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
    x = jax.random.normal(kx, (BATCH, 16))
    return x, jnp.sin(x[:, :4]) + 0.1 * jax.random.normal(ky, (BATCH, 4))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where the checkpoints go (one folder per step)")
    parser.add_argument("--steps", type=int, default=12, help="train until this step")
    parser.add_argument("--save-every", type=int, default=4, help="save every this many steps")
    parser.add_argument("--keep", type=int, default=2, help="keep the newest this many steps")
    parser.add_argument("--meshes", type=int, default=4, help="pipeline stages, one mesh each")
    args = parser.parse_args(argv)

    # Under `mpmdc launch` the launcher says how many devices each process has; alone, 8.
    alone = mpmdc.distributed.ENV_PROCESS_ID not in os.environ
    mpmdc.distributed.initialize(devices_per_process=8 if alone else None)
    train(args)


def train(args) -> None:
    """Restore the newest step in ``args.directory`` (or start afresh), then train."""
    every = LAYERS // args.meshes
    meshes = mpmdc.make_meshes(args.meshes, {"data": jax.device_count() // args.meshes})
    step_fn = mpmdc.compile(
        functools.partial(train_step, every=every), meshes, donate_argnums=(0, 1)
    )
    params = init_params(jax.random.key(0))
    opt_state = TX.init(params)
    x, y = batch(0)
    # Where the compiled step wants the state: each stage's rows of the stacked layers on
    # its mesh. The checkpoint is restored straight there, whatever layout saved it.
    shardings = step_fn.input_shardings(params, opt_state, x, y)[0][:2]
    here = jax.process_index() == 0
    # The directory is this run's alone: a save a kill interrupted left a partial folder
    # that no save will finish, removed as the run starts again.
    with mpmdc.checkpoint.CheckpointManager(
        args.directory,
        max_to_keep=args.keep,
        save_interval_steps=args.save_every,
        remove_partial=True,
    ) as manager:
        start = manager.latest_step() or 0
        if start:
            state = manager.restore({"params": shardings[0], "opt_state": shardings[1]})
            params, opt_state = state["params"], state["opt_state"]
            if here:
                print(f"resumed from step {start} in {manager.step_directory(start)}", flush=True)
        for n in range(start, args.steps):
            x, y = batch(n)
            loss, params, opt_state = step_fn(params, opt_state, x, y)
            state = {"params": params, "opt_state": opt_state}
            saving = manager.save(n + 1, state, force=n + 1 == args.steps)
            note = f", saving step {n + 1}" if saving else ""
            loss = float(mpmdc.fetch(loss))
            if here:
                print(f"step {n + 1}: loss {loss:.6f}{note}", flush=True)
            if manager.reached_preemption(n + 1):  # (saved above: every process stops here)
                if here:
                    print(f"preempted: stopped after saving step {n + 1}", flush=True)
                break


if __name__ == "__main__":
    main()
