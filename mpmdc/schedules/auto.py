"""Choosing a schedule from the pipeline's costs: ``schedule="auto"``, or a function.

A :class:`Pipeline` says what is known when the choice is made: stages, meshes,
microbatches, the placement the user gave (if any), each action's seconds (estimated
from the fragments, or measured by ``Compiled.run_timed``), each stage's activation
bytes per microbatch and each mesh's activation memory cap. :func:`evaluate` simulates a
schedule on it: the step time with steps back to back (:func:`~mpmdc.schedules.simulate.
step_time`), its bubble, and the most activation bytes each mesh holds.

:class:`Auto` (``"auto"``) evaluates every built-in schedule that runs the layout, and
schedules it synthesizes by list scheduling at these costs (:mod:`mpmdc.schedules.greedy`)
for several priorities and in-flight caps, and takes the fastest that fits every mesh's
cap. A function ``fn(pipeline) -> schedule`` chooses as the user likes; mpmdc evaluates
what it returns the same way.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mpmdc.errors import MpmdcError, ScheduleError
from mpmdc.ir.primitives import ActionKind
from mpmdc.ir.program import ScheduleChoice
from mpmdc.schedules.actions import Action, Layout
from mpmdc.schedules.greedy import list_schedule
from mpmdc.schedules.library import (
    CHOOSERS,
    SCHEDULES,
    ActionLists,
    Chooser,
    Schedule,
    get,
    v_placement,
)
from mpmdc.schedules.simulate import by_kind, in_flight, steady
from mpmdc.schedules.timeline import Timeline

# Above this many actions per step, ``Auto`` tries fewer synthesized candidates: the
# usual priorities and caps, not every order of them.
_SMALL = 64


@dataclass(frozen=True)
class Pipeline:
    """What a schedule is chosen from.

    ``stage_to_mesh``: the user's placement, or ``None`` (each schedule places its
    stages); ``cost(action)``: seconds; ``activations[s]``: bytes stage ``s`` keeps per
    microbatch in flight; ``memory_cap[mesh]``: bytes of activations the mesh may hold
    (``None``: no cap of its own); ``held[s]``: bytes stage ``s`` holds all step and
    ``memory[mesh]``: the mesh's devices' memory (``None``: unknown), which cap the
    activations too once a placement puts stages on the mesh.
    """

    num_stages: int
    num_meshes: int
    microbatches: int
    stage_to_mesh: tuple[int, ...] | None
    cost: Callable[[Action], float]
    activations: tuple[float, ...]
    memory_cap: tuple[float | None, ...]
    held: tuple[float, ...] = ()
    memory: tuple[float | None, ...] = ()

    def layout(self, schedule: Schedule) -> Layout:
        """The layout ``schedule`` runs: the user's placement, else the schedule's own."""
        placement = self.stage_to_mesh or schedule.placement(self.num_stages, self.num_meshes)
        return Layout.make(
            self.num_stages, self.microbatches, placement, num_meshes=self.num_meshes
        )

    def check_costs(self) -> None:
        """A ``ScheduleError`` naming the first action whose cost is not seconds (a
        non-negative number), as a costs function of the user's might return."""
        for stage, kind in itertools.product(range(self.num_stages), ActionKind):
            for microbatch in range(self.microbatches):
                action = Action(stage, kind, microbatch)
                seconds = self.cost(action)
                if not _is_seconds(seconds):
                    raise ScheduleError(
                        f"the cost of {action} is {seconds!r:.40}; a costs function returns "
                        f"the action's seconds, a non-negative number."
                    )

    def caps(self, layout: Layout) -> tuple[float | None, ...]:
        """Per mesh, the bytes of activations it may hold in ``layout``: its own cap, and
        its memory less what its stages hold all step."""
        out = []
        for mesh in range(self.num_meshes):
            limits = [self.memory_cap[mesh]]
            if self.memory and self.memory[mesh] is not None:
                held = sum(self.held[s] for s in layout.stages_of(mesh)) if self.held else 0.0
                limits.append(self.memory[mesh] - held)
            known = [x for x in limits if x is not None]
            out.append(min(known) if known else None)
        return tuple(out)


@dataclass(frozen=True)
class Evaluation:
    """A schedule simulated on a :class:`Pipeline`."""

    schedule: Schedule
    step_time: float
    bubble: float
    peak_memory: tuple[float, ...]


