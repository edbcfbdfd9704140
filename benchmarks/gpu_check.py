"""mpmdc end to end on the accelerators there are (CUDA, ROCm or TPU), against ``jax.jit``.

Each check compiles a training step with ``mpmdc.compile`` over meshes of the
accelerators, runs it, and compares its outputs with ``jax.jit`` of the same function on
one accelerator:

- **mlp-sgd**: the demo's 4-stage MLP, SGD over 8 microbatches (``mpmdc.accumulate``);
- **transformer-adam**: the benchmark transformer (8 layers, 4 stages), Adam;
- **scanned-stack-optax**: a residual stack of 8 layers run by one ``lax.scan`` with
  ``mpmdc.stage(h, every=2)``, ``optax.adamw``, state fed back for three steps;
- **checkpoint**: the scanned stack's state saved after one step, restored onto the
  compiled step's input shardings, and a second step from it against one without the
  checkpoint (bitwise);
- **no recompile**: a second call with the same types compiles nothing.

Meshes: 4 of ``devices / 4`` accelerators each, or where there are fewer than 4, one
mesh per accelerator (``gcd(4, devices)`` meshes), the 4 stages spread over them with
interleaved 1F1B and GPipe.

The tolerance of each check comes from its noise floor, measured here: ``jax.jit`` of
the same step at two microbatch counts (another reduction order), relative to the
largest value of each output. A check passes when mpmdc's difference from ``jax.jit``
is at most 10x that floor (GPU matmuls in float32 run as TF32 by default, so the floor
is far above float32's). Prints a table and writes ``results/gpu_check.json``.

    python benchmarks/gpu_check.py [--platform auto|gpu|cpu]
"""

# The platform must be chosen before ``_common`` starts JAX.
# ruff: noqa: E402
import argparse
import os
import shutil
import tempfile
import time
import traceback

PARSER = argparse.ArgumentParser(description=__doc__.splitlines()[0])
PARSER.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto")
OPTIONS = PARSER.parse_args()
if OPTIONS.platform == "gpu" or (OPTIONS.platform == "auto" and shutil.which("nvidia-smi")):
    os.environ["MPMDC_BENCHMARK_PLATFORM"] = "gpu"


import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpmdc
from mpmdc.cli.demo import init_params, train_step
from mpmdc.runtime.compiling import XlaCompiles

STAGES = 4
MARGIN = 10  # a check passes within MARGIN x its measured noise floor


def schedules(meshes) -> tuple[str, ...]:
    return _common.stage_schedules(STAGES, meshes)


def relative_error(got, want) -> float:
    """Max over leaves of max |got - want| / max |want|."""
    errors = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errors.append(float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-30))
    return max(errors)


def where(tree) -> str:
    """The platforms the leaves of ``tree`` live on."""
    return ",".join(sorted({d.platform for a in jax.tree.leaves(tree) for d in a.devices()}))


