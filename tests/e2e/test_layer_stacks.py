"""Layer stacks written as one scan (``lax.scan``, ``nnx.scan``, Linen ``nn.scan``) and
pipelined by ``mpmdc.stage(h, every=k)`` in the scan's body, against ``jax.jit``; each
stage's rows of every stacked parameter and optimizer-state leaf live on its mesh only.

Tolerances: the global norm of ``clip_by_global_norm`` adds per-stage partial sums, and
values crossing fragments are materialized, so sums round otherwise than in one
``jax.jit`` module; Adam magnifies that over steps. The noise floor is how far ``jax.jit``
of the same steps is from itself with the microbatches in the other order: 4.8e-7 for
these models over two steps (measured on CPU, float32); each bound is ten times that.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import XlaCompiles, assert_same_tree, largest_difference, rows_by_mesh

import mpmdc
from mpmdc.errors import IdleMeshWarning, PlacementWarning, StageError
from mpmdc.ir.program import placement_of
from mpmdc.ir.traffic import CATEGORIES

LAYERS, WIDTH, MICROBATCHES = 8, 16, 4
ATOL = 5e-6  # ten times the noise floor above

TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def block(w, h):
    return h + jnp.tanh(h @ w["w1"] + w["b1"]) @ w["w2"]


def lax_params(layers=LAYERS):
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "embed": jax.random.normal(k[0], (WIDTH, WIDTH)) * 0.3,
        "layers": {
            "w1": jax.random.normal(k[1], (layers, WIDTH, WIDTH)) * 0.3,
            "b1": jnp.zeros((layers, WIDTH)),
            "w2": jax.random.normal(k[2], (layers, WIDTH, WIDTH)) * 0.3,
        },
        "head": jax.random.normal(k[3], (WIDTH, 4)) * 0.3,
    }


def lax_loss(params, x, y, every=2):
    def body(h, w):
        h = mpmdc.stage(h, every=every)
        return block(w, h), None

    h, _ = jax.lax.scan(body, x @ params["embed"], params["layers"])
    return jnp.mean((h @ params["head"] - y) ** 2)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.down = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jnp.tanh(self.up(self.norm(h))))


class NnxModel(nnx.Module):
    def __init__(self, rngs, every=2):
        self.every = every
        self.embed = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NnxBlock(rngs)

        self.blocks = create(rngs)
        self.head = nnx.Linear(WIDTH, 4, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(layer, h):
            h = mpmdc.stage(h, every=self.every)
            return layer(h)

        return self.head(run(self.blocks, self.embed(x)))  # the scan's line


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        h = mpmdc.stage(h, every=2)
        return h + nn.Dense(WIDTH)(jnp.tanh(nn.Dense(WIDTH)(nn.LayerNorm()(h)))), None


class LinenModel(nn.Module):
    layer_axis: int = 0
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        layer = nn.remat(LinenBlock) if self.remat else LinenBlock
        stack = nn.scan(
            layer,
            variable_axes={"params": self.layer_axis},
            split_rngs={"params": True},
            length=LAYERS,
        )
        h, _ = stack()(nn.Dense(WIDTH)(x), None)
        return nn.Dense(4)(h)


def nnx_setup():
    graphdef, params = nnx.split(NnxModel(nnx.Rngs(0)), nnx.Param)
    return params, lambda p, x, y: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)


def linen_setup(**model_options):
    model = LinenModel(**model_options)
    params = model.init(jax.random.key(0), jnp.ones((2, WIDTH)))
    return params, lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2)


def training_step(loss, microbatches=MICROBATCHES, schedule="1f1b"):
    def step(params, opt_state, x, y):
        def one(batch):
            return jax.value_and_grad(loss)(params, *batch)

        value, grads = mpmdc.accumulate(
            one, (x, y), microbatches=microbatches, reduce="mean", schedule=schedule
        )
        updates, opt_state = TX.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    return step


def batch():
    k = jax.random.split(jax.random.key(1))
    return jax.random.normal(k[0], (16, WIDTH)), jax.random.normal(k[1], (16, 4))


def run_steps(step, params, steps=2):
    """``steps`` training steps; returns every step's outputs."""
    state = (params, TX.init(params))
    x, y = batch()
    out = []
    for _ in range(steps):
        loss, params_, opt_state = step(*state, x, y)
        out.append((loss, params_, opt_state))
        state = (params_, opt_state)
    return out


