"""Pipeline training under each schedule: numerics, fragment order, memory, timelines, errors."""

import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_index
from training import (
    assert_trees_close,
    hand_written_sgd_step,
    hand_written_transformer_step,
    mlp_data,
    sgd_step,
)

import mpmdc
from mpmdc import schedules
from mpmdc.cli.demo import init_params
from mpmdc.cli.models import adam_init, init_transformer, transformer_step
from mpmdc.errors import AccumulateError, ScheduleError
from mpmdc.ir.primitives import fragment_p
from mpmdc.schedules import (
    ActionLists,
    action_of,
    actions_of,
    layout_of,
    measured_costs,
    simulate,
)

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "dualpipev"]
TWO_STAGES_PER_MESH = ("interleaved-1f1b", "zb-v", "dualpipev")


def widths(schedule):
    """Interleaved and the V schedules run 8 stages on the 4 meshes, the others 4."""
    return [16] + [32] * (7 if schedule in TWO_STAGES_PER_MESH else 3) + [8]


def placement(schedule, stages, meshes=4):
    """The mesh of each stage where compile gets no stage_to_mesh."""
    return list(
        schedules.get(schedule).placement(stages, meshes) or (s % meshes for s in range(stages))
    )


def fragments(lowered, stage="after-schedule"):
    return [e for e in lowered.program(stage).jaxpr.jaxpr.eqns if e.primitive is fragment_p]


@pytest.fixture(scope="module")
def sgd_runs():
    """(lowered, executable, result) per schedule, compiled once for the module."""
    return {}


def run_sgd(schedule, meshes, cache):
    if schedule not in cache:
        params = init_params(jax.random.key(0), widths(schedule))
        step = mpmdc.compile(lambda p, x, y: sgd_step(p, x, y, schedule=schedule), meshes)
        lowered = step.lower(params, *mlp_data())
        executable = lowered.compile()
        cache[schedule] = (params, lowered, executable, executable(params, *mlp_data()))
    return cache[schedule]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.slow
def test_sgd_step_matches_the_hand_written_loop(schedule, meshes4, sgd_runs):
    params, _, _, (loss, new_params) = run_sgd(schedule, meshes4, sgd_runs)
    want = jax.jit(hand_written_sgd_step)(params, *mlp_data())
    assert_trees_close((loss, new_params), want)
    # The update of layer s runs on the mesh of stage s: s mod 4, or the V order.
    assert [mesh_index(w, meshes4) for w, _ in new_params] == placement(schedule, len(new_params))


@pytest.mark.parametrize(
    "schedule",
    [s if s in ("gpipe", "1f1b") else pytest.param(s, marks=pytest.mark.slow) for s in SCHEDULES],
)
def test_each_mesh_calls_its_fragments_in_schedule_order(schedule, meshes4, sgd_runs):
    _, lowered, _, _ = run_sgd(schedule, meshes4, sgd_runs)
    program = lowered.program("after-schedule")
    wanted = actions_of(program)
    frags = fragments(lowered)
    assert len({f.params["name"] for f in frags}) == len(frags)
    for mesh, actions in enumerate(wanted):
        ran = [action_of(f) for f in frags if f.params["mesh"] == mesh and action_of(f) is not None]
        present = set(ran)
        # Every action that has a fragment, in the schedule's order. The last stage's
        # backward is part of its forward fragment, so its B actions have none, and
        # stage 0 sends no input gradient anywhere, so its I actions have none.
        assert ran == [a for a in actions if a in present]
        last = layout_of(program).num_stages - 1
        without = {
            a
            for a in actions
            if (a.stage == last and a.kind != "F") or (a.stage == 0 and a.kind == "I")
        }
        assert present == set(actions) - without


