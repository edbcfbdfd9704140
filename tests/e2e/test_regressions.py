"""Named regression tests for failures the differential fuzzer found (``tests/fuzz``).

Each program is checked against ``jax.jit`` of the same program with every
``shard_map`` on one mesh (a ``psum`` over two devices gives the same numbers on any
two devices; ``jax.jit`` cannot run ``shard_map``s on several device sets). Every pass
is re-checked by ``vma-typecheck`` (the test configuration sets ``MPMDC_VERIFY=1``).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import XlaCompiles, assert_same_array, assert_same_as_jit, assert_same_tree
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.errors import PlacementWarning


def psum_on(mesh):
    return jax.shard_map(
        lambda t: jax.lax.psum(t, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")
    )


def clipped_momentum_step(loss):
    """A training step on ``loss``: the gradients clipped by their global norm, then SGD
    with momentum; returns the loss, the parameters and the momenta."""

    def step(params, momenta):
        value, grads = jax.value_and_grad(loss)(params)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
        scale = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
        momenta = [0.9 * m + scale * g for m, g in zip(momenta, grads)]
        return value, [p - 0.1 * m for p, m in zip(params, momenta)], momenta

    return step


def assert_first_state_stays_on_mesh_0(loss, meshes, x):
    """``clipped_momentum_step(loss)`` on two parameters: the first and its momentum go in
    and come back on mesh 0, the results are ``jax.jit``'s, and feeding them back compiles
    nothing."""
    step = clipped_momentum_step(loss)
    params, momenta = [x, x + 1], [x * 0.5, x * 0.25]
    compiled = mpmdc.compile(step, meshes)
    program = compiled.lower(params, momenta).program("after-split")
    assert program.in_meshes[0] == program.in_meshes[2] == 0
    assert program.out_meshes[1] == program.out_meshes[3] == 0
    got = compiled(params, momenta)
    # Noise floor: jax.jit against eager 6e-8 relative on these values; margin 20x.
    assert_same_tree(got, jax.jit(step)(params, momenta), rtol=1.2e-6, atol=1e-7)
    with XlaCompiles() as compiles:
        compiled(*got[1:])
    assert compiles.count == 0


def unmarked_operand(x, mesh_of):
    """A shard_map on mesh 1 reads a stage-0 value that was never marked into stage 1,
    and one on mesh 0 reads a stage-1 value: the shard_map's own mesh must place it."""
    y = jnp.tanh(mpmdc.stage(x, 0))
    a = psum_on(mesh_of(1))(y)
    b = mpmdc.stage(jnp.sin(a), 1)
    return jnp.sum(psum_on(mesh_of(0))(b))


def transpose_reads_later_stage(x, mesh_of):
    """The shard_map's transpose reads only a cotangent computed in stage 1 (``w`` is
    read across stages without a marker), so operand rules alone would put it there."""
    a = psum_on(mesh_of(0))(mpmdc.stage(x, 0))
    w = mpmdc.stage(x, 1)
    return jnp.sum(jnp.sin(w * a))


def stages_share_a_mesh(x, mesh_of):
    """Stages 0 and 2 share mesh 0: the shard_map reads stage 1 and feeds stage 2, and its
    transpose's cotangent comes from stage 2's backward."""
    h = mpmdc.stage(jnp.tanh(mpmdc.stage(x, 0)), 1) * 2.0
    a = psum_on(mesh_of(0))(h)
    return jnp.sum(jnp.cos(mpmdc.stage(a, 2) * x))


def marker_between_shard_maps_of_two_meshes(x, mesh_of):
    """Non-monotonic markers with shard_maps on both meshes, both inside one gradient."""
    a = psum_on(mesh_of(1))(mpmdc.stage(x, 1))
    b = mpmdc.stage(jnp.tanh(a) + x, 0)
    c = psum_on(mesh_of(0))(b * a)
    return jnp.sum(jnp.sin(mpmdc.stage(c, 1)) * b)


def no_marker_names_the_mesh(x, mesh_of):
    """Only stage 1 is marked; the shard_map on mesh 0 must still run there, in stage 0
    (also inside ``accumulate`` under ZB-H1)."""
    a = psum_on(mesh_of(0))(x * 0.5)
    return jnp.sum(mpmdc.stage(a, 1))