@pytest.fixture(scope="module")
def meshes4():
    return mpmdc.make_meshes(4, {"data": 2})


SETUPS = {
    "lax.scan": lambda: (lax_params(), lax_loss),
    "nnx.scan": nnx_setup,
    "nn.scan": linen_setup,
}


@pytest.mark.parametrize(
    "kind",
    [pytest.param(k, marks=pytest.mark.slow) if k == "nn.scan" else k for k in SETUPS],
)
@pytest.mark.slow
def test_a_scanned_stack_trains_as_under_jit_with_each_stages_rows_on_its_mesh(meshes4, kind):
    params, loss = SETUPS[kind]()
    step = training_step(loss)
    got = run_steps(mpmdc.compile(step, meshes4), params)
    want = run_steps(jax.jit(step), params)
    assert largest_difference(got, want) < ATOL
    stacked = [
        leaf
        for leaf in jax.tree_util.tree_leaves(got[-1][1:])
        if leaf.ndim and leaf.shape[0] == LAYERS
    ]
    assert len(stacked) >= 3 * 3  # parameters and Adam's two moments of each
    for leaf in stacked:
        assert rows_by_mesh(leaf, meshes4) == {i: [(2 * i, 2 * i + 2)] for i in range(4)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.slow
def test_every_schedule_runs_a_scanned_stack(meshes4, schedule):
    step = training_step(lax_loss, schedule=schedule)
    got = run_steps(mpmdc.compile(step, meshes4), lax_params(), steps=1)
    want = run_steps(jax.jit(step), lax_params(), steps=1)
    assert largest_difference(got, want) < ATOL


WRAPPED = {
    "MultiSteps": lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), every_k_schedule=2
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(1e-2), max_consecutive_errors=3),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
}


def _one_ulp_toward(new, old):
    return jnp.nextafter(new, old) if jnp.issubdtype(new.dtype, jnp.floating) else new


