"""The pass runner: stage names, verification after every pass, internal errors that name
the pass and the program it got."""

import gc
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import CRASHING, passes_with
from mpmdc.passes import PASSES, FunctionPass

import mpmdc
from mpmdc import cli, errors
from mpmdc.ir.program import placed
from mpmdc.pipeline import (
    resolve,
    run_pipeline,
    verification_requested,
    verifying,
)

X = jnp.ones((4, 8))


def two_stage(x):
    return jnp.sum(jnp.tanh(mpmdc.stage(jnp.sin(x), 1)))


def _forget_placements(program):
    eqns = list(program.jaxpr.jaxpr.eqns)
    eqns[0] = placed(eqns[0], None)
    return program.replace(
        jaxpr=program.jaxpr.replace(jaxpr=program.jaxpr.jaxpr.replace(eqns=eqns))
    )


# A pass with a bug that drops an equation's placement (``CRASHING`` raises instead).
FORGETS_PLACEMENTS = FunctionPass(
    "forgets-placements", "drops the first equation's placement", _forget_placements
)


def test_a_pass_that_raises_is_an_internal_error_naming_it(meshes2):
    compiled = mpmdc.compile(two_stage, meshes2, passes=passes_with(CRASHING, after="dce"))
    with pytest.raises(errors.InternalError) as caught:
        compiled.lower(jnp.ones(4))
    err = caught.value
    assert (err.pass_name, err.stage) == ("crashing", "after-dce")
    assert (
        "internal error in pass `crashing`, run on the program 'after-dce': it raised KeyError"
        in str(err)
    )
    assert "mpmdc dump FILE.py:TARGET --stage all" in str(err)
    assert isinstance(err.__cause__, KeyError)
    assert "stage[stage=1" in err.program.as_text()


def test_the_cyclic_collector_waits_for_lower_and_runs_again_after_it(meshes2):
    seen = []

    def traced(x):
        seen.append(gc.isenabled())
        return two_stage(x)

    mpmdc.compile(traced, meshes2).lower(jnp.ones(4))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(errors.InternalError):  # also when a pass fails
        mpmdc.compile(two_stage, meshes2, passes=passes_with(CRASHING, after="dce")).lower(
            jnp.ones(4)
        )
    assert gc.isenabled()


def test_verification_failure_names_the_pass_whose_output_failed(meshes2):
    program = mpmdc.compile(two_stage, meshes2).lower(jnp.ones(4)).program("after-partition")
    with pytest.raises(
        errors.InternalError,
        match=r"`forgets-placements`, run on the program 'input': its output fails verification: TypeCheckError: `sin` at .*has no placement",
    ):
        run_pipeline(program, [FORGETS_PLACEMENTS], verify=True)
    run_pipeline(program, [FORGETS_PLACEMENTS], verify=False)  # unverified, nothing notices


def test_verification_runs_when_asked_and_only_then(meshes2, monkeypatch):
    program = mpmdc.compile(two_stage, meshes2).lower(jnp.ones(4)).program("after-partition")
    monkeypatch.delenv("MPMDC_VERIFY", raising=False)
    assert not verification_requested()
    run_pipeline(program, [FORGETS_PLACEMENTS])  # a user's compile does not verify
    with verifying():
        assert verification_requested()
        with pytest.raises(errors.InternalError, match="fails verification"):
            run_pipeline(program, [FORGETS_PLACEMENTS])
    assert not verification_requested()
    monkeypatch.setenv("MPMDC_VERIFY", "1")
    with pytest.raises(errors.InternalError, match="fails verification"):
        run_pipeline(program, [FORGETS_PLACEMENTS])


def _dump_target(tmp_path, imports: str, *body: str):
    """A module for ``mpmdc dump`` whose ``lowered()`` runs ``body`` after ``imports``."""
    target = tmp_path / "model.py"
    lines = [
        "import jax.numpy as jnp, mpmdc",
        imports,
        "def lowered():",
        *(f"    {line}" for line in body),
    ]
    target.write_text("\n".join(lines) + "\n")
    return target


