"""The ``split`` pass (``mpmdc.passes.split``) on small hand-written programs.

What it promises: a placed program comes out as ``fragment`` and ``transfer`` equations
only (markers dropped), still a jaxpr JAX checks and evaluates to the same numbers; one
fragment per placement (stage, transpose count, microbatch) unless that would make a
cycle, in which case a re-entered stage gets numbered, acyclic fragments; a value used on
another mesh moves there by exactly one transfer, however many fragments read it there;
transferred values keep their source's ``PartitionSpec`` as far as the destination mesh
has its axes.
"""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_same_as_jit, fragments, input_program, mesh_index, mlp_loss
from jax.extend import core as jcore
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mpmdc.passes import dce, inline, partition, split

import mpmdc
from mpmdc.ir.primitives import fragment_p, transfer_p

WS = [jnp.eye(8) * 0.5 + 0.01 * i for i in range(4)]
X = jnp.arange(32.0).reshape(4, 8) / 32
W = jnp.eye(8) * 0.5


def split_of(fn, meshes, *args, **kwargs):
    """``(input program, split program)``, the passes called directly."""
    program = input_program(fn, meshes, *args, **kwargs)
    return program, split(partition(dce(inline(program))))


def transfers(program):
    return [e for e in program.jaxpr.jaxpr.eqns if e.primitive is transfer_p]


def two_stage_loss(w, x):
    a = jnp.tanh(mpmdc.stage(x, 0) @ w)
    return jnp.sum(jnp.sin(mpmdc.stage(a, 1) @ w) ** 2)


def test_split_program_holds_only_fragments_and_transfers(meshes4):
    lowered = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes4).lower(WS, X)
    program = lowered.program("after-split")
    prims = {e.primitive for e in program.jaxpr.jaxpr.eqns}
    assert prims == {fragment_p, transfer_p}
    # the MPMD program is still a jaxpr JAX can check and evaluate
    jax.extend.core.check_jaxpr(program.jaxpr.jaxpr)
    flat = jax.tree_util.tree_leaves((WS, X))
    got = jax.extend.core.jaxpr_as_fun(program.jaxpr)(*flat)
    want = jax.tree_util.tree_leaves(jax.value_and_grad(mlp_loss)(WS, X))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_the_split_program_computes_what_the_input_program_computes(meshes2):
    program, out = split_of(jax.value_and_grad(two_stage_loss), meshes2, W, X)
    assert {e.primitive.name for e in out.jaxpr.jaxpr.eqns} == {"fragment", "transfer"}
    # Markers are dropped: no fragment body holds one.
    assert not [
        e
        for f in fragments(out)
        for e in f.params["jaxpr"].jaxpr.eqns
        if e.primitive.name == "stage"
    ]
    jcore.check_jaxpr(out.jaxpr.jaxpr)
    got = jcore.jaxpr_as_fun(out.jaxpr)(W, X)
    want = jcore.jaxpr_as_fun(program.jaxpr)(W, X)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_one_fragment_per_stage_and_transpose_and_one_loop_iteration(meshes2):
    _, out = split_of(jax.grad(two_stage_loss), meshes2, W, X)
    # The last stage's backward shares its forward's fragment (its transpose count is
    # that of the stage-1 marker's forward, and nothing separates them).
    got = [
        (f.params["name"], f.params["stage"], f.params["transpose"], f.params["mesh"])
        for f in fragments(out)
    ]
    assert got == [("s0_fwd", 0, 0, 0), ("s1_fwd", 1, 0, 1), ("s0_bwd", 0, 1, 0)]

    def accumulated(ws, x):
        return mpmdc.accumulate(lambda xb: jax.grad(mlp_loss)(ws, xb), x, microbatches=2)

    _, out = split_of(accumulated, meshes2, [W, W], X)
    got = [
        (f.params["name"], f.params["stage"], f.params["transpose"], f.params["microbatch"])
        for f in fragments(out)
    ]
    # One iteration of the loop, whatever the microbatch count; the batch enters it
    # through a slice edge, the running sums through carry edges.
    assert sorted(got) == [
        ("s0_bwd_loop", 0, 1, "loop"),
        ("s0_fwd", 0, 0, None),  # before the loop: the zeros of a running sum
        ("s0_fwd_loop", 0, 0, "loop"),
        ("s1_fwd", 1, 0, None),  # mesh1 makes the zeros of its own running sum
        ("s1_fwd_loop", 1, 0, "loop"),
    ]
    edges = [e.params["edge"] for e in out.jaxpr.jaxpr.eqns if e.primitive.name == "loop_edge"]
    assert sorted(edges) == ["carry", "carry", "result", "result", "slice"]


