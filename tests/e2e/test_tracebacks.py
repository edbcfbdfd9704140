"""An error leaving mpmdc has a traceback of the user's frames, as one leaving ``jax.jit``.

JAX removes its own frames from the traceback of an exception that leaves one of its
entry points (``JAX_TRACEBACK_FILTERING``); mpmdc's entry points remove mpmdc's the
same way, so the last frame shown is the user's line. A chained cause (the exception a
crashing pass raised) keeps its frames, and ``JAX_TRACEBACK_FILTERING=off`` keeps all.
"""

import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import CRASHING, passes_with
from test_bad_input_catalog import rejecting_negatives, two_stage

import mpmdc
from mpmdc import errors

REPO = Path(__file__).resolve().parents[2]
MPMDC = tuple(str(REPO / package) + "/" for package in ("mpmdc", "passes", "lowering"))
W, X = jnp.full((4, 4), 0.25), jnp.ones((4, 4))


def raising(w, x):
    raise ValueError("the user's own mistake")


def three_microbatches(w, x):
    return mpmdc.accumulate(lambda mb: two_stage(w, mb), x, microbatches=3)


def one_stage_per_mesh(w, x):
    return mpmdc.accumulate(lambda mb: two_stage(w, mpmdc.stage(mb, 2)), x, microbatches=2)


def frames(err: BaseException) -> list:
    return traceback.extract_tb(err.__traceback__)


def mpmdc_frames(err: BaseException) -> list:
    return [f for f in frames(err) if f.filename.startswith(MPMDC)]


MISTAKES = {
    "the function raises while traced": (
        lambda meshes: mpmdc.compile(raising, meshes)(W, X),
        ValueError,
        "raising",
    ),
    "mpmdc.accumulate refuses its microbatches": (
        lambda meshes: mpmdc.compile(three_microbatches, meshes)(W, X),
        errors.AccumulateError,
        "three_microbatches",  # the line calling mpmdc.accumulate
    ),
    "a pass refuses the program (a schedule)": (
        lambda meshes: mpmdc.compile(one_stage_per_mesh, meshes)(W, X),
        errors.ScheduleError,
        "<lambda>",
    ),
    "a host callback raises at run time": (
        lambda meshes: mpmdc.compile(rejecting_negatives, meshes)(W, -X),
        errors.MpmdRuntimeError,
        "<lambda>",
    ),
    "a checkpoint that is not there": (
        lambda meshes: mpmdc.checkpoint.restore("/nonexistent/checkpoint"),
        errors.CheckpointError,
        "<lambda>",
    ),
    "a checkpoint manager with no step to restore": (
        lambda meshes: mpmdc.checkpoint.CheckpointManager("/nonexistent/run").restore(),
        errors.CheckpointError,
        "<lambda>",
    ),
    "a stage marker outside any trace": (
        lambda meshes: mpmdc.stage(X, -1),
        errors.StageError,
        "<lambda>",
    ),
}


@pytest.mark.parametrize("what", MISTAKES)
def test_an_error_s_traceback_ends_in_the_user_s_code(what, meshes2):
    make, error, last = MISTAKES[what]
    with pytest.raises(error) as caught:
        make(meshes2)
    assert not mpmdc_frames(caught.value), mpmdc_frames(caught.value)
    assert frames(caught.value)[-1].name == last
    assert frames(caught.value)[-1].filename == __file__


def test_a_crashing_pass_keeps_its_frames_in_the_chained_cause(meshes2):
    step = mpmdc.compile(two_stage, meshes2, passes=passes_with(CRASHING, "inline"))
    with pytest.raises(errors.InternalError) as caught:
        step(W, X)
    assert not mpmdc_frames(caught.value)
    assert isinstance(caught.value.__cause__, KeyError)
    assert any(f.name == "_crash" for f in frames(caught.value.__cause__))


def test_traceback_filtering_off_keeps_mpmdc_s_frames(meshes2):
    was = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        with pytest.raises(ValueError) as caught:
            mpmdc.compile(raising, meshes2)(W, X)
    finally:
        jax.config.update("jax_traceback_filtering", was)
    assert any(f.name == "_traced" for f in mpmdc_frames(caught.value))
