"""Differential fuzzing: random JAX programs through mpmdc must give ``jax.jit``'s results.

A program is a DAG of 3 to 60 operations on square float32 values: elementwise,
matmul, reductions, transpose, slicing and concatenation, ``scan``, ``cond``,
``custom_vjp``, an op carrying XLA metadata, ``shard_map`` on the mesh of a random stage
(its operand marked into that stage or not: a ``psum`` over some of the axes of its spec,
or a product split over one axis and summed over it; on a mesh of two axes in either
order, or built for the mesh's axes in another order, which must be refused unless it
is dead or runs off that mesh), and what real code does besides:

* ``with_sharding_constraint`` to a spec on the mesh of a random stage (the operand
  marked into it or not): it runs on that mesh, and its spec is the value's;
* captured constants: module-level jax and numpy arrays, arrays made in a closure, a
  jitted helper closing over its own array; "layers" (marker, matmul with a constant,
  tanh) give several stages bodies that differ only in the array they capture; some
  are checkpointed (``jax.checkpoint``), some functions with a derivative rule of their
  own (``custom_vjp``, ``custom_jvp``) whose rule marks their input;
* effects: ``debug.callback`` in the program and inside a jitted helper whose result
  is never used (each callback records its own tag, so two callbacks sharing an
  executable would be seen);
* a typed PRNG key among the inputs, used for noise and dropout masks and carried
  across stages;
* scanned layer stacks marked ``stage(h, every=k, first=f)`` (even or uneven groups), their
  weights stacked from a value of the step or captured, per-layer keys split in the step.

Stage markers go at random places (non-monotonic, repeated, skipped, on pytrees, the
key included), over 1 to 4 meshes of 1 or 2 devices or 1 to 2 meshes of two axes of 2,
stages mapped to meshes by default or by a random ``stage_to_mesh`` (several stages on one mesh), with random
``in_specs`` (or the same specs as the inputs' own shardings, committed to a random
mesh), plain, under ``value_and_grad`` or inside ``accumulate`` under a random
valid schedule (beside the loss a metric of each microbatch, a flag or a count of
any width, reduced by ``mean``, ``sum`` or ``max``); a plain program may also return some of its inputs, earlier values and
captured constants as they are. Half the programs run on meshes of ``Explicit`` axes,
called under the first mesh's ``jax.set_mesh``: their committed inputs are typed with
their shardings, a ``shard_map``'s operands resharded to its specs, a constraint is a
``reshard``; a program ``jax.jit`` refuses for its types (committed to the first mesh)
mpmdc must refuse with an error of the same type. Results must equal ``jax.jit``'s: dtype, shape and weak
type exactly, values to rtol 1e-5; each must own its buffers (none shared with an
argument or another result, as under ``jax.jit``); callbacks must record the same
values per tag. A second test
calls one compiled function again and again with new argument types (weak and strong
scalars, float32 and bfloat16, two sizes, tuple, list and dict containers), each call
against ``jax.jit`` of the same arguments; a result computed in a stage from the scalar
alone must keep its weak type. Every pass is re-checked (``MPMDC_VERIFY=1``,
set by the test configuration).

CI runs ``MPMDC_FUZZ_EXAMPLES`` programs (default 60) and a sixth as many repeat-call
sequences, always the same ones; ``MPMDC_FUZZ_EXAMPLES=2000 pytest tests/fuzz`` runs
longer, and ``MPMDC_FUZZ_SEED=<n>`` draws other programs (run several seeds side by
side to use more cores). A failure is
shrunk by hypothesis; keep it as a named test in ``tests/e2e/test_regressions.py``.
"""

import contextlib
import os
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_results_own_their_buffers, assert_same_array, clipped_tanh
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import PartitionSpec as P

import mpmdc
from mpmdc.ir.primitives import transfer_p
from mpmdc.ir.sharding import canonical_spec

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

EXAMPLES = int(os.environ.get("MPMDC_FUZZ_EXAMPLES", "60"))
SEED = os.environ.get("MPMDC_FUZZ_SEED")
SIZES = (4, 6)  # every operation works on square values of either size


def _scan_rows(x):
    def body(carry, row):
        carry = jnp.tanh(carry + row)
        return carry, carry * 0.5

    return jax.lax.scan(body, jnp.zeros(x.shape[1]), x)[1]


def _tagged_tanh(x):
    """tanh carrying XLA metadata (a dict in the equation's context, which keys must
    compare by value)."""
    with set_xla_metadata(origin="fuzz"):
        return jnp.tanh(x)


UNARY = {
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "half": lambda x: x * 0.5,
    "transpose": lambda x: x.T,
    "row_mean": lambda x: jnp.broadcast_to(jnp.mean(x, axis=1, keepdims=True), x.shape),
    "total": lambda x: jnp.broadcast_to(jnp.sum(x) * 0.05, x.shape),
    "roll_rows": lambda x: jnp.concatenate([x[1:], x[:1]]),
    "reshape": lambda x: x.reshape(2, -1).reshape(x.shape),
    # a mask built from constants by a jitted helper (jnp.where), recomputed where used
    "masked": lambda x: jnp.where(jnp.tril(jnp.ones(x.shape, bool)), x, -1.0),
    "scan": _scan_rows,
    "cond": lambda x: jax.lax.cond(jnp.sum(x) > 0, jnp.tanh, jnp.sin, x),
    "custom_vjp": clipped_tanh,
    "tagged": _tagged_tanh,
    # read without being differentiated: an input read so on one mesh and differentiated
    # on another has its gradient made away from where it lives
    "held": jax.lax.stop_gradient,
}
BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": lambda a, b: jnp.tanh(a * b),
    "matmul": lambda a, b: (a @ b) * 0.25,
    "max": jnp.maximum,
    "concat_halves": lambda a, b: jnp.concatenate([a[:2], b[2:]]),
}


def _module_constants(make):
    return {n: [make(n, seed) for seed in range(2)] for n in SIZES}


# Constants a program captures, by kind; "closure" ones are made per program.
MODULE_JAX = _module_constants(
    lambda n, seed: jax.random.normal(jax.random.key(seed), (n, n)) * 0.5
)
MODULE_NUMPY = _module_constants(
    lambda n, seed: np.random.default_rng(seed + 10).normal(size=(n, n)).astype(np.float32) * 0.5
)
CONSTANT_KINDS = ("module_jax", "module_numpy", "closure", "jitted_helper")
ECHOED_CONSTANTS = CONSTANT_KINDS[:3]  # the arrays themselves, returned as they are

# Mesh shapes (axis name, size) and the in_specs drawn for each: one axis of 2 or 1
# devices, or two axes of 2 (an FSDP x tensor-parallel layout), each dimension of a
# value sharded over any axis, both axes or none, so that values meeting in one
# operation often disagree on where they are split.
MESH_AXES = ((("d", 2),), (("d", 1),), (("a", 2), ("b", 2)))
# On a mesh of two axes a shard_map's spec names one axis or both, in either order.
SHARD_MAP_SPECS = {("a", "b"): (("a", "b"), ("b", "a"), ("a",), ("b",))}
INPUT_SPECS = {
    MESH_AXES[0]: (None, ("d",), (None, "d")),
    MESH_AXES[1]: (None,),
    MESH_AXES[2]: (None, ("a",), (None, "b"), ("a", "b"), ("b", "a"), (("a", "b"),)),
}


