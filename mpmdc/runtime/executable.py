"""The runtime's facade: :class:`Compiled`, a lowered program compiled for its meshes,
named and shaped as ``jax.stages.Compiled`` (calls, shardings, analyses, timed runs).

What it runs, and how, is :mod:`mpmdc.runtime.engine`'s; a timed run's threads are
:mod:`mpmdc.runtime.timed`'s.
"""

from __future__ import annotations

import jax

from mpmdc import _jax_compat as compat
from mpmdc import backends, distributed
from mpmdc.errors import MpmdRuntimeError, PassError
from mpmdc.ir.program import Program
from mpmdc.runtime.compiling import FragmentCompiler
from mpmdc.runtime.engine import Engine, announced_fault
from mpmdc.runtime.memory import MeshMemory, memory_profile
from mpmdc.runtime.signature import Signature
from mpmdc.runtime.timed import run_per_mesh_threads


class Compiled:
    """A compiled MPMD program, as ``jax.stages.Compiled``: call it like the function it
    was lowered from (static arguments left out, as they were fixed by ``lower``)."""

    def __init__(
        self, program: Program, signature: Signature, *, compiler: FragmentCompiler | None = None
    ):
        if program.lowerings is None:
            raise PassError("only a lowered program can be compiled; run the `lower` pass first.")
        self.signature = signature
        backend = backends.get(program.backend)
        backend.check_can_run(program.meshes)
        self.multiprocess = distributed.is_multiprocess()
        self._engine = Engine(program, signature, backend, compiler)
        self.program = self._engine.program  # (without its modules: see Engine)

    @property
    def memory(self) -> tuple[MeshMemory, ...]:
        """Per mesh, the peak live intermediate buffers (and activations) of one call."""
        return memory_profile(self.program)

    @property
    def input_shardings(self):
        """Where each argument runs, as ``(args, kwargs)`` pytrees of ``jax.sharding.Sharding``
        (as ``jax.stages.Compiled.input_shardings``): arguments already placed so are not
        moved when called, e.g. ``jax.device_put(args, executable.input_shardings[0])``."""
        return jax.tree_util.tree_unflatten(
            self.signature.in_tree, self._engine.pieces.arg_shardings
        )

    @property
    def output_shardings(self):
        """Where each output lives, a pytree of ``jax.sharding.Sharding`` (as
        ``jax.stages.Compiled.output_shardings``)."""
        return jax.tree_util.tree_unflatten(
            self.signature.out_tree, self._engine.pieces.result_shardings
        )

    @property
    def args_info(self):
        """Each argument's type and whether it is donated, as ``(args, kwargs)`` pytrees of
        ``jax.stages.ArgInfo`` (as ``jax.stages.Compiled.args_info``; static arguments
        left out)."""
        return self.signature.args_info(self._engine.pieces.per_argument(self.program.donated))

    @property
    def argument_specs(self) -> list:
        """Per flat argument, the spec of the sharding a call runs it with (``None``: the
        program chose none), as the call cache compares committed specs with."""
        pieces = self._engine.pieces
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
        for i, key in self._engine.fragment_keys.items():
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
                for name, value in _xla_costs(self._engine.executables[key]).items():
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
            stats = [s for s in (_xla_memory(self._engine.executables[k]) for k in distinct) if s]
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
        return len(self._engine.executables)

    @compat.api_boundary
    def __call__(self, *args, **kwargs):
        """Run on the meshes; returns ``jax.Array``s on the meshes that produced them."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        self.signature.check(args, kwargs, leaves, treedef)
        return self.call_flat(leaves)

    def call_flat(self, leaves):
        """Run with already-checked flat arguments; returns the output pytree (see
        :meth:`~mpmdc.runtime.engine.Engine.run`)."""
        with _no_context_mesh():
            return self._engine.run(leaves)

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
        with _no_context_mesh():
            return self._run_timed(leaves)

    def _run_timed(self, leaves):
        engine = self._engine
        if not self.multiprocess:
            env = engine.start(leaves)
            timeline = run_per_mesh_threads(engine.steps, env, len(self.program.meshes))
            return engine.finish(env), timeline
        # Every process starts its clock as the last one arrives, so the merged
        # timeline of all processes lines up to a barrier's latency.
        engine.check_agreed()  # before meeting on a topic named by the program
        topic = distributed.topic("timed", engine.agreed)
        distributed.barrier(topic)
        env = engine.start(leaves)
        try:
            timeline = run_per_mesh_threads(
                engine.steps, env, len(self.program.meshes), announced_fault
            )
        except MpmdRuntimeError as err:
            distributed.announce_failure(str(err))
            raise
        return engine.finish(env), distributed.merge_timelines(topic, timeline)


def _no_context_mesh():
    """A context without the caller's ``jax.set_mesh`` mesh, for a call's own work
    besides its compiled fragments (a stack cut into its stages' rows, pieces joined, key
    data sent between processes): eager operations on arrays on their own meshes, which
    JAX refuses under a context mesh of another shape. The fragments were traced under
    the caller's context already; their executables do not read it."""
    return jax.set_mesh(None)


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
