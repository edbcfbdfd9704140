"""Tensor-parallel shardings survive a pipelined training step, as under ``jax.jit``.

Megatron-style weights (column-parallel ``P(None, "model")``, row-parallel
``P("model", None)``) on meshes of ``{"data": 2, "model": 2}``: a step's updated
parameters and optimizer state come back with their arguments' specs, results fed back
compile nothing, and on one mesh every output sharding equals ``jax.jit``'s.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import XlaCompiles, assert_same_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.ir.program import fragment_key

D, H, B = 8, 16, 8
SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b1": P("model")}
OPT = optax.adam(1e-2)


def _params(stages):
    keys = jax.random.split(jax.random.key(0), 2 * stages)
    return [
        {
            "w1": jax.random.normal(keys[2 * i], (D, H)) * 0.3,
            "w2": jax.random.normal(keys[2 * i + 1], (H, D)) * 0.3,
            "b1": jnp.full((H,), 0.1, jnp.float32),
        }
        for i in range(stages)
    ]


def _loss(params, x, y):
    for i, p in enumerate(params):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    return jnp.mean((x - y) ** 2)


def _step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def _batch():
    x = jax.random.normal(jax.random.key(1), (B, D))
    return x, jnp.sin(x)


def _committed(params, meshes):
    return [
        {
            k: jax.device_put(v, NamedSharding(meshes[i % len(meshes)], SPECS[k]))
            for k, v in p.items()
        }
        for i, p in enumerate(params)
    ]


def _specs_of(tree):
    return jax.tree.map(lambda a: mpmdc.ir.sharding.canonical_spec(a.sharding.spec), tree)


def _want_specs(stages):
    return [{k: mpmdc.ir.sharding.canonical_spec(s) for k, s in SPECS.items()}] * stages


@pytest.fixture(scope="module")
def tp_meshes():
    return mpmdc.make_meshes(2, {"data": 2, "model": 2})


def test_tensor_parallel_weights_and_adam_state_keep_their_specs(tp_meshes):
    params = _committed(_params(2), tp_meshes)
    opt_state = OPT.init(params)
    x, y = _batch()
    step = mpmdc.compile(_step, tp_meshes)
    loss, new_params, new_state = step(params, opt_state, x, y)
    assert _specs_of(new_params) == _want_specs(2)
    assert _specs_of(new_state[0].mu) == _want_specs(2)
    assert _specs_of(new_state[0].nu) == _want_specs(2)
    said = step.output_shardings(params, opt_state, x, y)[1]
    assert jax.tree.map(lambda s: mpmdc.ir.sharding.canonical_spec(s.spec), said) == _want_specs(2)
    # Each stage's weights stay on its own mesh, with shardings equal to the arguments'
    # (``P("model", None)`` is returned as given, as ``jax.jit`` returns it).
    for i, p in enumerate(new_params):
        for k, a in p.items():
            assert a.sharding.mesh == tp_meshes[i]
            assert a.sharding == params[i][k].sharding, (i, k, a.sharding)
    # (On one device: jax.jit cannot take arguments committed to two meshes.)
    host = jax.device_put((params, opt_state, x, y), jax.devices()[0])
    want = jax.jit(_step)(*host)
    # Noise floor 3.0e-08 absolute (jax.jit tensor-parallel on one mesh against jax.jit on
    # one device; jax.jit against eager the same), margin 10x.
    for g, w in zip(jax.tree.leaves((loss, new_params, new_state)), jax.tree.leaves(want)):
        assert_same_array(g, w, atol=3e-7)


def test_in_specs_given_come_back_as_given(tp_meshes):
    params, x, y = _params(2), *_batch()
    opt_state = OPT.init(params)
    state_specs = jax.tree.map(lambda _: None, opt_state)
    state_specs[0].mu[:] = _want_specs(2)
    step = mpmdc.compile(_step, tp_meshes, in_specs=(_want_specs(2), None, None, None))
    _, new_params, _ = step(params, opt_state, x, y)
    assert _specs_of(new_params) == _want_specs(2)


@pytest.mark.parametrize(
    "layout", ["committed", "in_specs", "uncommitted", "placed_by_recipe", "placed_by_compiled"]
)
@pytest.mark.slow
def test_a_training_loop_compiles_once(tp_meshes, layout):
    params, (x, y) = _params(2), _batch()
    in_specs = None
    if layout == "committed":
        params = _committed(params, tp_meshes)
    elif layout == "in_specs":
        in_specs = (_want_specs(2), None, None, None)
    opt_state = OPT.init(params)
    step = mpmdc.compile(_step, tp_meshes, in_specs=in_specs)
    state = (params, opt_state)
    if layout == "placed_by_recipe":
        state = jax.device_put(state, step.input_shardings(*state, x, y)[0][:2])
    elif layout == "placed_by_compiled":  # lower().compile() serves the calls, as in jax.jit
        state = jax.device_put(state, step.lower(*state, x, y).compile().input_shardings[0][:2])
    with XlaCompiles() as first:
        _, *state = step(*state, x, y)
    with XlaCompiles() as later:
        for _ in range(3):
            _, *state = step(*state, x, y)
    assert first.count == (
        0 if layout.startswith("placed") else step.lower(*state, x, y).compile().num_executables
    )
    assert later.count == 0


def test_specs_differing_in_trailing_replicated_dimensions_share_one_executable(tp_meshes):
    params = _params(2)
    opt_state = OPT.init(params)
    x, y = _batch()
    step = mpmdc.compile(_step, tp_meshes)
    short = jax.device_put(params[0]["w2"], NamedSharding(tp_meshes[0], P("model")))
    long = jax.device_put(params[0]["w2"], NamedSharding(tp_meshes[0], P("model", None)))
    step([{**params[0], "w2": short}, params[1]], opt_state, x, y)
    with XlaCompiles() as c:
        step([{**params[0], "w2": long}, params[1]], opt_state, x, y)
    assert c.count == 0


@pytest.mark.parametrize("opt_state_made", ["from_committed_params", "uncommitted"])
def test_shardings_equal_jax_jits_on_one_mesh(opt_state_made):
    """Outputs, and the inputs propagation chose (uncommitted optimizer state), are
    sharded as ``jax.jit`` shards them."""
    mesh = mpmdc.make_meshes(1, {"data": 2, "model": 2})
    params = _committed(_params(2), mesh)
    opt_state = OPT.init(params if opt_state_made == "from_committed_params" else _params(2))
    x, y = (jax.device_put(a, NamedSharding(mesh[0], P("data"))) for a in _batch())
    args = (params, opt_state, x, y)
    step = mpmdc.compile(_step, mesh)
    jitted = jax.jit(_step).lower(*args).compile()
    outputs = step(*args)
    for what, values, got, want in [
        ("output", outputs, jax.tree.map(lambda a: a.sharding, outputs), jitted.output_shardings),
        ("input", args[:2], step.input_shardings(*args)[0][:2], jitted.input_shardings[0][:2]),
    ]:
        for (path, w), g, a in zip(
            jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), jax.tree.leaves(values)
        ):
            assert g.is_equivalent_to(w, a.ndim), (what, jax.tree_util.keystr(path), g, w)


def _accumulated_step(params, opt_state, x, y):
    """``_step`` with the gradient summed over 4 microbatches by ``mpmdc.accumulate``."""
    loss, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(_loss)(params, *mb), (x, y), microbatches=4, reduce="mean"
    )
    updates, opt_state = OPT.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


@pytest.mark.slow
def test_gradients_accumulated_over_microbatches_keep_their_specs(tp_meshes):
    """The running gradient sums of a rolled loop carry the gradients' tensor-parallel
    specs from one microbatch to the next; each microbatch's fragments share one
    executable and a loop fed back compiles nothing."""
    params = _committed(_params(2), tp_meshes)
    opt_state = OPT.init(params)
    x = jax.random.normal(jax.random.key(1), (4 * B, D))
    y = jnp.sin(x)
    step = mpmdc.compile(_accumulated_step, tp_meshes)
    loss, new_params, new_state = step(params, opt_state, x, y)
    assert _specs_of(new_params) == _want_specs(2)
    assert _specs_of(new_state[0].mu) == _want_specs(2)
    compiled = step.lower(params, opt_state, x, y).compile()
    calls = [
        e
        for e in compiled.program.jaxpr.jaxpr.eqns
        if e.primitive.name == "fragment" and e.params["microbatch"] is not None
    ]
    assert len({fragment_key(e) for e in calls}) == len(calls) // 4
    with XlaCompiles() as later:
        step(new_params, new_state, x, y)
    assert later.count == 0
    host = jax.device_put((params, opt_state, x, y), jax.devices()[0])
    want = jax.jit(_accumulated_step)(*host)
    # Noise floor 3.0e-08 absolute as above (the loop adds the microbatches in jax.jit's
    # order), margin 10x.
    for g, w in zip(jax.tree.leaves((loss, new_params, new_state)), jax.tree.leaves(want)):
        assert_same_array(g, w, atol=3e-7)


def _explicit_loss(ws, x):
    for i, w in enumerate(ws):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(jnp.einsum("bd,de->be", x, w, out_sharding=P("x", None)))
    return jnp.mean(x**2)


def test_make_meshes_takes_one_axis_type_for_all_axes_or_one_per_axis():
    """As ``jax.make_mesh`` takes them: one type per axis, in the order of the axes."""
    Auto, Explicit = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
    axes = {"data": 2, "model": 2}
    assert {m.axis_types for m in mpmdc.make_meshes(2, axes)} == {(Auto, Auto)}
    assert {m.axis_types for m in mpmdc.make_meshes(2, axes, axis_types=Explicit)} == {
        (Explicit, Explicit)
    }
    mixed = mpmdc.make_meshes(2, axes, axis_types=[Explicit, Auto])
    assert {m.axis_types for m in mixed} == {(Explicit, Auto)}


def test_explicit_axes_under_the_callers_set_mesh_lower_each_fragment_on_its_own_mesh():
    # jax.make_mesh's axes are Explicit: `out_sharding=P(...)` needs a mesh in context,
    # and each fragment still lowers and runs on its own mesh's devices.
    devices = jax.devices()
    explicit = (jax.sharding.AxisType.Explicit,)
    meshes = [
        jax.make_mesh((2,), ("x",), axis_types=explicit, devices=devices[2 * i : 2 * i + 2])
        for i in range(4)
    ]
    keys = jax.random.split(jax.random.key(1), 5)
    ws = [jax.random.normal(k, (D, D)) * 0.3 for k in keys[:4]]
    x = jax.random.normal(keys[4], (B, D))
    placed_ws = [jax.device_put(w, NamedSharding(m, P(None, "x"))) for w, m in zip(ws, meshes)]
    placed_x = jax.device_put(x, NamedSharding(meshes[0], P("x")))
    step = mpmdc.compile(jax.value_and_grad(_explicit_loss), meshes)
    with jax.set_mesh(meshes[0]):
        loss, grads = step(placed_ws, placed_x)
        want_loss, want_grads = jax.jit(jax.value_and_grad(_explicit_loss))(ws, x)
    # The default bound of a compiled function against jax.jit (docs/design.md).
    assert_same_array(loss, want_loss, rtol=2e-5, atol=1e-6)
    for g, want, mesh in zip(grads, want_grads, meshes):
        assert g.sharding.device_set == set(mesh.devices.flat)
        assert_same_array(g, want, rtol=2e-5, atol=1e-6)


def _explicit_meshes(count):
    explicit = (jax.sharding.AxisType.Explicit,)
    devices = jax.devices()
    return [
        jax.make_mesh((2,), ("x",), axis_types=explicit, devices=devices[2 * i : 2 * i + 2])
        for i in range(count)
    ]


def _typed_loss(seen):
    """Megatron pairs on an Explicit axis, the row-parallel product reduced by
    ``out_sharding``; ``seen`` collects the types of the arguments as traced."""

    def loss(ws, x):
        seen.append([str(jax.typeof(a)) for a in jax.tree.leaves((ws, x))])
        for i, (w1, w2) in enumerate(ws):
            x = mpmdc.stage(x, i)
            x = jnp.matmul(jnp.tanh(x @ w1), w2, out_sharding=P())
        return jnp.mean(x**2)

    return loss


def test_explicit_arguments_are_traced_with_their_shardings_as_under_jax_jit():
    """Inside the function an argument's type holds its Explicit sharding, as under
    ``jax.jit``: the products run sharded as the types say (the numbers are jax.jit's
    bit for bit), and a product whose result would be sharded twice on one axis is
    refused, as jax.jit refuses it."""
    meshes = _explicit_meshes(2)
    keys = jax.random.split(jax.random.key(3), 5)
    ws = [
        (
            jax.random.normal(keys[2 * i], (D, H)) * 0.3,
            jax.random.normal(keys[2 * i + 1], (H, D)) * 0.3,
        )
        for i in range(2)
    ]
    x = jax.random.normal(keys[4], (B, D))
    specs = (P(None, "x"), P("x", None))

    def placed(mesh_of):
        return [
            tuple(jax.device_put(a, NamedSharding(mesh_of(i), s)) for a, s in zip(pair, specs))
            for i, pair in enumerate(ws)
        ], jax.device_put(x, NamedSharding(meshes[0], P()))

    mpmdc_types, jit_types = [], []
    with jax.set_mesh(meshes[0]):
        got = mpmdc.compile(jax.value_and_grad(_typed_loss(mpmdc_types)), meshes)(
            *placed(lambda i: meshes[i])
        )
        want = jax.jit(jax.value_and_grad(_typed_loss(jit_types)))(*placed(lambda i: meshes[0]))
    assert mpmdc_types == jit_types
    assert mpmdc_types[0][0] == "float32[8,16@x]"
    jax.tree.map(np.testing.assert_array_equal, got, want)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert g.sharding.spec == w.sharding.spec

    def ambiguous(w, x):  # a batch-sharded x times a column-sharded w: f32[8@x,16@x]
        return jnp.sum(mpmdc.stage(x, 0) @ w)

    w = jax.device_put(ws[0][0], NamedSharding(meshes[0], P(None, "x")))
    x_rows = jax.device_put(x, NamedSharding(meshes[0], P("x")))
    with jax.set_mesh(meshes[0]):
        with pytest.raises(Exception, match="illegally sharded result") as jit_refusal:
            jax.jit(ambiguous)(w, x_rows)
        with pytest.raises(type(jit_refusal.value), match="illegally sharded result"):
            mpmdc.compile(ambiguous, meshes[:1])(w, x_rows)


def test_explicit_arguments_on_meshes_of_two_shapes_are_traced_by_shape_and_dtype():
    """One trace has one abstract mesh: arguments on Explicit meshes of 2 and 4 devices
    would make every product joining them a type error, so none is typed (each traced
    replicated); the numbers are jax.jit's."""
    explicit = (jax.sharding.AxisType.Explicit,)
    devices = jax.devices()
    meshes = [
        jax.make_mesh((2,), ("x",), axis_types=explicit, devices=devices[:2]),
        jax.make_mesh((4,), ("x",), axis_types=explicit, devices=devices[4:]),
    ]
    keys = jax.random.split(jax.random.key(5), 3)
    ws = [jax.random.normal(k, (D, D)) * 0.3 for k in keys[:2]]
    x = jax.random.normal(keys[2], (B, D))
    seen = []

    def loss(ws, x):
        seen.append([str(jax.typeof(a)) for a in ws])
        for i, w in enumerate(ws):
            x = jnp.tanh(mpmdc.stage(x, i) @ w)
        return jnp.mean(x**2)

    placed = [jax.device_put(w, NamedSharding(m, P(None, "x"))) for w, m in zip(ws, meshes)]
    got = mpmdc.compile(jax.value_and_grad(loss), meshes)(placed, x)
    assert seen == [["float32[8,8]", "float32[8,8]"]]
    want = jax.jit(jax.value_and_grad(loss))(ws, x)
    # The default bound of a compiled function against jax.jit (docs/design.md).
    jax.tree.map(lambda g, w: assert_same_array(g, w, rtol=2e-5, atol=1e-6), got, want)


