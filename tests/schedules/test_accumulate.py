"""``mpmdc.accumulate``: the sequential loop under jax.jit, the rolled (or unrolled) form under mpmdc."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_as_jit, mesh_index
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from training import assert_trees_close, hand_written_sgd_step, mlp_data, sgd_step

import mpmdc
from mpmdc.cli.demo import init_params
from mpmdc.errors import AccumulateError, ScheduleError


@pytest.mark.slow
def test_under_jit_it_is_the_per_microbatch_loop():
    params = init_params(jax.random.key(0), [16, 32, 32, 32, 8])
    assert_trees_close(
        jax.jit(sgd_step)(params, *mlp_data()), jax.jit(hand_written_sgd_step)(params, *mlp_data())
    )
    jaxpr = str(jax.make_jaxpr(sgd_step)(params, *mlp_data()))
    assert "scan[" in jaxpr  # one loop body, not eight copies


@pytest.mark.slow
def test_four_stage_sgd_step_under_mpmdc(meshes4):
    params = init_params(jax.random.key(0), [16, 32, 32, 32, 8])
    loss, new_params = mpmdc.compile(sgd_step, meshes4)(params, *mlp_data())
    assert_trees_close((loss, new_params), jax.jit(hand_written_sgd_step)(params, *mlp_data()))
    # The update runs where each layer's parameters and gradients live.
    assert [mesh_index(w, meshes4) for w, _ in new_params] == [0, 1, 2, 3]


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_reductions_and_pytree_prefixes(meshes2, microbatches):
    def fn(w, x):
        def per_microbatch(mb):
            h = mpmdc.stage(mb, 0) @ w
            h = mpmdc.stage(jnp.tanh(h), 1)
            return {"total": h.sum(), "peak": h.max(0), "rows": h, "both": (h.mean(), h.min())}

        reduce = {"total": "sum", "peak": "max", "rows": "concat", "both": "mean"}
        return mpmdc.accumulate(per_microbatch, x, microbatches=microbatches, reduce=reduce)

    w, x = jnp.ones((4, 6)) * 0.1, jnp.arange(32.0).reshape(8, 4) / 10
    # The microbatches' means are summed on another mesh than jax.jit sums them: noise
    # floor one float32 ulp of the mean (1.2e-07 relative, jax.jit of the loop against
    # jax.jit of the whole batch's mean), margin 4x.
    got = assert_same_as_jit(fn, meshes2, w, x, rtol=5e-7)
    # Against the whole batch at once: noise floors 8.6e-08 (rows, so their maximum too)
    # and 7.9e-08 (total) relative (jax.jit of the loop over microbatch slices against the
    # whole batch), margin 10x.
    np.testing.assert_allclose(got["rows"], jnp.tanh(x @ w), rtol=1e-6)
    np.testing.assert_allclose(got["peak"], jnp.tanh(x @ w).max(0), rtol=1e-6)
    np.testing.assert_allclose(got["total"], jnp.tanh(x @ w).sum(), rtol=1e-6)


def test_eager_call_works_too():
    out = mpmdc.accumulate(lambda mb: mb.sum(), jnp.arange(12.0), microbatches=3)
    assert float(out) == 66.0


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        (
            {"microbatches": 5},
            AccumulateError,
            "xs[0] has leading size 8, which 5 microbatches do not divide",
        ),
        ({"microbatches": 0}, AccumulateError, "microbatches must be a positive int, got 0"),
        ({"microbatches": True}, AccumulateError, "positive int, got True"),
        ({"microbatches": 2, "schedule": "2f2b"}, ScheduleError, "known schedules: gpipe, 1f1b"),
        ({"microbatches": 2, "reduce": "median"}, AccumulateError, "unknown reduction 'median'"),
        (
            {"microbatches": 2, "reduce": ["sum", "sum", "sum"]},
            AccumulateError,
            "does not match the structure",
        ),
        ({"microbatches": 2, "reduce": "concat"}, AccumulateError, "fn's output is a scalar"),
    ],
)
def test_accumulate_errors(kwargs, error, says):
    xs = (jnp.ones((8, 2)), jnp.ones((8,)))
    with pytest.raises(error, match=re.escape(says)):
        jax.jit(lambda xs: mpmdc.accumulate(lambda mb: mb[0].sum() + mb[1].sum(), xs, **kwargs))(xs)


def test_scalar_leaf_is_named():
    with pytest.raises(AccumulateError, match=r"xs\['scale'\] is a scalar"):
        mpmdc.accumulate(lambda mb: mb["x"].sum(), {"x": jnp.ones(4), "scale": 2.0}, microbatches=2)


def test_the_loop_stays_rolled_keeping_source_lines(meshes2):
    """Under mpmdc the passes see one microbatch's equations, whatever the microbatch
    count, each keeping the user's source line."""
    from mpmdc import _jax_compat as compat

    def loss(w, x):
        return jnp.sum(jnp.tanh(mpmdc.stage(mpmdc.stage(jnp.sin(x), 0) @ w, 1)) ** 2)

    def step(w, x, microbatches):
        return mpmdc.accumulate(
            lambda xb: jax.value_and_grad(loss)(w, xb), x, microbatches=microbatches
        )

    w, x = jnp.eye(8) * 0.5, jnp.arange(256.0).reshape(32, 8) / 256
    sizes = []
    for microbatches in (2, 16):
        lowered = mpmdc.compile(step, meshes2, static_argnums=2).lower(w, x, microbatches)
        program = lowered.program("after-split").jaxpr.jaxpr
        sines = [e for e in lowered.program("input").jaxpr.jaxpr.eqns if e.primitive.name == "sin"]
        assert len(sines) == 1 and "test_accumulate.py" in compat.source_line(sines[0])
        sizes.append(len(program.eqns))
    assert sizes[0] == sizes[1]


