"""The public entry points, named as ``jax.stages``: ``compile`` returns a :class:`Wrapped`
function; ``trace`` gives a :class:`Traced`, ``lower`` a :class:`Lowered` (the IR after
every pass) and ``Lowered.compile`` the runtime's :class:`Compiled`.

``compile`` is lazy like ``jax.jit``: nothing is traced until the first call or
``lower``, and executables are cached per input signature (pytree structure,
shapes, dtypes and static arguments), so a second call with the same types does
not retrace.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mpmdc import backends, schedules
from mpmdc.balancing import balanced, wants_balancing
from mpmdc.errors import (
    AccumulateError,
    ArgumentError,
    IdleMeshWarning,
    OutputError,
    PassError,
    SpecError,
    StageError,
)
from mpmdc.estimates import pipeline_of
from mpmdc.ir.layers import layer_stages
from mpmdc.ir.primitives import BALANCED, fragment_p, is_marker
from mpmdc.ir.program import Phase, Program, find_eqns
from mpmdc.ir.pytrees import broadcast_prefix, skeleton
from mpmdc.ir.sharding import STAGES_AXIS, canonical_spec, spec_problem, within_stage
from mpmdc.ir.traffic import TransferReport, transfer_report
from mpmdc.passes import FunctionPass
from mpmdc.pipeline import cycles_collected_after, resolve, run_pipeline
from mpmdc.runtime.arguments import committed_mesh
from mpmdc.runtime.compiling import FragmentCompiler
from mpmdc.runtime.executable import Compiled, Signature, leaf_type
from mpmdc.runtime.executable_cache import DEFAULT_CACHE_SIZE, CacheInfo, ExecutableCache
from mpmdc.runtime.meshes import check_meshes
from mpmdc.runtime.transfers import is_here
from mpmdc.schedules.accumulate import recording_loops


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _normalize_argnums(argnums, what: str) -> tuple[int, ...]:
    if isinstance(argnums, int):
        argnums = (argnums,)
    try:
        out = tuple(int(a) for a in argnums)
    except TypeError:
        raise ArgumentError(
            f"{what} must be an int or a sequence of ints, got {argnums!r}."
        ) from None
    return out


def _normalize_argnames(argnames, what: str) -> tuple[str, ...]:
    if isinstance(argnames, str):
        argnames = (argnames,)
    try:
        out = tuple(argnames)
    except TypeError:
        out = (None,)
    if not all(isinstance(a, str) for a in out):
        raise ArgumentError(f"{what} must be a str or a sequence of str, got {argnames!r}.")
    return out


def _parameters(fn) -> list[inspect.Parameter] | None:
    """``fn``'s parameters, ``None`` for a callable without a signature to read."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _positional_names(params) -> list[str]:
    """The names of the parameters an argument may be passed to by position."""
    return [p.name for p in params or () if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _by_other_name(fn, params, argnums, argnames, what: str):
    """``(argnums, argnames)`` that ``argnames`` and ``argnums`` also mean, read from
    ``fn``'s ``params`` as ``jax.jit`` does: a parameter named in ``argnames`` is also
    static (or donated) when passed by position, one whose index is in ``argnums`` also
    when passed by keyword. A name ``fn`` takes no keyword argument by is an
    ``ArgumentError`` (unless it takes ``**kwargs``)."""
    if params is None:
        return (), ()
    positional = _positional_names(params)
    keyword = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [a for a in argnames if a not in keyword]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params):
        raise ArgumentError(
            f"{what} names {unknown}, but {getattr(fn, '__name__', 'the function')} takes no "
            f"keyword argument so named; its keyword parameters: {', '.join(keyword) or 'none'}."
        )
    nums = tuple(i for i, name in enumerate(positional) if name in argnames)
    names = tuple(
        positional[i]
        for i in argnums
        if -len(positional) <= i < len(positional) and positional[i] in keyword
    )
    return nums, names


def _check_argnums(argnums, nargs: int, what: str) -> tuple[int, ...]:
    out = []
    for a in argnums:
        if not -nargs <= a < nargs:
            raise ArgumentError(
                f"{what} contains {a}, but the function was called with {nargs} positional "
                f"argument(s); use indices in range({nargs})."
            )
        out.append(a % nargs)
    return tuple(sorted(set(out)))


def _path_text(prefix: str, path) -> str:
    return prefix + jax.tree_util.keystr(path)


def _flat_arguments(dynamic, kwargs):
    """``(leaves, paths, tree)`` of the dynamic arguments ``[(index, value), ...]`` and
    ``kwargs``, each path as the user writes it (``args[2]['w']``)."""
    leaves_with_path, tree = jax.tree_util.tree_flatten_with_path(
        (tuple(a for _, a in dynamic), kwargs)
    )
    paths = []
    for path, _ in leaves_with_path:
        head, index, rest = path[0].idx, path[1], path[2:]
        if head == 0:
            paths.append(_path_text(f"args[{dynamic[index.idx][0]}]", rest))
        else:
            paths.append(_path_text(f"kwargs[{index.key!r}]", rest))
    return [x for _, x in leaves_with_path], paths, tree


