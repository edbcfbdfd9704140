"""What a step costs per microbatch count, counted rather than timed: the XLA modules a
step compiles do not grow with the microbatch count, and each microbatch adds the same
number of fragment calls and transfers.

The model is ``benchmarks/spmd_pipeline.py``'s, small: a residual MLP stack run by one
scan with ``mpmdc.stage(h, every=...)`` in its body, its gradient accumulated over the
microbatches with ``mpmdc.accumulate``, then SGD, the batch sharded on each mesh.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import XlaCompiles
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.ir.program import module_key
from mpmdc.pipeline import DEFAULT_PIPELINE

LAYERS, WIDTH, ROWS = 4, 8, 4  # rows per microbatch


def train_step(microbatches: int, schedule: str):
    """A new step function (so no cache serves it) over ``microbatches``."""

    def loss_fn(params, x, y):
        def layer(h, wb):
            h = mpmdc.stage(h, every=LAYERS // 4)
            return h + jnp.tanh(h @ wb[0] + wb[1]), None

        h, _ = jax.lax.scan(layer, x, (params["w"], params["b"]))
        return jnp.mean((h - y) ** 2)

    def step(params, x, y):
        loss, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss_fn)(params, *mb),
            (x, y),
            microbatches=microbatches,
            schedule=schedule,
            reduce="mean",
        )
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def arguments(microbatches: int):
    kw, kb, kx = jax.random.split(jax.random.key(0), 3)
    params = {
        "w": jax.random.normal(kw, (LAYERS, WIDTH, WIDTH)) / WIDTH,
        "b": jax.random.normal(kb, (LAYERS, WIDTH)),
    }
    x = jax.random.normal(kx, (ROWS * microbatches, WIDTH))
    return params, x, jnp.sin(x)


def lowered_step(meshes, microbatches: int, schedule: str):
    step = mpmdc.compile(
        train_step(microbatches, schedule), meshes, in_specs=(None, P("data"), P("data"))
    )
    return step.lower(*arguments(microbatches))


def compiled_step(meshes, microbatches: int, schedule: str, *, compile: bool = True) -> dict:
    """What compiling the step over ``microbatches`` costs and what a call of it makes."""
    lowered = lowered_step(meshes, microbatches, schedule)
    program = lowered.program("stablehlo")
    names = [e.primitive.name for e in program.jaxpr.jaxpr.eqns]
    found = {"fragment calls": names.count("fragment"), "transfers": names.count("transfer")}
    # The middle stages' work before the loop (their running sums' zeros, each stage's
    # own broadcast, not a slice of the whole stack's at its offset) is one module.
    found["middle stages' modules before the loop"] = len(
        {
            module_key(e, program.meshes[e.params["mesh"]])
            for e in program.jaxpr.jaxpr.eqns
            if e.primitive.name == "fragment"
            and e.params["microbatch"] is None
            and e.params["transpose"] == 0
            and e.params["stage"] in (1, 2)
        }
    )
    if compile:
        with XlaCompiles() as compiles:
            found["executables"] = lowered.compile().num_executables
        found["XLA compiles"] = compiles.count
    return found


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_compiles_do_not_grow_and_calls_grow_linearly_with_microbatches(meshes4, schedule):
    found = {m: compiled_step(meshes4, m, schedule, compile=m != 3) for m in (2, 8, 3)}
    assert found[8]["executables"] == found[2]["executables"], found
    assert found[2]["middle stages' modules before the loop"] == 1, found
    # At most: the first compile in a process may also pay for JAX's first-use compiles.
    assert found[8]["XLA compiles"] <= found[2]["XLA compiles"], found
    for what in ("fragment calls", "transfers"):
        per_mb = found[3][what] - found[2][what]  # once per step: the rest
        assert found[8][what] == found[2][what] + 6 * per_mb, found
    # Each microbatch's fragments on the 4 meshes: one per stage and kind (a stage's
    # scan inside it, with the running sum of its gradient; the microbatch's rows of the
    # batch taken inside the fragment reading them), the last stage's backward in its
    # forward's: 3 + 3 + 1 = 7 calls.
    assert found[3]["fragment calls"] - found[2]["fragment calls"] == 7, found
    # One executable per distinct fragment and mesh, none per microbatch.
    assert found[2]["executables"] <= 17, found
    # An activation forward and a cotangent backward across each of the 3 boundaries.
    assert found[3]["transfers"] - found[2]["transfers"] <= 6, found


def scan_modules(lowered) -> list[int]:
    """Per distinct module (up to its mesh) of the split program: how many top-level scans
    its fragment body holds; a list over the distinct modules holding one or more."""
    program = lowered.program("stablehlo")
    found = {}
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "fragment":
            body = eqn.params["jaxpr"].jaxpr.eqns
            key = module_key(eqn, program.meshes[eqn.params["mesh"]])
            found[key] = sum(e.primitive.name == "scan" for e in body)
    return sorted(n for n in found.values() if n)


@pytest.mark.parametrize("scans", ["fused", pytest.param("shared", marks=pytest.mark.slow)])
def test_scans_fused_in_their_stage_or_shared_by_equal_stages(meshes4, scans):
    def with_embedding(microbatches):
        step = train_step(microbatches, "1f1b")
        return lambda params, x, y: step(params, jnp.tanh(x) * 2.0, y)

    passes = [p if p != "split" else f"split{{scans={scans}}}" for p in DEFAULT_PIPELINE]
    calls = {}
    for m in (2, 3):
        lowered = mpmdc.compile(
            with_embedding(m), meshes4, in_specs=(None, P("data"), P("data")), passes=passes
        ).lower(*arguments(m))
        names = [e.primitive.name for e in lowered.program("stablehlo").jaxpr.jaxpr.eqns]
        calls[m] = names.count("fragment")
    # Fused: one call per stage and kind (the last stage's backward in its forward's);
    # shared: a stage's scans are calls of their own, beside the work around them.
    assert calls[3] - calls[2] == {"fused": 7, "shared": 13}[scans]
    if scans == "fused":
        # Stage 0's forward takes its microbatch of the batch and its backward sends no
        # cotangent on, so their scans compile in modules of their own; stages 1 and 2
        # share their forward's and their backward's; stage 3's holds both its scans.
        assert scan_modules(lowered) == [1, 1, 1, 1, 2]
    else:
        # Each scan a fragment of its own, equal ones shared whatever surrounds them:
        # the stages' forward scans (stage 0's apart: it takes its microbatch of the
        # batch), their backward scans, and stage 0's backward scan (it sends no
        # cotangent on).
        assert scan_modules(lowered) == [1, 1, 1, 1]
