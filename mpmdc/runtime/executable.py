"""The runtime: run a split program on its meshes, in one process or in many.

Each fragment's module, as the ``lower`` pass produced it (static shardings,
donation and all), is compiled ahead of time for its mesh, so every call is a plain
executable call and what runs is exactly the StableHLO that ``lower`` shows.
Fragments with the same body, mesh, shardings and donation share one executable.
Transfers are ``device_put`` onto the destination mesh (:mod:`mpmdc.runtime.transfers`).
JAX's asynchronous dispatch lets meshes overlap; each intermediate value is dropped
right after its last use.

With several processes (``jax.distributed``) every process holds the whole program
but compiles and runs only the fragments of meshes with devices here, and the
transfers it takes part in; transfers between processes are issued by all
processes in program order (:mod:`mpmdc.runtime.transfers` says why). Before its first call
the processes check they hold the same program (:mod:`mpmdc.runtime.peers`), and each call
waits for this process's own work under the fault timeout.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from mpmdc import _jax_compat as compat
from mpmdc import backends, distributed
from mpmdc.errors import ArgumentError, MpmdRuntimeError, PassError
from mpmdc.ir.graph import release_plan
from mpmdc.ir.primitives import fragment_p
from mpmdc.ir.program import Phase, Program, fragment_key, is_var
from mpmdc.ir.pytrees import first_difference, skeleton
from mpmdc.ir.sharding import named, program_spec_forms
from mpmdc.runtime.arguments import ArgumentMoves, placed_as
from mpmdc.runtime.compiling import FragmentCompiler
from mpmdc.runtime.memory import MeshMemory, memory_profile
from mpmdc.runtime.peers import Progress, program_entries
from mpmdc.runtime.pieces import Pieces
from mpmdc.runtime.transfers import MeshTransfer, is_here, placeholder, processes_of
from mpmdc.schedules import Action, Slot, Timeline, action_of


@dataclass(frozen=True)
class Signature:
    """The pytree and leaf types an executable was built for."""

    in_tree: Any
    in_types: tuple[tuple, ...]  # per leaf: ``leaf_type``'s (shape, dtype, weak type)
    in_paths: tuple[str, ...]
    out_tree: Any
    function: str = "the function"  # the user's function's name: what processes agree about

    def args_info(self, donated: tuple[bool, ...]):
        """Each argument's type and whether it is ``donated`` (one flag per leaf), as
        ``(args, kwargs)`` pytrees of ``jax.stages.ArgInfo`` (static arguments left out)."""
        infos = [
            jax.stages.ArgInfo(jax.core.ShapedArray(shape, dtype, weak_type=weak), d)
            for (shape, dtype, weak), d in zip(self.in_types, donated)
        ]
        return jax.tree_util.tree_unflatten(self.in_tree, infos)

    def check(self, args, kwargs, leaves, treedef) -> None:
        """Raise ``ArgumentError`` naming the first argument that does not fit.

        A weak type may differ, as with ``jax.stages.Compiled``: the executable then
        computes with the types it was lowered for.
        """
        if treedef != self.in_tree:
            want_args, want_kwargs = skeleton(self.in_tree)
            if len(args) != len(want_args) or sorted(kwargs) != sorted(want_kwargs):
                static = (
                    " (static arguments were fixed by lower(): leave them out)"
                    if len(args) > len(want_args)
                    else ""
                )
                raise ArgumentError(
                    f"called with {len(args)} positional argument(s) and keywords {sorted(kwargs)}, "
                    f"but the executable was lowered for {len(want_args)} and keywords "
                    f"{sorted(want_kwargs)}; pass each argument the way it was passed to lower(){static}."
                )
            found = first_difference((want_args, want_kwargs), (args, kwargs))
            detail = f" ({found.entries})" if found.entries else ""
            raise ArgumentError(
                f"argument {argument_path(found.path)} is {found.got}{detail}, but the executable "
                f"was lowered for {found.want}; call it with the same structure, or lower again."
            )
        for leaf, (shape, dtype, _), path in zip(leaves, self.in_types, self.in_paths):
            got_shape, got_dtype, _ = leaf_type(leaf, path)
            if got_shape != shape or got_dtype != dtype:
                raise ArgumentError(
                    f"argument {path} is {got_dtype}{list(got_shape)} but the executable was "
                    f"lowered for {dtype}{list(shape)}; lower again for the new type."
                )


def leaf_type(x, path: str | None = None) -> tuple:
    """``(shape, dtype, weak type)`` of an argument leaf (array, Python scalar, typed PRNG
    key or ``jax.ShapeDtypeStruct``): what ``jax.jit`` tells argument types apart by.

    A value that is no array, or a traced one, is an ``ArgumentError`` naming ``path``.
    """
    if isinstance(x, jax.core.Tracer):
        raise ArgumentError(
            f"argument {path or '(unnamed)'} is a traced value: the mpmdc program is being "
            f"called inside a JAX transformation (jax.jit, jax.grad, jax.vmap...). It runs on "
            f"its own meshes and cannot be traced; apply the transformation inside instead, "
            f"e.g. mpmdc.compile(jax.grad(fn), meshes)."
        )
    if isinstance(x, jax.Array):
        aval = x.aval
    elif isinstance(x, jax.ShapeDtypeStruct):
        aval = x
    else:
        try:
            aval = jax.typeof(x)
        except TypeError:
            raise ArgumentError(
                f"argument {path or '(unnamed)'} is a {type(x).__name__}, which is no array type; "
                f"pass arrays, numbers or jax.ShapeDtypeStructs, or make the argument "
                f"static with static_argnums."
            ) from None
    return tuple(aval.shape), aval.dtype, bool(aval.weak_type)


def argument_path(path) -> str:
    """A key path into ``(args, kwargs)`` as the user writes it: ``args[0]['w']``."""
    if not path:
        return "(all arguments)"
    head = "args" if path[0].idx == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))


@dataclass
class _Step:
    """One top-level equation, ready to run: read the ``inputs`` slots of the environment,
    call, write the ``outputs`` slots, clear the ``release`` slots."""

    call: Callable
    inputs: list
    outputs: list
    release: list
    mesh: int  # where it runs (a transfer: where the values arrive)
    name: str
    action: Action | None
    effectful: bool  # a fragment with effects (a callback): waited for as it runs
    senders: tuple[int, ...] = ()  # a transfer from other processes: theirs


def _finished(results, effectful: bool):
    """``results`` once computed; for an effectful step also once its effects have run,
    since a step with no results has nothing else to wait on (a callback's error
    surfaces here, where the step can be named, not at some later read)."""
    jax.block_until_ready(results)
    if effectful:
        jax.effects_barrier()
    return results


class _Slots:
    """Where the call loop keeps each value: every value (constant, literal, input,
    result) gets a slot of one list, so the loop reads and writes by index."""

    def __init__(self):
        self.index: dict = {}
        self.initial: list = []  # the list's starting contents: constants and literals

    def __call__(self, atom, value=None) -> int:
        """The slot of ``atom`` (a new one for each literal), holding ``value`` at first."""
        key = atom if is_var(atom) or isinstance(atom, jcore.DropVar) else object()
        if key not in self.index:
            self.index[key] = len(self.initial)
            self.initial.append(atom.val if key is not atom else value)
        return self.index[key]


def _compile_here(program: Program, backend, here: list[bool], compiler=None) -> tuple[dict, dict]:
    """``(fragment key per equation index, executable per key)`` for the fragments of
    meshes here: every module ``lower`` produced (nothing is lowered here, so what runs
    is what ``lower`` shows), through ``compiler`` where the call path already handed
    it modules as they were lowered, else through a new ``FragmentCompiler``."""
    eqns = program.jaxpr.jaxpr.eqns
    keys = {
        i: fragment_key(eqn)
        for i, eqn in enumerate(eqns)
        if eqn.primitive is fragment_p and here[eqn.params["mesh"]]
    }
    with contextlib.ExitStack() as owned:
        if compiler is None or compiler.backend is not backend:
            compiler = owned.enter_context(FragmentCompiler(backend))
        for i, key in keys.items():
            mesh = program.meshes[eqns[i].params["mesh"]]
            compiler.offer(key, eqns[i], mesh, backend, program.lowerings[key])
        return keys, compiler.executables()


class Compiled:
    """A compiled MPMD program, as ``jax.stages.Compiled``: call it like the function it
    was lowered from (static arguments left out, as they were fixed by ``lower``)."""

    def __init__(
        self, program: Program, signature: Signature, *, compiler: FragmentCompiler | None = None
    ):
        if program.lowerings is None:
            raise PassError("only a lowered program can be compiled; run the `lower` pass first.")
        # The program it runs, without its modules: once compiled, each module (an MLIR
        # module in a context of its own) is not needed, and held it would be most of
        # what a compiled program costs in memory (docs/performance.md).
        self.program = program.replace(phase=Phase.SCHEDULED, module_keys=None, lowerings=None)
        self.signature = signature
        backend = backends.get(program.backend)
        backend.check_can_run(program.meshes)
        self.multiprocess = distributed.is_multiprocess()
        here = [is_here(m) for m in program.meshes]
        forms = self._forms = program_spec_forms(program)
        self._in_shardings = [
            named(program.meshes[m], s, v.aval.ndim, forms)
            for v, m, s in zip(program.jaxpr.jaxpr.invars, program.in_meshes, program.in_specs)
        ]
        keys, self._executables = _compile_here(program, backend, here, compiler)
        self._fragment_keys = keys  # equation index -> fragment key, for the analyses
        slots = _Slots()
        for v, c in zip(program.jaxpr.jaxpr.constvars, program.jaxpr.consts):
            slots(v, c)
        # Arguments for meshes elsewhere are not read (their processes place them).
        self._inputs = [
            (slots(v), sharding, path)
            for v, sharding, m, path in zip(
                program.jaxpr.jaxpr.invars, self._in_shardings, program.in_meshes, program.in_paths
            )
            if here[m]
        ]
        self._input_here = [here[m] for m in program.in_meshes]
        self._steps = self._plan_steps(slots, backend, here, keys)
        # What the call loop reads, unpacked once: (call, inputs, outputs, release, wait).
        # An empty release list is None, so the loop skips it with one test.
        self._plan = [
            (st.call, st.inputs, st.outputs, st.release or None, st.effectful) for st in self._steps
        ]
        self._out_shardings, self._outputs = [], []
        for v, m, spec in zip(program.jaxpr.jaxpr.outvars, program.out_meshes, program.out_specs):
            sharding = named(program.meshes[m], spec, v.aval.ndim, forms)
            self._out_shardings.append(sharding)
            # An output living elsewhere is a global array with no shard here.
            self._outputs.append(
                (slots(v), sharding) if here[m] else (None, placeholder(v.aval, sharding))
            )
        self._initial = slots.initial
        self._pieces = Pieces(
            program,
            self._in_shardings,
            self._out_shardings,
            len(signature.in_types),
            signature.out_tree.num_leaves,
        )
        self._moves = ArgumentMoves(
            program.meshes, backend, self._pieces.arg_shardings, signature.in_paths
        )
        # Among several processes, what all must agree on before the first call: offered
        # now, checked at the first call (a collective anyway), so processes may compile
        # ahead of time in any order. The topic is named by the function, not by the
        # program: processes that traced different programs for it meet there, and the
        # check names the difference.
        self._agreement = None
        if self.multiprocess:
            entries = program_entries(program)
            self._agreement = (distributed.topic("program", signature.function), entries)
            distributed.offer_agreement(*self._agreement)
            self._agreed = repr(entries)  # what this program's later exchanges are about

    def _plan_steps(self, slots: _Slots, backend, here: list[bool], keys: dict) -> list[_Step]:
        """One step per top-level equation this process takes part in, in program order."""
        forms = self._forms
        jaxpr = self.program.jaxpr.jaxpr
        meshes = self.program.meshes
        releases = release_plan(jaxpr)
        donated_at = {
            v: i
            for i, eqn in enumerate(jaxpr.eqns)
            if eqn.primitive is fragment_p
            for k, v in enumerate(eqn.invars)
            if k in eqn.params["donate_argnums"]
        }
        direct_calls = {k: compat.direct_call(e) for k, e in self._executables.items()}
        steps = []
        for i, eqn in enumerate(jaxpr.eqns):
            senders: tuple[int, ...] = ()
            if eqn.primitive is fragment_p:
                mesh, name = eqn.params["mesh"], eqn.params["name"]
                if not here[mesh]:
                    continue
                call = direct_calls[keys[i]]
            else:
                src, mesh = eqn.params["src"], eqn.params["dst"]
                name = f"transfer mesh{src}->mesh{mesh}"
                call = MeshTransfer(
                    backend,
                    meshes[src],
                    meshes[mesh],
                    [
                        named(meshes[mesh], s, v.aval.ndim, forms)
                        for v, s in zip(eqn.invars, eqn.params["dst_specs"])
                    ],
                    [v.aval for v in eqn.invars],
                    name,
                    [donated_at.get(v, -1) > i for v in eqn.invars],
                )
                if not (call.everyone or call.sends):
                    continue
                if call.receives and not call.sends:
                    senders = tuple(sorted(set(processes_of(meshes[src]))))
            steps.append(
                _Step(
                    call,
                    [slots(a) for a in eqn.invars],
                    [slots(v) for v in eqn.outvars],
                    [slots.index[v] for v in releases[i] if v in slots.index],
                    mesh,
                    name,
                    action_of(eqn),
                    eqn.primitive is fragment_p and bool(eqn.effects),
                    senders,
                )
            )
        return steps

    @property
    def memory(self) -> tuple[MeshMemory, ...]:
        """Per mesh, the peak live intermediate buffers (and activations) of one call."""
        return memory_profile(self.program)

    @property
    def input_shardings(self):
        """Where each argument runs, as ``(args, kwargs)`` pytrees of ``jax.sharding.Sharding``
        (as ``jax.stages.Compiled.input_shardings``): arguments already placed so are not
        moved when called, e.g. ``jax.device_put(args, executable.input_shardings[0])``."""
        return jax.tree_util.tree_unflatten(self.signature.in_tree, self._pieces.arg_shardings)

    @property
    def output_shardings(self):
        """Where each output lives, a pytree of ``jax.sharding.Sharding`` (as
        ``jax.stages.Compiled.output_shardings``)."""
        return jax.tree_util.tree_unflatten(self.signature.out_tree, self._pieces.result_shardings)

    @property
    def args_info(self):
        """Each argument's type and whether it is donated, as ``(args, kwargs)`` pytrees of
        ``jax.stages.ArgInfo`` (as ``jax.stages.Compiled.args_info``; static arguments
        left out)."""
        return self.signature.args_info(self._pieces.per_argument(self.program.donated))

    @property
    def argument_specs(self) -> list:
        """Per flat argument, the spec of the sharding a call runs it with (``None``: the
        program chose none), as the call cache compares committed specs with."""
        pieces = self._pieces
        return [
            spec if len(group) == 1 else sharding.spec
            for spec, sharding, group in zip(
                pieces.per_argument(self.program.in_specs), pieces.arg_shardings, pieces.in_groups
            )
        ]

    def _fragments_by_mesh(self) -> dict[int, list]:
        """``{mesh: [fragment key per fragment call of one step]}`` for meshes here, in
        program order (a key repeats for each microbatch that runs it)."""
        eqns = self.program.jaxpr.jaxpr.eqns
        calls: dict[int, list] = {}
        for i, key in self._fragment_keys.items():
            calls.setdefault(eqns[i].params["mesh"], []).append(key)
        return dict(sorted(calls.items()))

    def cost_analysis(self) -> dict[int, dict[str, float]]:
        """XLA's cost estimate of one call, per mesh: ``{mesh index: {"flops": ...,
        "transcendentals": ..., "bytes accessed": ..., ...}}``.

        Each figure is summed over the fragment calls the mesh makes in one step, so a
        stage's fragment that runs once per microbatch counts once per microbatch. Only
        XLA's figures for whole modules are kept (its per-operand ones such as
        ``bytes accessed0{}`` do not add up across fragments). Meshes of other processes
        are left out, as are fragments whose executable gives no estimate.
        """
        out: dict[int, dict[str, float]] = {}
        for mesh, keys in self._fragments_by_mesh().items():
            totals: dict[str, float] = {}
            for key in keys:
                for name, value in _xla_costs(self._executables[key]).items():
                    totals[name] = totals.get(name, 0.0) + value
            out[mesh] = dict(sorted(totals.items()))
        return out

    def memory_analysis(self) -> dict[int, dict[str, int]]:
        """XLA's memory figures per mesh: ``{mesh index: {"generated_code_size_in_bytes":
        ..., "argument_size_in_bytes": ..., "output_size_in_bytes": ...,
        "alias_size_in_bytes": ..., "temp_size_in_bytes": ...}}``.

        Code size is summed over the mesh's distinct executables (all stay loaded); the
        other figures are the largest of any one fragment's, since a mesh runs its
        fragments one after another. Buffers that live from one fragment to a later one
        (activations kept for the backward) are :attr:`memory`'s. Meshes of other
        processes, and fragments whose executable gives no figures, are left out.
        """
        out: dict[int, dict[str, int]] = {}
        for mesh, keys in self._fragments_by_mesh().items():
            distinct = dict.fromkeys(keys)  # each executable once, in program order
            stats = [s for s in (_xla_memory(self._executables[k]) for k in distinct) if s]
            if not stats:
                continue
            figures = {"generated_code_size_in_bytes": sum(s[0] for s in stats)}
            for k, name in enumerate(_PER_FRAGMENT_MEMORY, start=1):
                figures[name] = max(s[k] for s in stats)
            out[mesh] = figures
        return out

    @property
    def num_executables(self) -> int:
        """How many distinct compiled fragment executables back this program."""
        return len(self._executables)

    def __call__(self, *args, **kwargs):
        """Run on the meshes; returns ``jax.Array``s on the meshes that produced them."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        self.signature.check(args, kwargs, leaves, treedef)
        return self.call_flat(leaves)

    def call_flat(self, leaves):
        """Run with already-checked flat arguments; returns the output pytree.

        Among several processes the loop also keeps track of the results in flight, so
        that the call ends only when this process's work is done, or fails within the
        fault timeout (:class:`~mpmdc.runtime.peers.Progress`).
        """
        self._check_alive(leaves)
        env = self._start(leaves)
        read = env.__getitem__
        progress = Progress(_announced_fault) if self.multiprocess else None
        k, results = 0, None
        try:
            for call, inputs, outputs, release, wait in self._plan:
                results = call(*map(read, inputs))
                if wait:
                    _finished(results, True)
                for i, value in zip(outputs, results):
                    env[i] = value
                if release:
                    for i in release:
                        env[i] = None
                if progress is not None:
                    progress.add(self._steps[k], results)
                    progress.settle()
                k += 1
            if progress is not None:
                progress.wait()
        except MpmdRuntimeError:  # from ``progress``: already told to the peers
            env.clear()
            raise
        except Exception as err:
            # The traceback keeps this frame alive; the buffers it holds need not live on.
            env.clear()
            results = None
            raise (_announced_fault if self.multiprocess else _fault)(self._steps[k], err) from err
        return self._finish(env)

    def _check_alive(self, leaves) -> None:
        """An ``ArgumentError`` naming an argument whose buffer is gone, checked before
        anything runs: otherwise the first fragment reading it fails, naming only itself."""
        for x, path in zip(leaves, self.signature.in_paths):
            if isinstance(x, jax.Array) and x.is_deleted():
                raise ArgumentError(
                    f"argument {path} was donated to an earlier call (or deleted), so its "
                    f"buffer is gone. Pass what that call returned in its place (a training "
                    f"loop feeds results back: params = step(params, ...)), or leave it out of "
                    f"donate_argnums to keep it."
                )

    def _check_agreed(self) -> None:
        """At the first call among several processes: every process compiled this program."""
        if self._agreement is not None:
            distributed.check_agreement(*self._agreement, "the program they compiled")
            self._agreement = None

    def _start(self, leaves) -> list:
        self._check_agreed()
        if self.multiprocess:  # what only another process can send, every process moves
            leaves = self._moves.across_processes(leaves)
        env = list(self._initial)
        leaves = self._pieces.arguments(leaves, self._input_here)
        for (i, sharding, path), x in zip(self._inputs, self._local_leaves(leaves)):
            placed = _placed(x, sharding)
            if placed is not x:
                self._moves.warn(path, x, sharding)
            env[i] = placed
        return env

    def _local_leaves(self, leaves):
        if len(self._inputs) == len(leaves):
            return leaves
        return [x for x, here in zip(leaves, self._input_here) if here]

    def _finish(self, env):
        outs = []
        for v, target in self._outputs:
            outs.append(target if v is None else _placed(env[v], target))
        return jax.tree_util.tree_unflatten(self.signature.out_tree, self._pieces.results(outs))

    def run_timed(self, *args, **kwargs):
        """Run once, one thread per mesh, and measure when each fragment and transfer ran.

        Returns ``(outputs, timeline)``: a :class:`~mpmdc.schedules.simulate.Timeline` in
        milliseconds from the start of the step, with a slot per fragment (its schedule
        action where it has one) and per transfer (on the receiving mesh). Each mesh
        waits for its work to finish before timing the next piece, so this run is a
        little slower than a plain call; ``timeline.chrome_trace()`` writes it for Perfetto.

        With several processes every process must call it (like a plain call); each
        measures its own meshes and all get the merged timeline of every mesh.
        """
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        self.signature.check(args, kwargs, leaves, treedef)
        if not self.multiprocess:
            env = self._start(leaves)
            timeline = run_per_mesh_threads(self._steps, env, len(self.program.meshes))
            return self._finish(env), timeline
        # Every process starts its clock as the last one arrives, so the merged
        # timeline of all processes lines up to a barrier's latency.
        self._check_agreed()  # before meeting on a topic named by the program
        topic = distributed.topic("timed", self._agreed)
        distributed.barrier(topic)
        env = self._start(leaves)
        try:
            timeline = run_per_mesh_threads(
                self._steps, env, len(self.program.meshes), _announced_fault
            )
        except MpmdRuntimeError as err:
            distributed.announce_failure(str(err))
            raise
        return self._finish(env), distributed.merge_timelines(topic, timeline)