def meshes_of(desc):
    """The meshes a program description runs on: ``Explicit`` axes for an explicit one."""
    kind = jax.sharding.AxisType.Explicit if desc.get("explicit") else None
    return mpmdc.make_meshes(desc["num_meshes"], dict(desc["mesh_axes"]), axis_types=kind)


@st.composite
def programs(draw, explicit_axes: bool = True):
    """A random program description: operations, markers, meshes, specs, mode; on
    ``Explicit`` axes or not, where ``explicit_axes`` allows them."""
    num_inputs = draw(st.integers(1, 3))
    # sampled_from shrinks towards its first entry; put the interesting layouts first.
    num_meshes = draw(st.sampled_from([2, 4, 3, 1]))
    mesh_axes = draw(st.sampled_from(MESH_AXES if num_meshes <= 2 else MESH_AXES[:2]))
    mode = draw(st.sampled_from(["accumulate", "value_and_grad", "plain"]))
    schedule = draw(st.sampled_from(["zb-h1", "1f1b", "gpipe"]))
    # The rolled loop is stamped out per microbatch: counts from one to many; the batch
    # given or computed in the step; each microbatch's loss summed or stacked.
    microbatches = draw(st.sampled_from([2, 1, 3, 8, 64]))
    computed_batch = draw(st.booleans())
    stacked_loss = draw(st.booleans())
    # a metric of each microbatch beside the loss (the rows it holds above zero, as a
    # count or a flag or a float), reduced over the microbatches
    metric = draw(st.sampled_from(["int8", "bool", "float32", "int32"]))
    metric_reduce = draw(st.sampled_from(["mean", "max", "sum"]))
    one_per_mesh = mode == "accumulate" and schedule != "gpipe"
    stages = num_meshes if one_per_mesh else draw(st.integers(1, 5))
    stage_to_mesh = None
    if not one_per_mesh and draw(st.booleans()):
        stage_to_mesh = tuple(
            draw(st.lists(st.integers(0, num_meshes - 1), min_size=stages, max_size=stages))
        )
    with_key = draw(st.booleans())
    ops = []
    for k in range(draw(st.integers(3, 60))):
        available = num_inputs + k
        operand = st.integers(0, available - 1)
        kind = draw(
            st.sampled_from(
                ["unary", "binary", "unary", "binary", "shard_map", "constant", "layer", "effect"]
                + ["constraint"]
                + ["noise", "dropout"] * with_key
                + ["stack", "custom_layer", "checkpointed_layer"]
            )
        )
        if kind == "unary":
            ops.append(("unary", draw(st.sampled_from(sorted(UNARY))), draw(operand)))
        elif kind == "binary":
            ops.append(
                ("binary", draw(st.sampled_from(sorted(BINARY))), draw(operand), draw(operand))
            )
        elif kind == "shard_map":
            # On the mesh of a stage, the operand marked into it or not: a psum over some
            # of the axes its spec names (on a mesh of two axes, one or both in either
            # order), or a product whose contraction is split over one axis (the rows
            # over the other) and summed over it. Some are built for the stage mesh's
            # axes in another order, which mpmdc refuses.
            axes = tuple(name for name, _ in mesh_axes)
            form = draw(st.sampled_from(["psum", "matmul"]))
            if form == "psum":
                spec_axes = draw(st.sampled_from(SHARD_MAP_SPECS.get(axes, (axes,))))
                summed_axes = tuple(a for a in spec_axes if draw(st.booleans()))
            else:  # (rows, contraction)
                spec_axes = (
                    draw(st.sampled_from([axes, axes[::-1]])) if len(axes) > 1 else (None, *axes)
                )
                summed_axes = spec_axes[1:]
            marked = draw(st.booleans())
            swapped = len(axes) > 1 and marked and draw(st.booleans())
            # built for the abstract mesh (the stage's devices inferred), as under jax.jit
            # with a context mesh
            abstract = marked and draw(st.booleans())
            ops.append(
                (
                    "shard_map",
                    draw(st.integers(0, stages - 1)),
                    draw(operand),
                    marked,
                    form,
                    spec_axes,
                    summed_axes,
                    swapped,
                    abstract,
                )
            )
        elif kind == "constraint":
            # with_sharding_constraint to a spec on the mesh of a stage, the operand
            # marked into it or not
            ops.append(
                (
                    "constraint",
                    draw(st.integers(0, stages - 1)),
                    draw(operand),
                    draw(st.booleans()),
                    draw(st.sampled_from(INPUT_SPECS[mesh_axes])),
                )
            )
        elif kind == "constant":  # the operand combined with a captured array
            how = draw(st.sampled_from(["matmul", "add"]))
            ops.append(
                (
                    "constant",
                    draw(st.sampled_from(CONSTANT_KINDS)),
                    draw(st.integers(0, 1)),
                    how,
                    draw(operand),
                )
            )
        elif kind in ("layer", "checkpointed_layer"):
            # tanh(stage(x, s) @ c): stages alike but for their constant; checkpointed,
            # the backward recomputes the product (one call JAX differentiates whole).
            ops.append(
                (
                    kind,
                    draw(st.integers(0, stages - 1)),
                    draw(st.sampled_from(CONSTANT_KINDS)),
                    draw(st.integers(0, 1)),
                    draw(operand),
                )
            )
        elif kind == "custom_layer":  # a layer with a derivative rule of its own
            ops.append(
                (
                    "custom_layer",
                    draw(st.integers(0, stages - 1)),
                    draw(st.sampled_from(["custom_vjp", "custom_jvp"])),
                    draw(st.integers(0, 1)),
                    draw(operand),
                )
            )
        elif kind == "stack":  # a scanned layer stack, its iterations cut into stages
            first = draw(st.integers(0, stages - 1))
            groups = draw(st.integers(1, stages - first))
            if draw(st.booleans()):
                every = draw(st.integers(1, 3))
                length = every * groups
            else:
                every = tuple(draw(st.lists(st.integers(1, 3), min_size=groups, max_size=groups)))
                length = sum(every)
            weights = draw(st.sampled_from(["input", "closure"]))
            ops.append(("stack", first, every, length, weights, draw(operand), draw(operand)))
        elif (
            kind == "effect"
        ):  # a callback recording the operand, live or inside a dead jitted call
            ops.append(("effect", draw(st.booleans()), draw(operand)))
        else:  # noise or a dropout mask drawn from the key input
            ops.append((kind, draw(operand)))
    markers = {}
    for k in draw(st.lists(st.integers(0, len(ops) - 1), max_size=8)):
        group = draw(st.lists(st.integers(0, num_inputs + k), min_size=1, max_size=2))
        with_the_key = with_key and draw(st.booleans())
        markers[k] = (
            draw(st.integers(0, stages - 1)),
            group,
            with_the_key,
        )  # stage, values to mark as a pytree
    if one_per_mesh:
        # Some value must reach the last stage so that every mesh has exactly one stage.
        markers[len(ops) - 1] = (stages - 1, [num_inputs + len(ops) - 1], False)
    in_specs = [draw(st.sampled_from(INPUT_SPECS[mesh_axes])) for _ in range(num_inputs)]
    # Some inputs committed to a mesh (maybe not the one reading them) with their spec as
    # their own sharding instead of in_specs: the default spec, moved before each call.
    committed = [
        draw(st.one_of(st.none(), st.integers(0, num_meshes - 1))) for _ in range(num_inputs)
    ]
    # What a plain program returns besides its last value: inputs, earlier values (the
    # last one again among them) and captured constants, each of which the call must
    # return in a buffer of its own.
    echo = st.one_of(
        st.tuples(st.just("value"), st.integers(0, num_inputs - 1)),  # an input
        st.just(("value", num_inputs + len(ops) - 1)),  # the last value again
        st.tuples(st.just("value"), st.integers(0, num_inputs + len(ops) - 1)),
        st.tuples(st.just("constant"), st.sampled_from(ECHOED_CONSTANTS), st.integers(0, 1)),
    )
    echoes = draw(st.lists(echo, max_size=3)) if mode == "plain" else []
    # Explicit axes: committed inputs are traced with their shardings in their types.
    explicit = explicit_axes and draw(st.booleans())
    return dict(
        explicit=explicit,
        num_inputs=num_inputs,
        ops=ops,
        markers=markers,
        num_meshes=num_meshes,
        mesh_axes=mesh_axes,
        in_specs=in_specs,
        committed=committed,
        mode=mode,
        schedule=schedule,
        microbatches=microbatches,
        computed_batch=computed_batch,
        stacked_loss=stacked_loss,
        metric=(metric, metric_reduce),
        stage_to_mesh=stage_to_mesh,
        with_key=with_key,
        echoes=echoes,
    )


