"""Property: a model whose layers are one scanned stack cut into stages
(``stage(h, every=k)``), trained by a real optimizer, matches ``jax.jit``; each stage's
rows of the stacked parameters and of their optimizer state come back on that stage's
mesh, or, where two stages share a mesh (the stack kept whole on one mesh), the stack
and its state come back whole on one mesh and no state rows leave it; and a second
call, the results fed back, moves and compiles nothing.

Drawn: 2 or 4 meshes of 2 devices, one stage on each or two (interleaved 1F1B, or on 2
meshes DualPipeV or ZB-V, the stacked leaves' layer axis first or second); 1 or 2
layers per stage; the layer
(a residual MLP, or one with a layer norm before it); what comes before and after the
stack (an embedding and a head of their own, or one matrix tied between them); the
optimizer (from SGD to optax's wrappers that keep state of the stack's shape, decide the
update in a conditional, scale it by per-leaf norms, factor its moments, keep them per
axis or take dot products over every parameter); a skip-step
guard or none; one batch or microbatches under a random schedule; the batch replicated
or split on ``data``; the first call's state uncommitted, on one device or whole on the
last mesh; the calls made under the first mesh's ``jax.set_mesh`` or not.

Tolerance: the noise floor is measured on each example, as ``jax.jit`` of the same steps
on the batch with its rows reversed (every sum over rows taken in another order) against
``jax.jit``. Each leaf may differ from ``jax.jit``'s by ten times that floor plus 1e-6
of its largest value (a float32 ulp or so of a value the reversal happened not to move;
mpmdc sums a global norm per stage, which the reversal does not reorder).
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import XlaCompiles, rows_by_mesh
from hypothesis import event, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_differential import EXAMPLES, FUZZ_SETTINGS, seeded

import mpmdc
from mpmdc.errors import PlacementWarning

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

WIDTH, OUT, ROWS = 6, 3, 8  # the width differs from every layer count drawn (2 to 16)

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(1e-2),
    "momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "adamw schedule": lambda: optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=1e-2),
    "MultiSteps": lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), every_k_schedule=2
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    # A conditional inside a conditional, and a vector of one flag per parameter.
    "MultiSteps(apply_if_finite)": lambda: optax.MultiSteps(
        optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 3),
        every_k_schedule=2,
    ),
    "lamb": lambda: optax.lamb(1e-2),
    # (Factored: its moments of a stacked weight are a row per layer and a column.)
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    # (Accumulators per axis, reshaped to broadcast against each other.)
    "sm3": lambda: optax.sm3(1e-2),
    # (A step size from dot products over every parameter, flattened.)
    "prodigy": lambda: optax.contrib.prodigy(1.0),
    "multi_transform": lambda: optax.multi_transform(
        {"stack": optax.adam(1e-2), "rest": optax.sgd(1e-2, momentum=0.9)},
        lambda params: {k: ("stack" if k == "layers" else "rest") for k in params},
    ),
}


@st.composite
def models(draw):
    """A random model and training setup, as a plain dict."""
    meshes = draw(st.sampled_from([4, 2]))
    kept_whole = draw(st.booleans())
    accumulate = kept_whole or draw(st.booleans())
    schedules = ["1f1b", "gpipe", "zb-h1"]
    if kept_whole:  # (two stages per mesh; the V schedules need 4 microbatches on 2 meshes)
        schedules = ["interleaved-1f1b"] + ["dualpipev", "zb-v"] * (meshes == 2)
    schedule = draw(st.sampled_from(schedules)) if accumulate else None
    microbatches = [4] if kept_whole and (meshes == 4 or schedule != "interleaved-1f1b") else [2, 4]
    return dict(
        meshes=meshes,
        stages=meshes * (1 + kept_whole),
        # Where the stacked leaves hold their layers (Linen's variable_axes): second,
        # read moved first, for a stack kept whole.
        layer_axis=draw(st.sampled_from([0, 1])) if kept_whole else 0,
        every=draw(st.sampled_from([1, 2])),
        norm=draw(st.booleans()),
        tied=draw(st.booleans()),
        optimizer=draw(st.sampled_from(sorted(OPTIMIZERS))),
        guard=draw(st.booleans()),
        microbatches=draw(st.sampled_from(microbatches)) if accumulate else None,
        schedule=schedule,
        split_batch=draw(st.booleans()),
        # Where the first call's state is (fed back after it), and whether the calls are
        # made under the first mesh's ``jax.set_mesh``, where a stack placed otherwise is
        # still cut into its stages' rows where it is.
        given=draw(st.sampled_from(["uncommitted", "on a device", "on the last mesh"])),
        in_context=draw(st.booleans()),
    )


def init(model, key):
    layers = model["stages"] * model["every"]
    k = jax.random.split(key, 5)
    params = {
        "embed": jax.random.normal(k[0], (WIDTH, WIDTH)) * 0.4,
        "layers": {
            "w1": jax.random.normal(k[1], (layers, WIDTH, WIDTH)) * 0.4,
            # (typed: a weakly typed leaf's moment turns strong after a step, and its new
            # type compiles the next call again, as under jax.jit)
            "b1": jnp.full((layers, WIDTH), 0.1, jnp.float32),
            "w2": jax.random.normal(k[2], (layers, WIDTH, WIDTH)) * 0.4,
        },
    }
    if model["norm"]:
        params["layers"]["scale"] = 1.0 + 0.1 * jax.random.normal(k[3], (layers, WIDTH))
    params["layers"] = jax.tree.map(
        lambda a: jnp.moveaxis(a, 0, model["layer_axis"]), params["layers"]
    )
    if not model["tied"]:
        params["head"] = jax.random.normal(k[4], (WIDTH, OUT)) * 0.4
    return params


def loss_fn(model):
    def layer(h, w):
        h = mpmdc.stage(h, every=model["every"])
        a = h
        if model["norm"]:
            a = a - a.mean(-1, keepdims=True)
            a = a * jax.lax.rsqrt((a * a).mean(-1, keepdims=True) + 1e-5) * w["scale"]
        return h + jnp.tanh(a @ w["w1"] + w["b1"]) @ w["w2"], None

    def loss(params, x, y):
        stack = jax.tree.map(lambda a: jnp.moveaxis(a, model["layer_axis"], 0), params["layers"])
        h, _ = jax.lax.scan(layer, x @ params["embed"], stack)
        head = params["embed"].T if model["tied"] else params["head"]
        return jnp.mean((h @ head - y) ** 2)

    return loss


def training_step(model):
    loss, tx = loss_fn(model), OPTIMIZERS[model["optimizer"]]()

    def step(params, opt_state, x, y):
        if model["microbatches"]:
            value, grads = mpmdc.accumulate(
                lambda mb: jax.value_and_grad(loss)(params, *mb),
                (x, y),
                microbatches=model["microbatches"],
                reduce="mean",
                schedule=model["schedule"],
            )
        else:
            value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if model["guard"]:  # skip the step on a non-finite loss
            ok = jnp.isfinite(value)
            new_params, new_state = jax.tree.map(
                lambda new, old: jnp.where(ok, new, old),
                (new_params, new_state),
                (params, opt_state),
            )
        return value, new_params, new_state

    return step, tx


def run(fn, state, x, y, steps=2):
    for _ in range(steps):
        loss, *state = fn(*state, x, y)
    return loss, state


def within_noise(got, want, floor):
    """Each leaf of ``got`` within ten times the noise floor's difference plus 1e-6 of
    its largest value, of ``want``'s."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)]
    leaves = (jax.tree.leaves(t) for t in (got, want, floor))
    for path, g, w, f in zip(paths, *leaves, strict=True):
        g, w, f = (np.asarray(a, np.float64) for a in (g, w, f))
        bound = 10 * np.max(np.abs(f - w), initial=0) + 1e-6 * np.max(np.abs(w), initial=0)
        difference = np.max(np.abs(g - w), initial=0)
        assert difference <= bound, (path, difference, bound)