def test_zero_bubble_splits_backward_into_input_and_weight_gradients(meshes4, sgd_runs):
    _, lowered, _, _ = run_sgd("zb-h1", meshes4, sgd_runs)
    names = [f.params["name"] for f in fragments(lowered)]
    for s in (1, 2):
        assert f"s{s}_igrad_mb0" in names and f"s{s}_wgrad_mb0" in names
    assert not any("_bwd_mb" in n for n in names)  # only the update after the loop is "s<k>_bwd"
    by_name = {f.params["name"]: f for f in fragments(lowered)}
    # The input-gradient part of stage 2 sends the cotangent on; weight gradients stay.
    igrad, wgrad = by_name["s2_igrad_mb3"], by_name["s2_wgrad_mb3"]
    readers = {a for f in fragments(lowered) if f.params["stage"] == 1 for a in f.invars}
    transfers = [
        e
        for e in lowered.program("after-schedule").jaxpr.jaxpr.eqns
        if e.primitive.name == "transfer"
    ]
    sent = {v for t in transfers if t.params["src"] == 2 and t.params["dst"] == 1 for v in t.invars}
    assert sent & set(igrad.outvars) and not sent & set(wgrad.outvars)
    assert not readers & set(wgrad.outvars)


def test_a_checkpointed_layer_s_weight_gradients_are_deferred_too(meshes4):
    """JAX differentiates ``jax.checkpoint`` into one call computing the recomputation
    and every cotangent; the cut looks inside it, so a zero-bubble schedule's ``W``
    still holds the weight gradients' matrix products, and the numbers are jax.jit's."""

    def layer(w, h):
        return h + jnp.tanh(h @ w)

    def loss(ws, x):
        for i, w in enumerate(ws):
            x = jax.checkpoint(layer)(w, mpmdc.stage(x, i))
        return jnp.mean(x**2)

    def step(ws, x):
        return mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss)(ws, mb), x, microbatches=4, schedule="zb-h1"
        )

    ws, x = [jnp.eye(8) * 0.5] * 4, jax.random.normal(jax.random.key(0), (16, 8))
    lowered = mpmdc.compile(step, meshes4).lower(ws, x)
    by_name = {f.params["name"]: f for f in fragments(lowered)}
    products = lambda f: sum(e.primitive.name == "dot_general" for e in f.params["jaxpr"].eqns)  # noqa: E731
    assert products(by_name["s1_wgrad_mb0"]) == 1 and products(by_name["s1_igrad_mb0"]) == 2
    # Noise floor: jax.jit with each microbatch's rows reversed differs by 2.0e-5
    # relative per element (mpmdc equals jax.jit here); the bound is ten times that.
    assert_trees_close(lowered.compile()(ws, x), jax.jit(step)(ws, x), rtol=2e-4)


# Peak in-flight microbatches per mesh (p stages, one per mesh, m microbatches): the
# schedule's own count. The last stage's backward runs inside its forward's fragment,
# so it holds one microbatch under every schedule.
PEAK_MICROBATCHES = {
    "gpipe": lambda p, m: [m] * (p - 1) + [1],
    "1f1b": lambda p, m: [min(m, p - s) for s in range(p - 1)] + [1],
    # ZB-H1 delays stage s's weight gradients by s microbatches: p in flight on each
    # mesh, no more than 1F1B's peak.
    "zb-h1": lambda p, m: [min(m, p)] * (p - 1) + [1],
    # ZB-H2 lets 2p - 1 in flight on every mesh.
    "zb-h2": lambda p, m: [min(m, 2 * p - 1)] * (p - 1) + [1],
    # Interleaved and the V schedules hold two stages' activations of a microbatch on a
    # mesh: counted once here. Mesh d of the V holds 2p - d microbatches (of which the
    # stage activations number at most 2p for ZB-V, 2p + 1 for DualPipeV).
    "interleaved-1f1b": lambda p, m: [8, 8, 7, 5],
    "zb-v": lambda p, m: [2 * p - d for d in range(p)],
    "dualpipev": lambda p, m: [2 * p - d for d in range(p)],
}