def constant(kind, index, n, closure_constants):
    """The captured array of ``kind`` for values of size ``n``, or a function applying it."""
    if kind == "module_jax":
        return MODULE_JAX[n][index]
    if kind == "module_numpy":
        return MODULE_NUMPY[n][index]
    c = closure_constants[n][index]
    if kind == "closure":
        return c
    return jax.jit(lambda x: x @ c)  # a jitted helper with its own constant


def make_body(desc, meshes, record, reference=False):
    """The program as a function of ``desc['num_inputs']`` arrays and, with
    ``desc['with_key']``, a typed key; ``record(tag, value)`` is what callbacks call."""
    rng = np.random.default_rng(len(desc["ops"]))
    closure_constants = {
        n: [jnp.asarray(rng.normal(size=(n, n)) * 0.5, jnp.float32) for _ in range(2)]
        for n in SIZES
    }

    def mesh_of(stage):
        s2m = desc["stage_to_mesh"]
        return meshes[(s2m[stage] if s2m else stage) % len(meshes)]

    def apply_constant(kind, index, how, x):
        c = constant(kind, index, x.shape[0], closure_constants)
        if callable(c):
            return c(x) * 0.5
        return jnp.tanh(x @ c.astype(x.dtype)) if how == "matmul" else x + c.astype(x.dtype)

    explicit = desc.get("explicit", False)

    def typed_as(x, spec):
        """``x`` resharded to ``spec`` where its type holds a sharding (Explicit axes),
        as a shard_map's operand must be; else ``x``."""
        return jax.sharding.reshard(x, spec) if explicit else x

    def body(*inputs):
        if desc["with_key"]:
            *values, key = inputs
        else:
            values, key = list(inputs), None
        values = list(values)
        stacked = values.pop() if desc.get("stacked_param") else None
        for k, op in enumerate(desc["ops"]):
            if op[0] == "unary":
                values.append(UNARY[op[1]](values[op[2]]))
            elif op[0] == "binary":
                values.append(BINARY[op[1]](values[op[2]], values[op[3]]))
            elif op[0] == "shard_map":
                _, stage, i, marked, form, spec_axes, summed_axes, swapped, abstract = op
                mesh = mesh_of(stage)
                # jax.jit runs the program meant: a shard_map's numbers do not depend on
                # its mesh's layout, and jax.jit takes an abstract one from a context mesh
                if swapped and not reference:
                    mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names[::-1])
                if (abstract or explicit) and not reference:
                    mesh = mesh.abstract_mesh
                x = mpmdc.stage(values[i], stage) if marked else values[i]
                if form == "psum":
                    summed = jax.shard_map(
                        lambda t: jax.lax.psum(t, summed_axes) * 0.5,  # noqa: B023 (called at once)
                        mesh=mesh,
                        in_specs=P(*spec_axes),
                        out_specs=P(*spec_axes),
                    )(typed_as(x, P(*spec_axes)))
                else:
                    rows, contraction = spec_axes
                    summed = jax.shard_map(
                        lambda a, b: jax.lax.psum(a @ b, contraction) * 0.25,  # noqa: B023
                        mesh=mesh,
                        in_specs=(P(rows, contraction), P(contraction)),
                        out_specs=P(rows),
                    )(typed_as(x, P(rows, contraction)), typed_as(x.T, P(contraction)))
                values.append(summed)
            elif op[0] == "constraint":
                _, stage, i, marked, spec = op
                x = mpmdc.stage(values[i], stage) if marked else values[i]
                if explicit:  # (a constraint on Explicit axes only asserts the type)
                    values.append(jax.sharding.reshard(x, P(*(spec or ()))))
                else:
                    sharding = jax.sharding.NamedSharding(mesh_of(stage), P(*(spec or ())))
                    values.append(jax.lax.with_sharding_constraint(x, sharding))
            elif op[0] == "constant":
                _, kind, index, how, i = op
                values.append(apply_constant(kind, index, how, values[i]))
            elif op[0] in ("layer", "checkpointed_layer"):
                _, stage, kind, index, i = op
                apply = lambda v: apply_constant(kind, index, "matmul", v)  # noqa: B023, E731 (called at once)
                if op[0] == "checkpointed_layer":
                    apply = jax.checkpoint(apply)
                values.append(apply(mpmdc.stage(values[i], stage)))
            elif op[0] == "custom_layer":
                _, stage, rule, index, i = op
                c = closure_constants[values[i].shape[0]][index]
                values.append(custom_layer(rule, stage, c)(values[i]))
            elif op[0] == "effect":
                _, live, i = op
                callback = (lambda tag: lambda v: record(tag, v))(k)
                if live:
                    jax.debug.callback(callback, values[i])
                    values.append(values[i])
                else:
                    jax.jit(lambda v: (jax.debug.callback(callback, v), v * 2)[1])(values[i])  # noqa: B023 (called at once)
                    values.append(values[i] * 1.5)
            elif op[0] == "stack":
                values.append(scanned_stack(op, values, key, closure_constants, stacked))
            elif op[0] == "dropout":  # the mask is made from the key alone
                keep = jax.random.bernoulli(jax.random.fold_in(key, k), 0.75, values[op[1]].shape)
                values.append(jnp.where(keep, values[op[1]] / 0.75, 0.0))
            else:  # noise
                noise = jax.random.normal(
                    jax.random.fold_in(key, k), values[op[1]].shape, values[op[1]].dtype
                )
                values.append(values[op[1]] + 0.1 * noise)
            if k in desc["markers"]:
                stage, group, with_the_key = desc["markers"][k]
                marked, key_marked = mpmdc.stage(
                    ([values[i] for i in group], key if with_the_key else None), stage
                )
                for i, v in zip(group, marked):
                    values[i] = v
                key = key_marked if with_the_key else key
        if not desc.get("echoes"):
            return values[-1]
        n = values[-1].shape[0]
        return values[-1], *(
            values[e[1]] if e[0] == "value" else constant(e[1], e[2], n, closure_constants)
            for e in desc["echoes"]
        )

    return body


