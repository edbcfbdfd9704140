"""The ``partition`` pass (``mpmdc.passes.partition``) on small hand-written programs.

What it promises: every equation gets a placement (stage, transpose count, microbatch);
markers seed the stages and the work after a marker follows it; what no marker places
runs in the first stage; cheap equations (constants, broadcasts of small values) are
cloned into each stage using them instead of being moved; a backward equation runs on
its forward stage's mesh; gradient contributions are summed where the parameter lives;
inside an ``accumulate`` loop each equation gets its microbatch; inputs live with their
earliest user and outputs where they are made.
"""

import jax
import jax.numpy as jnp
from helpers import assert_same_as_jit, assert_same_tree, input_program, mesh_index, mlp_loss
from mpmdc.passes import dce, inline, partition, split, vma_typecheck
from mpmdc.passes.partition import (
    follow_operands,
    follow_users,
    place_by_bytes,
    place_by_min_cut,
    place_cuts,
    placement_state,
)

import mpmdc
from mpmdc.ir.primitives import fragment_p, transfer_p
from mpmdc.ir.program import Placement

WS = [jnp.eye(8) * 0.5 + 0.01 * i for i in range(4)]
X = jnp.arange(32.0).reshape(4, 8) / 32
W = jnp.eye(8) * 0.5


def placed(fn, meshes, *args, **kwargs):
    """The program after inline and partition, run by calling the passes directly."""
    program = input_program(fn, meshes, *args, **kwargs)
    return partition(dce(inline(program)))


def labelled(program):
    """``(primitive, placement label)`` per top-level equation, in order."""
    return [
        (e.primitive.name, p.label) for e, p in zip(program.jaxpr.jaxpr.eqns, program.placements)
    ]


def test_markers_seed_stages_and_every_equation_is_placed(meshes2):
    def fn(w, x):
        a = jnp.sin(mpmdc.stage(x, 0))
        b = jnp.tanh(mpmdc.stage(a, 1) @ w)
        return jnp.sum(b), a

    program = placed(fn, meshes2, W, X)
    assert labelled(program) == [
        ("stage", "s0_fwd"),
        ("sin", "s0_fwd"),
        ("stage", "s1_fwd"),
        ("dot_general", "s1_fwd"),
        ("tanh", "s1_fwd"),
        ("reduce_sum", "s1_fwd"),
    ]
    # w lives with its only user (stage 1), x with stage 0; each output where it is made.
    assert program.in_meshes == (1, 0)
    assert program.out_meshes == (1, 0)

    # Without markers everything runs in the first stage.
    plain = placed(lambda x: jnp.sin(x) * 2, meshes2, X)
    assert labelled(plain) == [("sin", "s0_fwd"), ("mul", "s0_fwd")]
    assert plain.in_meshes == plain.out_meshes == (0,)


def test_a_broadcast_of_a_constant_used_on_two_meshes_is_cloned(meshes2):
    def fn(x):
        c = jnp.full((4, 8), 2.0)  # broadcast_in_dim of a literal: cheap
        a = mpmdc.stage(x, 0) * c
        return mpmdc.stage(a, 1) + c

    program = placed(fn, meshes2, X)
    assert labelled(program) == [
        ("broadcast_in_dim", "s0_fwd"),  # one clone per stage using it...
        ("broadcast_in_dim", "s1_fwd"),
        ("stage", "s0_fwd"),
        ("convert_element_type", "s0_fwd"),
        ("mul", "s0_fwd"),
        ("stage", "s1_fwd"),
        ("convert_element_type", "s1_fwd"),
        ("add", "s1_fwd"),
    ]
    eqns = program.jaxpr.jaxpr.eqns
    clone0, clone1 = eqns[0].outvars[0], eqns[1].outvars[0]
    assert clone0 is not clone1  # ...each with its own result, read only in its stage
    assert eqns[3].invars == [clone0] and eqns[6].invars == [clone1]


def test_cheap_constants_are_cloned_not_transferred(meshes2):
    def fn(x):
        c = jax.lax.broadcasted_iota(jnp.float32, (4, 8), 1) * 2.0  # from nothing: cheap
        a = mpmdc.stage(x, 0) * c
        b = mpmdc.stage(a, 1) + c
        return b

    program = vma_typecheck(split(dce(placed(fn, meshes2, X))))
    iotas = [
        e.params["name"]
        for e in program.jaxpr.jaxpr.eqns
        if e.primitive is fragment_p
        for inner in e.params["jaxpr"].jaxpr.eqns
        if inner.primitive.name == "iota"
    ]
    assert sorted(iotas) == ["s0_fwd", "s1_fwd"]
    transfers = [e for e in program.jaxpr.jaxpr.eqns if e.primitive is transfer_p]
    assert len(transfers) == 1 and len(transfers[0].invars) == 1


