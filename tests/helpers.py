"""Shared test helpers: reference comparison against ``jax.jit``, mesh lookups, and the
small model and input programs the per-pass tests start from."""

import jax
import jax.numpy as jnp
import numpy as np
from mpmdc.passes import FunctionPass, dce, inline, partition, plan, schedule, split

import mpmdc
from mpmdc.ir.keys import is_key
from mpmdc.ir.primitives import fragment_p
from mpmdc.pipeline import DEFAULT_PIPELINE
from mpmdc.runtime.compiling import XlaCompiles  # noqa: F401 (tests import it from here)


def assert_same_as_jit(fn, meshes, *args, rtol=0, atol=0, compile_kwargs=None):
    """Run ``fn`` through mpmdc and ``jax.jit``; assert equal results; return mpmdc's.

    Equal means bit for bit unless the caller passes a tolerance: one measured for its
    program, where a value crossing a fragment boundary (materialized, and so fused and
    summed otherwise than inside one ``jax.jit`` module) moves the last bits."""
    compile_kwargs = compile_kwargs or {}
    static = compile_kwargs.get("static_argnums", ())
    got = mpmdc.compile(fn, meshes, **compile_kwargs)(*args)
    want = jax.jit(fn, static_argnums=static)(*args)
    assert_same_tree(got, want, rtol=rtol, atol=atol)
    return got


def assert_same_tree(got, want, rtol=0, atol=0):
    """``got`` has ``want``'s pytree structure and each leaf is ``want``'s leaf as
    :func:`assert_same_array` compares them."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        assert_same_array(g, w, rtol=rtol, atol=atol)


def buffers(x) -> set[int]:
    """The device buffers holding ``x``'s shards on this process."""
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def assert_results_own_their_buffers(results, arguments=()):
    """No array leaf of ``results`` shares a device buffer with another or with an array
    leaf of ``arguments``, as ``jax.jit`` returns them (donating one would delete the
    other). Typed keys are left out: their buffers are not the user's to hold."""
    seen: dict[int, str] = {}
    for what, tree in (("argument", arguments), ("result", results)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if not isinstance(leaf, jax.Array) or jax.dtypes.issubdtype(
                leaf.dtype, jax.dtypes.prng_key
            ):
                continue
            name = f"{what} {jax.tree_util.keystr(path)}"
            for buffer in buffers(leaf):
                assert what == "argument" or buffer not in seen, (
                    f"{name} shares {seen[buffer]}'s buffer"
                )
                seen.setdefault(buffer, name)


def assert_same_array(got, want, rtol=0, atol=0):
    """``got`` is a ``jax.Array`` of ``want``'s type (shape, dtype, weak type) and values
    (bit for bit unless the caller passes a tolerance measured for its program)."""
    assert isinstance(got, jax.Array), type(got)
    got_type, want_type = jax.typeof(got), jax.typeof(want)
    assert (got_type.shape, got_type.dtype, got_type.weak_type) == (
        want_type.shape,
        want_type.dtype,
        want_type.weak_type,
    ), (got_type, want_type)
    if is_key(got):
        got, want = jax.random.key_data(got), jax.random.key_data(want)
    np.testing.assert_allclose(
        np.asarray(got, np.float64 if got.dtype == jnp.bfloat16 else None),
        np.asarray(want, np.float64 if want.dtype == jnp.bfloat16 else None),
        rtol=rtol,
        atol=atol,
    )


def largest_difference(a, b) -> float:
    """The largest absolute difference between the leaves of two pytrees, in float64."""
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


def mesh_index(array, meshes):
    """Index of the mesh whose devices hold ``array``."""
    ids = sorted(d.id for d in array.sharding.device_set)
    for i, m in enumerate(meshes):
        if sorted(d.id for d in m.devices.flat) == ids:
            return i
    raise AssertionError(f"array lives on devices {ids}, which are no mesh")


def rows_by_mesh(array, meshes):
    """``{mesh index: sorted row ranges of axis 0 its devices hold}`` of ``array``."""
    where = {}
    for shard in array.addressable_shards:
        mesh = next(i for i, m in enumerate(meshes) if shard.device in set(m.devices.flat))
        index = shard.index[0]
        where.setdefault(mesh, set()).add((index.start or 0, index.stop or array.shape[0]))
    return {m: sorted(r) for m, r in where.items()}


@jax.custom_vjp
def clipped_tanh(x):
    """``tanh`` whose gradient is clipped to [-0.5, 0.5]: a ``custom_vjp`` for tests."""
    return jnp.tanh(x)


def _clipped_fwd(x):
    y = jnp.tanh(x)
    return y, y


def _clipped_bwd(y, g):
    return (jnp.clip(g * (1 - y**2), -0.5, 0.5),)


clipped_tanh.defvjp(_clipped_fwd, _clipped_bwd)


def mlp_loss(ws, x):
    """A tanh MLP with one pipeline stage per layer (``ws[i]`` runs in stage ``i``)."""
    for i, w in enumerate(ws):
        x = jnp.tanh(mpmdc.stage(x, i) @ w)
    return jnp.sum(x**2)


def input_program(fn, meshes, *args, **compile_kwargs):
    """``fn``'s program before any pass (the ``input`` stage), to call passes on directly."""
    return mpmdc.compile(fn, meshes, passes=[], **compile_kwargs).lower(*args).program("input")


def planned_program(fn, meshes, *args, **compile_kwargs):
    """``fn``'s program after ``plan`` (its stages and schedule decided), to call the
    passes after it on directly."""
    return plan(input_program(fn, meshes, *args, **compile_kwargs))


def scheduled(fn, meshes, *args, **compile_kwargs):
    """``fn``'s program after ``schedule``, each pass before it called directly."""
    program = planned_program(fn, meshes, *args, **compile_kwargs)
    return schedule(split(partition(dce(inline(program)))))


def fragments(program):
    """The top-level ``fragment`` equations of ``program``."""
    return [e for e in program.jaxpr.jaxpr.eqns if e.primitive is fragment_p]


def _crash(program):
    return {}["missing"]


# A pass with a bug: it raises a plain Python error, which mpmdc reports as internal.
CRASHING = FunctionPass("crashing", "raises KeyError", _crash)


def passes_with(extra, after):
    """The default pipeline with the pass ``extra`` inserted after the pass named ``after``."""
    names = list(DEFAULT_PIPELINE)
    return [*names[: names.index(after) + 1], extra, *names[names.index(after) + 1 :]]
