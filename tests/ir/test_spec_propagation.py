"""Batch sharding carried from the inputs to intermediate values (``mpmdc.ir.spec_rules``)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.ir.primitives import fragment_p
from mpmdc.ir.spec_rules import propagate_specs


def specs_of(fn, in_specs, *args):
    """Spec of each output of ``fn`` (``P()`` where replicated)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = propagate_specs(jaxpr, in_specs)
    return [found.get(v, P()) for v in jaxpr.outvars]


X = jnp.ones((8, 6, 4))
W = jnp.ones((4, 5))


def test_rules_keep_the_batch_dimension_and_drop_reduced_ones():
    def fn(x, w):
        h = jnp.tanh(x @ w)  # dot_general free dimension, elementwise
        flat = h.reshape(48, 5)  # leading dimension merged
        back = flat.reshape(8, 6, 5)  # and split again
        return (
            h,
            flat,
            back,
            h.sum(axis=0),  # reduced: loses the axis
            h.sum(axis=2),  # kept
            jnp.transpose(h, (1, 0, 2)),  # moves with its dimension
            h[2:6],  # slice keeps it (fit_spec later checks divisibility)
            jnp.einsum("btd,bsd->bts", h, h),  # batch dimension of dot_general
            jnp.broadcast_to(h[None], (3, 8, 6, 5)),
            jnp.zeros((8, 6, 5)) + 1.0,  # nothing sharded flows in
        )

    got = specs_of(fn, [P("data"), None], X, W)
    assert got == [
        P("data", None, None),
        P("data", None),
        P("data", None, None),
        P(),
        P("data", None),
        P(None, "data", None),
        P("data", None, None),
        P("data", None, None),
        P(None, "data", None, None),
        P(),
    ]


def test_a_gather_follows_its_indices_and_a_shard_map_its_out_specs():
    mesh = mpmdc.make_meshes(1, {"data": 2})[0]
    table = jnp.ones((16, 4))
    tokens = jnp.zeros((8, 3), jnp.int32)

    def fn(table, tokens):
        looked_up = table[tokens]
        summed = jax.shard_map(
            lambda t: jax.lax.psum(t, "data"), mesh=mesh, in_specs=P(), out_specs=P()
        )(table)
        return looked_up, summed

    assert specs_of(fn, [None, P("data")], table, tokens) == [P("data", None, None), P()]


def test_a_column_sharded_weight_shards_the_features():
    got = specs_of(lambda x, w: (jnp.tanh(x @ w), (x @ w).T), [None, P(None, "model")], X[0], W)
    assert got == [P(None, "model"), P("model", None)]


def mlp_step(params, x):
    def per_microbatch(mb):
        def loss(params):
            h = jnp.tanh(mpmdc.stage(mb, 0) @ params["w0"])
            h = mpmdc.stage(h, 1)
            return jnp.mean((h @ params["w1"]) ** 2)

        return jax.value_and_grad(loss)(params)

    return mpmdc.accumulate(per_microbatch, x, microbatches=2, schedule="1f1b")


def test_activations_of_a_batch_sharded_pipeline_stay_sharded_and_match_jax_jit(meshes2):
    rng = np.random.default_rng(0)
    params = {
        "w0": jnp.asarray(rng.normal(size=(6, 8)), jnp.float32),
        "w1": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)
    compiled = mpmdc.compile(mlp_step, meshes2, in_specs=(None, P("data")))
    program = compiled.lower(params, x).program("after-schedule")
    crossing = {}
    for eqn in program.jaxpr.eqns:
        if eqn.primitive is fragment_p and eqn.params["kind"] == "F" and eqn.params["stage"] == 0:
            for v, spec in zip(eqn.outvars, eqn.params["out_specs"]):
                crossing[v.aval.shape] = spec
    # The stage-0 activation sent to stage 1 keeps the batch sharding of its microbatch.
    assert crossing[(4, 8)] == P("data")
    got = compiled(params, x)
    want = jax.jit(mlp_step)(params, x)
    # Noise floor 9.5e-07 absolute (jax.jit against eager; 2.4e-07 against jax.jit with x
    # split over data), margin 10x.
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-5)


def test_loops_and_branches_carry_the_batch_sharding_through():
    def fn(x, w):
        def layer(h, w):
            h = jnp.tanh(h @ w)
            return h, h * 2  # the carry, and a stacked residual

        h, residuals = jax.lax.scan(layer, x, jnp.stack([w, w, w]))
        looped = jax.lax.fori_loop(0, 3, lambda i, h: jnp.sin(h), h)
        branched = jax.lax.cond(h.sum() > 0, jnp.cos, lambda h: h * 0.5, h)
        zeros = jax.lax.scan(lambda c, _: (c + 1.0, c), jnp.zeros((8, 5)), None, length=2)
        return h, residuals, looped, branched, zeros[0], zeros[1]

    got = specs_of(fn, [P("data"), None], jnp.ones((8, 5)), jnp.ones((5, 5)))
    assert got == [
        P("data", None),
        P(None, "data", None),  # each iteration's slice sharded, the loop dimension not
        P("data", None),
        P("data", None),
        P(),  # nothing sharded flows in
        P(),
    ]


def test_a_carry_unsharded_at_first_takes_the_spec_each_iteration_gives_it():
    def fn(x, w):
        def layer(carry, w):
            h, acc = carry
            h = jnp.tanh(h @ w)
            return (h, acc + h), None

        return jax.lax.scan(layer, (x, jnp.zeros((8, 5))), jnp.stack([w, w]))[0][1]

    assert specs_of(fn, [P("data"), None], jnp.ones((8, 5)), jnp.ones((5, 5))) == [P("data", None)]