@pytest.mark.parametrize("wrapper", list(WRAPPED))
@pytest.mark.slow
def test_a_stack_under_a_wrapping_optimizer_trains_as_under_jit(meshes4, wrapper):
    """A scanned stack trained by an optimizer that keeps state of the stack's shape
    outside the slices (``MultiSteps``' gradient sum), decides the update in one
    conditional, or scales it by per-leaf norms (``lamb``, ``adafactor``). Two steps,
    results fed back, equal ``jax.jit``'s; the stack and its state come back in
    per-stage rows (the caller's arrays, assembled from them), so the second call moves
    nothing."""
    tx = WRAPPED[wrapper]()

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(lax_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    x, y = batch()

    def run(fn, x, y, rounded_back=False):
        state = (lax_params(), tx.init(lax_params()))
        for k in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("error", PlacementWarning)
                loss, *new = fn(*state, x, y)
            if rounded_back and k == 0:  # (each result one ulp toward what it updated)
                new = jax.tree.map(_one_ulp_toward, new, list(state))
            state = new
        return loss, state

    got, want = run(mpmdc.compile(step, meshes4), x, y), run(jax.jit(step), x, y)
    # The noise floor of this example: jax.jit of the same steps with the batch's rows
    # reversed (every sum over them in another order), and with the first step's results
    # rounded one ulp the other way (a fused multiply-add or a norm summed per stage
    # rounds so; lamb and adafactor scale a whole leaf's update by a norm, so that ulp
    # moves every element alike). Measured on CPU: lamb 2.6e-5 and adafactor 1.4e-4 after
    # two steps (mpmdc: 2.4e-5, 1.6e-5); the margin is ten times.
    floor = max(
        largest_difference(run(jax.jit(step), x[::-1], y[::-1]), want),
        largest_difference(run(jax.jit(step), x, y, rounded_back=True), want),
    )
    devices = {d for m in meshes4 for d in m.devices.flat}
    layers = len(lax_params()["layers"]["w1"])
    stacked = [a for a in jax.tree_util.tree_leaves(got[1]) if a.ndim and len(a) == layers]
    # (the parameters, and MultiSteps' gradient sum of their shape)
    assert len(stacked) >= len(jax.tree_util.tree_leaves(lax_params()["layers"]))
    assert all(a.sharding.device_set == devices for a in stacked)
    assert all(isinstance(a, jax.Array) for a in jax.tree_util.tree_leaves(got))
    assert largest_difference(got, want) <= 10 * floor


def test_a_stacked_result_is_weakly_typed_where_jax_jits_is(meshes4):
    """A stacked leaf made from a Python scalar (``jnp.full(..., 0.1)``) is weakly typed,
    and so is its Adam moment after one step under ``jax.jit``: the stacked results,
    assembled from their stages' pieces, keep each leaf's weak type as ``jax.jit``'s do
    (it decides how the caller's arithmetic on them promotes, and the next call's
    types)."""
    tx = optax.adam(1e-2)

    def step(params, opt_state, x, y):
        value, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(lax_loss)(params, *mb), (x, y), microbatches=2
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    params = lax_params()
    params["layers"]["b1"] = jnp.full((LAYERS, WIDTH), 0.1)
    args = (params, tx.init(params), *batch())
    got, want = mpmdc.compile(step, meshes4)(*args), jax.jit(step)(*args)
    weak = {
        jax.tree_util.keystr(p) for p, a in jax.tree_util.tree_leaves_with_path(want) if a.weak_type
    }
    assert "[2][0].mu['layers']['b1']" in weak, weak
    assert [a.weak_type for a in jax.tree.leaves(got)] == [
        a.weak_type for a in jax.tree.leaves(want)
    ]


@pytest.mark.slow
def test_results_fed_back_move_nothing_and_compile_nothing(meshes4):
    step = mpmdc.compile(training_step(lax_loss), meshes4)
    params = lax_params()
    x, y = batch()
    _, params, opt_state = step(params, TX.init(params), x, y)
    shardings = step.input_shardings(params, opt_state, x, y)[0]
    assert jax.tree_util.tree_leaves(shardings[0]["layers"]) == [
        p.sharding for p in jax.tree_util.tree_leaves(params["layers"])
    ]
    compiled = step.cache_info().misses
    _, again, _ = step(params, opt_state, x, y)
    assert step.cache_info().misses == compiled
    assert again["layers"]["w1"].sharding == params["layers"]["w1"].sharding


@pytest.mark.slow
def test_only_the_carry_its_cotangent_and_scalars_cross_and_activations_wait_as_1f1b_says(
    meshes4,
):
    params = lax_params()
    lowered = mpmdc.compile(training_step(lax_loss), meshes4).lower(
        params, TX.init(params), *batch()
    )
    report = lowered.transfer_report()
    activation = 4 * WIDTH * 4  # a microbatch's (4, WIDTH) float32 carry
    for link in report.links:
        values, moved = link.values, link.bytes
        assert moved[0] in (0, MICROBATCHES * activation)  # activations / cotangents
        assert moved[1] <= 8 and moved[2] <= 64  # scalars: Adam's count, norm partials
        del values
    total = sum(
        int(np.prod(leaf.shape)) * 4 for leaf in jax.tree_util.tree_leaves(params["layers"])
    )
    held = report.inputs_held
    for mesh in range(4):  # each mesh holds its quarter of the stack, its moments too
        assert held[mesh] >= 3 * total // 4
    # Activations in flight as 1F1B promises: the stack's residuals wait on their stage.
    memory = lowered.compile().memory
    assert [m.peak_microbatches for m in memory] == [4, 3, 2, 1]


@pytest.mark.slow
def test_the_layer_axis_may_be_any_axis(meshes4):
    params, loss = linen_setup(layer_axis=1, remat=True)
    step = training_step(loss)
    got = run_steps(mpmdc.compile(step, meshes4), params, steps=1)
    want = run_steps(jax.jit(step), params, steps=1)
    assert largest_difference(got, want) < ATOL
    kernel = got[0][1]["params"]["ScanCheckpointLinenBlock_0"]["Dense_0"]["kernel"]
    assert kernel.shape[1] == LAYERS
    assert kernel.sharding.spec[1] == "stages"


def _mixed_meshes():
    """Two meshes of 2 devices and two of 1: meshes of different shapes."""
    devices = jax.devices()
    return [
        jax.sharding.Mesh(np.array(devices[0:2]), ("data",)),
        jax.sharding.Mesh(np.array(devices[2:4]), ("data",)),
        jax.sharding.Mesh(np.array(devices[4:5]), ("data",)),
        jax.sharding.Mesh(np.array(devices[5:6]), ("data",)),
    ]


@pytest.mark.parametrize(
    "layout,every,schedule",
    [
        ("uneven", (3, 2, 2, 1), "1f1b"),
        pytest.param(  # 8 stages on 4 meshes
            "interleaved", 1, "interleaved-1f1b", marks=pytest.mark.slow
        ),
        pytest.param("meshes of different shapes", 2, "1f1b", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_a_stack_that_cannot_be_one_array_warns_stays_whole_and_computes(
    meshes4, layout, every, schedule
):
    meshes = _mixed_meshes() if layout == "meshes of different shapes" else meshes4
    step = training_step(lambda p, x, y: lax_loss(p, x, y, every=every), schedule=schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_steps(mpmdc.compile(step, meshes), lax_params(), steps=1)
    stacks = [w for w in caught if issubclass(w.category, PlacementWarning)]
    assert len(stacks) == 1  # one warning for all the stack's arrays
    assert "a layer stack (the scan at" in str(stacks[0].message)
    assert "argument args[0]['layers']" in str(stacks[0].message)
    want = run_steps(jax.jit(step), lax_params(), steps=1)
    assert largest_difference(got, want) < ATOL
    w1 = got[0][1]["layers"]["w1"]
    assert len(rows_by_mesh(w1, meshes)) == 1  # whole, on one mesh


@pytest.mark.parametrize(
    "schedule,axis", [("interleaved-1f1b", 0), ("dualpipev", 0), ("interleaved-1f1b", 1)]
)
def test_a_stack_kept_whole_sends_each_mesh_its_stages_rows_once_per_step(meshes4, schedule, axis):
    """8 stages of one layer on 4 meshes keep the stack whole on mesh0. Each other mesh
    receives the rows of its two stages once per step, taken on mesh0 before the loop
    (the forward's and the backward's take one value): not the stack whole, and not a
    stage's rows with every microbatch. So also where the stack's layer axis is not its
    first (Linen's ``variable_axes={"params": 1}``): the scan reads it moved first."""
    layers, width = 8, 16

    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(mpmdc.stage(h, every=1) @ w), None

        return jnp.mean(jax.lax.scan(layer, x, jnp.moveaxis(ws, axis, 0))[0] ** 2)

    def step(ws, x):
        return mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss)(ws, mb), x, microbatches=layers, reduce="mean"
        )

    ws = jnp.moveaxis(jnp.full((layers, width, width), 0.1), 0, axis)
    x = jnp.sin(jnp.arange(4.0 * layers * width)).reshape(4 * layers, width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlacementWarning)  # (kept whole: said elsewhere)
        lowered = mpmdc.compile(step, meshes4, schedule=schedule).lower(ws, x)
    report = lowered.transfer_report()
    state = CATEGORIES.index("parameters/optimizer state")
    sent = {(k.src, k.dst): k.values[state] for k in report.links if k.values[state]}
    assert sent == {(0, 1): 2, (0, 2): 2, (0, 3): 2}, sent
    row = ws.nbytes // layers
    assert report.total("parameters/optimizer state") == 6 * row
    assert largest_difference(lowered.compile()(ws, x), jax.jit(step)(ws, x)) < ATOL


@pytest.mark.parametrize(
    "schedule", ["interleaved-1f1b", pytest.param("dualpipev", marks=pytest.mark.slow)]
)
def test_a_stack_kept_whole_is_updated_where_it_lives_and_only_gradient_rows_come_back(
    meshes4, schedule
):
    """The same stack, updated by Adam in the step: each other mesh receives its stages'
    rows once (the forward's and the backward's) and sends back their gradient rows
    once; the update of every row runs on mesh0 with the stack and its moments, so no
    moment's rows go out and no updated rows come back (three of each per stage)."""
    layers, width = 8, 16
    tx = optax.adam(1e-2)

    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(mpmdc.stage(h, every=1) @ w), None

        return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)

    def step(ws, opt_state, x):
        value, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss)(ws, mb), x, microbatches=layers, reduce="mean"
        )
        updates, opt_state = tx.update(grads, opt_state, ws)
        return value, optax.apply_updates(ws, updates), opt_state

    ws = 0.1 + 0.01 * jnp.sin(jnp.arange(layers * width * width)).reshape(layers, width, width)
    x = jnp.sin(jnp.arange(4.0 * layers * width)).reshape(4 * layers, width)
    args = (ws, tx.init(ws), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlacementWarning)  # (kept whole: said elsewhere)
        lowered = mpmdc.compile(step, meshes4, schedule=schedule).lower(*args)
    report = lowered.transfer_report()
    row = ws.nbytes // layers
    rows = {
        (k.src, k.dst): b // row
        for k in report.links
        if (b := k.bytes[CATEGORIES.index("parameters/optimizer state")] + k.bytes[-1]) >= row
    }
    # (two stages per mesh: their rows out, their gradients' rows back; scalars aside)
    assert rows == {(0, m): 2 for m in (1, 2, 3)} | {(m, 0): 2 for m in (1, 2, 3)}, rows
    got = lowered.compile()(*args)
    assert largest_difference(got, jax.jit(step)(*args)) < ATOL
    stacked = [a for a in jax.tree.leaves(got[1:]) if a.ndim]  # (the stack and its moments)
    assert [rows_by_mesh(a, meshes4) for a in stacked] == [{0: [(0, layers)]}] * 3


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b"])
def test_a_stack_whose_stages_all_run_on_one_mesh_stays_there_without_a_warning(meshes4, schedule):
    # Kept whole where every stage reads it, nothing moves: no PlacementWarning.
    step = training_step(lax_loss, schedule=schedule)
    params = lax_params()
    args = (params, TX.init(params), *batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        lowered = mpmdc.compile(step, meshes4[:1]).lower(*args)
    assert not lowered.transfer_report().links  # one mesh: nothing moves


def test_a_warning_about_an_nnx_scan_names_the_models_line_not_flaxs(meshes4):
    # Shapes alone: making the model's values would take most of the test's time.
    model = nnx.eval_shape(lambda: NnxModel(nnx.Rngs(0), every=(3, 2, 2, 1)))
    graphdef, params = nnx.split(model, nnx.Param)
    x = jax.ShapeDtypeStruct((4, WIDTH), jnp.float32)
    loss = lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)  # noqa: E731
    # The passes up to the one that warns: the rest would only take time.
    step = mpmdc.compile(loss, meshes4, passes="inline,split-scans,slice-stacks")
    with pytest.warns(PlacementWarning, match="a layer stack") as caught:
        step.lower(params, x)
    (message,) = [str(w.message) for w in caught if "a layer stack" in str(w.message)]
    scan_line = next(
        i for i, line in enumerate(open(__file__), 1) if line.rstrip().endswith("# the scan's line")
    )
    assert f"test_layer_stacks.py:{scan_line}:" in message, message
    assert "(NnxModel.__call__)" in message
    assert "flax" not in message


