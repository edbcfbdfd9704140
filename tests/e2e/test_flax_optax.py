"""Flax and Optax programs as users write them, against ``jax.jit``; every parameter and
optimizer-state leaf stays on the mesh of the stage that uses it.

Tolerances: values crossing fragments are materialized, so XLA fuses and sums them
otherwise than in one ``jax.jit`` module, and Adam's steps magnify the rounding of small
gradients. Each bound is ten times a noise floor: how far ``jax.jit`` of the same step is
from itself run eagerly (every intermediate materialized) or with its microbatches in
the other order, the larger, over the test's steps. In bfloat16, XLA keeps excess
precision inside one module (``xla_allow_excess_precision``), while eager, like a
fragment boundary, rounds each intermediate to bfloat16.
"""

import importlib.util
import pathlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import largest_difference, mesh_index
from test_placement import WIDTH, batch, init, residual_loss, training_step

import mpmdc
from mpmdc.errors import PlacementWarning

_spec = importlib.util.spec_from_file_location(
    "nnx_gpt", pathlib.Path(__file__).parents[2] / "examples" / "nnx_gpt.py"
)
nnx_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nnx_gpt)

LAYERS = STAGES = 4
MICROBATCHES = 2


def small_gpt(dtype=None, stages=STAGES):
    model = nnx_gpt.GPT(
        vocab=32,
        width=16,
        heads=2,
        hidden=32,
        layers=stages,
        stages=stages,
        dtype=dtype,
        rngs=nnx.Rngs(0),
    )
    return nnx.split(model, nnx.Param)


def tokens():
    return jax.random.randint(jax.random.key(1), (8, 9), 0, 32)


def train(step, params, opt_state, *args, steps):
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, *args)
        losses.append(loss)
    return params, opt_state, losses


def expected_mesh(path: str):
    """The mesh of the stage using the parameter a leaf path names (``None``: a count)."""
    if "['blocks']" in path:
        block = int(path.split("['blocks'][")[1].split("]")[0])
        return block * STAGES // LAYERS
    if "['embed']" in path:
        return 0  # a tied embedding lives where it is first used
    if "['norm']" in path:
        return STAGES - 1
    return None


def assert_on_stage_meshes(tree, meshes):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        want = expected_mesh(jax.tree_util.keystr(path))
        if want is not None:
            assert mesh_index(leaf, meshes) == want, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_nnx_gpt_trains_with_clip_and_adamw_fed_back_and_donated(meshes4):
    graphdef, params = small_gpt()
    optimizer = nnx_gpt.default_optimizer()
    opt_state = optimizer.init(params)
    step = nnx_gpt.make_step(graphdef, optimizer, microbatches=MICROBATCHES)
    lowered = mpmdc.compile(step, meshes4, donate_argnums=(0, 1)).lower(params, opt_state, tokens())

    report = lowered.transfer_report()
    embedding = params["embed"]["embedding"][...].nbytes
    # Parameters and optimizer state stay put: only the tied embedding (to the last
    # stage) and the optimizer's scalars (Adam's bias corrections) are state crossing.
    assert embedding <= report.total("parameters/optimizer state") <= embedding + 64

    want = train(jax.jit(step), params, opt_state, tokens(), steps=3)
    got = train(lowered.compile(), params, opt_state, tokens(), steps=3)
    # Noise floor 9.8e-06 (jax.jit against eager over the three steps; 1.2e-07 against
    # jax.jit with the microbatches swapped), margin 10x.
    assert largest_difference(got, want) <= 1e-4
    assert_on_stage_meshes(got[:2], meshes4)


@pytest.mark.slow
def test_nnx_gpt_with_dropout_keys_per_microbatch_in_bfloat16(meshes2):
    graphdef, params = small_gpt(jnp.bfloat16, stages=2)
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(params)
    step = nnx_gpt.make_step(graphdef, optimizer, microbatches=MICROBATCHES, dropout=True)
    keys = jax.random.split(jax.random.key(3), MICROBATCHES)
    got = mpmdc.compile(step, meshes2)(params, opt_state, tokens(), keys)
    want = jax.jit(step)(params, opt_state, tokens(), keys)
    # Noise floors (jax.jit against eager; 0 with the microbatches swapped): 1.6e-04
    # relative for the loss, margin 10x; 1.8e-02 of a parameter's largest update for its
    # update, margin 5.5x.
    np.testing.assert_allclose(got[2], want[2], rtol=1.6e-3)
    for p, g, w in zip(*(jax.tree_util.tree_leaves(t) for t in (params, got[0], want[0]))):
        step_got, step_want = np.asarray(g) - np.asarray(p), np.asarray(w) - np.asarray(p)
        assert np.max(np.abs(step_got - step_want)) <= 0.1 * np.max(np.abs(step_want))
    dropped = jax.jit(nnx_gpt.make_step(graphdef, optimizer, microbatches=MICROBATCHES))(
        params, opt_state, tokens()
    )
    assert largest_difference(got, dropped) > 1e-3  # the keys did drop something
    for path, leaf in jax.tree_util.tree_leaves_with_path(got[0]):
        block = jax.tree_util.keystr(path)
        want_mesh = 0 if "['embed']" in block or "['blocks'][0]" in block else 1
        assert mesh_index(leaf, meshes2) == want_mesh, block


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "inject-hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.slow
def test_optax_optimizers_keep_their_state_with_its_parameter(meshes2, name):
    optimizer = OPTIMIZERS[name]()
    params = init(jax.random.key(0), stages=2)
    opt_state = optimizer.init(params)
    step = training_step(optimizer, microbatches=2)
    want = train(jax.jit(step), params, opt_state, *batch(), steps=2)
    with warnings.catch_warnings():  # (results fed back are where the next call reads them)
        warnings.simplefilter("error", PlacementWarning)
        got = train(
            mpmdc.compile(step, meshes2, donate_argnums=(0, 1)),
            params,
            opt_state,
            *batch(),
            steps=2,
        )
    # Noise floor 6.0e-08 (jax.jit against eager over the two steps, the largest over the
    # optimizers; 0 against jax.jit with the microbatches swapped), margin 10x.
    assert largest_difference(got, want) <= 6e-7
    for tree in got[:2]:
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            stages = [k.idx for k in path if isinstance(k, jax.tree_util.SequenceKey)]
            if jnp.ndim(leaf) and stages:
                assert mesh_index(leaf, meshes2) == stages[-1], jax.tree_util.keystr(path)


class LinenResidual(nn.Module):
    """A Flax Linen model with one pipeline stage per block."""

    stages: int = 4

    @nn.compact
    def __call__(self, x):
        for i in range(self.stages):
            x = mpmdc.stage(x, i)
            x = x + jnp.tanh(nn.Dense(WIDTH, name=f"block{i}")(nn.LayerNorm(name=f"norm{i}")(x)))
        return x


@pytest.mark.slow
def test_linen_model_through_apply(meshes4):
    model = LinenResidual()
    x, y = batch()
    params = model.init(jax.random.key(0), x)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    got = mpmdc.compile(step, meshes4)(params, opt_state, x, y)
    want = jax.jit(step)(params, opt_state, x, y)
    assert largest_difference(got, want) == 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(got[:2]):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        block = next((n for n in names if n.startswith(("block", "norm"))), None)
        if block is not None:
            assert mesh_index(leaf, meshes4) == int(block[-1]), jax.tree_util.keystr(path)


def test_the_residual_model_is_its_own_reference():
    """``residual_loss`` under plain ``jax.jit`` ignores its markers."""
    params = init(jax.random.key(0))
    assert np.isfinite(float(jax.jit(residual_loss)(params, *batch())))