def distinct_microbatches_held(per_mesh, last_stage):
    """Per mesh, the most microbatches with a stage's activations held at once by the
    action lists: from the forward to the weight gradient (or the whole backward). The
    last stage's backward runs inside its forward, so it holds nothing between actions;
    the last mesh still holds the microbatch its fragment works on."""
    peaks = []
    for row in per_mesh:
        split = {(a.stage, a.microbatch) for a in row if a.kind == "W"}
        held, peak = set(), 1
        for a in row:
            if a.stage == last_stage:
                continue
            if a.kind == "F":
                held.add((a.stage, a.microbatch))
            elif a.kind == ("W" if (a.stage, a.microbatch) in split else "B"):
                held.discard((a.stage, a.microbatch))
            peak = max(peak, len({b for _, b in held}))
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("schedule", sorted(PEAK_MICROBATCHES))
def test_each_mesh_holds_as_many_microbatches_as_its_schedule_says(schedule, meshes4, sgd_runs):
    """Values are received right before the work that reads them and freed after their
    last reader, so the measured peak per mesh is the schedule's count."""
    _, lowered, executable, _ = run_sgd(schedule, meshes4, sgd_runs)
    memory = executable.memory
    program = lowered.program("after-schedule")
    measured = [m.peak_microbatches for m in memory]
    assert measured == PEAK_MICROBATCHES[schedule](4, 8)
    assert measured == distinct_microbatches_held(
        actions_of(program), layout_of(program).num_stages - 1
    )
    for mesh in memory:
        assert mesh.peak_buffers >= mesh.peak_activation_buffers


def test_one_f_one_b_holds_fewer_activation_bytes_than_gpipe(meshes4, sgd_runs):
    gpipe = run_sgd("gpipe", meshes4, sgd_runs)[2].memory
    one_f_one_b = run_sgd("1f1b", meshes4, sgd_runs)[2].memory
    assert one_f_one_b[0].peak_activation_buffers < gpipe[0].peak_activation_buffers
    assert one_f_one_b[0].peak_activation_bytes < gpipe[0].peak_activation_bytes


def test_memory_without_a_loop_counts_buffers_but_no_microbatches(meshes4):
    from mpmdc.cli.demo import mlp_loss

    params = init_params(jax.random.key(0), widths("1f1b"))
    x, y = mlp_data(8)
    memory = mpmdc.compile(jax.grad(mlp_loss), meshes4).lower(params, x, y).compile().memory
    assert len(memory) == 4
    assert all(m.peak_microbatches == 0 and m.peak_buffers > 0 for m in memory)


def test_timed_run_measures_every_fragment_and_exports_a_trace(meshes4, sgd_runs, tmp_path):
    params, lowered, executable, result = run_sgd("1f1b", meshes4, sgd_runs)
    outputs, timeline = executable.run_timed(params, *mlp_data())
    assert_trees_close(outputs, result)
    names = sorted(slot.name for row in timeline.meshes for slot in row)
    frags = fragments(lowered)
    assert sorted(n for n in names if not n.startswith("transfer")) == sorted(
        f.params["name"] for f in frags
    )
    for mesh, row in enumerate(timeline.meshes):
        assert all(
            a.end <= b.start for a, b in itertools.pairwise(row)
        )  # one thing at a time per mesh
        assert {f.params["name"] for f in frags if f.params["mesh"] == mesh} <= {
            s.name for s in row
        }
    assert 0 <= timeline.bubble_fraction < 1
    # The simulator, fed the measured costs, reproduces each mesh's busy time.
    program = lowered.program("after-schedule")
    layout = layout_of(program)
    simulated = simulate(actions_of(program), layout, measured_costs(timeline))
    for measured, sim in zip(timeline.meshes, simulated.meshes):
        busy = sum(s.end - s.start for s in measured if s.action is not None)
        assert sum(s.end - s.start for s in sim) == pytest.approx(busy)
    trace = json.loads(timeline.chrome_trace())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(names)
    assert {e["args"].get("microbatch") for e in spans if e["cat"] == "F"} == set(range(8))


