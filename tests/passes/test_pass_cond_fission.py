"""The ``cond-fission`` pass (``mpmdc.passes.cond_fission``) and what it is for: an
optimizer wrapped in one conditional keeps every stage's state on its own mesh.

What it promises: a ``cond`` whose results share no non-scalar work becomes one
conditional per group of results, each reading only what its branches need, with the
same values (scalar work repeated), and a result every branch returns as one operand
is that operand; arrays sharing only scalar reductions (a global
norm) in elementwise branches become selects; results sharing an array, and
conditionals with effects, stay together; a conditional left reading several meshes' arrays is a
``PlacementWarning`` naming it. With ``partition``'s placement of state made from no
parameter (kin by pytree path), every stage's optimizer state stays on its mesh.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_same_array, input_program, mesh_index
from mpmdc.passes import cond_fission

import mpmdc
from mpmdc.errors import PlacementWarning


def conds(program):
    return [e for e in program.jaxpr.jaxpr.eqns if e.primitive.name == "cond"]


def run(program, *args):
    return jax.core.eval_jaxpr(program.jaxpr.jaxpr, program.jaxpr.consts, *args)


A, B, C = jnp.arange(6.0).reshape(2, 3), jnp.ones((3,)), jnp.full((4,), 2.0)


def test_independent_results_become_conditionals_of_their_own(meshes2):
    def fn(flag, a, b, c, n):
        def apply(a, b, c, n):
            scale = 1.0 / (1.0 + n)  # scalar work both groups use: repeated
            return a * scale, jnp.sin(b) * scale, c + 1.0

        return jax.lax.cond(flag, apply, lambda a, b, c, n: (a, b, c), a, b, c, n)

    args = (True, A, B, C, 3.0)
    before = input_program(fn, meshes2, *args)
    after = cond_fission(before)
    assert len(conds(before)) == 1
    assert [len(e.outvars) for e in conds(after)] == [1, 1, 1]
    # Each reads the index and only the operands its branches need.
    assert [len(e.invars) for e in conds(after)] == [3, 3, 2]
    for flag in (True, False):
        for got, want in zip(run(after, flag, *args[1:]), run(before, flag, *args[1:])):
            assert_same_array(got, want, rtol=0, atol=0)


def test_a_result_every_branch_returns_as_one_operand_is_that_operand(meshes2):
    """A weight both branches pass through (a residual JAX's linearization forwards) is
    the operand itself: a conditional of its own would be placed by its index alone.
    The rest stays one conditional, and later readers read the operand."""

    def fn(flag, a, b):
        out, kept = jax.lax.cond(
            flag, lambda a, b: (jnp.tanh(a), b), lambda a, b: (jnp.sin(a), b), a, b
        )
        return out, kept * 2.0, kept

    before = input_program(fn, meshes2, True, A, B)
    after = cond_fission(before)
    assert [len(e.outvars) for e in conds(after)] == [1]
    b = after.jaxpr.jaxpr.invars[2]
    assert after.jaxpr.jaxpr.outvars[2] is b
    assert any(b in e.invars for e in after.jaxpr.jaxpr.eqns if e.primitive.name == "mul")
    for flag in (True, False):
        for got, want in zip(run(after, flag, A, B), run(before, flag, A, B)):
            assert_same_array(got, want, rtol=0, atol=0)


def test_results_sharing_an_array_stay_together(meshes2):
    def fn(flag, a, b):
        def apply(a, b):
            shared = jnp.tanh(b)
            return a * shared, b + shared

        return jax.lax.cond(flag, apply, lambda a, b: (a, b), a, b)

    after = cond_fission(input_program(fn, meshes2, True, A, B))
    assert [len(e.outvars) for e in conds(after)] == [2]


def test_arrays_sharing_only_a_scalar_reduction_are_selected_not_branched(meshes2):
    """A global norm inside a branch: every result needs every array's partial sum, so
    no cut keeps a conditional per array; elementwise branches become selects."""

    def fn(flag, a, b):
        def clipped(a, b):
            norm = jnp.sqrt(jnp.sum(a * a) + jnp.sum(b * b))
            return a / norm, b / norm

        return jax.lax.cond(flag, clipped, lambda a, b: (a, b), a, b)

    before = input_program(fn, meshes2, True, A, B)
    after = cond_fission(before)
    assert conds(after) == []
    assert [e.primitive.name for e in after.jaxpr.jaxpr.eqns].count("select_n") == 2
    # eval_jaxpr runs the selects' work op by op and the cond as one XLA computation:
    # 1 float32 ulp apart (9.1e-8 relative measured, as jax.jit against eager of the
    # same division); 2 ulps allowed.
    for flag in (True, False):
        for got, want in zip(run(after, flag, A, B), run(before, flag, A, B)):
            assert_same_array(got, want, rtol=2.4e-7, atol=0)


def test_a_branch_that_calls_out_is_not_run_when_not_taken(meshes2):
    """A callback (no declared effect) in a branch sharing a global sum: predicating it
    would call it whichever branch is taken; the group stays a conditional."""

    def checked(v):
        if (v < 0).any():
            raise ValueError("the untaken branch ran")
        return v

    def fn(flag, a, b):
        def apply(a, b):
            total = jnp.sum(a) + jnp.sum(b)
            a = jax.pure_callback(checked, jax.ShapeDtypeStruct(a.shape, a.dtype), a)
            return a / total, b / total

        return jax.lax.cond(flag, apply, lambda a, b: (a, b), a, b)

    after = cond_fission(input_program(fn, meshes2, True, A, B))
    assert [e.primitive.name for e in after.jaxpr.jaxpr.eqns].count("select_n") == 0
    got = run(after, False, -A, B)
    assert_same_array(got[0], -A, rtol=0, atol=0)


def test_a_conditional_with_effects_stays_whole(meshes2):
    def fn(flag, a, b):
        def apply(a, b):
            jax.debug.print("applied {}", a.sum())
            return a * 2, b * 2

        return jax.lax.cond(flag, apply, lambda a, b: (a, b), a, b)

    after = cond_fission(input_program(fn, meshes2, True, A, B))
    assert [len(e.outvars) for e in conds(after)] == [2]


def _loss(params, x):
    for i, p in enumerate(params):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.mean(x**2)


def _skip_step(optimizer):
    """A user's own skip-step: apply the update only where the loss is finite."""

    def update(grads, state, params, loss):
        updates, new_state = optimizer.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        return jax.lax.cond(
            jnp.isfinite(loss), lambda: (new_params, new_state), lambda: (params, state)
        )

    return update


OPTIMIZERS = {
    "multi_steps": optax.MultiSteps(optax.adam(1e-2), 2),
    "apply_if_finite": optax.apply_if_finite(optax.adam(1e-2), 3),
    # A global norm inside the conditional: per-stage partial norms, selects per leaf.
    "multi_steps_clipped": optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 2
    ),
    # A conditional inside the conditional, and `jnp.array` of one flag per leaf.
    "multi_steps_apply_if_finite": optax.MultiSteps(
        optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 3),
        2,
    ),
    # No control flow, but state leaves made from no gradient (placeholders (1,) for the
    # moments a factored parameter does not keep): they go with their parameter.
    "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "switch_schedule": optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.join_schedules(
            [optax.constant_schedule(0.1), optax.constant_schedule(0.01)], [1]
        )
    ),
}


