"""Memory a compiled function keeps per call signature: mpmdc against jax.jit.

The README's 4-stage MLP training step (16x16 layers, 8 microbatches under 1F1B, SGD)
on 4 meshes of 2 CPU devices, called with `--sizes` batch sizes (8k rows, k = 1..N):
each a new signature, so each call compiles and adds one cache entry. Each
configuration runs in a fresh process: two warm-up calls at other batch sizes, then the
process's resident memory before and after the N calls, each reading taken after
`gc.collect()` and glibc's `malloc_trim(0)` (so memory freed is given back to the
system and not counted); per entry = growth / N. The warm-up runs a function of its
own, dropped before the N calls, so that no entry of it is counted or evicted. Also the executables alive (the CPU
client's `live_executables()`) per entry, and what is left once `step.clear_cache()`
and then `jax.clear_caches()` have run: resident memory over the reading before the N
calls, and executables over the count before the warm-up (whose function is gone).

Configurations: `jax.jit` of the step; `mpmdc.compile` of it; the same with the
`Lowered` of each signature kept beside its entry (`step.lower(...)`, compiled through
`.compile()`), which is what holding each fragment's module costs; and mpmdc with
`cache_size=8`, where only the 8 most recently used signatures stay.

    python benchmarks/executable_cache.py [--sizes 50]
"""

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys

import _common
import jax
import jax.numpy as jnp
import numpy as np

import mpmdc

CONFIGURATIONS = ("jax.jit", "mpmdc", "mpmdc, Lowered kept", "mpmdc, cache_size=8")


def resident_bytes() -> int:
    """Resident memory after a collection, with freed heap pages given back."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_executables() -> int:
    gc.collect()
    return len(jax.devices()[0].client.live_executables())


def loss_fn(params, x, y):
    for i, w in enumerate(params):
        x = jnp.tanh(mpmdc.stage(x, i) @ w)
    return jnp.mean((x - y) ** 2)


def train_step(params, x, y):
    loss, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(loss_fn)(params, *mb),
        (x, y),
        microbatches=8,
        schedule="1f1b",
        reduce="mean",
    )
    return loss, [w - 0.1 * g for w, g in zip(params, grads)]


def measure(configuration: str, sizes: int) -> dict:
    """One configuration, in this process: memory and executables per entry."""
    params = [jax.random.normal(k, (16, 16)) / 4 for k in jax.random.split(jax.random.key(0), 4)]

    def compiled():
        if configuration == "jax.jit":
            return jax.jit(train_step)
        cache_size = 8 if configuration.endswith("cache_size=8") else 64
        return mpmdc.compile(train_step, _common.four_meshes(), cache_size=cache_size)

    kept = []

    def call(step, k: int) -> None:
        x = y = np.ones((8 * k, 16), np.float32)
        if configuration == "mpmdc, Lowered kept":
            kept.append(step.lower(params, x, y))
            kept[-1].compile()
        jax.block_until_ready(step(params, x, y))

    executables = live_executables()
    warm = compiled()  # first-use costs paid by a function of its own, then dropped
    call(warm, sizes + 1)
    call(warm, sizes + 2)
    kept.clear()
    warm.clear_cache()
    step = compiled()
    before, warm_executables = resident_bytes(), live_executables()
    for k in range(1, sizes + 1):
        call(step, k)
    grown, more = resident_bytes() - before, live_executables() - warm_executables
    kept.clear()
    step.clear_cache()
    cleared, cleared_executables = resident_bytes() - before, live_executables() - executables
    jax.clear_caches()
    all_cleared = resident_bytes() - before
    mib = 2**20
    return {
        "configuration": configuration,
        "signatures": sizes,
        "MiB per entry": grown / sizes / mib,
        "executables per entry": more / sizes,
        "MiB held": grown / mib,
        "MiB left after clear_cache()": cleared / mib,
        "executables left": cleared_executables,
        "MiB left after jax.clear_caches()": all_cleared / mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, default=50, help="batch sizes, one signature each")
    parser.add_argument("--configuration", choices=CONFIGURATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.configuration:  # a fresh process measuring one configuration
        print("RESULT " + json.dumps(measure(args.configuration, args.sizes)))
        return
    rows = []
    for configuration in CONFIGURATIONS:
        command = [sys.executable, __file__, "--sizes", str(args.sizes)]
        result = subprocess.run(
            [*command, "--configuration", configuration],
            capture_output=True,
            text=True,
            check=True,
        )
        line = next(ln for ln in result.stdout.splitlines() if ln.startswith("RESULT "))
        rows.append(json.loads(line[len("RESULT ") :]))
    _common.report("executable_cache", rows, list(rows[0]))


if __name__ == "__main__":
    main()
