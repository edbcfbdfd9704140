"""``mpmdc.accumulate``: run a function on microbatch slices and reduce the results.

Under plain ``jax.jit`` (or eagerly) it is a sequential ``lax.scan`` over the
microbatches, carrying the running reduction, so the training step that uses it is
its own reference. While ``mpmdc.compile`` traces a function, the loop stays rolled:
``fn`` is traced once, on one microbatch, between loop edges (``mpmdc.ir.primitives.LoopEdge``)
that say which values are the batch's slices, which are running reductions carried
from one microbatch to the next, and which are stacked; every other value ``fn``
reads is loop-invariant. The passes see that one iteration, whatever the microbatch
count, and the ``schedule`` pass stamps its fragments out per microbatch. The loop's
schedule is recorded for that pass.

Where anything but ``mpmdc.compile``'s own trace traces the call (``jax.grad`` of a
function that calls ``accumulate``, a ``jax.jit`` or ``checkify`` around it), the loop
is unrolled instead, each microbatch's slice marked with its index: a transformation
would see one iteration where there are many (differentiating it would sum the gradient
of a loop-invariant value over one microbatch, not all of them). A ``jax.jit`` of the
call that JAX traced before ``mpmdc.compile`` traced the function keeps that trace, the
plain ``scan``, which no schedule pipelines (docs/design.md, "The microbatch loop").

Every form reduces in the same order (microbatch 0 first) from the same start, so
they compute the same numbers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mpmdc import _jax_compat as compat
from mpmdc._text import a_type
from mpmdc.errors import AccumulateError
from mpmdc.ir.primitives import LoopEdge, loop_edge, mark_microbatch
from mpmdc.ir.pytrees import broadcast_prefix, skeleton
from mpmdc.schedules import library

REDUCTIONS = ("sum", "mean", "concat", "max")


@dataclass(frozen=True)
class Loop:
    """What an ``accumulate`` call traced for mpmdc leaves for the ``schedule`` pass,
    and the user's line that called it."""

    schedule: library.Schedule | library.Chooser
    microbatches: int
    called_at: str


class _Recording(NamedTuple):
    loops: list[Loop]
    trace: object  # the trace mpmdc.compile traces the function with


_recording: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar(
    "mpmdc_accumulate_loops", default=None
)


@contextlib.contextmanager
def recording_loops():
    """While active, ``accumulate`` emits its loop for mpmdc's passes and records it in
    the list this yields. ``mpmdc.compile`` enters it inside the trace of the function:
    a loop traced by that trace itself stays rolled; one traced by any other (under
    ``jax.grad``, inside a ``jax.jit`` or ``checkify``, whose jaxpr JAX may interpret
    again) is unrolled.
    """
    recording = _Recording([], compat.current_trace())
    token = _recording.set(recording)
    try:
        yield recording.loops
    finally:
        _recording.reset(token)


def _error(problem: str) -> AccumulateError:
    """An ``AccumulateError`` naming the user's line that called ``mpmdc.accumulate``."""
    return AccumulateError(f"mpmdc.accumulate at {compat.user_line()}: {problem}")


def _explicit_split(x) -> tuple[tuple[str, ...], int]:
    """The ``Explicit`` mesh axes that ``x``'s type splits its leading axis over (axes of
    other types are not in the type) and how many devices they span."""
    spec = jax.typeof(x).sharding.spec
    names = spec[0] if len(spec) else None
    names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
    shape = jax.typeof(x).sharding.mesh.shape
    return names, math.prod(shape[n] for n in names)


