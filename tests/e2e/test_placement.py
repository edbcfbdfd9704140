"""Where training state lives: parameters, optimizer state and updates stay on the mesh
of the stage that uses them, and only activations, cotangents and scalars move.

Each case is an Optax optimizer on a residual model whose blocks end in a bias (Flax's
``Linear`` default), the shape that can pull bias gradients to the next stage.
"""

import math
import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_same_array, assert_same_tree, mesh_index, mlp_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.errors import PlacementWarning
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
    # factored second moments: a weight's `v` and a bias's `v_row`/`v_col` are (1,)
    # placeholders that nothing reads, yet must stay with their parameter
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    # a scalar second moment per parameter (the squared norm of its gradient), made from
    # the gradient where it lives: only the scalar may move, and it lives there too
    "novograd": lambda: optax.novograd(1e-2),
}


def stage_mesh_of_leaves(tree, params):
    """For each leaf of ``tree``: the stage index of the parameter it mirrors (optimizer
    state has the parameters' structure under its own keys, of their shapes or not), or
    ``None`` (a step count)."""
    where = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(params):
        where[jax.tree_util.keystr(path[-2:])] = path[0].idx
    return [
        where.get(jax.tree_util.keystr(path[-2:]))
        for path, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]


@pytest.mark.parametrize(
    "name,microbatches",
    [
        ("sgd+clip", None),
        ("adamw", None),
        ("clip+adamw", 4),
        ("sgd", 4),
        ("adafactor", None),
        ("novograd", None),
        ("novograd", 4),
    ],
)
@pytest.mark.slow
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


def _sgd_step(ws, x):
    grads = jax.grad(mlp_loss)(ws, x)
    return [w - 0.1 * g for w, g in zip(ws, grads)]


def test_a_skip_connections_cotangent_summed_before_its_crossing_counts_as_a_cotangent():
    """``h0`` enters stage 1 and, beside stage 1's result, stage 2: its two cotangents
    are summed where placement puts the sum (stage 1's backward) and the sum crosses to
    stage 0. It is a cotangent crossing a marker, the floor pipelining pays, not "other"."""
    meshes = mpmdc.make_meshes(3, {"data": 2})

    def loss(p, x):
        h0 = jnp.tanh(mpmdc.stage(x, 0) @ p[0])
        h1 = jnp.tanh(mpmdc.stage(h0, 1) @ p[1])
        h2, skip = mpmdc.stage((h1, h0), 2)
        return jnp.mean((jnp.tanh(h2 @ p[2]) + skip) ** 2)

    p, x = [jnp.eye(8) * 0.5] * 3, jnp.ones((16, 8))
    report = mpmdc.compile(jax.grad(loss), meshes).lower(p, x).transfer_report()
    activation = 16 * 8 * 4
    assert report.total("other") == 0
    assert report.total("activations/cotangents") == 6 * activation


def test_an_argument_on_another_mesh_is_counted_in_the_report_and_named_once(meshes4):
    """A parameter committed to another mesh than the one that reads it is moved before
    every call: the transfer report counts it, a warning names it once, the numbers
    stay ``jax.jit``'s; fed back where the step returned it, it moves nothing."""
    step = mpmdc.compile(_sgd_step, meshes4)
    ws = [jnp.eye(WIDTH) / 2] * STAGES
    x = jnp.ones((8, WIDTH))
    ws = step(ws, x)
    elsewhere = list(ws)
    elsewhere[2] = jax.device_put(ws[2], NamedSharding(meshes4[1], P()))
    report = step.lower(elsewhere, x).transfer_report()
    size = WIDTH * WIDTH * 4
    (move,) = report.arguments
    assert (move.path, move.src, move.dst, move.bytes) == ("args[0][2]", 1, 2, size)
    link = next(link for link in report.links if (link.src, link.dst) == (1, 2))
    assert link.bytes[1] == size  # parameters/optimizer state
    assert "args[0][2]: mesh1 -> mesh2" in report.as_text()
    assert step.lower(ws, x).transfer_report().arguments == ()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(elsewhere, x)
        step(elsewhere, x)
        step(ws, x)
    moved = [w for w in caught if issubclass(w.category, PlacementWarning)]
    assert len(moved) == 1, [str(w.message) for w in moved]
    message = str(moved[0].message)
    assert "argument args[0][2] is on mesh1, but the program reads it on mesh2" in message
    assert "input_shardings" in message and "pass what the step returned" in message
    assert moved[0].filename == __file__
    assert mesh_index(got[2], meshes4) == 2
    host = [np.asarray(w) for w in ws]  # jax.jit takes arrays of one device set
    for g, want in zip(got, jax.jit(_sgd_step)(host, x)):
        assert_same_array(g, want)