def test_a_user_action_list_schedule_runs(meshes2):
    params = init_params(jax.random.key(0), [16, 32, 8])
    lists = ["0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"]

    def step(p, x, y):
        return sgd_step(p, x, y, microbatches=4, schedule=ActionLists(lists))

    got = mpmdc.compile(step, meshes2)(params, *mlp_data())
    assert_trees_close(
        got, jax.jit(lambda p, x, y: hand_written_sgd_step(p, x, y, 4))(params, *mlp_data())
    )


@pytest.mark.slow
def test_transformer_with_tied_embedding_trains_three_adam_steps(meshes4):
    params = init_transformer(jax.random.key(0))
    state = adam_init(params)
    tokens = jax.random.randint(jax.random.key(3), (8, 9), 0, 32)
    step = mpmdc.compile(transformer_step, meshes4)
    reference = jax.jit(hand_written_transformer_step)
    got, want = (params, state), (params, state)
    losses = []
    # Noise floors over the three steps (jax.jit of the reference against itself with the
    # microbatches reversed, and against eager; the larger): 1.3e-07 relative for the loss,
    # 2.6e-06 absolute for parameters and Adam's state; margin 10x.
    for _ in range(3):
        *got, loss = step(*got, tokens)
        *want, want_loss = reference(*want, tokens)
        assert_trees_close(loss, want_loss, rtol=1.3e-6)
        losses.append(float(loss))
    assert_trees_close(tuple(got), tuple(want), atol=2.6e-5)
    assert losses[2] < losses[0]
    # The tied embedding's two gradient contributions (lookup on stage 0, logits on
    # stage 3) are summed across meshes and the update runs with the lookup.
    new_params = got[0]
    assert mesh_index(new_params["embed"], meshes4) == 0
    assert [mesh_index(b["q"], meshes4) for b in new_params["blocks"]] == [0, 1, 2, 3]
    assert mesh_index(new_params["norm"], meshes4) == 3


def remat_tied_loss(ws, x, y):
    """Each stage's layer under jax.checkpoint; the first weight read again by the head
    (a tied weight, on the first stage's mesh, its gradient summed across meshes)."""
    for i, w in enumerate(ws):
        x = mpmdc.stage(x, i)
        x = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x)
    return jnp.mean((x @ ws[0].T - y) ** 2)


@pytest.mark.parametrize("schedule", ["zb-h2", "zb-v", "dualpipev"])
@pytest.mark.slow
def test_new_schedules_keep_remat_and_tied_weights_equal_to_jit(schedule, meshes4):
    stages = 8 if schedule in TWO_STAGES_PER_MESH else 4
    ws = [jax.random.normal(jax.random.key(i), (16, 16)) * 0.4 for i in range(stages)]
    x, y = mlp_data()[0], jax.random.normal(jax.random.key(9), (32, 16))

    def step(ws, x, y):
        return sgd_step(ws, x, y, schedule=schedule, loss_fn=remat_tied_loss)

    lowered = mpmdc.compile(step, meshes4).lower(ws, x, y)
    compiled = lowered.compile()
    got = compiled(ws, x, y)
    jax.tree.map(np.testing.assert_array_equal, got, jax.jit(step)(ws, x, y))
    assert mesh_index(got[1][0], meshes4) == 0  # the tied weight stays with stage 0
    # The memory and transfer reports cover every mesh; the tied weight travels to the
    # last stage's mesh once per step, not per microbatch.
    assert len(compiled.memory) == 4 and all(m.peak_microbatches >= 1 for m in compiled.memory)
    report = lowered.transfer_report()
    last = placement(schedule, stages)[-1]
    weight = ws[0].size * 4
    assert report.total("parameters/optimizer state") == (weight if last != 0 else 0)


def mlp_step_with(schedule, microbatches=8):
    def step(p, x, y):
        return sgd_step(p, x, y, microbatches=microbatches, schedule=schedule)

    return step