def test_a_constant_constrained_to_a_mesh_runs_there_not_cloned_to_its_users(meshes2):
    """A constraint on a constant (the transpose of a constraint, reading the constant
    cotangent of a sum) is bound to its mesh: not cloned next to its user in another
    stage, where it would run on the wrong mesh (found by the fuzzer, seed 11)."""
    on_mesh1 = jax.sharding.NamedSharding(meshes2[1], jax.sharding.PartitionSpec())

    def loss(x):
        y = mpmdc.stage(x, 0) * 3.0
        return jnp.sum(jax.lax.with_sharding_constraint(y, on_mesh1))

    program = placed(jax.grad(loss), meshes2, X)
    assert labelled(program) == [
        ("reshard", "s1_fwd"),  # (the cotangent 1.0, cloned where it is read)
        ("broadcast_in_dim", "s1_fwd"),
        ("sharding_constraint", "s1_fwd"),  # on mesh1, its result sent to stage 0's backward
        ("mul", "s0_bwd"),
        ("stage", "s0_bwd"),
    ]
    vma_typecheck(split(program))
    assert_same_as_jit(jax.grad(loss), meshes2, X)


def test_gradients_from_several_meshes_sum_where_the_parameter_lives(meshes4):
    def fn(w, x):
        a = jnp.tanh(mpmdc.stage(x, 0) @ w)
        b = jnp.tanh(mpmdc.stage(a, 1) @ w)  # w is used by stages 0, 1 and 2
        c = jnp.tanh(mpmdc.stage(b, 2) @ w)
        return jnp.sum(c)

    w = jnp.eye(8) * 0.3
    _, grad = assert_same_as_jit(jax.value_and_grad(fn), meshes4, w, X)
    assert mesh_index(grad, meshes4) == 0
    program = placed(jax.value_and_grad(fn), meshes4, w, X)
    assert program.in_meshes[0] == 0
    add_any = [
        p
        for e, p in zip(program.jaxpr.jaxpr.eqns, program.placements)
        if e.primitive.name == "add_any"
    ]
    assert add_any[-1].stage == 0
    # Each other stage's contribution crosses once (summed on its way to stage 0), and
    # the weight once to each other stage: no more bytes than summing at stage 0.
    split = mpmdc.compile(jax.value_and_grad(fn), meshes4).lower(w, X).program("after-split")
    moved = [
        v.aval.shape for e in split.jaxpr.jaxpr.eqns if e.primitive is transfer_p for v in e.invars
    ]
    assert sorted(moved).count(w.shape) == 4


def test_backward_runs_on_the_forward_stage_mesh(meshes4):
    program = placed(jax.grad(mlp_loss), meshes4, WS, X)
    for eqn, p in zip(program.jaxpr.jaxpr.eqns, program.placements):
        if eqn.primitive.name == "stage":
            assert p == Placement(eqn.params["stage"], max(p.transpose, eqn.params["transpose"]))
    labels = {p.label for p in program.placements}
    assert {"s0_fwd", "s3_fwd", "s2_bwd", "s0_bwd"} <= labels


def test_work_inside_an_accumulate_loop_belongs_to_its_iteration(meshes2):
    def fn(w, x):
        return mpmdc.accumulate(
            lambda xb: jnp.sum(jnp.sin(mpmdc.stage(xb, 0) @ w)), x, microbatches=2
        )

    assert labelled(placed(fn, meshes2, W, X)) == [
        ("loop_edge", "s0_fwd"),  # the batch's slices enter the loop
        ("stage", "s0_fwd_loop"),  # one microbatch's work, standing for every microbatch
        ("dot_general", "s0_fwd_loop"),
        ("sin", "s0_fwd_loop"),
        ("reduce_sum", "s0_fwd_loop"),
        ("broadcast_in_dim", "s0_fwd"),  # the running sum's zeros, before the loop
        ("reshape", "s0_fwd"),
        ("loop_edge", "s0_fwd"),  # ...entering it as the running sum
        ("add", "s0_fwd_loop"),  # the running sum moves from one microbatch to the next
        ("loop_edge", "s0_fwd_loop"),  # the loop's result leaves the iteration
    ]