def test_under_a_transformation_the_loop_is_unrolled_and_replayed(meshes2, monkeypatch):
    """Differentiating a function that calls ``accumulate`` unrolls the loop (a rolled
    iteration would sum a loop-invariant value's gradient over one microbatch): the
    microbatch's equations are replayed as they are, the same program binding every
    primitive again gives, and the numbers are ``jax.jit``'s."""
    from mpmdc import _jax_compat as compat

    def loss(w, x):
        def per_microbatch(xb):
            return jnp.sum(jnp.tanh(mpmdc.stage(mpmdc.stage(jnp.sin(xb), 0) @ w, 1)) ** 2)

        return mpmdc.accumulate(per_microbatch, x, microbatches=4)

    step = jax.value_and_grad(loss)
    w, x = jnp.eye(8) * 0.5, jnp.arange(64.0).reshape(8, 8) / 64
    emitted = mpmdc.compile(step, meshes2).lower(w, x)
    sines = [e for e in emitted.program("input").jaxpr.jaxpr.eqns if e.primitive.name == "sin"]
    assert len(sines) == 4 and all("test_accumulate.py" in compat.source_line(e) for e in sines)
    assert_same_as_jit(step, meshes2, w, x)
    monkeypatch.setattr(compat, "replay_in_trace", lambda closed, *args: None)
    bound = mpmdc.compile(step, meshes2).lower(w, x)
    assert emitted.as_text("input") == bound.as_text("input")
    assert emitted.as_text("stablehlo") == bound.as_text("stablehlo")


def _per_microbatch(w, mb):
    h = jnp.tanh(mb @ w)
    return {"total": h.sum(), "peak": h.max(0), "rows": h, "both": (h.mean(), h.min())}


_REDUCE = {"total": "sum", "peak": "max", "rows": "concat", "both": "mean"}


def _accumulated(w, x, microbatches):
    return mpmdc.accumulate(
        lambda mb: _per_microbatch(w, mb), x, microbatches=microbatches, reduce=_REDUCE
    )


def _sliced(w, x, microbatches):
    """The same loop written with slices, reducing in microbatch order."""
    n = x.shape[0] // microbatches
    outs = [_per_microbatch(w, x[i * n : (i + 1) * n]) for i in range(microbatches)]
    total = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), outs)
    return {
        "total": total["total"],
        "peak": functools.reduce(jnp.maximum, [o["peak"] for o in outs]),
        "rows": jnp.concatenate([o["rows"] for o in outs]),
        "both": jax.tree.map(lambda t: t / microbatches, total["both"]),
    }


