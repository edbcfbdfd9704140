"""End-to-end numerics against jax.jit: MLPs, tied weights, stage graphs, pytrees."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_array, assert_same_as_jit, mesh_index

import mpmdc


def mlp_loss(params, x, y):
    for i, (w, b) in enumerate(params):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(x @ w + b)
    return jnp.mean((x - y) ** 2)


def make_params(n, width=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    return [(jax.random.normal(k, (width, width)) * 0.4, jnp.full((width,), 0.1)) for k in keys]


def data(width=8, batch=4):
    return jax.random.normal(jax.random.key(7), (batch, width)), jax.random.normal(
        jax.random.key(8), (batch, width)
    )


@pytest.mark.parametrize("n_stages,n_meshes", [(2, 2), (4, 4), (8, 4)])
def test_mlp_value_and_grad(n_stages, n_meshes):
    meshes = mpmdc.make_meshes(n_meshes, {"data": 2})
    params = make_params(n_stages)
    loss, grads = assert_same_as_jit(jax.value_and_grad(mlp_loss), meshes, params, *data())
    assert mesh_index(loss, meshes) == (n_stages - 1) % n_meshes
    for i, (gw, gb) in enumerate(grads):
        assert mesh_index(gw, meshes) == i % n_meshes
        assert mesh_index(gb, meshes) == i % n_meshes


def test_stage_to_mesh_reverses_placement(meshes4):
    params = make_params(4)
    step = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes4, stage_to_mesh=[3, 2, 1, 0])
    loss, grads = step(params, *data())
    assert mesh_index(loss, meshes4) == 0
    assert [mesh_index(g, meshes4) for g, _ in grads] == [3, 2, 1, 0]


def tied_loss(params, tokens, targets):
    emb, layers = params["embed"], params["layers"]
    x = mpmdc.stage(emb[tokens], 0)
    for i, w in enumerate(layers):
        x = mpmdc.stage(x, i) if i else x
        x = jnp.tanh(x @ w)
    x = mpmdc.stage(x, len(layers))
    logits = x @ emb.T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], axis=1))


def test_tied_embedding(meshes4):
    k = jax.random.split(jax.random.key(1), 4)
    params = {
        "embed": jax.random.normal(k[0], (16, 8)),
        "layers": [jax.random.normal(kk, (8, 8)) * 0.3 for kk in k[1:]],
    }
    tokens = jnp.array([1, 5, 7, 3])
    targets = jnp.array([2, 2, 9, 0])
    # Noise floor 8.9e-08 absolute (jax.jit of the same gradient against it op by op, whose
    # fusions round otherwise); the embedding's two gradient contributions are summed
    # across a fragment boundary, so its last bit depends on the CPU's vector width.
    # Margin ~10x.
    loss, grads = assert_same_as_jit(
        jax.value_and_grad(tied_loss), meshes4, params, tokens, targets, atol=1e-6
    )
    # the embedding lives on the first stage's mesh, so its summed gradient does too
    assert mesh_index(grads["embed"], meshes4) == 0
    assert mesh_index(loss, meshes4) == 3
    lowered = mpmdc.compile(jax.value_and_grad(tied_loss), meshes4).lower(params, tokens, targets)
    # the embedding travels to the last stage once, its gradient contribution back
    links = {(link.src, link.dst): link for link in lowered.transfer_report().links}
    assert (
        links[0, 3].bytes[1] == params["embed"].nbytes
        and links[3, 0].bytes[2] == params["embed"].nbytes
    )


def diamond(params, x):
    a = mpmdc.stage(x, 0) @ params[0]
    b = jnp.sin(mpmdc.stage(a, 1) @ params[1])
    c = jnp.cos(mpmdc.stage(a, 2) @ params[2])
    b, c = mpmdc.stage((b, c), 3)
    return jnp.sum((b * c) @ params[3])


def test_non_linear_stage_graph(meshes4):
    params = [w for w, _ in make_params(4)]
    x, _ = data()
    _loss, grads = assert_same_as_jit(jax.value_and_grad(diamond), meshes4, params, x)
    assert [mesh_index(g, meshes4) for g in grads] == [0, 1, 2, 3]


def test_pytrees_in_and_out(meshes2):
    def fn(inputs, scale):
        x = mpmdc.stage(inputs["x"], 0)
        h = x * scale[0]
        h = mpmdc.stage({"h": h, "extra": [inputs["y"], 2.0]}, 1)
        return {"out": (h["h"] + h["extra"][0], h["extra"][1]), "list": [h["h"].sum()]}

    x, y = data()
    # The sum reads h materialized: noise floor 2.0e-07 relative (jax.jit against eager),
    # margin 10x.
    assert_same_as_jit(fn, meshes2, {"x": x, "y": y}, (3.0,), rtol=2e-6)


def test_literal_and_passthrough_outputs(meshes2):
    def fn(x, y):
        z = mpmdc.stage(x, 1) * 2
        return z, 1.5, y, jnp.zeros(3)

    x, y = data()
    out = assert_same_as_jit(fn, meshes2, x, y)
    # values no stage computes live with the first stage used (here stage 1)
    assert [mesh_index(o, meshes2) for o in out] == [1, 1, 1, 1]


def test_function_without_markers(meshes4):
    params = make_params(2)

    def loss(params, x, y):
        for w, b in params:
            x = jnp.tanh(x @ w + b)
        return jnp.mean((x - y) ** 2)

    loss_value, _grads = assert_same_as_jit(jax.value_and_grad(loss), meshes4, params, *data())
    assert mesh_index(loss_value, meshes4) == 0
    lowered = mpmdc.compile(jax.value_and_grad(loss), meshes4).lower(params, *data())
    assert list(lowered.stablehlo()) == ["s0_fwd"]


def test_kwargs_and_static_args(meshes2):
    def fn(x, n, *, y):
        for i in range(n):
            x = mpmdc.stage(x, i) * y
        return x

    x, y = data()
    step = mpmdc.compile(fn, meshes2, static_argnums=1)
    out = step(x, 2, y=y)
    ref = jax.jit(fn, static_argnums=1)(x, 2, y=y)
    assert_same_array(out, ref)


def stacked_layers_loss(stacks, x):
    """The layer-stack pattern: a Python loop over stages, a scan over each stage's layers."""
    for i, stack in enumerate(stacks):
        x = mpmdc.stage(x, i)
        x, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, stack)
    return jnp.mean(x**2)