def test_an_argument_on_devices_no_one_mesh_holds_is_counted_and_named_once(meshes4):
    """A parameter replicated over every device (spread over all the meshes) is moved
    before every call too: the report names it, where it is and its bytes, and counts
    them in the totals (on no link, as no one mesh sends it); a warning names it once."""
    step = mpmdc.compile(_sgd_step, meshes4)
    ws = [jnp.eye(WIDTH) / 2] * STAGES
    x = jnp.ones((8, WIDTH))
    everywhere = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    spread = list(ws)
    spread[1] = jax.device_put(ws[1], NamedSharding(everywhere, P()))
    report = step.lower(spread, x).transfer_report()
    size = WIDTH * WIDTH * 4
    (move,) = report.arguments
    assert (move.path, move.src, move.dst, move.bytes) == ("args[0][1]", None, 1, size)
    ids = sorted(d.id for d in jax.devices())
    assert f"args[0][1]: devices {ids} -> mesh1, {size} B" in report.as_text()
    unmoved = step.lower(ws, x).transfer_report()
    assert report.links == unmoved.links
    state = "parameters/optimizer state"
    assert report.total(state) == unmoved.total(state) + size
    assert report.total() == unmoved.total() + size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(spread, x)
        step(spread, x)
    moved = [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]
    assert len(moved) == 1 and f"argument args[0][1] is on devices {ids}" in moved[0], moved
    for g, want in zip(got, step(ws, x)):
        assert_same_array(g, want)