# Memory figures of one fragment that do not add up over a mesh's fragments: the mesh
# needs the largest of them at any time (its fragments run one after another).
_PER_FRAGMENT_MEMORY = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
)


def _xla_costs(executable) -> dict[str, float]:
    """XLA's whole-module cost figures of one fragment's executable (``{}`` for one
    that gives none, as a backend's own callable may not)."""
    analyse = getattr(executable, "cost_analysis", None)
    costs = analyse() if analyse is not None else None
    if isinstance(costs, (list, tuple)):  # one entry per device program in older JAX
        costs = costs[0] if costs else None
    return {k: float(v) for k, v in (costs or {}).items() if "{" not in k}


def _xla_memory(executable) -> tuple[int, ...] | None:
    """``(generated code size, *_PER_FRAGMENT_MEMORY)`` of one fragment's executable, or
    ``None`` where it gives no figures."""
    analyse = getattr(executable, "memory_analysis", None)
    stats = analyse() if analyse is not None else None
    if stats is None:
        return None
    return (stats.generated_code_size_in_bytes, *(getattr(stats, n) for n in _PER_FRAGMENT_MEMORY))


def _fault(step: _Step, err: Exception, among_processes: bool = False) -> MpmdRuntimeError:
    """``err``, raised while ``step`` ran, as an error naming the fragment and where it ran
    (with ``err`` as its cause, also when raised from another thread)."""
    where = f"{step.name} on mesh{step.mesh}"
    if step.action is not None:
        where += f" (stage {step.action.stage}, microbatch {step.action.microbatch})"
    if among_processes:
        where = f"process {jax.process_index()}: {where}"
        if step.senders:
            where += f", sent by process {', '.join(map(str, step.senders))},"
    detail = str(err).strip().splitlines()
    summary = (detail[-1] if detail else "").rstrip(".")
    if not re.match(r"[\w.]+(Error|Exception): ", summary):  # XLA's text often names the cause
        summary = f"{type(err).__name__}: {summary}"
    if not among_processes:
        then = "The call was abandoned and its intermediate buffers freed; the executable can be called again."
    elif step.senders:
        then = "The connection to the sender broke: that process has probably died; see its output."
    else:
        then = "The other processes are told; this run cannot go on."
    error = MpmdRuntimeError(f"{where} failed while running: {summary}. {then}")
    error.__cause__ = err
    if not among_processes:
        # Waiting on the tokens is safe in one process; with several, a computation may
        # still wait on a peer that died, and this run ends anyway.
        compat.drop_failed_effect_tokens()
    return error


