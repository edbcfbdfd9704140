"""Start-up to the first step: from exported bytes against tracing and compiling.

The 8-layer transformer + Adam step (4 meshes of 2 CPU devices, 8 microbatches, 1F1B)
is exported once; then fresh processes, in turns (compile, load, compile, load, ...),
each time from just after their imports to the first step's result:

- ``compile``: ``mpmdc.compile(step, meshes)`` and its first call (trace, passes,
  StableHLO, XLA, one step);
- ``load``: ``mpmdc.deserialize`` of the bytes and ``Exported.call`` (rebuild, lower
  the deserialized modules, XLA, one step).

Each process also reports its CPU time (user + system) over the same span. The median
of each and the median of the per-pair ratios are reported. With ``--cache`` every
process shares one JAX persistent compilation cache, filled by one process of each kind
before the pairs, so XLA compiles nothing and what is left is the work before it.

Usage::

    python benchmarks/export_startup.py [--pairs 5] [--layers 8] [--cache]
"""

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common
import jax

import mpmdc


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def worker(mode: str, layers: int, folder: str) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    start, cpu = time.perf_counter(), _cpu()
    if mode == "compile":
        fn, args = _common.transformer_setup(layers)
        step = mpmdc.compile(fn, mpmdc.make_meshes(4, {"data": 2}))
        start, cpu = time.perf_counter(), _cpu()  # the arguments' initialization left out
        out = step(*args)
    else:
        with open(os.path.join(folder, "step.mpmdc"), "rb") as f:
            data = f.read()
        with open(os.path.join(folder, "args.pickle"), "rb") as f:
            args = pickle.load(f)  # (the benchmark's own file of NumPy arrays)
        start, cpu = time.perf_counter(), _cpu()
        out = mpmdc.deserialize(data).call(*args)
    jax.block_until_ready(out)
    print(json.dumps({"wall": time.perf_counter() - start, "cpu": _cpu() - cpu}))


def measure(mode: str, layers: int, folder: str, cache: bool) -> dict:
    env = dict(os.environ)
    if cache:
        env.update(
            JAX_COMPILATION_CACHE_DIR=os.path.join(folder, "cache"),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    result = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--layers", str(layers), "--folder", folder],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env=env,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cache", action="store_true")
    parser.add_argument("--worker")
    parser.add_argument("--folder")
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.layers, options.folder)
        return
    with tempfile.TemporaryDirectory() as folder:
        fn, args = _common.transformer_setup(options.layers)
        step = mpmdc.compile(fn, _common.four_meshes())
        started = time.perf_counter()
        data = mpmdc.export(step)(*args).serialize()
        export_s = time.perf_counter() - started
        with open(os.path.join(folder, "step.mpmdc"), "wb") as f:
            f.write(data)
        with open(os.path.join(folder, "args.pickle"), "wb") as f:
            pickle.dump(jax.device_get(args), f)
        runs = {"compile": [], "load": []}
        if options.cache:
            for mode in runs:  # (fills the cache)
                measure(mode, options.layers, folder, cache=True)
        for _ in range(options.pairs):
            for mode in runs:
                runs[mode].append(measure(mode, options.layers, folder, options.cache))
    rows = []
    for mode, found in runs.items():
        rows.append(
            {
                "start-up": mode,
                "first step s (median)": statistics.median(r["wall"] for r in found),
                "spread s": max(r["wall"] for r in found) - min(r["wall"] for r in found),
                "CPU s (median)": statistics.median(r["cpu"] for r in found),
            }
        )
    ratios = [lo["wall"] / co["wall"] for lo, co in zip(runs["load"], runs["compile"])]
    cpu_ratios = [lo["cpu"] / co["cpu"] for lo, co in zip(runs["load"], runs["compile"])]
    notes = (
        f"{options.layers}-layer transformer + Adam, 4 meshes x 2 CPU devices, 8 microbatches, "
        f"1F1B; {options.pairs} pairs of fresh processes"
        f"{', a warm persistent compilation cache' if options.cache else ''}; exported bytes: {len(data):,}, "
        f"export took {export_s:.2f} s. load / compile, per pair (median): wall "
        f"{statistics.median(ratios):.2f}, CPU {statistics.median(cpu_ratios):.2f}."
    )
    _common.report(
        "export_startup_cached" if options.cache else "export_startup",
        rows,
        ["start-up", "first step s (median)", "spread s", "CPU s (median)"],
        notes,
    )


if __name__ == "__main__":
    main()