def test_an_argument_on_part_of_the_mesh_reading_it_is_named_with_both_device_sets(meshes4):
    """A parameter on one device of the mesh that reads it (two devices): the warning
    says which devices it is on and which the program reads it on, not "on mesh1 ...
    reads it on mesh1"; the transfer report lists it so too, and one on part of another
    mesh, as the warning counts them."""
    step = mpmdc.compile(_sgd_step, meshes4)
    ws = [jnp.eye(WIDTH) / 2] * STAGES
    both = sorted(d.id for d in meshes4[1].devices.flat)
    one = both[1:]
    part = list(ws)
    part[1] = jax.device_put(ws[1], jax.devices()[one[0]])
    part[2] = jax.device_put(ws[2], jax.devices()[one[0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(part, jnp.ones((8, WIDTH)))
    (moved,) = [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]
    assert (
        f"args[0][1] is on devices {one} (part of mesh1), read on mesh1 (devices {both})"
    ) in moved
    assert f"args[0][2] is on devices {one} (part of mesh1), read on mesh2" in moved
    report = step.lower(part, jnp.ones((8, WIDTH))).transfer_report()
    assert [(a.path, a.source, a.dst) for a in report.arguments] == [
        ("args[0][1]", f"devices {one}", 1),
        ("args[0][2]", f"devices {one}", 2),
    ]


def stack_sgd_step(w, x):
    """An SGD step on a scanned stack of ``tanh`` layers, two per stage."""

    def loss(w):
        def layer(h, wi):
            return jnp.tanh(mpmdc.stage(h, every=2) @ wi), None

        return jnp.mean(jax.lax.scan(layer, x, w)[0] ** 2)

    return w - 0.1 * jax.grad(loss)(w)


def test_a_stacked_parameter_fed_back_is_not_reported_as_moved():
    """A layer stack's stacked weights, as the step returns them (one array over all the
    stage meshes, each stage's rows on its own mesh), are handed over as pieces that
    move nothing: the report counts no argument moved, as for the first call."""
    meshes = mpmdc.make_meshes(2, {"data": 2})

    compiled = mpmdc.compile(stack_sgd_step, meshes)
    w = jnp.full((4, WIDTH, WIDTH), 0.1)
    x = jnp.ones((8, WIDTH))
    fed_back = compiled(w, x)
    report = compiled.lower(fed_back, x).transfer_report()
    assert report.arguments == ()
    assert report.total("parameters/optimizer state") == 0
    assert report.as_text() == compiled.lower(w, x).transfer_report().as_text()


def test_an_uncommitted_stack_under_the_callers_set_mesh_is_placed_without_a_warning():
    """An uncommitted array is JAX's to place: cut into its stages' rows under a caller's
    ``jax.set_mesh`` (where slicing commits the rows to that mesh), its pieces are placed
    on their meshes as outside it, without a warning, and the numbers are ``jax.jit``'s."""
    meshes = mpmdc.make_meshes(2, {"data": 4})

    compiled = mpmdc.compile(stack_sgd_step, meshes, in_specs=(P(), P("data")))
    w = jnp.full((4, WIDTH, WIDTH), 0.1)
    x = jnp.ones((8, WIDTH))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        with jax.set_mesh(meshes[0]):
            got = compiled(w, x)
        assert_same_array(got, jax.jit(stack_sgd_step)(w, x))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_a_committed_stack_is_cut_into_its_stages_rows_under_the_callers_set_mesh(axis_type):
    """A committed stack not in the step's own layout (returned by a step on 4 meshes,
    whole on one device, whole on the other mesh) is cut into its stages' rows under a
    caller's ``jax.set_mesh`` as outside it: the cut runs where the stack is, not on the
    context mesh, which JAX would refuse. The numbers are ``jax.jit``'s."""

    def step(w, x, every=4):
        def loss(w):
            def layer(h, wi):
                return jnp.tanh(mpmdc.stage(h, every=every) @ wi), None

            return jnp.mean(jax.lax.scan(layer, x, w)[0] ** 2)

        return w - 0.1 * jax.grad(loss)(w)

    kind = getattr(jax.sharding.AxisType, axis_type)
    devices = jax.devices()
    meshes = [
        jax.make_mesh((4,), ("data",), axis_types=(kind,), devices=devices[4 * i : 4 * i + 4])
        for i in range(2)
    ]
    compiled = mpmdc.compile(step, meshes)
    w = jnp.full((8, WIDTH, WIDTH), 0.1)
    x = jnp.ones((8, WIDTH))
    from_four = mpmdc.compile(partial(step, every=2), mpmdc.make_meshes(4, {"data": 2}))(w, x)
    assert from_four.sharding.spec == P("stages")
    for stack in (
        from_four,
        jax.device_put(w, devices[0]),
        jax.device_put(w, NamedSharding(meshes[1], P())),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlacementWarning)  # (moved: said elsewhere)
            with jax.set_mesh(meshes[0]):
                got = compiled(stack, x)
        assert got.sharding.spec == P("stages")
        assert_same_array(got, jax.jit(step)(stack, x))


def test_a_stack_from_another_layout_is_reported_moved_piece_by_piece():
    """The stacked weights a step on 2 meshes returned (rows 0:4 on devices 0-3), read
    by a step on 4 meshes (rows 0:2 on mesh0, devices 0-1): each piece is moved before
    every call, and the report names each with the devices holding its rows."""

    def loss(w, x, every):
        def layer(h, wi):
            return jnp.tanh(mpmdc.stage(h, every=every) @ wi), None

        return jnp.mean(jax.lax.scan(layer, x, w)[0] ** 2)

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x, 4)

    w = jnp.full((8, WIDTH, WIDTH), 0.1)
    x = jnp.ones((8, WIDTH))
    from_two = mpmdc.compile(step, mpmdc.make_meshes(2, {"data": 4}))(w, x)
    four = mpmdc.compile(lambda w, x: loss(w, x, 2), mpmdc.make_meshes(4, {"data": 2}))
    report = four.lower(from_two, x).transfer_report()
    piece = WIDTH * WIDTH * 2 * 4
    assert [(m.path, m.source, m.dst, m.bytes) for m in report.arguments] == [
        ("args[0][0:2]", "devices [0, 1, 2, 3]", 0, piece),
        ("args[0][2:4]", "devices [0, 1, 2, 3]", 1, piece),
        ("args[0][4:6]", "devices [4, 5, 6, 7]", 2, piece),
        ("args[0][6:8]", "devices [4, 5, 6, 7]", 3, piece),
    ]
    assert report.total("parameters/optimizer state") == 4 * piece
    # The warning names each piece where the report does: by the devices holding its rows.
    with pytest.warns(mpmdc.errors.PlacementWarning, match="4 arguments are not where") as caught:
        four(from_two, x)
    assert (
        "args[0][0:2] is on devices [0, 1, 2, 3], read on mesh0 (devices [0, 1]); "
        "args[0][2:4] is on devices [0, 1, 2, 3], read on mesh1 (devices [2, 3]); "
        "args[0][4:6] is on devices [4, 5, 6, 7], read on mesh2"
    ) in str(caught[0].message)
    assert f"({4 * piece} bytes)" in str(caught[0].message)
    # Rows on one mesh, read on another (the stages placed in reverse): moved on that link.
    meshes = four.meshes
    from_four = mpmdc.compile(lambda w, x: w - 0.1 * jax.grad(loss)(w, x, 2), meshes)(w, x)
    reverse = mpmdc.compile(lambda w, x: loss(w, x, 2), meshes, stage_to_mesh=(3, 2, 1, 0))
    report = reverse.lower(from_four, x).transfer_report()
    assert [(m.source, m.dst) for m in report.arguments] == [
        ("mesh0", 3),
        ("mesh1", 2),
        ("mesh2", 1),
        ("mesh3", 0),
    ]
    links = {(link.src, link.dst): link.bytes[1] for link in report.links}
    assert links[(0, 3)] == links[(3, 0)] == piece
    assert (
        mpmdc.compile(lambda w, x: loss(w, x, 2), meshes)
        .lower(from_four, x)
        .transfer_report()
        .arguments
        == ()
    )


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
        mpmdc.compile(lambda x: x, meshes).lower(x)  # (no work at all: nothing idles)


def test_a_marked_stage_whose_work_a_shard_map_takes_elsewhere_is_named_at_the_users_line():
    """A shard_map built for mesh1 right after stage 0's marker runs in stage 1 (a
    shard_map's mesh places it), leaving mesh0 idle: the warning names stage 0's marker
    and the cause, and points at the user's line, not mpmdc's."""
    meshes = mpmdc.make_meshes(2, {"data": 2})

    def loss(w, x):
        h = mpmdc.stage(x, 0)
        h = jax.shard_map(
            lambda h, w: jnp.tanh(h @ w),
            mesh=meshes[1],
            in_specs=(P("data"), P()),
            out_specs=P("data"),
        )(h, w)
        return jnp.mean(mpmdc.stage(h, 1) ** 2)

    w, x = jnp.full((4, 4), 0.25), jnp.ones((4, 4))
    with pytest.warns(mpmdc.errors.IdleMeshWarning) as caught:
        mpmdc.compile(loss, meshes).lower(w, x)
    (warning,) = [w for w in caught if w.category is mpmdc.errors.IdleMeshWarning]
    # The cause is named on its own too, at the shard_map.
    (cause,) = [str(w.message) for w in caught if w.category is PlacementWarning]
    assert "was built for mesh1 but reads the values of stage 0, entered at" in cause
    assert re.search(
        r"mesh0 .* runs no stage .* Stage 0 is marked for it \(at .*test_placement.py:\d+:\d+ "
        r"\(.*loss\)\), .* build it with meshes\[0\]",
        str(warning.message),
    )
    assert warning.filename == __file__


VOCAB = 32
BEFORE_FIRST_MARKER = {
    "lookup alone": lambda p, x: x,
    "scaled by sqrt(d)": lambda p, x: x * jnp.sqrt(WIDTH).astype(x.dtype),
    "cast down and up": lambda p, x: x.astype(jnp.bfloat16).astype(jnp.float32),
    "a learned position embedding added": lambda p, x: x + p["position"],
    "normalized with a learned scale": lambda p, x: (
        x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1 + p["scale"])
    ),
}


@pytest.mark.parametrize("before", list(BEFORE_FIRST_MARKER))
@pytest.mark.slow
def test_a_tied_embedding_lives_updates_and_returns_where_the_lookup_is(meshes4, before):
    """An embedding the first stage looks up and the last stage reads again as the output
    projection (a tied weight, as in Gemma, T5 or PaLM), whatever elementwise work sits
    between the lookup and the first marker: its summed gradient, its Adam moments, its
    update and the returned value all live on mesh 0, where the next call reads it."""
    transform = BEFORE_FIRST_MARKER[before]

    def loss(p, tokens):
        x = transform(p, p["embed"][tokens])
        for i, w in enumerate(p["blocks"]):
            x = mpmdc.stage(x, i)
            x = x + jnp.tanh(x @ w)
        logits = x @ p["embed"].T
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens))

    opt = optax.adamw(1e-2)

    def step(p, state, tokens):
        value, grads = jax.value_and_grad(loss)(p, tokens)
        updates, state = opt.update(grads, state, p)
        return value, optax.apply_updates(p, updates), state

    keys = jax.random.split(jax.random.key(0), STAGES + 1)
    params = {
        "embed": jax.random.normal(keys[0], (VOCAB, WIDTH)),
        "position": jnp.zeros((6, WIDTH)),
        "scale": jnp.zeros((WIDTH,)),
        "blocks": [jax.random.normal(k, (WIDTH, WIDTH)) / 4 for k in keys[1:]],
    }
    tokens = jnp.arange(48).reshape(8, 6) % VOCAB
    state = opt.init(params)
    compiled = mpmdc.compile(step, meshes4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpmdc.errors.PlacementWarning)
        got = compiled(params, state, tokens)
        again = compiled(*got[1:], tokens)  # fed back: nothing to move
    want = jax.jit(step)(params, state, tokens)
    # The logits' cotangent reaches the embedding from two fragments, summed in another
    # order than in one module: docs/design.md's bound for any compiled function against
    # jax.jit (float32 noise floor 2.5e-7 relative; measured here up to 1e-7).
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert_same_array(g, w, rtol=2e-5, atol=1e-6)
    _, new_params, new_state = again
    assert mesh_index(new_params["embed"], meshes4) == 0
    assert mesh_index(new_state[0].mu["embed"], meshes4) == 0
    assert mesh_index(new_state[0].nu["embed"], meshes4) == 0
    wanted = compiled.input_shardings(*again[1:], tokens)[0]
    assert wanted[0]["embed"] == new_params["embed"].sharding
    lowered = compiled.lower(params, state, tokens)
    report = lowered.transfer_report()
    # The embedding goes to the last stage once (its gradient contribution comes back as
    # "other"); besides, only AdamW's scalars (the step count, its bias corrections) move.
    assert report.total("parameters/optimizer state") <= VOCAB * WIDTH * 4 + 256


