"""mpmdc's primitives: the ``stage``, ``layer_stage`` and ``microbatch`` markers,
``loop_edge``, ``fragment`` and ``transfer``.

``stage`` is what users write. It is an identity on a pytree whose JVP marks the
tangent with the same stage and whose transpose marks the cotangent with the
transpose count incremented, so the backward work of stage ``s`` can be found and
placed on the mesh of stage ``s``.

``layer_stage`` is what ``mpmdc.stage(h, every=k)`` binds in the body of a scan over a
layer stack: an identity saying which group of the scan's iterations runs in which
stage, which ``split-scans`` reads and removes when it cuts the scan per stage.

``microbatch`` is what ``mpmdc.accumulate`` puts on each microbatch's slice of the
batch while ``mpmdc.compile`` traces: an identity whose index ``partition`` follows
through the data flow, so each microbatch's work becomes its own fragments.

``loop_edge`` is where a value crosses the boundary of an ``accumulate`` loop kept
rolled (one iteration standing for every microbatch): the batch sliced per microbatch, a
running sum's start and last value, results stacked per microbatch, until ``schedule``
stamps the loop out per microbatch.

``fragment`` and ``transfer`` only appear after the ``split`` pass: a fragment is a
sub-jaxpr that runs on one mesh, a transfer moves values between two meshes. A
fragment's ``kind`` is the :class:`ActionKind` of the work in it. Each
has an abstract eval, a DCE rule and a typecheck rule next to it, so JAX's own
``check_jaxpr``, ``dce_jaxpr`` and ``eval_jaxpr`` work on MPMD programs (with the
meshes ignored, which makes ``eval_jaxpr`` a handy reference).
"""

from __future__ import annotations

import enum
import operator

import jax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from mpmdc import _jax_compat as compat
from mpmdc._text import a_type
from mpmdc.errors import StageError
from mpmdc.ir import custom_rules

# --------------------------------------------------------------------- stage

stage_p = jcore.Primitive("stage")
stage_p.multiple_results = True


def _stage_error(problem: str) -> StageError:
    """A ``StageError`` naming the user's line that called ``mpmdc.stage``."""
    return StageError(f"mpmdc.stage at {compat.user_line()}: {problem}")


def _checked_stage_index(index) -> int:
    if isinstance(index, jax.core.Tracer):
        raise _stage_error(
            "the stage index depends on a traced value; stage indices must be Python ints "
            "known when the function is traced (compute them from Python loop counters, not "
            "from arrays). Inside a scan over layers, write mpmdc.stage(h, every=k) instead: "
            "iteration j then enters stage j // k."
        )
    if isinstance(index, bool):
        raise _stage_error(f"stage index must be an int, got bool {index!r}.")
    try:
        index = operator.index(index)
    except TypeError:
        raise _stage_error(
            f"stage index must be a non-negative int, got {type(index).__name__} {index!r}."
        ) from None
    if index < 0:
        raise _stage_error(f"stage index must be non-negative, got {index}.")
    return index


BALANCED = "balanced"  # every="balanced" (a layer stack) and partition="balanced"


def _checked_every(every, first):
    """``every`` as an int, a tuple of per-stage counts or ``"balanced"``, ``first`` as an
    int: checked."""
    if isinstance(every, jax.core.Tracer) or isinstance(first, jax.core.Tracer):
        raise _stage_error("`every` and `first` must be Python ints known when tracing.")
    if isinstance(every, str):
        if every != BALANCED:
            raise _stage_error(
                f"every={every!r}: give a positive int, a tuple of per-stage counts, or 'balanced'."
            )
        return every, _checked_stage_index(first)
    counts = every if isinstance(every, (tuple, list)) else (every,)
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise _stage_error(
                f"every={every!r}: give a positive int (iterations per stage) or a tuple of "
                f"positive ints (the iterations of each stage, in order)."
            )
    return (tuple(every) if isinstance(every, (tuple, list)) else every), _checked_stage_index(
        first
    )


def _is_value(leaf) -> bool:
    """Whether JAX takes ``leaf`` as a value (an array, a number, a key)."""
    try:
        jax.typeof(leaf)
    except (TypeError, ValueError):
        return False
    return True


