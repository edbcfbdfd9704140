"""The public entry points, named as ``jax.stages``: ``compile`` returns a :class:`Wrapped`
function; ``trace`` gives a :class:`Traced`, ``lower`` a :class:`Lowered` (the IR after
every pass) and ``Lowered.compile`` the runtime's :class:`Compiled`.

``compile`` is lazy like ``jax.jit``: nothing is traced until the first call or
``lower``, and executables are cached per input signature (pytree structure,
shapes, dtypes and static arguments), so a second call with the same types does
not retrace.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from mpmdc import _jax_compat as compat
from mpmdc import backends
from mpmdc.errors import AccumulateError, IdleMeshWarning, PassError
from mpmdc.ir.custom_rules import placing
from mpmdc.ir.primitives import fragment_p, is_marker, is_transposed_marker
from mpmdc.ir.program import Phase, PlanRequest, Program
from mpmdc.ir.traffic import TransferReport, transfer_report
from mpmdc.options import CompileOptions
from mpmdc.passes import FunctionPass
from mpmdc.pipeline import (
    cycles_collected_after,
    default_pipeline,
    resolve,
    run_pipeline,
    stage_name,
    with_plan,
)
from mpmdc.planning.balancing import wants_balancing
from mpmdc.runtime.arguments import committed_blocks, committed_where
from mpmdc.runtime.compiling import FragmentCompiler
from mpmdc.runtime.executable import Compiled
from mpmdc.runtime.executable_cache import DEFAULT_CACHE_SIZE, CacheInfo, ExecutableCache
from mpmdc.runtime.signature import Signature, leaf_type
from mpmdc.runtime.transfers import is_here
from mpmdc.schedules.accumulate import recording_loops
from mpmdc.signatures import (
    Call,
    checked_outputs,
    flat_arguments,
    flat_in_specs,
    input_specs,
    output_specs,
    qualified_name,
    refuse_types_alone,
    serves,
    signature_key,
    split_args,
    type_shardings,
)


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
    (nothing to say about a pipeline that never splits, or runs nothing at all)."""
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
    if not stages:
        return  # (a program of no work, returning its arguments or constants: nothing idles)
    n = len(split.meshes)
    running = ", ".join(f"{sorted(stages[m])} on mesh{m}" for m in sorted(stages))
    idle = sorted(set(range(n)) - set(stages))
    marked = _marked_stages(lowered) if idle else {}
    for m in idle:
        advice = (
            f"Mark a stage for it (stage s runs on meshes[s % {n}] unless stage_to_mesh "
            f"says otherwise) or compile over fewer meshes."
        )
        if marked.get(m):
            s, line = marked[m]
            advice = (
                f"Stage {s} is marked for it (at {line}), but no work reads what enters it "
                f"there: its readers run in other stages (a shard_map runs in the stage of "
                f"the mesh it is built for; build it with meshes[{m}] to run it on mesh{m})."
            )
        warnings.warn(
            f"mesh{m} {dict(split.meshes[m].shape)} runs no stage and sits idle every step: "
            f"the program runs stages {running}. {advice}",
            IdleMeshWarning,
            stacklevel=compat.user_stacklevel(),
        )


def _marked_stages(lowered: Lowered) -> dict[int, tuple[int, str]]:
    """Per mesh, the first stage a forward marker of the placed program enters on it, and
    the marker's source line."""
    if "after-partition" not in lowered.stages:
        return {}
    placed = lowered.program("after-partition")
    out: dict[int, tuple[int, str]] = {}
    for eqn in placed.jaxpr.jaxpr.eqns:
        if is_marker(eqn) and not is_transposed_marker(eqn):
            stage = eqn.params["stage"]
            out.setdefault(placed.mesh_of_stage(stage), (stage, compat.source_line(eqn)))
    return out


def _typed_spec(spec, typed_mesh) -> str:
    """A leaf's spec as its type holds it (``P()`` for none: an unsharded type)."""
    return repr(spec) if typed_mesh is not None and spec is not None else "P()"