@pytest.mark.parametrize("scanned", [False, True], ids=["per-layer", "scanned"])
@pytest.mark.slow
def test_masks_and_position_tables_from_each_microbatchs_tokens_are_built_where_used(
    meshes4, scanned
):
    """An attention mask and a rotary position table computed from each microbatch's tokens
    (padding and a causal band, positions counted past the padding), read by every stage:
    each stage's mesh builds them from the tokens' small boolean, which alone crosses, per
    microbatch. Under a scanned stack JAX hoists them out of the loop; so too."""
    length, vocab = 8, 16

    def layer(w, h, keep, sin, cos):
        scores = jnp.einsum("bqd,bkd->bqk", h * cos + h * sin, h)
        probs = jax.nn.softmax(jnp.where(keep, scores, -1e30), axis=-1)
        return h + jnp.tanh(jnp.einsum("bqk,bkd->bqd", probs, h) @ w)

    def loss(p, tokens):
        real = tokens != 0
        keep = real[:, None, :] & jnp.tril(jnp.ones((length, length), bool))
        positions = jnp.cumsum(real, axis=1)
        angles = positions[..., None] * (0.5 ** jnp.arange(WIDTH))
        sin, cos = jnp.sin(angles), jnp.cos(angles)
        h = p["embed"][tokens]
        if scanned:

            def body(h, w):
                h = mpmdc.stage(h, every=1)
                return layer(w, h, keep, sin, cos), None

            h, _ = jax.lax.scan(body, h, p["layers"])
        else:
            for i in range(STAGES):
                h = layer(p["layers"][i], mpmdc.stage(h, i), keep, sin, cos)
        return jnp.mean((h @ p["head"]) ** 2)

    def step(p, tokens):
        value, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss)(p, mb), tokens, microbatches=2, reduce="mean"
        )
        return value, jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    keys = jax.random.split(jax.random.key(0), 3)
    layers = jax.random.normal(keys[1], (STAGES, WIDTH, WIDTH)) / 4
    params = {
        "embed": jax.random.normal(keys[0], (vocab, WIDTH)),
        "layers": layers if scanned else list(layers),
        "head": jax.random.normal(keys[2], (WIDTH, 4)),
    }
    tokens = jax.random.randint(jax.random.key(3), (8, length), 0, vocab)
    lowered = mpmdc.compile(step, meshes4).lower(params, tokens)
    program = lowered.program("after-schedule")
    microbatch = (4, length)
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive is transfer_p:
            for v, carried in zip(eqn.invars, eqn.params["carries"]):
                if carried not in ("activation", "cotangent"):
                    assert v.aval.size <= math.prod(microbatch), (carried, v.aval)
    report = lowered.transfer_report()
    assert report.total("other") <= report.total("activations/cotangents") / 8
    # The cotangents cross fragments and are summed in another order than in one module:
    # docs/design.md's bound for any compiled function against jax.jit.
    got = mpmdc.compile(step, meshes4)(params, tokens)
    want = jax.jit(step)(params, tokens)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert_same_array(g, w, rtol=2e-5, atol=1e-6)