def _checked_leaves(x, leaves) -> None:
    """A ``StageError`` naming the first leaf of ``x`` that is not a JAX value."""
    if all(map(_is_value, leaves)):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(x):
        if not _is_value(leaf):
            where = f"x{jax.tree_util.keystr(path)}" if path else "x"
            dtype = getattr(leaf, "dtype", None)
            of = f" of dtype {dtype}" if dtype is not None else ""
            raise _stage_error(
                f"{where} is {a_type(leaf)}{of}, which is no array type: mark arrays "
                f"(a pytree of them), and pass anything else around the marker, or register "
                f"its type as a pytree node."
            )


@compat.api_boundary
def stage(x, index=None, *, every=None, first=0):
    """Mark that the pytree ``x`` enters pipeline stage ``index``.

    The identity under ``jax.jit``, ``jax.grad`` and ``jax.vmap``; under
    ``mpmdc.compile`` everything computed from the returned value runs on the mesh
    of stage ``index`` until the next marker.

    Inside the body of a ``scan`` over a layer stack, ``stage(h, every=k)`` says that
    iteration ``j`` enters stage ``first + j // k``: the scan runs as one scan per stage
    over that stage's iterations. ``every`` may be a tuple of per-stage iteration counts
    (an uneven split) that sum to the scan's length, or ``"balanced"``: each iteration is
    a segment numbered from ``first``, and ``mpmdc.compile`` groups the program's segments
    into stages of equal estimated cost (as ``compile(..., partition="balanced")``).
    """
    if (index is None) == (every is None):
        raise _stage_error(
            (
                "it was given both a stage index and every=; give one: "
                if every is not None
                else "give "
            )
            + "a stage index, mpmdc.stage(x, i), or, inside a scan over layers, "
            "mpmdc.stage(x, every=k)."
        )
    leaves, treedef = jax.tree_util.tree_flatten(x)
    _checked_leaves(x, leaves)
    eager = compat.evaluating_eagerly()  # (the identity itself: 3 stays the int 3)
    if every is not None:
        every, first = _checked_every(every, first)
        if not leaves or eager:
            return x
        out = layer_stage_p.bind(*leaves, every=every, first=first, transpose=0)
        return jax.tree_util.tree_unflatten(treedef, out)
    index = _checked_stage_index(index)
    if not leaves or eager:
        return x
    custom_rules.RULES.entering(leaves, index)
    out = stage_p.bind(*leaves, stage=index, transpose=0)
    return jax.tree_util.tree_unflatten(treedef, out)


def is_marker(eqn) -> bool:
    """True for a ``stage`` marker equation."""
    return eqn.primitive is stage_p


def is_transposed_marker(eqn) -> bool:
    """A marker whose inputs leave its stage's backward (odd transpose count)."""
    return eqn.primitive is stage_p and eqn.params["transpose"] % 2 == 1


stage_p.def_impl(lambda *xs, stage, transpose: list(xs))
stage_p.def_abstract_eval(lambda *avals, stage, transpose: list(avals))


def _bind_nonzero(primitive, values, **params):
    """Bind ``primitive`` on the non-``Zero`` entries of ``values``; keep zeros as they are."""
    live = [v for v in values if type(v) is not ad.Zero]
    marked = iter(primitive.bind(*live, **params) if live else [])
    return [v if type(v) is ad.Zero else next(marked) for v in values]


def _marker_jvp(primitive):
    """JVP of a marker: the tangents are marked as the primals are."""

    def rule(primals, tangents, **params):
        out = primitive.bind(*primals, **params)
        return out, _bind_nonzero(primitive, list(tangents), **params)

    return rule


def _marker_transpose(primitive):
    """Transpose of a marker: the cotangents are marked with the transpose count + 1."""

    def rule(cts, *args, transpose, **params):
        cts = [
            ad.Zero(arg.aval) if type(ct) is ad.Zero and ad.is_undefined_primal(arg) else ct
            for ct, arg in zip(cts, args)
        ]
        out = _bind_nonzero(primitive, cts, transpose=transpose + 1, **params)
        return [ct if ad.is_undefined_primal(arg) else None for ct, arg in zip(out, args)]

    return rule


