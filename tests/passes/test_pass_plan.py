"""The ``plan`` pass: the first of the pipeline decides what the traced program asks.

What it promises: a traced program carries its request (the loop's schedule as given,
whether to balance stages) and ``plan`` turns it into plain data (``schedule``,
``stage_plan``, markers renumbered), shown by its own dump stage; ``compile``,
``Lowered.rerun`` and ``mpmdc dump`` put it first where a pipeline lacks it; its trial
run is the pipeline's own passes up to ``split`` (a user's pass there runs in the trial
too); planning a planned program changes nothing; the trial's warnings are not issued.
"""

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import input_program, mlp_loss
from mpmdc.passes import PASSES, FunctionPass, plan

import mpmdc
from mpmdc import cli
from mpmdc.errors import PassError, PlacementWarning
from mpmdc.ir.program import Phase
from mpmdc.pipeline import resolve, stage_names, with_plan

X = jnp.ones((8, 8))
WS = [jnp.eye(8) * (i + 1) for i in range(4)]


def four_segments(ws, x):
    """One marker per layer: four segments, for two meshes to balance."""
    for i, w in enumerate(ws):
        x = jnp.tanh(mpmdc.stage(x, i) @ w)
    return jnp.sum(x)


def accumulated(ws, x):
    return mpmdc.accumulate(
        lambda xb: jax.grad(four_segments)(ws, xb), x, microbatches=4, schedule="1f1b"
    )


def test_the_traced_program_carries_its_request_and_plan_decides_it(meshes2):
    traced = input_program(accumulated, meshes2, WS, X, partition="balanced")
    assert traced.phase is Phase.TRACED and traced.schedule is None
    assert traced.plan_request.balanced and repr(traced.plan_request.schedule) == "OneFOneB()"
    assert "requested: schedule OneFOneB(); stages balanced" in traced.as_text()
    planned = plan(traced)
    assert planned.phase is Phase.PLANNED and planned.plan_request is None
    assert [s for g in planned.stage_plan.groups for s in g] == [0, 1, 2, 3]
    assert len(planned.stage_plan.groups) == 2 and planned.schedule.name == "OneFOneB()"
    markers = [e.params["stage"] for e in planned.jaxpr.jaxpr.eqns if e.primitive.name == "stage"]
    assert sorted(set(markers)) == [0, 1]  # renumbered to the stages
    assert plan(planned) is planned


def test_a_program_asking_nothing_is_planned_unchanged(meshes2):
    traced = input_program(mlp_loss, meshes2, WS[:2], X)
    assert traced.plan_request is None
    planned = plan(traced)
    assert planned.phase is Phase.PLANNED and planned.jaxpr is traced.jaxpr
    assert planned.schedule is None and planned.stage_plan is None


def test_the_plan_is_a_stage_of_its_own(meshes2):
    lowered = mpmdc.compile(accumulated, meshes2, partition="balanced", schedule="auto").lower(
        WS, X
    )
    assert lowered.stages[:3] == ("input", "after-plan", "after-inline")
    text = lowered.as_text("after-plan")
    assert text.startswith("phase: planned\n")
    assert "stages balanced from 4 segments:" in text and "\n  chose " in text
    assert lowered.stage_plan is lowered.program("after-plan").stage_plan
    assert lowered.schedule_choice is lowered.program("after-plan").schedule.choice
    assert "requested: schedule Auto(); stages balanced" in lowered.as_text("input")


def test_the_trial_runs_the_pipelines_own_passes(meshes2):
    ran = []

    def spy(program):
        ran.append(program.phase)
        return program

    counted = FunctionPass("spy", "records each run", spy)
    passes = [*resolve("inline,dce"), counted, *resolve("partition,split,schedule,lower")]
    (first, *_) = with_plan(passes)
    assert first.name == "plan" and dict(first.options)["through"][2] is counted
    mpmdc.compile(accumulated, meshes2, partition="balanced", passes=passes).lower(WS, X)
    assert ran == [Phase.PLANNED, Phase.PLANNED]  # the trial's run, then the pipeline's
    # A pipeline of registered passes is set as text; the default one leaves the default.
    (named, *_) = with_plan(resolve("inline,dce,partition,split"))
    assert dict(named.options)["through"] == ("inline", "dce", "partition", "split")
    assert with_plan(resolve(None))[0] == PASSES["plan"]


def test_the_trials_warnings_are_not_issued(meshes2):
    def warns(ws, x):
        # A value made on stage 0 and read only by stage 1 moves: partition warns once.
        y = ws[0] @ ws[1]
        x = mpmdc.stage(x @ ws[0], 0)
        return jnp.sum(mpmdc.stage(x, 1) @ y)

    def count(**kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mpmdc.compile(warns, meshes2, **kw).lower(WS[:2], X)
        return sum(issubclass(w.category, PlacementWarning) for w in caught)

    assert count(partition="balanced") == count()


def test_the_stage_list_has_the_plan_and_the_backends_own_passes(capsys):
    assert stage_names(None)[:2] == ("input", "after-plan")
    assert "after-in-program-transfers" not in stage_names(None, "cpu")
    # (The program's file registers the backend ``cuda-in-program``.)
    target = "tests/programs/in_program_transfers.py:lowered"
    status = cli.main(["dump", target, "--list-stages", "--backend", "cuda-in-program"])
    listed = capsys.readouterr().out.split()
    assert status == 0 and listed[:2] == ["input", "after-plan"]
    assert "after-in-program-transfers" in listed
    assert "after-in-program-transfers" in stage_names(None, "cuda-in-program")


def test_a_trial_that_does_not_split_or_a_second_plan_is_refused(meshes2):
    short = "plan{through=('inline',)},inline,dce,partition,split,schedule,lower"
    with pytest.raises(PassError, match=r"its trial run \(inline\) does not split the program"):
        mpmdc.compile(accumulated, meshes2, partition="balanced", passes=short).lower(WS, X)
    twice = "plan,inline,plan,partition,split"
    with pytest.raises(PassError, match=r"runs `plan` 2 times \(passes number 1, 3\)"):
        mpmdc.compile(accumulated, meshes2, passes=twice)
