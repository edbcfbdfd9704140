"""Steady-state step time and per-fragment dispatch overhead: mpmdc against jax.jit.

Step: the 8-layer transformer training step (8 microbatches, 1F1B) under mpmdc on 4
meshes of 2 CPU devices (batch sharded over each mesh's devices, and replicated) and
of 1 device, against `jax.jit` of the same step on one device and data-parallel over 2
and over all 8 devices (batch sharded, parameters replicated). Every step's arguments
are already where it reads them, as in a training loop. Median of `--steps` steps after
two warm-up steps, the configurations taking turns step by step.

Dispatch: a chain of `--fragments` tiny fragments on one mesh (a stage marker before
each) under mpmdc, against the same fragment body as a bare jitted call, repeated
as often; the difference per fragment is mpmdc's overhead.

Loop dispatch: a step of tiny two-stage work on two 1-device meshes, its gradient
summed over 8, 64 and 128 microbatches, against as many bare jitted calls and
`jax.device_put` copies in a Python loop: mpmdc's time per fragment call or transfer.

    python benchmarks/runtime.py [--steps 20] [--loop-only]
"""

import argparse

import _common
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import mpmdc
from mpmdc.cli.models import init_transformer, transformer_loss


def blocked(fn, *args):
    return lambda: jax.block_until_ready(fn(*args))


def data_parallel(args, devices):
    """``args`` (parameter-like leaves, then the batch) placed for data parallelism over
    ``devices``: the batch sharded on its leading axis, everything else replicated."""
    mesh = jax.sharding.Mesh(devices, ("data",))
    replicated, batch = (
        NamedSharding(mesh, PartitionSpec()),
        NamedSharding(mesh, PartitionSpec("data")),
    )
    *rest, tokens = args
    return (*jax.device_put(rest, replicated), jax.device_put(tokens, batch))


def pipelined(step, args, meshes, **options):
    """mpmdc's executable of ``step`` and ``args`` already on the meshes that read them, as
    in a training loop that feeds each step's outputs to the next."""
    executable = mpmdc.compile(step, meshes, **options).lower(*args).compile()
    return executable, jax.device_put(args, executable.input_shardings[0])


def step_times(steps: int) -> list[dict]:
    step, args = _common.transformer_setup(8)
    batch_sharded = (None, None, PartitionSpec("data"))
    runs = {}
    for name, fn, fn_args in (
        (
            "mpmdc, 4 meshes x 2 devices, batch sharded",
            *pipelined(step, args, _common.four_meshes(), in_specs=batch_sharded),
        ),
        (
            "mpmdc, 4 meshes x 2 devices, batch replicated",
            *pipelined(step, args, _common.four_meshes()),
        ),
        ("mpmdc, 4 meshes x 1 device", *pipelined(step, args, mpmdc.make_meshes(4, {"data": 1}))),
        ("jax.jit, 1 device", jax.jit(step), args),
        (
            "jax.jit, data-parallel over 2 devices",
            jax.jit(step),
            data_parallel(args, jax.devices()[:2]),
        ),
        (
            "jax.jit, data-parallel over 8 devices",
            jax.jit(step),
            data_parallel(args, jax.devices()),
        ),
    ):
        runs[name] = blocked(fn, *fn_args)
        runs[name](), runs[name]()
    medians = _common.interleaved(list(runs.values()), repeat=steps)
    rows = [{"step": name, "median ms": t * 1e3} for name, t in zip(runs, medians)]
    by_name = {r["step"]: r["median ms"] for r in rows}
    for r in rows:
        r["vs 1-device jit"] = r["median ms"] / by_name["jax.jit, 1 device"]
        r["vs 2-device DP jit"] = r["median ms"] / by_name["jax.jit, data-parallel over 2 devices"]
    return rows