@pytest.mark.parametrize("name", [*OPTIMIZERS, "skip_step"])
@pytest.mark.slow
def test_each_stage_keeps_its_state_whatever_the_optimizer(meshes4, name):
    params = [{"w": jnp.eye(8) * 0.1 * (i + 1), "b": jnp.full((8,), 0.01 * i)} for i in range(4)]
    x = jnp.linspace(-1, 1, 32).reshape(4, 8)
    optimizer = OPTIMIZERS.get(name, optax.adam(1e-2))

    def step(params, state, x):
        loss, grads = jax.value_and_grad(_loss)(params, x)
        if name == "skip_step":
            params, state = _skip_step(optimizer)(grads, state, params, loss)
        else:
            updates, state = optimizer.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return loss, params, state

    state = optimizer.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        compiled = mpmdc.compile(step, meshes4)
        got = compiled(params, state, x)
    # The transfer report shows it too: of the state, only scalars (step counters, the
    # predicate's inputs) move.
    report = compiled.lower(params, state, x).transfer_report()
    moved = [(link.values[1], link.bytes[1]) for link in report.links]
    assert sum(b for _, b in moved) <= 8 * sum(n for n, _ in moved), report
    want = jax.jit(step)(params, state, x)
    # Bitwise but for apply_if_finite, whose cut branch bodies XLA fuses otherwise: one
    # float32 ulp measured (3.0e-8 absolute on values near 1e-2, 9.3e-8 relative); the
    # tolerance is 10x that. (MultiSteps around it measured bitwise.)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_same_array(g, w, rtol=1e-6, atol=3e-7)
    # Every parameter and every optimizer-state leaf of stage i's shape lives on mesh i.
    new_params, new_state = got[1], got[2]
    for i, p in enumerate(new_params):
        assert {mesh_index(a, meshes4) for a in jax.tree.leaves(p)} == {i}
    for path, leaf in jax.tree_util.tree_leaves_with_path(new_state):
        # (The stage is the list index right above the leaf's dict key: ``mu[1]['b']``.)
        stage = next(
            (k.idx for k in reversed(path) if isinstance(k, jax.tree_util.SequenceKey)), None
        )
        if leaf.ndim and stage is not None:
            assert mesh_index(leaf, meshes4) == stage, jax.tree_util.keystr(path)


