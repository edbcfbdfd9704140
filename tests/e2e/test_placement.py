"""Where training state lives: parameters, optimizer state and updates stay on the mesh
of the stage that uses them, and only activations, cotangents and scalars move.

Each case is an Optax optimizer on a residual model whose blocks end in a bias (Flax's
``Linear`` default), the shape that can pull bias gradients to the next stage.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_same_array, mesh_index

import mpmdc
from mpmdc.ir.primitives import transfer_p

STAGES = 4
WIDTH = 16


def init(key, stages=STAGES):
    keys = jax.random.split(key, stages)
    return [
        {"w": jax.random.normal(k, (WIDTH, WIDTH)) / 4, "b": jnp.full((WIDTH,), 0.1)} for k in keys
    ]


def residual_loss(params, x, y, l2=0.0):
    for i, p in enumerate(params):
        x = mpmdc.stage(x, i)
        x = x + jnp.tanh(x @ p["w"] + p["b"])
    penalty = sum(jnp.sum(p["w"] ** 2) for p in params)  # read by no stage's forward work
    return jnp.mean((x - y) ** 2) + l2 * penalty


def training_step(opt, microbatches=None, l2=0.0):
    def step(params, state, x, y):
        def value_and_grad(batch):
            return jax.value_and_grad(residual_loss)(params, *batch, l2)

        if microbatches:
            loss, grads = mpmdc.accumulate(
                value_and_grad, (x, y), microbatches=microbatches, reduce="mean"
            )
        else:
            loss, grads = value_and_grad((x, y))
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def batch():
    return jax.random.normal(jax.random.key(1), (8, WIDTH)), jax.random.normal(
        jax.random.key(2), (8, WIDTH)
    )


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd+clip": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
}


def stage_mesh_of_leaves(tree, params):
    """For each leaf of ``tree``: the stage index of the parameter it mirrors (optimizer
    state has the parameters' structure under its own keys), or ``None`` (a step count)."""
    where = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(params):
        where[jax.tree_util.keystr(path[-2:])] = path[0].idx
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out.append(where.get(jax.tree_util.keystr(path[-2:])) if jnp.ndim(leaf) else None)
    return out


@pytest.mark.parametrize(
    "name,microbatches",
    [("sgd+clip", None), ("adamw", None), ("clip+adamw", 4), ("sgd", 4)],
)
def test_parameters_and_optimizer_state_stay_on_their_stage_mesh(meshes4, name, microbatches):
    opt = OPTIMIZERS[name]()
    params = init(jax.random.key(0))
    state = opt.init(params)
    step = training_step(opt, microbatches)
    compiled = mpmdc.compile(step, meshes4)
    lowered = compiled.lower(params, state, *batch())
    program = lowered.program("after-split")

    leaves = len(jax.tree_util.tree_leaves((params, state)))
    expected = stage_mesh_of_leaves((params, state), params)
    assert program.in_meshes[:leaves] == program.out_meshes[:leaves]
    for k, stage in enumerate(expected):
        if stage is not None:
            assert program.in_meshes[k] == stage, (k, program.in_meshes[:leaves])

    # Nothing parameter-sized moves: only activations, cotangents and scalars.
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive is transfer_p:
            for v, carried in zip(eqn.invars, eqn.params["carries"]):
                assert carried in ("activation", "cotangent") or v.aval.size <= 1, (carried, v.aval)
    report = lowered.transfer_report()
    floor = report.total("activations/cotangents")
    assert floor == 2 * (STAGES - 1) * 8 * WIDTH * 4
    assert report.total() <= floor + 200

    got = compiled(params, state, *batch())
    want = jax.jit(step)(params, state, *batch())
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert_same_array(g, w)
    new_params = got[0]
    for i, p in enumerate(new_params):
        assert mesh_index(p["w"], meshes4) == i and mesh_index(p["b"], meshes4) == i


def test_a_penalty_on_every_parameter_is_computed_where_each_parameter_lives(meshes4):
    """An L2 term reads each parameter outside the pipeline's work: each mesh squares and
    sums its own, and only the partial sums move."""
    opt = optax.sgd(0.1)
    params = init(jax.random.key(0))
    step = training_step(opt, l2=1e-2)
    lowered = mpmdc.compile(step, meshes4).lower(params, opt.init(params), *batch())
    program = lowered.program("after-split")
    assert program.in_meshes[: 2 * STAGES] == tuple(i for i in range(STAGES) for _ in "bw")
    moved = [
        v.aval for e in program.jaxpr.jaxpr.eqns if e.primitive is transfer_p for v in e.invars
    ]
    assert all(a.shape != (WIDTH, WIDTH) for a in moved), moved


def test_the_transfer_report_counts_each_kind_of_value(meshes4):
    """A tied embedding travels once (state), its gradient contribution back (other),
    activations and cotangents once per boundary and microbatch."""

    def loss(emb, ws, tokens):
        x = mpmdc.stage(emb[tokens], 0)
        x = jnp.tanh(x @ ws[0])
        x = jnp.tanh(mpmdc.stage(x, 1) @ ws[1])
        return jnp.sum(jnp.tanh(x @ emb.T))

    emb = jnp.ones((32, WIDTH))
    ws = [jnp.eye(WIDTH)] * 2
    tokens = jnp.arange(8) % 32
    report = (
        mpmdc.compile(jax.grad(loss, argnums=(0, 1)), meshes4)
        .lower(emb, ws, tokens)
        .transfer_report()
    )
    assert [(link.src, link.dst) for link in report.links] == [(0, 1), (1, 0)]
    forward, backward = report.links
    assert forward.values == (1, 1, 0) and forward.bytes == (8 * WIDTH * 4, 32 * WIDTH * 4, 0)
    assert backward.values == (1, 0, 1) and backward.bytes == (8 * WIDTH * 4, 0, 32 * WIDTH * 4)
    embedding, weight, token_ids = 32 * WIDTH * 4, WIDTH * WIDTH * 4, 8 * 4
    assert report.inputs_held == (embedding + weight + token_ids, weight, 0, 0)
    text = report.as_text()
    assert "mesh0 -> mesh1" in text and "parameters/optimizer state B" in text


def test_a_mesh_that_runs_no_stage_is_named_in_a_warning():
    """Stages 0 and 2 on 3 meshes leave mesh1 idle every step: said once it is lowered,
    naming the mesh; a layout using every mesh says nothing."""

    def gapped(w, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ w)
        return jnp.sum(mpmdc.stage(h, 2) ** 2)

    meshes = mpmdc.make_meshes(3, {"data": 2})
    w, x = jnp.full((4, 4), 0.25), jnp.ones((4, 4))
    with pytest.warns(
        mpmdc.errors.IdleMeshWarning,
        match=r"mesh1 \{'data': 2\} runs no stage .* stages \[0\] on mesh0, \[2\] on mesh2",
    ):
        mpmdc.compile(gapped, meshes).lower(w, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpmdc.errors.IdleMeshWarning)
        mpmdc.compile(gapped, meshes[:2], stage_to_mesh=(0, 0, 1)).lower(w, x)