class Lowered:
    """A program taken through every pass, with the IR after each one kept for inspection
    (as ``jax.stages.Lowered``: ``as_text``, ``compile``)."""

    def __init__(self, dumps: list[tuple[str, Program]], signature: Signature, seconds=None):
        self._dumps = dict(dumps)
        self._order = tuple(name for name, _ in dumps)
        self.signature = signature
        self._by_backend: dict[str, Program] = {}
        # ``(cache, key, reuse)`` of the function lowered, for these argument types:
        # compile() keeps its executable there for the calls, and returns the one kept
        # already where ``reuse`` (in one process: the calls' programs are this one's).
        self._kept: tuple[ExecutableCache, Any, bool] | None = None
        # Wall time per stage: ``input`` is tracing, ``after-<pass>`` that pass.
        self.seconds: dict[str, float] = dict(seconds or {})

    @property
    def schedule_choice(self):
        """Why ``schedule="auto"`` (or a function) chose the schedule it did (an
        ``mpmdc.ir.program.ScheduleChoice``: its predicted step time, bubble and peak
        activation memory per mesh, and every candidate's step time), ``None`` for a
        schedule given outright."""
        plan = self._planned().schedule
        return None if plan is None else plan.choice

    @property
    def stage_plan(self):
        """How ``partition="balanced"`` grouped the marked segments into stages (an
        ``mpmdc.ir.program.StagePlan``: each stage's segments and predicted time), ``None``
        for a program not balanced."""
        return self._planned().stage_plan

    def _planned(self) -> Program:
        """The first program the ``plan`` pass had planned."""
        return next(p for p in map(self.program, self._order) if p.phase >= Phase.PLANNED)

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
            self.program("input"),
            with_plan(resolve(passes, self.program("input").backend)),
            self.signature,
            self.seconds.get("input", 0.0),
        )

    def _last_split(self, unlowered: bool = False) -> Program:
        """The last split program; with ``unlowered``, the last one no backend has
        changed yet (neither lowered nor with its transfers made send/recv pairs)."""
        backend_stages = (stage_name("in-program-transfers"), stage_name("lower"))
        for name in reversed(self._order):
            program = self._dumps[name]
            if program.phase >= Phase.SPLIT and not (unlowered and name in backend_stages):
                return program
        raise PassError(
            f"this pipeline never split the program (stages: {', '.join(self._order)}); "
            f"include the `split` pass to compile or emit StableHLO."
        )

    def _lowered(self, platform: str | None = None, backend: str | None = None) -> Program:
        """The split program lowered for ``platform`` or ``backend`` (see :meth:`stablehlo`):
        this pipeline's own, else the passes the default pipeline ends with for that
        backend (``in-program-transfers`` where it needs it, then ``lower``) run on the
        last unlowered split program by the pass runner."""
        last = self._last_split()
        key = backends.choose(platform, backend, default=last.backend)
        if last.phase is Phase.LOWERED and last.backend == key:
            return last
        if key not in self._by_backend:
            tail = default_pipeline(key)[default_pipeline(key).index("donate") + 1 :]
            passes = resolve([p if p != "lower" else f"lower{{backend={key}}}" for p in tail])
            self._by_backend[key] = run_pipeline(self._last_split(unlowered=True), passes)
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

    @compat.api_boundary
    def compile(self) -> Compiled:
        """Compile every fragment for its mesh; returns the callable :class:`Compiled`.

        Compiles the modules of the ``stablehlo`` stage (lowering first, with the
        ``lower`` pass, if this pipeline stopped before it). The function it was lowered
        from runs calls with the same argument types on the result, and a compile() of
        another ``lower()`` for those types returns it (or what a call compiled) without
        compiling again, as with ``jax.jit``."""
        if self._kept is None:
            return self._compile_with(None)
        cache, key, reuse = self._kept
        found = cache.peek(key) if reuse else None
        if found is not None:  # (as jax.jit's lower().compile() finds what it compiled)
            return found
        return cache.put(key, self._compile_with(None))

    def _compile_with(self, compiler: FragmentCompiler | None) -> Compiled:
        """:meth:`compile`, finishing what ``compiler`` started while lowering."""
        return Compiled(self._lowered(), self.signature, compiler=compiler)


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
        self._kept = None  # handed to what lower() returns (see Lowered._kept)

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

    @compat.api_boundary
    def lower(self) -> Lowered:
        """Run every pass; the IR after each one is the result's."""
        lowered = _through_passes(self._program, self._passes, self._signature, self._seconds)
        lowered._kept = self._kept
        _warn_of_idle_meshes(lowered)
        return lowered