def test_a_parameter_whose_gradient_comes_from_a_later_stage_returns_where_it_is_read(meshes4):
    """A parameter stage 0 reads for a side result (it lives there, its first user) whose
    gradient comes from stage 1 only: its update runs on stage 0's mesh, where the next
    call reads it, and only the gradient moves; returned on stage 1's mesh, it would be
    moved back at every call."""

    def loss(w, x):
        side = jnp.tanh(mpmdc.stage(w, 0) @ x)
        return jnp.sum((mpmdc.stage(w + w, 1) @ x) ** 2), side

    def step(w, momentum, x):
        (value, side), grad = jax.value_and_grad(loss, has_aux=True)(w, x)
        momentum = 0.9 * momentum + grad
        return value, side, w - 0.1 * momentum, momentum

    args = (jnp.full((4, 4), 0.5), jnp.zeros((4, 4)), jnp.ones((4, 4)))
    program = mpmdc.compile(step, meshes4[:2]).lower(*args).program("after-split")
    assert program.out_meshes[2:] == program.in_meshes[:2]  # w and its momentum
    got = mpmdc.compile(step, meshes4[:2])(*args)
    for g, w in zip(got, jax.jit(step)(*args)):
        assert_same_array(g, w)


def test_an_update_in_a_skip_step_conditional_returns_where_its_parameter_is_read(meshes4):
    """A weight stage 0 reads for a metric (it lives there, its first user) and stage 1
    for the loss, updated in a skip-step conditional that clips by a global norm computed
    inside it: the conditional becomes selects, and the weight's select runs where the
    next call reads the weight, not on stage 1's mesh with the predicate and the
    gradient, from where every call would move it back first."""

    def loss(p, x):
        x = mpmdc.stage(x, 0)
        metric = jnp.sum(x @ p["w"])
        h = mpmdc.stage(jnp.tanh(x @ p["v"]), 1)
        return jnp.sum(jnp.tanh(h @ p["w"]) ** 2), metric

    def step(p, state, x):
        (value, metric), grads = jax.value_and_grad(loss, has_aux=True)(p, x)

        def update(p, state):
            norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
            scale = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
            mu = jax.tree.map(lambda m, g: 0.9 * m + scale * g, state["mu"], grads)
            return jax.tree.map(lambda w, m: w - 0.1 * m, p, mu), {"mu": mu}

        p, state = jax.lax.cond(jnp.isfinite(value), update, lambda p, s: (p, s), p, state)
        return value, metric, p, state

    k = jax.random.split(jax.random.key(0), 3)
    p = {"v": jax.random.normal(k[0], (4, 4)), "w": jax.random.normal(k[1], (4, 4))}
    state = {"mu": jax.tree.map(jnp.zeros_like, p)}
    x = jax.random.normal(k[2], (4, 4))
    compiled = mpmdc.compile(step, meshes4[:2])
    program = compiled.lower(p, state, x).program("after-split")
    assert program.out_meshes[2:] == program.in_meshes[:4]  # the weights, their momenta
    got, want = (p, state), (p, state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        for _ in range(2):
            *_, got_p, got_s = compiled(*got, x)
            got = (got_p, got_s)
            *_, want_p, want_s = jax.jit(step)(*want, x)
            want = (want_p, want_s)
    # The global norm is summed per mesh, then across: 1.1e-7 relative from jax.jit
    # here, where jax.jit summing the squares of all gradients at once instead of per
    # leaf is 5.3e-7 from itself; the bound is ten times that floor.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_same_array(g, w, rtol=5.3e-6)


@pytest.mark.parametrize("returns", ["a tuple", "the parameters"])
def test_a_parameter_read_on_two_meshes_returns_from_the_loop_where_it_lives(meshes4, returns):
    """Stages 0 and 2 on mesh 0, stage 1 on mesh 1. ``w`` is read first by stage 1 (it
    lives on mesh 1) and differentiated in stage 2 (its gradient is made on mesh 0);
    its update after the microbatch loop, in a skip-step ``where``, runs on mesh 1,
    where the next call reads it: the work after the loop moves between meshes by a
    minimum cut of the bytes each step moves, and ``w`` is read on both meshes, so a
    new value tied to every mesh reading ``w`` would cost the same made on either.
    A step returning its parameters as they came in (not in a tuple) is the same."""

    def step(p, x):
        def grad(xb):
            def loss(p):
                h = mpmdc.stage(xb, 0) @ p["v"]
                h = mpmdc.stage(h, 1) @ jax.lax.stop_gradient(p["w"])
                return jnp.sum(jnp.tanh(mpmdc.stage(h, 2) @ p["w"]) ** 2)

            return jax.grad(loss)(p)

        g = mpmdc.accumulate(grad, x, microbatches=2)
        finite = jnp.all(jnp.isfinite(g["v"])) & jnp.all(jnp.isfinite(g["w"]))
        new = jax.tree.map(lambda w, d: jnp.where(finite, w - 0.1 * d, w), p, g)
        return (new, jnp.sum(g["w"])) if returns == "a tuple" else new

    k = jax.random.split(jax.random.key(0), 3)
    p = {"v": jax.random.normal(k[0], (16, 16)) / 4, "w": jax.random.normal(k[1], (16, 16)) / 4}
    x = jax.random.normal(k[2], (4, 16))
    compiled = mpmdc.compile(step, meshes4[:2], stage_to_mesh=(0, 1, 0), schedule="gpipe")
    program = compiled.lower(p, x).program("after-split")
    lives = dict(zip(program.in_paths, program.in_meshes))
    returns_to = dict(zip(program.out_paths, program.out_meshes))
    assert lives["args[0]['w']"] == 1 and lives["args[0]['v']"] == 0
    prefix = "out[0]" if returns == "a tuple" else "out"
    assert returns_to[f"{prefix}['w']"] == 1 and returns_to[f"{prefix}['v']"] == 0
    # The gradient summed over microbatches in another order than in one module:
    # docs/design.md's bound for any compiled function against jax.jit.
    assert_same_tree(compiled(p, x), jax.jit(step)(p, x), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("residual", [False, True])
def test_a_bare_sharding_constraint_ending_a_stage_differentiates_in_that_stage(residual):
    """A ``with_sharding_constraint`` of a bare spec on a stage's last value: its
    transpose reads only the cotangent leaving the next stage's backward, which goes to
    this stage's; it runs there too, not as a fragment of its own on the next stage's
    mesh sending the constrained cotangent back as "other" (beside the raw one, with a
    residual connection)."""
    meshes = mpmdc.make_meshes(2, {"data": 2, "model": 2})

    def loss(ws, x):
        x = mpmdc.stage(x, 0)
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ ws[0]), P("data", None))
        x = mpmdc.stage(x + h if residual else h, 1)
        return jnp.mean(jnp.tanh(x @ ws[1]) ** 2)

    ws = [jnp.eye(16) / 4 + 0.01, jnp.eye(16) / 2]
    x = jnp.arange(128.0).reshape(8, 16) / 128
    step = mpmdc.compile(jax.grad(loss), meshes)
    with jax.set_mesh(meshes[0]):
        lowered = step.lower(ws, x)
        got = step(ws, x)
    names = [
        e.params["name"]
        for e in lowered.program("after-split").jaxpr.jaxpr.eqns
        if "name" in e.params
    ]
    assert names == ["s0_fwd", "s1_fwd", "s0_bwd"], names
    report = lowered.transfer_report()
    assert report.total("other") == 0 and report.total() == 2 * 8 * 16 * 4
    # One step's gradient, summed over data shards: docs/design.md's bound against jax.jit.
    with jax.set_mesh(meshes[0]):
        want = jax.jit(jax.grad(loss))(ws, x)
    assert_same_tree(got, want, rtol=2e-5, atol=1e-6)


