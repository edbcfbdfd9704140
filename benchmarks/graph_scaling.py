"""Pass time against program size: synthetic programs of 10k, 50k and 100k equations.

Each program is a few parallel chains of elementwise ops and small matmuls that mix
every so often, with a stage marker every `size / 16` equations (16 stages on 4
meshes). It times the passes alone (inline through schedule; no StableHLO) and reports
the time per equation, which should not grow with the size.

    python benchmarks/graph_scaling.py [--sizes 10000 50000 100000]
"""

import argparse

import _common
import jax.numpy as jnp

import mpmdc

PASSES = ("inline", "partition", "dce", "vma-typecheck", "split", "schedule")
STAGES = 16


def synthetic(size: int):
    """A function whose traced program has about ``size`` equations."""
    per_stage = size // STAGES

    def fn(x, w):
        chains = [x, x * 2.0, x + 1.0]
        count = 3
        stage = 0
        while count < size:
            if count >= (stage + 1) * per_stage and stage + 1 < STAGES:
                stage += 1
                chains = mpmdc.stage(chains, stage)
                count += 1
            a, b, c = chains
            chains = [jnp.tanh(a) + b, b * c - 0.5, (c @ w) * 0.1 + a]
            count += 7
        return sum(jnp.sum(c) for c in chains)

    return fn


def measure(size: int) -> dict:
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8)) * 0.01
    compiled = mpmdc.compile(synthetic(size), _common.four_meshes(), passes=PASSES)
    lowered = compiled.lower(x, w)
    eqns = len(lowered.program("input").jaxpr.jaxpr.eqns)
    per_pass = {p: lowered.seconds[f"after-{p}"] for p in PASSES}
    total = sum(per_pass.values())
    return {
        "equations": eqns,
        "trace s": lowered.seconds["input"],
        "passes s": total,
        "us/eqn": total / eqns * 1e6,
        **{f"{p} s": t for p, t in per_pass.items()},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    rows = [measure(n) for n in parser.parse_args().sizes]
    for r in rows:
        r["vs smallest"] = r["us/eqn"] / rows[0]["us/eqn"]
    columns = [
        "equations",
        "trace s",
        "passes s",
        "us/eqn",
        "vs smallest",
        *(f"{p} s" for p in PASSES),
    ]
    _common.report("graph_scaling", rows, columns)


if __name__ == "__main__":
    main()
