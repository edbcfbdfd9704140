"""Steady-state step time and per-fragment dispatch overhead: mpmdc against jax.jit.

Step: the 8-layer transformer training step (8 microbatches, 1F1B) under mpmdc on 4
meshes of 2 CPU devices (batch sharded over each mesh's devices, and replicated) and
of 1 device, against `jax.jit` of the same step on one device and data-parallel over 2
and over all 8 devices (batch sharded, parameters replicated). Median of `--steps`
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


def data_parallel(step, args, devices):
    """``jax.jit`` of ``step`` over ``devices``: batch sharded, parameters replicated."""
    mesh = jax.sharding.Mesh(devices, ("data",))
    replicated, batch = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    params, state, tokens = args
    return jax.jit(step), (jax.device_put(params, replicated), jax.device_put(state, replicated),
                           jax.device_put(tokens, batch))


def step_times(steps: int) -> list[dict]:
    step, args = _common.transformer_setup(8)
    batch_sharded = (None, None, PartitionSpec("data"))
    rows = []
    for name, fn, fn_args in (
        ("mpmdc, 4 meshes x 2 devices, batch sharded",
         mpmdc.compile(step, _common.four_meshes(), in_specs=batch_sharded), args),
        ("mpmdc, 4 meshes x 2 devices, batch replicated", mpmdc.compile(step, _common.four_meshes()), args),
        ("mpmdc, 4 meshes x 1 device", mpmdc.compile(step, mpmdc.make_meshes(4, {"data": 1})), args),
        ("jax.jit, 1 device", jax.jit(step), args),
        ("jax.jit, data-parallel over 2 devices", *data_parallel(step, args, jax.devices()[:2])),
        ("jax.jit, data-parallel over 8 devices", *data_parallel(step, args, jax.devices())),
    ):
        run = blocked(fn, *fn_args)
        run(), run()
        rows.append({"step": name, "median ms": _common.seconds(run, repeat=steps) * 1e3})
    by_name = {r["step"]: r["median ms"] for r in rows}
    for r in rows:
        r["vs 1-device jit"] = r["median ms"] / by_name["jax.jit, 1 device"]
        r["vs 2-device DP jit"] = r["median ms"] / by_name["jax.jit, data-parallel over 2 devices"]
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
    _common.report("runtime_step", step_times(args.steps), ["step", "median ms", "vs 1-device jit", "vs 2-device DP jit"])
    _common.report("runtime_dispatch", dispatch(args.fragments, 20), ["call", "us per call", "ratio"])


if __name__ == "__main__":
    main()