def evaluate(schedule: Schedule, pipeline: Pipeline) -> Evaluation:
    """``schedule``'s step time (steps back to back), bubble and peak activation bytes per
    mesh on ``pipeline``; a ``ScheduleError`` if it cannot run the layout or a mesh would
    hold more than its cap."""
    layout = pipeline.layout(schedule)
    per_mesh = schedule.actions(layout)
    took, busy = steady(per_mesh, layout, pipeline.cost)
    peaks = in_flight(per_mesh, lambda stage: pipeline.activations[stage])
    for mesh, (peak, cap) in enumerate(zip(peaks, pipeline.caps(layout), strict=True)):
        if cap is not None and peak > cap:
            raise ScheduleError(
                f"{_label(schedule)} holds {peak / 1e6:.4g} MB of activations on mesh "
                f"{mesh}, over its cap of {cap / 1e6:.4g} MB."
            )
    return Evaluation(schedule, took, took - busy, peaks)


def _key(found: Evaluation) -> tuple[float, float]:
    """What ``Auto`` minimizes: step time, then peak memory; differences below a part in
    a billion (float rounding in the simulation) are ties."""
    return (round(found.step_time, 9 - _magnitude(found.step_time)), max(found.peak_memory))


def _magnitude(x: float) -> int:
    return 0 if x <= 0 else math.floor(math.log10(x))


def _label(schedule: Schedule) -> str:
    return schedule.name if type(schedule) in SCHEDULES.values() else repr(schedule)


class Synthesized(ActionLists):
    """A schedule found by list scheduling at a pipeline's costs: its action lists, its
    placement and how it was found."""

    name = "synthesized"

    def __init__(self, per_mesh, stage_to_mesh: tuple[int, ...], how: str):
        super().__init__(per_mesh)
        self.stage_to_mesh = stage_to_mesh
        self.how = how

    def placement(self, num_stages, num_meshes):
        """The placement it was synthesized for (where the stage count matches)."""
        return self.stage_to_mesh if len(self.stage_to_mesh) == num_stages else None

    def __repr__(self) -> str:
        return f"Synthesized({self.how!r})"


class Auto(Chooser):
    """The fastest of the built-in and synthesized schedules that fit every mesh's cap.

    ``memory_cap``: bytes of activations a mesh may hold (one number for every mesh, or
    one per mesh; default: what the devices report having, none on CPU); ``costs``:
    measured costs (``Compiled.run_timed()``'s ``Timeline``, a mapping from kind or
    action label to seconds, or a function of an action) instead of estimates from the
    fragments. Either of another type is a ``ScheduleError`` here.
    """

    name = "auto"

    def __init__(self, memory_cap=None, costs=None):
        self.memory_cap = _checked_cap(memory_cap)
        self.costs = _checked_costs(costs)

    def choose(self, pipeline):
        pipeline.check_costs()  # (a candidate's ScheduleError only rules the candidate out)
        tried: list[tuple[str, float | None, str]] = []
        best: Evaluation | None = None
        for candidate in candidates(pipeline):
            try:
                found = evaluate(candidate, pipeline)
            except ScheduleError as err:
                tried.append((_label(candidate), None, str(err).split(";")[0].rstrip(".")))
                continue
            tried.append((_label(candidate), found.step_time, ""))
            # Built-in schedules come first and keep a tie: a name says more than lists.
            if best is None or _key(found) < _key(best):
                best = found
        if best is None:
            over = [(name, why) for name, _, why in tried if "over its cap" in why]
            shown = "; ".join(f"{name} {why.split(' holds ', 1)[-1]}" for name, why in over[:3])
            # (A schedule synthesized under the cap fits it: none was found.)
            raise ScheduleError(
                f"none of the {len(tried)} built-in schedules runs {pipeline.num_stages} "
                f"stages on {pipeline.num_meshes} meshes within the memory cap, nor does "
                f"any order list scheduling finds"
                + (f" (e.g. {shown})" if shown else "")
                + "; raise the cap or use more microbatches of smaller size."
            )
        tried.sort(key=lambda t: (t[1] is None, t[1] or 0.0))
        choice = ScheduleChoice(
            _label(best.schedule), best.step_time, best.bubble, best.peak_memory, tuple(tried)
        )
        return best.schedule, choice