def _kept(values, keep) -> list:
    return [v for v, k in zip(values, keep) if k]


def _pruned_eqn(eqn, used_inputs, used_outputs, params, effects):
    """``eqn`` with only the used inputs and outputs, and new ``params``."""
    return jcore.new_jaxpr_eqn(
        _kept(eqn.invars, used_inputs),
        _kept(eqn.outvars, used_outputs),
        eqn.primitive,
        params,
        effects,
        eqn.source_info,
        eqn.ctx,
    )


def _elementwise_dce(spec_params=()):
    """DCE rule for a primitive whose output ``i`` is its input ``i`` (stage, transfer).

    ``spec_params`` name per-value tuple parameters pruned along with the values.
    """

    def rule(used_outputs, eqn):
        if not any(used_outputs):
            return [False] * len(eqn.invars), None
        keep = list(used_outputs)
        params = dict(eqn.params)
        params.update((k, tuple(_kept(params[k], keep))) for k in spec_params)
        return keep, _pruned_eqn(eqn, keep, keep, params, eqn.effects)

    return rule


ad.primitive_jvps[stage_p] = _marker_jvp(stage_p)
ad.primitive_transposes[stage_p] = _marker_transpose(stage_p)


def _marker_batcher(primitive):
    """Batching rule of a marker: the batched values are marked as they are."""
    return lambda args, dims, **params: (primitive.bind(*args, **params), dims)


batching.primitive_batchers[stage_p] = _marker_batcher(stage_p)
mlir.register_lowering(stage_p, lambda ctx, *args, stage, transpose: list(args))
pe.dce_rules[stage_p] = _elementwise_dce()

# ---------------------------------------------------------------- layer_stage

# ``stage(h, every=k, first=f)`` inside a scan body: iteration ``j`` enters stage
# ``f + j // k``. The ``split-scans`` pass cuts the scan into one scan per stage, removes
# these from the body and marks the carry with plain ``stage`` markers between the stages.
layer_stage_p = jcore.Primitive("layer_stage")
layer_stage_p.multiple_results = True
layer_stage_p.def_impl(lambda *xs, every, first, transpose: list(xs))
layer_stage_p.def_abstract_eval(lambda *avals, every, first, transpose: list(avals))


def is_layer_marker(eqn) -> bool:
    """True for a ``stage(h, every=...)`` marker (inside a scan body)."""
    return eqn.primitive is layer_stage_p


ad.primitive_jvps[layer_stage_p] = _marker_jvp(layer_stage_p)
ad.primitive_transposes[layer_stage_p] = _marker_transpose(layer_stage_p)
batching.primitive_batchers[layer_stage_p] = _marker_batcher(layer_stage_p)
mlir.register_lowering(layer_stage_p, lambda ctx, *args, **params: list(args))
pe.dce_rules[layer_stage_p] = _elementwise_dce()


# ---------------------------------------------------------------- microbatch

microbatch_p = jcore.Primitive("microbatch")
microbatch_p.multiple_results = True


def mark_microbatch(values: list, index: int | None) -> list:
    """``values`` marked as belonging to microbatch ``index`` (an identity); with
    ``None``, as crossing the loop's boundary (a running sum's start, a result).

    One marker per value, so each value is placed by its own users (the inputs go to
    the first stage, the labels to the last).
    """
    return [microbatch_p.bind(v, index=index)[0] for v in values]


def is_microbatch_marker(eqn) -> bool:
    """True for a ``microbatch`` marker equation."""
    return eqn.primitive is microbatch_p


def _microbatch_jvp(primals, tangents, *, index):  # index: int or None
    return microbatch_p.bind(*primals, index=index), _bind_nonzero(
        microbatch_p, list(tangents), index=index
    )


def _microbatch_transpose(cts, *args, index):
    out = _bind_nonzero(microbatch_p, list(cts), index=index)
    return [ct if ad.is_undefined_primal(arg) else None for ct, arg in zip(out, args)]