class Wrapped:
    """``mpmdc.compile(fn, meshes)``, as ``jax.jit(fn)``: call it like ``fn``; ``trace``
    and ``lower`` show what it does."""

    def __init__(self, fn: Callable, options: CompileOptions):
        self.fn = fn
        # Its name, docstring and signature are fn's (``__wrapped__``), as jax.jit's are.
        functools.update_wrapper(self, fn, updated=())
        if self.__doc__ is getattr(type(fn), "__doc__", None):  # (a partial's, not fn's)
            self.__doc__ = Wrapped.__doc__
        self.options = options
        self._cache = ExecutableCache(
            options.cache_size, f"mpmdc: executables of {qualified_name(fn)}"
        )
        # The last lower()'s program, until a call of its types compiles it: the call
        # then traces nothing again (as jax.jit's call after its lower() does not).
        self._lowered = ExecutableCache(1, f"mpmdc: program lowered of {qualified_name(fn)}")

    def __repr__(self) -> str:
        return f"<mpmdc.compile of {qualified_name(self.fn)} over {len(self.meshes)} meshes>"

    @property
    def meshes(self) -> tuple:
        """The meshes it runs on."""
        return self.options.meshes

    @property
    def backend(self) -> str:
        """The registered backend that lowers, compiles and runs it."""
        return self.options.backend

    @property
    def passes(self) -> list:
        """The pass pipeline it runs (``compile(passes=)``, else the default)."""
        return list(self.options.passes)

    def _executable(self, args, kwargs, values: bool = False):
        """The executable for calls of these argument types, and the arguments' leaves;
        ``values``: the arguments must be values (a call), not ``ShapeDtypeStruct``s."""
        key, leaves = signature_key(self.options, args, kwargs)
        if values:
            refuse_types_alone(self.options, args, kwargs, leaves)
        exe = self._cache.get(key, self._serving(key, args, kwargs))
        lowered = self._lowered.peek(key) if exe is None else None
        if lowered is not None:
            self._lowered.cache_clear()
            exe = lowered.compile()
        elif exe is None:
            backend = backends.get(self.backend)
            backend.check_can_run(self.meshes)
            # XLA compiles each module while the `lower` pass lowers the next.
            with FragmentCompiler(backend) as compiler:
                passes = self._passes_for_call(compiler.offer)
                try:
                    with cycles_collected_after():  # (see its docstring)
                        traced = self._traced(args, kwargs, passes)
                except Exception as err:
                    self._note_new_types(err, key, args, kwargs)
                    raise
                exe = traced.lower()._compile_with(compiler)
            exe = self._cache.put(key, exe)
        return exe, leaves

    def _note_new_types(self, err: Exception, key, args, kwargs) -> None:
        """Add to ``err``, raised by ``fn`` traced for a call of new argument types, the
        arguments whose types differ from those of the nearest earlier call of the same
        structure (the fewest arguments differing; the latest of those): the function
        may not take the new types (a parameter of a wrong shape)."""

        def differing(earlier) -> int:
            return sum(now[:2] != then[:2] for now, then in zip(key.types, earlier.types))

        earlier = [k for k in self._cache.cache_keys() if k.treedef == key.treedef]
        if not earlier:
            return
        last = min(reversed(earlier), key=differing)
        call = split_args(self.options, args, kwargs)
        _, paths, _ = flat_arguments(call.dynamic, call.kwargs)
        changed = [
            f"{path} is {now[1]}{list(now[0])} (was {then[1]}{list(then[0])})"
            for path, now, then in zip(paths, key.types, last.types)
            if now[:2] != then[:2]
        ]
        # On Explicit axes a sharding is part of the type the function is traced with,
        # and an earlier call may have run on an executable traced for other types (its
        # results fed back, laid out as `out_shardings` asked): compare with the types
        # that executable was traced for, the fewest of its keys' types holding a spec.
        exe = self._cache.peek(last)
        traced = min(
            (k for k in earlier if self._cache.peek(k) is exe),
            key=lambda k: sum(m is not None for m in k.typed),
        )
        changed += [
            f"{path} holds {_typed_spec(now, now_mesh)} in its type "
            f"(was {_typed_spec(then, then_mesh)})"
            for path, now, then, now_mesh, then_mesh in zip(
                paths, key.specs, traced.specs, key.typed, traced.typed
            )
            if (now_mesh, now) != (then_mesh, then)
            and (now_mesh is not None or then_mesh is not None)
        ]
        if changed:
            err.add_note(
                f"mpmdc: the function was traced again for new argument types, and failed: "
                f"{'; '.join(changed)}. If that is a mistake, pass arguments of the types "
                f"of the earlier calls."
            )

    def _serving(self, key, args, kwargs):
        """``serves(exe_key, exe)``: whether an executable the cache keeps, built for other
        committed specs, serves a call keyed ``key`` (:func:`~mpmdc.signatures.serves`). The specs given
        for the arguments are worked out only if the cache asks (a call whose key it
        holds never does)."""
        given = []

        def serving(exe_key, exe) -> bool:
            if not given:
                call = split_args(self.options, args, kwargs)
                given.append(flat_in_specs(self.options, args, dict(call.static_args), call.kwargs))
            return serves(exe_key, exe, key, given[0])

        return serving

    def clear_cache(self) -> None:
        """Drop every executable kept for this function (as ``jax.jit``'s
        ``clear_cache()``); the next call compiles again. ``jax.clear_caches()`` does this
        for every compiled function."""
        self._cache.cache_clear()
        self._lowered.cache_clear()

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

    @compat.api_boundary
    def __call__(self, *args, **kwargs):
        """Run ``fn`` on the meshes (compiling on the first call for these argument types);
        under ``jax.disable_jit()``, op by op as ``jax.jit`` runs it there (the markers
        are identities)."""
        if jax.config.jax_disable_jit:
            return self.fn(*args, **kwargs)
        exe, leaves = self._executable(args, kwargs, values=True)
        return exe.call_flat(leaves)

    @compat.api_boundary
    def input_shardings(self, *args, **kwargs):
        """Where a call with these arguments (arrays or ``ShapeDtypeStruct``s) runs each
        argument: ``(args, kwargs)`` pytrees of ``Sharding`` as ``Compiled.input_shardings``
        (static arguments left out), e.g. ``jax.device_put(args, step.input_shardings(*args)[0])``.
        Compiles for these types if no call has yet."""
        return self._executable(args, kwargs)[0].input_shardings

    @compat.api_boundary
    def output_shardings(self, *args, **kwargs):
        """Where a call with these arguments puts each output (a pytree of ``Sharding``)."""
        return self._executable(args, kwargs)[0].output_shardings

    @compat.api_boundary
    def trace(self, *args, **kwargs) -> Traced:
        """Trace with arrays or ``jax.ShapeDtypeStruct``s (as ``jax.jit(fn).trace``)."""
        with cycles_collected_after():
            traced = self._traced(args, kwargs, self.passes)
        everywhere = all(is_here(mesh) for mesh in self.meshes)  # (see _passes_for_call)
        traced._kept = (self._cache, signature_key(self.options, args, kwargs)[0], everywhere)
        return traced

    @compat.api_boundary
    def lower(self, *args, **kwargs) -> Lowered:
        """Trace with arrays or ``jax.ShapeDtypeStruct``s and run every pass. Calls with
        these argument types run on what the result's ``compile()`` returns; the first of
        them compiles it, tracing nothing again, unless another ``lower()`` came between."""
        lowered = self.trace(*args, **kwargs).lower()
        cache, key, reuse = lowered._kept
        if reuse and cache.peek(key) is None:
            self._lowered.put(key, lowered)
        return lowered

    def _traced(self, args, kwargs, passes) -> Traced:
        """The program of a call with ``args`` and ``kwargs``, before any of ``passes``."""
        options = self.options
        call = split_args(options, args, kwargs)
        static = dict(call.static_args)
        leaves, in_paths, in_tree = flat_arguments(call.dynamic, call.kwargs)
        in_types = tuple(map(leaf_type, leaves, in_paths))
        in_specs, committed_specs = input_specs(options, args, static, call.kwargs, leaves)
        started = time.perf_counter()
        closed, loop, out_tree, out_paths = self._trace(
            in_tree, call, in_types, type_shardings(leaves, committed_specs)
        )
        out_specs, wanted_out_meshes = output_specs(options, out_tree, out_paths)
        arg_meshes = tuple(committed_where(leaf, options.meshes) for leaf in leaves)
        arg_blocks = tuple(  # (of those spread over several meshes: see committed_where)
            committed_blocks(leaf) if isinstance(m, tuple) else None
            for leaf, m in zip(leaves, arg_meshes)
        )
        program = Program(
            jaxpr=closed,
            meshes=options.meshes,
            stage_to_mesh=options.stage_to_mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            wanted_out_meshes=wanted_out_meshes,
            in_paths=tuple(in_paths),
            out_paths=tuple(out_paths),
            donated=call.donated(),
            backend=options.backend,
            microbatches=loop.microbatches if loop else None,
            arg_meshes=arg_meshes if any(m is not None for m in arg_meshes) else None,
            arg_blocks=arg_blocks if any(b is not None for b in arg_blocks) else None,
            committed_specs=committed_specs if any(committed_specs) else None,
        )
        # What the ``plan`` pass decides: the first of the pipeline.
        request = PlanRequest(
            schedule=(options.schedule or loop.schedule) if loop else None,
            schedule_from=loop.called_at if loop and not options.schedule else "",
            balanced=wants_balancing(program, options.partition),
        )
        if request != PlanRequest():
            program = program.replace(plan_request=request)
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        signature = Signature(
            in_tree=in_tree,
            in_types=in_types,
            in_paths=tuple(in_paths),
            out_tree=out_tree,
            function=qualified_name(self.fn),
        )
        return Traced(program, signature, passes, name, time.perf_counter() - started)

    def _trace(self, in_tree, call: Call, in_types, shardings):
        """``(closed jaxpr, accumulate loop or None, output treedef, output paths)`` of
        ``fn`` traced on abstract values of ``in_types`` typed with ``shardings`` (see
        :func:`~mpmdc.signatures.type_shardings`), static arguments put back."""
        out_store = {}

        def flat_fn(*leaves):
            dyn, kw = jax.tree_util.tree_unflatten(in_tree, leaves)
            full = list(dyn)
            for i, value in call.static_args:  # in increasing order of i
                full.insert(i, value)
            with recording_loops() as out_store["loops"], placing():
                out = self.fn(*full, **kw, **dict(call.static_kwargs))
            out_leaves, out_store["paths"], out_store["tree"] = checked_outputs(out)
            return out_leaves

        leaf_types = [
            jax.ShapeDtypeStruct(shape, dtype, weak_type=weak, sharding=sharding)
            for (shape, dtype, weak), sharding in zip(in_types, shardings)
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


@compat.api_boundary
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
    options = CompileOptions.parse(
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
    return Wrapped(fn, options)
