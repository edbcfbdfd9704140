"""The staged API under the names ``jax.stages`` gives it: ``mpmdc.compile`` returns a
``Wrapped`` function, ``trace`` a ``Traced``, ``lower`` a ``Lowered`` and
``Lowered.compile`` a ``Compiled``, each with the facts its JAX namesake offers; static
and donated arguments by number or by name, as ``jax.jit`` takes them; StableHLO for a
platform or for a registered backend."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_index

import mpmdc
from mpmdc import backends, errors

WS = [jnp.eye(8) * 0.5, jnp.ones((8, 16)) / 8]
X = jnp.arange(32.0).reshape(4, 8) / 32


def loss(ws, x, scale=1.0):
    """Two stages, the second's matmul twice the first's."""
    for i, w in enumerate(ws):
        x = jnp.tanh(mpmdc.stage(x, i) @ w)
    return jnp.sum(x**2) * scale


def test_each_stage_has_the_name_of_its_jax_stages_namesake(meshes2):
    step = mpmdc.compile(jax.value_and_grad(loss), meshes2)
    traced = step.trace(WS, X)
    lowered = traced.lower()
    compiled = lowered.compile()
    assert [type(s).__name__ for s in (step, traced, lowered, compiled)] == [
        "Wrapped",
        "Traced",
        "Lowered",
        "Compiled",
    ]
    assert (mpmdc.Wrapped, mpmdc.Traced, mpmdc.Lowered, mpmdc.Compiled) == tuple(
        map(type, (step, traced, lowered, compiled))
    )
    assert lowered.stages == step.lower(WS, X).stages
    jax.tree.map(np.testing.assert_array_equal, compiled(WS, X), step(WS, X))


def test_the_compiled_function_has_its_functions_name_docstring_and_signature(meshes2):
    """As ``jax.jit(fn)`` has: ``__name__``, ``__doc__``, ``__wrapped__`` and so
    ``inspect.signature``."""

    def train_step(params, x, *, lr=0.1):
        """One step of training."""
        return params

    step = mpmdc.compile(train_step, meshes2)
    assert (step.__name__, step.__doc__, step.__wrapped__) == (
        "train_step",
        "One step of training.",
        train_step,
    )
    assert str(inspect.signature(step)) == "(params, x, *, lr=0.1)"
    # A partial has no docstring of its own: not functools.partial's class docstring.
    partial = mpmdc.compile(functools.partial(train_step, lr=0.2), meshes2)
    assert partial.__doc__ == mpmdc.Wrapped.__doc__
    assert str(inspect.signature(partial)) == "(params, x, *, lr=0.2)"
    assert repr(step).startswith("<mpmdc.compile of ") and "train_step over 2 meshes" in repr(step)


def test_traced_tells_what_tracing_learnt_as_jaxs_does(meshes2):
    fn = jax.value_and_grad(loss)
    ours = mpmdc.compile(fn, meshes2, donate_argnums=0).trace(WS, X)
    jaxs = jax.jit(fn, donate_argnums=0).trace(WS, X)
    assert ours.out_info == jaxs.out_info
    assert jax.tree.structure(ours.args_info) == jax.tree.structure(jaxs.args_info)
    for mine, theirs in zip(jax.tree.leaves(ours.args_info), jax.tree.leaves(jaxs.args_info)):
        assert (mine.shape, mine.dtype, mine.donated) == (
            theirs.shape,
            theirs.dtype,
            theirs.donated,
        )
    assert [a.donated for a in jax.tree.leaves(ours.args_info)] == [True, True, False]
    assert ours.fun_name == "loss"
    # The jaxpr is the traced function, flat: one input per argument leaf.
    assert ours.jaxpr.in_avals == [jax.typeof(a) for a in [*WS, X]]
    assert ours.jaxpr.out_avals == [jax.typeof(o) for o in jax.tree.leaves(jaxs.out_info)]


def test_shardings_are_properties_of_compiled_and_methods_of_the_wrapped_function(meshes2):
    step = mpmdc.compile(jax.value_and_grad(loss), meshes2)
    compiled = step.lower(WS, X).compile()
    assert isinstance(type(compiled).input_shardings, property)
    assert isinstance(type(compiled).output_shardings, property)
    assert compiled.input_shardings == step.input_shardings(WS, X)
    assert compiled.output_shardings == step.output_shardings(WS, X)
    # The placement recipe: arguments put where they run are used as they are.
    ws, x = jax.device_put((WS, X), step.input_shardings(WS, X)[0])
    assert [mesh_index(w, meshes2) for w in ws] == [0, 1]
    _, grads = step(ws, x)
    assert [mesh_index(g, meshes2) for g in grads] == [0, 1]


def test_cost_and_memory_analysis_are_xlas_per_mesh(meshes2):
    compiled = mpmdc.compile(jax.value_and_grad(loss), meshes2).lower(WS, X).compile()
    costs = compiled.cost_analysis()
    assert sorted(costs) == [0, 1]
    assert all(c["flops"] > 0 and c["bytes accessed"] > 0 for c in costs.values())
    assert not any("{" in name for c in costs.values() for name in c)  # whole-module figures
    assert costs[1]["flops"] > costs[0]["flops"]  # stage 1's matmul is twice stage 0's
    memory = compiled.memory_analysis()
    assert sorted(memory) == [0, 1]
    for figures in memory.values():
        assert set(figures) == {
            "generated_code_size_in_bytes",
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
        }
        assert figures["argument_size_in_bytes"] > 0


def test_costs_count_each_microbatchs_fragment_call(meshes2):
    """Twice the microbatches, each half the size: the same work per step, although each
    stage's fragment has one executable either way."""

    def step(ws, x):
        return mpmdc.accumulate(
            lambda mb: jax.grad(loss)(ws, mb), x, microbatches=microbatches, reduce="sum"
        )

    flops = {}
    for microbatches in (2, 4):
        compiled = mpmdc.compile(step, meshes2).lower(WS, jnp.ones((8, 8))).compile()
        flops[microbatches] = [c["flops"] for _, c in sorted(compiled.cost_analysis().items())]
    # Not rounding: XLA's estimate counts some work per call (measured: 5.3% more for 4
    # microbatches than for 2); 10% allowed.
    np.testing.assert_allclose(flops[4], flops[2], rtol=0.1)