@pytest.mark.parametrize("axes", ["explicit", "auto", "manual"])
def test_under_jit_a_sharded_batch_works_with_every_axis_type(axes):
    """``jax.make_mesh`` gives Explicit axes: a batch sharded over them has microbatches
    sharded the same way (a reshape into microbatches has no sharding JAX can infer).
    Inside ``shard_map`` the axes are Manual. The numbers are the sliced loop's, bit for bit."""
    kind = jax.sharding.AxisType.Auto if axes == "auto" else jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,), devices=jax.devices()[:4])
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    x = jax.device_put(jnp.arange(64.0).reshape(16, 4) / 16, NamedSharding(mesh, P("data")))

    def run(fn):
        if axes != "manual":
            return jax.jit(fn, static_argnums=2)(w, x, 2)
        per_device = jax.shard_map(
            lambda w, x: jax.tree.map(lambda a: a[None], fn(w, x, 2)),
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=P("data"),
        )
        return jax.jit(per_device)(w, x)

    got, want = run(_accumulated), run(_sliced)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    if axes == "explicit":
        assert jax.typeof(got["rows"]).sharding.spec[0] == "data"


def test_microbatches_an_explicit_sharding_cannot_split_are_named():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    with pytest.raises(
        AccumulateError,
        match=r"xs\['x'\] has its leading axis split over the Explicit mesh axes \('data',\) "
        r"\(4 devices\), which its microbatches of 2 rows cannot be",
    ):
        jax.jit(lambda x: mpmdc.accumulate(lambda mb: mb["x"].sum(), {"x": x}, microbatches=4))(x)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_under_disable_jit_it_is_the_same_loop(microbatches):
    """Eager debugging (``jax.disable_jit``) runs the loop too, one microbatch included."""
    w, x = jnp.ones((4, 3)) * 0.1, jnp.arange(32.0).reshape(8, 4) / 10
    with jax.disable_jit():
        got, want = _accumulated(w, x, microbatches), _sliced(w, x, microbatches)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def _two_stage_loss(ws, x, y):
    h = jnp.tanh(mpmdc.stage(x, 0) @ ws[0])
    return jnp.mean((mpmdc.stage(h, 1) @ ws[1] - y) ** 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_batch_computed_inside_the_step(meshes2, schedule):
    """The batch a step computes (inputs and targets cut from one array, as a language
    model shifts its tokens) enters the loop from the fragment computing it."""

    def step(ws, data):
        batch = (data[:, :-4] * 2.0, data[:, 4:])
        return mpmdc.accumulate(
            lambda mb: jax.grad(_two_stage_loss)(ws, *mb), batch, microbatches=4, schedule=schedule
        )

    ws = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.25]
    data = jnp.arange(192.0).reshape(16, 12) / 192
    assert_same_as_jit(step, meshes2, ws, data)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.slow
def test_each_microbatchs_loss_stacked_beside_the_gradients(meshes2, schedule):
    """A loss broadcast to be stacked (``reduce="concat"`` of ``loss[None]``) is computed
    in the loop's iteration, where the loss is, not after it."""

    def step(ws, x, y):
        def per_microbatch(mb):
            loss, grads = jax.value_and_grad(_two_stage_loss)(ws, *mb)
            return grads, loss[None], loss.reshape(1, 1) * 2.0

        return mpmdc.accumulate(
            per_microbatch,
            (x, y),
            microbatches=4,
            schedule=schedule,
            reduce=("mean", "concat", "concat"),
        )

    ws = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.25]
    x = jnp.arange(128.0).reshape(16, 8) / 128
    _, losses, doubled = assert_same_as_jit(step, meshes2, ws, x, jnp.sin(x))
    assert losses.shape == (4,) and doubled.shape == (4, 1)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_reduced_outputs_keep_their_weak_types(meshes2, reduce):
    """An output from a Python number is weakly typed under ``jax.jit``'s loop, so it
    promotes as a Python number does after the loop; so under mpmdc."""

    def step(x):
        total, count = mpmdc.accumulate(
            lambda mb: (mpmdc.stage(mb, 1).sum(), 1.5), x, microbatches=4, reduce=reduce
        )
        return total, count, total.astype(jnp.bfloat16) + count

    x = jnp.arange(32.0).reshape(8, 4)
    got = assert_same_as_jit(step, meshes2, x)
    want = jax.jit(step)(x)
    assert [a.weak_type for a in got] == [a.weak_type for a in want] == [False, True, False]
    assert got[2].dtype == jnp.bfloat16


