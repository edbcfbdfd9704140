"""Pipeline × tensor parallelism: what a training loop holds, costs and compiles.

A residual MLP stack (4 blocks, 2 per stage, d_model 256, hidden 1024, batch 16) with
Megatron weights: the first matmul column-parallel (``P(None, "model")``, its bias
``P("model")``), the second row-parallel (``P("model", None)``, its bias replicated).
mpmdc runs it on 2 meshes of ``{"data": 2, "model": 2}``, one stage each; the reference
is ``jax.jit`` of the same step on one such mesh (``jax.jit`` cannot take arrays
committed to two meshes). Both run 10 steps of Adam, each step's parameters and
optimizer state fed to the next. Per side: bytes of parameters + optimizer state each
device holds after the 10 steps (max and mean over the devices of its meshes), the
median step time of steps 2–10, the XLA compiles over the 10 steps, and the specs of
the weights after one step.

    python benchmarks/tensor_parallel.py

``MPMDC_ROOT=/path/to/checkout`` runs it against another checkout's mpmdc (for
comparing with an older commit) in place of the installed, editable one; the JSON is
then written under a name ending in that folder's name.
"""

# The imports below the MPMDC_ROOT switch must come after it.
# ruff: noqa: E402
import os
import statistics
import sys
import time
from pathlib import Path

# Before anything imports mpmdc (``_common`` does): the editable install's finder maps
# ``mpmdc`` to this checkout whatever sys.path says, so it goes, and the other root comes
# first. That root needs ``mpmdc/passes`` and ``mpmdc/lowering`` as links to its
# top-level ``passes/`` and ``lowering/`` (the editable install's package-dir mapping).
ROOT = os.environ.get("MPMDC_ROOT")
if ROOT:
    sys.meta_path[:] = [
        f
        for f in sys.meta_path
        if "editable" not in getattr(f, "__name__", type(f).__name__).lower()
        and "editable" not in (getattr(f, "__module__", "") or "").lower()
    ]
    sys.path.insert(0, ROOT)

import _common
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.runtime.compiling import XlaCompiles

BLOCKS, STAGES, D_MODEL, HIDDEN, BATCH, STEPS = 4, 2, 256, 1024, 16, 10
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
OPT = optax.adam(1e-3)


def init_params():
    keys = jax.random.split(jax.random.key(0), 2 * BLOCKS)
    return [
        {
            "w1": jax.random.normal(keys[2 * i], (D_MODEL, HIDDEN)) * D_MODEL**-0.5,
            "b1": jnp.zeros((HIDDEN,)),
            "w2": jax.random.normal(keys[2 * i + 1], (HIDDEN, D_MODEL)) * HIDDEN**-0.5,
            "b2": jnp.zeros((D_MODEL,)),
        }
        for i in range(BLOCKS)
    ]


def loss_fn(params, x, y):
    for i, p in enumerate(params):
        x = mpmdc.stage(x, i * STAGES // BLOCKS)  # an identity under jax.jit
        x = x + jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jnp.mean((x - y) ** 2)


def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def committed(params, meshes):
    """Each block's weights on its stage's mesh, with the Megatron specs."""
    return [
        {
            k: jax.device_put(v, NamedSharding(meshes[i * len(meshes) // BLOCKS], SPECS[k]))
            for k, v in p.items()
        }
        for i, p in enumerate(params)
    ]


def spec_text(spec) -> str:
    # Trailing Nones dropped, so P('model') and P('model', None) read alike.
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return "P(" + ",".join(repr(p) for p in parts) + ")"


def weight_specs(params) -> str:
    """The specs of w1 / b1 / w2 / b2, each one spec if every block agrees."""
    out = []
    for k in SPECS:
        specs = {spec_text(p[k].sharding.spec) for p in params}
        out.append("|".join(sorted(specs)))
    return " ".join(out)


def run(name, fn, params, opt_state, x, y, devices) -> dict:
    times, compiles, specs = [], [], None
    for i in range(STEPS):
        with XlaCompiles() as c:
            start = time.perf_counter()
            loss, params, opt_state = fn(params, opt_state, x, y)
            jax.block_until_ready((loss, params, opt_state))
            times.append(time.perf_counter() - start)
        compiles.append(c.count)
        if i == 0:
            specs = weight_specs(params)
    held = {d: 0 for d in devices}
    for leaf in jax.tree.leaves((params, opt_state)):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return {
        "run": name,
        "devices": len(devices),
        "max MB/device": max(held.values()) / 1e6,
        "mean MB/device": statistics.mean(held.values()) / 1e6,
        "step ms (median 2-10)": statistics.median(times[1:]) * 1e3,
        # Step 1 builds the executables; a later compile means results fed back
        # arrived with other shardings than the arguments they replace.
        "XLA compiles (step 1 + 2-10)": f"{compiles[0]} + {sum(compiles[1:])}",
        "w1 b1 w2 b2 specs after step 1": specs,
        "loss after 10": float(loss),
    }


def main():
    print(f"mpmdc from {mpmdc.__file__}")
    params = init_params()
    x = jax.random.normal(jax.random.key(1), (BATCH, D_MODEL))
    y = jnp.sin(x)  # uncommitted: each side places the batch where its step wants it

    meshes = mpmdc.make_meshes(STAGES, {"data": 2, "model": 2})
    p = committed(params, meshes)
    rows = [
        run(
            f"mpmdc, {STAGES} meshes",
            mpmdc.compile(step, meshes),
            p,
            OPT.init(p),
            x,
            y,
            [d for m in meshes for d in m.devices.flat],
        )
    ]
    mesh = mpmdc.make_meshes(1, {"data": 2, "model": 2})
    p = committed(params, mesh)
    rows.append(
        run("jax.jit, 1 mesh", jax.jit(step), p, OPT.init(p), x, y, list(mesh[0].devices.flat))
    )

    name = "tensor_parallel" + (f"-{Path(ROOT).name}" if ROOT else "")
    _common.report(
        name,
        rows,
        list(rows[0]),
        notes=(
            f"{BLOCKS} blocks, {STAGES} stages, d_model {D_MODEL}, hidden {HIDDEN}, batch {BATCH}, "
            f"Adam, {STEPS} steps fed back; meshes {{'data': 2, 'model': 2}}; "
            "MB/device: parameters + optimizer state held by each device after the steps (1e6 B)"
        ),
    )


if __name__ == "__main__":
    main()
