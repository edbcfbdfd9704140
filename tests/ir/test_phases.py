"""Program phases: each pass that moves a program on says so, and a program has the
fields of its phase and none of a later one.

What it promises: through the default pipeline each stage's ``Program.phase`` is the
phase its last phase-making pass set (``plan``, ``partition``, ``split``, ``schedule``,
``lower``),
the fields of ``MADE_BY`` exist exactly from their phase on, the contracts' starting
properties come from the phase, the verifier refuses a program whose fields its phase
does not promise, and the printer shows the phase and ``P(auto)`` only before ``split``.
"""

import re
from pathlib import Path

import jax.numpy as jnp
import pytest
from helpers import input_program, mlp_loss
from mpmdc.passes import Property
from mpmdc.passes.vma_typecheck import verify

import mpmdc
from mpmdc import errors
from mpmdc.ir.program import MADE_BY, Phase, PlanRequest
from mpmdc.pipeline import properties_of

X = jnp.ones((8, 8))
WS = [jnp.eye(8), jnp.eye(8)]

PHASE_AFTER = {  # the phase each stage of the default pipeline is in
    "input": Phase.TRACED,
    "after-plan": Phase.PLANNED,
    "after-inline": Phase.PLANNED,
    "after-split-scans": Phase.PLANNED,
    "after-cond-fission": Phase.PLANNED,
    "after-slice-stacks": Phase.PLANNED,
    "after-dce": Phase.PLANNED,
    "after-partition": Phase.PLACED,
    "after-vma-typecheck": Phase.PLACED,
    "after-split": Phase.SPLIT,
    "after-split-backward": Phase.SPLIT,
    "after-schedule": Phase.SCHEDULED,
    "after-donate": Phase.SCHEDULED,
    "stablehlo": Phase.LOWERED,
}


def accumulated(ws, x):
    return mpmdc.accumulate(lambda xb: mlp_loss(ws, xb), x, microbatches=2)


@pytest.fixture(scope="module")
def lowered(meshes2):
    return mpmdc.compile(accumulated, meshes2).lower(WS, X)


def test_each_stage_is_in_the_phase_its_passes_made(lowered):
    assert {stage: lowered.program(stage).phase for stage in lowered.stages} == PHASE_AFTER


def test_a_field_exists_exactly_from_the_phase_that_makes_it(lowered):
    for stage in lowered.stages:
        program = lowered.program(stage)
        for field, made_by in MADE_BY.items():
            assert (getattr(program, field) is not None) == (program.phase >= made_by), (
                stage,
                field,
            )
        assert (program.placements is not None) == (program.phase is Phase.PLACED)
        assert program.phase_problems() == []


def test_contracts_start_from_the_phase(lowered):
    have = {stage: properties_of(lowered.program(stage)) for stage in lowered.stages}
    assert have["input"] == frozenset()  # (it asks for a schedule to apply)
    assert have["after-plan"] == {Property.PLANNED}
    assert have["after-partition"] == {Property.PLANNED, Property.INLINED, Property.PLACED}
    assert have["after-split"] == {Property.PLANNED, Property.INLINED, Property.SPLIT}
    assert Property.SCHEDULED in have["after-schedule"]
    assert Property.LOWERED in have["stablehlo"]


def test_a_program_without_a_loop_is_scheduled_from_the_start(meshes2):
    assert Property.SCHEDULED in properties_of(input_program(mlp_loss, meshes2, WS, X))


@pytest.mark.parametrize(
    "stage, changes, says",
    [
        ("input", {"in_meshes": (0,)}, "`in_meshes` is set, but a traced program has none yet"),
        ("after-partition", {"phase": Phase.TRACED}, "`in_meshes` is set, but a traced"),
        ("input", {"phase": Phase.PLACED}, "`in_meshes` is missing, though a placed program"),
        ("after-donate", {"phase": Phase.LOWERED}, "`module_keys` is missing"),
        ("after-plan", {"plan_request": PlanRequest()}, "`plan_request` is set, but a planned"),
        ("after-split", {"in_specs": None}, "`in_specs` has an entry not chosen, after `split`"),
        ("after-split", {"phase": Phase.PLACED}, "a `fragment` is at the top level before"),
        ("after-split", {"phase": Phase.SCHEDULED}, "a loop edge is at the top level"),
        (
            "after-partition",
            {"out_meshes": ()},
            "`out_meshes` has 0 entries for a jaxpr of 1 output(s)",
        ),
    ],
)
def test_the_verifier_refuses_what_a_phase_does_not_promise(lowered, stage, changes, says):
    program = lowered.program(stage)
    if changes.get("in_specs", 0) is None:
        changes = {"in_specs": (None,) * len(program.in_specs)}
    with pytest.raises(errors.TypeCheckError, match=re.escape(says)):
        verify(program.replace(**changes))


def test_the_printer_shows_the_phase_and_auto_specs_only_before_split(lowered):
    for stage in lowered.stages:
        text = lowered.as_text(stage)
        phase = lowered.program(stage).phase
        assert text.startswith(f"phase: {phase}\nmeshes:\n")
        assert ("P(auto)" in text) == (phase < Phase.SPLIT), stage
        assert ("// ----- fragment" in text) == (phase is Phase.LOWERED), stage


def test_a_compiled_program_drops_its_modules_and_is_scheduled(lowered):
    program = lowered.compile().program
    assert program.phase is Phase.SCHEDULED and program.phase_problems() == []


def test_the_design_doc_states_every_phase():
    text = (Path(__file__).parents[2] / "docs" / "design.md").read_text()
    table = text.split("### Phases", 1)[1].split("\n\n")[2]
    rows = re.findall(r"^\| `([a-z]+)` \|", table, re.M)
    assert rows == [str(p) for p in Phase]