def custom_layer(rule, stage, c):
    """``tanh(stage(x, stage) @ c)`` as a function JAX differentiates by a rule of its own
    (``custom_vjp`` or ``custom_jvp``), which marks the function's input."""

    def forward(x):
        t = jnp.tanh(mpmdc.stage(x, stage) @ c.astype(x.dtype))
        return t, t

    if rule == "custom_vjp":
        layer = jax.custom_vjp(lambda x: forward(x)[0])
        layer.defvjp(forward, lambda t, g: ((g * (1 - t * t)) @ c.astype(g.dtype).T,))
        return layer
    layer = jax.custom_jvp(lambda x: forward(x)[0])

    @layer.defjvp
    def tangent_rule(primals, tangents):
        t, _ = forward(primals[0])
        return t, (1 - t * t) * (tangents[0] @ c.astype(t.dtype))

    return layer


def scanned_stack(op, values, key, closure_constants, stacked=None):
    """A ``scan`` over ``length`` layers ``tanh(h @ w)`` marked ``stage(h, every=...)``: the
    weights stacked from an operand (computed in the step, so a program input's gradient
    flows through the stack), the first rows of ``stacked`` (a stacked parameter, where
    given, in place of the operand) or captured; with a key, per-layer noise from split
    keys; the result adds the final carry and the mean of the per-layer outputs."""
    _, first, every, length, weights, i, j = op
    n = values[i].shape[0]
    if weights == "input" and stacked is not None:
        ws = stacked[:length, :n, :n]
    elif weights == "input":
        ws = jnp.stack([values[j] * (0.3 + 0.1 * k) for k in range(length)])
    else:
        ws = jnp.stack([closure_constants[n][k % 2] * (1 + 0.1 * k) for k in range(length)])
    keys = jax.random.split(key, length) if key is not None else None

    def layer(h, xs):
        w, k = xs
        h = mpmdc.stage(h, every=every, first=first)
        h = jnp.tanh(h @ w.astype(h.dtype))
        if k is not None:
            h = h + 0.05 * jax.random.normal(k, h.shape, h.dtype)
        return h, h * 0.5

    h, ys = jax.lax.scan(layer, values[i], (ws, keys))
    return h + jnp.mean(ys, axis=0)


def build(desc, meshes, record, reference=False):
    """``(function, arguments, compile keyword arguments)`` for a program description."""
    body = make_body(desc, meshes, record, reference)
    rng = np.random.default_rng(len(desc["ops"]))
    n = SIZES[0]
    args = [jnp.asarray(rng.normal(size=(n, n)), jnp.float32) for _ in range(desc["num_inputs"])]
    key_args = [jax.random.key(len(desc["ops"]))] if desc["with_key"] else []
    mode = desc["mode"]
    if mode == "plain":
        fn = body
    elif mode == "value_and_grad":

        def fn(*inputs):
            return jax.value_and_grad(lambda first, *rest: jnp.sum(body(first, *rest)))(*inputs)
    else:
        batch = jnp.asarray(rng.normal(size=(desc["microbatches"] * n, n)), jnp.float32)

        def fn(*inputs):
            *inputs, batch = inputs
            if desc["computed_batch"]:
                batch = batch * 1.5

            def per_microbatch(mb):
                loss, grad = jax.value_and_grad(
                    lambda first: jnp.sum(body(first + mb, *inputs[1:]))
                )(inputs[0])
                above = jnp.sum(mb[:, 0] > 0, dtype=jnp.int32)
                dtype = desc["metric"][0]
                metric = (above > 1) if dtype == "bool" else above.astype(dtype)
                return (loss[None] if desc["stacked_loss"] else loss), grad, metric

            return mpmdc.accumulate(
                per_microbatch,
                batch,
                microbatches=desc["microbatches"],
                schedule=schedule_of(desc),
                reduce=("concat" if desc["stacked_loss"] else "sum", "sum", desc["metric"][1]),
            )

        key_args = [*key_args, batch]
    specs = tuple(None if s is None else P(*s) for s in desc["in_specs"]) + (None,) * len(key_args)
    return fn, args + key_args, dict(in_specs=specs, stage_to_mesh=desc["stage_to_mesh"])


def schedule_of(desc):
    """The drawn schedule where the layout allows it (1F1B and ZB-H1 need one stage per mesh)."""
    stages = {s for s, _, _ in desc["markers"].values()}
    for op in desc["ops"]:
        if op[0] == "stack":
            groups = op[3] // op[2] if isinstance(op[2], int) else len(op[2])
            stages.update(range(op[1], op[1] + groups))
    one_per_mesh = (
        max(stages, default=0) + 1 == desc["num_meshes"] and desc["stage_to_mesh"] is None
    )
    return desc["schedule"] if one_per_mesh else "gpipe"


class Recorder:
    """What the callbacks of one run recorded, per tag.

    A tag's records are compared as a multiset: an unordered callback has no order
    across executions (JAX orders only ``ordered=True`` effects), and one microbatch's
    fragment may run its callback after the next one's.
    """

    def __init__(self):
        self.by_tag = defaultdict(list)

    def __call__(self, tag, value):
        self.by_tag[tag].append(np.asarray(value, np.float64))

    def assert_same_as(self, other, rtol, atol):
        assert sorted(self.by_tag) == sorted(other.by_tag)
        for tag, values in self.by_tag.items():
            unmatched = list(other.by_tag[tag])
            assert len(values) == len(unmatched), tag
            for got in values:
                match = next(
                    (
                        k
                        for k, w in enumerate(unmatched)
                        if np.allclose(got, w, rtol=rtol, atol=atol)
                    ),
                    None,
                )
                assert match is not None, (tag, got, unmatched)
                unmatched.pop(match)


# Noise floors of the drawn programs (jax.jit against eager, which materializes every
# value as a fragment boundary does; one CI run). float32: 1.8e-07 absolute on values of
# magnitude <= 1, 1.9e-06 on larger ones (so at most 1.9e-06 relative); margin 5x.
FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}
# bfloat16: 7.5e-03 relative, margin 13x; values of magnitude <= 1 agreed exactly, and the
# absolute 0.1 (13 bfloat16 ulps at 1) covers cancellation near zero.
BFLOAT16 = {"rtol": 0.1, "atol": 0.1}


def assert_same_results(got, want, rtol=FLOAT32["rtol"], atol=FLOAT32["atol"]):
    """Each leaf of ``got`` equals ``want``'s to ``rtol`` of the element, or of the leaf's
    largest magnitude where that is more: an element that cancels to near zero keeps
    the rounding of the larger values it was computed from. (Measured on a drawn 2-stack
    program: jax.jit against eager 2.6e-05 absolute, 3.3e-06 of the leaf's largest value
    7.7, on an element of 0.3, which an element-wise 1e-05 would reject.)"""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        scale = _largest_magnitude(w)
        assert_same_array(g, w, rtol=rtol, atol=max(atol, rtol * scale))


def _largest_magnitude(value) -> float:
    if not jnp.issubdtype(value.dtype, jnp.floating):
        return 0.0
    values = np.abs(np.asarray(value, np.float64))
    return float(np.max(values[np.isfinite(values)], initial=0.0))


def reference_meshes(meshes):
    # jax.jit runs every shard_map of a program on one set of devices; a psum over
    # equally many devices gives the same numbers on any of them.
    return meshes[:1] * len(meshes)


