"""The pass registry, the default pipeline and the runner that applies it.

Stage names are ``input`` (the traced program) and ``after-<pass>`` for each pass;
the ``lower`` pass's result is called ``stablehlo``. Before running a pipeline the
runner checks every pass's contract (:class:`~mpmdc.passes.base.Property`) over it.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import os
from collections.abc import Callable, Iterable
from typing import Protocol

from mpmdc import backends
from mpmdc._text import split_top_level
from mpmdc.errors import InternalError, MpmdcError, PassError
from mpmdc.ir.program import Phase, Program
from mpmdc.passes import PASSES, FunctionPass, Property, pass_from_text
from mpmdc.passes.vma_typecheck import verify as verify_program


class Pass(Protocol):
    """What the runner needs of a pass (a registered ``FunctionPass`` or a user's own).

    A pass may also declare its contract as ``requires``, ``produces`` and
    ``invalidates``, collections of :class:`~mpmdc.passes.base.Property`; one that declares
    none requires nothing and changes no property.
    """

    name: str
    summary: str

    def run(self, program: Program) -> Program: ...


DEFAULT_PIPELINE: tuple[str, ...] = (
    "plan",  # first: the stages and schedule every later pass works to
    "inline",  # first: markers hidden in nested jit/custom_vjp calls must be visible
    "split-scans",  # needs top-level scans; a stage per group of a layer stack's iterations
    "cond-fission",  # before placement: an optimizer in one cond must not land on one mesh
    "slice-stacks",  # needs the per-stage scans, and conds cut: a stack's conditional alone
    "dce",  # before placement: dead work must not decide where a value lives
    "partition",  # needs every marker at top level; decides stage and mesh per equation
    "vma-typecheck",  # checks types, specs against the chosen meshes, shard_map meshes
    "split",  # cuts the checked, placed program into fragments and transfers
    "split-backward",  # needs fragments; zero-bubble schedules run a backward as I and W
    "schedule",  # needs the loop's fragments; stamps them out, orders them as the schedule says
    "donate",  # needs the final order of calls: a buffer goes to its last reader
    "lower",  # last: StableHLO per fragment
)


def default_pipeline(backend: str | None = None) -> tuple[str, ...]:
    """The default pipeline for programs lowered by ``backend``: for a backend whose
    transfers are in-program, ``in-program-transfers`` comes right before ``lower`` (it
    needs the final order of calls, and ``lower`` emits the send/recv pairs it makes)."""
    if backend is None or backends.get(backend).transfers is not backends.TransferMode.IN_PROGRAM:
        return DEFAULT_PIPELINE
    return (*DEFAULT_PIPELINE[:-1], "in-program-transfers", DEFAULT_PIPELINE[-1])


def stage_name(pass_name: str) -> str:
    """The dump-stage name of the program after ``pass_name``."""
    return "stablehlo" if pass_name == "lower" else f"after-{pass_name}"


def stage_names(
    passes: Iterable[str | Pass] | str | None, backend: str | None = None
) -> tuple[str, ...]:
    """The dump stages a pipeline of ``passes`` (as :func:`resolve` takes them, for
    ``backend``) gives a traced program, known without running it: ``input``, then one
    per pass of :func:`with_plan`'s pipeline."""
    return ("input", *(stage_name(p.name) for p in with_plan(resolve(passes, backend))))


def resolve(passes: Iterable[str | Pass] | str | None, backend: str | None = None) -> list[Pass]:
    """Pass objects for pass objects or texts (``name`` or ``name{option=value}``), or for
    one comma-separated text of them; ``None`` is the default pipeline for ``backend``
    (:func:`default_pipeline`)."""
    if passes is None:
        passes = default_pipeline(backend)
    elif isinstance(passes, str):
        passes = _split_pipeline_text(passes)
    return [pass_from_text(p) if isinstance(p, str) else p for p in passes]


def with_plan(passes: list[Pass]) -> list[Pass]:
    """``passes`` as they run on a traced program: the ``plan`` pass first where they lack
    it (every later pass works to the stages and schedule it decides), and its trial run
    (its option ``through``, where not given) their own passes from it up to ``split``."""
    passes = list(passes)
    planners = [i for i, p in enumerate(passes) if p.name == "plan"]
    if len(planners) > 1:
        raise PassError(
            f"the pipeline runs `plan` {len(planners)} times (passes number "
            f"{', '.join(str(i + 1) for i in planners)}); a program is planned once, first: "
            f"keep one."
        )
    if not planners:
        passes.insert(0, PASSES["plan"])
    i = planners[0] if planners else 0
    first = passes[i]
    ends = [j for j in range(i + 1, len(passes)) if passes[j].name == "split"]
    if not isinstance(first, FunctionPass) or "through" in dict(first.options) or not ends:
        return passes
    through = tuple(map(_as_text, passes[i + 1 : ends[0] + 1]))
    if through != default_trial():
        passes[i] = first.with_options(through=through)
    return passes


def default_trial() -> tuple[str, ...]:
    """The default pipeline's passes after ``plan`` up to ``split``: what the ``plan``
    pass estimates on unless told otherwise."""
    start = DEFAULT_PIPELINE.index("plan") + 1
    return DEFAULT_PIPELINE[start : DEFAULT_PIPELINE.index("split") + 1]


def _as_text(p: Pass) -> str | Pass:
    """A registered pass as its text (``lower{backend=tpu}``); any other as it is."""
    registered = PASSES.get(p.name)
    if isinstance(p, FunctionPass) and registered is not None and registered.body is p.body:
        return str(p)
    return p


def _split_pipeline_text(text: str) -> list[str]:
    """``"a,b{x=1,y=2},c"`` as ``["a", "b{x=1,y=2}", "c"]`` (commas inside braces stay)."""
    try:
        items = split_top_level(text, "{}")
    except ValueError:
        raise PassError(f"unbalanced braces in the pass list {text!r}.") from None
    return [item for item in items if item.strip()]


_VERIFYING = contextvars.ContextVar("mpmdc_verifying", default=False)


def verification_requested() -> bool:
    """Whether the pipeline verifies every pass's output: with ``MPMDC_VERIFY=1`` (the
    test suite sets it) or inside :func:`verifying` (``mpmdc dump`` is)."""
    return _VERIFYING.get() or os.environ.get("MPMDC_VERIFY") == "1"


@contextlib.contextmanager
def verifying():
    """Verify every pass's output of the pipelines run inside this block."""
    token = _VERIFYING.set(True)
    try:
        yield
    finally:
        _VERIFYING.reset(token)


def run_pipeline(
    program: Program,
    passes: Iterable[Pass],
    callback: Callable[[str, Program], None] | None = None,
    *,
    verify: bool | None = None,
) -> Program:
    """Apply ``passes`` in order, calling ``callback(stage_name, program)`` after each.

    First :func:`check_contracts`: a pipeline whose passes would not get what they require
    is a ``PassError`` before any of it runs.
    With ``verify`` (default: :func:`verification_requested`) every pass's output is
    also checked by :func:`verify_program`, JAX's ``check_jaxpr`` included. A pass that raises
    something other than an ``MpmdcError`` or a warning (which the caller's warning
    filters turned into an error), or whose output fails verification, is an
    ``InternalError`` naming the pass and the stage of the program it got.
    """
    passes = list(passes)
    check_contracts(program, passes)
    if verify is None:
        verify = verification_requested()
    if callback is not None:
        callback("input", program)
    stage = "input"
    with cycles_collected_after():
        for p in passes:
            try:
                result = p.run(program)
            except (MpmdcError, Warning):  # (a warning the caller's filters made an error)
                raise
            except Exception as err:
                raise _internal(p, stage, program, f"it raised {_summary(err)}") from err
            if verify:
                try:
                    verify_program(result)
                except MpmdcError as err:
                    raise _internal(
                        p, stage, program, f"its output fails verification: {_summary(err)}"
                    ) from err
            program, stage = result, stage_name(p.name)
            if callback is not None:
                callback(stage, program)
    return program


# The properties a program of each phase has (``scheduled`` also without a schedule).
_PHASE_PROPERTIES: dict[Phase, frozenset[Property]] = {
    Phase.TRACED: frozenset(),
    Phase.PLANNED: frozenset({Property.PLANNED}),
    Phase.PLACED: frozenset({Property.PLANNED, Property.INLINED, Property.PLACED}),
    Phase.SPLIT: frozenset({Property.PLANNED, Property.INLINED, Property.SPLIT}),
    Phase.SCHEDULED: frozenset(
        {Property.PLANNED, Property.INLINED, Property.SPLIT, Property.SCHEDULED}
    ),
    Phase.LOWERED: frozenset(
        {Property.PLANNED, Property.INLINED, Property.SPLIT, Property.SCHEDULED, Property.LOWERED}
    ),
}


def properties_of(program: Program) -> frozenset[Property]:
    """The properties ``program`` is known to have, from its phase (a program with no
    schedule to apply, neither chosen nor asked for, is ``scheduled`` too)."""
    have = _PHASE_PROPERTIES[program.phase]
    request = program.plan_request
    if program.schedule is None and (request is None or request.schedule is None):
        have |= {Property.SCHEDULED}
    return have


def _contract(p: Pass, field: str) -> frozenset[Property]:
    return frozenset(getattr(p, field, ()))


def check_contracts(program: Program, passes: list[Pass]) -> None:
    """Raise a ``PassError`` for the first of ``passes`` that would get ``program`` (as the
    passes before it leave it) without a property it requires; run nothing."""
    have = set(properties_of(program))
    made_by: dict[Property, int] = {}  # property -> index of the pass that last made it
    undone_by: dict[Property, int] = {}  # property -> index of the pass that last undid it
    for i, p in enumerate(passes):
        missing = [prop for prop in Property if prop in _contract(p, "requires") - have]
        if missing:  # the first in pipeline order, so the fix named is the first to make
            prop = missing[0]
            raise _unmet(passes, i, prop, made_by.get(prop), undone_by.get(prop))
        for prop in _contract(p, "invalidates"):
            have.discard(prop)
            undone_by[prop] = i
        for prop in _contract(p, "produces"):
            have.add(prop)
            made_by[prop] = i
            undone_by.pop(prop, None)


def _unmet(passes, i: int, prop: Property, made: int | None, undone: int | None) -> PassError:
    """The error for pass ``i`` of ``passes`` missing ``prop``, which pass ``made`` (if any)
    made and pass ``undone`` (if any) undid."""
    name = passes[i].name
    providers = " or ".join(f"`{n}`" for n, q in PASSES.items() if prop in q.produces)
    head = f"pass `{name}` (number {i + 1} in the pipeline) requires `{prop}`: {prop.meaning}. "
    if undone is not None and made is not None:
        maker = f"`{passes[made].name}`"
        undoer = passes[undone].name
        if undoer == name:
            fix = f"run `{name}` once"
        else:
            fix = f"run `{undoer}` before {maker}, or leave it out"
        return PassError(
            f"{head}{maker} provides it, but pass number {undone + 1}, `{undoer}`, undoes it: "
            f"{fix}."
        )
    if not providers:
        return PassError(f"{head}No registered pass provides it; leave `{name}` out.")
    first = providers.split(" or ")[0]
    return PassError(
        f"{head}{providers} provides it, and no pass before `{name}` does: put {first} before "
        f"it (the default pipeline is {', '.join(DEFAULT_PIPELINE)})."
    )


@contextlib.contextmanager
def cycles_collected_after():
    """Hold off Python's cyclic garbage collector until the block ends.

    Tracing and the passes allocate millions of small objects and free them by
    reference counting; the collector's repeated scans of them (and of everything
    JAX holds) took a quarter of the passes' time (57 vs 78 microseconds per equation
    on a 100k-equation program) and about 0.3 s of the 8-layer step's ``lower()``.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _summary(err: Exception, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _internal(p: Pass, stage: str, program: Program, what: str) -> InternalError:
    return InternalError(
        f"internal error in pass `{p.name}`, run on the program {stage!r}: {what}. This is a "
        f"bug in mpmdc (or in the pass, if you wrote it), not in your program. Please report "
        f"it with this message and the program the pass got: `mpmdc dump FILE.py:TARGET "
        f"--stage all` prints it (in Python: the error's `.program.as_text()`).",
        p.name,
        stage,
        program,
    )