def _checked_outputs(out):
    """``(leaves, paths, tree)`` of ``out``; a leaf that is no array is an ``OutputError``."""
    leaves_with_path, tree = jax.tree_util.tree_flatten_with_path(out)
    paths = [_path_text("out", path) for path, _ in leaves_with_path]
    for path, (_, leaf) in zip(paths, leaves_with_path):
        try:
            jax.typeof(leaf)
        except TypeError:
            raise OutputError(
                f"output {path} is a {type(leaf).__name__} ({leaf!r:.60}), which is no array "
                f"type; compiled functions return arrays and numbers (as under jax.jit). "
                f"Return it from outside the compiled function."
            ) from None
    return [leaf for _, leaf in leaves_with_path], paths, tree


def _committed_spec(leaf) -> PartitionSpec | None:
    """The ``PartitionSpec`` of a committed ``jax.Array``'s (or a ``ShapeDtypeStruct``'s)
    ``NamedSharding``, ``None`` for any other leaf (its spec is free for propagation to
    choose); cheap, as the call cache reads it per leaf."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or (
        isinstance(leaf, jax.Array) and not leaf.committed
    ):
        return None
    return canonical_spec(sharding.spec)


def _sharding_spec(leaf, meshes) -> PartitionSpec | None:
    """The committed spec as written (see :func:`_committed_spec`) if every mesh can
    shard the leaf that way (any of them may hold it): the argument's default
    ``in_spec``."""
    if _committed_spec(leaf) is None:
        return None
    spec = leaf.sharding.spec
    if leaf.sharding.mesh.axis_names[0] == STAGES_AXIS:  # a stacked array held in pieces
        spec = within_stage(spec)
    if any(spec_problem(spec, mesh, leaf.shape) for mesh in meshes):
        return None
    return spec


class _CallKey(NamedTuple):
    """What the executable cache is keyed on (see ``Wrapped._signature_key``)."""

    static: tuple
    treedef: Any
    types: tuple
    specs: tuple  # per leaf: its committed spec, canonical, or None
    donated: tuple


def _serves(exe_key: _CallKey, exe: Compiled, key: _CallKey, given) -> bool:
    """Whether ``exe`` (built for ``exe_key``) is the program for a call keyed ``key``:
    every argument leaf has the spec it had then, or one the program ignores (an
    ``in_specs`` entry was ``given`` for it), or the spec the program chose for a leaf
    that had none (uncommitted). So arguments placed by ``step.input_shardings`` and
    results fed back run on the executable that placed them, as under ``jax.jit``."""
    if exe_key._replace(specs=()) != key._replace(specs=()):
        return False
    return all(
        now == then or user is not None or (then is None and now == canonical_spec(chosen))
        for now, then, chosen, user in zip(key.specs, exe_key.specs, exe.argument_specs, given)
    )


def _flat_specs(specs, tree, nleaves_prefix: str, what: str):
    """Broadcast a spec pytree prefix over ``tree``; a mismatch, or a leaf that is no
    ``PartitionSpec`` (``"data"`` for ``P("data")``), is a ``SpecError``."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec_leaf)[0]:
        if not _is_spec_leaf(leaf):
            raise SpecError(
                f"{what}{jax.tree_util.keystr(path)} is a {type(leaf).__name__} ({leaf!r:.40}), "
                f"not a PartitionSpec; write jax.sharding.PartitionSpec({leaf!r:.40}) or None."
            )
    try:
        return broadcast_prefix(specs, tree, _is_spec_leaf)
    except ValueError as err:
        raise SpecError(
            f"{what} does not match the structure of {nleaves_prefix}: {err}. Give a "
            f"PartitionSpec (or None) per leaf, or a prefix of the pytree."
        ) from None


@dataclass(frozen=True)
class _Call:
    """A call's arguments told apart as ``jax.jit`` does."""

    static_args: tuple  # ((index, value), ...): the static positional arguments
    static_kwargs: tuple  # ((name, value), ...) by name: the static keyword arguments
    dynamic: tuple  # ((index, value), ...): the other positional arguments
    kwargs: dict  # the other keyword arguments
    donate: tuple[int, ...]  # donated positional arguments
    donate_names: tuple[str, ...]  # donated keyword arguments (of those passed)

    def donated(self) -> tuple[bool, ...]:
        """Per flat input (positional arguments, then keywords by name), whether it is donated."""
        flags = []
        for i, a in self.dynamic:
            flags += [i in self.donate] * len(jax.tree_util.tree_leaves(a))
        for name in sorted(self.kwargs):  # the order a dict's leaves flatten in
            flags += [name in self.donate_names] * len(jax.tree_util.tree_leaves(self.kwargs[name]))
        return tuple(flags)


