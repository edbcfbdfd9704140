"""What the benchmark scripts share: 8 virtual CPU devices, the model, timing, tables, JSON.

Import this first: it sets the device count before JAX starts.
"""

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import mpmdc
from mpmdc.cli.models import (
    TransformerConfig,
    adam_init,
    init_transformer,
    transformer_step,
)

# A process of `mpmdc launch` has its own devices; a script run with
# MPMDC_BENCHMARK_PLATFORM=gpu uses the GPUs there are.
if not jax.distributed.is_initialized() and os.environ.get("MPMDC_BENCHMARK_PLATFORM") != "gpu":
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

RESULTS = Path(__file__).resolve().parent / "results"


def transformer_config(layers: int, stages: int = 4) -> TransformerConfig:
    """The benchmark transformer with ``layers`` layers."""
    return TransformerConfig(vocab=256, width=64, heads=4, hidden=256, layers=layers, stages=stages)


def step_function(layers: int, microbatches: int = 8, schedule: str = "1f1b", stages: int = 4):
    """The benchmark transformer's training step, a new function on each call (JAX
    caches tracing and lowering per function)."""
    config = transformer_config(layers, stages)

    def step(params, state, tokens):
        return transformer_step(
            params, state, tokens, config, microbatches=microbatches, schedule=schedule
        )

    return step


def transformer_setup(layers: int, microbatches: int = 8, schedule: str = "1f1b", stages: int = 4):
    """(step function, arguments) of the benchmark transformer's training step: 32
    sequences, or 4 per microbatch where there are more than 8 microbatches."""
    config = transformer_config(layers, stages)
    params = init_transformer(jax.random.key(0), config)
    tokens = jax.random.randint(jax.random.key(1), (max(32, 4 * microbatches), 33), 0, config.vocab)
    return step_function(layers, microbatches, schedule, stages), (
        params,
        adam_init(params),
        tokens,
    )


def stage_layout(stages: int, devices) -> tuple[Mesh, tuple[Mesh, ...]]:
    """A mesh ``{stage: s, data: n/s}`` over the ``n`` ``devices`` and its rows as ``s``
    meshes ``{data: n/s}`` for mpmdc: ``s`` = ``stages``, or on fewer devices the largest
    divisor of ``stages`` that divides ``n``, a device along ``stage`` then holding
    ``stages/s`` stages."""
    holders = math.gcd(stages, len(devices))
    grid = np.array(devices[: holders * (len(devices) // holders)]).reshape(holders, -1)
    return Mesh(grid, ("stage", "data")), tuple(Mesh(row, ("data",)) for row in grid)


def stage_schedules(stages: int, meshes) -> tuple[str, ...]:
    """1F1B and GPipe, interleaved 1F1B in place of 1F1B where a mesh holds several
    stages."""
    return ("1f1b" if len(meshes) == stages else "interleaved-1f1b", "gpipe")


def residual_stack(layers: int, width: int) -> dict:
    """Stacked parameters of a residual MLP stack: ``w`` ``(layers, width, width)``, ``b``
    ``(layers, width)``."""
    kw, kb = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(kw, (layers, width, width)) * (0.5 / width**0.5),
        "b": jax.random.normal(kb, (layers, width)) * 0.1,
    }


def residual_layer(h, wb):
    """One layer of the stack, as a ``lax.scan`` body: ``h + tanh(h @ w + b)``."""
    w, b = wb
    return h + jnp.tanh(h @ w + b), None


def residual_stack_loss(every: int):
    """Mean squared error of the stack run by one ``lax.scan``, a stage beginning every
    ``every`` layers (``mpmdc.stage(h, every=every)`` in the scan's body)."""

    def loss_fn(params, x, y):
        def marked(h, wb):
            return residual_layer(mpmdc.stage(h, every=every), wb)

        h, _ = jax.lax.scan(marked, x, (params["w"], params["b"]))
        return jnp.mean((h - y) ** 2)

    return loss_fn


def mean_loss_and_grad(loss_fn, params, batch, microbatches: int, schedule: str):
    """The loss and gradient of ``loss_fn`` averaged over the microbatches of ``batch``
    (``mpmdc.accumulate``)."""
    return mpmdc.accumulate(
        lambda mb: jax.value_and_grad(loss_fn)(params, *mb),
        batch,
        microbatches=microbatches,
        schedule=schedule,
        reduce="mean",
    )


def launched(script: str, *args: str, processes: int = 4, timeout: int = 600):
    """Run ``script --worker ARGS`` as ``processes`` processes under ``mpmdc launch`` and
    return what process 0 printed as JSON after ``RESULT `` (exits if it printed none)."""
    command = [sys.executable, "-m", "mpmdc", "launch", "-n", str(processes)]
    command += ["--timeout", str(timeout), "--", sys.executable, script, "--worker", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60)
    for line in result.stdout.splitlines():
        if line.startswith("[0] RESULT "):
            return json.loads(line[len("[0] RESULT ") :])
    raise SystemExit(
        f"the launched run printed no result (status {result.returncode}):\n"
        f"{result.stdout[-3000:]}{result.stderr[-2000:]}"
    )


def warm_up(meshes=None) -> None:
    """Run a 1-layer step with ``jax.jit`` and with mpmdc (on ``meshes``, default
    :func:`four_meshes`): first-use costs (JAX's rules and caches, mpmdc's too) are
    paid before anything is timed."""
    step, args = transformer_setup(1, microbatches=2)
    first_call(jax.jit(step), args)
    with warnings.catch_warnings():  # one layer is one stage: the other meshes sit idle
        warnings.simplefilter("ignore", mpmdc.errors.IdleMeshWarning)
        first_call(mpmdc.compile(step_function(1, microbatches=2), meshes or four_meshes()), args)


def first_call(fn, args) -> float:
    """Seconds from calling ``fn`` (mpmdc-compiled or jitted, not called before) to its
    result on this process's devices: tracing, passes, compiling and one step."""
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready([x for x in jax.tree_util.tree_leaves(out) if x.addressable_shards])
    return time.perf_counter() - start


def four_meshes():
    """4 meshes of 2 CPU devices."""
    return mpmdc.make_meshes(4, {"data": 2})


def seconds(fn, *, repeat: int = 1) -> float:
    """Median wall time of ``fn()`` (which should block until its work is done)."""
    return interleaved([fn], repeat=repeat)[0]


def interleaved(fns, *, repeat: int) -> list[float]:
    """Median wall time of each of ``fns``, timed in turn ``repeat`` times over: on a shared
    machine, load that comes and goes then lands on all of them alike, not on one."""
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def machine() -> str:
    """One line naming this machine."""
    first = jax.devices()[0]
    devices = "virtual CPU devices" if first.platform == "cpu" else f"{first.device_kind} devices"
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{sys.version.split()[0]}, jax {jax.__version__}, {jax.device_count()} {devices}"
    )


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` (floats with 3 significant digits)."""

    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def report(name: str, rows: list[dict], columns: list[str], notes: str = "") -> None:
    """Print the table and write ``results/<name>.json``."""
    RESULTS.mkdir(exist_ok=True)
    print(f"# {name} ({machine()})")
    print(table(rows, columns))
    if notes:
        print(notes)
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"machine": machine(), "rows": rows, "notes": notes}, indent=1) + "\n"
    )