def _batch_leaves(xs, microbatches: int):
    """``(leaves, rows per microbatch of each, treedef)`` of ``xs``, every leaf checked
    to have a leading axis that ``microbatches`` divides into slices its sharding fits."""
    leaves, _tree = jax.tree_util.tree_flatten_with_path(xs)
    if not leaves:
        raise _error("xs holds no arrays to split into microbatches.")
    for path, x in leaves:
        shape = jnp.shape(x)
        where = f"xs{jax.tree_util.keystr(path)}"
        if not shape:
            raise _error(
                f"{where} is a scalar; accumulate splits the leading axis of every leaf of xs."
            )
        if shape[0] % microbatches:
            raise _error(
                f"{where} has leading size {shape[0]}, which {microbatches} microbatches do not "
                f"divide; choose a microbatch count that divides every batch size."
            )
        axes, devices = _explicit_split(x)
        if (shape[0] // microbatches) % devices:
            raise _error(
                f"{where} has its leading axis split over the Explicit mesh axes {axes} "
                f"({devices} devices), which its microbatches of {shape[0] // microbatches} "
                f"rows cannot be; choose a microbatch count that leaves a multiple of "
                f"{devices} rows per microbatch, or reshard xs (jax.sharding.reshard)."
            )
    arrays = [jnp.asarray(x) for _, x in leaves]
    return arrays, [x.shape[0] // microbatches for x in arrays], jax.tree_util.tree_structure(xs)


def _reductions(reduce, out_tree):
    """One reduction name per output leaf (``reduce`` is a name or a pytree prefix of names)."""
    outputs = skeleton(out_tree)
    try:
        names = broadcast_prefix(reduce, outputs, lambda r: isinstance(r, str))
    except ValueError as err:
        raise _error(
            f"reduce={reduce!r} does not match the structure of fn's outputs: {err}. Give one "
            f"of {REDUCTIONS} or a pytree prefix of them."
        ) from None
    for r in names:
        if r not in REDUCTIONS:
            raise _error(f"unknown reduction {r!r}; use one of {', '.join(REDUCTIONS)}.")
    return names


def _combine(kind: str, acc, y):
    if kind in ("sum", "mean"):
        return acc + y
    return jnp.maximum(acc, y)


def _finish(kind: str, acc, microbatches: int):
    return acc / microbatches if kind == "mean" else acc


def _start(kind: str, like):
    """The running reduction's value before microbatch 0: the identity of ``kind``
    (``0 + x == x`` and ``max(-inf, x) == x`` exactly), of ``like``'s type, weak type
    included (the ``scan`` under ``jax.jit`` starts from a first value of that type).
    Built by an equation, not a literal, so it is a value of its own that ``split``
    passes into the loop."""
    shape, dtype = jnp.shape(like), jnp.result_type(like)
    if kind == "max":
        if jnp.issubdtype(dtype, jnp.floating):
            fill = -jnp.inf
        elif jnp.issubdtype(dtype, jnp.integer):
            fill = jnp.iinfo(dtype).min
        else:
            fill = False
    else:
        fill = 0
    start = jnp.reshape(jnp.full((1, *shape), fill, dtype), shape)
    return compat.with_weak_type(start, jax.typeof(like).weak_type)


def _rolled_reduction(kind: str, value, carry: int, microbatches: int):
    """Reduce one output of the rolled loop's iteration: stacked for ``concat``, else a
    running value carried from microbatch to microbatch (``carry`` numbers it)."""
    if kind == "concat":
        return loop_edge(value, LoopEdge.STACK, microbatches)
    if kind != "max" and compat.known_zero(value):
        # Zeros every microbatch (the gradient of a frozen parameter) sum to the start,
        # zeros, to the bit: no running value to carry through the loop, and to place.
        return _finish(kind, _start(kind, value), microbatches)
    running = loop_edge(_start(kind, value), LoopEdge.CARRY, microbatches, carry)
    total = _combine(kind, running, value)
    return _finish(kind, loop_edge(total, LoopEdge.RESULT, microbatches, carry), microbatches)


def _rolled(fn, leaves, tree, microbatches: int, reduce):
    """The loop kept rolled for mpmdc: ``fn`` traced once on the batch's slices, its
    results reduced across the loop's edges."""
    slices = [loop_edge(x, LoopEdge.SLICE, microbatches) for x in leaves]
    out_leaves, out_tree = jax.tree_util.tree_flatten(
        fn(jax.tree_util.tree_unflatten(tree, slices))
    )
    out_leaves = [jnp.asarray(y) for y in out_leaves]
    kinds = _checked_reductions(reduce, out_tree, [y.shape for y in out_leaves])
    results = [
        _rolled_reduction(kind, y, k, microbatches)
        for k, (y, kind) in enumerate(zip(out_leaves, kinds))
    ]
    return jax.tree_util.tree_unflatten(out_tree, results)


def _unrolled_reduction(kind: str, values: list, microbatches: int):
    """Reduce one output over the unrolled microbatches, marking where the loop ends.

    A running sum starts from zeros made outside the loop, and every result crosses a
    ``microbatch[None]`` marker on its way out: so each microbatch's fragment has the
    same body (receive the sum, add, pass it on) and work after the loop, such as the
    optimizer, gets fragments of its own. ``0 + x == x`` exactly, so the numbers are
    those of the ``lax.scan`` form.
    """
    if kind == "concat":
        return jnp.concatenate(mark_microbatch(values, None))
    if kind == "max":
        total = functools.reduce(jnp.maximum, values)
    else:
        # Built by an equation (a scalar zero would be a literal, which `split` folds into
        # the first microbatch's fragment instead of passing it in).
        total = mark_microbatch([_start(kind, values[0])], None)[0]
        for value in values:
            total = total + value
    return _finish(kind, mark_microbatch([total], None)[0], microbatches)


def _checked_reductions(reduce, out_tree, shapes) -> list[str]:
    kinds = _reductions(reduce, out_tree)
    for path, shape, kind in zip(_output_paths(out_tree), shapes, kinds):
        if kind == "concat" and not shape:
            raise _error(
                f"reduce='concat' needs outputs with a leading axis; fn's output{path} is a "
                f"scalar. Return it with one (x[None]), or give it another reduction "
                f"(a pytree of reductions matching fn's outputs)."
            )
    return kinds


def _output_paths(out_tree) -> list[str]:
    """The path of each leaf of ``fn``'s outputs (``['loss']``; empty for a lone leaf)."""
    leaves = jax.tree_util.tree_leaves_with_path(skeleton(out_tree))
    return [jax.tree_util.keystr(path) for path, _ in leaves]


def _microbatch(leaves, sizes, i) -> list:
    """Microbatch ``i`` of every leaf: rows ``[i*n, (i+1)*n)`` of a leaf whose
    microbatches have ``n`` rows. Slices, not a reshape into ``(microbatches, n, ...)``:
    a slice of a batch sharded along its leading axis is sharded the same way for every
    axis type, where a reshape of an ``Explicit``-sharded axis has no sharding JAX can
    infer. ``i`` is a Python int (a static slice) or a traced index (a dynamic one)."""
    if isinstance(i, int):
        return [jax.lax.slice_in_dim(x, i * n, (i + 1) * n) for x, n in zip(leaves, sizes)]
    return [jax.lax.dynamic_slice_in_dim(x, i * n, n) for x, n in zip(leaves, sizes)]


def _unrolled(fn, leaves, sizes, tree, microbatches: int, reduce):
    """The loop unrolled for mpmdc (under a transformation): ``fn`` traced once, its
    jaxpr replayed per microbatch.

    Replaying the equations (each keeping its source line; emitted as they are where
    mpmdc traces, so no primitive computes its output types again) costs a fraction
    of tracing ``fn`` again, which for a training step means differentiating the model
    again. Values ``fn`` closes over (the parameters) are the jaxpr's constants. A
    microbatch is a contiguous slice of the leading axis, so a batch sharded along that
    axis gives microbatches sharded the same way.
    """
    one = jax.tree_util.tree_unflatten(
        tree, [jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype) for x, n in zip(leaves, sizes)]
    )
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(one)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    kinds = _checked_reductions(reduce, out_tree, [y.shape for y in out_leaves])
    replay = compat.replaying_fun(closed)
    outs = [replay(*mark_microbatch(_microbatch(leaves, sizes, i), i)) for i in range(microbatches)]
    results = [
        _unrolled_reduction(kind, [o[k] for o in outs], microbatches)
        for k, kind in enumerate(kinds)
    ]
    return jax.tree_util.tree_unflatten(out_tree, results)


@compat.api_boundary
def accumulate(fn, xs, *, microbatches: int, schedule="1f1b", reduce="sum"):
    """Run ``fn`` on each of ``microbatches`` slices of ``xs``'s leading axis; reduce the results.

    ``reduce`` is ``"sum"``, ``"mean"``, ``"concat"`` (along the leading axis), ``"max"``
    or a pytree prefix of these matching ``fn``'s outputs. ``schedule`` (a name, an
    ``mpmdc.schedules.Schedule``, per-mesh action lists, ``"auto"`` or a function of the
    pipeline) is how mpmdc orders the microbatches' fragments on the meshes; it does not
    change the result.
    """
    if not callable(fn):
        raise _error(
            f"fn is {'an array' if hasattr(fn, 'shape') else a_type(fn)}, not a function; "
            f"pass the function of one microbatch "
            f"first: mpmdc.accumulate(fn, xs, microbatches=...)."
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise _error(f"microbatches must be a positive int, got {microbatches!r}.")
    schedule = library.get(schedule)
    leaves, sizes, tree = _batch_leaves(xs, microbatches)
    recording = _recording.get()

    if recording is not None:
        recording.loops.append(Loop(schedule, microbatches, compat.user_line()))
        if compat.current_trace() is recording.trace:
            return _rolled(fn, leaves, tree, microbatches, reduce)
        return _unrolled(fn, leaves, sizes, tree, microbatches, reduce)

    def run(i):
        return fn(jax.tree_util.tree_unflatten(tree, _microbatch(leaves, sizes, i)))

    first = run(0)
    first_leaves, out_tree = jax.tree_util.tree_flatten(first)
    kinds = _checked_reductions(reduce, out_tree, [jnp.shape(y) for y in first_leaves])
    if microbatches == 1:  # a scan of no steps has no eager form under jax.disable_jit
        return jax.tree_util.tree_unflatten(
            out_tree, [_finish(kind, y, 1) for y, kind in zip(first_leaves, kinds)]
        )

    def body(carry, i):
        leaves = jax.tree_util.tree_leaves(run(i))
        new_carry = [
            c if kind == "concat" else _combine(kind, c, y)
            for c, y, kind in zip(carry, leaves, kinds)
        ]
        stacked_out = [y if kind == "concat" else None for y, kind in zip(leaves, kinds)]
        return new_carry, stacked_out

    init = [jnp.zeros(()) if kind == "concat" else y for y, kind in zip(first_leaves, kinds)]
    carry, ys = jax.lax.scan(body, init, jnp.arange(1, microbatches))
    results = []
    for y0, c, ys_k, kind in zip(first_leaves, carry, ys, kinds):
        if kind == "concat":
            results.append(jnp.concatenate([y0, jnp.reshape(ys_k, (-1, *jnp.shape(y0)[1:]))]))
        else:
            results.append(_finish(kind, c, microbatches))
    return jax.tree_util.tree_unflatten(out_tree, results)