def scanned_loss(ws, x):
    def layer(h, w):
        h = mpmdc.stage(h, every=2)
        return jnp.tanh(h @ w) + h, None

    return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)


def test_a_split_layer_scans_residuals_stay_batch_sharded_without_collectives():
    """Each stage's forward scan stacks its residuals sharded as the activations are:
    no compiled module gathers anything (XLA would insert an all-gather per residual
    returned replicated); only the weights' gradients are summed over the batch."""
    meshes = mpmdc.make_meshes(4, {"data": 2})
    ws = jax.random.normal(jax.random.key(0), (8, 16, 16)) * 0.2
    x = jax.device_put(
        jax.random.normal(jax.random.key(1), (8, 16)),
        jax.sharding.NamedSharding(meshes[0], P("data")),
    )
    step = mpmdc.compile(jax.value_and_grad(scanned_loss), meshes)
    compiled = step.lower(ws, x).compile()
    texts = [executable.as_text() for executable in compiled._engine.executables.values()]
    assert sum(text.count("all-gather(") for text in texts) == 0
    assert any("all-reduce(" in text for text in texts)  # (the count sees collectives)
    # Noise floor 2.4e-07 absolute (jax.jit against eager), margin ~10x.
    got, want = compiled(ws, x), jax.jit(jax.value_and_grad(scanned_loss))(ws, x)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6)


def test_a_free_input_takes_the_spec_its_update_wants_through_a_skip_step_cond():
    """A parameter given no spec, updated by a batch-sharded gradient inside a skip-step
    ``cond`` (returned as is by one branch, updated by the other) or inside a jitted
    helper, takes the gradient's spec, so its new value comes back with the spec it
    went in with."""

    def update(p, g):
        return p - 0.1 * g

    def fn(p, x, q):
        g = jnp.tanh(x)  # sharded on the batch, as a gradient of batch-sharded work is
        skipped = jax.lax.cond(jnp.isfinite(g.sum()), update, lambda p, g: p, p, g)
        return skipped, jax.jit(update)(q, g)

    jaxpr = jax.make_jaxpr(fn)(X, X, X).jaxpr
    found = propagate_specs(jaxpr, [None, P("data"), None])
    p, _, q = jaxpr.invars
    assert found[p] == found[q] == P("data", None, None)
    assert [found.get(v, P()) for v in jaxpr.outvars] == [P("data", None, None)] * 2


def test_elementwise_work_keeps_every_axis_its_operands_shard():
    """A moment sharded over two axes updated by a gradient sharded over one keeps both;
    axes in conflict go to the first operand, also an axis the operands put on different
    dimensions (no mix of the two)."""

    def fn(mu, g):
        return jnp.sin(0.9 * mu + 0.1 * g), jnp.sin(g + mu)

    def sums(in_specs):  # the specs of the two sums (the results take their inputs')
        jaxpr = jax.make_jaxpr(fn)(W @ W.T, W @ W.T).jaxpr
        found = propagate_specs(jaxpr, in_specs)
        return [found.get(e.outvars[0], P()) for e in jaxpr.eqns if e.primitive.name == "add"]

    assert sums([P("fsdp", "tp"), P(None, "tp")]) == [P("fsdp", "tp"), P("fsdp", "tp")]
    assert sums([P(None, "d"), P("d", None)]) == [P(None, "d"), P("d", None)]


def test_free_inputs_choose_until_none_gains_a_spec():
    """A free parameter added to a batch-sharded value is sharded like it; its gradient
    then is, and the free momentum it meets takes that spec too, whatever order the
    inputs come in."""

    def fn(m, p, x):
        y = p + x  # what shards p
        g = jnp.sin(p)  # sharded once p's spec is chosen
        m = 0.9 * m + g
        return y, p - 0.1 * m, m

    jaxpr = jax.make_jaxpr(fn)(X, X, X).jaxpr
    found = propagate_specs(jaxpr, [None, None, P("data")])
    m, p, _ = jaxpr.invars
    assert found[m] == found[p] == P("data", None, None)


def test_an_update_of_an_input_comes_back_with_the_inputs_spec():
    """A state and a parameter updated by a gradient split otherwise (optax's order: the
    gradient first) come back with the specs they went in with, also through a
    skip-step ``cond``; a result that updates no input keeps its computed spec."""

    def fn(m, x, p):
        g = jnp.sin(x)  # a gradient, sharded as the batch it comes from
        m = 0.1 * g + 0.9 * m
        p = jax.lax.cond(jnp.all(jnp.isfinite(g)), lambda: p - 0.1 * m, lambda: p)
        return m, p, x * 2.0

    specs = [P(None, "b"), P("a", None), P(None, "b")]
    assert specs_of(fn, specs, W @ W.T, W @ W.T, W @ W.T) == [
        P(None, "b"),
        P(None, "b"),
        P("a", None),
    ]


def test_state_created_unsharded_takes_its_parameters_spec():
    """A momentum given no spec (zeros made by the optimizer's ``init``) takes the spec of
    the parameter whose update reads it, not its gradient's (FSDP keeps its optimizer
    state sharded), also for Adam's two moments."""

    def fn(p, m, v, x):
        g = jnp.sin(x)  # a gradient, split otherwise than its parameter
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        return p - 0.1 * m / (jnp.sqrt(v) + 1e-8), m, v

    jaxpr = jax.make_jaxpr(fn)(W @ W.T, W @ W.T, W @ W.T, W @ W.T).jaxpr
    found = propagate_specs(jaxpr, [P("fsdp", "tp"), None, None, P(None, "fsdp")])
    p, m, v, _ = jaxpr.invars
    assert found[m] == found[v] == found[p] == P("fsdp", "tp")
    assert [found[o] for o in jaxpr.outvars] == [P("fsdp", "tp")] * 3