def check(desc):
    explicit = desc.get("explicit", False)
    if explicit:  # (the shard_maps' meshes are the context's abstract one)
        desc = without_swapped_axes(desc)
    meshes = meshes_of(desc)
    seen, expected = Recorder(), Recorder()
    fn, args, kwargs = build(desc, meshes, seen)
    given, specs = list(args), list(kwargs["in_specs"])
    for k, mesh in enumerate(desc["committed"]):
        if mesh is not None:
            sharding = jax.sharding.NamedSharding(meshes[mesh], specs[k] or P())
            given[k], specs[k] = jax.device_put(args[k], sharding), None
    compiled = mpmdc.compile(fn, meshes, **{**kwargs, "in_specs": tuple(specs)})
    reference, _, _ = build(desc, reference_meshes(meshes), expected, reference=True)
    # An explicit program runs under the first mesh's context (every call, or the cache
    # would trace it again without one).
    context = (lambda: jax.set_mesh(meshes[0])) if explicit else contextlib.nullcontext
    with context():
        if explicit:
            results = _explicit_results(desc, meshes, compiled, given, reference, args)
        else:
            results = _results(desc, compiled, given, reference, args)
    if results is None:
        return
    got, want = results
    jax.effects_barrier()
    assert_same_results(got, want)
    seen.assert_same_as(expected, **FLOAT32)
    assert_results_own_their_buffers(got, given)
    if desc["echoes"]:  # nor with the next call's (a constant returned each time)
        with context():
            again = jax.block_until_ready(compiled(*given))
        assert_results_own_their_buffers(again, (given, got))


def _results(desc, compiled, given, reference, args):
    """``(mpmdc's results, jax.jit's)``, or ``None`` for a program mpmdc rightly refuses."""
    if any(op[0] == "shard_map" and op[7] for op in desc["ops"]):
        # A shard_map built for its stage mesh's axes in another order would lay its
        # shards out by the wrong axis: refused, unless it is dead code or left its mesh.
        try:
            got = jax.block_until_ready(compiled(*given))
        except mpmdc.errors.TypeCheckError as e:
            assert "the same axes in another order" in str(e), e
            event("a shard_map for the axes in another order: refused")
            return None
    else:
        got = jax.block_until_ready(compiled(*given))
    return got, jax.block_until_ready(jax.jit(reference)(*args))


def _explicit_results(desc, meshes, compiled, given, reference, args):
    """``(mpmdc's results, jax.jit's)`` of a program on Explicit axes, jax.jit given the
    committed inputs on the first mesh; ``None`` for a program jax.jit refuses for its
    types, which mpmdc must refuse with the same error."""
    placed = list(args)
    for k, mesh in enumerate(desc["committed"]):
        if mesh is not None:
            sharding = jax.sharding.NamedSharding(meshes[0], given[k].sharding.spec)
            placed[k] = jax.device_put(args[k], sharding)
    try:
        want = jax.block_until_ready(jax.jit(reference)(*placed))
    except Exception as refusal:  # (any error of JAX's type checks)
        with pytest.raises(type(refusal)):
            compiled(*given)
        event("explicit: refused by jax.jit and mpmdc")
        return None
    return jax.block_until_ready(compiled(*given)), want


def without_swapped_axes(desc):
    """``desc`` with every ``shard_map`` built for its stage mesh's axes in their order
    (for the properties of programs mpmdc runs)."""
    ops = [(*op[:7], False, op[8]) if op[0] == "shard_map" else op for op in desc["ops"]]
    return {**desc, "ops": ops}


def _describe(desc):
    event(f"mode={desc['mode']}")
    event(f"explicit={desc.get('explicit', False)}")
    event(f"meshes={desc['num_meshes']}x{dict(desc['mesh_axes'])}")
    event(f"in_specs={sorted({str(s) for s in desc['in_specs']})}")
    event(f"stage_to_mesh={desc['stage_to_mesh'] is not None}")
    event(f"committed inputs={sum(m is not None for m in desc['committed'])}")
    event(f"key={desc['with_key']}")
    event(f"echoes={sorted({e[0] for e in desc['echoes']})}")
    kinds = (
        "shard_map",
        "constraint",
        "constant",
        "layer",
        "checkpointed_layer",
        "custom_layer",
        "effect",
    )
    for kind in (*kinds, "dropout"):
        event(f"{kind}={any(op[0] == kind for op in desc['ops'])}")
    shard_maps = [op for op in desc["ops"] if op[0] == "shard_map"]
    if any(len(op[5]) > 1 for op in shard_maps):
        event(f"shard_map forms={sorted({op[4] for op in shard_maps})}")
        event(f"shard_map swapped={any(op[7] for op in shard_maps)}")
    event(f"shard_map abstract={any(op[8] for op in shard_maps)}")
    event(f"markers={min(len(desc['markers']), 3)}{'+' if len(desc['markers']) >= 3 else ''}")
    event(f"ops={'<10' if len(desc['ops']) < 10 else '<30' if len(desc['ops']) < 30 else '30+'}")
    if desc["mode"] == "accumulate":
        event(f"schedule={schedule_of(desc)}")
        event(f"microbatches={desc['microbatches']}")
        event(f"computed_batch={desc['computed_batch']}")
        event(f"stacked_loss={desc['stacked_loss']}")
        event(f"metric={desc['metric']}")


FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def seeded(test):
    """``test`` drawing from ``MPMDC_FUZZ_SEED`` when it is set."""
    return seed(int(SEED))(test) if SEED is not None else test


@seeded
@settings(max_examples=EXAMPLES, **FUZZ_SETTINGS)
@given(programs())
def test_random_programs_match_jax_jit(desc):
    _describe(desc)
    check(desc)


def check_half_program(length, ops, markers, **desc):
    """:func:`check` of a 4-mesh accumulating program of ``length`` ops, each
    ``x * 0.5`` but ``ops`` (``{index: op}``): a fuzz example cut down by hand."""
    check(
        dict(
            num_inputs=2,
            ops=[ops.get(k, ("unary", "half", 0)) for k in range(length)],
            markers=markers,
            num_meshes=4,
            mesh_axes=(("d", 1),),
            in_specs=[None, None],
            committed=[None, None],
            mode="accumulate",
            microbatches=2,
            computed_batch=False,
            stage_to_mesh=None,
            with_key=False,
            echoes=[],
            **desc,
        )
    )


def test_a_result_made_from_nothing_in_the_loop_is_made_after_it():
    """Found with ``MPMDC_FUZZ_SEED=7``: the gradient of the first input is zero (the
    loss reads none of the work on it), a constant the program returns; it went with
    its kin, the loss's result of the microbatch loop, into the loop's iteration, and
    the scheduled program returned a value no equation made (an internal error)."""
    check_half_program(
        49,
        {
            2: ("layer", 3, "module_jax", 0, 0),
            6: ("layer", 0, "module_jax", 1, 4),
            13: ("custom_layer", 1, "custom_vjp", 1, 7),
            16: ("unary", "row_mean", 15),
            21: ("binary", "mul", 8, 18),
            24: ("layer", 3, "module_jax", 0, 23),
            39: ("layer", 1, "jitted_helper", 0, 1),
            40: ("effect", False, 26),
            48: ("stack", 1, 1, 2, "closure", 41, 25),
        },
        markers={48: (3, [50], False)},
        schedule="1f1b",
        stacked_loss=False,
        metric=("float32", "sum"),
    )


