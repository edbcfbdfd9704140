"""Every user mistake is a typed MpmdcError naming the culprit, never a raw JAX traceback."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc import errors


def two_stage(w, x):
    h = jnp.tanh(mpmdc.stage(x, 0) @ w)
    return jnp.sum(mpmdc.stage(h, 1) ** 2)


W, X = jnp.ones((8, 8)) * 0.1, jnp.ones((4, 8))


def test_all_errors_subclass_mpmdc_error():
    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, mpmdc.MpmdcError)


def test_stage_to_mesh_naming_missing_mesh(meshes2):
    with pytest.raises(errors.StageError, match=r"stage 1 to 5.*only 2 meshes"):
        mpmdc.compile(two_stage, meshes2, stage_to_mesh=[0, 5])


def test_stage_without_stage_to_mesh_entry(meshes2):
    with pytest.raises(errors.StageError, match=r"stage 1 .*no entry in stage_to_mesh"):
        mpmdc.compile(two_stage, meshes2, stage_to_mesh=[0]).lower(W, X)


def test_meshes_sharing_a_device():
    d = jax.devices()
    a = Mesh(np.array(d[:2]), ("data",))
    b = Mesh(np.array(d[1:3]), ("data",))
    with pytest.raises(errors.MeshError, match=r"meshes\[0\] and meshes\[1\] share device 1"):
        mpmdc.compile(two_stage, [a, b])


@dataclasses.dataclass(frozen=True)
class _TpuDevice:
    """A stand-in device of a platform this machine does not have (a Mesh only reads these)."""

    id: int
    platform: str = "tpu"
    process_index: int = 0


def test_meshes_on_different_platforms(meshes2):
    tpus = Mesh(np.array([_TpuDevice(100), _TpuDevice(101)]), ("data",))
    with pytest.raises(errors.MeshError, match=r"mix platforms: cpu \(meshes\[0\]\), tpu \(meshes\[1\]\)"):
        mpmdc.compile(two_stage, [meshes2[0], tpus])


@pytest.mark.parametrize("bad", [[], (), "mesh", [object()], None])
def test_empty_or_non_mesh_meshes(bad):
    with pytest.raises(errors.MeshError):
        mpmdc.compile(two_stage, bad)


@pytest.mark.parametrize("index", [-1, 1.5, "0", True])
def test_bad_stage_index(index):
    with pytest.raises(errors.StageError, match="stage index"):
        mpmdc.stage(jnp.ones(3), index)


def test_stage_index_depending_on_traced_value(meshes2):
    def fn(x, i):
        return mpmdc.stage(x, i) * 2

    with pytest.raises(errors.StageError, match="traced value"):
        mpmdc.compile(fn, meshes2)(X, 1)


def test_in_specs_pytree_mismatch(meshes2):
    with pytest.raises(errors.SpecError, match=r"in_specs\[0\] does not match"):
        mpmdc.compile(two_stage, meshes2, in_specs=([P(), P()], P()))(W, X)
    with pytest.raises(errors.SpecError, match="one entry per argument"):
        mpmdc.compile(two_stage, meshes2, in_specs=(P(),))(W, X)


def test_in_specs_unknown_axis(meshes2):
    with pytest.raises(errors.SpecError, match=r"args\[1\].*names axis 'model'"):
        mpmdc.compile(two_stage, meshes2, in_specs=(P(), P("model")))(W, X)


def test_in_specs_not_dividing(meshes2):
    x = jnp.ones((3, 8))
    with pytest.raises(errors.SpecError, match=r"args\[1\].*dimension 0 \(size 3\).*does not divide"):
        mpmdc.compile(two_stage, meshes2, in_specs=(P(), P("data")))(W, x)


def test_donate_argnums_out_of_range(meshes2):
    with pytest.raises(errors.ArgumentError, match=r"donate_argnums contains 5.*2 positional"):
        mpmdc.compile(two_stage, meshes2, donate_argnums=5)(W, X)


def test_executable_called_with_wrong_types(meshes2):
    exe = mpmdc.compile(two_stage, meshes2).lower(W, X).compile()
    with pytest.raises(errors.ArgumentError, match=r"args\[1\] is float32\[4, 9\]"):
        exe(W, jnp.ones((4, 9)))
    with pytest.raises(errors.ArgumentError, match=r"args\[0\] is int32"):
        exe(jnp.ones((8, 8), jnp.int32), X)
    with pytest.raises(errors.ArgumentError, match=r"args\[0\] is a tuple of 1 entry"):
        exe((W,), X)
    np.testing.assert_allclose(float(exe(W, X)), float(two_stage(W, X)), rtol=2e-5)


def test_marker_inside_loop_body(meshes2):
    def fn(x):
        return jax.lax.fori_loop(0, 2, lambda i, v: mpmdc.stage(v, 1) * 2, x)

    with pytest.raises(errors.PlacementError, match=r"test_errors.py.*runs inside `(scan|while)` \(at .*test_errors.py"):
        mpmdc.compile(fn, meshes2)(X)


def test_unknown_backend_and_pass(meshes2):
    with pytest.raises(errors.BackendError, match=r"unknown backend 'metal'; available backends: cpu, cuda, .*tpu"):
        mpmdc.compile(two_stage, meshes2, backend="metal")
    with pytest.raises(errors.PassError, match="known passes: dce, in-program-transfers, inline, lower"):
        mpmdc.compile(two_stage, meshes2, passes=["inline", "fuse-everything"])


def test_unknown_stage_name(meshes2):
    lowered = mpmdc.compile(two_stage, meshes2).lower(W, X)
    with pytest.raises(errors.PassError, match="stages: input, after-inline"):
        lowered.as_text("after-magic")


def shard_map_on_mesh0(x, meshes):
    x = mpmdc.stage(x, 1)
    return jax.shard_map(lambda t: t * 2, mesh=meshes[0], in_specs=P("data"), out_specs=P("data"))(x)


def test_a_shard_map_runs_on_the_mesh_it_was_built_for(meshes2):
    compiled = mpmdc.compile(lambda x: shard_map_on_mesh0(x, meshes2), meshes2)
    program = compiled.lower(X).program("after-partition")
    (placement,) = [p for e, p in zip(program.jaxpr.eqns, program.placements) if e.primitive.name == "shard_map"]
    assert placement.stage == 0
    np.testing.assert_allclose(np.asarray(compiled(X)), np.asarray(X) * 2)


def test_shard_map_on_a_mesh_no_stage_runs_on(meshes2):
    with pytest.raises(errors.TypeCheckError, match=r"shard_map at .*test_errors.py.*mesh1"):
        mpmdc.compile(lambda x: shard_map_on_mesh0(x, meshes2), meshes2, stage_to_mesh=(1, 1))(X)