def test_explicit_results_fed_back_compile_nothing_and_a_batch_sharded_on_them_accumulates():
    """An accumulated step over an Explicit batch sharding (the microbatches stacked with
    their rows, not the microbatches, spread over the axis), with Adam: its results
    fed back run on the executable that made them; the numbers are jax.jit's."""
    meshes = _explicit_meshes(4)
    keys = jax.random.split(jax.random.key(4), 5)
    ws = [jax.random.normal(k, (D, D)) * 0.3 for k in keys[:4]]
    x = jax.random.normal(keys[4], (4 * B, D))

    def loss(ws, x):
        for i, w in enumerate(ws):
            x = jnp.tanh(mpmdc.stage(x, i) @ w)
        return jnp.mean(x**2)

    def step(ws, opt_state, x):
        value, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss)(ws, mb), x, microbatches=4, reduce="mean"
        )
        updates, opt_state = OPT.update(grads, opt_state, ws)
        return value, optax.apply_updates(ws, updates), opt_state

    def plain(ws, opt_state, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        updates, opt_state = OPT.update(grads, opt_state, ws)
        return value, optax.apply_updates(ws, updates), opt_state

    rows = jax.device_put(x, NamedSharding(meshes[0], P("x")))
    compiled = mpmdc.compile(step, meshes)
    opt_state = OPT.init(ws)
    with jax.set_mesh(meshes[0]):
        state = compiled(ws, opt_state, rows)[1:]
        with XlaCompiles() as later:
            got = compiled(*state, rows)
            got = compiled(*got[1:], rows)
        want = jax.jit(plain)(ws, opt_state, rows)
        for _ in range(2):
            want = jax.jit(plain)(*want[1:], rows)
    assert later.count == 0
    # The default bound of a compiled function against jax.jit (docs/design.md).
    jax.tree.map(lambda g, w: assert_same_array(g, w, rtol=2e-5, atol=1e-6), got, want)


# ------------------------------------------------- sharding constraints in the program


def _constrained_loss(sharding_of):
    """Two stages; stage 0's activation constrained (the last value before the next
    marker) to ``sharding_of(0)``, stage 1's hidden layer to ``sharding_of(1)``."""

    def loss(w0, w1, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ w0)
        h = jax.lax.with_sharding_constraint(h, sharding_of(0))
        h = mpmdc.stage(h, 1) @ w1
        h = jax.lax.with_sharding_constraint(h, sharding_of(1))
        return jnp.mean(jnp.tanh(h) ** 2)

    return loss


def test_a_sharding_constraint_runs_on_its_mesh_and_its_spec_crosses_fragments(tp_meshes):
    """A constraint's spec is the value's at a fragment boundary (the activation crosses
    split over both axes, as ``jax.jit`` keeps it), the gradients come back with the
    weights' specs as under ``jax.jit``, and a constraint's transpose runs with the
    stage of its mesh (it sat right before the next marker: its transpose was placed in
    stage 1's backward, on the wrong mesh)."""
    spec = P("data", "model")
    loss = _constrained_loss(lambda s: NamedSharding(tp_meshes[s], spec))
    keys = jax.random.split(jax.random.key(2), 3)
    w0, w1 = (jax.random.normal(k, (D, D)) * 0.5 for k in keys[:2])
    x = jax.random.normal(keys[2], (B, D))
    step = mpmdc.compile(jax.value_and_grad(loss, argnums=(0, 1)), tp_meshes)
    split = step.lower(w0, w1, x).as_text("after-split")
    assert "src_specs=(P('data', 'model'),)" in split
    got = step(w0, w1, x)
    # jax.jit on one mesh: both constraints there.
    want = jax.jit(
        jax.value_and_grad(
            _constrained_loss(lambda s: NamedSharding(tp_meshes[0], spec)), argnums=(0, 1)
        )
    )(w0, w1, x)
    # Noise floor: jax.jit against itself with the batch split over data, 6e-8; 10x.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_same_array(g, w, rtol=1e-6, atol=6e-7)
        assert _specs_of(g) == _specs_of(w)


def test_a_constraint_on_another_stages_mesh_moves_the_value_there(tp_meshes):
    """Both constraints on mesh1: the first takes stage 0's activation to mesh1 (as a
    transfer would), the second stays there; the numbers are jax.jit's."""
    loss = _constrained_loss(lambda s: NamedSharding(tp_meshes[1], P("data")))
    w0, w1 = jnp.eye(D) * 0.5, jnp.ones((D, D)) / D
    x = jnp.arange(B * D, dtype=jnp.float32).reshape(B, D) / (B * D)
    got = mpmdc.compile(loss, tp_meshes)(w0, w1, x)
    want = jax.jit(_constrained_loss(lambda s: NamedSharding(tp_meshes[0], P("data"))))(w0, w1, x)
    assert_same_array(got, want, rtol=1e-6)  # (the noise floor above)


@pytest.mark.parametrize("where", ["all devices", "inside a scan over both meshes"])
def test_a_constraint_no_stage_can_run_is_a_type_error(tp_meshes, where):
    """Devices no stage mesh has, or a mesh of one stage inside a layer stack's scan
    split over both meshes: a TypeCheckError naming the constraint and what to give."""
    w = jnp.eye(D) * 0.5
    x = jnp.ones((B, D))
    if where == "all devices":
        everywhere = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
        fn = _constrained_loss(lambda s: NamedSharding(everywhere, P("data")))
        args = (w, w, x)
    else:

        def fn(ws, x):
            def layer(h, wi):
                h = mpmdc.stage(h, every=1) @ wi
                return jax.lax.with_sharding_constraint(h, NamedSharding(tp_meshes[0], P())), None

            return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)

        args = (jnp.stack([w, w]), x)
    with pytest.raises(
        mpmdc.errors.TypeCheckError,
        match=r"with_sharding_constraint at .* but its sharding is on devices .*; give it a "
        r"sharding on that stage's mesh \(NamedSharding\(meshes\[\d\], spec\)\), or a bare "
        r"PartitionSpec under jax.set_mesh",
    ):
        mpmdc.compile(fn, tp_meshes).lower(*args)