def _stacked(leaf, model) -> bool:
    """Whether ``leaf`` is a stacked parameter's or a state of its shape."""
    axis = model["layer_axis"]
    return leaf.ndim > axis and leaf.shape[axis] == model["stages"] * model["every"]


def check_kept_whole(model, compiled, meshes, state, x, y, stacked):
    """The stack and its state whole on one mesh, and no state rows leaving it: the
    parameters and optimizer state sent per step are at most the stacked parameters'
    rows of the stages off that mesh (once: a stage's forward, backward and update read
    one take) and what else the step reads, once to each other mesh."""
    homes = {tuple(rows_by_mesh(leaf, meshes)) for leaf in stacked}
    assert len(homes) == 1 and len(homes.pop()) == 1, homes
    whole = [a for a in jax.tree.leaves(state) if _stacked(a, model)]
    rows = sum(a.nbytes for a in jax.tree.leaves(state[0]["layers"]))
    rest = sum(a.nbytes for a in jax.tree.leaves(state)) - sum(a.nbytes for a in whole)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlacementWarning)  # (kept whole: meant)
        report = compiled.lower(*state, x, y).transfer_report()
    off_home = rows * (model["meshes"] - 1) // model["meshes"]
    scalars = 64 * 4 * model["meshes"]  # (a step count, partial norms: a few per mesh)
    bound = off_home + rest * (model["meshes"] - 1) + scalars
    assert report.total("parameters/optimizer state") <= bound, (report.as_text(), bound)


