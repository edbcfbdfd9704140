"""An argument's own sharding is its default ``in_spec``; where arguments and outputs live."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import XlaCompiles, assert_same_array, assert_same_tree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmdc


def two_stage(w, x):
    h = jnp.tanh(mpmdc.stage(x, 0) @ w)
    return jnp.sum(mpmdc.stage(h, 1) ** 2)


W = jnp.eye(8) * 0.5
X = jnp.arange(32.0).reshape(4, 8) / 32


def batch_spec(lowered):
    return lowered.program("after-split").in_specs[1] or P()


def test_a_committed_arrays_sharding_is_its_default_in_spec(meshes2):
    x = jax.device_put(X, NamedSharding(meshes2[0], P("data")))
    step = mpmdc.compile(jax.value_and_grad(two_stage), meshes2)
    assert batch_spec(step.lower(W, x)) == P("data")
    assert batch_spec(step.lower(W, X)) == P()  # an uncommitted array: replicated
    # A ShapeDtypeStruct's sharding counts the same.
    typed = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(meshes2[1], P("data")))
    assert batch_spec(step.lower(W, typed)) == P("data")
    got = step(W, x)
    for g, w in zip(
        jax.tree_util.tree_leaves(got),
        jax.tree_util.tree_leaves(jax.jit(jax.value_and_grad(two_stage))(W, X)),
    ):
        # Noise floor 1.2e-07 relative (jax.jit with x split over data against jax.jit),
        # margin 10x.
        assert_same_array(g, w, rtol=1.2e-6)
    # The call cache keys on the sharding: a replicated call compiles its own executable.
    (_, x_sharding) = step.input_shardings(W, x)[0]
    (_, replicated) = step.input_shardings(W, X)[0]
    assert x_sharding.spec == P("data") and replicated.spec == P()


def test_in_specs_override_the_arguments_sharding(meshes2):
    x = jax.device_put(X, NamedSharding(meshes2[0], P("data")))
    step = mpmdc.compile(two_stage, meshes2, in_specs=(None, P()))
    # None is "not given": the argument's own sharding stays the default...
    assert batch_spec(mpmdc.compile(two_stage, meshes2, in_specs=(None, None)).lower(W, x)) == P(
        "data"
    )
    # ...an explicit spec wins.
    assert batch_spec(step.lower(W, x)) == P()


def test_a_committed_sharding_is_kept_where_the_mesh_reading_it_has_its_axes():
    """Meshes of different axes (a stage without tensor parallelism): an argument's own
    spec is its default where the mesh reading it has the spec's axes (the batch split
    over ``data`` on mesh0), and none where it lacks them (``w`` committed split over
    ``model`` on mesh1, read on mesh0: moved there, laid out as its computation gives)."""
    devices = jax.devices()
    meshes = [
        jax.sharding.Mesh(devices[:2], ("data",)),
        jax.sharding.Mesh(np.array(devices[2:6]).reshape(2, 2), ("data", "model")),
    ]
    x = jax.device_put(X, NamedSharding(meshes[0], P("data")))
    w = jax.device_put(W, NamedSharding(meshes[1], P("model")))
    step = mpmdc.compile(two_stage, meshes)
    assert step.lower(w, x).program("after-split").in_specs == (P(), P("data"))
    # Read on mesh1, whose axes it names, a committed tensor-parallel weight keeps its spec.
    second = mpmdc.compile(lambda x, w: two_stage(W, x) + jnp.sum(mpmdc.stage(x, 1) @ w), meshes)
    w1 = jax.device_put(W, NamedSharding(meshes[1], P(None, "model")))
    assert second.lower(x, w1).program("after-split").in_specs[1] == P(None, "model")
    # Noise floor as above: 1.2e-07 relative (x split over data against jax.jit), 10x.
    assert_same_array(step(w, x), jax.jit(two_stage)(W, X), rtol=1.2e-6)
    assert_same_array(second(x, w1), jax.jit(second.fn)(X, W), rtol=1.2e-6)


def test_outputs_fed_back_need_no_moving(meshes2):
    """A training loop's parameters come back where they went in."""

    def step(w, x):
        loss, g = jax.value_and_grad(two_stage)(w, x)
        return w - 0.1 * g, loss

    compiled = mpmdc.compile(step, meshes2)
    (w_in, _), _ = compiled.input_shardings(W, X)
    w_out, loss_out = compiled.output_shardings(W, X)
    assert w_in == w_out
    assert loss_out.mesh == meshes2[1]


def test_out_shardings_say_where_results_live(meshes2):
    def step(w, x):
        loss, g = jax.value_and_grad(two_stage)(w, x)
        return w - 0.1 * g, loss

    x = jax.device_put(X, NamedSharding(meshes2[0], P("data")))
    wanted = (None, NamedSharding(meshes2[0], P()))  # the loss next to the first stage
    compiled = mpmdc.compile(step, meshes2, out_shardings=wanted)
    w_new, loss = compiled(W, x)
    assert loss.sharding.mesh == meshes2[0] and compiled.output_shardings(W, x)[1] == wanted[1]
    # Noise floor 1.4e-07 relative (jax.jit with x split over data against jax.jit), margin 10x.
    for g, want in zip((w_new, loss), jax.jit(step)(W, X)):
        assert_same_array(g, want, rtol=1.4e-6)
    # A result fed back can be asked to live with its input, sharded as it is.
    sharded = mpmdc.compile(lambda x: mpmdc.stage(x, 1) * 2, meshes2, out_shardings=x.sharding)
    out = sharded(x)
    assert out.sharding == x.sharding