def _planned(program: Program, schedule, microbatches: int, choice=None) -> Program:
    """``program`` with ``schedule`` run on the layout its stage markers make: the mesh of
    each stage (``stage_to_mesh``, else the schedule's own placement, else stage ``s`` on
    mesh ``s mod M``; a ``StageError`` names the marker of a stage without one) and each
    mesh's actions, as the plain data the program holds."""
    markers: dict = {}
    for eqn in find_eqns(program.jaxpr.jaxpr.eqns, is_marker):
        markers.setdefault(eqn.params["stage"], eqn)
    stages = max([*markers, *layer_stages(program.jaxpr.jaxpr.eqns)], default=0) + 1
    if program.stage_to_mesh is None:
        placement = schedule.placement(stages, len(program.meshes))
        if placement is not None:
            program = program.replace(stage_to_mesh=placement)
    for stage, marker in sorted(markers.items()):
        program.mesh_of_stage(stage, marker)
    layout = schedules.Layout.make(
        stages, microbatches, tuple(map(program.mesh_of_stage, range(stages)))
    )
    plan = schedules.loop_schedule(schedule, layout)
    return program.replace(schedule=dataclasses.replace(plan, choice=choice))


def _through_passes(program: Program, passes, signature, trace_seconds: float) -> Lowered:
    """``program`` taken through ``passes``, with every stage and its wall time kept
    (``input``'s time is ``trace_seconds``, what tracing took)."""
    dumps, seconds = [], {}
    last = time.perf_counter()

    def record(name, p):
        nonlocal last
        now = time.perf_counter()
        seconds[name], last = (trace_seconds if name == "input" else now - last), now
        dumps.append((name, p))

    run_pipeline(program, passes, record)
    return Lowered(dumps, signature, seconds)


def _warn_of_idle_meshes(lowered: Lowered) -> None:
    """An ``IdleMeshWarning`` for each mesh that runs no fragment of the split program
    (nothing to say about a pipeline that never splits)."""
    split = next(
        (p for p in map(lowered.program, reversed(lowered.stages)) if p.phase >= Phase.SPLIT),
        None,
    )
    if split is None:
        return
    stages = {}
    for eqn in split.jaxpr.jaxpr.eqns:
        if eqn.primitive is fragment_p:
            stages.setdefault(eqn.params["mesh"], set()).add(eqn.params["stage"])
    n = len(split.meshes)
    running = ", ".join(f"{sorted(stages[m])} on mesh{m}" for m in sorted(stages))
    for m in sorted(set(range(n)) - set(stages)):
        warnings.warn(
            f"mesh{m} {dict(split.meshes[m].shape)} runs no stage and sits idle every step: "
            f"the program runs stages {running}. Mark a stage for it (stage s runs on "
            f"meshes[s % {n}] unless stage_to_mesh says otherwise) or compile over fewer "
            f"meshes.",
            IdleMeshWarning,
            stacklevel=2,
        )