def test_a_donated_argument_is_donated_by_position_and_by_keyword(meshes2):
    def fn(w, x):
        return loss([w, WS[1]], x)

    on_mesh0 = jax.sharding.NamedSharding(meshes2[0], jax.sharding.PartitionSpec())
    for kwargs in ({"donate_argnums": 1}, {"donate_argnames": "x"}):
        step = mpmdc.compile(fn, meshes2, **kwargs)
        by_position, by_keyword = (jax.device_put(X + 0, on_mesh0) for _ in range(2))
        want = float(jax.jit(fn)(WS[0], X))
        assert float(step(WS[0], by_position)) == want
        assert float(step(WS[0], x=by_keyword)) == want
        assert by_position.is_deleted() and by_keyword.is_deleted(), kwargs
        info = step.lower(WS[0], x=X).compile().args_info
        assert info[1]["x"].donated and not info[0][0].donated


def test_a_static_argument_by_name_is_in_the_cache_key(meshes2):
    traces = []

    def fn(ws, x, scale=1.0):
        traces.append(scale)
        return loss(ws, x, scale)

    for kwargs in ({"static_argnames": "scale"}, {"static_argnums": 2}):
        traces.clear()
        step = mpmdc.compile(fn, meshes2, **kwargs)
        one, two = step(WS, X, scale=1.0), step(WS, X, scale=2.0)
        assert float(two) == 2 * float(one)
        step(WS, X, scale=2.0)
        assert traces == [1.0, 2.0], kwargs
        # By position too (another call signature, so traced again, as under jax.jit).
        assert float(step(WS, X, 2.0)) == float(two)
        assert traces == [1.0, 2.0, 2.0], kwargs
    # A static argument is fixed by lower(): the compiled program takes the others.
    compiled = mpmdc.compile(fn, meshes2, static_argnames="scale").lower(WS, X, scale=3.0).compile()
    # (Times 3 is rounded once more than the loss scaled inside: one float32 ulp, 1.2e-07
    # relative; margin 4x.)
    assert float(compiled(WS, X)) == pytest.approx(3 * float(one), rel=5e-7)