def test_a_result_fed_back_with_out_shardings_gives_its_input_that_spec(meshes2):
    """A parameter whose update the caller asks for sharded comes in sharded so on the
    first call too, so a training loop compiles once (``jax.jit`` compiles twice); its
    momentum, created unsharded, takes the parameter's spec (not its gradient's)."""

    def step(params, state, x):
        loss, g = jax.value_and_grad(lambda p: two_stage(p["w"], x))(params)
        m = 0.9 * state["mu"] + g["w"]  # (as optax keeps it: its own place, .mu)
        return {"w": params["w"] - 0.1 * m}, {"mu": m}, loss

    for spec in (P("data"), P(None, "data")):
        wanted = ({"w": NamedSharding(meshes2[0], spec)}, None, None)
        compiled = mpmdc.compile(step, meshes2, out_shardings=wanted)
        args = ({"w": W}, {"mu": jnp.zeros_like(W)}, X)
        (w_in, m_in, _), _ = compiled.input_shardings(*args)
        assert w_in == wanted[0] and m_in["mu"] == wanted[0]["w"]
        got, want, compiles = args[:2], args[:2], []
        for _ in range(3):
            with XlaCompiles() as c:
                *got, loss = compiled(*got, X)
            compiles.append(c.count)
            *want, want_loss = jax.jit(step)(*want, X)
        assert compiles[1:] == [0, 0], compiles  # (the first may find executables made)
        assert got[0]["w"].sharding == got[1]["mu"].sharding == wanted[0]["w"]
        # Noise floor 1.4e-07 relative (jax.jit with w split over data against jax.jit,
        # 3 steps: 7e-08 on w, 1.4e-07 on the loss), margin 10x.
        assert_same_tree((got, loss), (want, want_loss), rtol=1.4e-6)


def test_out_shardings_off_the_meshes_are_named(meshes2):
    other = jax.sharding.Mesh(jax.devices()[4:6], ("data",))
    with pytest.raises(
        mpmdc.errors.SpecError,
        match=r"out_shardings for out\[1\].*not a NamedSharding on one of the 2 meshes",
    ):
        mpmdc.compile(
            lambda x: (x, x * 2), meshes2, out_shardings=(None, NamedSharding(other, P()))
        ).lower(X)
    with pytest.raises(
        mpmdc.errors.SpecError,
        match=r"out_shardings for out is P\(\), which is not a NamedSharding",
    ):
        mpmdc.compile(lambda x: x * 2, meshes2, out_shardings=P()).lower(X)


def test_in_specs_may_leave_static_arguments_out_as_jax_jit_does(meshes2):
    def scaled(w, scale, x):
        return two_stage(w, x) * scale

    with_static = mpmdc.compile(scaled, meshes2, static_argnums=1, in_specs=(None, None, P("data")))
    without = mpmdc.compile(scaled, meshes2, static_argnums=1, in_specs=(None, P("data")))
    assert with_static.lower(W, 2.0, X).program("after-split").in_specs[1] == P("data")
    assert without.lower(W, 2.0, X).program("after-split").in_specs[1] == P("data")
    assert_same_array(without(W, 2.0, X), jax.jit(scaled, static_argnums=1)(W, 2.0, X))
    with pytest.raises(
        mpmdc.errors.SpecError,
        match=r"one entry per argument \(or one per non-static argument, 2\)",
    ):
        mpmdc.compile(scaled, meshes2, static_argnums=1, in_specs=(P("data"),)).lower(W, 2.0, X)
    # The executable from lower() has its static arguments fixed: passing one again is named.
    executable = without.lower(W, 2.0, X).compile()
    with pytest.raises(mpmdc.errors.ArgumentError, match="static arguments were fixed by lower"):
        executable(W, 2.0, X)


def test_adams_moments_take_their_parameters_out_shardings_spec(meshes4):
    """Adam's moments created unsharded take the spec their parameter is given by
    ``out_shardings`` (rows over ``data``), not the one their gradient's computation
    gives them (the columns)."""
    k = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(k[i], (16, 16)) / 4 for i in range(4)]
    x, y = jax.random.normal(k[4], (8, 16)), jax.random.normal(k[5], (8, 16))
    opt = optax.adam(1e-2)

    def loss_fn(ps, x, y):
        for i, w in enumerate(ps):
            x = jnp.tanh(mpmdc.stage(x, i) @ w)
        return jnp.mean((x - y) ** 2)

    def step(ps, s, x, y):
        loss, g = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss_fn)(ps, *mb), (x, y), microbatches=2
        )
        updates, s = opt.update(g, s, ps)
        return optax.apply_updates(ps, updates), s, loss

    rows = [NamedSharding(m, P("data", None)) for m in meshes4]
    compiled = mpmdc.compile(step, meshes4, out_shardings=(rows, None, None))
    got = compiled(params, opt.init(params), x, y)
    want = jax.jit(step)(params, opt.init(params), x, y)
    for i in range(4):
        assert got[0][i].sharding == rows[i]
        assert got[1][0].mu[i].sharding == got[1][0].nu[i].sharding == rows[i], i
    # Noise floor 1.9e-07 of each leaf's largest value (jax.jit with x split over data
    # against jax.jit; Adam divides tiny gradients by their own size), margin 10x.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_same_array(g, w, atol=2e-6 * float(jnp.max(jnp.abs(w))))
