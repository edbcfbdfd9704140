"""The ``split-scans`` pass (``mpmdc.passes.split_scans``).

What it promises: a scan whose body holds ``mpmdc.stage(h, every=...)`` becomes one
scan per group of its iterations (equal groups, or the given counts), each placed in its
stage (``first`` numbering the first), reading its rows of every per-iteration operand,
handing the carry on, all sharing one body without the markers; the carry is marked
entering each forward group and leaving each transposed one; the transposed scan of a
gradient is cut at the same rows, its groups last first; the program computes what it
did. A scan of no iterations has nothing to cut and stays one scan, unplaced, its
markers removed. A scan without such markers is left as it is.
"""

import jax
import jax.numpy as jnp
from helpers import assert_same_array, input_program
from mpmdc.passes import inline, split_scans

import mpmdc
from mpmdc.ir.program import placement_of

WS = jax.random.normal(jax.random.key(0), (8, 4, 4)) * 0.5
X = jnp.ones((2, 4))


def stacked_loss(ws, x, every=2, first=0):
    def layer(h, w):
        h = mpmdc.stage(h, every=every, first=first)
        return jnp.tanh(h @ w), h

    h, hs = jax.lax.scan(layer, x, ws)
    return jnp.sum(h**2) + jnp.sum(hs)


def cut(fn, meshes, *args):
    before = inline(input_program(fn, meshes, *args))
    return before, split_scans(before)


def run(program, *args):
    return jax.core.eval_jaxpr(program.jaxpr.jaxpr, program.jaxpr.consts, *args)


def scans(program):
    return [e for e in program.jaxpr.jaxpr.eqns if e.primitive.name == "scan"]


def test_a_marked_scan_becomes_one_scan_per_stage_computing_the_same(meshes4):
    before, after = cut(stacked_loss, meshes4, WS, X)
    groups = scans(after)
    assert [e.params["length"] for e in groups] == [2, 2, 2, 2]
    assert [placement_of(e).stage for e in groups] == [0, 1, 2, 3]
    assert len({id(e.params["jaxpr"]) for e in groups}) == 1  # one body, shared
    assert "layer_stage" not in str(groups[0].params["jaxpr"])
    markers = [e for e in after.jaxpr.jaxpr.eqns if e.primitive.name == "stage"]
    assert [(m.params["stage"], m.params["transpose"]) for m in markers] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
    ]
    for got, want in zip(run(after, WS, X), run(before, WS, X)):
        assert_same_array(got, want)


def test_uneven_counts_and_a_first_stage(meshes4):
    _, after = cut(lambda ws, x: stacked_loss(ws, x, every=(3, 3, 2), first=1), meshes4, WS, X)
    groups = scans(after)
    assert [e.params["length"] for e in groups] == [3, 3, 2]
    assert [placement_of(e).stage for e in groups] == [1, 2, 3]


def test_the_transposed_scan_is_cut_at_the_same_rows_last_group_first(meshes4):
    before, after = cut(jax.grad(stacked_loss), meshes4, WS, X)
    backward = [e for e in scans(after) if e.params["reverse"]]
    assert [placement_of(e).stage for e in backward] == [3, 2, 1, 0]
    assert {placement_of(e).transpose for e in backward} == {1}
    leaving = [
        e
        for e in after.jaxpr.jaxpr.eqns
        if e.primitive.name == "stage" and e.params["transpose"] == 1
    ]
    assert [m.params["stage"] for m in leaving] == [3, 2, 1, 0]
    for got, want in zip(run(after, WS, X), run(before, WS, X)):
        assert_same_array(got, want)


def test_a_scan_without_markers_is_left_as_it_is(meshes2):
    def plain(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()

    before, after = cut(plain, meshes2, WS, X)
    assert after is before


def test_a_scan_of_no_iterations_stays_one_scan_unplaced_without_markers(meshes2):
    empty = jnp.zeros((0, 4, 4))
    before, after = cut(jax.value_and_grad(stacked_loss), meshes2, empty, X)
    kept = scans(after)
    assert [e.params["length"] for e in kept] == [0, 0]  # the forward and its transpose
    assert [placement_of(e) for e in kept] == [None, None]
    assert all("layer_stage" not in str(e.params["jaxpr"]) for e in kept)
    for got, want in zip(run(after, empty, X), run(before, empty, X)):
        assert_same_array(got, want)