def test_a_call_after_lower_compiles_what_lower_made_without_tracing_again(meshes2):
    """As ``jax.jit``: ``lower()`` then a call of the same types traces once (a warning
    made while tracing is said once); a call of other types, or after another
    ``lower()`` or ``clear_cache()``, traces as it would have."""
    traces = []

    def fn(ws, x):
        traces.append(x.shape)
        return loss(ws, x)

    step = mpmdc.compile(fn, meshes2)
    lowered = step.lower(WS, X)
    assert float(step(WS, X)) == float(lowered.compile()(WS, X))
    assert traces == [X.shape]
    assert step.cache_info().misses == 1
    step(WS, X)
    assert traces == [X.shape] and step.cache_info().hits == 1
    wider = jnp.ones((8, 8))
    step.lower(WS, wider)
    step.lower(WS, X[:2])  # (the program kept is this one, not the last but one)
    step(WS, wider)
    assert traces == [X.shape, wider.shape, (2, 8), wider.shape]
    step.clear_cache()
    step(WS, X[:2])
    assert traces[-1] == (2, 8) and len(traces) == 5


def test_an_argname_the_function_lacks_is_named(meshes2):
    with pytest.raises(
        errors.ArgumentError, match=r"static_argnames names \['scal'\].*ws, x, scale"
    ):
        mpmdc.compile(loss, meshes2, static_argnames="scal")
    with pytest.raises(errors.ArgumentError, match="donate_argnames must be a str"):
        mpmdc.compile(loss, meshes2, donate_argnames=[0])


def test_stablehlo_takes_a_platform_or_a_backend(meshes2, monkeypatch):
    monkeypatch.setattr(backends, "_registry", dict(backends._registry))
    backends.register(backends.Backend("test-cuda-sends", "cuda", transfers="in-program"))
    lowered = mpmdc.compile(loss, meshes2).lower(WS, X)
    assert lowered.stablehlo(platform="tpu") == lowered.stablehlo(backend="tpu")
    assert "stablehlo.send" in "".join(lowered.stablehlo(backend="test-cuda-sends").values())
    with pytest.raises(errors.BackendError, match="choose it with backend='test-cuda-sends'"):
        lowered.stablehlo(platform="test-cuda-sends")
    with pytest.raises(errors.BackendError, match="not both"):
        lowered.stablehlo(platform="cuda", backend="test-cuda-sends")
    # A platform keeps the program's own backend where it lowers for that platform.
    sending = mpmdc.compile(loss, meshes2, backend="test-cuda-sends").lower(WS, X)
    assert sending.stablehlo(platform="cuda") == sending.stablehlo()
    assert sending.stablehlo(platform="rocm") == lowered.stablehlo(platform="rocm")


def _named_for_processes(x, scale):
    return x * scale


def test_processes_meet_on_a_functions_qualified_name_seen_through_partials():
    """Several processes check their programs on a topic named by the function: its module
    and qualified name, the same in every process (a ``partial``'s is its function's)."""
    import functools

    from mpmdc.signatures import qualified_name

    name = f"{__name__}._named_for_processes"
    assert qualified_name(_named_for_processes) == name
    assert qualified_name(functools.partial(_named_for_processes, scale=2)) == name
