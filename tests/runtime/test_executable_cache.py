"""The executables a compiled function keeps per call signature
(``mpmdc.runtime.executable_cache``, ``compile(..., cache_size=)``).

What it promises: at most ``cache_size`` signatures are kept, the least recently used
dropped first, and a signature kept is never compiled again (nor by ``lower().compile()``); ``step.clear_cache()`` and
``jax.clear_caches()`` drop them all, and the next call compiles again and still gives
``jax.jit``'s numbers; a compiled program keeps its executables, not the modules they
were compiled from.
"""

import gc
import weakref

import jax
import jax.numpy as jnp
import pytest
from helpers import XlaCompiles, assert_same_tree, mlp_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.errors import AccumulateError, ArgumentError
from mpmdc.runtime.executable_cache import ExecutableCache

STEP = jax.value_and_grad(mlp_loss)
WS = [jax.random.normal(k, (8, 8)) * 0.3 for k in jax.random.split(jax.random.key(0), 2)]


def batch(rows: int):
    return jax.random.normal(jax.random.key(rows), (rows, 8))


def live_executables() -> int:
    gc.collect()
    return len(jax.devices()[0].client.live_executables())


@pytest.mark.slow
def test_the_lru_drops_the_least_recently_used_signature_and_keeps_reused_ones(meshes2):
    step = mpmdc.compile(STEP, meshes2, cache_size=2)
    xs = {rows: batch(rows) for rows in (2, 4, 6)}
    want = {rows: jax.jit(STEP)(WS, x) for rows, x in xs.items()}
    compiles = []
    for rows in (2, 4, 2, 6, 2, 4):  # 6 drops 4 (2 was used since), 4 comes back
        with XlaCompiles() as c:
            got = step(WS, xs[rows])
        compiles.append(c.count > 0)
        assert_same_tree(got, want[rows])
    assert compiles == [True, True, False, True, False, True]
    info = step.cache_info()
    assert (info.hits, info.misses, info.evictions, info.maxsize, info.currsize) == (2, 4, 2, 2, 2)


@pytest.mark.parametrize("clear", ["step.clear_cache()", "jax.clear_caches()"])
@pytest.mark.slow
def test_clearing_drops_every_executable_and_the_next_call_compiles_as_jit(meshes2, clear):
    step = mpmdc.compile(STEP, meshes2)
    x = batch(4)
    want = jax.jit(STEP)(WS, x)
    step(WS, x)
    step(WS, batch(2))
    held = live_executables()
    assert step.cache_info().currsize == 2
    step.clear_cache() if clear == "step.clear_cache()" else jax.clear_caches()
    assert step.cache_info().currsize == 0
    assert live_executables() < held  # the executables are gone, not only the entries
    with XlaCompiles() as c:
        got = step(WS, x)
    assert c.count > 0
    assert_same_tree(got, want)
    assert step.cache_info().currsize == 1


def test_compiling_another_lowering_of_the_same_types_compiles_nothing(meshes2):
    """As with ``jax.jit``: ``lower().compile()`` again (or after a call) returns the
    executable kept for those argument types; for new types it compiles."""
    step = mpmdc.compile(STEP, meshes2)
    x = batch(4)
    first = step.lower(WS, x).compile()
    with XlaCompiles() as c:
        again = step.lower(WS, x).compile()
        step(WS, x)
    assert c.count == 0 and again is first
    assert step.cache_info().currsize == 1
    other = mpmdc.compile(STEP, meshes2)
    other(WS, x)
    with XlaCompiles() as c:
        other.lower(WS, x).compile()
    assert c.count == 0
    x2 = batch(2)
    with XlaCompiles() as c:
        other.lower(WS, x2).compile()
        other.trace(WS, x2).lower().compile()  # (the same as lower)
    assert c.count > 0
    with XlaCompiles() as c:
        other.trace(WS, x2).lower().compile()
    assert c.count == 0
    assert other.cache_info().currsize == 2


def test_the_mesh_of_the_callers_set_mesh_is_part_of_the_signature(meshes2):
    """As with ``jax.jit``: a step whose constraint names a bare ``PartitionSpec`` (read
    against ``jax.set_mesh``'s mesh while tracing) traced under one is not served outside
    it, where tracing it fails as ``jax.jit``'s does; under the same mesh again it is."""

    def step(x):
        y = jax.lax.with_sharding_constraint(jax.numpy.sin(x), P("data"))
        return mpmdc.stage(y, 1) * 2

    compiled = mpmdc.compile(step, meshes2)
    x = batch(4)
    with jax.set_mesh(meshes2[0]):
        want = jax.jit(step)(x)
        assert_same_tree(compiled(x), want)
        with XlaCompiles() as c:
            compiled(x)
        assert c.count == 0
    with pytest.raises(RuntimeError, match="requires a non-empty mesh in context") as outside:
        jax.jit(step)(x)
    with pytest.raises(type(outside.value), match="requires a non-empty mesh in context"):
        compiled(x)
    assert compiled.cache_info().currsize == 1