def _checked_cap(cap):
    """``memory_cap`` as ``None``, a float or a tuple of floats or ``None``s: checked."""
    if cap is None:
        return None
    one = isinstance(cap, numbers.Real) and not isinstance(cap, bool)
    caps = (cap,) if one else tuple(cap) if isinstance(cap, (list, tuple)) else None
    if caps is None or not all(
        c is None or (isinstance(c, numbers.Real) and not isinstance(c, bool) and c >= 0)
        for c in caps
    ):
        raise ScheduleError(
            f"memory_cap={cap!r}: give bytes of activations a mesh may hold, as one "
            f"non-negative number or one per mesh (None for no cap)."
        )
    return float(cap) if one else tuple(None if c is None else float(c) for c in caps)


def _checked_costs(costs):
    """``costs`` as given, checked: ``None``, a ``Timeline``, a function of an action, or
    a mapping from kind or action label to seconds."""
    if costs is None or isinstance(costs, Timeline) or _is_function(costs):
        return costs
    if not isinstance(costs, Mapping):
        raise ScheduleError(
            f"costs={costs!r:.40} is {type(costs).__name__}, not measured costs: give "
            f"Compiled.run_timed()'s Timeline, a mapping from kind ('F', 'B', 'I', 'W') or "
            f"action label ('0F1') to seconds, or a function of an action returning seconds; "
            f"leave costs out to estimate them from the program."
        )
    for key, seconds in costs.items():
        if not (key in tuple(ActionKind) or isinstance(key, Action)):
            try:
                Action.parse(key)
            except ScheduleError:
                raise ScheduleError(
                    f"costs has the key {key!r}, which is neither an action kind (F, B, I, "
                    f"W) nor an action label such as '0F1'; key each cost by one of them."
                ) from None
        if not _is_seconds(seconds):
            raise ScheduleError(
                f"costs[{key!r}] is {seconds!r:.40}; give seconds, a non-negative number."
            )
    return costs


def _is_function(costs) -> bool:
    return callable(costs) and not isinstance(costs, (type, Mapping))


def _is_seconds(value) -> bool:
    """Whether ``value`` is a number of seconds: a non-negative real (NumPy's and 0-d
    arrays' included), not a string or a bool."""
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        return False
    try:
        return float(value) >= 0
    except (TypeError, ValueError):  # (an array of several values)
        return False


class ChosenBy(Chooser):
    """A user's function ``fn(pipeline) -> schedule`` (a name, a ``Schedule`` or action
    lists), evaluated like ``Auto``'s candidates."""

    def __init__(self, fn: Callable[[Pipeline], object]):
        self.fn = fn
        self.name = getattr(fn, "__name__", "chooser")

    def choose(self, pipeline):
        try:
            returned = self.fn(pipeline)
        except MpmdcError:
            raise
        except Exception as err:
            raise ScheduleError(
                f"the schedule function {self.name} raised {type(err).__name__}: {err} "
                f"(its traceback is above this one); fix it, or pass a schedule by name."
            ) from err
        try:
            schedule = get(returned)
        except ScheduleError:
            schedule = None
        if not isinstance(schedule, Schedule):
            raise ScheduleError(
                f"the schedule function {self.name} returned {returned!r}; return a schedule "
                f"name (not 'auto'), an mpmdc.schedules.Schedule or per-mesh action lists."
            )
        found = evaluate(schedule, pipeline)
        label = _label(schedule)
        considered = ((label, found.step_time, ""),)
        return schedule, ScheduleChoice(
            label, found.step_time, found.bubble, found.peak_memory, considered
        )

    def __repr__(self) -> str:
        return f"ChosenBy({self.name})"