def test_constants_lifted_out_of_a_shard_map_are_made_where_they_are_read():
    """``jax.nn.gelu`` in a ``shard_map`` in a scanned stack, differentiated: JAX lifts its
    constants into a ``shard_map`` of no operands (on the abstract mesh). Computed once
    in stage 0's microbatch iteration and sent to every other mesh in each, they are
    recomputed next to each reader instead, as any constant: the step moves what the
    same stack without the ``shard_map`` moves."""
    meshes = mpmdc.make_meshes(2, {"model": 2})
    abstract = meshes[0].abstract_mesh

    def mlp(h, w1, w2):
        return jax.lax.psum(jax.nn.gelu(h @ w1) @ w2, "model")

    def loss(ws, x, with_shard_map):
        def layer(h, w):
            h = mpmdc.stage(h, every=1)
            if with_shard_map:
                spec = (P(), P(None, "model"), P("model", None))
                return h + jax.shard_map(mlp, mesh=abstract, in_specs=spec, out_specs=P())(
                    h, *w
                ), None
            return h + jax.nn.gelu(h @ w[0]) @ w[1], None

        return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)

    def step(ws, x, with_shard_map):
        return mpmdc.accumulate(
            lambda xb: jax.grad(loss)(ws, xb, with_shard_map), x, microbatches=2
        )

    k = jax.random.split(jax.random.key(0), 3)
    ws = (jax.random.normal(k[0], (2, 8, 16)) / 4, jax.random.normal(k[1], (2, 16, 8)) / 4)
    x = jax.random.normal(k[2], (4, 8))
    values = {}
    for with_shard_map in (False, True):
        compiled = mpmdc.compile(partial(step, with_shard_map=with_shard_map), meshes)
        with jax.set_mesh(meshes[0]):
            report = compiled.lower(ws, x).transfer_report()
            got = compiled(ws, x)
        values[with_shard_map] = sum(sum(link.values) for link in report.links)
        # The gradient summed over microbatches: docs/design.md's bound against jax.jit.
        with jax.set_mesh(meshes[0]):
            want = jax.jit(partial(step, with_shard_map=with_shard_map))(ws, x)
        assert_same_tree(got, want, rtol=2e-5, atol=1e-6)
    assert values[True] == values[False], values