def test_a_stacked_value_the_same_every_microbatch_is_stacked_after_it_is_made():
    """Found with ``MPMDC_FUZZ_SEED=83``: the stacked loss reads no microbatch (the same
    every microbatch), so it is made outside the loop, and ``split`` put the work making
    it in one fragment with the work after the loop (the int8 metric's mean). Stamped
    out, the stack was concatenated before the loop's results were read, before the
    value it stacks was made: the schedule pass raised an internal error."""
    check_half_program(
        59,
        {
            2: ("layer", 0, "module_jax", 0, 1),
            6: ("layer", 0, "module_jax", 0, 0),
            9: ("unary", "cond", 1),
            13: ("constant", "module_jax", 0, "matmul", 4),
            16: ("unary", "cond", 15),
            25: ("stack", 2, 1, 2, "input", 11, 18),
            30: ("custom_layer", 0, "custom_jvp", 0, 27),
            52: ("layer", 3, "module_numpy", 0, 33),
            58: ("stack", 0, (1,), 1, "closure", 32, 21),
        },
        markers={52: (2, [13], False), 58: (3, [60], False)},
        schedule="gpipe",
        stacked_loss=True,
        metric=("int8", "mean"),
    )


# --------------------------------------------------- one function, many calls

CONTAINERS = {
    "tuple": lambda xs: tuple(xs),
    "list": lambda xs: list(xs),
    "dict": lambda xs: {f"x{i}": x for i, x in enumerate(xs)},
}
SCALARS = {
    "python_float": lambda: 0.75,
    "python_int": lambda: 2,
    "float32": lambda: jnp.float32(0.75),
    "numpy_float32": lambda: np.float32(0.75),
    "weak_array": lambda: jnp.asarray(0.75),
}


@st.composite
def call_sequences(draw):
    """A plain or differentiated program and 2 to 4 argument variants to call it with."""
    desc = draw(
        programs(explicit_axes=False)
        .filter(lambda d: d["mode"] != "accumulate" and not d["with_key"])
        .map(without_swapped_axes)
    )
    variants = draw(
        st.lists(
            st.tuples(
                st.sampled_from(sorted(CONTAINERS)),
                st.sampled_from(sorted(SCALARS)),
                st.sampled_from(["float32", "bfloat16"]),
                st.sampled_from(SIZES),
            ),
            min_size=2,
            max_size=4,
        )
    )
    return desc, variants


