"""Every schedule on the 8-layer transformer, and balanced stages against an even split.

Part 1 runs the 8-layer transformer step on 4 meshes of 2 CPU devices at 8 and 16
microbatches under each schedule (two blocks per stage; one per stage, two stages per
mesh, for interleaved 1F1B and the V schedules) and reports:

- the bubble of one measured step (``Compiled.run_timed``, median of 5 by makespan), of
  the simulator replaying the measured fragment times, and of the textbook formula where
  one exists;
- the simulated bubble in steady training (steps back to back) at the measured mean
  costs, against the published formula at those costs;
- the step time of plain calls (median) and the peak activation bytes per mesh.

Part 2 trains a transformer with a large vocabulary (its LM head on the last stage) on
two meshes of one device (one core each) with the even split (four blocks per stage)
and with ``partition="balanced"`` (each block a segment), and reports the groupings,
their estimated compute per stage and both step times.

Part 3 times ``schedule="auto"``'s choice alone on pipelines of 4 to 32 stages.

    python benchmarks/schedule.py [--schedules gpipe 1f1b ...] [--microbatches 8 16]
        [--parts schedules balanced auto]
"""

import argparse
import statistics
import time

import _common  # first: it sets the device count before JAX starts
import jax

import mpmdc
from mpmdc.cli.models import TransformerConfig, adam_init, init_transformer, transformer_step
from mpmdc.schedules import (
    Auto,
    Pipeline,
    actions_of,
    bubble_formula,
    bubble_time_formula,
    formula_holds,
    layout_of,
    measured,
    measured_costs,
    simulate,
    steady_bubble,
)

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev"]
TWO_STAGES_PER_MESH = ("interleaved-1f1b", "zb-v", "dualpipev")


def mean_costs(cost, stages: int) -> dict:
    """F, I, W (and B) in milliseconds, each a mean over the stages but the first and the
    last (stage 0 sends no input gradient; the last's backward runs inside its forward)."""
    return {
        kind: statistics.mean(
            cost(mpmdc.schedules.Action(s, kind, 0)) * 1e3 for s in range(1, stages - 1)
        )
        for kind in "FIWB"
    }