@seeded
@settings(max_examples=max(EXAMPLES // 6, 10), **FUZZ_SETTINGS)
@given(models())
def test_a_layer_stack_trains_as_under_jit_with_each_stages_rows_on_its_mesh(model):
    for name, value in model.items():
        event(f"{name}={value}")
    meshes = mpmdc.make_meshes(model["meshes"], {"data": 2})
    step, tx = training_step(model)
    params = init(model, jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (ROWS, WIDTH))
    y = jax.random.normal(ky, (ROWS, WIDTH if model["tied"] else OUT))
    batch = jax.sharding.PartitionSpec("data") if model["split_batch"] else None
    compiled = mpmdc.compile(step, meshes, in_specs=(None, None, batch, batch))

    state = (params, tx.init(params))
    where = {
        "uncommitted": None,
        "on a device": jax.devices()[0],
        "on the last mesh": NamedSharding(meshes[-1], P()),
    }[model["given"]]
    given = state if where is None else jax.device_put(state, where)
    context = (lambda: jax.set_mesh(meshes[0])) if model["in_context"] else contextlib.nullcontext
    with context():
        got = run(compiled, given, x, y)
    want = run(jax.jit(step), state, x, y)
    floor = run(jax.jit(step), state, x[::-1], y[::-1])
    within_noise(got, want, floor)
    assert [a.weak_type for a in jax.tree.leaves(got)] == [
        a.weak_type for a in jax.tree.leaves(want)
    ]

    stacked = [a for a in jax.tree.leaves(got[1]) if _stacked(a, model)]
    assert len(stacked) >= len(params["layers"])
    if model["stages"] > model["meshes"]:
        check_kept_whole(model, compiled, meshes, state, x, y, stacked)
    else:
        for leaf in stacked:  # the parameters, and the state of their shape
            assert rows_by_mesh(leaf, meshes) == {
                m: [(m * model["every"], (m + 1) * model["every"])] for m in range(model["meshes"])
            }

    misses = compiled.cache_info().misses
    with warnings.catch_warnings(), context(), XlaCompiles() as compiles:
        warnings.simplefilter("error", PlacementWarning)
        again = compiled(*got[1], x, y)
    assert compiled.cache_info().misses == misses
    assert compiles.count == 0  # (nothing to cut or move into place either)
    for new, old in zip(jax.tree.leaves(again), jax.tree.leaves((got[0], *got[1]))):
        assert new.sharding == old.sharding