def test_a_compiled_program_keeps_its_executables_not_its_modules(meshes2):
    """Each module is an MLIR module in a context of its own, several times what its
    executable holds; once compiled, only the ``Lowered`` (while kept) holds them."""
    lowered = mpmdc.compile(STEP, meshes2).lower(WS, batch(4))
    modules = [weakref.ref(m) for m in lowered.program("stablehlo").lowerings.values()]
    assert modules
    compiled = lowered.compile()
    del lowered
    gc.collect()
    assert [m() for m in modules] == [None] * len(modules)
    assert_same_tree(compiled(WS, batch(4)), jax.jit(STEP)(WS, batch(4)))


@pytest.mark.parametrize("size", [0, -1, 2.0, "8", True])
def test_a_cache_size_that_is_no_positive_int_is_named(meshes2, size):
    with pytest.raises(ArgumentError, match=r"cache_size must be a positive int .* or None"):
        mpmdc.compile(STEP, meshes2, cache_size=size)


def test_the_cache_alone_counts_hits_misses_and_evictions_and_files_what_serves():
    cache = ExecutableCache(2, "test")
    assert cache.get("a") is None
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # now the most recently used
    cache.put("c", 3)
    assert cache.cache_keys() == ["a", "c"]
    assert cache.get("d", lambda key, exe: exe == 3) == 3  # served by c's, filed under d
    assert cache.cache_keys() == ["c", "d"]
    assert tuple(cache.cache_info()) == (2, 1, 2, 2, 2)
    assert cache.put("d", 4) == 3  # one kept already is the one used
    jax.clear_caches()
    assert len(cache) == 0
    unbounded = ExecutableCache(None, "test")
    for k in range(100):
        unbounded.put(k, k)
    assert unbounded.cache_info().evictions == 0 and len(unbounded) == 100


def test_a_new_argument_type_the_function_cannot_take_is_named_in_the_error(meshes2):
    """A second call with a parameter of a wrong shape is traced again and fails in the
    user's function, with JAX's error as ``jax.jit`` gives it; a note names the argument
    whose type changed from the last call's, and both types."""
    step = mpmdc.compile(STEP, meshes2)
    step(WS, batch(4))
    with pytest.raises(TypeError) as caught:
        step([WS[0][:, :4], WS[1]], batch(4))
    assert (
        "mpmdc: the function was traced again for new argument types, and failed: "
        "args[0][0] is float32[8, 4] (was float32[8, 8])"
    ) in "\n".join(getattr(caught.value, "__notes__", []))


def test_the_note_compares_with_the_nearest_earlier_call_not_the_last(meshes2):
    """After calls at batch 4 and then 2, a call at batch 4 with a parameter of a wrong
    shape names only the parameter: the batch's type was compiled before."""
    step = mpmdc.compile(STEP, meshes2)
    step(WS, batch(4))
    step(WS, batch(2))
    with pytest.raises(TypeError) as caught:
        step([WS[0][:, :4], WS[1]], batch(4))
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "failed: args[0][0] is float32[8, 4] (was float32[8, 8])." in note


def test_a_new_batch_size_accumulate_cannot_split_is_named_in_its_error(meshes2):
    """mpmdc's own errors get the note too: a batch of 6 rows for 4 microbatches, after
    a call with 8, names the batch and both types."""

    def step(ws, x):
        return mpmdc.accumulate(lambda b: STEP(ws, b), x, microbatches=4)

    compiled = mpmdc.compile(step, meshes2)
    compiled(WS, batch(8))
    with pytest.raises(AccumulateError) as caught:
        compiled(WS, batch(6))
    assert "args[1] is float32[6, 8] (was float32[8, 8])" in "\n".join(caught.value.__notes__)


def test_a_spec_a_type_holds_on_explicit_axes_is_named_in_the_note():
    """On Explicit axes a spec is part of an argument's type. Parameters fed back as
    ``out_shardings`` lays them out run on the first call's executable, traced with
    unsharded types; a new batch size traces them with their specs, which this model's
    contraction over ``model`` cannot take (``jax.jit`` fails at its second call). The
    note names the specs as well as the batch."""
    meshes = mpmdc.make_meshes(2, {"model": 2}, axis_types=jax.sharding.AxisType.Explicit)
    specs = (P(None, "model"), P("model", None))
    params = [(jnp.ones((8, 16)) / 8, jnp.ones((16, 8)) / 16) for _ in meshes]

    def step(ps, x):
        def loss_fn(ps):
            h = x
            for i, (w1, w2) in enumerate(ps):
                h = jnp.tanh(mpmdc.stage(h, i) @ w1) @ w2
            return jnp.mean(h**2)

        loss, g = jax.value_and_grad(loss_fn)(ps)
        return jax.tree.map(lambda p, d: p - 0.1 * d, ps, g), loss

    laid_out = [tuple(NamedSharding(m, s) for s in specs) for m in meshes]
    compiled = mpmdc.compile(step, meshes, out_shardings=(laid_out, None))
    with jax.set_mesh(meshes[0]):
        params, _ = compiled(params, jnp.ones((4, 8)))
        params, _ = compiled(params, jnp.ones((4, 8)))  # (the first call's executable)
        with pytest.raises(Exception, match="Contracting dimensions are sharded") as caught:
            compiled(params, jnp.ones((2, 8)))
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "args[1] is float32[2, 8] (was float32[4, 8])" in note, note
    assert "args[0][0][0] holds P(None, 'model') in its type (was P())" in note, note
