"""The three forms a microbatch loop reaches the passes in, each through every pass.

What it promises: a rolled loop (``loop_edge``s: ``accumulate`` traced by
``mpmdc.compile``'s own trace), an unrolled one (``microbatch[i]`` markers: traced by
another trace, here ``jax.value_and_grad`` around the call) and a plain ``scan`` (a
``jax.jit``'d ``accumulate`` JAX had traced before, whose cached jaxpr it reuses) each
go through every pass of the default pipeline: every stage dumps, verifies, holds its
form until the pass that changes it, and the numbers are ``jax.jit``'s. docs/design.md
("The microbatch loop") says when each form arises.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_tree, fragments
from mpmdc.passes.vma_typecheck import verify

import mpmdc
from mpmdc.ir.program import Phase, find_eqns
from mpmdc.pipeline import DEFAULT_PIPELINE, stage_names

MICROBATCHES = 4
WS = [jnp.eye(8) * 0.5 + 0.01, jnp.eye(8) * 0.25 - 0.02]
X = jnp.arange(64.0).reshape(8, 8) / 64


def _loss(ws, xb):
    h = jnp.tanh(mpmdc.stage(xb, 0) @ ws[0])
    return jnp.sum(jnp.tanh(mpmdc.stage(h, 1) @ ws[1]) ** 2)


def rolled(ws, x):
    """Differentiating inside ``accumulate``: the loop stays rolled."""
    return mpmdc.accumulate(
        lambda xb: jax.value_and_grad(_loss)(ws, xb), x, microbatches=MICROBATCHES
    )


def _accumulated_loss(ws, x):
    return mpmdc.accumulate(lambda xb: _loss(ws, xb), x, microbatches=MICROBATCHES)


unrolled = jax.value_and_grad(_accumulated_loss)  # a transformation around the call


def plain_scan():
    """A loop in stage 1 that a ``jax.jit`` of its own traced before ``mpmdc.compile``
    did: JAX reuses that trace, a ``scan`` (the stage markers are outside it)."""
    inner = jax.jit(
        lambda w, h: mpmdc.accumulate(
            lambda hb: jnp.sum(jnp.tanh(hb @ w) ** 2), h, microbatches=MICROBATCHES
        )
    )

    def loss(ws, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ ws[0])
        return inner(ws[1], mpmdc.stage(h, 1))

    inner(WS[1], jnp.tanh(X @ WS[0]))  # traced outside mpmdc.compile, so cached as a scan
    return jax.value_and_grad(loss)


def _has(program, name: str) -> bool:
    """Whether a top-level equation of ``program`` binds the primitive ``name``."""
    return any(e.primitive.name == name for e in program.jaxpr.jaxpr.eqns)


def _holds(program, name: str) -> bool:
    """Whether an equation of ``program``, at any depth, binds the primitive ``name``."""
    return any(find_eqns(program.jaxpr.jaxpr.eqns, lambda e: e.primitive.name == name))


@pytest.mark.parametrize("form", ["rolled", "unrolled", "plain-scan"])
def test_each_form_goes_through_every_pass(meshes2, form):
    fn = plain_scan() if form == "plain-scan" else {"rolled": rolled, "unrolled": unrolled}[form]
    lowered = mpmdc.compile(fn, meshes2).lower(WS, X)
    assert lowered.stages == stage_names(DEFAULT_PIPELINE)
    for stage in lowered.stages:
        program = lowered.program(stage)
        verify(program)
        assert lowered.as_text(stage).startswith(f"phase: {program.phase}\n")
        before_split = program.phase < Phase.SPLIT
        # The form each stage holds: rolled edges until `schedule` stamps them out,
        # microbatch markers until `split` drops them, the scan in a call, then a fragment.
        assert _has(program, "loop_edge") == (form == "rolled" and program.phase < Phase.SCHEDULED)
        assert _has(program, "microbatch") == (form == "unrolled" and before_split)
        assert _holds(program, "scan") == (form == "plain-scan")
        # (The traced program asks for its schedule; `plan` runs it on the stages.)
        assert (program.schedule is None) == (form == "plain-scan" or program.phase is Phase.TRACED)
        assert (program.plan_request is None) == (
            form == "plain-scan" or program.phase > Phase.TRACED
        )
    split, scheduled = lowered.program("after-split"), lowered.program("after-schedule")
    microbatches = {e.params["microbatch"] for e in fragments(split)} - {None}
    assert (
        microbatches
        == {"rolled": {"loop"}, "unrolled": set(range(MICROBATCHES)), "plain-scan": set()}[form]
    )
    stamped = {e.params["microbatch"] for e in fragments(scheduled)} - {None}
    assert stamped == (set() if form == "plain-scan" else set(range(MICROBATCHES)))
    # Bit for bit: every form reduces in microbatch order from the same start.
    assert_same_tree(lowered.compile()(WS, X), jax.jit(fn)(WS, X))
