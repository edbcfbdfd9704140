"""The IR every pass reads and writes: a ``ClosedJaxpr`` plus a little side data.

A program says which :class:`Phase` it is in, and has the fields of that phase and
the phases before it, never those of a later one (:data:`MADE_BY`). Before ``split``
the jaxpr is the traced program; after ``partition`` each equation carries its
placement (stage, transpose count, microbatch) in its own context metadata, so it
travels with the equation through every rewrite (JAX's DCE rules rebuild equations
and keep their context). After ``split`` the top-level equations are only
``fragment`` and ``transfer`` (and a rolled loop's edges, until ``schedule``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as jprims
from jax.sharding import Mesh, PartitionSpec

from mpmdc import _jax_compat as compat
from mpmdc.errors import StageError
from mpmdc.ir.primitives import LOOP, ActionKind, fragment_p


@dataclass(frozen=True)
class Placement:
    """Where one equation runs: pipeline stage, transpose count (0 forward, 1 backward...)
    and, inside an ``mpmdc.accumulate`` loop, the microbatch (``None`` outside one;
    ``LOOP`` inside a rolled loop's one iteration, which stands for every microbatch)."""

    stage: int
    transpose: int
    microbatch: int | str | None = None

    @property
    def kind(self) -> ActionKind:
        """The schedule action kind: ``F`` for forward work, ``B`` for backward."""
        return ActionKind.F if self.transpose % 2 == 0 else ActionKind.B

    @property
    def label(self) -> str:
        """Short deterministic name, e.g. ``s2_fwd``, ``s1_bwd`` or ``s1_bwd_mb3``."""
        kind = {0: "fwd", 1: "bwd"}.get(self.transpose, f"t{self.transpose}")
        if self.microbatch is None:
            mb = ""
        elif self.microbatch == LOOP:
            mb = "_loop"
        else:
            mb = f"_mb{self.microbatch}"
        return f"s{self.stage}_{kind}{mb}"

    def order_key(self) -> tuple[int, int, int]:
        """Pipeline execution order: forward stages ascending, then backward descending;
        work outside a microbatch loop before the loop's microbatches."""
        stage = self.stage if self.transpose % 2 == 0 else -self.stage
        if self.microbatch is None:
            microbatch = -1
        else:
            microbatch = 0 if self.microbatch == LOOP else self.microbatch
        return (self.transpose, stage, microbatch)


_PLACEMENT_KEY = "mpmdc.placement"


def placement_of(eqn) -> Placement | None:
    """The placement recorded on ``eqn`` (``None`` before ``partition`` and after ``split``)."""
    metadata = eqn.ctx.xla_metadata
    return metadata.get(_PLACEMENT_KEY) if metadata else None


_REMAT_KEY = "mpmdc.remat"


def placed(eqn, placement: Placement | None, **changes):
    """``eqn`` with ``changes`` recording ``placement`` (``None``: with no placement, as
    in a fragment body). Placing it drops the mark :func:`rematerialized` left, which only
    placement reads."""
    metadata = eqn.ctx.xla_metadata or {}
    if metadata.get(_PLACEMENT_KEY) != placement or _REMAT_KEY in metadata:
        changes["ctx"] = _placed_context(eqn.ctx, placement)
    return eqn.replace(**changes) if changes else eqn


@functools.lru_cache(maxsize=4096)
def _placed_context(ctx, placement: Placement | None):
    # (JAX interns contexts: a program's equations share a few, one per placement.)
    return compat.with_metadata(ctx, {_PLACEMENT_KEY: placement, _REMAT_KEY: None})


compat.register_cache(_placed_context, "mpmdc: equation contexts with placements")


def is_rematerialized(eqn) -> bool:
    """True for an equation ``inline`` took out of a ``jax.checkpoint`` body."""
    metadata = eqn.ctx.xla_metadata
    return bool(metadata and metadata.get(_REMAT_KEY))


def rematerialized(eqn, flag: bool):
    """``eqn`` recording whether it came out of a ``jax.checkpoint`` body."""
    if is_rematerialized(eqn) == flag:
        return eqn
    return eqn.replace(ctx=compat.with_metadata(eqn.ctx, {_REMAT_KEY: True if flag else None}))


@dataclass(frozen=True)
class PlanRequest:
    """What a traced program asks the ``plan`` pass to decide, as the user wrote it:
    ``schedule``, the microbatch loop's schedule (an ``mpmdc.schedules`` schedule, or a
    chooser such as ``"auto"`` that picks one from the pipeline's estimated costs;
    ``None`` without a loop), ``schedule_from``, the user's line that gave it where that
    is an ``mpmdc.accumulate`` call (``""``: ``mpmdc.compile(schedule=)``), and
    ``balanced``, whether the marked segments are grouped into stages
    (``partition="balanced"`` or a layer stack's ``every="balanced"``)."""

    schedule: object = None
    schedule_from: str = ""
    balanced: bool = False

    def describe(self) -> str:
        """One line: what is asked."""
        asked = [f"schedule {self.schedule!r}"] if self.schedule is not None else []
        asked += ["stages balanced from the marked segments"] if self.balanced else []
        return "; ".join(asked) or "nothing"


@dataclass(frozen=True)
class LoopSchedule:
    """How a microbatch loop's work is ordered, as plain data: the schedule's ``name``
    (what printed it), the pipeline's layout (stages and the mesh of each) and each
    mesh's actions in order, as text (``0F3``: stage 0's forward of microbatch 3;
    ``mpmdc.schedules.actions_of`` parses them)."""

    name: str
    stage_to_mesh: tuple[int, ...]
    actions: tuple[tuple[str, ...], ...]
    choice: ScheduleChoice | None = None  # why ``schedule="auto"`` (or a function) chose it


@dataclass(frozen=True)
class ScheduleChoice:
    """What a schedule chosen from the pipeline's costs (``schedule="auto"``) is predicted
    to do, as plain data: ``step_time`` (seconds a step takes, steps back to back),
    ``bubble`` (idle seconds per mesh and step), ``peak_memory`` (bytes of activations
    each mesh holds at most) and ``considered``: ``(schedule, step time or None, why not)``
    for every candidate."""

    name: str
    step_time: float
    bubble: float
    peak_memory: tuple[float, ...]
    considered: tuple[tuple[str, float | None, str], ...]

    def describe(self, candidates: int = 4) -> list[str]:
        """The choice and its prediction, then the best ``candidates`` others."""
        peaks = ", ".join(f"{b / 1e6:.4g}" for b in self.peak_memory)
        lines = [
            f"chose {self.name}: step {self.step_time * 1e3:.4g} ms, bubble "
            f"{self.bubble * 1e3:.4g} ms per mesh, peak activations per mesh [{peaks}] MB"
        ]
        others = [c for c in self.considered if c[0] != self.name]
        for name, step, why in others[:candidates]:
            lines.append(f"  {name}: " + (f"step {step * 1e3:.4g} ms" if step is not None else why))
        if len(others) > candidates:
            lines.append(f"  ({len(others) - candidates} more candidates)")
        return lines


@dataclass(frozen=True)
class SegmentCost:
    """One marked segment's estimated work and memory (``partition="balanced"``).

    ``forward``/``backward``: seconds of its forward and backward per microbatch (the
    update after the loop spread over the microbatches); ``held``: bytes it keeps live
    all step (the inputs it reads: parameters, optimizer state); ``activations``: bytes its
    forward keeps for its backward, per microbatch.
    """

    forward: float
    backward: float
    held: int = 0
    activations: int = 0


@dataclass(frozen=True)
class StagePlan:
    """How marked segments were grouped into stages (``partition="balanced"``), as plain
    data: ``groups[s]`` is stage ``s``'s consecutive segments, ``predicted[s]`` its
    estimated seconds per microbatch (compute plus transfers in and out), ``segments``
    every segment's :class:`SegmentCost`."""

    groups: tuple[tuple[int, ...], ...]
    predicted: tuple[float, ...]
    segments: tuple[SegmentCost, ...]

    def stage_of(self, segment: int) -> int:
        """The stage segment ``segment`` runs in."""
        return next(s for s, group in enumerate(self.groups) if segment in group)

    def describe(self) -> list[str]:
        """One line per stage: its segments and its predicted time."""
        lines = []
        for s, (group, seconds) in enumerate(zip(self.groups, self.predicted)):
            span = f"{group[0]}" if len(group) == 1 else f"{group[0]}-{group[-1]}"
            lines.append(f"stage {s}: segments {span}, predicted {seconds * 1e3:.4g} ms")
        return lines


@dataclass(frozen=True)
class Piece:
    """What one program input (or output) is of the caller's flat argument (or result)
    ``leaf``: all of it (``rows`` is ``None``), or the rows ``lo:hi`` along ``axis`` of a
    stacked array held in pieces, ``rows = (axis, lo, hi)``."""

    leaf: int
    rows: tuple[int, int, int] | None = None


class Phase(enum.IntEnum):
    """How far through compilation a program is, set by the pass that takes it there.

    Phases are ordered (``program.phase >= Phase.SPLIT``); each promises what the one
    before it did and more. ``TRACED``: the traced program, with what it asks the
    planner for (``plan_request``). ``PLANNED`` (``plan``): its stages grouped as asked
    and its microbatch loop's schedule chosen (the passes before ``partition`` keep it
    planned). ``PLACED`` (``partition``): every top-level equation placed, every
    input and output on a mesh. ``SPLIT`` (``split``): top-level equations are fragments,
    transfers and a rolled loop's edges, every input and output has its spec.
    ``SCHEDULED`` (``schedule``): the loop stamped out, the calls in the order they run.
    ``LOWERED`` (``lower``): a StableHLO module per distinct fragment.
    """

    TRACED = 0
    PLANNED = 1
    PLACED = 2
    SPLIT = 3
    SCHEDULED = 4
    LOWERED = 5

    def __str__(self) -> str:
        return self.name.lower()


# The optional fields that exist only from a phase on: ``None`` before it, set from it.
MADE_BY: dict[str, Phase] = {
    "in_meshes": Phase.PLACED,
    "out_meshes": Phase.PLACED,
    "module_keys": Phase.LOWERED,
    "lowerings": Phase.LOWERED,
}


@dataclass(frozen=True)
class Program:
    """A program between two passes.

    ``phase`` says how far through compilation it is (:class:`Phase`); the fields in
    :data:`MADE_BY` are ``None`` before the phase that makes them.
    ``in_specs``/``out_specs`` are flat, one per jaxpr input/output: the
    ``PartitionSpec`` *inside* whichever mesh holds the value (``P()`` replicated), or
    ``None`` where none is chosen yet (neither the caller nor a committed argument gave
    one); ``split`` chooses every one, so from ``Phase.SPLIT`` on none is ``None``.
    ``in_paths``/``out_paths`` name each flat input/output for error messages.
    ``in_pieces``/``out_pieces`` say which argument (result) each input (output) is, or
    which rows of it (``slice-stacks`` holds stacked arrays in pieces); ``None``: input
    (output) ``i`` is argument (result) ``i``.
    """

    jaxpr: jcore.ClosedJaxpr
    meshes: tuple[Mesh, ...]
    stage_to_mesh: tuple[int, ...] | None
    in_specs: tuple[PartitionSpec | None, ...]
    out_specs: tuple[PartitionSpec | None, ...]
    in_paths: tuple[str, ...]
    out_paths: tuple[str, ...]
    donated: tuple[bool, ...]
    backend: str
    phase: Phase = Phase.TRACED
    in_meshes: tuple[int, ...] | None = None
    out_meshes: tuple[int, ...] | None = None
    # per output, the mesh the caller asked for (``compile(out_shardings=...)``) or None
    wanted_out_meshes: tuple[int | None, ...] | None = None
    # (first fragment's name, ``fragment_key``) per distinct module, once lowered for ``backend``
    module_keys: tuple[tuple[str, tuple], ...] | None = dataclasses.field(default=None, repr=False)
    schedule: LoopSchedule | None = None  # of the program's ``mpmdc.accumulate`` loop, if any
    microbatches: int | None = None
    in_pieces: tuple[Piece, ...] | None = None
    out_pieces: tuple[Piece, ...] | None = None
    # the stacked arrays ``slice-stacks`` kept whole, as ``(input positions, output
    # positions)`` per stack, shape and dtype: an output of a group is the next value of
    # an input of it, which a training loop feeds back; ``partition`` pairs the one left
    # of each when it has paired the others by their paths (a bare array has none)
    stack_feedback: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None = None
    stage_plan: StagePlan | None = None  # how ``partition="balanced"`` grouped the segments
    # what the ``plan`` pass is to decide; ``None`` once it has (from ``Phase.PLANNED`` on)
    plan_request: PlanRequest | None = None
    # per caller argument leaf, the mesh it was committed to when traced (``None``: not
    # committed; a tuple of device ids: committed to devices no one mesh holds): one
    # read elsewhere moves before every call
    arg_meshes: tuple[int | tuple[int, ...] | None, ...] | None = None
    # per caller argument leaf committed to devices of several meshes, the block each
    # device holds, ``((device id, ((start, stop) per dimension)), ...)`` (else ``None``):
    # which rows of a stack are where
    arg_blocks: tuple[tuple | None, ...] | None = None
    # per caller argument leaf, whether its spec in ``in_specs`` is its own committed
    # sharding's (not the caller's ``in_specs``): ``partition`` keeps such a spec only
    # where the mesh reading the argument has its axes, as the mesh it was committed to
    committed_specs: tuple[bool, ...] | None = None
    # ``fragment_key`` -> ``jax.stages.Lowered`` for ``backend``, kept by ``lower`` for the runtime
    lowerings: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def modules(self) -> tuple[tuple[str, str], ...] | None:
        """``(fragment name, StableHLO text)`` per distinct module, ``None`` before ``lower``.

        Printed when asked, not by ``lower``: the call path never reads the text.
        """
        if self.phase is not Phase.LOWERED:
            return None
        return tuple((name, self.lowerings[key].as_text()) for name, key in self.module_keys)

    def replace(self, **changes) -> Program:
        """A copy with ``changes`` applied (programs are immutable)."""
        return dataclasses.replace(self, **changes)

    def with_eqns(self, eqns) -> Program:
        """A copy whose top-level equations are ``eqns`` (same inputs, outputs, constants)."""
        jaxpr = self.jaxpr.jaxpr
        closed = make_closed_jaxpr(
            jaxpr.constvars,
            self.jaxpr.consts,
            jaxpr.invars,
            jaxpr.outvars,
            list(eqns),
            jaxpr.debug_info,
        )
        return self.replace(jaxpr=closed)

    def argument_leaf(self, k: int) -> int:
        """The caller's flat argument leaf that program input ``k`` is (or rows of)."""
        return k if self.in_pieces is None else self.in_pieces[k].leaf

    def mesh_of_stage(self, stage: int, eqn=None) -> int:
        """The mesh index stage ``stage`` runs on."""
        if self.stage_to_mesh is None:
            return stage % len(self.meshes)
        if stage >= len(self.stage_to_mesh):
            where = f" (marker at {compat.source_line(eqn)})" if eqn is not None else ""
            raise StageError(
                f"stage {stage}{where} has no entry in stage_to_mesh, which maps stages "
                f"0..{len(self.stage_to_mesh) - 1}; give it one mesh index per stage."
            )
        return self.stage_to_mesh[stage]

    @property
    def placements(self) -> tuple[Placement | None, ...] | None:
        """Each top-level equation's placement, read off the equations; ``None`` except
        in ``Phase.PLACED``."""
        if self.phase is not Phase.PLACED:
            return None
        return tuple(placement_of(eqn) for eqn in self.jaxpr.jaxpr.eqns)

    def phase_problems(self) -> list[str]:
        """What does not hold of the fields its phase promises: a field of
        :data:`MADE_BY` set before its phase or missing from it on, per-input and
        per-output fields of the wrong length, a spec not chosen from ``split`` on."""
        problems = []
        for field, made_by in MADE_BY.items():
            value = getattr(self, field)
            if self.phase < made_by and value is not None:
                problems.append(f"`{field}` is set, but a {self.phase} program has none yet")
            elif self.phase >= made_by and value is None:
                problems.append(f"`{field}` is missing, though a {self.phase} program has it")
        if self.phase >= Phase.PLANNED and self.plan_request is not None:
            problems.append(
                f"`plan_request` is set, but a {self.phase} program has no request left"
            )
        jaxpr = self.jaxpr.jaxpr
        for side, count in (("in", len(jaxpr.invars)), ("out", len(jaxpr.outvars))):
            for field in (f"{side}_specs", f"{side}_paths", f"{side}_meshes"):
                value = getattr(self, field)
                if value is not None and len(value) != count:
                    problems.append(
                        f"`{field}` has {len(value)} entries for a jaxpr of {count} {side}put(s)"
                    )
            specs = getattr(self, f"{side}_specs")
            if self.phase >= Phase.SPLIT and any(s is None for s in specs):
                problems.append(f"`{side}_specs` has an entry not chosen, after `split`")
        return problems

    def as_text(self) -> str:
        """Deterministic text: meshes, inputs, equations (with placements), outputs."""
        return format_program(self)


# ------------------------------------------------------------- building jaxprs


def nbytes(aval) -> int:
    """Bytes of an array of type ``aval`` (a PRNG key counts its key data's size)."""
    return math.prod(aval.shape) * getattr(aval.dtype, "itemsize", 4)


_Var = jcore.Var


def is_var(atom) -> bool:
    """True for a jaxpr variable (not a literal, not a dropped output)."""
    # Passes ask this millions of times: the exact-type test answers the common case.
    return type(atom) is _Var or (isinstance(atom, _Var) and not isinstance(atom, jcore.DropVar))


def vars_of(atoms: Sequence) -> list:
    """The variables among ``atoms`` (literals and dropped outputs left out)."""
    return [a for a in atoms if type(a) is _Var or is_var(a)]


def fresh_like(var):
    """A new variable of the same type (``DropVar`` stays a ``DropVar``)."""
    if isinstance(var, jcore.DropVar):
        return var
    return compat.Var(var.aval)


def substituted(atoms: Sequence, env: dict) -> list:
    """``atoms`` with every variable replaced by ``env``'s binding, where it has one."""
    return [env.get(a, a) if type(a) is _Var or is_var(a) else a for a in atoms]


def _renaming(eqn, env: dict) -> dict:
    """``eqn``'s inputs renamed through ``env`` and fresh outputs (recorded in ``env``),
    as changes for ``eqn.replace``."""
    outvars = [fresh_like(v) for v in eqn.outvars]
    env.update({old: new for old, new in zip(eqn.outvars, outvars) if is_var(old)})
    return {"invars": substituted(eqn.invars, env), "outvars": outvars}


def copy_eqn(eqn, env: dict, **changes):
    """Copy ``eqn`` with inputs renamed through ``env`` and fresh outputs recorded in ``env``."""
    return eqn.replace(**_renaming(eqn, env), **changes)


def derived_eqn(primitive, invars, outvars, params, like):
    """A new effect-free, unplaced equation with ``like``'s source line and context (work a
    pass writes for an equation of the user's: its slices, its pieces, a marker)."""
    eqn = jcore.new_jaxpr_eqn(
        list(invars), list(outvars), primitive, params, jcore.no_effects, like.source_info, like.ctx
    )
    return placed(eqn, None)


def make_closed_jaxpr(constvars, consts, invars, outvars, eqns, debug_info=None, name="fragment"):
    """Assemble a ``ClosedJaxpr`` whose effects are the union of its equations'.

    Without ``debug_info`` one is made up naming ``name``'s arguments and results.
    """
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else jcore.no_effects
    if debug_info is None:
        debug_info = jcore.DebugInfo(
            "mpmdc",
            name,
            tuple(f"arg{i}" for i in range(len(invars))),
            tuple(f"result{i}" for i in range(len(outvars))),
        )
    jaxpr = jcore.Jaxpr(
        list(constvars), list(invars), list(outvars), list(eqns), effects, debug_info
    )
    return jcore.ClosedJaxpr(jaxpr, list(consts))


def sub_jaxpr(eqns, outputs, const_values: dict, name: str):
    """``eqns`` as a closed jaxpr of their own, with fresh variables, returning ``outputs``.

    Its inputs are the variables ``eqns`` and ``outputs`` read but ``eqns`` do not
    define, in first-read order; those in ``const_values`` become bound constants.
    Its equations carry no placements or remat marks (JAX would lower them as
    attributes). Returns ``(inputs, closed_jaxpr)`` with ``inputs`` the outer
    variables to pass in.
    """
    defined = {v for e in eqns for v in e.outvars if is_var(v)}
    inputs, consts = {}, {}  # (dicts as ordered sets)
    for a in [a for e in eqns for a in vars_of(e.invars)] + vars_of(outputs):
        if a not in defined:
            (consts if a in const_values else inputs)[a] = None
    inputs, consts = list(inputs), list(consts)
    env = {v: fresh_like(v) for v in inputs + consts}
    inner_eqns = [placed(e, None, **_renaming(e, env)) for e in eqns]
    closed = make_closed_jaxpr(
        [env[c] for c in consts],
        [const_values[c] for c in consts],
        [env[v] for v in inputs],
        substituted(outputs, env),
        inner_eqns,
        name=name,
    )
    return inputs, closed


# ------------------------------------------------------- fragment identity

# Parameters a primitive's lowering never reads (rules used only when differentiating):
# they do not make two bodies compute different things.
PARAMS_LOWERING_IGNORES: dict = {
    jprims.custom_jvp_call_p: frozenset({"jvp_jaxpr_fun"}),
    jprims.custom_vjp_call_p: frozenset({"fwd_jaxpr_thunk", "bwd", "out_trees"}),
}


def _hashable(value):
    """``value`` where it can be hashed (compared by equality), else its identity."""
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _scalar_bits(value) -> tuple:
    """A scalar literal by its dtype and bits: a Python number, NumPy scalar or 0-d
    ``jax.Array`` (which cannot be hashed) of one value compare equal, NaN included."""
    host = np.asarray(value)
    return (host.dtype.str, host.tobytes())


# Parameter types compared by equality, with their type (no jaxpr inside, always hashable).
_PLAIN_PARAMS = frozenset({int, bool, str, type(None)})


def _param_key(value, out: list) -> None:
    """Append to ``out`` an account of parameter ``value``: a jaxpr by its structure,
    the constants of a closed one by identity, other values by equality where they are
    hashable, else by identity (callbacks, arrays)."""
    kind = type(value)
    if kind in _PLAIN_PARAMS:  # (most parameters: checked first, by exact type)
        out.append((kind, value))  # (with its type: 1, 1.0 and True are equal in Python)
    elif kind is float or isinstance(value, np.generic):
        out.append(_scalar_bits(value))  # (by its bits: 0.0 and -0.0 are equal in Python)
    elif isinstance(value, jcore.ClosedJaxpr):
        out.append(("consts", tuple(id(c) for c in value.consts)))
        _jaxpr_key(value.jaxpr, out)
    elif isinstance(value, jcore.Jaxpr):
        _jaxpr_key(value, out)
    elif isinstance(value, (tuple, list)):
        out.append(("items", len(value)))
        for item in value:
            _param_key(item, out)
    else:
        out.append(_hashable(value))


def _jaxpr_key(jaxpr: jcore.Jaxpr, out: list) -> None:
    """Append to ``out`` what ``jaxpr`` computes: the types of its constants and inputs,
    then per equation its primitive, operands (variables numbered as they are defined,
    literals by value), context, result types and parameters, then its outputs."""
    # (Written for speed: every fragment's body is walked once per lowering.)
    number: dict = {}

    def define(variables) -> tuple:
        for v in variables:
            number[v] = len(number)
        return tuple([v.aval for v in variables])

    def operands(atoms) -> tuple:
        return tuple([number[a] if type(a) is _Var else _operand(a, number) for a in atoms])

    out.append(define(jaxpr.constvars))
    out.append(define(jaxpr.invars))
    for eqn in jaxpr.eqns:
        ctx, params = eqn.ctx, eqn.params
        # (The metadata is a dict: keyed by its items, not by a temporary's identity.)
        metadata = ctx.xla_metadata
        metadata = (
            tuple([(k, _hashable(v)) for k, v in sorted(metadata.items())]) if metadata else ()
        )
        context = (_hashable(ctx.compute_type), ctx.threefry_partitionable, metadata)
        out.append((eqn.primitive, operands(eqn.invars), context, define(eqn.outvars)))
        if params:
            ignored = PARAMS_LOWERING_IGNORES.get(eqn.primitive, ())
            for name in sorted(params):
                if name not in ignored:
                    out.append(name)
                    _param_key(params[name], out)
    out.append(operands(jaxpr.outvars))


def _operand(atom, number: dict):
    """An operand that is not a plain variable: a literal by value (a scalar by its
    bits, an array by identity), or a variable of a subclass by its number."""
    if isinstance(atom, jcore.Literal):
        value = atom.val
        return (
            "literal",
            _scalar_bits(value) if not np.ndim(value) else ("id", id(value)),
            atom.aval,
        )
    return number[atom]


_BODY_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def body_key(body: jcore.ClosedJaxpr) -> tuple:
    """What a closed jaxpr computes, as a hashable key: equal keys compute the same.

    One walk over the body and the jaxprs nested in it (``_jaxpr_key``); its constants
    and opaque parameters (callbacks, arrays) count by identity. Printing the jaxpr
    would say as much but cost ten times more. Remembered per body object, since
    several passes ask.
    """
    if body not in _BODY_KEYS:
        key: list = []
        _param_key(body, key)
        _BODY_KEYS[body] = tuple(key)
    return _BODY_KEYS[body]


def fragment_key(eqn) -> tuple:
    """Fragments with equal keys lower to the same module and share one executable:
    the body's key, the mesh, the specs and the donated operands (everything the
    module depends on except its name)."""
    p = eqn.params
    return (body_key(p["jaxpr"]), p["mesh"], p["in_specs"], p["out_specs"], p["donate_argnums"])


def module_key(eqn, mesh) -> tuple:
    """Fragments with equal keys compile to one executable up to the devices it runs on:
    the :func:`fragment_key` with the mesh index replaced by ``mesh``'s axes (names,
    sizes and types), so identical stages on meshes of one shape share it."""
    body, _, *rest = fragment_key(eqn)
    return (body, tuple(mesh.shape.items()), tuple(getattr(mesh, "axis_types", ())), *rest)


# ----------------------------------------------------------------- printing


def _mesh_text(mesh: Mesh) -> str:
    return "{" + ", ".join(f"{n}={s}" for n, s in mesh.shape.items()) + "}"


def _spec_text(spec) -> str:
    # No spec (only before `split`): propagation has yet to choose one.
    return "P(auto)" if spec is None else str(spec)


def format_program(program: Program) -> str:
    """Render ``program`` as deterministic text (JAX's printer for each equation)."""
    ctx = compat.JaxprPpContext()
    settings = compat.JaxprPpSettings()
    jaxpr = program.jaxpr.jaxpr
    lines = [f"phase: {program.phase}", "meshes:"]
    lines += [f"  mesh{i} {_mesh_text(m)}" for i, m in enumerate(program.meshes)]
    if program.plan_request is not None:
        over = f" over {program.microbatches} microbatches" if program.microbatches else ""
        lines.append(f"requested: {program.plan_request.describe()}{over}")
    if program.schedule is not None:
        lines.append(f"schedule: {program.schedule.name} over {program.microbatches} microbatches")
        if program.schedule.choice is not None:
            lines += [f"  {line}" for line in program.schedule.choice.describe()]
    if program.stage_plan is not None:
        lines.append(f"stages balanced from {len(program.stage_plan.segments)} segments:")
        lines += [f"  {line}" for line in program.stage_plan.describe()]
    if program.jaxpr.consts:
        lines.append("consts:")
        for v in jaxpr.constvars:
            lines.append(f"  {compat.pp_var(v, ctx)}:{v.aval.str_short()}")
    lines.append("inputs:")
    for i, v in enumerate(jaxpr.invars):
        where = f" @mesh{program.in_meshes[i]}" if program.in_meshes is not None else ""
        lines.append(
            f"  {compat.pp_var(v, ctx)}:{v.aval.str_short()}{where} "
            f"{_spec_text(program.in_specs[i])}  # {program.in_paths[i]}"
        )
    lines.append("equations:")
    placements = program.placements
    for i, eqn in enumerate(jaxpr.eqns):
        text = compat.pp_eqn(eqn, ctx, settings).format()
        # (Before ``partition`` only the scans ``split-scans`` cut are placed.)
        if placements is not None:
            p = placements[i]
        else:
            p = placement_of(eqn) if program.phase < Phase.PLACED else None
        if p is not None:
            prefix = f"  [{p.label} @mesh{program.mesh_of_stage(p.stage)}] "
        else:
            prefix = "  "
        lines.append(prefix + text.replace("\n", "\n" + " " * len(prefix)))
    lines.append("outputs:")
    for i, v in enumerate(jaxpr.outvars):
        where = f" @mesh{program.out_meshes[i]}" if program.out_meshes is not None else ""
        name = compat.pp_var(v, ctx) if is_var(v) else str(v)
        lines.append(
            f"  {name}{where} {_spec_text(program.out_specs[i])}  # {program.out_paths[i]}"
        )
    if program.phase is Phase.LOWERED:
        lines.append(format_modules(program).rstrip("\n"))
    # Equations without operands print with a trailing blank; golden files should not.
    return "\n".join(line.rstrip() for line in "\n".join(lines).split("\n")) + "\n"


def format_modules(program: Program) -> str:
    """The StableHLO modules of a lowered program, each under a header naming the
    fragment it was lowered from, its mesh, and the fragments sharing it."""
    fragments = [e for e in program.jaxpr.jaxpr.eqns if e.primitive is fragment_p]
    sharing: dict = {}
    for eqn in fragments:
        sharing.setdefault(fragment_key(eqn), []).append(eqn.params["name"])
    by_name = {names[0]: (key, names) for key, names in sharing.items()}
    lines = []
    for name, text in program.modules:
        key, names = by_name[name]
        also = f", also {', '.join(names[1:])}" if len(names) > 1 else ""
        lines.append(f"// ----- fragment {name} @mesh{key[1]} ({program.backend}){also}")
        lines.append(text.rstrip("\n"))
    return "\n".join(lines) + "\n"


def find_eqns(eqns, predicate):
    """Yield every equation satisfying ``predicate`` among ``eqns`` and in their sub-jaxprs."""
    for eqn in eqns:
        if predicate(eqn):
            yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from find_eqns(sub.eqns, predicate)