@pytest.mark.parametrize(
    ("schedule", "microbatches", "error", "says"),
    [
        (
            "1f1b",
            5,
            AccumulateError,
            "xs[0] has leading size 32, which 5 microbatches do not divide",
        ),
        (
            "pipedream",
            8,
            ScheduleError,
            "unknown schedule 'pipedream'; known schedules: gpipe, 1f1b, interleaved-1f1b, zb-h1",
        ),
        (
            ["0F0 0B0 0F1 0B1", "1F0 1B0 1F1 1B1"],
            2,
            ScheduleError,
            "has 2 action list(s) but the pipeline uses 4 meshes",
        ),
        (
            ["0F0 0B0 0F1 0B1", "1B0 1F0 1F1 1B1", "2F0 2B0 2F1 2B1", "3F0 3B0 3F1 3B1"],
            2,
            ScheduleError,
            "mesh 1 runs 1B0 before 1F0, which 1B0 needs; put 1F0 first",
        ),
        (
            ["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1", "2F0 2B0 2F1 2B1", "3F0 3B0 3F1 3B1"],
            2,
            ScheduleError,
            "the schedule deadlocks: mesh 0 waits at 0B0 for 1B0; mesh 1 waits at 1F1 for 0F1",
        ),
        (
            ["0F0 0B0", "1F0 1B0", "2F0 2B0", "3F0 3B0"],
            2,
            ScheduleError,
            "the schedule never runs 0F1",
        ),
        (
            "interleaved-1f1b",
            2,
            ScheduleError,
            "groups of 4 (one per mesh); 2 microbatches is not a multiple of 4",
        ),
    ],
)
def test_bad_schedules_fail_before_anything_runs(meshes4, schedule, microbatches, error, says):
    params = init_params(jax.random.key(0), widths("1f1b"))
    with pytest.raises(error, match=re.escape(says)):
        mpmdc.compile(mlp_step_with(schedule, microbatches), meshes4).lower(params, *mlp_data())


def test_eight_stages_on_four_meshes_need_the_interleaved_schedule(meshes4):
    params = init_params(jax.random.key(0), widths("interleaved-1f1b"))
    with pytest.raises(
        ScheduleError,
        match=re.escape(
            "mesh 0 has stages [0, 4]; for 8 stages on 4 meshes use "
            "mpmdc.compile(..., schedule='interleaved-1f1b')"
        ),
    ):
        mpmdc.compile(mlp_step_with("1f1b"), meshes4).lower(params, *mlp_data())


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
@pytest.mark.slow
def test_v_schedules_place_their_stages_and_refuse_a_placement_they_cannot_run(schedule, meshes4):
    """Without stage_to_mesh the V schedules put stages s and 7-s on mesh s; a
    stage_to_mesh of the same V is the same program; another is refused, naming the V,
    and so is a program of one stage per mesh."""
    params = init_params(jax.random.key(0), widths(schedule))
    step = mlp_step_with(schedule)
    default = mpmdc.compile(step, meshes4).lower(params, *mlp_data())
    explicit = mpmdc.compile(step, meshes4, stage_to_mesh=(0, 1, 2, 3, 3, 2, 1, 0))
    assert (
        default.program("after-schedule").schedule
        == explicit.lower(params, *mlp_data()).program("after-schedule").schedule
    )
    round_robin = mpmdc.compile(step, meshes4, stage_to_mesh=(0, 1, 2, 3, 0, 1, 2, 3))
    with pytest.raises(ScheduleError, match=re.escape("stage_to_mesh=[0, 1, 2, 3, 3, 2, 1, 0]")):
        round_robin.lower(params, *mlp_data())
    four_stages = init_params(jax.random.key(0), widths("1f1b"))
    with pytest.raises(
        ScheduleError, match=re.escape(f"{schedule} runs two stages per mesh in V order: 8")
    ):
        mpmdc.compile(step, meshes4).lower(four_stages, *mlp_data())