def test_a_cast_of_a_loops_result_runs_after_the_loop(meshes2):
    """The mean of int8 counts: the cast of the running sum to float32 is cheap (four
    times larger than what it reads) and makes an output; it runs after the loop, not
    in the iteration, which reads no value of after the loop (the program was
    ill-typed and failed at run time)."""
    x = jnp.arange(16, dtype=jnp.int8)

    def fn(x):
        count = lambda xb: jnp.sum(mpmdc.stage(xb, 0) > 3, dtype=jnp.int8)  # noqa: E731
        return mpmdc.accumulate(count, x, microbatches=4, reduce="mean")

    assert labelled(placed(fn, meshes2, x))[-3:] == [
        ("loop_edge", "s0_fwd_loop"),  # the running sum leaves the iteration
        ("convert_element_type", "s0_fwd"),
        ("div", "s0_fwd"),
    ]
    assert_same_as_jit(fn, meshes2, x)


# ----- the placement steps, each alone on a hand-written program


def _state(fn, meshes, *args):
    """``(names of the top-level equations, their placement state before any step)``."""
    program = dce(inline(input_program(fn, meshes, *args)))
    return [e.primitive.name for e in program.jaxpr.jaxpr.eqns], placement_state(program)


def _unplaced(state):
    return [i for i, s in enumerate(state.stage) if s is None and i not in state.cheap]


def test_follow_operands_runs_work_on_the_stage_its_operands_are_on(meshes2):
    names, state = _state(lambda x: jnp.cos(jnp.sin(mpmdc.stage(x, 1))), meshes2, X)
    members = _unplaced(state)
    assert [names[i] for i in members] == ["sin", "cos"]
    assert follow_operands(state, members, through_boundaries=False)
    assert [state.stage[i] for i in members] == [1, 1]
    assert not follow_operands(state, members, through_boundaries=False)  # nothing left


def test_follow_users_runs_what_prepares_a_markers_input_with_it(meshes2):
    names, state = _state(lambda x: mpmdc.stage(jnp.sin(x), 1) * 2.0, meshes2, X)
    (sin,) = [i for i in _unplaced(state) if names[i] == "sin"]
    # Its operand is a program input, which pulls no work: only its user places it.
    assert not follow_operands(state, [sin], through_boundaries=True)
    assert follow_users(state, [sin]) and state.stage[sin] == 1


def test_place_by_bytes_puts_work_on_a_parameter_where_the_parameter_lives(meshes2):
    def fn(w, x):
        grad = jax.grad(lambda w: jnp.sum(mpmdc.stage(mpmdc.stage(x, 0) @ w, 1)))(w)
        decay = w * 0.01  # reads the parameter alone: no marker places it
        return w - 0.1 * grad - decay

    names, state = _state(fn, meshes2, W, X)
    for t in sorted(set(state.transpose)):
        members = [i for i in _unplaced(state) if state.transpose[i] == t]
        state.settle(members, False)
        state.settle(members, True)
    rest = _unplaced(state)
    assert [names[i] for i in rest] == ["mul"]
    place_by_bytes(state, rest)
    assert state.stage[rest[0]] == 0  # w's first reader is stage 0's matmul


def test_place_cuts_runs_a_cut_of_an_input_where_the_input_lives(meshes2):
    """Stage 0 reads ``w`` whole, stage 1 two of its columns: the slice runs in stage 0,
    where ``w`` lives, so two columns move to stage 1's mesh, not ``w``."""

    def fn(w, x):
        h = mpmdc.stage(x, 0) @ w
        return mpmdc.stage(h, 1) @ w[:, :2]

    names, state = _state(fn, meshes2, W, X)
    cuts = state.cuts()
    assert [names[i] for i in cuts] == ["slice"]
    for t in sorted(set(state.transpose)):
        members = [i for i in _unplaced(state) if state.transpose[i] == t and i not in cuts]
        state.settle(members, False)
        state.settle(members, True)
    place_cuts(state, cuts)
    assert [state.stage[i] for i in cuts] == [0]
    program = split(vma_typecheck(placed(fn, meshes2, W, X)))
    moved = [
        a.aval.shape
        for e in program.jaxpr.jaxpr.eqns
        if e.primitive is transfer_p
        for a in e.invars
    ]
    assert (8, 2) in moved and (8, 8) not in moved, moved


