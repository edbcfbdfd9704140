"""Compile time of a transformer training step: mpmdc against jax.jit.

The step: next-token loss and gradient over 8 microbatches under 1F1B, then Adam, for
4 to 32 layers in 4 stages on 4 meshes of 2 CPU devices. After a warm-up of both (a
1-layer step), for mpmdc it times tracing, the passes alone (inline..schedule, and per
equation of the traced program), the `lower` pass (StableHLO) and the whole `lower()`
against `jax.jit(step).lower(...)` (each median of 3, taken in turns); then
`lower().compile()` with the number of fragments XLA compiled and of those loaded from
another mesh's executable, against `jax.jit(step).lower(...).compile()` of the same
step on one device (where `accumulate` is a `lax.scan`); then the first call of each
(function to result: what a user waits for; mpmdc's compiles each module while
lowering the next), median of 3 taken in turns. Writes results/compile_time.json and,
with matplotlib, results/compile_time.png.

Then the first calls at 8 layers in two fresh processes sharing JAX's persistent
compilation cache (cold, then warm).

Then where the compile time goes: XLA compiling mpmdc's distinct modules of the 8-layer
step one after another against `jax.jit`'s one module (in all, and per module: inside
the microbatch loop or outside it), and XLA's time for one jitted gradient module
against its number of layers.

    python benchmarks/compile_time.py [--layers 4 8 16 32]

With ``--microbatches``, only the sweep over microbatch counts (for each of ``--layers``):

    python benchmarks/compile_time.py --layers 8 32 --microbatches 8 32 64 128
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

import _common
import jax

import mpmdc
from mpmdc import backends
from mpmdc.cli.models import init_transformer, transformer_loss
from mpmdc.ir.program import fragment_key

PASSES = (
    "after-inline",
    "after-partition",
    "after-dce",
    "after-vma-typecheck",
    "after-split",
    "after-schedule",
)
COUNTS = {"compiled": 0, "loaded": 0}
REPEAT = 3  # lowerings and first calls of each, taking turns (median)


def _counting(method, counter):
    def counted(self, *args):
        COUNTS[counter] += 1
        return method(self, *args)

    return counted


# How many fragments XLA compiles, and how many reuse another mesh's executable.
backends.Backend.compile_fragment = _counting(backends.Backend.compile_fragment, "compiled")
backends.Backend.load_fragment = _counting(backends.Backend.load_fragment, "loaded")


def measure(layers: int) -> dict:
    args = _common.transformer_setup(layers)[1]
    lowers, jit_lowers, phases = [], [], []
    for _ in range(REPEAT):  # taking turns, so that load on the machine falls on both alike
        start = time.perf_counter()
        lowered = mpmdc.compile(_common.step_function(layers), _common.four_meshes()).lower(*args)
        lowers.append(time.perf_counter() - start)
        phases.append(lowered.seconds)
        jit_lowers.append(
            _common.seconds(lambda: jax.jit(_common.step_function(layers)).lower(*args))
        )
    lower_s, jit_lower_s = statistics.median(lowers), statistics.median(jit_lowers)
    COUNTS.update(compiled=0, loaded=0)
    start = time.perf_counter()
    lowered.compile()
    compile_s = time.perf_counter() - start
    counts = dict(COUNTS)
    jit_s = _common.seconds(lambda: jax.jit(_common.step_function(layers)).lower(*args).compile())
    firsts, jit_firsts = [], []
    for _ in range(REPEAT):  # taking turns, so that load on the machine falls on both alike
        firsts.append(
            _common.first_call(
                mpmdc.compile(_common.step_function(layers), _common.four_meshes()), args
            )
        )
        jit_firsts.append(_common.first_call(jax.jit(_common.step_function(layers)), args))
    first_s, jit_first_s = statistics.median(firsts), statistics.median(jit_firsts)
    seconds = {name: statistics.median(p[name] for p in phases) for name in phases[0]}
    passes = sum(seconds[p] for p in PASSES)
    eqns = len(lowered.program("input").jaxpr.jaxpr.eqns)
    return {
        "layers": layers,
        "equations": eqns,
        "trace s": seconds["input"],
        "passes s": passes,
        "passes us/eqn": passes / eqns * 1e6,
        "StableHLO s": seconds["stablehlo"],
        "lower() s": lower_s,
        "jax.jit lower s": jit_lower_s,
        "lower ratio": lower_s / jit_lower_s,
        "compile() s": compile_s,
        "XLA compiles": counts["compiled"],
        "loaded": counts["loaded"],
        "mpmdc total s": lower_s + compile_s,
        "jax.jit total s": jit_s,
        "ratio": (lower_s + compile_s) / jit_s,
        "first call s": first_s,
        "jax.jit first call s": jit_first_s,
        "first-call ratio": first_s / jit_first_s,
    }


def measure_microbatches(layers: int, microbatches: int) -> dict:
    """`lower()` and function -> runnable (`lower()` then `compile()`) of the step over
    ``microbatches`` microbatches against `jax.jit`'s lower and lower + compile (one
    device, `accumulate` a `lax.scan`); the passes' share; the peak of Python memory
    allocated during one more `lower()` (tracemalloc, which slows it, so timed apart)."""
    args = _common.transformer_setup(layers, microbatches)[1]

    def fresh():
        return _common.step_function(layers, microbatches)

    lowers, jit_lowers, phases = [], [], []
    for _ in range(REPEAT):  # taking turns, so that load on the machine falls on both alike
        start = time.perf_counter()
        lowered = mpmdc.compile(fresh(), _common.four_meshes()).lower(*args)
        lowers.append(time.perf_counter() - start)
        phases.append(lowered.seconds)
        jit_lowers.append(_common.seconds(lambda: jax.jit(fresh()).lower(*args)))
    compile_s = _common.seconds(lowered.compile)
    jit_total_s = _common.seconds(lambda: jax.jit(fresh()).lower(*args).compile())
    tracemalloc.start()
    mpmdc.compile(fresh(), _common.four_meshes()).lower(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    seconds = {name: statistics.median(p[name] for p in phases) for name in phases[0]}
    lower_s, jit_lower_s = statistics.median(lowers), statistics.median(jit_lowers)
    split = lowered.program("after-split").jaxpr.jaxpr.eqns
    scheduled = lowered.program("after-schedule").jaxpr.jaxpr.eqns
    return {
        "layers": layers,
        "microbatches": microbatches,
        "equations traced": len(lowered.program("input").jaxpr.jaxpr.eqns),
        "calls before schedule": len(split),
        "calls after": len(scheduled),
        "passes s": sum(seconds[p] for p in PASSES),
        "lower() s": lower_s,
        "jax.jit lower s": jit_lower_s,
        "lower ratio": lower_s / jit_lower_s,
        "lower() peak MiB": peak / 2**20,
        "runnable s": lower_s + compile_s,
        "jax.jit runnable s": jit_total_s,
        "runnable ratio": (lower_s + compile_s) / jit_total_s,
    }


def warm_cache(layers: int) -> list[dict]:
    """First calls in two fresh processes sharing a persistent compilation cache: the
    first fills it, the second finds every module there."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
        for run in ("cold (fills the cache)", "warm"):
            command = [sys.executable, __file__, "--first-calls", str(layers)]
            found = json.loads(
                subprocess.run(
                    command, env=env, capture_output=True, text=True, check=True
                ).stdout.splitlines()[-1]
            )
            rows.append(
                {
                    "layers": layers,
                    "cache": run,
                    "mpmdc first call s": found[0],
                    "jax.jit first call s": found[1],
                    "ratio": found[0] / found[1],
                }
            )
    return rows