CASES = {
    "no_marker_names_the_mesh": (no_marker_names_the_mesh, None),
    "unmarked_operand": (unmarked_operand, None),
    "transpose_reads_later_stage": (transpose_reads_later_stage, None),
    "stages_share_a_mesh": (stages_share_a_mesh, (0, 1, 0)),
    "marker_between_shard_maps_of_two_meshes": (marker_between_shard_maps_of_two_meshes, None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_shard_map_runs_on_its_own_mesh_also_in_the_backward(name):
    body, stage_to_mesh = CASES[name]
    meshes = mpmdc.make_meshes(2, {"d": 2})
    reference_mesh = mpmdc.make_meshes(1, {"d": 2})[0]
    x = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 10

    compiled = mpmdc.compile(
        jax.value_and_grad(lambda x: body(x, lambda m: meshes[m])),
        meshes,
        stage_to_mesh=stage_to_mesh,
    )
    program = compiled.lower(x).program("after-partition")
    for eqn, placement in zip(program.jaxpr.eqns, program.placements):
        if eqn.primitive.name == "shard_map":
            runs_on = program.meshes[program.mesh_of_stage(placement.stage)]
            assert runs_on.device_ids.tolist() == eqn.params["mesh"].device_ids.tolist(), (
                placement.label
            )

    got = compiled(x)
    want = jax.jit(jax.value_and_grad(lambda x: body(x, lambda m: reference_mesh)))(x)
    # Noise floor 1.2e-07 relative (jax.jit against eager, the largest over the cases),
    # margin 10x.
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1.2e-6)


# ------------------------------------------- programs users write
# Each of these guards against a wrong number or a raw exception.


def test_dead_jitted_helper_with_an_effect_keeps_its_placement():
    """JAX's DCE rebuilds a jitted call whose outputs are all unused but which prints,
    with no outputs at all; ``partition`` places the rebuilt equation, the placement
    stays on it, and nothing raises."""
    printed = []

    @jax.jit
    def helper(x):
        jax.debug.callback(lambda v: printed.append(np.asarray(v)), x)
        return x * 2

    def fn(x):
        helper(x)
        return mpmdc.stage(x, 1) + 1

    meshes = mpmdc.make_meshes(2, {"d": 2})
    x = jnp.arange(3.0)
    assert_same_as_jit(fn, meshes, x)
    assert len(printed) == 2  # once under mpmdc, once under jax.jit
    np.testing.assert_array_equal(printed[0], printed[1])
    program = mpmdc.compile(fn, meshes).lower(x).program("after-partition")
    (call,) = [e for e in program.jaxpr.eqns if e.primitive.name == "jit"]
    assert not call.outvars and program.placements[program.jaxpr.eqns.index(call)] is not None


A_JAX = jax.random.normal(jax.random.key(1), (4, 4))
B_NUMPY = np.asarray(jax.random.normal(jax.random.key(2), (4, 4)))


def _closing_over(c):
    @jax.jit
    def helper(x):
        return jnp.tanh(x @ c)

    return helper


@pytest.mark.parametrize(
    "stages",
    [(0, 1), (0, 1, 0)],
    ids=["two_stages_one_mesh", "stage_re_entered"],
)
def test_fragments_differing_only_in_captured_constants_do_not_share(stages):
    """Fragment bodies that print alike but capture different arrays (module-level jax
    and numpy arrays, a closure, a jitted helper's own constant) must not share one
    executable, or every element is wrong: their identity includes the constants."""
    closure = jnp.full((4, 4), 0.3)
    consts = [A_JAX, B_NUMPY, closure]

    def fn(x):
        for i, s in enumerate(stages):
            x = jnp.tanh(mpmdc.stage(x, s) @ consts[i])
            x = _closing_over(consts[-1 - i])(x)
        return x

    meshes = mpmdc.make_meshes(1 if len(stages) == 2 else 2, {"d": 2})
    assert_same_as_jit(fn, meshes, jnp.linspace(-1, 1, 16).reshape(4, 4))


def test_fragments_differing_only_in_their_callback_do_not_share():
    """``debug.callback`` and ``pure_callback`` print their function as a masked address,
    so two stages calling different functions look alike; they must not share an
    executable."""
    seen = []

    def stage_body(x, s):
        x = mpmdc.stage(x, s)
        jax.debug.callback(lambda v: seen.append(s), x)
        return jax.pure_callback(
            lambda v: np.asarray(v) + s, jax.ShapeDtypeStruct(x.shape, x.dtype), x
        )

    def fn(x):
        return stage_body(stage_body(x, 0), 1)

    meshes = mpmdc.make_meshes(1, {"d": 2})
    assert_same_as_jit(fn, meshes, jnp.zeros(4))
    assert sorted(seen) == [0, 0, 1, 1]  # each stage its own callback, once per run


def test_a_new_weak_type_is_a_new_signature():
    """The call cache keys on the weak type too: after ``step(2.0, y)`` (a weakly typed
    scalar), ``step(jnp.float32(2.0), y)`` gets an executable of its own and returns
    float32, as ``jax.jit`` does, not bfloat16."""

    def fn(a, y):
        return mpmdc.stage(a * y, 1) + 1

    meshes = mpmdc.make_meshes(2, {"d": 2})
    step = mpmdc.compile(fn, meshes)
    y = jnp.ones(4, jnp.bfloat16)
    for a in (2.0, jnp.float32(2.0), 2, jnp.asarray(2.0), np.float16(2.0)):
        got, want = step(a, y), jax.jit(fn)(a, y)
        assert_same_array(got, want)


def test_under_disable_jit_a_compiled_step_runs_op_by_op_as_jit_does():
    """``jax.disable_jit()`` (a debugging switch) runs a compiled step as it runs a
    ``jax.jit`` one: the function op by op, markers (a scan's ``every=`` too) and the
    microbatch loop as identities and a loop; nothing is compiled."""
    meshes = mpmdc.make_meshes(2, {"d": 2})
    ws = jnp.stack([jnp.eye(4) * 0.5, jnp.eye(4) * 0.25])
    x = jnp.arange(32.0).reshape(8, 4) / 32

    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(mpmdc.stage(h, every=1) @ w), None

        return jnp.sum(jax.lax.scan(layer, x, ws)[0])

    def step(ws, x):
        return mpmdc.accumulate(lambda mb: jax.value_and_grad(loss)(ws, mb), x, microbatches=2)

    compiled = mpmdc.compile(step, meshes)
    with jax.disable_jit():
        assert_same_tree(compiled(ws, x), jax.jit(step)(ws, x))
    assert compiled.cache_info().currsize == 0


@pytest.mark.parametrize("dtype", ["int4", "uint4", "float4_e2m1fn", "float8_e4m3fn", "int2"])
def test_narrow_dtypes_cross_stages_as_arguments_and_between_fragments(dtype):
    """A 4-bit (or 2-bit) array read by a fragment, as an argument or from another
    stage, runs as under ``jax.jit``: JAX's check of an executable's input layouts
    refuses every such array (its layout lacks the element size the executable's has)."""
    dtype = jnp.dtype(dtype)
    meshes = mpmdc.make_meshes(2, {"d": 2})
    x = jnp.arange(-2.0, 2.0, 0.25).reshape(2, 8)

    def crossing(x):
        h = mpmdc.stage(mpmdc.stage(x.astype(dtype), 0), 1)
        return (h * 2).astype(jnp.float32)

    def argument(a):
        return (mpmdc.stage(a, 1) * 2).astype(jnp.float32)

    assert_same_array(mpmdc.compile(crossing, meshes)(x), jax.jit(crossing)(x))
    narrow = x.astype(dtype)
    assert_same_array(mpmdc.compile(argument, meshes)(narrow), jax.jit(argument)(narrow))


@pytest.mark.slow
def test_typed_prng_keys_as_arguments_outputs_and_microbatches():
    """``jax.random.key`` arrays work as arguments, outputs, across transfers, in ``lower``
    with ``ShapeDtypeStruct``s and in ``accumulate``'s ``xs``, with no ``TypeError:
    Cannot interpret 'key<fry>' as a data type``."""
    meshes = mpmdc.make_meshes(2, {"d": 2})

    def fn(key, x):
        k1, k2 = jax.random.split(key)
        x = mpmdc.stage(x + jax.random.normal(k1, x.shape), 0)
        x, k2 = mpmdc.stage((x, k2), 1)  # the key crosses to mesh 1
        return x * jax.random.uniform(k2, x.shape), jax.random.split(k2, 3)

    key, x = jax.random.key(0), jnp.ones(4)
    assert_same_as_jit(fn, meshes, key, x)
    assert_same_as_jit(fn, meshes, jax.random.PRNGKey(0), x)  # raw uint32 keys too
    lowered = mpmdc.compile(fn, meshes).lower(
        jax.ShapeDtypeStruct((), key.dtype), jax.ShapeDtypeStruct((4,), jnp.float32)
    )
    assert "key<fry>[] @mesh0" in lowered.as_text("after-split")
    np.testing.assert_array_equal(
        jax.random.key_data(lowered.compile()(key, x)[1]), jax.random.key_data(fn(key, x)[1])
    )

    def per_microbatch(w, xs):
        batch, keys = xs
        h = mpmdc.stage(batch * w, 0)
        return jnp.sum(mpmdc.stage(h + jax.random.normal(keys[0], h.shape), 1))

    def loop(w, batch, keys):
        return mpmdc.accumulate(
            lambda xs: per_microbatch(w, xs), (batch, keys), microbatches=2, schedule="gpipe"
        )

    # Noise floor 1.5e-07 relative (jax.jit against eager), margin 10x.
    assert_same_as_jit(
        loop, meshes, jnp.ones(4), jnp.ones((4, 4)), jax.random.split(key, 2), rtol=1.5e-6
    )


def test_a_wrong_pytree_is_named_in_a_line():
    """Calling an executable with one extra key in a 200-entry dict names the path and the
    key in one short line, not both whole ``PyTreeDef``s (tens of thousands of
    characters)."""
    meshes = mpmdc.make_meshes(2, {"d": 2})
    params = {f"w{i}": jnp.ones(3) for i in range(200)}
    executable = (
        mpmdc.compile(lambda p, x: mpmdc.stage(x, 1) + sum(jax.tree.leaves(p)), meshes)
        .lower(params, jnp.ones(3))
        .compile()
    )
    with pytest.raises(mpmdc.errors.ArgumentError) as caught:
        executable({**params, "extra": jnp.ones(3)}, jnp.ones(3))
    assert len(str(caught.value)) < 300
    assert "args[0] is a dict of 201 entries (unexpected ['extra'])" in str(caught.value)


# What a new user tries: Flax, Optax, callbacks, transformations.


def test_results_computed_from_weak_values_stay_weak():
    """A fragment is lowered with weakly typed arguments where the call's are, so ``s * 2``
    of a Python scalar stays weak: multiplied into a bfloat16 array it keeps bfloat16,
    as ``jax.jit``'s result does, not float32."""
    meshes = mpmdc.make_meshes(2, {"d": 1})

    def fn(s, x):
        x = mpmdc.stage(x, 0) * 2
        return mpmdc.stage(x, 1), s * 2, mpmdc.stage(s * 3, 1), s, 2.0

    for s in (2.5, 3, 1 + 2j):
        assert_same_as_jit(fn, meshes, s, jnp.ones(2))
    doubled = mpmdc.compile(lambda s: s * 2, meshes)(2.5)
    assert (jnp.ones(2, jnp.bfloat16) * doubled).dtype == jnp.bfloat16


def test_a_failing_callback_in_a_fragment_without_results_fails_the_call():
    """A fragment with a callback and no results gives ``block_until_ready`` nothing to
    wait on; the call must still wait for its effects and fail, not return normally
    and let the error surface later, raw."""
    meshes = mpmdc.make_meshes(2, {"d": 1})
    fail = {"now": True}

    def check(v):
        if fail["now"]:
            time.sleep(0.05)  # the call has long returned by now, unless it waits for effects
            raise ZeroDivisionError("boom")

    for _ in range(10):
        step = mpmdc.compile(lambda x: (jax.debug.callback(check, mpmdc.stage(x, 1)), x)[1], meshes)
        with pytest.raises(
            mpmdc.errors.MpmdRuntimeError, match="s1_fwd on mesh1 failed while running"
        ):
            step(jnp.ones(4))
    fail["now"] = False
    np.testing.assert_array_equal(step(jnp.ones(4)), np.ones(4))


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_calling_a_pipeline_inside_a_transformation_is_named(transform):
    """Calling a compiled pipeline under ``jax.jit``/``grad``/``vmap`` is a named error,
    not a raw ``AttributeError`` about a tracer's sharding."""
    step = mpmdc.compile(lambda x: jnp.sin(mpmdc.stage(x, 1)), mpmdc.make_meshes(2, {"d": 1}))
    call = {
        "jit": lambda: jax.jit(lambda x: step(x) * 2)(jnp.ones(3)),
        "grad": lambda: jax.grad(lambda x: step(x).sum())(jnp.ones(3)),
        "vmap": lambda: jax.vmap(step)(jnp.ones((2, 3))),
    }[transform]
    with pytest.raises(
        mpmdc.errors.ArgumentError, match=r"args\[0\] is a traced value.*mpmdc.compile\(jax.grad"
    ):
        call()


def test_ordered_effects_on_a_multi_device_mesh_are_the_users_to_fix():
    """An ordered ``debug.print`` on a 2-device mesh is the user's error, not reported as a
    bug in mpmdc (an ``InternalError`` from ``lower``); ``jax.jit`` refuses it too. On
    1-device meshes it runs in order."""

    def fn(x):
        x = mpmdc.stage(x, 0)
        jax.debug.print("s0 {}", x.sum(), ordered=True)
        x = mpmdc.stage(x * 2, 1)
        jax.debug.print("s1 {}", x.sum(), ordered=True)
        return x

    with pytest.raises(
        mpmdc.errors.TypeCheckError,
        match=r"`debug_print` at .*test_regressions.py.* ordered effect .* mesh0 of 2 devices",
    ):
        mpmdc.compile(fn, mpmdc.make_meshes(2, {"d": 2}))(jnp.ones(4))
    assert_same_as_jit(fn, mpmdc.make_meshes(2, {"d": 1}), jnp.ones(4))


def test_a_keyword_where_a_positional_argument_was_lowered_is_named():
    x = jnp.ones(3)
    executable = mpmdc.compile(
        lambda a, b: mpmdc.stage(a["x"] + b, 1), mpmdc.make_meshes(2, {"d": 1})
    )
    executable = executable.lower({"x": x}, x).compile()
    with pytest.raises(
        mpmdc.errors.ArgumentError,
        match=r"1 positional argument\(s\) and keywords \['b'\], but .* lowered for 2",
    ):
        executable({"x": x}, b=x)


def test_a_body_with_xla_metadata_is_keyed_by_the_metadata_not_its_identity():
    """``body_key`` keys an equation's XLA metadata (a dict, unhashable) by its contents,
    not by the identity of a temporary tuple: otherwise equal bodies get different keys,
    and a recycled address can make different ones equal."""
    from jax.experimental.xla_metadata import set_xla_metadata

    from mpmdc.ir.program import body_key

    def tagged(tag):
        def f(x):
            with set_xla_metadata(tag=tag):
                return jnp.sin(x) * 2

        return jax.make_jaxpr(f)(1.0)

    assert tagged("a").jaxpr.eqns[0].ctx.xla_metadata == {"tag": "a"}
    assert body_key(tagged("a")) == body_key(tagged("a"))
    assert body_key(tagged("a")) != body_key(tagged("b"))


def test_a_body_parameter_is_keyed_by_its_type_and_bits():
    """``body_key`` compares scalar parameters by type and bits, not by Python equality,
    under which 0.0 and -0.0 (and 1, 1.0 and True) are equal: bodies differing only
    there must not share one executable."""
    from jax.extend.core import Primitive

    from mpmdc.ir.program import body_key

    scaled = Primitive("scaled_for_test")
    scaled.def_abstract_eval(lambda x, *, factor: x)

    def body(factor):
        return jax.make_jaxpr(lambda x: scaled.bind(x, factor=factor))(1.0)

    assert body_key(body(0.0)) == body_key(body(0.0))
    assert body_key(body(np.float32(2.0))) == body_key(body(np.float32(2.0)))
    keys = [body_key(body(f)) for f in (0.0, -0.0, 1, 1.0, True, np.float32(1.0), np.float32(-0.0))]
    assert len(set(keys)) == len(keys)


def test_work_after_a_shard_map_of_a_shared_mesh_follows_it_to_its_mesh():
    """A ``shard_map`` built for a mesh that two stages share is placed by the data
    around it and then kept on its own mesh: what reads its results (here a parameter's
    gradient, its clipping and momentum) must follow it there, not the stage the data
    first suggested. The parameter, its update and its momentum share one mesh."""
    meshes = mpmdc.make_meshes(2, {"d": 1})
    c = jnp.full((4, 4), 0.3)

    def loss(params):
        x, _ = params
        a = jax.shard_map(
            lambda t: jax.lax.psum(t, "d") * 0.5,
            mesh=meshes[1],
            in_specs=P("d"),
            out_specs=P("d"),
        )(x)
        h = jnp.tanh(mpmdc.stage(x, 0) @ c)
        return jnp.sum(jnp.tanh(mpmdc.stage(a, 1) @ c)) + jnp.sum(mpmdc.stage(h, 1))

    step = clipped_momentum_step(loss)

    x = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 10
    params, momenta = [x, x + 1], [x * 0.5, x * 0.25]
    # Stage 0 and stage 2 (which the program does not use) share mesh 1.
    compiled = mpmdc.compile(step, meshes, stage_to_mesh=(1, 0, 1))
    program = compiled.lower(params, momenta).program("after-split")
    assert program.in_meshes[0] == program.out_meshes[1] == program.out_meshes[3] == 1
    assert program.in_meshes[2] == 1  # the momentum of x, read where it is updated
    # Noise floor: jax.jit against eager 6e-8 relative on these values; margin 20x.
    assert_same_tree(
        compiled(params, momenta), jax.jit(step)(params, momenta), rtol=1.2e-6, atol=1e-7
    )


def test_a_parameter_updated_in_a_skip_step_cond_comes_back_as_it_went_in():
    """A parameter given no spec whose gradient a ``shard_map`` shards, updated inside a
    skip-step ``lax.cond``: it goes in with the spec its update wants and comes back
    with it, so the second step moves and compiles nothing."""
    meshes = mpmdc.make_meshes(1, {"d": 2})

    def step(p, m):
        def loss(p):
            return jnp.sum(psum_on(meshes[0])(mpmdc.stage(p, 0)) * 0.5)

        value, g = jax.value_and_grad(loss)(p)

        def update(p, m):
            m = 0.9 * m + g
            return p - 0.1 * m, m

        return value, *jax.lax.cond(jnp.isfinite(value), update, lambda p, m: (p, m), p, m)

    x = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 10
    compiled = mpmdc.compile(step, meshes)
    program = compiled.lower(x, x * 0.5).program("after-split")
    assert program.in_specs[0] == program.out_specs[1] == P("d")
    assert program.in_specs[1] == program.out_specs[2] == P("d")
    first = compiled(x, x * 0.5)
    with XlaCompiles() as compiles:
        second = compiled(*first[1:])
    assert compiles.count == 0
    want = jax.jit(step)(*jax.jit(step)(x, x * 0.5)[1:])
    assert_same_tree(second, want)


def test_adam_moments_of_a_weight_sharded_over_two_axes_keep_both():
    """A weight sharded ``P('fsdp', 'tp')`` whose gradient is sharded over ``tp`` alone:
    its AdamW moments, put where the weight is, come back ``P('fsdp', 'tp')`` as they
    went in, and the step fed back compiles nothing."""
    optax = pytest.importorskip("optax")
    meshes = mpmdc.make_meshes(2, {"fsdp": 2, "tp": 2})
    params = {
        "w0": jax.device_put(
            jnp.full((8, 8), 0.1, jnp.float32),
            jax.sharding.NamedSharding(meshes[0], P("fsdp", "tp")),
        ),
        "w1": jax.device_put(
            jnp.full((8, 8), 0.2, jnp.float32),
            jax.sharding.NamedSharding(meshes[1], P("tp", "fsdp")),
        ),
    }
    opt = optax.adamw(1e-2)

    def step(params, state, x):
        def loss(p):
            h = mpmdc.stage(jnp.tanh(mpmdc.stage(x, 0) @ p["w0"]), 1)
            return jnp.sum(jnp.tanh(h @ p["w1"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return value, optax.apply_updates(params, updates), state

    x = jnp.linspace(-1, 1, 32, dtype=jnp.float32).reshape(4, 8)
    compiled = mpmdc.compile(step, meshes)
    (adam, *rest) = opt.init(params)
    on_params = {name: w.sharding for name, w in params.items()}
    adam = adam._replace(
        mu=jax.device_put(adam.mu, on_params), nu=jax.device_put(adam.nu, on_params)
    )
    first = compiled(params, (adam, *rest), x)
    for moment in (first[2][0].mu, first[2][0].nu):
        for name, spec in (("w0", P("fsdp", "tp")), ("w1", P("tp", "fsdp"))):
            assert moment[name].sharding.spec == spec, name
            assert moment[name].sharding.mesh == params[name].sharding.mesh, name
    with XlaCompiles() as compiles:
        compiled(*first[1:], x)
    assert compiles.count == 0


def test_the_momentum_of_a_parameter_with_a_zero_gradient_stays_with_its_parameter():
    """A parameter read on stage 0 whose gradient is zero (its value reaches the loss only
    through ``stop_gradient``): nothing but the global norm, a scalar computed on the last
    stage, pulls its momentum's update anywhere. The update must go where the parameter's
    update reads it, so the momentum lives and comes back on the parameter's mesh, not
    on the mesh of the norm (which would send the momentum across every step)."""
    meshes = mpmdc.make_meshes(2, {"d": 2})
    x = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 10

    def loss(params):
        frozen, w = params
        h = jax.lax.stop_gradient(jnp.tanh(mpmdc.stage(x, 0) @ frozen))
        return jnp.sum(jnp.tanh(mpmdc.stage(h, 1) @ w))

    assert_first_state_stays_on_mesh_0(loss, meshes, x)


def test_state_comes_back_with_its_spec_when_its_gradient_is_split_over_more_axes():
    """A parameter and its momentum given ``P(None, 'b')`` on a two-axis mesh, whose
    gradient is split over ``'a'`` too (it meets a value sharded ``P('a')``): the
    updates come back as they went in, not over both axes, so the next step moves and
    compiles nothing."""
    meshes = mpmdc.make_meshes(1, {"a": 2, "b": 2})
    x = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 10

    def step(p, m, other):
        value, g = jax.value_and_grad(lambda p: jnp.sum(jnp.maximum(p, other)))(p)
        m = 0.1 * g + 0.9 * m
        return value, p - 0.1 * m, m

    specs = (P(None, "b"), P(None, "b"), P("a"))
    compiled = mpmdc.compile(step, meshes, in_specs=specs)
    args = (x, x * 0.5, jnp.flip(x))
    assert compiled.lower(*args).program("after-split").out_specs[1:] == specs[:2]
    got = compiled(*args)
    assert_same_tree(got, jax.jit(step)(*args), rtol=0, atol=0)  # elementwise: exact
    with XlaCompiles() as compiles:
        compiled(*got[1:], args[2])
    assert compiles.count == 0


@pytest.mark.slow
def test_momentum_created_unsharded_takes_its_fsdp_parameters_spec():
    """Parameters given ``P('fsdp', 'tp')`` and a momentum made by ``zeros_like`` (no
    spec, not committed), on two meshes of ``{fsdp: 2, tp: 2}``: the momentum comes
    back sharded as its parameter, not as its gradient (``P(None, 'tp')``)."""
    meshes = mpmdc.make_meshes(2, {"fsdp": 2, "tp": 2})

    def step(params, mom, x):
        def loss(params, x):
            h = mpmdc.stage(x, 0) @ params["w0"]
            h = mpmdc.stage(jnp.tanh(h), 1) @ params["w1"]
            return jnp.mean(h**2)

        g = jax.grad(loss)(params, x)
        mom = jax.tree.map(lambda m, g: 0.9 * m + g, mom, g)
        return jax.tree.map(lambda p, m: p - 0.1 * m, params, mom), mom

    k = jax.random.split(jax.random.key(0), 3)
    params = {"w0": jax.random.normal(k[0], (16, 32)), "w1": jax.random.normal(k[1], (32, 16))}
    mom = jax.tree.map(jnp.zeros_like, params)
    x = jax.random.normal(k[2], (8, 16))
    specs = {"w0": P("fsdp", "tp"), "w1": P("fsdp", "tp")}
    compiled = mpmdc.compile(step, meshes, in_specs=(specs, None, None))
    got = compiled(params, mom, x)
    for name in specs:
        assert got[0][name].sharding == got[1][name].sharding, name
        assert got[1][name].sharding.spec == specs[name], name
    # Noise floor: jax.jit against eager 6e-8 relative on these values; margin 20x.
    assert_same_tree(got, jax.jit(step)(params, mom, x), rtol=1.2e-6, atol=1e-6)
    with XlaCompiles() as compiles:
        compiled(*got, x)
    assert compiles.count == 0


def test_a_frozen_parameters_clipped_zero_gradient_is_not_moved():
    """A stage-1 parameter read through ``stop_gradient``, its (zero) gradient clipped by
    the global norm as optax does (``select(norm < max, g, g / norm * max)``): that
    clipped zero is computed next to the parameter's update from the two scalars, not
    on the mesh of the norm and then moved whole every step."""
    meshes = mpmdc.make_meshes(2, {"d": 2})
    w0, w1, frozen = (jnp.full((8, 8), c, jnp.float32) for c in (0.1, 0.2, 0.3))
    x = jnp.arange(32.0, dtype=jnp.float32).reshape(4, 8) / 32

    def loss(params):
        w0, w1, frozen = params
        h = mpmdc.stage(jnp.tanh(mpmdc.stage(x, 0) @ w0), 1)
        h = h + h @ jax.lax.stop_gradient(frozen)
        return jnp.mean(jnp.tanh(h @ w1) ** 2)

    def step(params):
        grads = jax.grad(loss)(params)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
        clipped = [jnp.where(norm < 1.0, g, g / norm) for g in grads]
        return [p - 0.1 * g for p, g in zip(params, clipped)]

    params = [w0, w1, frozen]
    compiled = mpmdc.compile(step, meshes)
    program = compiled.lower(params).program("after-split")
    moved = [
        v.aval.shape
        for e in program.jaxpr.jaxpr.eqns
        if e.primitive.name == "transfer"
        for v, carries in zip(e.invars, e.params["carries"])
        if carries not in ("activation", "cotangent")
    ]
    assert all(shape == () for shape in moved), moved
    # Noise floor: jax.jit against eager 6e-8 relative on these values; margin 20x.
    assert_same_tree(compiled(params), jax.jit(step)(params), rtol=1.2e-6, atol=1e-7)


@pytest.mark.parametrize("microbatches", [None, 2])
def test_a_frozen_parameters_adam_moments_stay_on_its_mesh(microbatches):
    """A stage-1 parameter read through ``stop_gradient`` (frozen), trained with optax's
    ``clip_by_global_norm`` and ``adam``, whole or under ``accumulate``: the parameter
    and its moments go in and come back on mesh 1, not on the mesh of the global norm.
    Whole, the moments' updates were placed by the scalars (norm, bias correction) they
    read; under ``accumulate``, the zero gradient was summed through the loop on the
    norm's mesh, and the parameter's update and moments followed it there."""
    import optax

    meshes = mpmdc.make_meshes(2, {"d": 2})
    k0, k1, kx = jax.random.split(jax.random.key(0), 3)
    params = [jax.random.normal(k0, (8, 8)) * 0.3, jax.random.normal(k1, (8, 8)) * 0.3]
    x = jax.random.normal(kx, (8, 8))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))

    def loss(params, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ params[0])
        return jnp.mean(jnp.tanh(mpmdc.stage(h, 1) @ jax.lax.stop_gradient(params[1])) ** 2)

    def step(params, state, x):
        grad = jax.value_and_grad(loss)
        if microbatches is None:
            value, grads = grad(params, x)
        else:
            value, grads = mpmdc.accumulate(
                lambda mb: grad(params, mb), x, microbatches=microbatches, reduce="mean"
            )
        updates, state = opt.update(grads, state, params)
        return value, optax.apply_updates(params, updates), state

    state = opt.init(params)
    compiled = mpmdc.compile(step, meshes)
    program = compiled.lower(params, state, x).program("after-split")
    frozen = jax.tree_util.tree_leaves((params[1], state[1][0].mu[1], state[1][0].nu[1]))
    flat = jax.tree_util.tree_leaves((params, state, x))
    inputs = [i for i, leaf in enumerate(flat) if any(leaf is f for f in frozen)]
    assert [program.in_meshes[i] for i in inputs] == [1, 1, 1]
    # The outputs: loss, then the parameters and state in the inputs' order.
    assert [program.out_meshes[1 + i] for i in inputs] == [1, 1, 1]
    if microbatches is not None:  # a zero every microbatch sums to zeros without a loop
        carries = [
            e
            for e in compiled.lower(params, state, x).program("after-inline").jaxpr.jaxpr.eqns
            if e.primitive.name == "loop_edge" and e.params["edge"] == "carry"
        ]
        assert len(carries) == 2  # the loss and the trained parameter's gradient
    got = compiled(params, state, x)
    # Noise floor: jax.jit against eager 6e-8 relative on these values; margin 20x.
    assert_same_tree(got, jax.jit(step)(params, state, x), rtol=1.2e-6, atol=1e-7)
    with XlaCompiles() as compiles:
        compiled(*got[1:], x)
    assert compiles.count == 0


@pytest.mark.slow
def test_the_momentum_of_a_parameter_whose_gradient_two_meshes_send_stays_with_it():
    """A parameter read on stage 0 alone, where it also scales the weight stage 1 reads:
    its gradient is the sum of stage 0's backward and of stage 1's (sent back through the
    scaling). The sum is the parameter's gradient and goes where the parameter lives,
    with its momentum's update, so the momentum comes back on the parameter's mesh, not
    on stage 1's (which would send it across every step)."""
    meshes = mpmdc.make_meshes(2, {"d": 2})
    x = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 10

    def loss(params):
        w, v = params
        h = jnp.tanh(mpmdc.stage(w, 0) @ x)
        return jnp.sum(jnp.tanh(mpmdc.stage(h, 1) @ (w * 0.3)) * v)

    assert_first_state_stays_on_mesh_0(loss, meshes, x)


@pytest.mark.slow
def test_a_layer_stack_kept_whole_comes_back_where_the_next_call_reads_it():
    """A scanned stack of uneven stages (``every=(1, 2, 3, 2)``) is kept whole on one mesh,
    its rows updated per stage and joined. The joined parameters were placed by bytes on
    the mesh of the largest stage, while the next call reads them where the first
    stage's rows are cut: every call moved the stack across. They now come back where
    they are read (the parameters in a pytree, so the result pairs with its input)."""
    meshes = mpmdc.make_meshes(4, {"data": 1})

    def loss_fn(params, x):
        def layer(h, w):
            return jnp.tanh(mpmdc.stage(h, every=(1, 2, 3, 2)) @ w), None

        return jnp.mean(jax.lax.scan(layer, x, params["layers"])[0] ** 2)

    def step(params, state, x):
        loss, g = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss_fn)(params, mb), x, microbatches=4
        )
        mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], g)
        return jax.tree.map(lambda p, m: p - 0.01 * m, params, mu), {"mu": mu}, loss

    params = {"layers": jax.random.normal(jax.random.key(0), (8, 16, 16)) / 4}
    x = jax.random.normal(jax.random.key(1), (16, 16))
    state = {"mu": jax.tree.map(jnp.zeros_like, params)}
    with pytest.warns(PlacementWarning, match="cannot be one array over the stage meshes"):
        compiled = mpmdc.compile(step, meshes)
        program = compiled.lower(params, state, x).program("after-split")
    assert program.in_meshes[:2] == program.out_meshes[:2]
    got = compiled(params, state, x)
    # Noise floor: jax.jit against eager 6e-8 relative on these values; margin 20x.
    assert_same_tree(got, jax.jit(step)(params, state, x), rtol=1.2e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,meshes_count,every",
    [
        ("interleaved-1f1b", 2, 2),
        ("gpipe", 2, 2),
        ("1f1b", 4, (3, 2, 2, 1)),
        # The parameters, a bare array (no path to pair its result by), joined by bytes
        # on the largest stage's mesh (mesh2) but read on mesh0: moved every call.
        ("1f1b", 4, (1, 2, 3, 2)),
    ],
)
def test_a_layer_stacks_optimizer_state_is_read_where_it_is_returned(schedule, meshes_count, every):
    """A scanned stack whose stages do not each take a contiguous run of rows of its own
    mesh (two stages per mesh, or uneven groups) is kept whole on one mesh, its rows sent
    per step. Adam's moments of it, sliced per stage after the loop, are read where
    their updates are concatenated and returned, so results fed back move nothing: the
    moments' slices were taken where the last stage's update happened to be placed
    first, and every call moved them across."""
    layers, width = 8, 16
    meshes = mpmdc.make_meshes(meshes_count, {"data": 8 // meshes_count // 2})

    def loss_fn(params, x):
        def layer(h, w):
            return jnp.tanh(mpmdc.stage(h, every=every) @ w), None

        return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)

    def step(params, state, x):
        loss, g = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(loss_fn)(params, mb),
            x,
            microbatches=4,
            schedule=schedule,
        )
        mu = 0.9 * state["mu"] + 0.1 * g
        nu = 0.99 * state["nu"] + 0.01 * g * g
        return params - 0.01 * mu / (jnp.sqrt(nu) + 1e-8), {"mu": mu, "nu": nu}, loss

    params = jax.random.normal(jax.random.key(0), (layers, width, width)) / 4
    x = jax.random.normal(jax.random.key(1), (16, width))
    state = {"mu": jnp.zeros_like(params), "nu": jnp.zeros_like(params)}
    program = mpmdc.compile(step, meshes).lower(params, state, x).program("after-split")
    assert program.in_meshes[:3] == program.out_meshes[:3]