microbatch_p.def_impl(lambda *xs, index: list(xs))
microbatch_p.def_abstract_eval(lambda *avals, index: list(avals))
ad.primitive_jvps[microbatch_p] = _microbatch_jvp
ad.primitive_transposes[microbatch_p] = _microbatch_transpose
batching.primitive_batchers[microbatch_p] = _marker_batcher(microbatch_p)
mlir.register_lowering(microbatch_p, lambda ctx, *args, index: list(args))
pe.dce_rules[microbatch_p] = _elementwise_dce()


# ----------------------------------------------------------------- loop edges


class LoopEdge(enum.StrEnum):
    """Where a value crosses the boundary of an ``mpmdc.accumulate`` loop kept rolled:
    the passes see one iteration (one microbatch's work) and ``schedule`` stamps it out."""

    SLICE = "slice"  # the whole batch outside; microbatch i's rows inside iteration i
    CARRY = "carry"  # the start value outside; the running value entering iteration i
    RESULT = "result"  # the running value leaving iteration i; outside, the last one's
    STACK = "stack"  # each iteration's value inside; outside, all of them stacked in order


# (The microbatch of equations inside a rolled loop's one iteration.)
LOOP = "loop"

loop_edge_p = jcore.Primitive("loop_edge")
loop_edge_p.multiple_results = True


def loop_edge(value, edge: LoopEdge, microbatches: int, carry: int = -1):
    """``value`` crossing a rolled loop's boundary at ``edge``; a ``CARRY`` and the
    ``RESULT`` closing it share ``carry`` (the carry's number in its loop)."""
    return loop_edge_p.bind(value, edge=edge, microbatches=microbatches, carry=carry)[0]


def is_loop_edge(eqn, *edges: LoopEdge) -> bool:
    """True for a loop edge equation (of one of ``edges``, where given)."""
    return eqn.primitive is loop_edge_p and (not edges or eqn.params["edge"] in edges)


def is_loop_entry(eqn) -> bool:
    """A loop edge whose output is inside the loop (``SLICE``, ``CARRY``)."""
    return is_loop_edge(eqn, LoopEdge.SLICE, LoopEdge.CARRY)