class Lowered:
    """A program taken through every pass, with the IR after each one kept for inspection
    (as ``jax.stages.Lowered``: ``as_text``, ``compile``)."""

    def __init__(self, dumps: list[tuple[str, Program]], signature: Signature, seconds=None):
        self._dumps = dict(dumps)
        self._order = tuple(name for name, _ in dumps)
        self.signature = signature
        self._by_backend: dict[str, Program] = {}
        # Told of the result of compile(): the function lowered keeps it for its calls.
        self._compiled_hook: Callable[[Compiled], None] | None = None
        # Wall time per stage: ``input`` is tracing, ``after-<pass>`` that pass.
        self.seconds: dict[str, float] = dict(seconds or {})

    @property
    def schedule_choice(self):
        """Why ``schedule="auto"`` (or a function) chose the schedule it did (an
        ``mpmdc.ir.program.ScheduleChoice``: its predicted step time, bubble and peak
        activation memory per mesh, and every candidate's step time), ``None`` for a
        schedule given outright."""
        plan = self.program(self._order[0]).schedule
        return None if plan is None else plan.choice

    @property
    def stage_plan(self):
        """How ``partition="balanced"`` grouped the marked segments into stages (an
        ``mpmdc.ir.program.StagePlan``: each stage's segments and predicted time), ``None``
        for a program not balanced."""
        return self.program(self._order[0]).stage_plan

    @property
    def stages(self) -> tuple[str, ...]:
        """Names of the dump stages, in pipeline order (``input``, ``after-inline``, ...)."""
        return self._order

    def program(self, stage: str) -> Program:
        """The IR after ``stage``."""
        if stage not in self._dumps:
            raise PassError(f"unknown stage {stage!r}; stages: {', '.join(self._order)}.")
        return self._dumps[stage]

    def as_text(
        self, stage: str = "after-split", platform: str | None = None, *, backend: str | None = None
    ) -> str:
        """Deterministic text of the IR after ``stage``.

        ``platform`` or ``backend`` picks whose modules the ``stablehlo`` stage shows, as
        for :meth:`stablehlo`; the other stages do not depend on it.
        """
        program = self.program(stage)
        if stage == "stablehlo" and (platform is not None or backend is not None):
            program = self._lowered(platform, backend)
        return program.as_text()

    def rerun(self, passes) -> Lowered:
        """The traced program (stage ``input``) taken through ``passes`` instead: names,
        ``name{option=value}`` texts, one comma-separated text, or pass objects."""
        return _through_passes(
            self.program("input"), resolve(passes), self.signature, self.seconds.get("input", 0.0)
        )

    def _last_split(self, unlowered: bool = False) -> Program:
        for name in reversed(self._order):
            program = self._dumps[name]
            if program.phase >= Phase.SPLIT and not (unlowered and program.phase is Phase.LOWERED):
                return program
        raise PassError(
            f"this pipeline never split the program (stages: {', '.join(self._order)}); "
            f"include the `split` pass to compile or emit StableHLO."
        )

    def _lowered(self, platform: str | None = None, backend: str | None = None) -> Program:
        """The split program lowered for ``platform`` or ``backend`` (see :meth:`stablehlo`)."""
        from mpmdc.passes.lower import lower

        last = self._last_split()
        key = backends.choose(platform, backend, default=last.backend)
        if last.phase is Phase.LOWERED and last.backend == key:
            return last
        if key not in self._by_backend:
            self._by_backend[key] = lower(self._last_split(unlowered=True), backend=key)
        return self._by_backend[key]

    def stablehlo(
        self, platform: str | None = None, *, backend: str | None = None
    ) -> dict[str, str]:
        """``{fragment name: StableHLO text}`` for ``platform`` (``cpu``, ``cuda``, ``rocm``
        or ``tpu``) or for the registered ``backend`` (an in-program transfer variant,
        say); by default for the program's own backend.

        A platform keeps the program's backend where it lowers for that platform (its
        transfers and compiler options with it), else takes the platform's built-in one.
        """
        return dict(self._lowered(platform, backend).modules)

    def transfer_report(self) -> TransferReport:
        """What a step moves between meshes (per mesh pair and kind of value) and what
        each mesh holds; see ``mpmdc.ir.traffic``."""
        return transfer_report(self._last_split())

    def compile(self) -> Compiled:
        """Compile every fragment for its mesh; returns the callable :class:`Compiled`.

        Compiles the modules of the ``stablehlo`` stage (lowering first, with the
        ``lower`` pass, if this pipeline stopped before it). The function it was lowered
        from runs calls with the same argument types on the result, as ``jax.jit`` does."""
        compiled = self._compile_with(None)
        if self._compiled_hook is not None:
            self._compiled_hook(compiled)
        return compiled

    def _compile_with(self, compiler: FragmentCompiler | None) -> Compiled:
        """:meth:`compile`, finishing what ``compiler`` started while lowering."""
        return Compiled(self._lowered(), self.signature, compiler=compiler)


def _checked_cache_size(size):
    """``compile(cache_size=)``: a positive int, or ``None`` for no bound."""
    if size is None or (isinstance(size, (int, np.integer)) and not isinstance(size, bool)):
        if size is None or size > 0:
            return None if size is None else int(size)
    raise ArgumentError(
        f"cache_size must be a positive int (the call signatures whose executables are "
        f"kept) or None (no bound), got {size!r}."
    )


def _qualified_name(fn) -> str:
    """``module.qualname`` of ``fn``, seen through ``functools.partial``: the same in every
    process running the same script, unlike an address."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"{module}.{name or type(fn).__qualname__}"


class Traced:
    """A function traced for given argument types, before any pass (as
    ``jax.stages.Traced``): its ``jaxpr``, ``args_info`` and ``out_info``; :meth:`lower`
    runs the passes."""

    def __init__(
        self, program: Program, signature: Signature, passes, fun_name: str, seconds: float
    ):
        self._program = program
        self._signature = signature
        self._passes = passes
        self.fun_name = fun_name
        self._seconds = seconds  # tracing's wall time: the ``input`` stage's

    @property
    def jaxpr(self) -> jax.extend.core.ClosedJaxpr:
        """The traced function as one flat jaxpr: arguments and results are the leaves of
        ``args_info`` and ``out_info`` (the ``input`` stage's program)."""
        return self._program.jaxpr

    @property
    def args_info(self):
        """Each argument's type and whether it is donated: ``(args, kwargs)`` pytrees of
        ``jax.stages.ArgInfo`` (static arguments left out)."""
        return self._signature.args_info(self._program.donated)

    @property
    def out_info(self):
        """The results' types: a pytree of ``jax.ShapeDtypeStruct`` shaped as the output."""
        types = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
            for a in self._program.jaxpr.out_avals
        ]
        return jax.tree_util.tree_unflatten(self._signature.out_tree, types)

    def lower(self) -> Lowered:
        """Run every pass; the IR after each one is the result's."""
        lowered = _through_passes(self._program, self._passes, self._signature, self._seconds)
        _warn_of_idle_meshes(lowered)
        return lowered