def splitting_work(steps: int) -> list[dict]:
    """One gradient of the 8-layer model alone, on 1 device against data-parallel over 2:
    for one microbatch (what a 4x2 pipeline fragment computes) and for the whole batch."""
    config = _common.transformer_config(8)
    params = init_transformer(jax.random.key(0), config)
    grad = jax.jit(jax.value_and_grad(lambda p, t: transformer_loss(p, t, config)))
    rows = []
    for sequences in (4, 32):
        tokens = jax.random.randint(jax.random.key(1), (sequences, 33), 0, config.vocab)
        one = blocked(grad, params, tokens)
        two = blocked(grad, *data_parallel((params, tokens), jax.devices()[:2]))
        one(), two()
        t1, t2 = (t * 1e3 for t in _common.interleaved([one, two], repeat=steps))
        rows.append(
            {"sequences": sequences, "1 device ms": t1, "2 devices ms": t2, "ratio": t2 / t1}
        )
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

    bare = jax.jit(body)
    y = jax.device_put(x, mesh[0].devices.flat[0])

    def bare_chain():
        z = y
        for _ in range(fragments):
            z = bare(z)
        return jax.block_until_ready(z)

    run(), bare_chain()
    per_fragment, bare_per_call = (
        t / fragments for t in _common.interleaved([run, bare_chain], repeat=calls)
    )
    return [
        {
            "call": "mpmdc fragment (in a chain)",
            "us per call": per_fragment * 1e6,
            "ratio": per_fragment / bare_per_call,
        },
        {"call": "bare jitted call (in a chain)", "us per call": bare_per_call * 1e6, "ratio": 1.0},
    ]


def loop_dispatch(microbatches: int, repeat: int) -> list[dict]:
    """A training step of tiny work (two stages on two 1-device meshes, the gradient
    summed over ``microbatches``) against the same number of bare jitted calls and
    ``jax.device_put`` copies between the two devices, in a Python loop: mpmdc's time
    per fragment call or transfer against a bare call's."""
    meshes = mpmdc.make_meshes(2, {"data": 1})

    def loss(w, x):
        h = jnp.tanh(mpmdc.stage(x, 0) * w[0])
        return jnp.sum(jnp.tanh(mpmdc.stage(h, 1) * w[1]))

    def step(w, xs):
        return mpmdc.accumulate(lambda x: jax.grad(loss)(w, x), xs, microbatches=microbatches)

    w, xs = jnp.ones((2, 8)), jnp.ones((microbatches, 8))
    executable, (w, xs) = pipelined(step, (w, xs), meshes)
    eqns = executable.program.jaxpr.jaxpr.eqns
    calls = sum(e.primitive.name == "fragment" for e in eqns)
    transfers = sum(e.primitive.name == "transfer" for e in eqns)
    run = blocked(executable, w, xs)

    body = jax.jit(lambda x: jnp.tanh(x * 1.0001))
    devices = [m.devices.flat[0] for m in meshes]
    x0 = jax.device_put(jnp.ones((8,)), devices[0])

    def bare():
        x = x0
        for k in range(calls):
            x = body(x)
            if k < transfers:
                x = jax.device_put(x, devices[(k + 1) % 2])
        return jax.block_until_ready(x)

    run(), bare()
    mpmdc_s, bare_s = _common.interleaved([run, bare], repeat=repeat)
    ops = calls + transfers
    return [
        {
            "microbatches": microbatches,
            "fragment calls": calls,
            "transfers": transfers,
            "mpmdc us per call or transfer": mpmdc_s / ops * 1e6,
            "bare us per call or device_put": bare_s / ops * 1e6,
            "ratio": mpmdc_s / bare_s,
        }
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=64)
    parser.add_argument(
        "--loop-only",
        action="store_true",
        help="only the per-call overhead of a step's microbatch loop at 8, 64 and 128 microbatches",
    )
    args = parser.parse_args()
    loop = [row for m in (8, 64, 128) for row in loop_dispatch(m, args.steps)]
    _common.report("runtime_loop_dispatch", loop, list(loop[0]))
    if args.loop_only:
        return
    _common.report(
        "runtime_step",
        step_times(args.steps),
        ["step", "median ms", "vs 1-device jit", "vs 2-device DP jit"],
    )
    _common.report(
        "runtime_splitting",
        splitting_work(args.steps),
        ["sequences", "1 device ms", "2 devices ms", "ratio"],
    )
    _common.report(
        "runtime_dispatch", dispatch(args.fragments, 100), ["call", "us per call", "ratio"]
    )


if __name__ == "__main__":
    main()
