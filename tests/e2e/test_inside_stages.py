"""Control flow, remat, custom derivatives, nested jit and shard_map inside stages."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_as_jit, assert_same_tree, clipped_tanh, mesh_index
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.errors import PlacementWarning


def params_and_data():
    k = jax.random.split(jax.random.key(3), 3)
    return [jax.random.normal(kk, (8, 8)) * 0.3 for kk in k], jax.random.normal(
        jax.random.key(4), (4, 8)
    )


def control_flow_loss(ws, x):
    x = mpmdc.stage(x, 0)
    x, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, jnp.stack([ws[0], ws[0].T]))
    x = mpmdc.stage(x, 1)
    x = jax.lax.cond(x.sum() > 0, lambda v: v @ ws[1], lambda v: -v @ ws[1], x)
    x = jax.checkpoint(lambda v: jnp.sin(v) * 2)(x)
    x = mpmdc.stage(x, 2)
    x = clipped_tanh(x @ ws[2])
    x = jax.lax.fori_loop(0, 3, lambda i, v: v * 0.9 + 0.01 * i, x)
    return jnp.sum(x**2)


def test_control_flow_remat_and_custom_vjp(meshes4):
    ws, x = params_and_data()
    _loss, grads = assert_same_as_jit(jax.value_and_grad(control_flow_loss), meshes4, ws, x)
    assert [mesh_index(g, meshes4) for g in grads] == [0, 1, 2]


def test_while_loop_forward(meshes2):
    def fn(x):
        x = mpmdc.stage(x, 0)
        x = jax.lax.while_loop(lambda v: v.sum() < 100.0, lambda v: v * 1.5 + 1.0, x)
        return mpmdc.stage(x, 1) * 2

    assert_same_as_jit(fn, meshes2, jnp.ones((4, 8)))


def block_with_its_own_rule(kind, marked="input"):
    """``tanh(stage(h, 1) @ w)`` as a function with a derivative rule of its own, the
    marker on its input ``h`` (in the forward or tangent rule JAX differentiates by), or
    on a value the function computes from it."""

    def forward(w, h):
        h = mpmdc.stage(h if marked == "input" else h * 1.0, 1)
        t = jnp.tanh(h @ w)
        return t, (w, h, t)

    if kind == "custom_vjp":
        block = jax.custom_vjp(lambda w, h: forward(w, h)[0])

        def backward(res, g):
            w, h, t = res
            g = g * (1 - t**2)
            return h.T @ g, g @ w.T

        block.defvjp(forward, backward)
        return block
    block = jax.custom_jvp(lambda w, h: forward(w, h)[0])

    @block.defjvp
    def tangent_rule(primals, tangents):
        (w, h), (dw, dh) = primals, tangents
        t, (w, h, _) = forward(w, h) if marked != "nested" else (block(w, h), (w, h, None))
        return t, (1 - t**2) * (dh @ w + h @ dw)

    return block


def two_stage_sgd(block):
    def loss(ws, x):
        x = jnp.tanh(mpmdc.stage(x, 0) @ ws[0])
        return jnp.sum(block(ws[1], x) ** 2)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return value, [w - 0.1 * g for w, g in zip(ws, grads)]

    return step


@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_a_marker_on_the_input_of_a_function_with_its_own_rule_ends_its_backward(meshes2, kind):
    """JAX differentiates such a function by the user's rule, which has no marker: the
    input's cotangent still leaves stage 1's backward there, so stage 0's backward and
    update run on mesh 0, and the updated weights come back where the next call reads
    them."""
    ws, x = params_and_data()
    step = two_stage_sgd(block_with_its_own_rule(kind))
    compiled = mpmdc.compile(step, meshes2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        _, new = compiled(ws[:2], x)
        again = compiled(new, x)
    assert [mesh_index(w, meshes2) for w in new] == [0, 1]
    assert_same_tree(again, jax.jit(step)(jax.jit(step)(ws[:2], x)[1], x))


@pytest.mark.parametrize(
    "kind, marked",
    [("custom_vjp", "computed"), ("custom_jvp", "computed"), ("custom_jvp", "nested")],
)
def test_a_marker_whose_backward_a_custom_rule_hides_is_warned_about(meshes2, kind, marked):
    """A marker on a value the function computed, or inside a call its tangent rule
    makes, has no input whose cotangent could be marked: a warning names its line."""
    ws, x = params_and_data()
    step = two_stage_sgd(block_with_its_own_rule(kind, marked))
    with pytest.warns(
        PlacementWarning,
        match=rf"mpmdc.stage at .*test_inside_stages.py:\d+.* inside a {kind} function .* cannot mark",
    ):
        mpmdc.compile(step, meshes2).lower(ws[:2], x)


@jax.jit
def jitted_block(w, x):
    x = mpmdc.stage(x, 1)
    x = jnp.tanh(x @ w)
    return mpmdc.stage(x, 2)


def test_markers_inside_jitted_helper(meshes4):
    ws, x = params_and_data()

    def loss(ws, x):
        x = jnp.tanh(mpmdc.stage(x, 0) @ ws[0])
        x = jitted_block(ws[1], x)
        return jnp.sum(jnp.tanh(x @ ws[2]))

    _, grads = assert_same_as_jit(jax.value_and_grad(loss), meshes4, ws, x)
    assert [mesh_index(g, meshes4) for g in grads] == [0, 1, 2]
    text = mpmdc.compile(jax.value_and_grad(loss), meshes4).lower(ws, x).as_text("after-inline")
    assert "jit[" not in text


def test_shard_map_psum_inside_stage(meshes2):
    inner_mesh = meshes2[1]

    def fn(w, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ w)
        h = mpmdc.stage(h, 1)
        summed = jax.shard_map(
            lambda t: jax.lax.psum(t, "data"), mesh=inner_mesh, in_specs=P("data"), out_specs=P()
        )(h)
        return jnp.sum(summed**2)

    w, x = jnp.eye(8) * 0.5, jnp.arange(32.0).reshape(4, 8) / 32
    # The cotangent comes back split over mesh 0's devices, so the weight gradient's sum
    # over rows is two partial sums: noise floor 1.4e-07 relative (jax.jit against
    # jax.jit computing x @ w by row halves), margin 10x.
    assert_same_as_jit(jax.value_and_grad(fn), meshes2, w, x, rtol=1.4e-6)
    modules = mpmdc.compile(fn, meshes2).lower(w, x).stablehlo()
    assert "all_reduce" in modules["s1_fwd"]
    assert "all_reduce" not in modules["s0_fwd"]
    assert 'sdy.mesh @mesh = <["data"=2]>' in modules["s1_fwd"]


def test_a_shard_map_runs_on_the_mesh_it_was_built_for(meshes2):
    x = jnp.ones((4, 8))

    def shard_map_on_mesh0(x):
        x = mpmdc.stage(x, 1)
        return jax.shard_map(
            lambda t: t * 2, mesh=meshes2[0], in_specs=P("data"), out_specs=P("data")
        )(x)

    compiled = mpmdc.compile(shard_map_on_mesh0, meshes2)
    # The marker says stage 1 (mesh1); the shard_map takes its value to mesh0, and says so.
    with pytest.warns(
        PlacementWarning,
        match=r"shard_map at .* was built for mesh0 but reads the values of stage 1, entered at "
        r".*, whose mesh is mesh1: it runs on mesh0, .* Build it for stage 1's mesh "
        r"\(meshes\[1\], or meshes\[1\]\.abstract_mesh\)",
    ):
        program = compiled.lower(x).program("after-partition")
    (placement,) = [
        p for e, p in zip(program.jaxpr.eqns, program.placements) if e.primitive.name == "shard_map"
    ]
    assert placement.stage == 0
    with warnings.catch_warnings():  # (the call compiles what lower() made: said once)
        warnings.simplefilter("error", PlacementWarning)
        np.testing.assert_array_equal(np.asarray(compiled(x)), np.asarray(x) * 2)


def test_a_shard_map_off_its_marker_is_named_also_on_a_mesh_of_several_stages(meshes2):
    """Stages 0 and 1 share mesh0: a shard_map built for it, reading what enters stage 2
    (mesh1), is named as for a mesh of one stage."""

    def fn(x):
        h = mpmdc.stage(mpmdc.stage(x, 0) * 2, 1)
        h = mpmdc.stage(jnp.sin(h), 2)
        return jax.shard_map(
            lambda t: t * 2, mesh=meshes2[0], in_specs=P("data"), out_specs=P("data")
        )(h)

    with pytest.warns(PlacementWarning, match=r"built for mesh0 but reads the values of stage 2"):
        mpmdc.compile(fn, meshes2, stage_to_mesh=(0, 0, 1)).lower(jnp.ones((4, 8)))


def test_a_shard_map_off_its_stage_is_named_also_past_work_after_the_marker(meshes2):
    """A shard_map built for mesh0 reading stage 1's work a few operations after its
    marker (not the marked value itself) takes that work to mesh0 as well, and is named;
    one built for stage 1's mesh, reading stage 1's values and a skip connection from
    stage 0, is where its stage is and says nothing."""

    def off(x):
        h = jnp.sin(mpmdc.stage(jnp.tanh(mpmdc.stage(x, 0)), 1) * 2) + 1
        return jax.shard_map(
            lambda t: t * 2, mesh=meshes2[0], in_specs=P("data"), out_specs=P("data")
        )(h)

    with pytest.warns(
        PlacementWarning, match=r"built for mesh0 but reads the values of stage 1, entered at"
    ):
        mpmdc.compile(off, meshes2).lower(jnp.ones((4, 8)))

    def on(x):
        skip = jnp.tanh(mpmdc.stage(x, 0))
        h = jnp.sin(mpmdc.stage(skip * 3, 1)) * 2
        return jax.shard_map(
            lambda t, s: t * s, mesh=meshes2[1], in_specs=P("data"), out_specs=P("data")
        )(h, skip)

    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        mpmdc.compile(on, meshes2).lower(jnp.ones((4, 8)))