def first_calls(layers: int) -> None:
    """Print ``[mpmdc's first call s, jax.jit's]`` for the step (after a warm-up)."""
    _common.warm_up()
    args = _common.transformer_setup(layers)[1]
    mpmdc_s = _common.first_call(
        mpmdc.compile(_common.step_function(layers), _common.four_meshes()), args
    )
    print(json.dumps([mpmdc_s, _common.first_call(jax.jit(_common.step_function(layers)), args)]))


def xla_split(layers: int) -> tuple[list[dict], list[dict]]:
    """XLA's time alone: each of mpmdc's distinct modules compiled one after another,
    against the one module of `jax.jit`; and per module, what it is and its compile time."""
    step, args = _common.transformer_setup(layers)
    program = mpmdc.compile(step, _common.four_meshes()).lower(*args).program("stablehlo")
    fragments = [e for e in program.jaxpr.jaxpr.eqns if e.primitive.name == "fragment"]
    sharing: dict = {}
    for eqn in fragments:
        sharing.setdefault(fragment_key(eqn), []).append(eqn)
    modules = []
    for name, key in program.module_keys:
        first = sharing[key][0]
        where = "microbatch loop" if first.params["microbatch"] is not None else "outside the loop"
        modules.append(
            {
                "fragment": name,
                "mesh": first.params["mesh"],
                "calls per step": len(sharing[key]),
                "where": where,
                "equations": len(first.params["jaxpr"].jaxpr.eqns),
                "XLA compile s": _common.seconds(program.lowerings[key].compile),
            }
        )
    each = [m["XLA compile s"] for m in modules]
    jit_lowered = jax.jit(step).lower(*args)
    summary = [
        {
            "modules": f"mpmdc, {len(each)} distinct fragment modules",
            "XLA compile s": sum(each),
            "smallest s": min(each),
            "largest s": max(each),
        },
        {
            "modules": "jax.jit, 1 module",
            "XLA compile s": _common.seconds(jit_lowered.compile),
            "smallest s": float("nan"),
            "largest s": float("nan"),
        },
    ]
    return summary, modules


