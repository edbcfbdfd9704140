"""Differential fuzzing: random JAX programs through mpmdc must give ``jax.jit``'s numbers.

A program is a DAG of 3 to 60 operations on 4x4 float32 values (elementwise, matmul,
reductions, transpose, slicing and concatenation, ``scan``, ``cond``, ``custom_vjp``,
``shard_map`` with ``psum`` on the mesh of a random stage, its operand marked into that
stage or not),
with stage markers at random places (non-monotonic, repeated, skipped, on pytrees),
compiled over 1 to 4 meshes of 1 or 2 devices, with random ``in_specs``, with and
without ``value_and_grad``, with and without ``accumulate`` under a random valid
schedule. Every pass is re-checked by ``vma-typecheck`` (``MPMDC_VERIFY=1``, set by
the test configuration).

CI runs ``MPMDC_FUZZ_EXAMPLES`` examples (default 300); ``MPMDC_FUZZ_EXAMPLES=2000
pytest tests/fuzz`` runs longer. A failure is shrunk by hypothesis; keep it as a
named test in ``tests/test_regressions.py``.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from helpers import clipped_tanh
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import mpmdc

EXAMPLES = int(os.environ.get("MPMDC_FUZZ_EXAMPLES", "300"))
SIZE = 4


def _scan_rows(x):
    def body(carry, row):
        carry = jnp.tanh(carry + row)
        return carry, carry * 0.5

    return jax.lax.scan(body, jnp.zeros(x.shape[1]), x)[1]


UNARY = {
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "half": lambda x: x * 0.5,
    "transpose": lambda x: x.T,
    "row_mean": lambda x: jnp.broadcast_to(jnp.mean(x, axis=1, keepdims=True), x.shape),
    "total": lambda x: jnp.broadcast_to(jnp.sum(x) * 0.05, x.shape),
    "roll_rows": lambda x: jnp.concatenate([x[1:], x[:1]]),
    "reshape": lambda x: x.reshape(2, 8).reshape(SIZE, SIZE),
    "scan": _scan_rows,
    "cond": lambda x: jax.lax.cond(jnp.sum(x) > 0, jnp.tanh, jnp.sin, x),
    "custom_vjp": clipped_tanh,
}
BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": lambda a, b: jnp.tanh(a * b),
    "matmul": lambda a, b: (a @ b) * 0.25,
    "max": jnp.maximum,
    "concat_halves": lambda a, b: jnp.concatenate([a[:2], b[2:]]),
}


@st.composite
def programs(draw):
    """A random program description: operations, markers, meshes, specs, mode."""
    num_inputs = draw(st.integers(1, 3))
    # sampled_from shrinks towards its first entry; put the interesting layouts first.
    num_meshes = draw(st.sampled_from([2, 4, 3, 1]))
    mesh_size = draw(st.sampled_from([2, 1]))
    mode = draw(st.sampled_from(["accumulate", "value_and_grad", "plain"]))
    schedule = draw(st.sampled_from(["zb-h1", "1f1b", "gpipe"]))
    one_per_mesh = mode == "accumulate" and schedule != "gpipe"
    stages = num_meshes if one_per_mesh else draw(st.integers(1, 5))
    ops = []
    for k in range(draw(st.integers(3, 60))):
        available = num_inputs + k
        kind = draw(st.sampled_from(["unary", "binary", "unary", "binary", "shard_map"]))
        if kind == "unary":
            ops.append(("unary", draw(st.sampled_from(sorted(UNARY))), draw(st.integers(0, available - 1))))
        elif kind == "binary":
            a, b = draw(st.integers(0, available - 1)), draw(st.integers(0, available - 1))
            ops.append(("binary", draw(st.sampled_from(sorted(BINARY))), a, b))
        else:  # a psum over the mesh of a stage, the operand marked into it or not
            stage, operand = draw(st.integers(0, stages - 1)), draw(st.integers(0, available - 1))
            ops.append(("shard_map", stage, operand, draw(st.booleans())))
    markers = {}
    for k in draw(st.lists(st.integers(0, len(ops) - 1), max_size=8)):
        group = draw(st.lists(st.integers(0, num_inputs + k), min_size=1, max_size=2))
        markers[k] = (draw(st.integers(0, stages - 1)), group)  # stage, values to mark as a pytree
    if one_per_mesh:
        # Some value must reach the last stage so that every mesh has exactly one stage.
        markers[len(ops) - 1] = (stages - 1, [num_inputs + len(ops) - 1])
    sharded = [draw(st.booleans()) and mesh_size == 2 for _ in range(num_inputs)]
    return dict(
        num_inputs=num_inputs, ops=ops, markers=markers, num_meshes=num_meshes,
        mesh_size=mesh_size, sharded=sharded, mode=mode, schedule=schedule,
    )


def build(desc, meshes):
    """``(function, arguments, compile keyword arguments)`` for a program description."""

    def body(*inputs):
        values = list(inputs)
        for k, op in enumerate(ops):
            if op[0] == "unary":
                values.append(UNARY[op[1]](values[op[2]]))
            elif op[0] == "shard_map":
                _, stage, i, marked = op
                summed = jax.shard_map(
                    lambda t: jax.lax.psum(t, "d") * 0.5,
                    mesh=meshes[stage % len(meshes)], in_specs=P("d"), out_specs=P("d"),
                )
                values.append(summed(mpmdc.stage(values[i], stage) if marked else values[i]))
            else:
                values.append(BINARY[op[1]](values[op[2]], values[op[3]]))
            if k in desc["markers"]:
                stage, group = desc["markers"][k]
                marked = mpmdc.stage([values[i] for i in group], stage)
                for i, v in zip(group, marked):
                    values[i] = v
        return values[-1]

    ops = desc["ops"]
    rng = np.random.default_rng(len(ops))
    args = [jnp.asarray(rng.normal(size=(SIZE, SIZE)), jnp.float32) for _ in range(desc["num_inputs"])]
    mode = desc["mode"]
    if mode == "plain":
        fn = body
    elif mode == "value_and_grad":
        def fn(*inputs):
            return jax.value_and_grad(lambda first, *rest: jnp.sum(body(first, *rest)))(*inputs)
    else:
        batch = jnp.asarray(rng.normal(size=(2 * SIZE, SIZE)), jnp.float32)

        def fn(*inputs):
            def per_microbatch(mb):
                return jax.value_and_grad(lambda first: jnp.sum(body(first + mb, *inputs[1:-1])))(inputs[0])

            return mpmdc.accumulate(per_microbatch, inputs[-1], microbatches=2, schedule=schedule_of(desc))

        args = args + [batch]
    in_specs = tuple(P("d") if s else None for s in desc["sharded"]) + ((None,) if mode == "accumulate" else ())
    return fn, args, dict(in_specs=in_specs)


def schedule_of(desc):
    """The drawn schedule where the layout allows it (1F1B and ZB-H1 need one stage per mesh)."""
    stages = {s for s, _ in desc["markers"].values()}
    one_per_mesh = max(stages, default=0) + 1 == desc["num_meshes"]
    return desc["schedule"] if one_per_mesh else "gpipe"


def check(desc):
    meshes = mpmdc.make_meshes(desc["num_meshes"], {"d": desc["mesh_size"]})
    fn, args, kwargs = build(desc, meshes)
    got = mpmdc.compile(fn, meshes, **kwargs)(*args)
    # jax.jit runs every shard_map of a program on one set of devices; a psum over
    # equally many devices gives the same numbers on any of them.
    reference, _, _ = build(desc, meshes[:1] * len(meshes))
    want = jax.jit(reference)(*args)
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs())
def test_random_programs_match_jax_jit(desc):
    event(f"mode={desc['mode']}")
    event(f"shard_map={any(op[0] == 'shard_map' for op in desc['ops'])}")
    event(f"meshes={desc['num_meshes']}x{desc['mesh_size']}")
    event(f"markers={min(len(desc['markers']), 3)}{'+' if len(desc['markers']) >= 3 else ''}")
    event(f"ops={'<10' if len(desc['ops']) < 10 else '<30' if len(desc['ops']) < 30 else '30+'}")
    if desc["mode"] == "accumulate":
        event(f"schedule={schedule_of(desc)}")
    check(desc)
