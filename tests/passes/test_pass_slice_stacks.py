"""The ``slice-stacks`` pass (``mpmdc.passes.slice_stacks``).

What it promises: after ``split-scans``, a program input the stages' scans read as rows
becomes one input per stage (``in_pieces`` saying which rows of which argument), as
does an input that work on a stacked value reads whole beside it (an optimizer state);
a slice taking one stage's rows of the stages' concatenated results is that stage's
piece; elementwise work on stacked values runs per piece, a reduction across the stacked
axis adds per-piece partial results; a stacked result is returned in pieces
(``out_pieces``); the program computes what it did. Where the pieces cannot be one
array over the stage meshes (uneven groups), the input stays whole with one warning.
"""

import importlib

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_array, input_program
from mpmdc.passes import dce, inline, slice_stacks, split_scans

import mpmdc
from mpmdc.errors import PlacementWarning
from mpmdc.ir.program import Piece

# (the package's ``slice_stacks`` is the pass; its module holds the walk)
slice_stacks_module = importlib.import_module("mpmdc.passes.slice_stacks")

WS = jax.random.normal(jax.random.key(0), (8, 4, 4)) * 0.5
X = jnp.ones((2, 4))


def adam_like_step(ws, moment, x, every=2):
    """A gradient step through a scanned stack: a moment updated elementwise beside the
    gradient, the update scaled by a global norm."""

    def loss(ws):
        def layer(h, w):
            return jnp.tanh(mpmdc.stage(h, every=every) @ w), None

        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    grad = jax.grad(loss)(ws)
    moment = 0.9 * moment + 0.1 * grad
    norm = jnp.sqrt(jnp.sum(grad**2))
    return ws - 0.1 * moment / (norm + 1.0), moment


def sliced(fn, meshes, *args):
    before = dce(split_scans(inline(input_program(fn, meshes, *args))))
    return before, dce(slice_stacks(before))


def run(program, *args):
    return jax.core.eval_jaxpr(program.jaxpr.jaxpr, program.jaxpr.consts, *args)


def pieces_of(program, args):
    """The program's inputs from the caller's arguments (``in_pieces``)."""
    out = []
    for piece in program.in_pieces:
        x = args[piece.leaf]
        if piece.rows is None:
            out.append(x)
        else:
            axis, lo, hi = piece.rows
            out.append(jax.lax.slice_in_dim(x, lo, hi, axis=axis))
    return out


@pytest.mark.slow
def test_stacked_inputs_results_and_state_are_held_in_pieces(meshes4):
    moment = jnp.zeros_like(WS)
    before, after = sliced(adam_like_step, meshes4, WS, moment, X)
    rows = [Piece(leaf, (0, 2 * i, 2 * i + 2)) for leaf in (0, 1) for i in range(4)]
    assert after.in_pieces == (*rows, Piece(2))
    assert after.out_pieces == tuple(rows)
    assert after.in_paths[1] == "args[0][2:4]"
    # Nothing gathers the stack: no concatenation is left, and no slice of one.
    names = [e.primitive.name for e in after.jaxpr.jaxpr.eqns]
    assert "concatenate" not in names
    # The global norm: a partial sum per stage, then three additions.
    assert names.count("reduce_sum") == 4
    got = run(after, *pieces_of(after, (WS, moment, X)))
    want = run(before, WS, moment, X)
    for k, leaf in enumerate(want):
        parts = [g for g, piece in zip(got, after.out_pieces) if piece.leaf == k]
        assert_same_array(jnp.concatenate(parts), leaf, rtol=1e-6)


def test_a_stack_that_cannot_be_one_array_stays_whole_with_one_warning(meshes4):
    moment = jnp.zeros_like(WS)
    uneven = lambda ws, m, x: adam_like_step(ws, m, x, every=(3, 3, 1, 1))  # noqa: E731
    with pytest.warns(PlacementWarning, match=r"different numbers of rows \(\[3, 3, 1, 1\]\)"):
        _, after = sliced(uneven, meshes4, WS, moment, X)
    assert after.in_pieces is None or all(p.rows is None for p in after.in_pieces)


def test_walks_that_keep_asking_for_values_of_their_own_making_stop_with_an_error(
    meshes4, monkeypatch
):
    """A walk asking for a value only that walk made (a rule's fresh variable) would be
    asked again by every later walk: the pass stops, naming it, rather than loop."""
    walk_once = slice_stacks_module._walk

    def asking_for_its_own(*args):
        walk, new_inputs = walk_once(*args)
        fresh = jax.extend.core.Var(WS.aval)  # made by this walk, unknown to the next
        walk.demands[fresh] = next(iter(walk.stacks.values())).layout
        return walk, new_inputs

    monkeypatch.setattr(slice_stacks_module, "_walk", asking_for_its_own)
    with pytest.raises(
        RuntimeError, match=r"never settle: .* still asked for a float32\[8,4,4\] value"
    ):
        sliced(adam_like_step, meshes4, WS, jnp.zeros_like(WS), X)


@jax.jit
def keep_if(ok, new, old):
    """``new`` if ``ok`` else ``old``, by a conditional whose first result nothing reads
    (a dropped output in the body of a call made twice with one jaxpr)."""
    return jax.lax.cond(ok, lambda: (new + 1.0, new), lambda: (old + 1.0, old))[1]


def skip_step(guard):
    """``adam_like_step`` whose results are kept only when the update is finite, by
    ``jnp.where`` (a ``jit`` call), ``lax.cond``, or a jitted guard called per result."""

    def step(ws, moment, x):
        new_ws, new_moment = adam_like_step(ws, moment, x)
        ok = jnp.all(jnp.isfinite(new_ws))
        if guard == "where":
            return jnp.where(ok, new_ws, ws), jnp.where(ok, new_moment, moment)
        if guard == "jitted_cond":
            return keep_if(ok, new_ws, ws), keep_if(ok, new_moment, moment)
        return jax.lax.cond(ok, lambda: (new_ws, new_moment), lambda: (ws, moment))

    return step


@pytest.mark.parametrize(
    "guard",
    [
        pytest.param("where", marks=pytest.mark.slow),
        "cond",
        pytest.param("jitted_cond", marks=pytest.mark.slow),
    ],
)
def test_a_skip_step_guard_on_a_stacked_update_keeps_it_in_pieces(meshes4, guard):
    """A skip-step guard on a stack's update (optax's ``apply_if_finite`` and
    ``MultiSteps`` decide in one ``lax.cond``) runs per piece: the ``jit`` call's body,
    and the conditional's branches with one ``select_n`` per result, each piece's on its
    stage; nothing reads the stack whole."""
    moment = jnp.zeros_like(WS)
    before, after = sliced(skip_step(guard), meshes4, WS, moment, X)
    rows = [Piece(leaf, (0, 2 * i, 2 * i + 2)) for leaf in (0, 1) for i in range(4)]
    assert after.in_pieces == (*rows, Piece(2))
    assert after.out_pieces == tuple(rows)
    names = [e.primitive.name for e in after.jaxpr.jaxpr.eqns]
    assert "concatenate" not in names and "cond" not in names
    assert names.count("select_n") == 8  # one per piece of each result
    got = run(after, *pieces_of(after, (WS, moment, X)))
    want = run(before, WS, moment, X)
    for k, leaf in enumerate(want):
        parts = [g for g, piece in zip(got, after.out_pieces) if piece.leaf == k]
        assert_same_array(jnp.concatenate(parts), leaf)