def candidates(pipeline: Pipeline) -> list[Schedule]:
    """The built-in schedules, then list schedules at the pipeline's costs: per placement
    (the user's, else round robin and, for 2M stages, the V), backwards split or whole, a
    priority among the kinds, and a cap (the memory cap's, 1F1B's ``p`` and ZB-H2's
    ``2p - 1`` microbatches per mesh; every cap up to the memory's on small pipelines)."""
    out: list[Schedule] = [cls() for cls in SCHEDULES.values()]
    n, p, m = pipeline.num_stages, pipeline.num_meshes, pipeline.microbatches
    placements = (
        [pipeline.stage_to_mesh] if pipeline.stage_to_mesh else [tuple(s % p for s in range(n))]
    )
    if pipeline.stage_to_mesh is None and n == 2 * p:
        placements.append(v_placement(p))
    small = 3 * n * m <= _SMALL
    for placement in placements:
        layout = Layout.make(n, m, placement, num_meshes=p)
        weight = max(pipeline.activations) or 1.0
        for split in (True, False):
            kinds = (
                (ActionKind.F, ActionKind.I, ActionKind.W)
                if split
                else (
                    ActionKind.F,
                    ActionKind.B,
                )
            )
            orders = list(itertools.permutations(kinds))
            if not small:
                orders = [o for o in orders if o[-1] is not ActionKind.F][:3]
            caps = range(1, m * len(layout.stages_of(0)) + 1) if small else (p, 2 * p - 1)
            memory = pipeline.caps(layout)
            for order, units in itertools.product(orders, caps):
                cap = _cap(memory, units * weight)
                try:
                    per_mesh = list_schedule(
                        layout,
                        cap=cap,
                        priority=lambda a, order=order: (order.index(a.kind), -a.stage),
                        split=split,
                        cost=pipeline.cost,
                        weight=lambda stage: pipeline.activations[stage] or 0.0,
                    )
                except ScheduleError:
                    continue
                # (A cap of bytes, ``units`` microbatches of the largest stage: a mesh
                # may hold parts of more microbatches' activations within it.)
                how = (
                    f"{'>'.join(order)} first, at most {units} microbatches' worth of "
                    f"activations per mesh, stage_to_mesh={list(placement)}"
                )
                out.append(Synthesized(per_mesh, placement, how))
    return out


def _cap(memory: tuple[float | None, ...], limit: float) -> Callable[[int], float]:
    """Per mesh, the smaller of ``limit`` and its memory cap."""
    return lambda mesh: limit if memory[mesh] is None else min(limit, memory[mesh])


def _reported(costs: Callable[[Action], float]) -> Callable[[Action], float]:
    """The user's cost function, raising a ``ScheduleError`` naming it and the action
    where it raises (not an internal error of the pass choosing the schedule)."""
    name = getattr(costs, "__name__", "costs")

    def cost(action: Action) -> float:
        try:
            return costs(action)
        except MpmdcError:
            raise
        except Exception as err:
            raise ScheduleError(
                f"the costs function {name} raised {type(err).__name__} for action {action}: "
                f"{err} (its traceback is above this one); it must return the seconds of "
                f"every action."
            ) from err

    return cost


def measured(costs) -> Callable[[Action], float] | None:
    """A cost function (seconds) from measured costs: the ``Timeline`` of
    ``Compiled.run_timed`` (milliseconds; each stage and kind at its mean over the
    microbatches), a mapping from kind or action label to seconds, or a function of an
    action (:meth:`Pipeline.check_costs` checks what it returns). A backward measured
    whole gives ``I`` and ``W`` half of it each, and one measured in halves gives ``B``
    their sum; an action's own label comes before its kind."""
    costs = _checked_costs(costs)
    if costs is None:
        return None
    if _is_function(costs):
        return _reported(costs)
    if isinstance(costs, Mapping):
        kinds = {ActionKind(k) for k in costs if k in tuple(ActionKind)}
        per_kind = by_kind(lambda stage, kind: costs[kind] if kind in kinds else None)
        labels = {
            k if isinstance(k, Action) else Action.parse(k): float(v)
            for k, v in costs.items()
            if k not in tuple(ActionKind)
        }
        if not labels:
            return per_kind
        return lambda action: labels[action] if action in labels else per_kind(action)
    took: dict = {}
    for row in costs.meshes:
        for slot in row:
            if slot.action is not None:
                took.setdefault((slot.action.stage, slot.action.kind), []).append(
                    (slot.end - slot.start) / 1e3
                )
    mean = {key: sum(v) / len(v) for key, v in took.items()}
    return by_kind(lambda stage, kind: mean.get((stage, kind)))


CHOOSERS["auto"] = Auto
CHOOSERS[callable] = ChosenBy