def xla_module_size(layer_counts) -> list[dict]:
    """XLA's time for one jitted gradient (one microbatch, one device) of 1 to 16 layers:
    a large fixed cost per module, a small one per layer."""
    rows = []
    for layers in layer_counts:
        config = _common.transformer_config(layers, stages=1)
        params = init_transformer(jax.random.key(0), config)
        tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, config.vocab)
        lowered = jax.jit(
            jax.value_and_grad(lambda p, t, config=config: transformer_loss(p, t, config))
        ).lower(params, tokens)
        lines = lowered.as_text().count("\n")
        seconds = _common.seconds(lowered.compile)
        rows.append(
            {
                "layers": layers,
                "StableHLO lines": lines,
                "XLA compile s": seconds,
                "ms per line": seconds / lines * 1e3,
            }
        )
    return rows


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(layers, [r["mpmdc total s"] for r in rows], "o-", label="mpmdc lower() + compile()")
    ax.plot(layers, [r["passes s"] for r in rows], "o-", label="mpmdc passes alone")
    ax.plot(
        layers,
        [r["jax.jit total s"] for r in rows],
        "o-",
        label="jax.jit lower + compile (1 device)",
    )
    ax.set_xlabel("transformer layers (8 microbatches, 1F1B, 4 meshes)")
    ax.set_ylabel("seconds")
    ax.set_xscale("log", base=2)
    ax.set_xticks(layers, [str(n) for n in layers])
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        help="only the microbatch sweep: lower() and function -> runnable per microbatch "
        "count, for each of --layers",
    )
    parser.add_argument("--first-calls", type=int, help=argparse.SUPPRESS)  # a warm_cache process
    options = parser.parse_args()
    if options.first_calls:
        return first_calls(options.first_calls)
    _common.warm_up()
    if options.microbatches:
        rows = [measure_microbatches(n, m) for n in options.layers for m in options.microbatches]
        return _common.report("compile_microbatches", rows, list(rows[0]))
    rows = [measure(n) for n in options.layers]
    columns = list(rows[0])
    _common.report("compile_time", rows, columns)
    plot(rows, _common.RESULTS / "compile_time.png")
    warm = warm_cache(8)
    _common.report("compile_warm_cache", warm, list(warm[0]))
    split, modules = xla_split(8)
    _common.report("compile_xla_split", split, list(split[0]))
    _common.report("compile_xla_modules", modules, list(modules[0]))
    sizes = xla_module_size([1, 2, 4, 8, 16])
    _common.report("compile_xla_module_size", sizes, list(sizes[0]))


if __name__ == "__main__":
    main()