def _stack_from_input(x):
    """A loss of 8 scanned layers in 4 stages, their weights and carry made from ``x``."""
    ws = jnp.stack([x * (0.3 + 0.1 * k) for k in range(8)])

    def layer(h, w):
        h = jnp.tanh(mpmdc.stage(h, every=2) @ w)
        return h, h * 0.5

    h, ys = jax.lax.scan(layer, x, ws)
    return jnp.sum(h + jnp.mean(ys, axis=0))


@pytest.mark.parametrize("spec", [P("x"), P(None, "x")])
def test_a_scanned_stack_on_explicit_axes_keeps_the_specs_its_types_state(spec):
    """On Explicit axes a value's type states its sharding and a fragment is lowered
    with its values typed so: each stage's scan of a stack whose carry (and weights,
    made from it) is sharded gets the spec its type states at every fragment boundary
    (the backward's carry crossed replicated, and lowering its scan failed on carry
    types that differ); the numbers are ``jax.jit``'s."""
    meshes = _explicit_meshes(2)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (4, 4)), NamedSharding(meshes[0], spec))
    with jax.set_mesh(meshes[0]):
        got = mpmdc.compile(jax.value_and_grad(_stack_from_input), meshes)(x)
        want = jax.jit(jax.value_and_grad(_stack_from_input))(x)
    # The default bound of a compiled function against jax.jit (docs/design.md).
    for g, w in zip(got, want):
        assert_same_array(g, w, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [P("x"), P(None, "x")])