@pytest.mark.slow
def test_remat_dropout_keys_and_tensor_parallel_specs_inside_the_body():
    meshes = mpmdc.make_meshes(2, {"model": 2})
    params = lax_params(layers=4)

    def loss(params, x, y, key):
        keys = jax.random.split(key, 4)

        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_saveable)
        def body(h, layer):
            w, k = layer
            h = mpmdc.stage(h, every=2)
            keep = jax.random.bernoulli(k, 0.9, h.shape)
            return block(w, jnp.where(keep, h, 0.0) / 0.9), None

        h, _ = jax.lax.scan(body, x @ params["embed"], (params["layers"], keys))
        return jnp.mean((h @ params["head"] - y) ** 2)

    def step(params, x, y, key):
        grads = jax.grad(loss)(params, x, y, key)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    specs = jax.tree_util.tree_map(lambda _: None, params)
    specs["layers"] = {
        "w1": jax.P(None, None, "model"),
        "b1": jax.P(None, "model"),
        "w2": jax.P(None, "model"),
    }
    compiled = mpmdc.compile(step, meshes, in_specs=(specs, None, None, None))
    key = jax.random.key(3)
    got = compiled(params, *batch(), key)
    want = jax.jit(step)(params, *batch(), key)
    assert largest_difference(got, want) < ATOL
    w1 = got["layers"]["w1"]
    assert w1.sharding.spec == jax.P("stages", None, "model")


