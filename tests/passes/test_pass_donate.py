"""The ``donate`` pass (``mpmdc.passes.donate``) on small hand-written programs.

What it promises: each fragment's ``donate_argnums`` names the donated program inputs
it reads last, and only those a result of it can take over, so XLA aliases them and
JAX never warns that a donated buffer was not usable.
"""

import warnings

import jax
import jax.numpy as jnp
from helpers import fragments, scheduled
from mpmdc.passes import donate, lower

import mpmdc

X = jnp.arange(64.0).reshape(8, 8) / 64
W = jnp.eye(8) * 0.5


def test_a_donated_input_is_donated_by_its_last_reader_only(meshes2):
    def loss(w, x):
        a = jnp.tanh(mpmdc.stage(x, 0) @ w)
        return jnp.sum(jnp.sin(mpmdc.stage(a, 1)) ** 2)

    def sgd(w, x):  # w is read by stage 0's forward and by its backward (the update)
        return w - 0.1 * jax.grad(loss)(w, x)

    program = scheduled(sgd, meshes2, W, X, donate_argnums=0)
    assert program.donated == (True, False)
    w = program.jaxpr.jaxpr.invars[0]
    readers = [f.params["name"] for f in fragments(program) if w in f.invars]
    assert readers == ["s0_fwd", "s0_bwd"]
    out = lower(donate(program))
    donated = {f.params["name"]: f.params["donate_argnums"] for f in fragments(out)}
    s0_bwd = fragments(out)[-1]
    assert donated == {"s0_fwd": (), "s1_fwd": (), "s0_bwd": (s0_bwd.invars.index(w),)}
    # The module of s0_bwd aliases that argument to a result; no other module donates.
    modules = dict(out.modules)
    assert "tf.aliasing_output" in modules["s0_bwd"]
    assert not any("tf.aliasing_output" in modules[name] for name in ("s0_fwd", "s1_fwd"))


def test_only_an_input_a_result_can_take_over_is_donated(meshes2):
    """A donated input whose last reader makes no result of its shape, dtype and spec
    is not donated there: XLA could not reuse its buffer and JAX would warn."""

    def step(w, n, x):  # n (an int counter) is read last where only floats are made
        loss = jnp.sum(mpmdc.stage(jnp.tanh(mpmdc.stage(x, 0) @ w), 1) * n)
        return loss, w * 2

    program = scheduled(step, meshes2, W, jnp.int32(3), X, donate_argnums=(0, 1))
    out = lower(donate(program))
    n = program.jaxpr.jaxpr.invars[1]
    for f in fragments(out):
        donated = [f.invars[k] for k in f.params["donate_argnums"]]
        assert n not in donated, f.params["name"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable"
        mpmdc.compile(step, meshes2, donate_argnums=(0, 1))(W * 1, jnp.int32(3), X)
