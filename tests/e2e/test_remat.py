"""A stage marker inside ``jax.checkpoint`` keeps the remat of each stage's work."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_array

import mpmdc


def block(w, x):
    for _ in range(4):
        x = jnp.tanh(x @ w)
    return x


def markers_inside(policy=None):
    def loss(ws, x):
        def body(ws, x):
            for i, w in enumerate(ws):
                x = mpmdc.stage(x, i)
                x = block(w, x)
            return x

        return jnp.sum(jax.checkpoint(body, policy=policy)(ws, x) ** 2)

    return loss


def markers_outside(ws, x):
    for i, w in enumerate(ws):
        x = mpmdc.stage(x, i)
        x = jax.checkpoint(block)(w, x)
    return jnp.sum(x**2)


def no_remat(ws, x):
    for i, w in enumerate(ws):
        x = mpmdc.stage(x, i)
        x = block(w, x)
    return jnp.sum(x**2)


WS = [jnp.eye(64) * 0.5] * 3
X = jnp.ones((32, 64))


def peaks(loss, meshes2):
    grad = jax.grad(loss)
    exe = mpmdc.compile(grad, meshes2, stage_to_mesh=[0, 1, 1]).lower(WS, X).compile()
    for got, want in zip(
        jax.tree_util.tree_leaves(exe(WS, X)), jax.tree_util.tree_leaves(jax.jit(grad)(WS, X))
    ):
        assert_same_array(got, want)
    return [m.peak_bytes for m in exe.memory]


@pytest.mark.slow
def test_a_checkpoint_around_the_stages_remats_each_stage_as_one_around_each_stage(meshes2):
    inside, outside, plain = (
        peaks(markers_inside(), meshes2),
        peaks(markers_outside, meshes2),
        peaks(no_remat, meshes2),
    )
    assert inside == outside
    assert all(i < p for i, p in zip(inside, plain))


@pytest.mark.parametrize(
    "policy", [jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.everything_saveable]
)
@pytest.mark.slow
def test_the_checkpoint_policy_decides_what_each_stage_saves(meshes2, policy):
    saving = peaks(markers_inside(policy), meshes2)
    assert all(s > i for s, i in zip(saving, peaks(markers_inside(), meshes2)))
