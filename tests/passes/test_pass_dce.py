"""The ``dce`` pass (``mpmdc.passes.dce``) on small hand-written programs.

What it promises: equations whose results nobody uses are removed, with mpmdc's rules
for ``stage`` markers, ``fragment`` and ``transfer`` equations (each keeps only the
values still read, with their specs); every program input and output is kept; the
placements of the equations that stay are kept; a fragment with an effect stays even
when nothing reads its results.

The split programs here are cut down by hand: an output is dropped, so what only fed it
is dead and must disappear.
"""

import jax
import jax.numpy as jnp
from helpers import input_program
from mpmdc.passes import dce, inline, partition, split

import mpmdc
from mpmdc.ir.primitives import fragment_p, transfer_p
from mpmdc.ir.program import make_closed_jaxpr

X = jnp.arange(32.0).reshape(4, 8) / 32
Y = jnp.ones((4, 8))


def prims(program):
    return [e.primitive.name for e in program.jaxpr.jaxpr.eqns]


def keeping_outputs(program, keep):
    """``program`` returning only its outputs ``keep`` (indices): what fed the others is dead."""
    jaxpr = program.jaxpr.jaxpr
    outvars = [jaxpr.outvars[k] for k in keep]
    closed = make_closed_jaxpr(
        jaxpr.constvars, program.jaxpr.consts, jaxpr.invars, outvars, jaxpr.eqns, jaxpr.debug_info
    )

    def pick(values):
        return None if values is None else tuple(values[k] for k in keep)

    return program.replace(
        jaxpr=closed,
        out_specs=pick(program.out_specs),
        out_paths=pick(program.out_paths),
        out_meshes=pick(program.out_meshes),
    )


def test_an_unused_equation_is_removed_and_inputs_and_outputs_are_kept(meshes2):
    def fn(x, y):
        jnp.cos(y)  # nobody reads it
        return jnp.sin(x) * 2

    program = input_program(fn, meshes2, X, Y)
    assert prims(program) == ["cos", "sin", "mul"]
    out = dce(program)
    assert prims(out) == ["sin", "mul"]
    # y is read by nothing now, and stays an input: the signature does not change.
    assert out.jaxpr.jaxpr.invars == program.jaxpr.jaxpr.invars
    assert out.jaxpr.jaxpr.outvars == program.jaxpr.jaxpr.outvars


def two_values_into_stage_1(x):
    a = mpmdc.stage(x, 0)
    b, c = mpmdc.stage((jnp.sin(a), jnp.cos(a)), 1)
    return b * 2, c * 3, jnp.tanh(a)


def test_a_marker_keeps_only_the_values_still_used_and_placements_survive(meshes2):
    placed = partition(dce(inline(input_program(two_values_into_stage_1, meshes2, X))))
    out = dce(keeping_outputs(placed, [0]))  # c * 3 and tanh(a) are dead now
    labels = [(e.primitive.name, p.label) for e, p in zip(out.jaxpr.jaxpr.eqns, out.placements)]
    assert labels == [
        ("stage", "s0_fwd"),
        ("sin", "s0_fwd"),
        ("stage", "s1_fwd"),  # one value left of two
        ("mul", "s1_fwd"),
    ]
    marker = out.jaxpr.jaxpr.eqns[2]
    assert len(marker.invars) == len(marker.outvars) == 1
    assert marker.params == {"stage": 1, "transpose": 0}


def split_two_values_into_stage_1(meshes):
    """s0_fwd makes sin(a), cos(a) and tanh(a); one transfer carries the first two to
    mesh1, where s1_fwd returns ``b * 2`` and ``c * 3``."""
    program = split(partition(dce(inline(input_program(two_values_into_stage_1, meshes, X)))))
    assert prims(program) == ["fragment", "transfer", "fragment"]
    return program


def test_a_transfer_and_a_fragment_keep_only_the_values_still_read(meshes2):
    out = dce(keeping_outputs(split_two_values_into_stage_1(meshes2), [0, 2]))  # c * 3 is dead
    s0, transfer, s1 = out.jaxpr.jaxpr.eqns
    assert (s0.params["name"], s1.params["name"]) == ("s0_fwd", "s1_fwd")
    # The transfer carries sin(a) only, with one spec and one kind per value.
    assert transfer.invars == [s0.outvars[0]]
    assert len(transfer.params["src_specs"]) == len(transfer.params["dst_specs"]) == 1
    assert transfer.params["carries"] == ("activation",)
    # s1_fwd computes b * 2 only.
    assert [e.primitive.name for e in s1.params["jaxpr"].jaxpr.eqns] == ["mul"]
    assert len(s1.outvars) == len(s1.params["out_specs"]) == 1
    assert len(s1.invars) == len(s1.params["in_specs"]) == 1
    # s0_fwd no longer makes cos(a), which only fed the dead output.
    assert [e.primitive.name for e in s0.params["jaxpr"].jaxpr.eqns] == ["sin", "tanh"]
    assert len(s0.outvars) == len(s0.params["out_specs"]) == 2


def test_fragments_and_transfers_whose_results_are_unused_disappear(meshes2):
    out = dce(keeping_outputs(split_two_values_into_stage_1(meshes2), [2]))  # only tanh(a) is left
    (s0,) = out.jaxpr.jaxpr.eqns
    assert s0.primitive is fragment_p and s0.params["name"] == "s0_fwd"
    assert [e.primitive.name for e in s0.params["jaxpr"].jaxpr.eqns] == ["tanh"]
    assert s0.params["out_specs"] == (jax.sharding.PartitionSpec(),)
    assert out.jaxpr.jaxpr.outvars == s0.outvars
    assert out.jaxpr.jaxpr.invars == s0.invars  # the input is kept


def test_a_fragment_with_an_effect_stays_when_nothing_reads_it(meshes2):
    def fn(x):
        a = mpmdc.stage(x, 0)
        jax.debug.callback(lambda v: None, a)
        return mpmdc.stage(a, 1) * 2

    program = split(partition(dce(inline(input_program(fn, meshes2, X)))))
    assert prims(program) == ["fragment", "transfer", "fragment"]
    out = dce(keeping_outputs(program, []))  # no output at all
    (s0,) = out.jaxpr.jaxpr.eqns
    assert s0.params["name"] == "s0_fwd" and s0.outvars == []
    assert [e.primitive.name for e in s0.params["jaxpr"].jaxpr.eqns] == ["debug_callback"]
    assert not any(e.primitive is transfer_p for e in out.jaxpr.jaxpr.eqns)
