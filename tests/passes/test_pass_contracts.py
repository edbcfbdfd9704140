"""Pass contracts: what each pass requires, produces and invalidates, checked by the runner.

What it promises: every registered pass declares its contract over ``Property`` (the
table in docs/design.md says the same); ``run_pipeline`` refuses a pipeline in which a
pass would get a program without a property it requires with a ``PassError`` naming the
pass, the property, the pass that provides it and what to do, before any pass runs; a
pass that declares nothing (a user's own) requires nothing and changes nothing.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import input_program, mlp_loss, planned_program
from mpmdc.passes import PASSES, FunctionPass, Property

import mpmdc
from mpmdc import cli, errors
from mpmdc.pipeline import check_contracts, resolve, run_pipeline

X = jnp.ones((8, 8))
WS = [jnp.eye(8), jnp.eye(8)]

P = Property
CONTRACTS = {  # pass: (requires, produces, invalidates)
    "plan": ((), (P.PLANNED,), ()),
    "inline": ((), (P.INLINED,), (P.PLACED,)),
    "split-scans": ((P.INLINED,), (P.SCANS_SPLIT,), (P.PLACED,)),
    "slice-stacks": ((P.SCANS_SPLIT,), (), (P.PLACED,)),
    "cond-fission": ((), (), (P.PLACED,)),
    "dce": ((), (), ()),
    "partition": ((P.PLANNED, P.INLINED), (P.PLACED,), ()),
    "vma-typecheck": ((), (), ()),
    "split": ((P.PLACED,), (P.SPLIT,), (P.PLACED,)),
    "split-backward": ((P.PLANNED, P.SPLIT), (), ()),
    "schedule": ((P.PLANNED, P.SPLIT), (P.SCHEDULED,), ()),
    "donate": ((P.SPLIT, P.SCHEDULED), (P.DONATED,), ()),
    "in-program-transfers": ((P.SPLIT, P.SCHEDULED), (), ()),
    "lower": ((P.SPLIT, P.SCHEDULED), (P.LOWERED,), ()),
}


def accumulated(ws, x):
    """A gradient accumulated over 4 microbatches under 1F1B: a program with a schedule."""
    return mpmdc.accumulate(
        lambda xb: jax.grad(mlp_loss)(ws, xb), x, microbatches=4, schedule="1f1b"
    )


@pytest.fixture(scope="module")
def looped(meshes2):
    return planned_program(accumulated, meshes2, WS, X)


@pytest.fixture(scope="module")
def loop_free(meshes2):
    return planned_program(mlp_loss, meshes2, WS, X)


def _run(program, passes, ran=None):
    """Run ``passes`` on ``program`` behind a pass that records in ``ran`` that it ran, as
    the callback records each stage; return ``ran``."""
    ran = [] if ran is None else ran
    spy = FunctionPass("spy", "records that it ran", lambda p: ran.append("spy") or p)
    run_pipeline(program, [spy, *resolve(passes)], lambda stage, _: ran.append(stage))
    return ran


def test_every_registered_pass_declares_its_contract():
    got = {
        name: (
            tuple(q for q in P if q in p.requires),
            tuple(q for q in P if q in p.produces),
            tuple(q for q in P if q in p.invalidates),
        )
        for name, p in PASSES.items()
    }
    assert got == CONTRACTS


def test_the_design_doc_states_every_contract():
    text = (Path(__file__).parents[2] / "docs" / "design.md").read_text()
    table = text.split("### Pass contracts", 1)[1].split("\n\n| pass |", 1)[1].split("\n\n")[0]
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| (.*) \|$", table, re.M))
    for name, contract in CONTRACTS.items():
        cells = [c.strip() for c in rows[name].split("|")]
        words = [", ".join(f"`{q}`" for q in props) or "—" for props in contract]
        assert cells[:3] == words, name


def test_the_default_pipeline_meets_every_contract(looped, loop_free):
    check_contracts(looped, resolve(None))
    check_contracts(loop_free, resolve(None))


@pytest.mark.parametrize(
    "passes, says",
    [
        # Each pass with requirements, alone: the first it lacks, and the pass to add.
        ("split-scans", "pass `split-scans` (number 2 in the pipeline) requires `inlined`"),
        ("slice-stacks", "requires `scans-split`: every scan marked with stage(every=...)"),
        ("partition", "`inline` provides it, and no pass before `partition` does"),
        ("split", "requires `placed`: every top-level equation placed on a stage"),
        ("split-backward", "`split-backward` (number 2 in the pipeline) requires `split`"),
        ("schedule", "`split` provides it, and no pass before `schedule` does: put `split`"),
        ("donate", "pass `donate` (number 2 in the pipeline) requires `split`"),
        ("in-program-transfers", "`in-program-transfers` (number 2 in the pipeline) requires"),
        ("lower", "pass `lower` (number 2 in the pipeline) requires `split`"),
        # Split, but the loop not stamped out.
        ("inline,partition,split,donate", "`donate` (number 5 in the pipeline) requires `sched"),
        ("inline,partition,split,lower", "`schedule` provides it, and no pass before `lower`"),
        (
            "inline,partition,split,in-program-transfers",
            "requires `scheduled`: fragment calls in the order they run",
        ),
        # Misordered.
        (
            "inline,partition,split,split",
            "pass `split` (number 5 in the pipeline) requires `placed`: every top-level "
            "equation placed on a stage, every input and output on a mesh. `partition` "
            "provides it, but pass number 4, `split`, undoes it: run `split` once.",
        ),
        (
            "inline,partition,schedule,split",
            "pass `schedule` (number 4 in the pipeline) requires `split`: top-level equations "
            "that are fragments and transfers. `split` provides it, and no pass before "
            "`schedule` does: put `split` before it (the default pipeline is plan, inline, ",
        ),
        (
            "inline,dce,partition,cond-fission,split",
            "`partition` provides it, but pass number 5, `cond-fission`, undoes it: run "
            "`cond-fission` before `partition`, or leave it out.",
        ),
        ("inline,slice-stacks,split-scans", "`slice-stacks` (number 3 in the pipeline)"),
        # Undone by a pass before it, but never made: the pass to add is named.
        (
            "inline,split,partition",
            "`partition` provides it, and no pass before `split` does: put `partition` before",
        ),
        ("split-scans,inline", "`split-scans` (number 2 in the pipeline) requires `inlined`"),
    ],
)
def test_a_pipeline_that_cannot_work_is_refused_before_any_pass_runs(looped, passes, says):
    ran = []
    with pytest.raises(errors.PassError, match=re.escape(says)):
        _run(looped, passes, ran)
    assert ran == []


def test_a_traced_program_is_planned_before_it_is_placed(meshes2):
    traced = input_program(accumulated, meshes2, WS, X)
    with pytest.raises(errors.PassError) as caught:
        _run(traced, "inline,partition")
    assert str(caught.value).startswith(
        "pass `partition` (number 3 in the pipeline) requires `planned`: the stages grouped "
        "and the microbatch loop's schedule chosen, as the program asks. `plan` provides it, "
        "and no pass before `partition` does: put `plan` before it"
    )
    _run(traced, "plan,inline,partition")
    # ``compile`` and ``Lowered.rerun`` put it first where a pipeline lacks it.
    lowered = mpmdc.compile(accumulated, meshes2, passes="inline,partition").lower(WS, X)
    assert lowered.stages == ("input", "after-plan", "after-inline", "after-partition")
    assert lowered.rerun("inline").stages == ("input", "after-plan", "after-inline")


def test_a_program_without_a_schedule_needs_no_schedule_pass(loop_free, looped, meshes2):
    assert _run(loop_free, "inline,partition,split,lower")[-1] == "stablehlo"
    with pytest.raises(errors.PassError, match="requires `scheduled`"):
        mpmdc.compile(accumulated, meshes2, passes="inline,partition,split,lower").lower(WS, X)


def test_a_pass_that_declares_nothing_requires_nothing(looped):
    class Identity:  # a user's own pass object: a name, a summary and ``run``
        name, summary = "identity", "returns the program"

        def run(self, program):
            return program

    stages = _run(looped, [*resolve("inline,partition,split"), Identity()])
    assert stages[-1] == "after-identity"
    _run(looped, [Identity(), *resolve(None)])


def test_a_users_pass_declares_its_contract(looped):
    counts = FunctionPass(
        "count-fragments",
        "counts the fragments",
        lambda program: program,
        requires={Property.SPLIT},
    )
    assert counts.requires == frozenset({Property.SPLIT})
    with pytest.raises(
        errors.PassError,
        match=re.escape("pass `count-fragments` (number 3 in the pipeline) requires `split`"),
    ):
        _run(looped, [*resolve("inline"), counts, *resolve("partition,split")])
    _run(looped, [*resolve("inline,partition,split"), counts])
    # A pass that produces a property lets a later pass require it.
    places = FunctionPass("places", "places", lambda p: p, produces=["placed"])
    check_contracts(looped, [places, *resolve("split")])


def test_the_command_line_reports_a_refused_pipeline(capsys):
    status = cli.main(
        ["dump", "tests/programs/pipeline_1f1b.py:lowered", "--passes", "inline,split"]
    )
    _, err = capsys.readouterr()
    # (``plan`` is added first: a traced program is planned before anything else.)
    assert status == 1 and "PassError: pass `split` (number 3 in the pipeline)" in err
    assert "`partition` provides it" in err
