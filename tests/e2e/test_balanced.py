"""``partition="balanced"`` and ``every="balanced"``: segments grouped into stages by cost."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_index
from training import mlp_data, scanned_params, sgd_step

import mpmdc
from mpmdc import cli
from mpmdc.cli.demo import init_params
from mpmdc.errors import StageError

# Widths of a tanh MLP with one marker per layer: 8 segments, the middle ones the widest.
WIDTHS = [16, 32, 32, 64, 64, 64, 32, 32, 8]


def mlp_step(params, x, y):
    return sgd_step(params, x, y)


def assert_bitwise(got, want):
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.slow
def test_balanced_mlp_runs_like_jit_with_the_grouping_shown(meshes4):
    params = init_params(jax.random.key(0), WIDTHS)
    step = mpmdc.compile(mlp_step, meshes4, partition="balanced")
    lowered = step.lower(params, *mlp_data())
    plan = lowered.stage_plan
    assert len(plan.groups) == 4 and [s for g in plan.groups for s in g] == list(range(8))
    # The two 64x64 layers are the heaviest segments: no stage holds both.
    assert plan.stage_of(3) != plan.stage_of(4)
    # The plan is the best grouping of its own estimated costs (no transfers between
    # one mesh's segments, bytes across the cuts counted).
    assert (
        max(plan.predicted)
        <= min(
            max(
                sum(c.forward + c.backward for c in plan.segments[a:b])
                for a, b in itertools.pairwise((0, *cuts, 8))
            )
            for cuts in itertools.combinations(range(1, 8), 3)
        )
        * 1.5
    )
    text = lowered.as_text("after-plan")
    assert "stages balanced from 8 segments:" in text
    assert re.search(r"stage 3: segments \d(-\d)?, predicted [\d.e-]+ ms", text)
    got = step(params, *mlp_data())
    assert_bitwise(got, jax.jit(mlp_step)(params, *mlp_data()))
    # Each layer's update lives on the mesh of the stage its segment was grouped into.
    assert [mesh_index(w, meshes4) for w, _ in got[1]] == [plan.stage_of(s) for s in range(8)]
    step(got[1], *mlp_data())
    assert step.cache_info().misses == 1  # fed back: nothing recompiles


@pytest.mark.slow
def test_without_balancing_the_plan_is_none(meshes4):
    params = init_params(jax.random.key(0), [16, 32, 32, 32, 8])
    assert mpmdc.compile(mlp_step, meshes4).lower(params, *mlp_data()).stage_plan is None


@pytest.mark.slow
def test_two_stages_per_mesh_schedules_get_twice_the_stages(meshes4):
    params = init_params(jax.random.key(0), [16] + [32] * 11 + [8])  # 12 segments
    lowered = mpmdc.compile(
        mlp_step, meshes4, partition="balanced", schedule="interleaved-1f1b"
    ).lower(params, *mlp_data())
    assert len(lowered.stage_plan.groups) == 8
    assert_bitwise(lowered.compile()(params, *mlp_data()), jax.jit(mlp_step)(params, *mlp_data()))


def heavy_head_loss(params, x, y):
    """A scanned stack between an embedding (segment 0 with the first layer) and a head
    six times a layer's work (segment 8)."""
    h = jnp.tanh(mpmdc.stage(x, 0) @ params["embed"])

    def body(h, w):
        h = mpmdc.stage(h, every="balanced", first=0)
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, h, params["layers"])
    h = mpmdc.stage(h, 8)
    for _ in range(6):
        h = jnp.tanh(h @ params["head_w"])
    return jnp.mean((h @ params["head"] - y) ** 2)


@pytest.mark.slow
def test_every_balanced_splits_a_scanned_stack_unevenly_around_a_heavy_head(meshes4):
    params = scanned_params(jax.random.key(0), layers=8)
    params["head_w"] = jax.random.normal(jax.random.key(5), (16, 16)) * 0.3

    def step_fn(p, x, y):
        return sgd_step(p, x, y, 8, "1f1b", loss_fn=heavy_head_loss)

    step = mpmdc.compile(step_fn, meshes4)
    # Uneven counts cannot be one array over the meshes: the stack stays whole, as the
    # warning says (see docs/guides/pipelining.md).
    with pytest.warns(mpmdc.errors.PlacementWarning, match="different numbers of rows"):
        lowered = step.lower(params, *mlp_data())
    got = lowered.compile()(params, *mlp_data())
    plan = lowered.stage_plan
    assert len(plan.segments) == 9
    head_stage = plan.groups[-1]
    assert 8 in head_stage and len(head_stage) < 3  # the head's stage runs fewer layers
    assert "every=(" in lowered.as_text("after-inline")
    assert_bitwise(got, jax.jit(step_fn)(params, *mlp_data()))