def test_a_stack_of_layers_per_stage_runs_as_one_scan_per_stage(meshes4):
    layers = jax.random.normal(jax.random.key(0), (8, 8, 8)) * 0.4
    stacks = [layers[i * 2 : (i + 1) * 2] for i in range(4)]  # 2 layers per stage
    _, grads = assert_same_as_jit(
        jax.value_and_grad(stacked_layers_loss), meshes4, stacks, data()[0]
    )
    assert [mesh_index(g, meshes4) for g in grads] == [0, 1, 2, 3]


def test_a_marker_inside_a_scan_over_layers_names_its_line_and_the_pattern_that_works(meshes2):
    def loss(layers, x):
        def layer(h, w):
            h = mpmdc.stage(h, 0)  # the marker's line is what the error names
            return jnp.tanh(h @ w), None

        return jnp.sum(jax.lax.scan(layer, x, layers)[0])

    with pytest.raises(mpmdc.errors.PlacementError) as err:
        mpmdc.compile(jax.grad(loss), meshes2).lower(jnp.ones((4, 8, 8)), jnp.ones((4, 8)))
    message = str(err.value)
    assert "test_against_jit.py" in message and "loss.<locals>.layer)" in message
    assert "mpmdc.stage(h, every=k)" in message and "one scan per stage" in message