@seeded
@settings(max_examples=max(EXAMPLES // 6, 10), **FUZZ_SETTINGS)
@given(call_sequences())
def test_one_compiled_function_called_with_new_argument_types(case):
    """Each call of one ``mpmdc.compile``d function equals ``jax.jit`` on the same arguments,
    whatever came before: the executable cache tells weak types, dtypes, shapes and
    pytrees apart as ``jax.jit``'s does."""
    desc, variants = case
    event(f"variants={len(set(variants))}")
    last_stage = max((s for s, _, _ in desc["markers"].values()), default=0)
    meshes = meshes_of(desc)
    seen, expected = Recorder(), Recorder()

    def program(record, meshes_, reference=False):
        body = make_body(desc, meshes_, record, reference)
        inner = (
            body if desc["mode"] == "plain" else jax.value_and_grad(lambda *xs: jnp.sum(body(*xs)))
        )

        def fn(container, scale):
            first, *rest = jax.tree.leaves(container)
            # A result computed from the scalar alone stays weakly typed for a weak scalar.
            return inner(first * scale, *rest), mpmdc.stage(scale, last_stage) * 3

        return fn

    step = mpmdc.compile(program(seen, meshes), meshes, stage_to_mesh=desc["stage_to_mesh"])
    reference = jax.jit(program(expected, reference_meshes(meshes), reference=True))
    rng = np.random.default_rng(len(desc["ops"]))
    for container, scalar, dtype, n in variants:
        xs = [jnp.asarray(rng.normal(size=(n, n)), dtype) for _ in range(desc["num_inputs"])]
        args = (CONTAINERS[container](xs), SCALARS[scalar]())
        # bfloat16 rounding depends on where XLA fuses
        assert_same_results(
            step(*args), reference(*args), **(BFLOAT16 if dtype == "bfloat16" else FLOAT32)
        )
    jax.effects_barrier()
    seen.assert_same_as(expected, **BFLOAT16)


# ------------------------------------------------ training steps keep their state


@seeded
@settings(max_examples=max(EXAMPLES // 6, 10), **FUZZ_SETTINGS)
@given(
    programs(explicit_axes=False)
    .filter(lambda d: not d["with_key"])
    .map(without_swapped_axes)
    .map(
        lambda d: {
            **d,
            "mode": "accumulate" if d["mode"] == "accumulate" else "value_and_grad",
            "echoes": [],  # (a loss returns one value)
        }
    ),
    st.sampled_from(["none", "norm_outside", "norm_inside"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["in_specs", "out_specs"]),
)
def test_a_training_step_keeps_parameters_and_state_where_they_go_in(
    desc, skip_step, stacked_param, frozen, in_context, one_tree, specs_given_as
):
    """Random programs as the loss of a training step (one batch, or microbatches in
    ``accumulate`` under a random valid schedule; the layer stacks' weights computed in
    the step or the rows of a stacked parameter) with global-norm clipping,
    momentum scaled by a scalar of the norm (as Adam's bias correction scales it) and a
    scalar per parameter (its gradient's squared norm, as NovoGrad keeps), the update
    applied in a skip-step ``lax.cond`` (on a finite loss, the global norm
    computed before it or inside its branch) or not, the last parameter maybe frozen
    (read through ``stop_gradient``: its gradient is zeros):
    equal to ``jax.jit``, and a parameter read on one mesh only comes back there with
    its momentum, its scalar and its placeholder (a state leaf nobody reads), wherever
    its gradient is made or summed, each with the spec it came in with (the
    parameter's where one is given), so a loop feeding them back moves and compiles
    nothing. A parameter several meshes read is sent to them and its gradient
    contributions summed on the way back, somewhere: where is not checked. Some steps
    are called under the first mesh's ``jax.set_mesh``, a stacked parameter (and its
    momentum) then committed whole to the last mesh and moved to where it is read, not
    on the context mesh (these programs read a slice of it, so it is never cut into
    stage rows: ``test_stacks.py`` calls stacks so). Some steps take their state as one
    pytree and return it as one, the loss in it (``{"params": ..., "state": ...}`` in,
    with ``"loss"`` out), not in a tuple. Some give the parameters' specs as the
    results' ``out_specs`` instead of the arguments' ``in_specs``, and none for the
    momenta: the parameters then come in on the first call as they will come back, and
    each momentum with its parameter's spec."""
    _describe({**desc, "stacked_param": stacked_param})
    event(f"skip_step={skip_step}")
    event(f"stacked_param={stacked_param}")
    event(f"frozen={frozen}")
    event(f"in_context={in_context}")
    event(f"one_tree={one_tree}")
    event(f"specs_given_as={specs_given_as}")
    check_training_step(
        desc, skip_step, stacked_param, frozen, in_context, one_tree, specs_given_as
    )


def check_training_step(
    desc,
    skip_step,
    stacked_param,
    frozen,
    in_context,
    one_tree=False,
    specs_given_as="in_specs",
    note=event,
):
    """The properties of :func:`test_a_training_step_keeps_parameters_and_state_where_
    they_go_in` for one program; ``note`` records what it saw (Hypothesis's ``event``
    inside a test)."""
    desc = {**desc, "stacked_param": stacked_param}
    meshes = meshes_of(desc)
    seen, expected = Recorder(), Recorder()
    n = desc["num_inputs"] + stacked_param

    def training_step(record, meshes_, reference=False):
        body = make_body(desc, meshes_, record, reference)

        def step(params, momenta, *batch):
            def trained(ps):
                return [*ps[:-1], jax.lax.stop_gradient(ps[-1])] if frozen else ps

            def microbatch_loss(ps, mb):
                ps = trained(ps)
                return jnp.sum(body(ps[0] + mb, *ps[1:]))

            if batch:
                loss, grads = mpmdc.accumulate(
                    lambda mb: jax.value_and_grad(microbatch_loss)(params, mb),
                    batch[0],
                    microbatches=desc["microbatches"],
                    schedule=schedule_of(desc),
                )
            else:
                loss, grads = jax.value_and_grad(lambda ps: jnp.sum(body(*trained(ps))))(params)

            def clip_scale():
                norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
                return jnp.minimum(1.0, 1.0 / (norm + 1e-6))

            scale = clip_scale() if skip_step != "norm_inside" else None

            def update(params, momenta):  # (momenta as optax keeps them: {"mu": ...})
                s = clip_scale() if scale is None else scale
                # (one counter every parameter's update reads, as MultiSteps' mini_step)
                step = momenta["step"]
                mu = [0.9 * m + s * g / (step + 1) for m, g in zip(momenta["mu"], grads)]
                # (a scalar per parameter, as NovoGrad's second moment: its own kin)
                nu = [0.9 * v + 0.1 * jnp.sum(g * g) for v, g in zip(momenta["nu"], grads)]
                new = [
                    p - 0.1 * m / (1.0 + s) / jnp.sqrt(1.0 + v) for p, m, v in zip(params, mu, nu)
                ]
                # (and a leaf nobody reads, as Adafactor's placeholder of a factored moment)
                # (its next value chosen by a conditional on the loss, as MultiSteps'
                # by one on its other counter)
                step = jax.lax.cond(jnp.isfinite(loss), lambda c: c + 1, lambda c: c * 0, step)
                return new, {"mu": mu, "nu": nu, "ph": momenta["ph"], "step": step}

            if skip_step == "none":
                params, momenta = update(params, momenta)
            else:  # one conditional over every stage's state (cond-fission)
                params, momenta = jax.lax.cond(
                    jnp.isfinite(loss), update, lambda p, m: (p, m), params, momenta
                )
            return loss, params, momenta

        def step_on_one_tree(train_state, *batch):  # (keys sorting as the tuple's order)
            loss, params, momenta = step(train_state["params"], train_state["state"], *batch)
            return {"loss": loss, "params": params, "state": momenta}

        return step_on_one_tree if one_tree else step

    _, args, kwargs = build(desc, meshes, seen)
    params, batch = args[: n - stacked_param], args[n - stacked_param :]
    if stacked_param:  # the weights of the layer stacks that read an operand
        rng = np.random.default_rng(len(desc["ops"]))
        longest, size = 15, max(SIZES)  # every=3 over 5 groups
        params.append(jnp.asarray(rng.normal(size=(longest, size, size)) * 0.5, jnp.float32))
    momenta = {
        "mu": [0.5 * a for a in params],
        "nu": [jnp.sum(a * a) for a in params],
        "ph": [jnp.zeros((1,), a.dtype) for a in params],
        "step": jnp.zeros((), jnp.int32),
    }
    specs = list(kwargs["in_specs"][: n - stacked_param]) + [None] * stacked_param
    # (the momenta's as their parameters')
    state_specs = (specs, {"mu": specs, "nu": [None] * n, "ph": [None] * n, "step": None})
    if specs_given_as == "out_specs":  # (the parameters' only: the momenta take theirs)
        free = {"mu": [None] * n, "nu": [None] * n, "ph": [None] * n, "step": None}
        kwargs["out_specs"] = (
            {"loss": None, "params": specs, "state": free} if one_tree else (None, specs, free)
        )
        state_specs = ([None] * n, free)
    if one_tree:
        state_specs = ({"params": state_specs[0], "state": state_specs[1]},)
    kwargs["in_specs"] = (*state_specs, *(None,) * len(batch))

    def state_args(params, momenta):
        return ({"params": params, "state": momenta},) if one_tree else (params, momenta)

    compiled = mpmdc.compile(training_step(seen, meshes), meshes, **kwargs)
    program = compiled.lower(*state_args(params, momenta), *batch).program("after-split")
    jaxpr = program.jaxpr.jaxpr
    sent = {v for e in jaxpr.eqns if e.primitive is transfer_p for v in e.invars}
    for j in range(4 * n + 1):  # fed back, each is where the next call reads it
        assert program.out_meshes[1 + j] == program.in_meshes[j], j
    for k, v in enumerate(jaxpr.invars[:n]):
        if v not in sent:
            note("a parameter read on one mesh")
            # Its momentum, its scalar (a norm of its gradient) and its placeholder
            # live with it.
            for j in (n + k, 2 * n + k, 3 * n + k):
                assert program.in_meshes[j] == program.out_meshes[1 + j] == program.in_meshes[k], j
            for j in (k, n + k):
                # Each comes back with the spec it came in with: the one given (the
                # parameter's, for the argument or for the result fed back for it),
                # or, where none is, the one propagation chose for it.
                came_in = canonical_spec(program.in_specs[j])
                assert specs[k] is None or came_in == canonical_spec(specs[k]), j
                assert canonical_spec(program.out_specs[1 + j]) == came_in, j
    given = state_args(params, momenta)
    if in_context and stacked_param:  # (jax.jit is given the stack uncommitted)
        whole_on_last = jax.sharding.NamedSharding(meshes[-1], P())
        given = jax.tree.map(
            lambda a: jax.device_put(a, whole_on_last) if a.ndim == 3 else a, given
        )
    with jax.set_mesh(meshes[0]) if in_context else contextlib.nullcontext():
        got = jax.block_until_ready(compiled(*given, *batch))
    want = jax.block_until_ready(
        jax.jit(training_step(expected, reference_meshes(meshes), reference=True))(
            *state_args(params, momenta), *batch
        )
    )
    jax.effects_barrier()
    assert_same_results(got, want)
    seen.assert_same_as(expected, **FLOAT32)


def test_a_stacked_parameter_cut_for_two_meshes_keeps_its_momentum_with_it():
    """Found with ``MPMDC_FUZZ_SEED=59``: a stacked parameter read in slices by stages
    on two meshes; its slices run where it lives and move. Placed only after every
    transpose count, they left the parameter nowhere while its gradient's sum was
    placed, and its momentum came to live on the other mesh (moved every step)."""
    check_training_step(
        dict(
            explicit=False,
            num_inputs=2,
            ops=[
                ("unary", "cond", 0),
                ("stack", 1, 2, 2, "input", 0, 0),
                ("constant", "module_jax", 0, "matmul", 0),
                ("constant", "module_jax", 0, "matmul", 0),
                ("checkpointed_layer", 0, "module_jax", 0, 0),
                ("binary", "add", 0, 0),
                ("layer", 0, "jitted_helper", 0, 2),
                ("custom_layer", 1, "custom_jvp", 0, 0),
                ("stack", 0, (1, 2), 3, "closure", 7, 8),
                ("binary", "matmul", 0, 0),
                ("constant", "module_jax", 0, "matmul", 5),
                ("layer", 1, "jitted_helper", 0, 9),
                ("unary", "scan", 12),
                ("custom_layer", 1, "custom_vjp", 0, 13),
                ("stack", 0, 1, 2, "input", 9, 4),
                ("shard_map", 1, 16, True, "matmul", (None, "d"), ("d",), False, True),
                ("shard_map", 0, 12, True, "matmul", (None, "d"), ("d",), False, False),
                ("constant", "module_jax", 0, "matmul", 13),
                ("shard_map", 0, 18, False, "matmul", (None, "d"), ("d",), False, False),
                ("binary", "sub", 0, 1),
                ("layer", 1, "module_numpy", 0, 21),
                ("checkpointed_layer", 1, "module_numpy", 1, 10),
                ("effect", True, 8),
                ("binary", "max", 19, 8),
                ("unary", "cond", 8),
                ("unary", "scan", 15),
                ("constant", "closure", 0, "add", 14),
                ("constraint", 0, 5, False, None),
                ("checkpointed_layer", 1, "module_jax", 1, 17),
                ("binary", "mul", 26, 24),
                ("shard_map", 0, 4, True, "psum", ("d",), (), False, False),
                ("layer", 1, "module_numpy", 0, 18),
                ("constraint", 1, 33, False, None),
                ("binary", "mul", 10, 19),
                ("unary", "roll_rows", 31),
                ("constant", "module_numpy", 0, "matmul", 27),
                ("constraint", 0, 7, False, None),
                ("unary", "tanh", 31),
                ("effect", True, 17),
                ("stack", 0, 1, 1, "closure", 11, 15),
                ("shard_map", 0, 30, True, "psum", ("d",), (), False, True),
                ("constraint", 0, 36, False, None),
                ("binary", "sub", 31, 22),
                ("constant", "module_numpy", 1, "matmul", 28),
                ("unary", "roll_rows", 37),
                ("custom_layer", 1, "custom_jvp", 1, 23),
                ("constraint", 1, 21, False, None),
                ("binary", "sub", 42, 20),
                ("effect", False, 40),
                ("constant", "module_jax", 0, "matmul", 33),
                ("stack", 1, (1,), 1, "input", 0, 12),
                ("unary", "sin", 0),
                ("unary", "cond", 5),
                ("binary", "max", 0, 46),
                ("unary", "cond", 27),
                ("unary", "sin", 7),
                ("unary", "tagged", 3),
                ("custom_layer", 1, "custom_vjp", 0, 51),
                ("stack", 1, 3, 3, "closure", 58, 37),
            ],
            markers={},
            num_meshes=2,
            mesh_axes=(("d", 1),),
            in_specs=[None, None],
            committed=[None, 1],
            mode="value_and_grad",
            schedule="zb-h1",
            microbatches=2,
            computed_batch=True,
            stacked_loss=False,
            metric=("int8", "mean"),
            stage_to_mesh=(1, 0),
            with_key=False,
            echoes=[],
        ),
        skip_step="none",
        stacked_param=True,
        frozen=False,
        in_context=False,
        note=lambda _: None,
    )


def test_a_parameter_whose_gradient_is_made_on_another_mesh_keeps_its_momentum_with_it():
    """Found with ``MPMDC_FUZZ_SEED=109``: a parameter read by stage 0 on mesh 0 and, as
    ``f + f``, by work of the last stage on mesh 1 that reads no marker, so its gradient
    is made on mesh 1 by work no marker places. Its momentum's update, placed one
    equation at a time with the parameter, was moved to mesh 1 by the minimum cut after
    it (one scalar fewer to send) and the momentum lived there, away from its parameter."""
    ops = {
        0: ("binary", "add", 0, 0),
        3: ("stack", 3, 1, 1, "input", 1, 0),
        5: ("unary", "cond", 1),
        8: ("binary", "add", 0, 6),
        11: ("constant", "closure", 0, "matmul", 1),
        16: ("stack", 2, (1,), 1, "closure", 4, 10),
        20: ("layer", 0, "closure", 1, 9),
        31: ("binary", "sub", 21, 3),
        39: ("effect", True, 32),
        41: ("effect", True, 17),
        54: ("constant", "module_numpy", 0, "matmul", 12),
    }
    check_training_case(
        [ops.get(k, ("unary", "sin", 0)) for k in range(55)],
        markers={20: (0, [16], False)},
        num_meshes=2,
        committed=[0],
        mode="value_and_grad",
        computed_batch=True,
        stacked_loss=True,
        skip_step="norm_inside",
        stacked_param=True,
    )


def test_a_momentum_lives_with_its_parameter_where_the_running_sum_is_elsewhere():
    """Found with ``MPMDC_FUZZ_SEED=1`` once the property above asked it under
    ``accumulate`` too: a parameter read by stage 0 alone, whose gradient's running sum
    the loop leaves on stage 2's mesh. The minimum cut after the loop weighed the
    momentum's update the same on either mesh and left it with the sum, so the
    momentum lived on mesh 2, away from its parameter."""
    check_training_case(
        [
            ("custom_layer", 2, "custom_vjp", 0, 0),
            ("custom_layer", 0, "custom_vjp", 0, 1),
            *[("unary", "cond", 0)] * 7,
            ("unary", "cond", 2),
        ],
        markers={9: (2, [10], False)},
        num_meshes=3,
        committed=[None],
        mode="accumulate",
        computed_batch=False,
        stacked_loss=False,
        skip_step="none",
        stacked_param=False,
    )


def test_a_parameters_scalar_state_lives_with_it_where_an_argument_shares_its_index():
    """Found by CI's seed once the property above kept a scalar per parameter: the
    state taken as one pytree (``args[0]['state']['nu'][1]``, the scalar of parameter
    ``args[0]['params'][1]``) and the batch as ``args[1]``. Kin were matched by path
    endings that kept the argument's index, so the batch, read on mesh 2, was kin of
    every scalar at index ``[1]`` and the scalar lived there, away from its parameter
    on mesh 0."""
    ops = {
        1: ("constraint", 1, 0, True, None),
        2: ("constant", "module_jax", 0, "matmul", 4),
        11: ("layer", 0, "module_jax", 0, 5),
        20: ("stack", 0, 2, 4, "closure", 14, 7),
    }
    check_training_case(
        [ops.get(k, ("unary", "sin", 0)) for k in range(21)],
        skip_step="none",
        stacked_param=False,
        one_tree=True,
        num_inputs=3,
        in_specs=[None, (None, "d"), None],
        schedule="gpipe",
        stage_to_mesh=(0, 2, 0),
        markers={},
        num_meshes=4,
        committed=[None, 0, 1],
        mode="accumulate",
        computed_batch=False,
        stacked_loss=False,
    )


def check_training_case(ops, skip_step, stacked_param, one_tree=False, **desc):
    """:func:`check_training_step` of a fuzz example cut down by hand, by default of one
    input on meshes of two devices along ``d`` (``desc``: the rest of its description,
    and what differs from those defaults)."""
    check_training_step(
        {
            "explicit": False,
            "num_inputs": 1,
            "ops": ops,
            "mesh_axes": (("d", 2),),
            "in_specs": [None],
            "schedule": "zb-h1",
            "microbatches": 2,
            "metric": ("int8", "mean"),
            "stage_to_mesh": None,
            "with_key": False,
            "echoes": [],
            **desc,
        },
        skip_step=skip_step,
        stacked_param=stacked_param,
        frozen=False,
        in_context=False,
        one_tree=one_tree,
        note=lambda _: None,
    )
