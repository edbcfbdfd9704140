"""Many processes against one: step time, transfers between processes, compile time.

Three tables, one run each (medians over repeats within the run):

1. the 8-layer transformer + Adam step (4 stages, 8 microbatches, 1F1B) with 4
   processes x 1 CPU device, against one process with 4 meshes of 1 device and
   against ``jax.jit`` on one device;
2. moving 1 KB to 64 MB from one process's device to another's (JAX's cross-host
   ``device_put`` over the loopback socket transport) against ``device_put`` between
   two devices of one process;
3. function to first result per process (trace, passes, compile, one step: the
   first call) against ``jax.jit``'s first call of the same step in the same process,
   all processes at once, and the same in one process compiling every mesh's fragments.

Usage::

    python benchmarks/multiprocess.py           # starts `mpmdc launch -n 4` itself

The script re-runs itself under ``mpmdc launch`` with ``--worker``; process 0 prints
its measurements as one JSON line, which the parent reads.
"""

import json
import os
import statistics
import sys
import time

import mpmdc

WORKER = "--worker" in sys.argv
if WORKER:
    mpmdc.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

LAYERS = 8
SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26]
REPEAT = 10


def step_setup():
    return _common.transformer_setup(LAYERS, microbatches=8, schedule="1f1b")


def time_steps(fn, args, feed, repeat=REPEAT):
    """Median seconds of one step of ``fn`` fed back into itself (after a warm-up)."""
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeat):
        args = feed(out, args)
        start = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready([x for x in jax.tree_util.tree_leaves(out) if x.addressable_shards])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def feed(out, args):
    return (out[0], out[1], args[2])


def first_calls(meshes) -> tuple[float, float]:
    """Seconds of mpmdc's first call of the step on ``meshes``, then of ``jax.jit``'s
    (each: function to result)."""
    step, args = step_setup()
    mpmdc_s = _common.first_call(mpmdc.compile(step, meshes), args)
    if mpmdc.distributed.is_multiprocess():
        mpmdc.distributed.barrier("bench-jit-first-call")
    return mpmdc_s, _common.first_call(jax.jit(step), args)


def worker():
    """One of 4 processes: first calls and step times, then process 0 -> 1 transfers."""
    here = jax.process_index()
    meshes = mpmdc.make_meshes(4, {"data": 1})
    _common.warm_up(meshes)
    mpmdc.distributed.barrier("bench-warm")
    compile_s, jit_compile_s = first_calls(meshes)
    client = mpmdc._jax_compat.distributed_client()
    client.key_value_set(f"mpmdc/bench/first-call/{here}", json.dumps([compile_s, jit_compile_s]))
    step, args = step_setup()
    compiled = mpmdc.compile(step, meshes)
    jax.block_until_ready(
        [x for x in jax.tree_util.tree_leaves(compiled(*args)) if x.addressable_shards]
    )
    mpmdc.distributed.barrier("bench-step")
    step_s = time_steps(compiled, args, feed)
    transfers = {}
    first = {d.process_index: d for d in reversed(jax.devices())}
    src, dst = (
        jax.sharding.SingleDeviceSharding(first[0]),
        jax.sharding.SingleDeviceSharding(first[1]),
    )
    for size in SIZES:
        shape = (size // 4,)
        if here == 0:
            x = jax.device_put(np.ones(shape, np.float32), src)
        else:
            x = jax.make_array_from_single_device_arrays(shape, src, [], dtype=np.float32)
        jax.block_until_ready(x)
        times = []
        for k in range(REPEAT):
            mpmdc.distributed.barrier(f"bench-transfer-{size}-{k}")
            start = time.perf_counter()
            y = jax.device_put(x, dst)
            if here == 1:
                jax.block_until_ready(y)
                times.append(time.perf_counter() - start)
        if here == 1:
            transfers[size] = statistics.median(times)
    key = "mpmdc/bench/result"
    if here == 1:
        client.key_value_set(key, json.dumps(transfers))
    if here == 0:
        received = json.loads(client.blocking_key_value_get(key, 60_000))
        firsts = [
            json.loads(client.blocking_key_value_get(f"mpmdc/bench/first-call/{i}", 60_000))
            for i in range(4)
        ]
        print(
            "RESULT "
            + json.dumps({"step_s": step_s, "first_calls": firsts, "transfers": received}),
            flush=True,
        )


def in_one_process():
    meshes = mpmdc.make_meshes(4, {"data": 1})
    _common.warm_up(meshes)
    compile_s, jit_compile_s = first_calls(meshes)
    step, args = step_setup()
    compiled = mpmdc.compile(step, meshes)
    step_s = time_steps(compiled, args, feed)
    jitted = jax.jit(step)
    jit_s = time_steps(jitted, args, feed)
    devices = jax.devices()
    transfers = {}
    for size in SIZES:
        x = jax.device_put(np.ones((size // 4,), np.float32), devices[0])
        jax.block_until_ready(x)
        transfers[size] = _common.seconds(
            lambda x=x: jax.block_until_ready(jax.device_put(x, devices[1])), repeat=REPEAT
        )
    return {
        "step_s": step_s,
        "jit_s": jit_s,
        "first_call": [compile_s, jit_compile_s],
        "transfers": transfers,
    }


def main():
    many = _common.launched(__file__)
    one = in_one_process()
    steps = [
        {"run": "jax.jit, 1 device", "step ms": one["jit_s"] * 1e3, "vs jit": 1.0},
        {
            "run": "mpmdc, 1 process, 4 meshes x 1",
            "step ms": one["step_s"] * 1e3,
            "vs jit": one["step_s"] / one["jit_s"],
        },
        {
            "run": "mpmdc, 4 processes x 1 device",
            "step ms": many["step_s"] * 1e3,
            "vs jit": many["step_s"] / one["jit_s"],
        },
    ]
    _common.report(
        "multiprocess-step",
        steps,
        ["run", "step ms", "vs jit"],
        f"{LAYERS}-layer transformer + Adam, 4 stages, 8 microbatches, 1F1B (process 0's view)",
    )
    rows = []
    for size in SIZES:
        cross, local = many["transfers"][str(size)], one["transfers"][size]
        rows.append(
            {
                "bytes": size,
                "between processes ms": cross * 1e3,
                "MB/s": size / cross / 1e6,
                "in one process ms": local * 1e3,
                "in-process MB/s": size / local / 1e6,
                "ratio": cross / local,
            }
        )
    _common.report(
        "multiprocess-transfers",
        rows,
        ["bytes", "between processes ms", "MB/s", "in one process ms", "in-process MB/s", "ratio"],
        "one array, process 0's device -> process 1's device, receiver waits; median of 10",
    )
    compiles = [
        {
            "run": "1 process, every mesh's fragments",
            "mpmdc s": one["first_call"][0],
            "jax.jit s": one["first_call"][1],
            "ratio": one["first_call"][0] / one["first_call"][1],
        }
    ]
    compiles += [
        {
            "run": f"4 processes at once: process {i}, its own mesh's",
            "mpmdc s": m,
            "jax.jit s": j,
            "ratio": m / j,
        }
        for i, (m, j) in enumerate(many["first_calls"])
    ]
    _common.report(
        "multiprocess-compile",
        compiles,
        ["run", "mpmdc s", "jax.jit s", "ratio"],
        "first call (trace, passes, compile, one step) of mpmdc, then of jax.jit in the same "
        "process; in the 4-process run all processes do each at once on 2 cores",
    )


if __name__ == "__main__":
    worker() if WORKER else main()