def test_reentering_a_stage_splits_its_work_into_acyclic_fragments(meshes2):
    def fn(x):
        a = jnp.sin(mpmdc.stage(x, 0))
        b = jnp.cos(mpmdc.stage(a, 1))
        return jnp.tanh(mpmdc.stage(b, 0)) + a

    out = assert_same_as_jit(fn, meshes2, X)
    program = mpmdc.compile(fn, meshes2).lower(X).program("after-split")
    names = [e.params["name"] for e in program.jaxpr.jaxpr.eqns if e.primitive is fragment_p]
    assert names == ["s0_fwd_0", "s1_fwd", "s0_fwd_1"]
    assert mesh_index(out, meshes2) == 0


def test_a_value_used_by_two_fragments_on_another_mesh_crosses_once(meshes2):
    def fn(w, x):
        a = jnp.sin(mpmdc.stage(x, 0) @ w)  # read by both fragments of stage 1
        b = jnp.cos(mpmdc.stage(a, 1) @ w)
        c = jnp.tanh(mpmdc.stage(b, 0))
        return jnp.sum(mpmdc.stage(c, 1) * a)

    _, out = split_of(fn, meshes2, W, X)
    assert [e.params.get("name", "transfer") for e in out.jaxpr.jaxpr.eqns] == [
        "s0_fwd_0",
        "transfer",
        "s1_fwd_0",
        "transfer",
        "s0_fwd_1",
        "transfer",
        "s1_fwd_1",
    ]
    moved = [(v, t.params["dst"]) for t in transfers(out) for v in t.invars]
    assert len(moved) == len(set(moved)) == 4  # a and w once each to mesh1, b back, c over
    s0_first, to_mesh1, s1_first, _, _, _, s1_second = out.jaxpr.jaxpr.eqns
    a_on_mesh1 = to_mesh1.outvars[to_mesh1.invars.index(s0_first.outvars[0])]
    assert a_on_mesh1 in s1_first.invars and a_on_mesh1 in s1_second.invars


def test_transferred_values_keep_their_spec_where_the_destination_has_the_axes(meshes2):
    _, out = split_of(jax.grad(two_stage_loss), meshes2, W, X, in_specs=(None, P("data")))
    forward, backward = transfers(out)
    assert forward.params["carries"] == ("activation", "state")
    assert forward.params["src_specs"] == forward.params["dst_specs"] == (P("data"), P())
    assert backward.params["carries"] == ("cotangent", "other")
    assert backward.params["src_specs"] == backward.params["dst_specs"] == (P("data"), P())
    s0, s1, _ = fragments(out)
    assert s0.params["in_specs"] == (P("data"), P()) and s1.params["in_specs"] == (P("data"), P())

    # A destination mesh without the axis gets the value replicated.
    devices = np.array(jax.devices()[:4])
    meshes = (Mesh(devices[:2], ("data",)), Mesh(devices[2:], ("model",)))
    _, out = split_of(jax.grad(two_stage_loss), meshes, W, X, in_specs=(None, P("data")))
    forward, backward = transfers(out)
    assert forward.params["src_specs"] == (P("data"), P()) and forward.params["dst_specs"] == (
        P(),
        P(),
    )
    assert backward.params["src_specs"] == (P(), P()) and backward.params["dst_specs"] == (P(), P())