def test_dropout_in_a_stage_moves_no_mask_and_each_cotangent_once(meshes4):
    """A stage's dropout mask (made from the key) is a value of that stage: the backward
    of its ``where`` runs in the stage's backward, where the cotangent leaving the next
    stage goes anyway; run there with the cotangent, it would pull the mask forward and
    send back two cotangents (the masked one and the residual's)."""

    def loss(ws, x, key):
        h = x
        for i, w in enumerate(ws):
            h = mpmdc.stage(h, i)
            z = jnp.tanh(h @ w)
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, z.shape)
            h = h + jnp.where(keep, z / 0.8, 0.0)
        return jnp.mean(h**2)

    step = jax.value_and_grad(loss)
    ws = [jnp.eye(WIDTH) * (1 + i / 10) for i in range(STAGES)]
    x, key = jnp.ones((8, WIDTH)), jax.random.key(0)
    lowered = mpmdc.compile(step, meshes4).lower(ws, x, key)
    report = lowered.transfer_report()
    activation = 8 * WIDTH * 4
    assert report.total("activations/cotangents") == 2 * (STAGES - 1) * activation
    assert report.total() == report.total("activations/cotangents") + (STAGES - 1) * 8  # keys
    got = lowered.compile()(ws, x, key)
    assert_same_tree(got, jax.jit(step)(ws, x, key))


def test_a_skip_connections_cotangent_is_not_sent_up_the_pipeline_to_be_summed(meshes4):
    """Stage 0's output also read by the loss (a skip connection): its two cotangents,
    the skip's (made in the last stage's backward, which shares its forward's transpose
    count) and the one leaving stage 1, are summed on the way down, never by sending
    stage 1's up to the last mesh, where stage 0's backward would wait on it."""

    def loss(ws, x, y):
        skip = None
        for i, w in enumerate(ws):
            x = jnp.tanh(mpmdc.stage(x, i) @ w)
            skip = x if i == 0 else skip
        return jnp.mean((x + skip - y) ** 2)

    def step(ws, x, y):
        value, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss)(ws, *mb), (x, y), microbatches=4, reduce="mean"
        )
        return value, [w - 0.1 * g for w, g in zip(ws, grads)]

    k = jax.random.split(jax.random.key(0), 6)
    ws = [jax.random.normal(k[i], (WIDTH, WIDTH)) * 0.3 for i in range(STAGES)]
    x, y = jax.random.normal(k[4], (16, WIDTH)), jax.random.normal(k[5], (16, WIDTH))
    lowered = mpmdc.compile(step, meshes4).lower(ws, x, y)
    links = {(link.src, link.dst) for link in lowered.transfer_report().links}
    assert (1, 3) not in links and (2, 3) in links, links
    # Noise floor: jax.jit of this step over 2 microbatches against 4 differs by 6.9e-7
    # relative per element (mpmdc equals jax.jit here); the bound is ten times that.
    assert_same_tree(lowered.compile()(ws, x, y), jax.jit(step)(ws, x, y), rtol=7e-6)


def test_a_conditional_in_a_stage_on_a_predicate_from_an_earlier_one_differentiates_there(
    meshes4,
):
    """``lax.cond`` in stage 1 on a predicate computed in stage 0: its backward runs on
    stage 1's mesh with its forward. JAX's linearization passes the weight through the
    conditional as a residual; kept as a conditional of its own, the predicate alone
    placed it in stage 0, whose backward then pulled in the rest and the weight."""

    def loss(ws, x):
        h0 = jnp.tanh(mpmdc.stage(x, 0) @ ws[0])
        h1 = mpmdc.stage(h0, 1)
        h1 = jax.lax.cond(
            jnp.mean(h0) > 0, lambda h: jnp.tanh(h @ ws[1]), lambda h: jnp.sin(h @ ws[1]), h1
        )
        return jnp.mean(jnp.tanh(mpmdc.stage(h1, 2) @ ws[2]) ** 2)

    step = jax.value_and_grad(loss)
    k = jax.random.split(jax.random.key(0), 4)
    ws = [jax.random.normal(k[i], (WIDTH, WIDTH)) / 4 for i in range(3)]
    x = jax.random.normal(k[3], (8, WIDTH))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        lowered = mpmdc.compile(step, meshes4[:3]).lower(ws, x)
    program = lowered.program("after-split")
    assert program.in_meshes[:3] == program.out_meshes[1:4] == (0, 1, 2)
    got = lowered.compile()(ws, x)
    assert_same_tree(got, jax.jit(step)(ws, x))