@pytest.mark.slow
def test_a_layout_change_is_a_compile_argument_not_a_model_edit(meshes4, meshes2):
    """The same step (its accumulate names 1f1b) on 4 meshes, and on 2 with two stages
    each by compile's ``schedule=``: both jax.jit's numbers, bit for bit."""
    params = init_params(jax.random.key(0), widths("1f1b"))
    want = jax.jit(sgd_step)(params, *mlp_data())
    on_four = mpmdc.compile(sgd_step, meshes4)
    on_two = mpmdc.compile(sgd_step, meshes2, schedule="interleaved-1f1b")
    for step, meshes in ((on_four, meshes4), (on_two, meshes2)):
        got = step(params, *mlp_data())
        jax.tree.map(np.testing.assert_array_equal, got, want)
        assert [mesh_index(w, meshes) for w, _ in got[1]] == [s % len(meshes) for s in range(4)]
    assert on_two.lower(params, *mlp_data()).program("after-schedule").schedule.name == (
        "Interleaved1F1B()"
    )


@pytest.mark.parametrize("schedule", ["gpipe", mpmdc.schedules.GPipe()])
@pytest.mark.slow
def test_compiles_schedule_wins_over_accumulates(meshes2, schedule):
    # 1f1b (named in the step) refuses two stages per mesh; gpipe runs them.
    params = init_params(jax.random.key(0), widths("1f1b"))
    step = mpmdc.compile(sgd_step, meshes2, stage_to_mesh=(0, 0, 1, 1), schedule=schedule)
    lowered = step.lower(params, *mlp_data())
    assert lowered.program("after-schedule").schedule.name == "GPipe()"
    jax.tree.map(
        np.testing.assert_array_equal,
        lowered.compile()(params, *mlp_data()),
        jax.jit(sgd_step)(params, *mlp_data()),
    )


def test_an_unknown_schedule_name_given_to_compile_names_the_choices(meshes2):
    with pytest.raises(
        ScheduleError, match="unknown schedule 'pipedream'; known schedules: gpipe, 1f1b"
    ):
        mpmdc.compile(sgd_step, meshes2, schedule="pipedream")


def test_two_accumulate_loops_in_one_function_are_refused(meshes2):
    def step(w, x):
        a = mpmdc.accumulate(lambda mb: jnp.sum(mpmdc.stage(mb, 1) * w), x, microbatches=2)
        b = mpmdc.accumulate(lambda mb: jnp.sum(mb * w), x, microbatches=2)
        return a + b

    with pytest.raises(AccumulateError, match=r"runs mpmdc\.accumulate 2 times"):
        mpmdc.compile(step, meshes2).lower(jnp.ones(3), jnp.ones((4, 3)))


def test_gpipe_takes_any_stage_to_mesh_map(meshes2):
    params = init_params(jax.random.key(0), widths("1f1b"))
    step = mpmdc.compile(mlp_step_with("gpipe", 4), meshes2, stage_to_mesh=(0, 0, 1, 1))
    got = step(params, *mlp_data())
    assert_trees_close(
        got, jax.jit(lambda p, x, y: hand_written_sgd_step(p, x, y, 4))(params, *mlp_data())
    )
    assert [mesh_index(w, meshes2) for w, _ in got[1]] == [0, 0, 1, 1]


def test_a_marker_inside_accumulate_is_reported_at_the_users_line(meshes2):
    def step(w, x):
        def per_microbatch(mb):
            return jnp.sum(mpmdc.stage(mb @ w, 5))

        return mpmdc.accumulate(per_microbatch, x, microbatches=2)

    from mpmdc.errors import StageError

    with pytest.raises(
        StageError,
        match=r"stage 5 \(marker at .*test_pipeline_training.py:\d+:\d+ \(.*per_microbatch\)\)",
    ):
        mpmdc.compile(step, meshes2, stage_to_mesh=(0, 1)).lower(jnp.ones((3, 3)), jnp.ones((4, 3)))
