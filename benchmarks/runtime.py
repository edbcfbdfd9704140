"""Steady-state step time and per-fragment dispatch overhead: mpmdc against jax.jit.

Step: the 8-layer transformer training step (8 microbatches, 1F1B, 4 meshes of 2 CPU
devices) under mpmdc, against `jax.jit` of the same step on one device and
data-parallel over all 8 (batch sharded, parameters replicated). Median of `--steps`
steps after two warm-up steps.

Dispatch: a chain of `--fragments` tiny fragments on one mesh (a stage marker before
each) under mpmdc, against the same fragment body as a bare jitted call, repeated
as often; the difference per fragment is mpmdc's overhead.

    python benchmarks/runtime.py [--steps 20]
"""

import argparse

import _common
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import mpmdc


def blocked(fn, *args):
    return lambda: jax.block_until_ready(fn(*args))


def step_times(steps: int) -> list[dict]:
    step, args = _common.transformer_setup(8)
    mpmdc_step = mpmdc.compile(step, _common.four_meshes())
    mpmdc_small = mpmdc.compile(step, mpmdc.make_meshes(4, {"data": 1}))
    one = jax.jit(step)
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    replicated, batch = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    params, state, tokens = args
    dp_args = (jax.device_put(params, replicated), jax.device_put(state, replicated), jax.device_put(tokens, batch))
    dp = jax.jit(step)
    rows = []
    for name, fn, fn_args in (
        ("mpmdc, 4 meshes x 2 devices", mpmdc_step, args),
        ("mpmdc, 4 meshes x 1 device", mpmdc_small, args),
        ("jax.jit, 1 device", one, args),
        ("jax.jit, data-parallel over 8 devices", dp, dp_args),
    ):
        run = blocked(fn, *fn_args)
        run(), run()
        rows.append({"step": name, "median ms": _common.seconds(run, repeat=steps) * 1e3})
    base = rows[2]["median ms"]
    for r in rows:
        r["vs 1-device jit"] = r["median ms"] / base
    return rows


def dispatch(fragments: int, calls: int) -> list[dict]:
    mesh = mpmdc.make_meshes(1, {"data": 1})

    def body(x):
        return x * 1.0001 + 1.0

    def chain(x):
        for i in range(fragments):
            x = mpmdc.stage(body(x), i)
        return x

    x = jnp.ones((8,))
    # One mesh for every stage: fragments run back to back, no transfers.
    compiled = mpmdc.compile(chain, mesh, stage_to_mesh=(0,) * fragments)
    run = blocked(compiled, x)
    run()
    per_fragment = _common.seconds(run, repeat=calls) / fragments

    bare = jax.jit(body)
    y = jax.device_put(x, mesh[0].devices.flat[0])

    def bare_chain():
        z = y
        for _ in range(fragments):
            z = bare(z)
        return jax.block_until_ready(z)

    bare_chain()
    bare_per_call = _common.seconds(bare_chain, repeat=calls) / fragments
    return [
        {"call": "mpmdc fragment (in a chain)", "us per call": per_fragment * 1e6, "ratio": per_fragment / bare_per_call},
        {"call": "bare jitted call (in a chain)", "us per call": bare_per_call * 1e6, "ratio": 1.0},
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=64)
    args = parser.parse_args()
    _common.report("runtime_step", step_times(args.steps), ["step", "median ms", "vs 1-device jit"])
    _common.report("runtime_dispatch", dispatch(args.fragments, 20), ["call", "us per call", "ratio"])


if __name__ == "__main__":
    main()