def _announced_fault(step: _Step, err: Exception) -> MpmdRuntimeError:
    """``_fault``, also told to the other processes (which may be waiting on this one)."""
    error = _fault(step, err, among_processes=True)
    distributed.announce_failure(f"{error}")
    return error


def _placed(x, sharding):
    """``x`` with ``sharding``; an array already placed so (or equivalently: a one-device
    array on a one-device mesh) is passed through untouched, saving a ``device_put``.

    A mesh with devices on other processes too gets a global array of which this
    process makes only its own shards, from a host value equal on all processes.
    """
    if placed_as(x, sharding):
        return x
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)


def run_per_mesh_threads(steps: list[_Step], env: list, num_meshes: int, fault=None) -> Timeline:
    """Run ``steps`` with one thread per mesh, each in program order; bind results in ``env``.

    A step waits until its inputs exist. Values are dropped once every reader has
    run, as in a plain call. The first error stops every thread and is raised
    (made by ``fault(step, error)``, default ``_fault``).

    Transfers every process issues (between processes) go from one more thread, in
    program order, as JAX pairs them by that order; the mesh that reads a value
    received so then waits for its arrival, and that wait is its transfer's slot.
    """
    fault = fault or _fault
    ready = {v: threading.Event() for step in steps for v in step.outputs}
    readers: dict = {}
    for step in steps:
        for a in step.inputs:
            if a in ready:
                readers[a] = readers.get(a, 0) + 1
    released = {v for step in steps for v in step.release}
    in_order = [s for s in steps if getattr(s.call, "everyone", False)]
    lane_of = {id(s): None if getattr(s.call, "everyone", False) else s.mesh for s in steps}
    arriving = {v: s for s in in_order if s.call.receives for v in s.outputs}
    lock = threading.Lock()
    failed: list[BaseException] = []  # the first error, as raised to the caller
    slots: list[list[Slot]] = [[] for _ in range(num_meshes)]
    t0 = time.perf_counter()

    def wait(v) -> bool:
        while not ready[v].wait(0.05):
            if failed:
                return False
        return True

    def bind(step, results):
        with lock:
            for i, value in zip(step.outputs, results):
                env[i] = value
            for a in step.inputs:
                if a in readers:
                    readers[a] -= 1
                    if readers[a] == 0 and a in released:
                        env[a] = None
        for v in step.outputs:
            ready[v].set()

    def await_arrivals(step, mesh: int):
        for a in step.inputs:
            transfer = arriving.pop(a, None)
            if transfer is not None:
                start = time.perf_counter()
                try:
                    jax.block_until_ready([env[i] for i in transfer.outputs])
                except Exception as err:
                    raise _StepFailed(transfer, err) from None
                slots[mesh].append(
                    Slot(None, (start - t0) * 1e3, (time.perf_counter() - t0) * 1e3, transfer.name)
                )

    def worker(mesh: int | None):
        step = None
        try:
            for step in (s for s in steps if lane_of[id(s)] == mesh):
                if not all(wait(a) for a in step.inputs if a in ready):
                    return
                if mesh is not None:
                    await_arrivals(step, mesh)
                    start = time.perf_counter()
                    results = _finished(step.call(*[env[i] for i in step.inputs]), step.effectful)
                    end = time.perf_counter()
                    slots[mesh].append(
                        Slot(step.action, (start - t0) * 1e3, (end - t0) * 1e3, step.name)
                    )
                else:
                    results = step.call(*[env[i] for i in step.inputs])
                bind(step, results)
        except _StepFailed as err:
            failed.append(fault(err.step, err.error))
        except Exception as err:  # re-raised by the caller's thread
            results = None
            failed.append(fault(step, err))

    lanes = sorted({m for m in lane_of.values() if m is not None})
    threads = [threading.Thread(target=worker, args=(m,), name=f"mpmdc-mesh{m}") for m in lanes]
    if in_order:
        threads.append(threading.Thread(target=worker, args=(None,), name="mpmdc-transfers"))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        env.clear()
        raise failed[0]
    return Timeline(tuple(tuple(row) for row in slots))


class _StepFailed(Exception):
    """A step's results failed where another step waited for them."""

    def __init__(self, step: _Step, error: Exception):
        super().__init__(str(error))
        self.step, self.error = step, error