def compare(name, make_step, args, microbatches, meshes, in_specs=None) -> list[dict]:
    """One row per schedule: mpmdc's step against ``jax.jit``'s, with the noise floor of
    ``jax.jit`` at ``microbatches`` against ``microbatches // 2``."""
    on_one = jax.device_put(args, jax.devices()[0])
    want = jax.jit(make_step(microbatches, "gpipe"))(*on_one)
    other = jax.jit(make_step(microbatches // 2, "gpipe"))(*on_one)
    floor = relative_error(other, want)
    rows = []
    for schedule in schedules(meshes):
        step = mpmdc.compile(make_step(microbatches, schedule), meshes, in_specs=in_specs)
        start = time.perf_counter()
        with XlaCompiles() as first:
            got = jax.block_until_ready(step(*args))
        first_s = time.perf_counter() - start
        with XlaCompiles() as again:
            jax.block_until_ready(step(*args))
        err = relative_error(got, want)
        rows.append(
            row(
                name,
                schedule,
                err,
                floor,
                f"{first.count} XLA compiles in {first_s:.1f} s, {again.count} on call 2; "
                f"outputs on {where(got)}",
            )
        )
    return rows


def row(check, schedule, err, floor, detail, passed=None) -> dict:
    if passed is None:
        passed = err <= MARGIN * floor + 1e-7
    return {
        "check": check,
        "schedule": schedule,
        "rel. error vs jax.jit": err,
        "noise floor": floor,
        "passed": "yes" if passed else "NO",
        "detail": detail,
    }


def mlp_sgd(meshes):
    params = init_params(jax.random.key(0), [64, 128, 128, 128, 32])
    x = jax.random.normal(jax.random.key(1), (64, 64))
    y = jax.random.normal(jax.random.key(2), (64, 32))

    def make(microbatches, schedule):
        return lambda p, x, y: train_step(p, x, y, schedule, microbatches)

    return compare("mlp-sgd", make, (params, x, y), 8, meshes)


def transformer_adam(meshes):
    _, args = _common.transformer_setup(8, microbatches=8, stages=STAGES)

    def make(microbatches, schedule):
        return _common.step_function(8, microbatches, schedule, STAGES)

    return compare("transformer-adam", make, args, 8, meshes)


def scanned_stack(width=128, layers=8):
    params = {
        "w": jax.random.normal(jax.random.split(jax.random.key(3))[0], (layers, width, width))
        / width**0.5,
        "b": jnp.zeros((layers, width)),
    }
    x = jax.random.normal(jax.random.key(4), (64, width))
    y = jax.random.normal(jax.random.key(5), (64, width))
    optimizer = optax.adamw(1e-2)
    loss_fn = _common.residual_stack_loss(every=layers // STAGES)

    def make(microbatches, schedule):
        def step(params, opt_state, x, y):
            loss, grads = _common.mean_loss_and_grad(
                loss_fn, params, (x, y), microbatches, schedule
            )
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    return make, (params, optimizer.init(params), x, y)


def scanned_stack_optax(meshes):
    make, args = scanned_stack()
    rows = compare("scanned-stack-optax", make, args, 8, meshes)
    # Three steps, state fed back: still equal, nothing moved between calls.
    schedule = schedules(meshes)[0]
    step = mpmdc.compile(make(8, schedule), meshes)
    reference = jax.jit(make(8, "gpipe"))
    params, opt_state, x, y = args
    mine, theirs = (params, opt_state), jax.device_put((params, opt_state), jax.devices()[0])
    noisy = jax.jit(make(4, "gpipe"))
    floor_state = theirs
    for _ in range(3):
        *mine, _ = step(*mine, x, y)
        *theirs, _ = reference(*theirs, x, y)
        *floor_state, _ = noisy(*floor_state, x, y)
    err = relative_error(mine, theirs)
    floor = relative_error(floor_state, theirs)
    rows.append(row("scanned-stack-optax, 3 steps fed back", schedule, err, floor, where(mine)))
    return rows


def checkpoint(meshes):
    make, (params, opt_state, x, y) = scanned_stack()
    schedule = schedules(meshes)[0]
    step = mpmdc.compile(make(8, schedule), meshes)
    params, opt_state, _ = step(params, opt_state, x, y)
    straight = step(params, opt_state, x, y)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "step-1")
        mpmdc.checkpoint.save(path, {"params": params, "opt_state": opt_state})
        shardings = step.input_shardings(params, opt_state, x, y)[0]
        state = mpmdc.checkpoint.restore(path, {"params": shardings[0], "opt_state": shardings[1]})
    with XlaCompiles() as compiles:
        resumed = step(state["params"], state["opt_state"], x, y)
    err = relative_error(resumed, straight)
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight))
    )
    return [
        row(
            "checkpoint save, restore, step",
            schedule,
            err,
            0.0,
            f"bitwise equal: {same}; {compiles.count} XLA compiles after restore",
            passed=same and compiles.count == 0,
        )
    ]


CHECKS = [mlp_sgd, transformer_adam, scanned_stack_optax, checkpoint]


def main():
    _, meshes = _common.stage_layout(STAGES, jax.devices())
    print(
        f"{_common.machine()}; {len(meshes)} meshes of {meshes[0].size}; "
        f"default matmul precision {jax.config.jax_default_matmul_precision}"
    )
    rows = []
    for check in CHECKS:
        start = time.perf_counter()
        try:
            rows += check(meshes)
        except Exception as err:  # a failed check is a row, the others still run
            traceback.print_exc()
            rows.append(row(check.__name__, "", float("nan"), float("nan"), repr(err)[:200], False))
        print(f"{check.__name__}: {time.perf_counter() - start:.1f} s", flush=True)
    _common.report("gpu_check", rows, list(rows[0]))
    if any(r["passed"] != "yes" for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