@pytest.mark.slow
def test_dump_shows_the_grouping(capsys, tmp_path):
    program = tmp_path / "balanced_mlp.py"
    program.write_text(
        "import jax\nimport mpmdc\nfrom training import mlp_data, sgd_step\n"
        "from mpmdc.cli.demo import init_params\n\n"
        "def lowered():\n"
        f"    params = init_params(jax.random.key(0), {WIDTHS})\n"
        "    step = mpmdc.compile(sgd_step, mpmdc.make_meshes(4, {'data': 2}), "
        "partition='balanced')\n"
        "    return step.lower(params, *mlp_data())\n"
    )
    assert cli.main(["dump", f"{program}:lowered", "--stage", "after-split"]) == 0
    out = capsys.readouterr().out
    assert "stages balanced from 8 segments:" in out and "stage 0: segments 0" in out


@pytest.mark.slow
def test_balancing_errors_name_the_problem(meshes4):
    with pytest.raises(
        StageError, match=re.escape("partition must be None or 'balanced', got 'even'")
    ):
        mpmdc.compile(mlp_step, meshes4, partition="even")
    params = init_params(jax.random.key(0), [16, 32, 32, 8])  # 3 segments
    with pytest.raises(
        StageError,
        match=re.escape(
            "4 stages need at least 4 marked segments to group, but the program marks 3"
        ),
    ):
        mpmdc.compile(mlp_step, meshes4, partition="balanced").lower(params, *mlp_data())
    with pytest.raises(
        StageError, match=re.escape("with partition='balanced' it maps those stages")
    ):
        step = mpmdc.compile(mlp_step, meshes4, partition="balanced", stage_to_mesh=[0] * 8)
        step.lower(init_params(jax.random.key(0), WIDTHS), *mlp_data())
    with pytest.raises(StageError, match=re.escape("every='even': give a positive int")):
        mpmdc.stage(jnp.ones(3), every="even")


def v_heavy_head_loss(ws, x, y):
    """Twelve layers, a marker each; the last segment also runs a head of two layers."""
    for i, w in enumerate(ws[:-1]):
        x = jnp.tanh(mpmdc.stage(x, i) @ w)
    for _ in range(2):
        x = jnp.tanh(x @ ws[-1])
    return jnp.mean((x - y) ** 2)


@pytest.mark.slow
def test_under_a_v_schedule_balancing_evens_the_meshes_totals(meshes4):
    """Mesh 0 runs stage 0 and stage 7, which holds the head: it gets just the first and
    the last segment, and no mesh is slower than it, which it cannot help being: the
    slowest mesh, not the slowest stage, is as fast as it can be."""
    ws = [jax.random.normal(jax.random.key(i), (32, 32)) * 0.2 for i in range(13)]
    x, y = jax.random.normal(jax.random.key(20), (32, 32)), jnp.zeros((32, 32))

    def step(ws, x, y):
        return sgd_step(ws, x, y, schedule="zb-v", loss_fn=v_heavy_head_loss)

    compiled = mpmdc.compile(step, meshes4, partition="balanced")
    lowered = compiled.lower(ws, x, y)
    groups = lowered.stage_plan.groups
    per_mesh = [len(groups[d]) + len(groups[7 - d]) for d in range(4)]
    assert per_mesh[0] < min(per_mesh[1:]), groups
    mesh_time = [
        lowered.stage_plan.predicted[d] + lowered.stage_plan.predicted[7 - d] for d in range(4)
    ]
    assert max(mesh_time) < 1.5 * min(mesh_time)
    assert_bitwise(compiled(ws, x, y), jax.jit(step)(ws, x, y))
