"""The Llama example (``examples/llama_nnx.py``): a Flax NNX model whose scanned layer stack
is pipelined by one ``mpmdc.stage(h, every=k)`` line trains as under ``jax.jit``, each
stage's rows of every stacked parameter and Adam moment held by its mesh only.

Tolerance: the global norm of ``clip_by_global_norm`` adds per-stage partial sums and
values crossing fragments are materialized, so sums round otherwise than in one
``jax.jit`` module; Adam magnifies that over steps. The bound is ten times a noise floor:
how far ``jax.jit`` of the same two steps is from itself with the microbatches in
reverse order.
"""

import importlib.util
import math
import pathlib
import re

import jax
import pytest
from flax import nnx
from helpers import largest_difference

import mpmdc

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

_spec = importlib.util.spec_from_file_location(
    "llama_nnx", pathlib.Path(__file__).parents[2] / "examples" / "llama_nnx.py"
)
llama_nnx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama_nnx)

LAYERS, STAGES, MICROBATCHES, STEPS = 8, 4, 4, 2
# Noise floor 5.7e-07 (jax.jit of the two steps against jax.jit with the four
# microbatches in reverse order; CPU, float32), margin 10x.
ATOL = 6e-6


def small_llama():
    model = llama_nnx.Llama(
        vocab=32,
        width=16,
        heads=4,
        kv_heads=2,
        hidden=32,
        layers=LAYERS,
        stages=STAGES,
        rngs=nnx.Rngs(0),
    )
    return nnx.split(model, nnx.Param)


def tokens():
    return jax.random.randint(jax.random.key(1), (16, 9), 0, 32)


def train(step, steps=STEPS):
    """``steps`` steps from a fresh model, each step's results fed to the next."""
    params = small_llama()[1]
    optimizer = llama_nnx.default_optimizer()
    state = (params, optimizer.init(params))
    losses = []
    for _ in range(steps):
        *state, loss = step(*state, tokens())
        losses.append(loss)
    return (*state, losses)


def make_step():
    return llama_nnx.make_step(small_llama()[0], llama_nnx.default_optimizer(), MICROBATCHES)


@pytest.fixture(scope="module")
def pipelined(meshes4):
    """The compiled step, what two steps of it return and a host copy of that (the
    arrays are donated when fed back)."""
    step = mpmdc.compile(make_step(), meshes4, donate_argnums=(0, 1))
    results = train(step)
    return step, results, jax.device_get(results)


def test_two_steps_match_jit(pipelined):
    got = pipelined[2]
    want = train(jax.jit(make_step()))
    assert largest_difference(got, want) <= ATOL
    assert math.isfinite(float(got[2][-1])) and float(got[2][-1]) < float(got[2][0])


def stacked_leaves(params, opt_state):
    """The stacked block parameters and Adam's two moments of each, by path."""
    found = {}
    for prefix, tree in (("params", params), ("opt_state", opt_state)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            name = prefix + jax.tree_util.keystr(path)
            if "['blocks']" in name:
                found[name] = leaf
    return found


def test_each_mesh_holds_its_stages_rows_and_results_feed_back(pipelined, meshes4):
    step, (params, opt_state, _), _ = pipelined
    stacked = stacked_leaves(params, opt_state)
    # Nine stacked parameters, each with a first and a second Adam moment.
    assert len(stacked) == 3 * 9
    assert sum(".mu[" in n for n in stacked) == sum(".nu[" in n for n in stacked) == 9
    rows = LAYERS // STAGES
    want = {
        (d.id, rows * i, rows * (i + 1))
        for i, mesh in enumerate(meshes4)
        for d in mesh.devices.flat
    }
    shardings = {name: leaf.sharding for name, leaf in stacked.items()}
    for name, leaf in stacked.items():
        assert leaf.shape[0] == LAYERS, name
        held = {(s.device.id, s.index[0].start, s.index[0].stop) for s in leaf.addressable_shards}
        assert held == want, name
    # Two calls (the second fed the first's results) and one more: one executable.
    again = step(params, opt_state, tokens())
    assert step.cache_info().misses == 1
    for name, leaf in stacked_leaves(*again[:2]).items():
        assert leaf.sharding == shardings[name], name


def test_the_example_runs(capsys):
    llama_nnx.main(steps=1)
    out = capsys.readouterr().out
    loss = re.search(r"step 0: loss (\S+)", out)
    assert loss and math.isfinite(float(loss.group(1))), out
    # Each of the nine stacked parameters: mesh i holds rows [2i, 2i + 2).
    assert out.count("mesh0 [0, 2), mesh1 [2, 4), mesh2 [4, 6), mesh3 [6, 8)") == 9, out