def test_place_by_min_cut_moves_a_chain_after_the_loop_to_where_its_inputs_live(meshes2):
    """The momentum update after the loop, put on stage 1 by hand (one equation at a
    time, each costs about as much on either mesh): the cut moves the whole chain to
    stage 0, where ``w``, its gradient and so ``m`` are, and nothing moves after the
    loop."""

    def fn(w, m, x):
        def grad(xb):
            return jax.grad(lambda w: jnp.sum(mpmdc.stage(mpmdc.stage(xb, 0) @ w, 1) ** 2))(w)

        g = mpmdc.accumulate(grad, x, microbatches=2)
        m = 0.9 * m + g
        return w - 0.1 * m, m

    w, x = jnp.eye(16) * 0.5, jnp.ones((4, 16))  # (more than a few elements: worth a cut)
    names, state = _state(fn, meshes2, w, w, x)
    state.run()
    after = state.after_loop()
    assert [names[i] for i in after] == ["mul", "add", "mul", "sub"]
    assert {state.stage[i] for i in after} == {0}
    for i in after:
        state.stage[i] = 1
    place_by_min_cut(state, after)
    assert {state.stage[i] for i in after} == {0}


def test_a_cut_of_an_input_read_in_the_loop_is_taken_once_before_it(meshes2):
    """A microbatch's work reads two columns of ``w``: they are taken once, before the
    loop, not in every microbatch's iteration."""

    def fn(w, x):
        return mpmdc.accumulate(
            lambda xb: jnp.sum(mpmdc.stage(xb, 0) @ w[:, :2]), x, microbatches=2
        )

    assert ("slice", "s0_fwd") in labelled(placed(fn, meshes2, W, X))  # before the loop
    assert_same_as_jit(fn, meshes2, W, X)


def test_clone_small_values_copies_a_constant_into_each_stage_using_it(meshes2):
    def fn(x):
        c = jnp.full((8,), 2.0)
        return mpmdc.stage(mpmdc.stage(x, 0) * c, 1) + c

    got = labelled(placed(fn, meshes2, X))
    assert ("broadcast_in_dim", "s0_fwd") in got and ("broadcast_in_dim", "s1_fwd") in got


def test_a_tied_weight_lives_with_its_first_stage_and_its_gradients_are_summed_there(meshes2):
    def loss(w, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ w)
        return jnp.sum(mpmdc.stage(h, 1) @ w.T)

    program = placed(jax.grad(loss), meshes2, W, X)
    assert program.in_meshes[0] == 0  # w: read by stages 0 and 1, lives with stage 0
    summed = [label for name, label in labelled(program) if name == "add_any"]
    assert summed and all(label.startswith("s0_") for label in summed)
    assert program.out_meshes == (0,)


def test_a_skip_step_update_keeps_the_momentum_with_its_parameter(meshes2):
    """``w`` lives on mesh 0 (stage 0 reads it) and its gradient is made on mesh 1 (stage
    1 reads ``w + w``). The skip-step conditional becomes a ``select_n`` between each
    state and its update, so the update is not itself a result: it goes where the
    momentum, its kin, will live (with ``w``), as an update returned as is does."""

    def fn(ws, ms, x):
        metric = jnp.sum(jnp.tanh(mpmdc.stage(x, 0) @ ws["w"]))

        def loss(ws):
            return jnp.sum(jnp.tanh(mpmdc.stage(x, 1) @ (ws["w"] + ws["w"]) @ ws["u"]))

        value, grads = jax.value_and_grad(loss)(ws)

        def update(ws, ms):
            norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
            scale = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
            mu = jax.tree.map(lambda m, g: 0.9 * m + scale * g, ms["mu"], grads)
            return jax.tree.map(lambda w, m: w - 0.1 * m, ws, mu), {"mu": mu}

        ws, ms = jax.lax.cond(jnp.isfinite(value), update, lambda *state: state, ws, ms)
        return value, metric, ws, ms

    ws = {"u": W, "w": W}
    compiled = mpmdc.compile(fn, meshes2)
    program = compiled.lower(ws, {"mu": ws}, X).program("after-partition")
    where = dict(zip(program.in_paths, program.in_meshes))
    assert where["args[0]['w']"] == where["args[1]['mu']['w']"] == 0, where
    assert where["args[0]['u']"] == where["args[1]['mu']['u']"] == 1, where
    out = dict(zip(program.out_paths, program.out_meshes))
    assert out["out[2]['w']"] == out["out[3]['mu']['w']"] == 0, out
    # Noise floor: jax.jit against eager (every value materialized, as at a fragment
    # boundary), 1.7e-07 relative; margin 6x.
    got, want = compiled(ws, {"mu": ws}, X), jax.jit(fn)(ws, {"mu": ws}, X)
    assert_same_tree(got, want, rtol=1e-6)