def test_dump_verifies_every_pass(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MPMDC_VERIFY", raising=False)
    monkeypatch.setitem(PASSES, FORGETS_PLACEMENTS.name, FORGETS_PLACEMENTS)
    target = _dump_target(
        tmp_path,
        "from test_pass_runner import two_stage",
        "return mpmdc.compile(two_stage, mpmdc.make_meshes(2, {'data': 2})).lower(jnp.ones(4))",
    )
    status = cli.main(
        ["dump", f"{target}:lowered", "--passes", "inline,partition,forgets-placements"]
    )
    _, err = capsys.readouterr()
    assert (
        status == 1
        and "`forgets-placements`, run on the program 'after-partition': its output fails verification"
        in err
    )


def _refuse(program):
    raise errors.PlacementError("this pass refuses every program")


def test_a_users_own_mpmdc_error_is_not_an_internal_error(meshes2):
    refuses = FunctionPass("refuses", "raises a PlacementError", _refuse)
    with pytest.raises(errors.PlacementError, match="refuses every program"):
        mpmdc.compile(two_stage, meshes2, passes=["inline", refuses]).lower(jnp.ones(4))


def test_a_warning_the_callers_filters_make_an_error_is_raised_as_it_is(meshes2):
    """Under ``warnings.simplefilter("error")`` (``pytest -W error``) a pass's warning is
    the error the caller asked for, not a bug in the pass: ``partition`` warns of a
    conditional reading both stages' weights."""

    def step(ws, x):
        h = jnp.tanh(mpmdc.stage(jnp.tanh(mpmdc.stage(x, 0) @ ws[0]), 1) @ ws[1])
        mixed = jax.lax.cond(jnp.sum(h) > 0, jnp.matmul, lambda a, b: a, ws[0], ws[1])
        return jnp.sum(h), mixed

    ws = [jnp.eye(16), jnp.eye(16)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", errors.PlacementWarning)
        with pytest.raises(errors.PlacementWarning, match=r"`cond` at .* reads arrays living"):
            mpmdc.compile(step, meshes2).lower(ws, jnp.ones((4, 16)))


def test_dump_prints_the_program_the_failing_pass_got(tmp_path, capsys):
    target = _dump_target(
        tmp_path,
        "from test_pass_runner import CRASHING, passes_with, two_stage",
        "meshes = mpmdc.make_meshes(2, {'data': 2})",
        "passes = passes_with(CRASHING, after='partition')",
        "return mpmdc.compile(two_stage, meshes, passes=passes).lower(jnp.ones(4))",
    )
    status = cli.main(["dump", f"{target}:lowered", "--stage", "all"])
    out, err = capsys.readouterr()
    assert status == 1
    assert (
        out.startswith("// ----- after-partition\nphase: placed\nmeshes:")
        and "[s1_fwd @mesh1]" in out
    )
    assert err.count("\n") == 1 and "InternalError: internal error in pass `crashing`" in err


def test_the_registry_holds_one_pass_per_file():
    folder = Path(mpmdc.passes.__file__).parent
    files = {p.stem for p in folder.glob("*.py")} - {"__init__", "base"}
    assert set(PASSES) == {f.replace("_", "-") for f in files}
    for name, p in PASSES.items():
        assert p.body.__module__ == f"mpmdc.passes.{name.replace('-', '_')}", name
        assert p.summary and "\n" not in p.summary, name


def test_pass_options_are_set_by_name(meshes2):
    (lower,) = resolve("lower{backend=tpu}")
    assert lower.options == (("backend", "tpu"),) and str(lower) == "lower{backend=tpu}"
    assert [p.name for p in resolve(" inline, partition ,dce")] == ["inline", "partition", "dce"]
    lowered = mpmdc.compile(
        two_stage, meshes2, passes="inline,dce,partition,split,lower{backend=tpu}"
    ).lower(X)
    assert lowered.stages == (
        "input",
        "after-plan",
        "after-inline",
        "after-dce",
        "after-partition",
        "after-split",
        "stablehlo",
    )
    assert lowered.program("stablehlo").backend == "tpu"
    assert lowered.stablehlo("tpu") == dict(lowered.program("stablehlo").modules)
    # A tuple option keeps its commas, and prints as it parses.
    (_, lower) = resolve("dce,lower{backend=cpu, meshes=(0,1)}")
    assert lower.options == (("backend", "cpu"), ("meshes", (0, 1)))
    assert resolve(str(lower))[0] == lower
    # Options are converted to the types the pass declares.
    assert resolve("lower{meshes=[1]}")[0].options == (("meshes", (1,)),)


@pytest.mark.parametrize(
    "text, says",
    [
        (
            "lower{platform=tpu}",
            "pass `lower` has no option platform; its options: backend, meshes",
        ),
        ("lower{meshes=(0,1}", "unbalanced parentheses in the options of pass `lower`"),
        ("lower{backend}", "needs a value: backend=VALUE"),
        ("lower{backend=tpu", "unbalanced braces"),
        ("Lower", "is not a pass"),
        ("dce{x=1}", "pass `dce` has no option x; its options: none"),
        (
            "lower{meshes=abc}",
            "option meshes='abc' of pass `lower` is not a tuple[int, ...] | None; "
            "e.g. lower{meshes=(0,2)}",
        ),
        ("lower{meshes=2}", "option meshes=2 of pass `lower` is not a tuple[int, ...]"),
        ("lower{backend=3}", "option backend=3 of pass `lower` is not a str | None"),
    ],
)
def test_a_wrong_pass_text_names_what_is_wrong(text, says):
    with pytest.raises(errors.PassError, match=re.escape(says)):
        resolve(text)