def test_the_transfer_report_counts_a_rolled_loop_once_per_microbatch(meshes2):
    """Before ``schedule`` the loop is one iteration; what a step moves is the same as
    after it, where every microbatch's transfers are."""
    from mpmdc.ir.traffic import transfer_report

    def step(ws, x, y):
        return mpmdc.accumulate(
            lambda mb: jax.grad(_two_stage_loss)(ws, *mb), (x, y), microbatches=4
        )

    ws = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.25]
    x = jnp.arange(128.0).reshape(16, 8) / 128
    lowered = mpmdc.compile(step, meshes2).lower(ws, x, jnp.sin(x))
    rolled = transfer_report(lowered.program("after-split"))
    assert rolled == transfer_report(lowered.program("after-schedule"))
    # Per microbatch: the activation forward, its cotangent back (8 rows of 2 x 8 floats).
    assert rolled.total("activations/cotangents") == 4 * 2 * 4 * 8 * 4


def test_a_schedule_refusing_skipped_stage_indices_names_the_unmarked_ones(meshes4):
    """Markers 0, 1, 2, 6: stages 3 to 5 are empty, and 1F1B (one stage per mesh) counts
    them; the error says so and what to do, GPipe runs the program."""

    def loss(ws, x):
        for stage, w in zip((0, 1, 2, 6), ws):
            x = jnp.tanh(mpmdc.stage(x, stage) @ w)
        return jnp.mean(x**2)

    def step(ws, x, schedule):
        return mpmdc.accumulate(
            lambda b: jax.value_and_grad(loss)(ws, b), x, microbatches=2, schedule=schedule
        )

    ws, x = [jnp.eye(4) * 0.5] * 4, jnp.ones((4, 4))
    with pytest.raises(
        ScheduleError,
        match=r"mesh 0 has stages \[0, 4\].* Stages \[3, 4, 5\] have no marker .*number the "
        r"stages without gaps",
    ):
        mpmdc.compile(functools.partial(step, schedule="1f1b"), meshes4).lower(ws, x)
    gpipe = functools.partial(step, schedule="gpipe")
    assert_trees_close(mpmdc.compile(gpipe, meshes4)(ws, x), jax.jit(gpipe)(ws, x))


def test_with_x64_enabled_the_loop_runs_and_a_call_without_it_traces_again(meshes2):
    """Under ``jax_enable_x64`` (Python ints are 64-bit) the loop takes its microbatches
    as without it, with ``jax.jit``'s numbers; the same step called without it traces
    again, as ``jax.jit`` does, and returns ``jax.jit``'s 32-bit count."""
    ws = [jnp.eye(4) * 0.5, jnp.eye(4) * 0.25]
    x = jnp.arange(32.0).reshape(8, 4) / 32

    def loss(ws, x):
        for i, w in enumerate(ws):
            x = jnp.tanh(mpmdc.stage(x, i) @ w)
        return jnp.sum(x), jnp.sum(x > 0.1)

    def step(ws, x):
        return mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss, has_aux=True)(ws, mb), x, microbatches=4
        )

    compiled = mpmdc.compile(step, meshes2)
    with jax.enable_x64(True):
        got = compiled(ws, x)
        want = jax.jit(step)(ws, x)
    assert got[0][1].dtype == want[0][1].dtype == jnp.int64
    jax.tree.map(np.testing.assert_array_equal, got, want)
    got = compiled(ws, x)
    assert got[0][1].dtype == jax.jit(step)(ws, x)[0][1].dtype == jnp.int32
    assert compiled.cache_info().currsize == 2