def test_a_state_committed_to_one_device_is_one_warning_naming_its_arguments(meshes4):
    """Every parameter put on device 0: one mistake, one warning (the count, the bytes,
    the first arguments), not one per leaf."""
    step = mpmdc.compile(_sgd_step, meshes4)
    ws = jax.device_put([jnp.eye(WIDTH) / 2] * STAGES, jax.devices()[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(ws, jnp.ones((8, WIDTH)))
    (moved,) = [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]
    assert moved.startswith(
        f"4 arguments are not where the program reads them, so every call moves them there "
        f"first ({4 * WIDTH * WIDTH * 4} bytes): args[0][0] is on devices [0] (part of mesh0), "
        f"read on mesh0 (devices [0, 1]); args[0][1] is on devices [0] (part of mesh0), read "
        f"on mesh1 (devices [2, 3]); args[0][2]"
    ), moved
    assert "; and 1 more. Put each there once" in moved


def test_a_list_of_accumulators_at_a_parameters_place_stays_with_it(meshes2):
    """SM3 keeps a list of accumulators, one per axis, at each parameter's place:
    ``mu[0][1]`` (32 floats) is parameter ``[0]``'s, though its path ends as parameter
    ``[1]``'s does. Each stays with its own parameter, so its update reads the gradient
    where it is made, and a fed-back call moves nothing but activations and
    cotangents."""
    opt = optax.sm3(0.1)
    k = jax.random.split(jax.random.key(0), 4)
    params = [jax.random.normal(k[i], (16, 32)) / 4 for i in range(2)]
    x, y = jax.random.normal(k[2], (16, 16)), jax.random.normal(k[3], (16, 32))

    def loss_fn(p, x, y):
        h = jnp.tanh(mpmdc.stage(x, 0) @ p[0])
        return jnp.mean((jnp.tanh(mpmdc.stage(h, 1)[:, :16] @ p[1]) - y) ** 2)

    def step(p, s, x, y):
        loss, g = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss_fn)(p, *mb), (x, y), microbatches=2
        )
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    compiled = mpmdc.compile(step, meshes2)
    got = compiled(params, opt.init(params), x, y)
    assert_same_tree(got, jax.jit(step)(params, opt.init(params), x, y))
    for i in range(2):
        assert mesh_index(got[0][i], meshes2) == i
        assert [mesh_index(a, meshes2) for a in got[1][0].mu[i]] == [i, i]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        report = compiled.lower(*got[:2], x, y).transfer_report()
    assert report.total() == report.total("activations/cotangents")


def test_a_state_leaf_nobody_reads_stays_with_its_parameter_not_with_an_argument(meshes4):
    """A state leaf the step returns unread (as Adafactor's ``(1,)`` placeholder of a
    factored moment) goes with its kin by its place in the pytree:
    ``args[1]['v'][2]`` is parameter ``args[0][2]``'s, not the batch ``args[2]``'s,
    and ``out[1]['v'][2]`` not the loss ``out[2]``'s. Parameter ``[2]`` is read by
    stage 1, the batch by stage 0 and the loss made by stage 3, so matching the
    argument's or the result's index ties them and sends the leaf to mesh 0."""
    k = jax.random.split(jax.random.key(0), 5)
    params = [jax.random.normal(k[i], (WIDTH, WIDTH)) / 4 for i in range(4)]
    x = jax.random.normal(k[4], (8, WIDTH))

    def loss_fn(p, x):
        for stage, i in enumerate([0, 2, 1, 3]):
            x = jnp.tanh(mpmdc.stage(x, stage) @ p[i])
        return jnp.mean(x**2)

    def step(p, s, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        return [a - 0.1 * b for a, b in zip(p, g)], s, loss

    state = {"v": [jnp.zeros((1,)) for _ in params]}
    compiled = mpmdc.compile(step, meshes4)
    got = compiled(params, state, x)
    assert_same_tree(got, jax.jit(step)(params, state, x))
    stage_of = [0, 2, 1, 3]  # (parameter i's stage, this order being its own inverse)
    for i in range(4):
        assert mesh_index(got[0][i], meshes4) == stage_of[i]
        assert mesh_index(got[1]["v"][i], meshes4) == stage_of[i], i
    program = compiled.lower(params, state, x).program("after-split")
    assert list(program.in_meshes[4:8]) == stage_of


def test_a_counter_every_stage_reads_lives_where_its_next_value_is_made(meshes4):
    """``optax.MultiSteps``' ``mini_step`` is read by every stage's accumulation and its
    next value made on the last mesh (with the step counter it sits beside): living on
    the first mesh, its earliest reader, it came back on the last and moved before every
    call. It lives where it is made and goes to its readers within the step."""
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "embed": jax.random.normal(k[0], (WIDTH, WIDTH)) / 4,
        "layers": jax.random.normal(k[1], (4, WIDTH, WIDTH)) / 4,
    }
    x = jax.random.normal(k[2], (8, WIDTH))
    opt = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)

    def loss_fn(p, x):
        def layer(h, w):
            return jnp.tanh(mpmdc.stage(h, every=1) @ w), None

        h, _ = jax.lax.scan(layer, x @ p["embed"], p["layers"])
        return jnp.mean(h**2)

    def step(p, s, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    compiled = mpmdc.compile(step, meshes4)
    program = compiled.lower(params, opt.init(params), x).program("after-split")
    for j, path in enumerate(program.in_paths[:-1]):  # (the state fed back: all but x)
        result = program.out_paths.index("out" + path[len("args") :])
        assert program.out_meshes[result] == program.in_meshes[j], path
    got, want = (params, opt.init(params)), (params, opt.init(params))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        for _ in range(3):
            *got, loss = compiled(*got, x)
            *want, want_loss = jax.jit(step)(*want, x)
    # Noise floor 5.0e-07 of each leaf's largest value (jax.jit with x split over data
    # against jax.jit, 3 steps; Adam divides tiny gradients by their own size, so
    # single elements differ more), margin 10x.
    for g, w in zip(jax.tree.leaves((got, loss)), jax.tree.leaves((want, want_loss))):
        assert_same_array(g, w, atol=5e-6 * float(jnp.max(jnp.abs(w))))
