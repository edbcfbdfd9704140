"""The ``vma-typecheck`` pass (``mpmdc.passes.vma_typecheck``) on small hand-written programs.

What it promises: a well-typed program comes back unchanged (the same object); the
user's choices are checked (each ``in_specs``/``out_specs`` entry names only axes of the
mesh holding the value and splits only dimensions they divide, a ``SpecError``; each
``shard_map`` runs on the mesh it was built for, a ``TypeCheckError``); and so are the
invariants of every pass (``TypeCheckError``): between ``partition`` and ``split`` every
equation has a placement, after ``split`` every value is read on the mesh where it lives.
JAX's ``check_jaxpr`` is left to verification (``verify``), which the pipeline runs
after every pass when asked.

The broken programs here are made by hand from good ones: a spec replaced, a placement
moved or dropped, a transfer cut out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import input_program
from jax.sharding import PartitionSpec as P
from mpmdc.passes import dce, inline, partition, split, vma_typecheck
from mpmdc.passes.vma_typecheck import verify

import mpmdc
from mpmdc import _jax_compat as compat
from mpmdc.errors import SpecError, TypeCheckError
from mpmdc.ir.primitives import transfer_p
from mpmdc.ir.program import Placement, make_closed_jaxpr, placed

X = jnp.arange(32.0).reshape(4, 8) / 32


def placed_program(fn, meshes, *args):
    return partition(dce(inline(input_program(fn, meshes, *args))))


def with_eqns(program, eqns):
    """``program`` with its top-level equations replaced by ``eqns``."""
    jaxpr = program.jaxpr.jaxpr
    closed = make_closed_jaxpr(
        jaxpr.constvars, program.jaxpr.consts, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.debug_info
    )
    return program.replace(jaxpr=closed)


def two_stages(x):
    return jnp.tanh(mpmdc.stage(jnp.sin(mpmdc.stage(x, 0)), 1))


def psum_in_stage_1(meshes):
    def fn(x):
        a = mpmdc.stage(jnp.sin(mpmdc.stage(x, 0)), 1)
        total = jax.shard_map(
            lambda v: jax.lax.psum(v, "data"), mesh=meshes[1], in_specs=P("data"), out_specs=P()
        )(a)
        return total * 2

    return fn


def test_a_well_typed_program_passes_unchanged(meshes2):
    program = placed_program(psum_in_stage_1(meshes2), meshes2, X)
    labels = [
        (e.primitive.name, p.label) for e, p in zip(program.jaxpr.jaxpr.eqns, program.placements)
    ]
    assert ("shard_map", "s1_fwd") in labels  # on mesh1, the mesh it was built for
    sharded = program.replace(in_specs=(P("data"),))  # dimension 0 (4) over data (2)
    assert vma_typecheck(sharded) is sharded
    after_split = split(sharded)
    assert vma_typecheck(after_split) is after_split


@pytest.mark.parametrize(
    "where,message",
    [
        (
            "in_specs",
            "in_specs for argument args[0] (on mesh0): P('model',) names axis 'model', which the mesh {'data': 2} does not have",
        ),
        (
            "out_specs",
            "out_specs for output out (on mesh1): P('model',) names axis 'model', which the mesh {'data': 2} does not have",
        ),
    ],
)
def test_a_spec_naming_an_axis_the_mesh_lacks_is_a_spec_error(meshes2, where, message):
    program = placed_program(two_stages, meshes2, X)
    vma_typecheck(program)
    with pytest.raises(SpecError) as info:
        vma_typecheck(program.replace(**{where: (P("model"),)}))
    assert str(info.value).startswith(message)


def test_a_spec_for_another_mesh_is_named_for_its_axis_before_its_length(meshes2):
    """A spec of more entries than dimensions that names an axis the mesh lacks (a spec
    for another mesh, or another value) names the axis first."""
    program = placed_program(two_stages, meshes2, X)
    with pytest.raises(SpecError, match=r"P\(None, None, 'model'\) names axis 'model'"):
        vma_typecheck(program.replace(in_specs=(P(None, None, "model"),)))


def test_a_spec_that_does_not_divide_its_dimension_is_a_spec_error(meshes2):
    program = placed_program(two_stages, meshes2, jnp.ones((3, 8)))
    vma_typecheck(program.replace(in_specs=(P(None, "data"),)))  # 8 over 2 is fine
    with pytest.raises(
        SpecError, match=r"P\('data',\) splits dimension 0 \(size 3\) over \('data',\) \(size 2\)"
    ):
        vma_typecheck(program.replace(in_specs=(P("data"),)))


def test_a_shard_map_placed_on_another_mesh_is_a_type_error(meshes2):
    program = placed_program(psum_in_stage_1(meshes2), meshes2, X)
    eqns = list(program.jaxpr.jaxpr.eqns)
    (k,) = [k for k, e in enumerate(eqns) if e.primitive.name == "shard_map"]
    eqns[k] = placed(eqns[k], Placement(0, 0))  # stage 0 runs on mesh0 (devices 0, 1)
    with pytest.raises(TypeCheckError) as info:
        vma_typecheck(with_eqns(program, eqns))
    message = str(info.value)
    assert "is in stage 0, which runs on mesh0 {'data': 2} on devices [0, 1]" in message
    assert "but it was built for the mesh {'data': 2} on devices [2, 3]" in message


def test_an_equation_without_a_placement_is_a_type_error(meshes2):
    program = placed_program(two_stages, meshes2, X)
    eqns = list(program.jaxpr.jaxpr.eqns)
    assert [e.primitive.name for e in eqns] == ["stage", "sin", "stage", "tanh"]
    eqns[1] = placed(eqns[1], None)
    with pytest.raises(TypeCheckError, match=r"`sin` at .* has no placement"):
        vma_typecheck(with_eqns(program, eqns))


def test_after_split_a_value_read_off_its_mesh_is_a_type_error(meshes2):
    program = split(placed_program(two_stages, meshes2, X))
    s0, transfer, s1 = program.jaxpr.jaxpr.eqns
    assert (
        transfer.primitive is transfer_p
        and transfer.params["src"] == 0
        and transfer.params["dst"] == 1
    )
    # s1_fwd reads sin(x) straight from mesh0, without the transfer.
    direct = s1.replace(invars=list(transfer.invars))
    with pytest.raises(
        TypeCheckError,
        match=r"fragment s1_fwd on mesh1 reads a value living on mesh0 \(float32\[4,8\]\); a transfer is missing",
    ):
        vma_typecheck(with_eqns(program, [s0, direct]))


def test_types_are_left_to_verification(meshes2):
    # JAX type-checked the user's program while tracing it; only a pass could break
    # that, so the pass skips the costly check_jaxpr and verification runs it.
    program = placed_program(two_stages, meshes2, X)
    eqns = list(program.jaxpr.jaxpr.eqns)
    i = next(k for k, e in enumerate(eqns) if e.primitive.name == "sin")
    eqns[i] = eqns[i].replace(outvars=[compat.Var(jax.core.ShapedArray((2,), jnp.float32))])
    broken = with_eqns(program, eqns)
    assert vma_typecheck(broken) is broken
    with pytest.raises(TypeCheckError, match="ill-typed"):
        verify(broken)


def test_a_spec_from_out_shardings_is_named_as_out_shardings(meshes2):
    def f(x):
        return jnp.sum(mpmdc.stage(x, 1) * 2)

    scalar_on_mesh1 = jax.sharding.NamedSharding(meshes2[1], P("data"))
    with pytest.raises(
        SpecError, match=r"^out_shardings for output out \(on mesh1\): P\('data',\)"
    ):
        mpmdc.compile(f, meshes2, out_shardings=scalar_on_mesh1).lower(X)


def test_a_shard_map_for_the_same_axes_in_another_order_is_a_type_error():
    """A stage mesh ("model", "data") and a shard_map built for ("data", "model") of the
    same sizes: the shards would be laid out by the wrong axis (wrong numbers, silently);
    it is refused, as JAX refuses it under a context mesh. The mesh's own axes run."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    stage_mesh = jax.sharding.Mesh(devices, ("model", "data"))

    def product(axes_of):
        def f(x, w):
            return jax.shard_map(
                lambda x, w: jax.lax.psum(x @ w, "model"),
                mesh=axes_of.abstract_mesh,
                in_specs=(P("data", "model"), P("model")),
                out_specs=P("data"),
            )(x, w)

        return f

    x, w = jnp.arange(32.0).reshape(4, 8) / 10, jnp.arange(24.0).reshape(8, 3) / 10
    swapped = jax.sharding.Mesh(devices, ("data", "model"))
    with pytest.raises(
        TypeCheckError,
        match=r"runs on mesh0 \{'model': 2, 'data': 2\} .* built for the mesh \{'data': 2, "
        r"'model': 2\} \(the same axes in another order\)",
    ):
        mpmdc.compile(product(swapped), [stage_mesh])(x, w)
    got = mpmdc.compile(product(stage_mesh), [stage_mesh])(x, w)
    # Noise floor: the product summed over 2 shards against jnp's one dot, 1.9e-6
    # absolute on values up to 55; the bound is ten times that.
    np.testing.assert_allclose(got, x @ w, atol=2e-5)
