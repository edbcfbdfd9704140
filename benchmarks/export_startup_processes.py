"""Start-up to the first step under ``mpmdc launch -n 4``: from exported bytes against
tracing and compiling in every process.

The step of ``tests/e2e/test_export.py`` (4 meshes of 2 devices, 1F1B, AdamW) is exported
once; then launches of 4 processes with 2 devices each, in turns (compile, load, ...),
each process timing from ``mpmdc.compile`` or ``mpmdc.deserialize`` to its first step's
result. The slowest process's time and the whole launch's are printed.

Usage::

    python benchmarks/export_startup_processes.py [--pairs 2]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
sys.path[:0] = [os.path.join(TESTS, "e2e"), TESTS]


def worker(mode: str, folder: str) -> None:
    """One process of a launch: its first step, timed; prints ``first-step SECONDS``."""
    import mpmdc

    mpmdc.distributed.initialize()
    import jax
    import numpy as np
    import optax  # noqa: F401  (the optimizer state's types, which the pytrees name)

    start = time.perf_counter()
    if mode == "compile":
        import test_export

        step = mpmdc.compile(test_export.train_step, mpmdc.make_meshes(4, {"data": 2}))
        out = step(*test_export.inputs())
    else:
        with open(os.path.join(folder, "step.mpmdc"), "rb") as f:
            exported = mpmdc.deserialize(f.read())
        saved = np.load(os.path.join(folder, "inputs.npz"))
        leaves = [saved[f"arr_{k}"] for k in range(len(saved.files))]
        args, kwargs = exported.in_tree.unflatten(leaves)
        out = exported.call(*args, **kwargs)
    jax.block_until_ready(mpmdc.fetch(jax.tree_util.tree_leaves(out)))
    print(f"first-step {time.perf_counter() - start:.3f}", flush=True)


def launch(mode: str, folder: str) -> tuple[float, float]:
    """(slowest process's first step, whole launch) in seconds."""
    start = time.perf_counter()
    launcher = [sys.executable, "-m", "mpmdc", "launch", "-n", "4", "--devices-per-process", "2"]
    done = subprocess.run(
        [*launcher, "--", sys.executable, __file__, "--worker", mode, "--folder", folder],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    whole = time.perf_counter() - start
    firsts = [float(w.split()[-1]) for w in done.stdout.splitlines() if "first-step" in w]
    return max(firsts), whole


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--worker")
    parser.add_argument("--folder")
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.folder)
        return
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import numpy as np
    import test_export

    import mpmdc

    with tempfile.TemporaryDirectory() as folder:
        step = mpmdc.compile(test_export.train_step, mpmdc.make_meshes(4, {"data": 2}))
        args = test_export.inputs()
        with open(os.path.join(folder, "step.mpmdc"), "wb") as f:
            f.write(mpmdc.export(step)(*args).serialize())
        np.savez(os.path.join(folder, "inputs.npz"), *test_export.leaves(args))
        print("| start-up | slowest process: first step s | whole launch s |")
        print("|---|---|---|")
        for _ in range(options.pairs):
            for mode in ("compile", "load"):
                first, whole = launch(mode, folder)
                print(f"| {mode} | {first:.2f} | {whole:.1f} |", flush=True)


if __name__ == "__main__":
    main()
