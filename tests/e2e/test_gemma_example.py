"""The Gemma-shaped example (``examples/gemma_nnx.py``): a Flax NNX model as Gemma is
written (a scaled embedding tied with the output projection, RMSNorm, rotary positions,
grouped-query attention alternating local and global, soft caps, positions and masks
from padded tokens), its blocks a list or one scanned stack, pipelined by stage markers
alone, trains as under ``jax.jit``; the tied embedding and its AdamW moments live on the
first stage's mesh, where the next step reads them; the masks and position tables every
stage reads cost little to move.

Tolerance: clipping's global norm adds per-stage partial sums, the tied embedding's
gradient contributions cross fragments, and Adam magnifies rounding over steps. The
bound is ten times a noise floor: how far ``jax.jit`` of the same two steps is from
itself with the four microbatches in reverse order (CPU, float32: 1.9e-6 with the blocks
in a list, 2.8e-7 scanned).
"""

import importlib.util
import math
import pathlib

import jax
import pytest
from flax import nnx
from helpers import largest_difference, mesh_index

import mpmdc

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

_spec = importlib.util.spec_from_file_location(
    "gemma_nnx", pathlib.Path(__file__).parents[2] / "examples" / "gemma_nnx.py"
)
gemma_nnx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gemma_nnx)

STEPS = 2
ATOL = 2e-5


def model(scanned):
    return nnx.split(gemma_nnx.Gemma(scanned=scanned, rngs=nnx.Rngs(0)), nnx.Param)


def train(step, params, steps=STEPS):
    """``steps`` steps, each step's results fed to the next, on data of its own."""
    state = (params, gemma_nnx.default_optimizer().init(params))
    losses = []
    for k in range(steps):
        *state, loss = step(*state, gemma_nnx.data(k + 1))
        losses.append(loss)
    return (*state, losses)


@pytest.fixture(scope="module", params=[False, True], ids=["blocks in a list", "scanned"])
def pipelined(request, meshes4):
    """The variant, the compiled step, what two steps of it return, and a host copy."""
    graphdef, params = model(request.param)
    step = mpmdc.compile(
        gemma_nnx.make_step(graphdef, gemma_nnx.default_optimizer()),
        meshes4,
        donate_argnums=(0, 1),
    )
    results = train(step, params)
    return request.param, step, results, jax.device_get(results)


def test_two_steps_match_jit(pipelined):
    scanned, _, _, got = pipelined
    graphdef, params = model(scanned)
    want = train(jax.jit(gemma_nnx.make_step(graphdef, gemma_nnx.default_optimizer())), params)
    assert largest_difference(got, want) <= ATOL
    assert all(math.isfinite(float(loss)) for loss in got[2])


def test_the_tied_embedding_and_its_moments_stay_where_the_next_step_reads_them(pipelined, meshes4):
    _, step, (params, opt_state, _), _ = pipelined
    adam = opt_state[1][0]
    for leaf in (params["embedding"], adam.mu["embedding"], adam.nu["embedding"]):
        assert mesh_index(leaf, meshes4) == 0
    tokens = gemma_nnx.data(9)
    wanted = step.input_shardings(params, opt_state, tokens)[0][0]
    assert wanted["embedding"] == params["embedding"].sharding
    step(params, opt_state, tokens)  # the results of two steps fed back: nothing compiles
    assert step.cache_info().misses == 1


def test_what_every_stage_reads_moves_little_beside_the_activations(pipelined):
    scanned, step, _, _ = pipelined
    params = model(scanned)[1]
    opt_state = gemma_nnx.default_optimizer().init(params)
    report = step.lower(params, opt_state, gemma_nnx.data(1)).transfer_report()
    assert report.total("other") <= report.total("activations/cotangents") / 4
