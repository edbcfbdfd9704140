"""Control flow, remat, custom derivatives, nested jit and shard_map inside stages."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_same_as_jit, clipped_tanh, mesh_index
from jax.sharding import PartitionSpec as P

import mpmdc


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
    program = compiled.lower(x).program("after-partition")
    (placement,) = [
        p for e, p in zip(program.jaxpr.eqns, program.placements) if e.primitive.name == "shard_map"
    ]
    assert placement.stage == 0
    np.testing.assert_array_equal(np.asarray(compiled(x)), np.asarray(x) * 2)