@pytest.mark.slow
def test_lowering_does_not_grow_with_depth(meshes4):
    sizes = []
    for layers in (8, 64):
        params = lax_params(layers)
        lowered = mpmdc.compile(
            training_step(lambda p, x, y, k=layers // 4: lax_loss(p, x, y, every=k)), meshes4
        ).lower(params, TX.init(params), *batch())
        program = lowered.program("after-split")
        sizes.append(
            sum(
                len(e.params["jaxpr"].jaxpr.eqns)
                for e in program.jaxpr.jaxpr.eqns
                if "jaxpr" in e.params
            )
        )
    assert sizes[0] == sizes[1]


def test_markers_that_disagree_or_nest_name_the_scan(meshes4):
    def disagreeing(w, x):
        def body(h, wi):
            h = mpmdc.stage(h, every=2)
            return mpmdc.stage(h @ wi, every=4), None

        return jax.lax.scan(body, x, w)[0].sum()

    with pytest.raises(StageError, match=r"every=2, first=0 .* and every=4, first=0"):
        mpmdc.compile(disagreeing, meshes4).lower(jnp.ones((8, 4, 4)), jnp.ones((2, 4)))

    def nested(w, x):
        def inner(h, wi):
            return mpmdc.stage(h, every=2) @ wi, None

        def outer(h, ws):
            return jax.lax.scan(inner, h, ws)[0], None

        return jax.lax.scan(outer, x, w)[0].sum()

    with pytest.raises(StageError, match="in a scan nested in the `scan`"):
        mpmdc.compile(nested, meshes4).lower(jnp.ones((2, 4, 4, 4)), jnp.ones((2, 4)))


@pytest.mark.slow
def test_a_mask_built_from_constants_is_built_on_every_mesh_not_sent(meshes4):
    """A causal mask made in the body by ``jnp.where`` (a jitted helper reading only
    constants, which JAX hoists out of the scan) is recomputed on each stage's mesh; only
    activations, cotangents and scalars cross."""

    def loss(params, x, y):
        def body(h, w):
            h = mpmdc.stage(h, every=2)
            causal = jnp.tril(jnp.ones((WIDTH, WIDTH), bool))
            scores = jnp.where(causal, h[:, :, None] * h[:, None, :], -1e30)
            return block(w, h + jax.nn.softmax(scores, axis=-1).sum(-1)), None

        h, _ = jax.lax.scan(body, x @ params["embed"], params["layers"])
        return jnp.mean((h @ params["head"] - y) ** 2)

    params = lax_params()
    step = training_step(loss)
    lowered = mpmdc.compile(step, meshes4).lower(params, TX.init(params), *batch())
    for link in lowered.transfer_report().links:
        assert link.bytes[1] <= 8 and link.bytes[2] <= 64, link
    got = run_steps(mpmdc.compile(step, meshes4), params, steps=1)
    assert largest_difference(got, run_steps(jax.jit(step), params, steps=1)) < ATOL


def test_a_shard_map_in_the_body_runs_on_each_stages_mesh():
    """A ``shard_map`` in the body of a scan that every stage runs is built for the stage
    meshes' shape (an abstract mesh) and runs on each stage's own mesh."""
    meshes = mpmdc.make_meshes(4, {"model": 2})

    def loss(ws, x):
        def body(h, w):
            h = mpmdc.stage(h, every=2)
            product = jax.shard_map(
                lambda a, b: jax.lax.psum(a @ b, "model"),
                mesh=meshes[0].abstract_mesh,
                in_specs=(jax.P(None, "model"), jax.P("model", None)),
                out_specs=jax.P(),
            )
            return jnp.tanh(product(h, w)), None

        return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    ws = jax.random.normal(jax.random.key(0), (8, 8, 8)) * 0.3
    x = jnp.ones((4, 8))
    got = mpmdc.compile(jax.value_and_grad(loss), meshes)(ws, x)
    with jax.set_mesh(meshes[0]):  # (plain jax.jit needs the mesh of an abstract shard_map)
        want = jax.jit(jax.value_and_grad(loss))(ws, x)
    assert largest_difference(got, want) == 0
    assert rows_by_mesh(got[1], meshes) == {i: [(2 * i, 2 * i + 2)] for i in range(4)}


def test_a_stack_indexed_inside_the_body_is_named_in_a_warning(meshes4):
    """Weights read as ``w[i]`` (the scan over ``arange``) cannot be cut per stage: every
    stage receives the whole stack, which a warning names with the scan's line."""

    def loss(params, x, y):
        def body(h, i):
            h = mpmdc.stage(h, every=2)
            return jnp.tanh(h @ params["layers"]["w1"][i]), None

        h, _ = jax.lax.scan(body, x @ params["embed"], jnp.arange(LAYERS))
        return jnp.mean((h @ params["head"] - y) ** 2)

    params = lax_params()
    params["layers"]["w1"] = jnp.tile(params["layers"]["w1"], (1, 8, 8))  # (8, 128, 128)
    params["embed"] = jnp.tile(params["embed"], (1, 8))
    params["head"] = jnp.tile(params["head"], (8, 1))
    with pytest.warns(PlacementWarning, match=r"reads args\[0\]\['layers'\]\['w1'\] whole"):
        mpmdc.compile(jax.grad(loss), meshes4).lower(params, *batch())


def stack_of_no_layers_loss(params, x, every=2, first=0):
    def body(h, w):
        h = mpmdc.stage(h, every=every, first=first)
        return jnp.tanh(h @ w["w"] + w["b"]), h

    h, hs = jax.lax.scan(body, x @ params["embed"], params["layers"])
    return jnp.mean(h**2) + jnp.sum(hs)


def sgd_step(loss, microbatches):
    def step(params, x):
        if microbatches is None:
            value, grads = jax.value_and_grad(loss)(params, x)
        else:
            value, grads = mpmdc.accumulate(
                lambda mb: jax.value_and_grad(loss)(params, mb),
                x,
                microbatches=microbatches,
                reduce="mean",
            )
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def no_layers():
    k = jax.random.split(jax.random.key(2))
    params = {
        "embed": jax.random.normal(k[0], (WIDTH, WIDTH)) * 0.3,
        "layers": {"w": jnp.zeros((0, WIDTH, WIDTH)), "b": jnp.zeros((0, WIDTH))},
    }
    return params, jax.random.normal(k[1], (8, WIDTH))


@pytest.mark.parametrize("microbatches", [None, 2], ids=["value_and_grad", "accumulate"])
def test_a_stack_of_no_layers_runs_whole_as_under_jit(meshes2, microbatches):
    """A scan of length 0 has no stage boundaries to cut: it stays one scan, unplaced,
    and runs where its carry lives (here with the rest of the program, in stage 0, so
    mesh 1 is idle and says so); its empty rows, their gradient and update come back as
    under ``jax.jit``."""
    step = sgd_step(stack_of_no_layers_loss, microbatches)
    params, x = no_layers()
    with pytest.warns(IdleMeshWarning, match="mesh1"):
        got = mpmdc.compile(step, meshes2)(params, x)
    assert got[1]["layers"]["w"].shape == (0, WIDTH, WIDTH)
    assert_same_tree(got, jax.jit(step)(params, x))


@pytest.mark.slow
def test_a_stack_of_no_layers_after_marked_stages_stays_in_the_stage_of_its_carry(meshes2):
    """Between marked stages, with its iterations balanced or counted: the empty scan
    has no groups to regroup and runs in the stage its carry comes from."""
    for every in (2, "balanced"):

        def loss(params, x, every=every):
            h = jnp.tanh(mpmdc.stage(x, 0) @ params["embed"])
            h = jnp.tanh(mpmdc.stage(h, 1) @ params["embed"])
            return stack_of_no_layers_loss(params, h, every=every, first=2)

        step = sgd_step(loss, 2)
        params, x = no_layers()
        compiled = mpmdc.compile(step, meshes2, partition="balanced")
        assert_same_tree(compiled(params, x), jax.jit(step)(params, x))
        placed = compiled.lower(params, x).program("after-partition")
        scans = [e for e in placed.jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert {e.params["length"] for e in scans} == {0}
        assert {placement_of(e).stage for e in scans} == {1}, every


ROW_MOMENT = 2 * WIDTH * 4  # (a stage's two rows of a factored moment, float32)
PER_STAGE = {
    # (the optimizer; its state leaves of a row per layer; the bytes of "other" values
    # a link may carry per step: scalars, and for SM3 the partial maxima of the five
    # accumulators over every layer, one per column of w1, w2 and b1)
    "adafactor": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8), 5, ROW_MOMENT - 1),
    "lamb": (lambda: optax.lamb(1e-2), 6, ROW_MOMENT - 1),
    "sm3": (lambda: optax.sm3(0.1), 6, 5 * WIDTH * 4),
    "prodigy": (lambda: optax.contrib.prodigy(1.0), 12, ROW_MOMENT - 1),
}


