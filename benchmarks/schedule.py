"""Bubble fraction of a real run against the simulator and the formula.

Runs the 8-layer transformer step (8 microbatches, 4 meshes of 2 CPU devices) under
each schedule with `Compiled.run_timed` (one thread per mesh), and compares the
measured timeline's bubble fraction with the simulator's, given unit costs and
given the measured fragment times, and with (p-1)/(m+p-1) where it applies.

    python benchmarks/schedule.py [--schedules gpipe 1f1b zb-h1]
"""

import argparse

import _common  # first: it sets the device count before JAX starts

import mpmdc
from mpmdc.schedules import actions_of, bubble_formula, layout_of, measured_costs, simulate


def measure(schedule: str) -> dict:
    step, args = _common.transformer_setup(8, schedule=schedule)
    lowered = mpmdc.compile(step, _common.four_meshes()).lower(*args)
    executable = lowered.compile()
    executable(*args)
    runs = [executable.run_timed(*args)[1] for _ in range(5)]
    timeline = sorted(runs, key=lambda t: t.makespan)[len(runs) // 2]
    program = lowered.program("after-schedule")
    layout = layout_of(program)
    actions = actions_of(program)
    unit = simulate(actions, layout)
    replay = simulate(actions, layout, measured_costs(timeline))
    try:
        formula = bubble_formula(schedule, layout.num_meshes, layout.microbatches)
    except mpmdc.MpmdcError:
        formula = float("nan")
    return {
        "schedule": schedule,
        "measured makespan ms": timeline.makespan,
        "measured bubble": timeline.bubble_fraction,
        "simulated, measured costs": replay.bubble_fraction,
        "simulated, unit costs": unit.bubble_fraction,
        "formula": formula,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "zb-h1"])
    rows = [measure(s) for s in parser.parse_args().schedules]
    _common.report("schedule", rows, list(rows[0]))


if __name__ == "__main__":
    main()