def measure(schedule: str, microbatches: int) -> dict:
    stages = 8 if schedule in TWO_STAGES_PER_MESH else 4
    step, args = _common.transformer_setup(8, microbatches, schedule=schedule, stages=stages)
    lowered = mpmdc.compile(step, _common.four_meshes()).lower(*args)
    executable = lowered.compile()
    jax.block_until_ready(executable(*args))
    runs = [executable.run_timed(*args)[1] for _ in range(5)]
    timeline = sorted(runs, key=lambda t: t.makespan)[len(runs) // 2]
    program = lowered.program("after-schedule")
    layout, actions = layout_of(program), actions_of(program)
    replay = simulate(actions, layout, measured_costs(timeline))
    try:
        formula = bubble_formula(schedule, 4, microbatches, stages // 4)
    except mpmdc.MpmdcError:
        formula = float("nan")
    cost = measured(timeline)  # seconds, per stage and kind
    costs = mean_costs(cost, stages)
    steady = 1e3 * steady_bubble(actions, layout, cost)
    published = (
        bubble_time_formula(schedule, 4, costs) if formula_holds(schedule, costs) else float("nan")
    )
    step_ms = 1e3 * _common.seconds(lambda: jax.block_until_ready(executable(*args)), repeat=5)
    peaks = [m.peak_activation_bytes / 1e3 for m in executable.memory]
    return {
        "schedule": schedule,
        "m": microbatches,
        "step ms": step_ms,
        "bubble measured": timeline.bubble_fraction,
        "bubble replayed": replay.bubble_fraction,
        "bubble formula": formula,
        "steady bubble ms": steady,
        "steady formula ms": published,
        "F/I/W ms": "/".join(f"{costs[k]:.2g}" for k in "FIW"),
        "peak activation kB per mesh": "/".join(f"{p:.0f}" for p in peaks),
    }


def balanced_against_even(vocab: int, microbatches: int, repeat: int) -> list[dict]:
    """Step times of the even split and of ``partition="balanced"`` on two meshes of one
    device (two cores: each mesh has one to itself), timed in turns."""
    meshes = mpmdc.make_meshes(2, {"data": 1})
    rows, fns = [], []
    for name, stages, partition in (("even", 2, None), ("balanced", 8, "balanced")):
        config = TransformerConfig(
            vocab=vocab, width=64, heads=4, hidden=256, layers=8, stages=stages
        )
        params = init_transformer(jax.random.key(0), config)
        tokens = jax.random.randint(jax.random.key(1), (32, 33), 0, vocab)
        args = (params, adam_init(params), tokens)

        def step(params, state, tokens, config=config):
            return transformer_step(params, state, tokens, config, microbatches=microbatches)

        compiled = mpmdc.compile(step, meshes, partition=partition)
        lowered = compiled.lower(*args)
        executable = lowered.compile()
        jax.block_until_ready(executable(*args))
        plan = lowered.stage_plan
        groups = plan.groups if plan else ((0, 1, 2, 3), (4, 5, 6, 7))
        grouping = " / ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}" for g in groups)
        rows.append({"split": name, "blocks per stage": grouping + " + head", "plan": plan})
        fns.append(
            lambda executable=executable, args=args: jax.block_until_ready(executable(*args))
        )
    # Both groupings' compute per stage at the balanced plan's segment costs.
    segments = rows[1]["plan"].segments
    for row in rows:
        groups = (
            row.pop("plan").groups if row["split"] == "balanced" else ((0, 1, 2, 3), (4, 5, 6, 7))
        )
        row["estimated ms per stage"] = "/".join(
            f"{sum(c.forward + c.backward for c in segments[g[0] : g[-1] + 1]) * 1e3:.3g}"
            for g in groups
        )
    for row, seconds in zip(rows, _common.interleaved(fns, repeat=repeat)):
        row["step ms"] = seconds * 1e3
    rows[1]["speed-up"] = rows[0]["step ms"] / rows[1]["step ms"]
    rows[0]["speed-up"] = 1.0
    return rows


def auto_cost() -> list[dict]:
    """Seconds ``Auto().choose`` takes on pipelines of growing size (unit costs, no cap):
    every candidate built and simulated over three steps."""
    rows = []
    for stages, microbatches in ((4, 32), (8, 64), (16, 64), (32, 128)):
        pipeline = Pipeline(
            stages,
            stages,
            microbatches,
            None,
            lambda a: 2.0 if a.kind == "B" else 1.0,
            (1.0,) * stages,
            (None,) * stages,
        )
        start = time.perf_counter()
        _, choice = Auto().choose(pipeline)
        rows.append(
            {
                "stages": stages,
                "microbatches": microbatches,
                "candidates": len(choice.considered),
                "choose s": time.perf_counter() - start,
                "chose": choice.name,
            }
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    parser.add_argument("--microbatches", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--parts", nargs="+", default=["schedules", "balanced", "auto"], help="what to measure"
    )
    options = parser.parse_args()
    if "schedules" in options.parts:
        _common.warm_up()
        rows = [measure(s, m) for m in options.microbatches for s in options.schedules]
        _common.report("schedule", rows, list(rows[0]))
    if "balanced" in options.parts:
        balanced = balanced_against_even(options.vocab, 8, options.repeat)
        _common.report(
            "balanced",
            balanced,
            ["split", "blocks per stage", "estimated ms per stage", "step ms", "speed-up"],
            notes=f"8-layer transformer, vocabulary {options.vocab}, 8 microbatches, 1f1b, "
            f"2 meshes of 1 CPU device",
        )
    if "auto" in options.parts:
        rows = auto_cost()
        _common.report("auto", rows, list(rows[0]))


if __name__ == "__main__":
    main()
