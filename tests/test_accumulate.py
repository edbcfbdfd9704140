"""``mpmdc.accumulate``: the sequential loop under jax.jit, the unrolled form under mpmdc."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_as_jit, mesh_index

import mpmdc
from mpmdc.demo import init_params, mlp_loss
from mpmdc.errors import AccumulateError, ScheduleError


def data(batch=32):
    return jax.random.normal(jax.random.key(1), (batch, 16)), jax.random.normal(jax.random.key(2), (batch, 8))


def sgd_step(params, x, y, microbatches=8, schedule="1f1b"):
    """Mean loss and gradient over microbatches, then one SGD update."""
    loss, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(mlp_loss)(params, *mb),
        (x, y), microbatches=microbatches, schedule=schedule, reduce="mean",
    )
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def hand_written_step(params, x, y, microbatches=8):
    """The same step as a plain per-microbatch Python loop."""
    size = x.shape[0] // microbatches
    total = None
    for i in range(microbatches):
        part = jax.value_and_grad(mlp_loss)(params, x[i * size : (i + 1) * size], y[i * size : (i + 1) * size])
        total = part if total is None else jax.tree_util.tree_map(jnp.add, total, part)
    loss, grads = jax.tree_util.tree_map(lambda a: a / microbatches, total)
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def assert_trees_close(got, want, rtol=2e-5):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=1e-6)


def test_under_jit_it_is_the_per_microbatch_loop():
    params = init_params(jax.random.key(0), [16, 32, 32, 32, 8])
    assert_trees_close(jax.jit(sgd_step)(params, *data()), jax.jit(hand_written_step)(params, *data()))
    jaxpr = str(jax.make_jaxpr(sgd_step)(params, *data()))
    assert "scan[" in jaxpr  # one loop body, not eight copies


def test_four_stage_sgd_step_under_mpmdc(meshes4):
    params = init_params(jax.random.key(0), [16, 32, 32, 32, 8])
    loss, new_params = mpmdc.compile(sgd_step, meshes4)(params, *data())
    assert_trees_close((loss, new_params), jax.jit(hand_written_step)(params, *data()))
    # The update runs where each layer's parameters and gradients live.
    assert [mesh_index(w, meshes4) for w, _ in new_params] == [0, 1, 2, 3]


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_reductions_and_pytree_prefixes(meshes2, microbatches):
    def fn(w, x):
        def per_microbatch(mb):
            h = mpmdc.stage(mb, 0) @ w
            h = mpmdc.stage(jnp.tanh(h), 1)
            return {"total": h.sum(), "peak": h.max(0), "rows": h, "both": (h.mean(), h.min())}

        reduce = {"total": "sum", "peak": "max", "rows": "concat", "both": "mean"}
        return mpmdc.accumulate(per_microbatch, x, microbatches=microbatches, reduce=reduce)

    w, x = jnp.ones((4, 6)) * 0.1, jnp.arange(32.0).reshape(8, 4) / 10
    got = assert_same_as_jit(fn, meshes2, w, x)
    np.testing.assert_allclose(got["rows"], jnp.tanh(x @ w), rtol=1e-6)
    np.testing.assert_allclose(got["peak"], jnp.tanh(x @ w).max(0), rtol=1e-6)
    np.testing.assert_allclose(got["total"], jnp.tanh(x @ w).sum(), rtol=1e-5)


def test_eager_call_works_too():
    out = mpmdc.accumulate(lambda mb: mb.sum(), jnp.arange(12.0), microbatches=3)
    assert float(out) == 66.0


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"microbatches": 5}, AccumulateError, "xs[0] has leading size 8, which 5 microbatches do not divide"),
        ({"microbatches": 0}, AccumulateError, "microbatches must be a positive int, got 0"),
        ({"microbatches": True}, AccumulateError, "positive int, got True"),
        ({"microbatches": 2, "schedule": "2f2b"}, ScheduleError, "known schedules: gpipe, 1f1b"),
        ({"microbatches": 2, "reduce": "median"}, AccumulateError, "unknown reduction 'median'"),
        ({"microbatches": 2, "reduce": ["sum", "sum", "sum"]}, AccumulateError, "does not match the structure"),
        ({"microbatches": 2, "reduce": "concat"}, AccumulateError, "fn returned a scalar"),
    ],
)
def test_accumulate_errors(kwargs, error, says):
    xs = (jnp.ones((8, 2)), jnp.ones((8,)))
    with pytest.raises(error, match=re.escape(says)):
        jax.jit(lambda xs: mpmdc.accumulate(lambda mb: mb[0].sum() + mb[1].sum(), xs, **kwargs))(xs)


def test_scalar_leaf_is_named():
    with pytest.raises(AccumulateError, match=r"xs\['scale'\] is a scalar"):
        mpmdc.accumulate(lambda mb: mb["x"].sum(), {"x": jnp.ones(4), "scale": 2.0}, microbatches=2)
