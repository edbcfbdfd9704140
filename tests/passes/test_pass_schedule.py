"""The ``schedule`` pass (``mpmdc.passes.schedule``) on small hand-written programs.

What it promises: for a program with an ``mpmdc.accumulate`` loop, each mesh calls its
fragments in the order of the schedule's action lists (the last stage's backward is
part of its forward fragment, so its ``B`` actions have none); under a zero-bubble
schedule (ZB-H1) ``split-backward`` has cut each backward of the loop's iteration once
into an input-gradient fragment (``I``, what the stage before waits for) and a
weight-gradient one (``W``), and every microbatch runs them; the reordered program computes the
same numbers; a schedule breaking a dependency is a ``ScheduleError`` before anything
runs; a program without a loop passes through unchanged.

The programs: a 2-layer (or 3-layer) tanh MLP, one stage per layer, its gradient
accumulated over 4 microbatches of shape (2, 8).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mlp_loss
from jax.extend import core as jcore
from mpmdc.passes import dce, inline, partition, schedule, split, split_backward

import mpmdc
from mpmdc.errors import ScheduleError
from mpmdc.ir.primitives import fragment_p, transfer_p
from mpmdc.ir.program import Phase
from mpmdc.schedules import ActionLists, action_of, actions_of, layout_of, loop_schedule

X = jnp.arange(64.0).reshape(8, 8) / 64
W = jnp.eye(8) * 0.5


def grad_step(schedule_name):
    def step(ws, x):
        return mpmdc.accumulate(
            lambda xb: jax.grad(mlp_loss)(ws, xb), x, microbatches=4, schedule=schedule_name
        )

    return step


def split_program(fn, meshes, *args):
    """``(planned program, split program)``, the passes before ``schedule`` called directly."""
    program = mpmdc.compile(fn, meshes, passes=[]).lower(*args).program("after-plan")
    return program, split_backward(split(partition(dce(inline(program)))))


def planned(program, schedule):
    """``program`` ordered by ``schedule`` (an ``mpmdc.schedules.Schedule``) instead."""
    return program.replace(schedule=loop_schedule(schedule, layout_of(program)))


def names_per_mesh(program):
    out = {}
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive is fragment_p:
            out.setdefault(eqn.params["mesh"], []).append(eqn.params["name"])
    return [out[m] for m in sorted(out)]


@pytest.mark.parametrize(
    "name,mesh0_actions,mesh0_fragments",
    [
        (
            "gpipe",
            "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
            "s0_fwd s0_fwd_mb0 s0_fwd_mb1 s0_fwd_mb2 s0_fwd_mb3 s0_bwd_mb0 s0_bwd_mb1 "
            "s0_bwd_mb2 s0_bwd_mb3",
        ),
        (
            "1f1b",
            "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
            "s0_fwd s0_fwd_mb0 s0_fwd_mb1 s0_bwd_mb0 s0_fwd_mb2 s0_bwd_mb1 s0_fwd_mb3 "
            "s0_bwd_mb2 s0_bwd_mb3",
        ),
    ],
)
def test_each_mesh_calls_its_fragments_in_the_schedules_order(
    meshes2, name, mesh0_actions, mesh0_fragments
):
    _, program = split_program(grad_step(name), meshes2, [W, W], X)
    out = schedule(program)
    wanted = actions_of(out)
    assert " ".join(map(str, wanted[0])) == mesh0_actions
    mesh0, mesh1 = names_per_mesh(out)
    # s0_fwd: the loop's set-up (a running sum's zeros, the batch laid out by
    # microbatch), before any action; s0_fwd_mb<i>, the one fragment reading the batch,
    # takes microbatch i of it itself.
    assert mesh0 == mesh0_fragments.split()
    # Stage 1 is the last: its backward runs inside its forward fragment.
    assert mesh1 == ["s1_fwd", "s1_fwd_mb0", "s1_fwd_mb1", "s1_fwd_mb2", "s1_fwd_mb3"]
    for mesh, actions in enumerate(wanted):
        ran = [
            action_of(e)
            for e in out.jaxpr.jaxpr.eqns
            if e.primitive is fragment_p and e.params["mesh"] == mesh
        ]
        ran = [a for a in ran if a is not None]
        assert ran == [a for a in actions if a in set(ran)]
    # The split program holds one iteration; every microbatch's call of a fragment runs
    # one body (the first stage's forward also taking its microbatch of the batch).
    assert names_per_mesh(program) == [
        ["s0_fwd_loop", "s0_fwd", "s0_bwd_loop"],
        ["s1_fwd", "s1_fwd_loop"],
    ]
    bodies = {}
    for e in out.jaxpr.jaxpr.eqns:
        if e.primitive is fragment_p and e.params["microbatch"] is not None:
            body = bodies.setdefault(e.params["name"].rsplit("_mb", 1)[0], e.params["jaxpr"])
            assert e.params["jaxpr"] is body
    assert sorted(bodies) == ["s0_bwd", "s0_fwd", "s1_fwd"]


def test_zb_h1_splits_backwards_into_input_and_weight_gradient_fragments():
    meshes = mpmdc.make_meshes(3, {"data": 2})
    _, program = split_program(grad_step("zb-h1"), meshes, [W, W, W], X)
    # split-backward cut the iteration's backwards once, for every microbatch.
    assert "s1_igrad_loop" in names_per_mesh(program)[1]
    assert not any("_bwd_" in n for n in names_per_mesh(program)[1])
    out = schedule(program)
    mesh0, mesh1, mesh2 = names_per_mesh(out)
    # Stage 0 sends no cotangent anywhere: its backward is all weight gradient.
    assert [n for n in mesh0 if "_batch_" not in n] == [
        "s0_fwd",
        "s0_fwd_mb0",
        "s0_fwd_mb1",
        "s0_fwd_mb2",
        "s0_wgrad_mb0",
        "s0_fwd_mb3",
        "s0_wgrad_mb1",
        "s0_wgrad_mb2",
        "s0_wgrad_mb3",
    ]
    # Mesh 1 runs ZB-H1's "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3" (the start
    # of its running sums, s1_fwd, where its first weight gradient needs it).
    assert mesh1 == [
        "s1_fwd_mb0",
        "s1_fwd_mb1",
        "s1_igrad_mb0",
        "s1_fwd_mb2",
        "s1_igrad_mb1",
        "s1_fwd",
        "s1_wgrad_mb0",
        "s1_fwd_mb3",
        "s1_igrad_mb2",
        "s1_wgrad_mb1",
        "s1_igrad_mb3",
        "s1_wgrad_mb2",
        "s1_wgrad_mb3",
    ]
    assert mesh2 == ["s2_fwd", "s2_fwd_mb0", "s2_fwd_mb1", "s2_fwd_mb2", "s2_fwd_mb3"]
    by_name = {e.params["name"]: e for e in out.jaxpr.jaxpr.eqns if e.primitive is fragment_p}
    igrad, wgrad = by_name["s1_igrad_mb2"], by_name["s1_wgrad_mb2"]
    assert (igrad.params["kind"], wgrad.params["kind"]) == ("I", "W")
    # The input-gradient part sends the cotangent to stage 0; the weight gradient stays.
    sent = {
        v
        for e in out.jaxpr.jaxpr.eqns
        if e.primitive is transfer_p and e.params["dst"] == 0
        for v in e.invars
    }
    assert sent & set(igrad.outvars) and not sent & set(wgrad.outvars)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_the_scheduled_program_computes_the_same_numbers(name):
    meshes = mpmdc.make_meshes(3, {"data": 2})
    _, split_ = split_program(grad_step(name), meshes, [W, W, W], X)
    args = jax.tree_util.tree_leaves(([W, W, W], X))
    with jax.disable_jit():  # the loop, op by op as the scheduled program is evaluated
        want = jax.tree_util.tree_leaves(grad_step(name)([W, W, W], X))
    got = jcore.jaxpr_as_fun(schedule(split_).jaxpr)(*args)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
        assert float(jnp.abs(g).sum()) > 0


def test_a_schedule_breaking_a_dependency_is_a_schedule_error(meshes2):
    _, program = split_program(grad_step("1f1b"), meshes2, [W, W], X)
    broken = ActionLists(["0B0 0F0 0F1 0F2 0F3 0B1 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"])
    with pytest.raises(
        ScheduleError, match="mesh 0 runs 0B0 before 0F0, which 0B0 needs; put 0F0 first"
    ):
        schedule(planned(program, broken))
    missing = ActionLists(["0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3"])
    with pytest.raises(ScheduleError, match="the schedule never runs 1B3"):
        schedule(planned(program, missing))
    # A user's list that respects the dependencies orders the calls as it says.
    own = ActionLists(["0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"])
    mesh0, _ = names_per_mesh(schedule(planned(program, own)))
    assert [n for n in mesh0 if "_batch_" not in n][1:] == [
        "s0_fwd_mb0",
        "s0_fwd_mb1",
        "s0_fwd_mb2",
        "s0_bwd_mb0",
        "s0_fwd_mb3",
        "s0_bwd_mb1",
        "s0_bwd_mb2",
        "s0_bwd_mb3",
    ]


def test_a_program_without_a_loop_keeps_its_calls_and_is_scheduled(meshes2):
    _, program = split_program(jax.grad(mlp_loss), meshes2, [W, W], X)
    assert program.schedule is None and program.phase is Phase.SPLIT
    scheduled = schedule(program)
    assert scheduled.jaxpr is program.jaxpr and scheduled.phase is Phase.SCHEDULED


def test_a_rolled_loop_cuts_a_stages_backward_for_every_microbatch_or_none(meshes2):
    program = mpmdc.compile(grad_step("1f1b"), meshes2, passes=[]).lower([W, W], X)
    program = split(partition(dce(inline(program.program("after-plan")))))
    mixed = ActionLists(["0F0 0F1 0F2 0F3 0I0 0W0 0B1 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"])
    with pytest.raises(
        ScheduleError, match=r"stage 0's backward as I and W for microbatches \[0\] and as B"
    ):
        split_backward(planned(program, mixed))
    every = ActionLists(
        ["0F0 0F1 0F2 0F3 0I0 0I1 0I2 0I3 0W0 0W1 0W2 0W3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"]
    )
    names = names_per_mesh(schedule(split_backward(planned(program, every))))[0]
    assert names[-4:] == [f"s0_wgrad_mb{i}" for i in range(4)]