@pytest.mark.parametrize(
    "name, microbatches",
    [("adafactor", None), ("adafactor", 2), ("lamb", None), ("sm3", 2), ("prodigy", 2)],
)
@pytest.mark.slow
def test_an_optimizer_broadcasting_along_size_one_axes_updates_a_stack_per_stage(
    meshes4, name, microbatches
):
    """Optimizers whose update of a stacked weight broadcasts along size-1 axes, as
    ``lax`` does: Adafactor divides ``v_row`` by ``mean(v_row, -1, keepdims=True)`` and
    scales the gradient by both factored moments (a row per layer each); LAMB's
    ``jnp.where`` broadcasts a mask from ``bool[1, 1, 1]``. Each stage updates its own
    rows, reading its rows of every operand (a mask broadcast on the stage itself); the
    state comes back in the stage rows the next call reads, so that call compiles
    nothing; and besides the carry only scalars and the bias's column moment (a sum over
    every layer, so of every stage's rows) cross meshes."""
    make, stacked_leaves, other_bytes = PER_STAGE[name]
    tx = make()

    def step(params, opt_state, x, y):
        if microbatches:
            value, grads = mpmdc.accumulate(
                lambda mb: jax.value_and_grad(lax_loss)(params, *mb),
                (x, y),
                microbatches=microbatches,
            )
        else:
            value, grads = jax.value_and_grad(lax_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    params = lax_params()
    args = (params, tx.init(params), *batch())
    compiled = mpmdc.compile(step, meshes4)
    for link in compiled.lower(*args).transfer_report().links:
        assert link.bytes[CATEGORIES.index("other")] <= other_bytes, link
    got = compiled(*args)
    assert largest_difference(got, jax.jit(step)(*args)) < ATOL
    with XlaCompiles() as compiles:
        compiled(*got[1:], *batch())
    assert compiles.count == 0
    stage_rows = {m: [(2 * m, 2 * m + 2)] for m in range(4)}
    state = [a for a in jax.tree.leaves(got[2]) if a.ndim and len(a) == LAYERS]
    assert len(state) == stacked_leaves
    assert all(rows_by_mesh(a, meshes4) == stage_rows for a in state)