class Wrapped:
    """``mpmdc.compile(fn, meshes)``, as ``jax.jit(fn)``: call it like ``fn``; ``trace``
    and ``lower`` show what it does."""

    def __init__(
        self,
        fn: Callable,
        meshes,
        *,
        in_specs=None,
        out_specs=None,
        out_shardings=None,
        static_argnums=(),
        static_argnames=(),
        donate_argnums=(),
        donate_argnames=(),
        stage_to_mesh=None,
        schedule=None,
        partition=None,
        backend: str | None = None,
        passes=None,
        cache_size: int | None = DEFAULT_CACHE_SIZE,
    ):
        if not callable(fn):
            raise ArgumentError(f"mpmdc.compile expects a callable, got {type(fn).__name__}.")
        self.fn = fn
        self.meshes = check_meshes(meshes)
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.out_shardings = out_shardings
        self.static_argnums = _normalize_argnums(static_argnums, "static_argnums")
        self.donate_argnums = _normalize_argnums(donate_argnums, "donate_argnums")
        static_names = _normalize_argnames(static_argnames, "static_argnames")
        donate_names = _normalize_argnames(donate_argnames, "donate_argnames")
        # What the numbers and names mean in the other form: parameters named in the
        # ``*_argnames`` when passed by position, and those numbered when passed by name.
        params = _parameters(fn)
        self._positional = _positional_names(params)
        self._static_by_name, more_static = _by_other_name(
            fn, params, self.static_argnums, static_names, "static_argnames"
        )
        self._donate_by_name, more_donated = _by_other_name(
            fn, params, self.donate_argnums, donate_names, "donate_argnames"
        )
        self.static_argnames = tuple(dict.fromkeys(static_names + more_static))
        self.donate_argnames = tuple(dict.fromkeys(donate_names + more_donated))
        self.stage_to_mesh = self._checked_stage_to_mesh(stage_to_mesh)
        # Checked now, as a bad name is a mistake in this call, not in the traced function.
        self.schedule = None if schedule is None else schedules.get(schedule)
        if partition not in (None, BALANCED):
            raise StageError(f"partition must be None or {BALANCED!r}, got {partition!r}.")
        self.partition = partition
        first = self.meshes[0].devices.flat[0]
        self.backend = backends.get(
            backend or backends.for_platform(first.platform, first.client.platform_version)
        ).name
        self.passes = resolve(passes)
        self._cache = ExecutableCache(
            _checked_cache_size(cache_size), f"mpmdc: executables of {_qualified_name(fn)}"
        )

    def _checked_stage_to_mesh(self, stage_to_mesh):
        if stage_to_mesh is None:
            return None
        if isinstance(stage_to_mesh, dict):
            if sorted(stage_to_mesh) != list(range(len(stage_to_mesh))):
                raise StageError(
                    f"stage_to_mesh keys must be the stages 0..n-1, got {sorted(stage_to_mesh)}."
                )
            stage_to_mesh = [stage_to_mesh[s] for s in range(len(stage_to_mesh))]
        out = []
        for s, m in enumerate(stage_to_mesh):
            if (
                isinstance(m, bool)
                or not isinstance(m, (int, np.integer))
                or not 0 <= m < len(self.meshes)
            ):
                raise StageError(
                    f"stage_to_mesh maps stage {s} to {m!r}, but there are only "
                    f"{len(self.meshes)} meshes (indices 0..{len(self.meshes) - 1})."
                )
            out.append(int(m))
        return tuple(out)

    def _numbered(self, argnums, by_name, nargs: int, kwargs, what: str) -> tuple[int, ...]:
        """The positional arguments of a call with ``nargs`` of them and keywords ``kwargs``
        that ``argnums`` (each in range, but for a parameter passed by keyword, which its
        name selects) or a parameter name (``by_name``, where passed by position) selects."""
        by_keyword = {i for i, name in enumerate(self._positional) if name in kwargs}
        given = [a for a in argnums if a not in by_keyword]
        checked = _check_argnums(given, nargs, what) if given else ()
        return tuple(sorted(set(checked) | {i for i in by_name if i < nargs}))

    def _split_args(self, args, kwargs) -> _Call:
        static = self._numbered(
            self.static_argnums, self._static_by_name, len(args), kwargs, "static_argnums"
        )
        donate = self._numbered(
            self.donate_argnums, self._donate_by_name, len(args), kwargs, "donate_argnums"
        )
        static_names = tuple(sorted(k for k in kwargs if k in self.static_argnames))
        donate_names = tuple(sorted(k for k in kwargs if k in self.donate_argnames))
        for both, what in (
            (sorted(set(static) & set(donate)), "arguments"),
            (sorted(set(static_names) & set(donate_names)), "keyword arguments"),
        ):
            if both:
                raise ArgumentError(f"{what} {both} are both static and donated.")
        static_args = tuple((i, args[i]) for i in static)
        static_kwargs = tuple((k, kwargs[k]) for k in static_names)
        try:
            hash((static_args, static_kwargs))
        except TypeError:
            named = [f"args[{i}]" for i in static] + [f"kwargs[{k!r}]" for k in static_names]
            raise ArgumentError(
                f"static arguments {', '.join(named)} must be hashable (like jax.jit's "
                f"static_argnums and static_argnames)."
            ) from None
        return _Call(
            static_args=static_args,
            static_kwargs=static_kwargs,
            dynamic=tuple((i, a) for i, a in enumerate(args) if i not in static),
            kwargs={k: v for k, v in kwargs.items() if k not in static_names},
            donate=donate,
            donate_names=donate_names,
        )

    def _signature_key(self, args, kwargs):
        """What the executable cache is keyed on: static values, pytree structure, each
        leaf's shape, dtype, weak type and sharding spec (as ``jax.jit``), donated arguments."""
        call = self._split_args(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten(
            (tuple(a for _, a in call.dynamic), call.kwargs)
        )
        try:
            types = tuple(map(leaf_type, leaves))
        except ArgumentError:
            _, paths, _ = _flat_arguments(call.dynamic, call.kwargs)
            types = tuple(map(leaf_type, leaves, paths))  # raises, naming the argument
        specs = tuple(map(_committed_spec, leaves))
        static = (call.static_args, call.static_kwargs)
        donated = (call.donate, call.donate_names)
        return _CallKey(static, treedef, types, specs, donated), leaves

    def _executable(self, args, kwargs):
        key, leaves = self._signature_key(args, kwargs)
        exe = self._cache.get(key, self._serving(key, args, kwargs))
        if exe is None:
            backend = backends.get(self.backend)
            backend.check_can_run(self.meshes)
            # XLA compiles each module while the `lower` pass lowers the next.
            with FragmentCompiler(backend) as compiler:
                passes = self._passes_for_call(compiler.offer)
                lowered = self._traced(args, kwargs, passes).lower()
                exe = lowered._compile_with(compiler)
            exe = self._cache.put(key, exe)
        return exe, leaves

    def _serving(self, key, args, kwargs):
        """``serves(exe_key, exe)``: whether an executable the cache keeps, built for other
        committed specs, serves a call keyed ``key`` (:func:`_serves`). The specs given
        for the arguments are worked out only if the cache asks (a call whose key it
        holds never does)."""
        given = []

        def serves(exe_key, exe) -> bool:
            if not given:
                call = self._split_args(args, kwargs)
                given.append(self._flat_in_specs(args, dict(call.static_args), call.kwargs))
            return _serves(exe_key, exe, key, given[0])

        return serves

    def clear_cache(self) -> None:
        """Drop every executable kept for this function (as ``jax.jit``'s
        ``clear_cache()``); the next call compiles again. ``jax.clear_caches()`` does this
        for every compiled function."""
        self._cache.cache_clear()

    def cache_info(self) -> CacheInfo:
        """How the executable cache has served calls: ``hits`` (an executable was kept),
        ``misses`` (the call compiled), ``evictions`` (least recently used signatures
        dropped to stay within ``cache_size``), ``maxsize`` and ``currsize``."""
        return self._cache.cache_info()

    def _passes_for_call(self, on_module):
        """The passes, with ``lower`` handing each module to ``on_module`` as it lowers it
        and emitting only the fragments of meshes this process runs (all of them in one
        process)."""
        here = tuple(m for m, mesh in enumerate(self.meshes) if is_here(mesh))
        options = {"on_module": on_module}
        if len(here) < len(self.meshes):
            options["meshes"] = here
        return [
            p.with_options(**options) if isinstance(p, FunctionPass) and p.name == "lower" else p
            for p in self.passes
        ]

    def __call__(self, *args, **kwargs):
        """Run ``fn`` on the meshes (compiling on the first call for these argument types)."""
        exe, leaves = self._executable(args, kwargs)
        return exe.call_flat(leaves)

    def input_shardings(self, *args, **kwargs):
        """Where a call with these arguments (arrays or ``ShapeDtypeStruct``s) runs each
        argument: ``(args, kwargs)`` pytrees of ``Sharding`` as ``Compiled.input_shardings``
        (static arguments left out), e.g. ``jax.device_put(args, step.input_shardings(*args)[0])``.
        Compiles for these types if no call has yet."""
        return self._executable(args, kwargs)[0].input_shardings

    def output_shardings(self, *args, **kwargs):
        """Where a call with these arguments puts each output (a pytree of ``Sharding``)."""
        return self._executable(args, kwargs)[0].output_shardings

    def trace(self, *args, **kwargs) -> Traced:
        """Trace with arrays or ``jax.ShapeDtypeStruct``s (as ``jax.jit(fn).trace``)."""
        return self._traced(args, kwargs, self.passes)

    def lower(self, *args, **kwargs) -> Lowered:
        """Trace with arrays or ``jax.ShapeDtypeStruct``s and run every pass. Calls with
        these argument types run on what the result's ``compile()`` returns."""
        lowered = self._traced(args, kwargs, self.passes).lower()
        key = self._signature_key(args, kwargs)[0]
        lowered._compiled_hook = lambda compiled: self._cache.put(key, compiled)
        return lowered

    @cycles_collected_after()  # (see its docstring)
    def _traced(self, args, kwargs, passes) -> Traced:
        """The program of a call with ``args`` and ``kwargs``, before any of ``passes``."""
        call = self._split_args(args, kwargs)
        static = dict(call.static_args)
        leaves, in_paths, in_tree = _flat_arguments(call.dynamic, call.kwargs)
        in_types = tuple(map(leaf_type, leaves, in_paths))
        started = time.perf_counter()
        closed, loop, out_tree, out_paths = self._trace(in_tree, call, in_types)
        out_specs, wanted_out_meshes = self._output_specs(out_tree, out_paths)
        arg_meshes = tuple(committed_mesh(leaf, self.meshes) for leaf in leaves)
        program = Program(
            jaxpr=closed,
            meshes=self.meshes,
            stage_to_mesh=self.stage_to_mesh,
            in_specs=self._input_specs(args, static, call.kwargs, leaves),
            out_specs=out_specs,
            wanted_out_meshes=wanted_out_meshes,
            in_paths=tuple(in_paths),
            out_paths=tuple(out_paths),
            donated=call.donated(),
            backend=self.backend,
            microbatches=loop.microbatches if loop else None,
            arg_meshes=arg_meshes if any(m is not None for m in arg_meshes) else None,
        )
        schedule = (self.schedule or loop.schedule) if loop else None
        choosing = isinstance(schedule, schedules.Chooser)
        if wants_balancing(program, self.partition):
            # A chooser's stages are one per mesh, balanced as for 1F1B's memory.
            program = balanced(program, schedules.OneFOneB() if choosing else schedule)
        if loop:
            choice = None
            if choosing:
                pipeline = pipeline_of(program, schedule, loop.microbatches)
                schedule, choice = schedule.choose(pipeline)
            program = _planned(program, schedule, loop.microbatches, choice)
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        signature = Signature(
            in_tree=in_tree,
            in_types=in_types,
            in_paths=tuple(in_paths),
            out_tree=out_tree,
            function=_qualified_name(self.fn),
        )
        return Traced(program, signature, passes, name, time.perf_counter() - started)

    def _trace(self, in_tree, call: _Call, in_types):
        """``(closed jaxpr, accumulate loop or None, output treedef, output paths)`` of
        ``fn`` traced on abstract values of ``in_types``, static arguments put back."""
        out_store = {}

        def flat_fn(*leaves):
            dyn, kw = jax.tree_util.tree_unflatten(in_tree, leaves)
            full = list(dyn)
            for i, value in call.static_args:  # in increasing order of i
                full.insert(i, value)
            with recording_loops() as out_store["loops"]:
                out = self.fn(*full, **kw, **dict(call.static_kwargs))
            out_leaves, out_store["paths"], out_store["tree"] = _checked_outputs(out)
            return out_leaves

        leaf_types = [
            jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in in_types
        ]
        closed = jax.make_jaxpr(flat_fn)(*leaf_types)
        loops = out_store["loops"]
        if len(loops) > 1:
            raise AccumulateError(
                f"the function runs mpmdc.accumulate {len(loops)} times (at "
                f"{' and at '.join(loop.called_at for loop in loops)}); mpmdc.compile pipelines "
                f"one microbatch loop per function. Put all per-microbatch work in one "
                f"accumulate call (it can return a pytree of results)."
            )
        return closed, (loops[0] if loops else None), out_store["tree"], out_store["paths"]

    def _input_specs(self, args, static: dict, kwargs, leaves) -> tuple:
        """Per flat input, ``in_specs``' entry, else the argument's own sharding."""
        return tuple(
            spec if spec is not None else _sharding_spec(leaf, self.meshes)
            for spec, leaf in zip(self._flat_in_specs(args, static, kwargs), leaves)
        )

    def _output_specs(self, out_tree, out_paths):
        """``(spec per output, mesh asked for per output or None)`` from ``out_specs``
        and ``out_shardings``."""
        if self.out_specs is None:
            out_specs = [None] * out_tree.num_leaves
        else:
            out_specs = _flat_specs(self.out_specs, skeleton(out_tree), "the outputs", "out_specs")
        if self.out_shardings is None:
            return tuple(out_specs), None
        wanted_out_meshes, out_specs = self._flat_out_shardings(out_tree, out_paths, out_specs)
        return tuple(out_specs), wanted_out_meshes

    def _flat_out_shardings(self, out_tree, out_paths, out_specs):
        """``(mesh index or None, spec)`` per output from ``out_shardings``: a pytree
        (prefix) of ``NamedSharding`` on one of the meshes, or ``None``."""
        try:
            flat = broadcast_prefix(
                self.out_shardings,
                skeleton(out_tree),
                lambda s: s is None or isinstance(s, (jax.sharding.Sharding, PartitionSpec)),
            )
        except ValueError as err:
            raise SpecError(
                f"out_shardings does not match the structure of the outputs: {err}. Give a "
                f"NamedSharding (or None) per output, or a prefix of the pytree."
            ) from None
        ids = [tuple(m.device_ids.flat) for m in self.meshes]
        meshes, specs = [], list(out_specs)
        for k, (sharding, path) in enumerate(zip(flat, out_paths)):
            if sharding is None:
                meshes.append(None)
                continue
            if (
                not isinstance(sharding, NamedSharding)
                or tuple(sharding.mesh.device_ids.flat) not in ids
            ):
                raise SpecError(
                    f"out_shardings for {path} is {sharding!r}, which is not a NamedSharding on one "
                    f"of the {len(self.meshes)} meshes; build it as NamedSharding(meshes[i], spec)."
                )
            meshes.append(ids.index(tuple(sharding.mesh.device_ids.flat)))
            specs[k] = sharding.spec
        return tuple(meshes), specs

    def _flat_in_specs(self, args, static, kwargs):
        if self.in_specs is None:
            per_arg = [None] * len(args)
        elif _is_spec_leaf(self.in_specs):
            per_arg = [self.in_specs] * len(args)
        else:
            per_arg = list(self.in_specs)
            dynamic = [i for i in range(len(args)) if i not in static]
            if (
                len(per_arg) == len(dynamic) < len(args)
            ):  # static ones left out, as jax.jit's in_shardings
                given = iter(per_arg)
                per_arg = [None if i in static else next(given) for i in range(len(args))]
            elif len(per_arg) != len(args):
                also = f" (or one per non-static argument, {len(dynamic)})" if static else ""
                raise SpecError(
                    f"in_specs has {len(per_arg)} entries but the function was called with "
                    f"{len(args)} positional arguments; give one entry per argument{also}."
                )
        flat = []
        for i, (spec, arg) in enumerate(zip(per_arg, args)):
            if i in static:
                continue
            flat += _flat_specs(spec, arg, f"argument args[{i}]", f"in_specs[{i}]")
        flat += [None] * len(jax.tree_util.tree_leaves(kwargs))
        return flat


def compile(
    fn: Callable,
    meshes: Sequence,
    *,
    in_specs: Any = None,
    out_specs: Any = None,
    out_shardings: Any = None,
    static_argnums=(),
    static_argnames=(),
    donate_argnums=(),
    donate_argnames=(),
    stage_to_mesh=None,
    schedule=None,
    partition=None,
    backend: str | None = None,
    passes=None,
    cache_size: int | None = DEFAULT_CACHE_SIZE,
) -> Wrapped:
    """Compile ``fn`` for pipeline execution over ``meshes`` (lazily, like ``jax.jit``);
    returns the :class:`Wrapped` function.

    ``in_specs``/``out_specs`` are pytrees (or prefixes) of ``PartitionSpec`` over the
    mesh axes, the sharding inside whichever mesh holds each value. ``out_shardings``
    (a pytree or prefix of ``NamedSharding`` on one of ``meshes``, or ``None``) says on
    which mesh, and how, an output should live, e.g. the input's sharding for a result
    a loop feeds back. Stage ``s`` runs
    on ``meshes[s % len(meshes)]`` unless ``stage_to_mesh`` maps it elsewhere or the
    schedule places its stages (the V order of ``"zb-v"`` and ``"dualpipev"``).

    ``schedule`` (a name such as ``"interleaved-1f1b"``, an ``mpmdc.schedules.Schedule``,
    per-mesh action lists, ``"auto"`` or a function of the ``mpmdc.schedules.Pipeline``)
    orders the microbatches of ``fn``'s ``mpmdc.accumulate`` loop, overriding the
    schedule named there: the schedule goes with the layout (meshes, ``stage_to_mesh``),
    so changing the layout needs no edit of the model.

    ``partition="balanced"`` makes the markers' indices name *segments*, grouped into
    the stages the schedule runs (one per mesh, two for interleaved and V schedules) so
    that the slowest stage's estimated time is smallest, within each mesh's memory;
    ``Lowered.stage_plan`` and ``mpmdc dump`` show the grouping and each stage's
    predicted time.

    ``static_argnums``/``static_argnames`` and ``donate_argnums``/``donate_argnames`` are
    ``jax.jit``'s: a parameter given by number is also static (or donated) when passed
    by keyword, and one given by name also when passed by position. ``backend`` (a
    registered name, default the meshes' platform's) lowers, compiles and runs.

    ``cache_size`` bounds how many call signatures keep their executables (least
    recently used dropped first; ``None``: no bound); ``Wrapped.clear_cache()`` and
    ``jax.clear_caches()`` drop them all.
    """
    return Wrapped(
        fn,
        meshes,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        stage_to_mesh=stage_to_mesh,
        schedule=schedule,
        partition=partition,
        backend=backend,
        passes=passes,
        cache_size=cache_size,
    )
