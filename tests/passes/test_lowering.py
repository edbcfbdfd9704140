"""StableHLO per fragment: platforms, Shardy shardings from in_specs, mixed mesh shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_as_jit, mesh_index
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import mpmdc


def two_stage(params, x, y):
    h = jnp.tanh(mpmdc.stage(x, 0) @ params[0])
    h = jnp.tanh(mpmdc.stage(h, 1) @ params[1])
    return jnp.mean((h - y) ** 2)


def args():
    k = jax.random.split(jax.random.key(0), 4)
    return (
        [jax.random.normal(k[0], (8, 8)), jax.random.normal(k[1], (8, 8))],
        jax.random.normal(k[2], (4, 8)),
        jax.random.normal(k[3], (4, 8)),
    )


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu"])
def test_stablehlo_for_every_platform(meshes2, platform):
    lowered = mpmdc.compile(jax.value_and_grad(two_stage), meshes2).lower(*args())
    modules = lowered.stablehlo(platform=platform)
    assert set(modules) == {"s0_fwd", "s1_fwd", "s0_bwd"}
    for name, text in modules.items():
        assert text.startswith(f"module @jit_{name}")
        assert 'sdy.mesh @mesh = <["data"=2]>' in text


def test_in_specs_show_as_sdy_sharding(meshes2):
    in_specs = ([P(), P()], P("data"), P("data"))
    step = mpmdc.compile(jax.value_and_grad(two_stage), meshes2, in_specs=in_specs)
    modules = step.lower(*args()).stablehlo()
    batch_sharded = '#sdy.sharding<@mesh, [{"data"}, {}]>'
    assert batch_sharded in modules["s0_fwd"]  # x on mesh 0
    assert batch_sharded in modules["s1_fwd"]  # y on mesh 1
    # Noise floor 4.8e-07 absolute (jax.jit with x and y split over data against jax.jit),
    # margin 10x.
    _loss, _grads = assert_same_as_jit(
        jax.value_and_grad(two_stage),
        meshes2,
        *args(),
        atol=5e-6,
        compile_kwargs={"in_specs": in_specs},
    )


def test_out_specs_shard_outputs(meshes2):
    def fn(x):
        return mpmdc.stage(x, 1) * 2

    x = jnp.arange(32.0).reshape(4, 8)
    out = mpmdc.compile(fn, meshes2, out_specs=P("data"))(x)
    assert out.sharding.spec == P("data")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)


def test_meshes_of_different_shapes():
    devices = jax.devices()
    small = Mesh(np.array(devices[:2]), ("data",))
    big = Mesh(np.array(devices[2:6]).reshape(2, 2), ("data", "model"))
    params, x, y = args()
    in_specs = ([P(), P(None, "model")], P("data"), P("data"))
    # Noise floor 2.4e-07 absolute (jax.jit with the same shardings on the 2x2 mesh against
    # jax.jit), margin 10x.
    _loss, grads = assert_same_as_jit(
        jax.value_and_grad(two_stage),
        [small, big],
        params,
        x,
        y,
        atol=2.4e-6,
        compile_kwargs={"in_specs": in_specs},
    )
    assert mesh_index(grads[1], [small, big]) == 1
    modules = (
        mpmdc.compile(jax.value_and_grad(two_stage), [small, big], in_specs=in_specs)
        .lower(params, x, y)
        .stablehlo()
    )
    assert 'sdy.mesh @mesh = <["data"=2]>' in modules["s0_fwd"]
    assert 'sdy.mesh @mesh = <["data"=2, "model"=2]>' in modules["s1_fwd"]
    assert '[{}, {"model"}]' in modules["s1_fwd"]