def _loop_edge_abstract_eval(aval, *, edge, microbatches, **_):
    if edge is LoopEdge.SLICE:
        return [aval.update(shape=(aval.shape[0] // microbatches, *aval.shape[1:]))]
    if edge is LoopEdge.STACK:
        return [aval.update(shape=(aval.shape[0] * microbatches, *aval.shape[1:]))]
    return [aval]


def _loop_edge_impl(*_, edge, **__):
    raise NotImplementedError(
        f"a loop edge ({edge}) stands for a whole rolled loop and cannot be evaluated "
        f"alone; evaluate the program after the `schedule` pass, which stamps the loop out."
    )


def _loop_edge_dce(used_outputs, eqn):
    # Slices and carries stay even when nothing reads them: ``accumulate`` emits them
    # before and right after tracing its function, and ``partition`` reads the loop's
    # extent (where that function's callbacks were traced) off their positions.
    if is_loop_entry(eqn):
        return [True], eqn
    return _elementwise_dce()(used_outputs, eqn)


loop_edge_p.def_impl(_loop_edge_impl)
loop_edge_p.def_abstract_eval(_loop_edge_abstract_eval)
pe.dce_rules[loop_edge_p] = _loop_edge_dce


# ------------------------------------------------------------------ fragment


class ActionKind(enum.StrEnum):
    """What a fragment's work is, as schedules name it: forward, whole backward, or a
    backward split into its input-gradient and weight-gradient halves."""

    F = "F"  # forward
    B = "B"  # backward: input and weight gradients together
    I = "I"  # noqa: E741 -- backward, input gradients only (what the previous stage waits for)
    W = "W"  # backward, weight gradients only (free to run later)


fragment_p = jcore.Primitive("fragment")
fragment_p.multiple_results = True


def _fragment_impl(*args, jaxpr, **_):
    return jcore.jaxpr_as_fun(jaxpr)(*args)


def _fragment_abstract_eval(*avals, jaxpr, **_):
    return list(jaxpr.out_avals), jaxpr.effects


def _fragment_dce(used_outputs, eqn):
    inner = eqn.params["jaxpr"]
    if not any(used_outputs) and not inner.effects:
        return [False] * len(eqn.invars), None
    new_inner, used_inputs = pe.dce_jaxpr(inner.jaxpr, used_outputs)
    closed = jcore.ClosedJaxpr(new_inner, inner.consts)
    kept_index = {
        old: new for new, old in enumerate(k for k, used in enumerate(used_inputs) if used)
    }
    params = dict(
        eqn.params,
        jaxpr=closed,
        in_specs=tuple(_kept(eqn.params["in_specs"], used_inputs)),
        out_specs=tuple(_kept(eqn.params["out_specs"], used_outputs)),
        donate_argnums=tuple(
            kept_index[k] for k in eqn.params["donate_argnums"] if k in kept_index
        ),
    )
    return used_inputs, _pruned_eqn(eqn, used_inputs, used_outputs, params, closed.effects)


def _same_type(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def _fragment_typecheck(_ctx_factory, *in_atoms, jaxpr, name, in_specs, out_specs, **_):
    if len(in_specs) != len(in_atoms) or len(out_specs) != len(jaxpr.out_avals):
        raise jcore.JaxprTypeError(
            f"fragment {name}: {len(in_specs)} input / {len(out_specs)} output specs for "
            f"{len(in_atoms)} inputs / {len(jaxpr.out_avals)} outputs"
        )
    if len(in_atoms) != len(jaxpr.in_avals) or not all(
        _same_type(a.aval, b) for a, b in zip(in_atoms, jaxpr.in_avals)
    ):
        got = ", ".join(str(a.aval) for a in in_atoms)
        want = ", ".join(str(a) for a in jaxpr.in_avals)
        raise jcore.JaxprTypeError(f"fragment {name}: called with ({got}), body takes ({want})")
    jcore.check_jaxpr(jaxpr.jaxpr)
    return list(jaxpr.out_avals), jaxpr.effects


fragment_p.def_impl(_fragment_impl)
fragment_p.def_effectful_abstract_eval(_fragment_abstract_eval)
pe.dce_rules[fragment_p] = _fragment_dce
compat.custom_typechecks[fragment_p] = _fragment_typecheck
mlir.register_lowering(fragment_p, mlir.lower_fun(_fragment_impl, multiple_results=True))


# ------------------------------------------------------------------ transfer


class Carries(enum.StrEnum):
    """What a transferred value is, for the transfer report: a value crossing a stage
    marker (``ACTIVATION`` forward, ``COTANGENT`` backward), one computed from program
    inputs alone (``STATE``: parameters, optimizer state), or anything else."""

    ACTIVATION = "activation"
    COTANGENT = "cotangent"
    STATE = "state"
    OTHER = "other"

    def __repr__(self) -> str:
        # (Printed inside a transfer's parameters as the text it stands for.)
        return repr(self.value)


transfer_p = jcore.Primitive("transfer")
transfer_p.multiple_results = True


def _transfer_typecheck(_ctx_factory, *in_atoms, src, dst, src_specs, dst_specs, carries):
    if not len(in_atoms) == len(src_specs) == len(dst_specs) == len(carries):
        raise jcore.JaxprTypeError(
            f"transfer mesh{src}->mesh{dst}: {len(in_atoms)} values but "
            f"{len(src_specs)} source and {len(dst_specs)} destination specs, {len(carries)} kinds"
        )
    if src == dst:
        raise jcore.JaxprTypeError(f"transfer from mesh{src} to itself")
    return [a.aval for a in in_atoms], jcore.no_effects


transfer_p.def_impl(lambda *xs, **_: list(xs))
transfer_p.def_abstract_eval(lambda *avals, **_: list(avals))
pe.dce_rules[transfer_p] = _elementwise_dce(("src_specs", "dst_specs", "carries"))
compat.custom_typechecks[transfer_p] = _transfer_typecheck
mlir.register_lowering(transfer_p, lambda ctx, *args, **_: list(args))


custom_rules.RULES.mark = lambda x, stage, transpose: _bind_nonzero(
    stage_p, [x], stage=stage, transpose=transpose
)[0]
