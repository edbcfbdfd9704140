"""Estimated seconds and bytes of a split program's fragments, per stage and kind.

XLA's cost analysis of each fragment's StableHLO gives its flops and bytes accessed; the
platform's :class:`Throughput` turns them into seconds (a roofline: the larger of compute
and memory time). :func:`estimate` adds what each stage reads of the program's inputs
(held all step), what its forwards keep for its backwards (per microbatch) and the bytes
one stage's loop fragments send another. The ``plan`` pass decides from these
(``partition="balanced"`` and ``schedule="auto"``).
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from mpmdc import backends, schedules
from mpmdc.errors import PassError
from mpmdc.ir.primitives import LOOP, ActionKind, LoopEdge, fragment_p, is_loop_edge
from mpmdc.ir.program import Phase, Program, is_var, nbytes
from mpmdc.ir.sharding import program_spec_forms
from mpmdc.lowering import lower_fragment
from mpmdc.pipeline import Pass, run_pipeline


@dataclass(frozen=True)
class Throughput:
    """What a device does per second: ``flops``, memory ``bytes`` and ``link`` bytes to
    another mesh. Rough public figures per platform; only their ratios steer choices."""

    flops: float
    bytes: float
    link: float


THROUGHPUT = {
    "cpu": Throughput(flops=1e11, bytes=2e10, link=1e10),
    "cuda": Throughput(flops=4e14, bytes=2e12, link=5e10),
    "rocm": Throughput(flops=4e14, bytes=2e12, link=5e10),
    "tpu": Throughput(flops=2e14, bytes=1e12, link=1e11),
}


@dataclass(frozen=True)
class Estimate:
    """A split program's estimated costs, per stage (``num_stages`` of them).

    ``seconds[s, kind]``: stage ``s``'s loop fragments of ``kind`` (F, B, I, W), per
    microbatch; ``after_loop[s]``: its fragments after the loop (the update), per step;
    ``held[s]``: bytes of program inputs it reads; ``activations[s]``: bytes its
    forward keeps for its backward, per microbatch; ``flow[i, j]``: bytes per
    microbatch stage ``i``'s loop fragments send stage ``j``'s; ``link``: seconds per
    byte between meshes.
    """

    num_stages: int
    seconds: dict
    after_loop: np.ndarray
    held: np.ndarray
    activations: np.ndarray
    flow: np.ndarray
    link: float

    @functools.cached_property
    def action_cost(self) -> Callable[[schedules.Action], float]:
        """Seconds of an action, per microbatch (``schedules.by_kind``'s rules for a
        backward estimated whole or in halves): what a simulation calls per action."""
        return schedules.by_kind(lambda s, k: self.seconds.get((s, k)))

    def cost(self, stage: int, kind: ActionKind) -> float:
        """Seconds of stage ``stage``'s ``kind`` per microbatch."""
        return self.action_cost(schedules.Action(stage, kind, 0))


def trial_split(program: Program, through: list[Pass]) -> Program:
    """The traced ``program`` taken through ``through`` (the pipeline's passes up to
    ``split``, its loop still rolled) to be estimated, not run. What the trial's layout
    would warn of is left unsaid: the pipeline that runs the planned program says what
    applies to it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trial = run_pipeline(program.replace(phase=Phase.PLANNED, plan_request=None), through)
    if trial.phase < Phase.SPLIT:
        names = ", ".join(p.name for p in through) or "no pass"
        raise PassError(
            f"the `plan` pass estimates fragments, but its trial run ({names}) does not "
            f"split the program: give it the passes up to `split` (its option `through`), "
            f"or leave the option out for the default pipeline's."
        )
    return trial


def memory_limit(mesh) -> int | None:
    """Bytes of memory ``mesh``'s devices have together, ``None`` where the platform does
    not say (CPU): the smallest of its devices this process holds (of this process's
    first device where it holds none, as only a device's own process can ask it) times
    its device count, so every process of a run of like devices computes the same."""
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    limits = [
        (d.memory_stats() or {}).get("bytes_limit") for d in devices or jax.local_devices()[:1]
    ]
    return None if None in limits else min(limits) * mesh.devices.size


def estimate(program: Program, num_stages: int) -> Estimate:
    """The :class:`Estimate` of the split ``program`` (its loop still rolled)."""
    chosen = backends.get(program.backend)
    throughput = THROUGHPUT[chosen.platform]
    forms = program_spec_forms(program)
    seconds: dict = defaultdict(float)
    after_loop = np.zeros(num_stages)
    held = np.zeros(num_stages, dtype=np.int64)
    activations = np.zeros(num_stages, dtype=np.int64)
    flow = np.zeros((num_stages, num_stages))
    # value -> (stage, kind, in the loop) of the fragment that made it
    producer: dict = {}
    inputs = set(program.jaxpr.jaxpr.invars)
    rows: set = set()  # (a microbatch's rows of the batch, and their copies on other meshes)
    counted: set = set()
    kept: set = set()
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive is not fragment_p:  # a transfer or loop edge: values pass through
            for a, v in zip(eqn.invars, eqn.outvars):
                if is_var(a) and a in producer:
                    producer[v] = producer[a]
                elif is_var(a) and a in inputs:
                    inputs.add(v)
                if is_var(a) and (a in rows or is_loop_edge(eqn, LoopEdge.SLICE)):
                    rows.add(v)
            continue
        s, kind = eqn.params["stage"], eqn.params["kind"]
        # Without a microbatch loop every fragment is the one microbatch's.
        in_loop = eqn.params["microbatch"] is LOOP or program.microbatches is None
        cost = lower_fragment(program, eqn, chosen, forms).cost_analysis() or {}
        took = max(
            cost.get("flops", 0.0) / throughput.flops,
            cost.get("bytes accessed", 0.0) / throughput.bytes,
        )
        if in_loop:
            seconds[s, kind] += took
        else:
            after_loop[s] += took
        for a in filter(is_var, eqn.invars):
            if a in rows and in_loop and (a, s) not in kept:
                # A microbatch's rows are held from the loop's start of it to the last
                # call reading them here (the first stage's backward, the last's loss).
                kept.add((a, s))
                activations[s] += nbytes(a.aval)
            if a in inputs and (a, s) not in counted:
                counted.add((a, s))
                held[s] += nbytes(a.aval)
            source = producer.get(a)
            if source is None or not in_loop or not source[2]:
                continue
            if source[0] != s:
                flow[source[0], s] += nbytes(a.aval)
            # A forward's value (its own or one received) that a backward reads is held
            # from then until that backward: kept once, if both halves of a cut one read it.
            if source[1] is ActionKind.F and kind is not ActionKind.F and (a, s) not in kept:
                kept.add((a, s))
                activations[s] += nbytes(a.aval)
        for v in eqn.outvars:
            producer[v] = (s, kind, in_loop)
    return Estimate(
        num_stages, dict(seconds), after_loop, held, activations, flow, 1.0 / throughput.link
    )
