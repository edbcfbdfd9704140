"""The ``in-program-transfers`` pass (``mpmdc.passes.in_program_transfers``) on small
hand-written programs.

What it promises: a value a fragment makes and fragments on another mesh read is sent
at the end of the producing fragment (``send``) and received at the start of the first
reader (``recv``), with the same channel id on both sides; later readers on that mesh
get it from the first as an extra result, so each value crosses once; channel ids
count up in program order from 2 (JAX's collectives use 1); a program input needed on
a second mesh, or a value that is a program output, keeps its ``transfer``.
"""

import jax
import jax.numpy as jnp
from helpers import input_program
from jax.sharding import NamedSharding
from mpmdc.passes import dce, in_program_transfers, inline, partition, split

import mpmdc
from mpmdc.ir.primitives import fragment_p, transfer_p

X = jnp.arange(32.0).reshape(4, 8) / 32
W = jnp.eye(8) * 0.5


def split_program(fn, meshes, *args, **kwargs):
    program = input_program(fn, meshes, *args, **kwargs)
    return split(partition(dce(inline(program))))


def body_ops(fragment, name):
    """``(channel, src, dst)`` of each ``name`` (send or recv) in ``fragment``'s body."""
    return [
        (e.params["channel"], e.params["src"], e.params["dst"])
        for e in fragment.params["jaxpr"].jaxpr.eqns
        if e.primitive.name == name
    ]


def by_name(program):
    return {e.params["name"]: e for e in program.jaxpr.jaxpr.eqns if e.primitive is fragment_p}


def back_and_forth(w, x):
    a = jnp.sin(mpmdc.stage(x, 0) @ w)  # read by both fragments of stage 1
    b = jnp.cos(mpmdc.stage(a, 1) @ w)
    c = jnp.tanh(mpmdc.stage(b, 0))
    return jnp.sum(mpmdc.stage(c, 1) * a)


def test_fragment_to_fragment_transfers_become_send_recv_pairs_with_one_channel_each(meshes2):
    program = split_program(back_and_forth, meshes2, W, X)
    assert [e.params.get("name", "transfer") for e in program.jaxpr.jaxpr.eqns] == [
        "s0_fwd_0",
        "transfer",
        "s1_fwd_0",
        "transfer",
        "s0_fwd_1",
        "transfer",
        "s1_fwd_1",
    ]
    out = in_program_transfers(program)
    f = by_name(out)
    # a: mesh0 -> mesh1 on channel 2; b: back on 3; c: over again on 4.
    assert body_ops(f["s0_fwd_0"], "send") == [(2, 0, 1)]
    assert body_ops(f["s1_fwd_0"], "recv") == [(2, 0, 1)]
    assert body_ops(f["s1_fwd_0"], "send") == [(3, 1, 0)]
    assert body_ops(f["s0_fwd_1"], "recv") == [(3, 1, 0)]
    assert body_ops(f["s0_fwd_1"], "send") == [(4, 0, 1)]
    assert body_ops(f["s1_fwd_1"], "recv") == [(4, 0, 1)]
    assert body_ops(f["s1_fwd_1"], "send") == []
    # A send comes last in its body, a recv first.
    body = [e.primitive.name for e in f["s1_fwd_0"].params["jaxpr"].jaxpr.eqns]
    assert body[0] == "recv" and body[-1] == "send"
    # What was only sent is no fragment result any more.
    assert f["s0_fwd_0"].outvars == [] and f["s0_fwd_1"].outvars == []


def test_a_value_read_by_two_fragments_on_one_mesh_is_received_once(meshes2):
    out = in_program_transfers(split_program(back_and_forth, meshes2, W, X))
    f = by_name(out)
    first, second = f["s1_fwd_0"], f["s1_fwd_1"]
    # s1_fwd_0 receives a and passes it on as an extra result; s1_fwd_1 reads that.
    received = [
        e.outvars[0] for e in first.params["jaxpr"].jaxpr.eqns if e.primitive.name == "recv"
    ]
    assert first.params["jaxpr"].jaxpr.outvars == received
    assert first.outvars[0] in second.invars
    assert len(first.params["out_specs"]) == 1
    assert [c for c, _, _ in body_ops(second, "recv")] == [4]  # c only, not a again


def test_a_program_input_needed_on_a_second_mesh_keeps_its_transfer(meshes2):
    out = in_program_transfers(split_program(back_and_forth, meshes2, W, X))
    (kept,) = [e for e in out.jaxpr.jaxpr.eqns if e.primitive is transfer_p]
    w = out.jaxpr.jaxpr.invars[0]
    assert kept.invars == [w] and (kept.params["src"], kept.params["dst"]) == (0, 1)
    assert kept.params["carries"] == ("state",)
    assert kept.outvars[0] in by_name(out)["s1_fwd_0"].invars


def test_a_value_that_is_a_program_output_keeps_its_transfer(meshes2):
    def fn(x):
        a = jnp.sin(mpmdc.stage(x, 0))
        return jnp.cos(mpmdc.stage(a, 1)), a * 2

    # a * 2 is made on mesh0 and returned on mesh1.
    out_shardings = (None, NamedSharding(meshes2[1], jax.sharding.PartitionSpec()))
    program = split_program(fn, meshes2, X, out_shardings=out_shardings)
    assert program.out_meshes == (1, 1)
    out = in_program_transfers(program)
    (kept,) = [e for e in out.jaxpr.jaxpr.eqns if e.primitive is transfer_p]
    assert kept.outvars == [out.jaxpr.jaxpr.outvars[1]]
    f = by_name(out)
    assert body_ops(f["s0_fwd"], "send") == [(2, 0, 1)] and body_ops(f["s1_fwd"], "recv") == [
        (2, 0, 1)
    ]