def test_an_argument_given_in_specs_on_explicit_axes_is_traced_replicated_as_under_jax_jit(spec):
    """An uncommitted argument given an ``in_specs`` entry is traced replicated, as
    ``jax.jit`` traces one given ``in_shardings``, and arrives at its fragments sharded
    so: each fragment brings it to the type its body was traced with (the stack's
    backward, lowered with the argument typed sharded, failed on scan carry types that
    differ: fuzz seed 47). The numbers are ``jax.jit``'s."""
    meshes = _explicit_meshes(2)
    traced = []

    def loss(x):
        traced.append(jax.typeof(x))
        return _stack_from_input(x)

    x = jax.random.normal(jax.random.key(0), (4, 4))
    sharding = NamedSharding(meshes[0], spec)
    with jax.set_mesh(meshes[0]):
        got = mpmdc.compile(jax.value_and_grad(loss), meshes, in_specs=spec)(x)
        want = jax.jit(jax.value_and_grad(loss), in_shardings=sharding)(x)
    assert traced[0] == traced[1], traced  # mpmdc's trace, then jax.jit's
    # The default bound of a compiled function against jax.jit (docs/design.md).
    for g, w in zip(got, want):
        assert_same_array(g, w, rtol=2e-5, atol=1e-6)


def test_a_state_reduced_from_a_split_update_is_taken_as_it_comes_back(tp_meshes):
    """SM3's accumulator of each column of a column-split weight is a maximum over the
    weight's rows, so it comes back split over ``model``; created unsharded, it is
    taken so on the first call (as the result fed back for it is), and the loop
    feeding it back compiles nothing more."""
    opt = optax.sm3(0.1)
    k = jax.random.split(jax.random.key(0), 4)
    params = [
        jax.device_put(jax.random.normal(k[i], (16, 32)) / 4, NamedSharding(m, P(None, "model")))
        for i, m in enumerate(tp_meshes)
    ]
    x, y = jax.random.normal(k[2], (16, 16)), jax.random.normal(k[3], (16, 32))

    def step(p, s, x, y):
        def loss_fn(p):
            h = jnp.tanh(mpmdc.stage(x, 0) @ p[0])
            return jnp.mean((jnp.tanh(mpmdc.stage(h, 1)[:, :16] @ p[1]) - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    compiled = mpmdc.compile(step, tp_meshes)
    state = compiled(params, opt.init(params), x, y)
    taken = compiled.input_shardings(params, opt.init(params), x, y)[0][1]
    for i in range(2):
        column = state[1][0].mu[i][1]
        assert column.sharding.spec == taken[0].mu[i][1].spec == P("model"), i
    with XlaCompiles() as compiles:
        for _ in range(2):
            state = compiled(*state[:2], x, y)
    assert compiles.count == 0
