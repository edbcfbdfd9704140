"""The ``inline`` pass (``mpmdc.passes.inline``) on small hand-written programs.

What it promises: call sites (``jit``, ``checkpoint``...) whose bodies hold a stage
marker are flattened so the markers become top-level equations; calls without markers
stay whole; a marker inside a loop, conditional or ``shard_map`` body is a
``PlacementError`` naming its source line; equations taken out of a ``checkpoint`` body
are tagged as rematerialized, and a checkpoint's recomputed marker reads the value that
entered the stage in the forward.
"""

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import input_program
from jax.extend import core as jcore
from mpmdc.passes import inline

import mpmdc
from mpmdc.errors import PlacementError
from mpmdc.ir.program import is_rematerialized

X = jnp.arange(32.0).reshape(4, 8) / 32
W = jnp.eye(8) * 0.5


def prims(program):
    """The top-level primitive names, in order."""
    return [e.primitive.name for e in program.jaxpr.jaxpr.eqns]


def markers(program):
    """``(stage, transpose)`` of each top-level stage marker, in order."""
    return [
        (e.params["stage"], e.params["transpose"])
        for e in program.jaxpr.jaxpr.eqns
        if e.primitive.name == "stage"
    ]


def evaluated(program, *args):
    return jcore.jaxpr_as_fun(program.jaxpr)(*jax.tree_util.tree_leaves(args))


@jax.jit
def stage1_layer(x, w):
    return jnp.tanh(mpmdc.stage(x, 1) @ w)


def two_stages_through_a_jitted_helper(w, x):
    y = jnp.sin(mpmdc.stage(x, 0))
    return jnp.sum(stage1_layer(y, w) + jax.jit(jnp.cos)(y))


def test_a_jitted_call_holding_a_marker_is_flattened(meshes2):
    program = input_program(two_stages_through_a_jitted_helper, meshes2, W, X)
    assert prims(program) == ["stage", "sin", "jit", "jit", "add", "reduce_sum"]
    assert markers(program) == [(0, 0)]  # stage 1's marker is hidden in the helper

    out = inline(program)
    # The helper's body (marker, matmul, tanh) now sits at the top level, in place.
    assert prims(out) == [
        "stage",
        "sin",
        "stage",
        "dot_general",
        "tanh",
        "jit",
        "add",
        "reduce_sum",
    ]
    assert markers(out) == [(0, 0), (1, 0)]
    # Same inputs, same numbers.
    assert len(out.jaxpr.jaxpr.invars) == len(program.jaxpr.jaxpr.invars)
    np.testing.assert_array_equal(evaluated(out, W, X)[0], evaluated(program, W, X)[0])


def test_a_call_without_markers_stays_whole(meshes2):
    out = inline(input_program(two_stages_through_a_jitted_helper, meshes2, W, X))
    (call,) = [e for e in out.jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
    assert call.params["name"] == "cos"
    assert [e.primitive.name for e in call.params["jaxpr"].jaxpr.eqns] == ["cos"]
    # A program without any marker comes out with the same equations.
    plain = input_program(lambda x: jax.jit(jnp.sin)(x) * 2, meshes2, X)
    assert prims(inline(plain)) == prims(plain) == ["jit", "mul"]


def _line_of(fn, text):
    """``file:line`` of the line of ``fn``'s source containing ``text``."""
    lines, first = inspect.getsourcelines(fn)
    (offset,) = [k for k, line in enumerate(lines) if text in line]
    return f"{os.path.basename(__file__)}:{first + offset}:"


def marker_in_scan(x):
    def step(carry, _):
        return mpmdc.stage(carry, 1) * 2, None  # the marker the error names

    return jax.lax.scan(step, x, None, length=3)[0]


def marker_in_cond(x):
    return jax.lax.cond(x[0, 0] > 0, lambda v: mpmdc.stage(v, 1) * 2, lambda v: v, x)


def marker_in_fori_loop(x):
    return jax.lax.fori_loop(0, 2, lambda i, v: mpmdc.stage(v, 1) * 2, x)


def marker_in_while_loop(x):
    return jax.lax.while_loop(lambda v: v[0, 0] < 4, lambda v: mpmdc.stage(v, 1) * 2, x)


@pytest.mark.parametrize(
    "fn,where,advice",
    [
        (marker_in_scan, "inside `scan`", "write mpmdc.stage(h, every=k) in its body"),
        (marker_in_cond, "inside `cond`", "Move mpmdc.stage(...) before or after the `cond`"),
        (
            marker_in_fori_loop,
            "inside `scan` (jax.lax.scan, lax.map, or fori_loop with static bounds)",
            "write mpmdc.stage(h, every=k) in its body",
        ),
        (
            marker_in_while_loop,
            "inside `while` (jax.lax.while_loop, or fori_loop with traced bounds)",
            "Move mpmdc.stage(...) before or after the `while`",
        ),
    ],
)
def test_a_marker_inside_a_loop_or_cond_names_its_line(meshes2, fn, where, advice):
    program = input_program(fn, meshes2, X)
    with pytest.raises(PlacementError) as info:
        inline(program)
    message = str(info.value)
    assert message.startswith("mpmdc.stage(..., 1) at ")
    assert _line_of(fn, "mpmdc.stage(") in message
    assert where in message and advice in message


def stage1_checkpointed(w, x):
    x = mpmdc.stage(x, 0)

    @jax.checkpoint
    def body(x):
        return jnp.tanh(mpmdc.stage(jnp.sin(x @ w), 1))

    return jnp.sum(body(x))


def test_checkpoint_bodies_are_marked_rematerialized(meshes2):
    program = input_program(jax.grad(stage1_checkpointed), meshes2, W, X)
    # Under grad the checkpoint is one remat2 call holding the recomputation and the backward.
    assert prims(program) == [
        "stage",
        "dot_general",
        "sin",
        "stage",
        "tanh",
        "reduce_sum",
        "broadcast_in_dim",
        "remat2",
    ]

    out = inline(program)
    tagged = [(e.primitive.name, is_rematerialized(e)) for e in out.jaxpr.jaxpr.eqns]
    forward = [
        ("stage", False),
        ("dot_general", False),
        ("sin", False),
        ("stage", False),
        ("tanh", False),
        ("reduce_sum", False),
        ("broadcast_in_dim", False),
    ]
    # The body, inlined and tagged; its recomputed stage-1 marker is gone (next test).
    body = [
        "dot_general",
        "sin",
        "cos",
        "tanh",
        "sub",
        "mul",
        "mul",
        "add_any",
        "stage",
        "mul",
        "dot_general",
        "transpose",
    ]
    assert tagged == forward + [(name, True) for name in body]
    np.testing.assert_array_equal(evaluated(out, W, X)[0], evaluated(program, W, X)[0])


def test_a_recomputed_marker_reads_the_value_that_entered_the_stage(meshes2):
    out = inline(input_program(jax.grad(stage1_checkpointed), meshes2, W, X))
    eqns = out.jaxpr.jaxpr.eqns
    assert markers(out) == [(0, 0), (1, 0), (1, 1)]
    (entering,) = [
        e for e in eqns if e.primitive.name == "stage" and e.params == {"stage": 1, "transpose": 0}
    ]
    # The recomputed tanh reads what entered stage 1 in the forward, not a recomputation.
    (recomputed_tanh,) = [e for e in eqns if e.primitive.name == "tanh" and is_rematerialized(e)]
    assert recomputed_tanh.invars == entering.outvars
