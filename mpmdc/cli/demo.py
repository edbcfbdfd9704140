"""``mpmdc demo``: a pipelined SGD step of a 4-stage MLP on 4 meshes of 2 virtual CPU devices.

Under ``mpmdc launch -n N`` the same step runs on 4 meshes spread over the N processes
(each mesh a quarter of all devices); process 0 prints the report, the others a line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpmdc.api import compile
from mpmdc.distributed import fetch
from mpmdc.ir.primitives import fragment_p, stage
from mpmdc.runtime.meshes import make_meshes
from mpmdc.schedules import bubble_formula
from mpmdc.schedules.accumulate import accumulate

MICROBATCHES = 8


def mlp_loss(params, x, y):
    """Mean squared error of a tanh MLP whose layer ``i`` is pipeline stage ``i``."""
    for i, (w, b) in enumerate(params):
        x = stage(x, i)
        x = jnp.tanh(x @ w + b)
    return jnp.mean((x - y) ** 2)


def init_params(key, widths):
    """``[(w, b), ...]`` for consecutive ``widths``."""
    keys = jax.random.split(key, len(widths) - 1)
    return [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros((b,)))
        for k, a, b in zip(keys, widths[:-1], widths[1:])
    ]


def train_step(params, x, y, schedule="1f1b", microbatches=MICROBATCHES):
    """Mean loss and gradient over microbatches (``mpmdc.accumulate``), then SGD."""
    loss, grads = accumulate(
        lambda mb: jax.value_and_grad(mlp_loss)(params, *mb),
        (x, y),
        microbatches=microbatches,
        schedule=schedule,
        reduce="mean",
    )
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def run(print_fn=print, schedule: str = "1f1b", trace: str | None = None) -> float:
    """Run the demo, print its report and return the largest difference from ``jax.jit``.

    With ``trace`` the measured timeline is written there as Chrome/Perfetto JSON.
    """
    meshes = make_meshes(4, {"data": max(1, jax.device_count() // 4)})
    params = init_params(jax.random.key(0), [16, 32, 32, 32, 8])
    x = jax.random.normal(jax.random.key(1), (64, 16))
    y = jax.random.normal(jax.random.key(2), (64, 8))

    def step(params, x, y):
        return train_step(params, x, y, schedule)

    lowered = compile(step, meshes).lower(params, x, y)
    executable = lowered.compile()
    loss, new_params = executable(params, x, y)
    _, timeline = executable.run_timed(params, x, y)  # after a first call, so nothing is cold
    ref_loss, ref_params = jax.jit(step)(params, x, y)
    got = fetch((loss, new_params))  # from the processes that hold them, when there are several
    diffs = [
        float(np.max(np.abs(a - np.asarray(b))))
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves((ref_loss, ref_params))
        )
    ]
    mesh_of = {tuple(d.id for d in m.devices.flat): i for i, m in enumerate(meshes)}

    def where(a):
        return f"mesh{mesh_of[tuple(d.id for d in a.sharding.mesh.devices.flat)]}"

    if jax.process_index() > 0:
        mine = [
            i
            for i, m in enumerate(meshes)
            if jax.process_index() in {d.process_index for d in m.devices.flat}
        ]
        print_fn(
            f"process {jax.process_index()} ran mesh(es) {mine}; max |mpmdc - jax.jit| = {max(diffs):.3g}"
        )
        return max(diffs)
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    print_fn(
        f"mpmdc demo: one SGD step of a 4-stage MLP, {MICROBATCHES} microbatches under {schedule}, "
        f"on {len(meshes)} meshes x {meshes[0].size} {meshes[0].devices.flat[0].platform.upper()} devices{processes}"
    )
    print_fn(f"loss = {float(got[0]):.6f}  (on {where(loss)})")
    for i, (w, b) in enumerate(new_params):
        print_fn(
            f"layer {i} updated: w{list(w.shape)} on {where(w)}, b{list(b.shape)} on {where(b)}"
        )
    print_fn(f"max |mpmdc - jax.jit| = {max(diffs):.3g}")
    program = executable.program
    print_fn(
        f"{sum(eqn.primitive is fragment_p for eqn in program.jaxpr.jaxpr.eqns)} fragment calls, {executable.num_executables} distinct executables"
    )
    for line in lowered.transfer_report().as_text().splitlines():
        print_fn(line)
    print_fn("peak live activations per mesh (microbatches, buffers, bytes):")
    for i, m in enumerate(executable.memory):
        print_fn(
            f"  mesh{i}: {m.peak_microbatches}, {m.peak_activation_buffers}, {m.peak_activation_bytes}"
        )
    print_fn(f"measured timeline, bubble fraction {timeline.bubble_fraction:.2f}:")
    for line in timeline.ascii(max_columns=100).splitlines():
        print_fn("  " + line)
    print_fn(
        f"  one column = {timeline.column_time(max_columns=100):.3g} ms; . idle; a box is one call:"
    )
    print_fn("  <stage><F|B><microbatch> in the loop, s<k>_... work outside it, t... a transfer")
    formula = (
        bubble_formula(schedule, len(meshes), MICROBATCHES)
        if schedule in ("gpipe", "1f1b")
        else None
    )
    if formula is not None:
        print_fn(
            f"  the textbook {schedule} bubble is {formula:.2f}: it assumes equal stages and free transfers;\n"
            f"  here each call is tiny, so dispatch, transfers and the work outside the loop weigh in"
        )
    if trace:
        with open(trace, "w") as f:
            f.write(timeline.chrome_trace())
        print_fn(f"wrote the measured timeline to {trace} (open it in https://ui.perfetto.dev)")
    return max(diffs)