def test_a_conditional_sharing_work_across_meshes_is_named_in_a_warning(meshes2):
    def step(ws, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ ws[0])
        h = jnp.tanh(mpmdc.stage(h, 1) @ ws[1])
        # A matrix product of both stages' weights inside a branch: no cut, no select.
        mixed = jax.lax.cond(
            jnp.sum(h) > 0, lambda a, b: (a @ b, b @ a), lambda a, b: (a, b), ws[0], ws[1]
        )
        return jnp.sum(h), mixed

    ws = [jnp.eye(16) * 0.5, jnp.eye(16) * 0.25]
    with pytest.warns(
        PlacementWarning,
        match=r"`cond` at .*runs on mesh\d and reads arrays living on mesh\d every call "
        r"\(the largest: args\[0\]\[\d\], float32\[16,16\]\)",
    ):
        lowered = mpmdc.compile(step, meshes2).lower(ws, jnp.ones((4, 16)))
    # ... and the transfer report shows a stage's weight moved for it.
    assert lowered.transfer_report().total("parameters/optimizer state") > 0


def test_a_conditional_reading_a_few_elements_of_another_mesh_is_not_warned_about(meshes2):
    """A loop reading a few coefficients kept on another mesh (Muon's Newton–Schulz
    coefficients, one array of 3 for every parameter) moves them as a scalar moves:
    nothing to warn about."""

    def step(ws, coefficients, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ ws[0])
        h = jnp.tanh(mpmdc.stage(h, 1) @ ws[1] * coefficients[0])

        def orthogonalize(w):
            return jax.lax.fori_loop(0, 2, lambda _, a: a @ a.T @ a * jnp.sum(coefficients), w)

        return jnp.sum(h), [orthogonalize(w) for w in ws]

    ws = [jnp.eye(16) * 0.5, jnp.eye(16) * 0.25]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        mpmdc.compile(step, meshes2).lower(ws, jnp.ones(3), jnp.ones((4, 16)))
