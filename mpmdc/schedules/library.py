"""Pipeline schedules: which fragment each mesh runs next, as per-mesh action lists.

A schedule turns a :class:`~mpmdc.schedules.actions.Layout` (stages, microbatches,
stage-to-mesh map) into one list of :class:`~mpmdc.schedules.actions.Action` per mesh. Built in, also by name:

- ``GPipe()`` ("gpipe"): every forward, then every backward.
- ``OneFOneB()`` ("1f1b"): a warm-up of forwards, then one forward and one backward
  alternately, so a mesh holds at most as many microbatches as there are stages after it.
- ``Interleaved1F1B()`` ("interleaved-1f1b"): several stages per mesh (stage ``s`` on
  mesh ``s mod p``), forwards in groups of ``p`` microbatches per stage, 1F1B between.
- ``ZeroBubbleH1()`` ("zb-h1"): the backward split into ``I`` and ``W``; weight
  gradients wait to fill the bubbles 1F1B leaves, with 1F1B's memory limit.
- ``ZeroBubbleH2()`` ("zb-h2"): up to ``2p - 1`` microbatches in flight on every mesh,
  input gradients first: no bubble in steady training at equal F, I and W costs.
- ``ZeroBubbleV()`` ("zb-v"): two stages per mesh in V order, no bubble in steady
  training at equal costs with 1F1B's peak activation memory.
- ``DualPipeV()`` ("dualpipev"): DeepSeek's V-shaped DualPipe, forward of one stage
  and backward of the other in pairs, ``2p + 1`` stage activations per mesh.
- ``ActionLists([...])``: a user's own lists, e.g. ``["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]``.

Every schedule is checked against the data dependencies by :mod:`mpmdc.schedules.simulate`
before it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from mpmdc.errors import ScheduleError
from mpmdc.ir.primitives import ActionKind
from mpmdc.schedules.actions import Action, Layout
from mpmdc.schedules.greedy import list_schedule


class Schedule:
    """Base class: a rule that gives each mesh its list of actions."""

    name: ClassVar[str] = ""

    def actions(self, layout: Layout) -> tuple[tuple[Action, ...], ...]:
        """One tuple of actions per mesh, in the order that mesh runs them."""
        raise NotImplementedError

    def stages_for(self, num_meshes: int) -> int:
        """How many stages this schedule runs on ``num_meshes`` meshes: what
        ``partition="balanced"`` groups the marked segments into."""
        return num_meshes

    def placement(self, num_stages: int, num_meshes: int) -> tuple[int, ...] | None:
        """The mesh of each stage where ``compile`` gets no ``stage_to_mesh``; ``None``:
        stage ``s`` on mesh ``s mod num_meshes``."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _one_stage_per_mesh(schedule: Schedule, layout: Layout) -> None:
    """A ``ScheduleError`` saying which schedule runs ``layout`` unless every mesh has one stage."""
    p = layout.num_meshes
    for mesh in range(p):
        if len(layout.stages_of(mesh)) != 1:
            # The schedule is chosen with the layout (compile's `schedule=`), so the
            # message names the call that runs this layout.
            if layout.round_robin:
                instead = (
                    f"for {layout.num_stages} stages on {p} mesh{'es' * (p > 1)} use "
                    f"mpmdc.compile(..., schedule='interleaved-1f1b'), or schedule='gpipe', "
                    f"which takes any stage-to-mesh map"
                    + (
                        ", or 'zb-v' / 'dualpipev', which place them in V order"
                        if layout.num_stages == 2 * p
                        else ""
                    )
                )
            else:
                instead = (
                    "use mpmdc.compile(..., schedule='gpipe'), which takes any stage-to-mesh "
                    f"map (interleaved-1f1b needs stage s on mesh s mod {p})"
                )
            raise ScheduleError(
                f"{schedule.name} runs exactly one stage per mesh, but mesh {mesh} has stages "
                f"{layout.stages_of(mesh)}; {instead}."
            )


class GPipe(Schedule):
    """All forwards, then all backwards (each mesh holds every microbatch's activations)."""

    name = "gpipe"

    def actions(self, layout):
        out = []
        for mesh in range(layout.num_meshes):
            stages = layout.stages_of(mesh)
            forwards = [
                Action(s, ActionKind.F, b) for s in stages for b in range(layout.microbatches)
            ]
            backwards = [
                Action(s, ActionKind.B, b)
                for s in reversed(stages)
                for b in range(layout.microbatches)
            ]
            out.append(tuple(forwards + backwards))
        return tuple(out)


def _one_f_one_b(forwards, backwards, warmup):
    """Warm-up forwards, then one forward and one backward alternately, then the rest."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return tuple(order + list(backwards[len(forwards) - warmup :]))


class OneFOneB(Schedule):
    """1F1B: stage ``s`` of ``p`` runs ``p - 1 - s`` forwards, then alternates F and B."""

    name = "1f1b"

    def actions(self, layout):
        _one_stage_per_mesh(self, layout)
        out = []
        for mesh in range(layout.num_meshes):
            (s,) = layout.stages_of(mesh)
            m = layout.microbatches
            forwards = [Action(s, ActionKind.F, b) for b in range(m)]
            backwards = [Action(s, ActionKind.B, b) for b in range(m)]
            out.append(_one_f_one_b(forwards, backwards, layout.num_stages - 1 - s))
        return tuple(out)


class Interleaved1F1B(Schedule):
    """Interleaved 1F1B: ``v`` stages per mesh, microbatches in groups of ``p`` per stage.

    Needs stage ``s`` on mesh ``s mod p`` and a microbatch count divisible by ``p``.
    """

    name = "interleaved-1f1b"

    def stages_for(self, num_meshes):
        return 2 * num_meshes

    def actions(self, layout):
        p, n, m = layout.num_meshes, layout.num_stages, layout.microbatches
        if not layout.round_robin:
            raise ScheduleError(
                f"interleaved-1f1b needs stage s on mesh s mod {p} and a whole number of stages "
                f"per mesh; got stage_to_mesh={list(layout.stage_to_mesh)}."
            )
        if m % p:
            raise ScheduleError(
                f"interleaved-1f1b runs microbatches in groups of {p} (one per mesh); "
                f"{m} microbatches is not a multiple of {p}."
                + (
                    f" (With {n} stages on {n} meshes nothing interleaves: put several stages on each mesh.)"
                    if n == p
                    else ""
                )
            )
        v = n // p
        total = m * v

        def chunk(k):
            return (k % (p * v)) // p

        def microbatch(k):
            return (k // (p * v)) * p + k % p

        out = []
        for r in range(p):
            forwards = [Action(chunk(k) * p + r, ActionKind.F, microbatch(k)) for k in range(total)]
            backwards = [
                Action((v - 1 - chunk(k)) * p + r, ActionKind.B, microbatch(k))
                for k in range(total)
            ]
            out.append(_one_f_one_b(forwards, backwards, (p - r - 1) * 2 + (v - 1) * p))
        return tuple(out)


class ZeroBubbleH1(Schedule):
    """ZB-H1: the backward split into input (I) and weight (W) gradients.

    Each mesh runs 1F1B's order with ``I`` in place of ``B``; the weight gradient of
    microbatch ``j`` on stage ``s`` waits until after ``I`` of microbatch ``j + s``
    (the rest come last). The deferred ``W``s fill the bubbles the backward wave leaves
    in 1F1B, while at most ``p`` microbatches are in flight on any mesh.
    """

    name = "zb-h1"

    def actions(self, layout):
        _one_stage_per_mesh(self, layout)
        p, m = layout.num_stages, layout.microbatches
        out = [()] * layout.num_meshes
        for s in range(p):
            forwards = [Action(s, ActionKind.F, b) for b in range(m)]
            inputs = [Action(s, ActionKind.I, b) for b in range(m)]
            order = []
            for action in _one_f_one_b(forwards, inputs, p - 1 - s):
                order.append(action)
                if action.kind is ActionKind.I and action.microbatch >= s:
                    order.append(Action(s, ActionKind.W, action.microbatch - s))
            order += [Action(s, ActionKind.W, b) for b in range(max(0, m - s), m)]
            out[layout.stage_to_mesh[s]] = tuple(order)
        return tuple(out)


class ZeroBubbleH2(Schedule):
    """ZB-H2: zero bubble with up to ``2p - 1`` microbatches in flight on every mesh.

    Each mesh, whenever it is free, runs an input gradient if one can start, else a
    forward while it holds fewer than ``2p - 1`` microbatches, else a weight gradient.
    The extra warm-up forwards fill the wait for the first input gradient, and the later
    stages defer their weight gradients to the tail, so every mesh is busy from its first
    forward to its last weight gradient (the paper's parallelogram): in steady training,
    steps back to back, the bubble is ``(p-1) max(F + I - 2W, I - F, 0)``, none at equal
    costs (``bubble_time_formula``).
    """

    name = "zb-h2"

    def actions(self, layout):
        _one_stage_per_mesh(self, layout)
        cap = 2 * layout.num_stages - 1
        return list_schedule(layout, cap=lambda mesh: cap, priority=_input_gradients_first)


def _input_gradients_first(action: Action) -> int:
    """``I`` before ``F`` before ``W`` among actions that can start at once."""
    return (ActionKind.I, ActionKind.F, ActionKind.W).index(action.kind)


def v_placement(num_meshes: int) -> tuple[int, ...]:
    """Stages ``s`` and ``2M-1-s`` on mesh ``s``: the V order of 2M stages on M meshes."""
    return (*range(num_meshes), *reversed(range(num_meshes)))


class _VSchedule(Schedule):
    """A schedule of two stages per mesh in V order (``v_placement``)."""

    min_microbatches: ClassVar = staticmethod(lambda p: 1)

    def stages_for(self, num_meshes):
        return 2 * num_meshes

    def placement(self, num_stages, num_meshes):
        return v_placement(num_meshes) if num_stages == 2 * num_meshes else None

    def _check(self, layout: Layout) -> None:
        p, n, m = layout.num_meshes, layout.num_stages, layout.microbatches
        if n != 2 * p or layout.stage_to_mesh != v_placement(p):
            instead = (
                "leave stage_to_mesh out or give it this V"
                if n == 2 * p
                else f"mark {2 * p} stages, or use a schedule of one stage per mesh ('zb-h2', "
                f"'zb-h1', '1f1b')"
            )
            raise ScheduleError(
                f"{self.name} runs two stages per mesh in V order: {2 * p} stages on {p} "
                f"mesh{'es' * (p > 1)}, stages s and {2 * p - 1}-s on mesh s "
                f"(stage_to_mesh={list(v_placement(p))}, the default for this schedule); got "
                f"{n} stages with stage_to_mesh={list(layout.stage_to_mesh)}: {instead}."
            )
        if m < self.min_microbatches(p):
            raise ScheduleError(
                f"{self.name} on {p} mesh{'es' * (p > 1)} needs at least "
                f"{self.min_microbatches(p)} microbatches (its warm-up fills the pipeline), "
                f"got {m}; use more microbatches or schedule='gpipe'."
            )


class ZeroBubbleV(_VSchedule):
    """ZB-V: two stages per mesh in V order, zero bubble at 1F1B's activation memory.

    Mesh ``d`` of ``p`` warms up with ``2(p-d)-1`` forwards of its first stage, then
    alternates the two stages' forwards ``d`` times, then runs ``p-d`` rounds of its
    second stage's F, I and W; the steady phase runs F, I, W of the first stage, then of
    the second; the cool-down runs the input gradients first and the deferred weight
    gradients last. Every mesh holds at most ``2p`` stage activations (what 1F1B's first
    mesh holds of stages twice the size), and at equal F, I and W costs steady training
    has no bubble. Needs ``2p - 1`` microbatches or more.
    """

    name = "zb-v"
    min_microbatches: ClassVar = staticmethod(lambda p: 2 * p - 1)

    def actions(self, layout):
        self._check(layout)
        p, m = layout.num_meshes, layout.microbatches
        return tuple(_zb_v_mesh(d, p, m) for d in range(p))


class _Row:
    """One mesh's action list being written, with the next microbatch of each stage and
    kind."""

    def __init__(self):
        self.actions: list[Action] = []
        self.next: dict = {}

    def add(self, stage: int, *kinds: str) -> None:
        for kind in map(ActionKind, kinds):
            b = self.next.get((stage, kind), 0)
            self.next[stage, kind] = b + 1
            self.actions.append(Action(stage, kind, b))

    def count(self, stage: int, kind: str) -> int:
        return self.next.get((stage, ActionKind(kind)), 0)


def _zb_v_mesh(d: int, p: int, m: int) -> tuple[Action, ...]:
    first, second = d, 2 * p - 1 - d
    row = _Row()
    for _ in range(2 * (p - d) - 1):
        row.add(first, "F")
    for _ in range(d):
        row.add(second, "F")
        row.add(first, "F")
    for _ in range(p - d):
        row.add(second, "F", "I", "W")
    while row.count(first, "F") < m or row.count(second, "F") < row.count(first, "F"):
        if row.count(first, "F") < m:
            row.add(first, "F")
        row.add(first, "I", "W")
        row.add(second, "F", "I", "W")
    for _ in range(d):
        row.add(first, "I")
        row.add(second, "I")
    for _ in range(p - d):
        row.add(first, "I", "W")
    for stage in (second, first):
        while row.count(stage, "W") < m:
            row.add(stage, "W")
    return tuple(row.actions)


class DualPipeV(_VSchedule):
    """DualPipeV: DeepSeek's DualPipe cut in half, two stages per mesh in V order.

    Mesh ``d`` of ``p`` runs eight phases: ``2(p-d-1)`` forwards of its first stage;
    ``d+1`` pairs of forwards of both stages; ``p-d-1`` rounds of the second stage's
    input gradient, a deferred weight gradient and a forward; the main phase of
    ``m - 2p + d + 1`` rounds of a forward of one stage with a backward of the other,
    both ways; ``p-d-1`` rounds of a second-stage backward and a forward/backward pair;
    ``d+1`` backwards of both stages (the second half deferring their weight
    gradients); ``p-d-1`` deferred weight gradients, each with a first-stage input
    gradient; and the ``d+1`` weight gradients left. A backward that defers nothing runs
    as ``I`` then ``W``. Each mesh holds at most ``2p + 1`` stage activations. Needs
    ``2p`` microbatches or more.
    """

    name = "dualpipev"
    min_microbatches: ClassVar = staticmethod(lambda p: 2 * p)

    def actions(self, layout):
        self._check(layout)
        p, m = layout.num_meshes, layout.microbatches
        return tuple(_dualpipe_v_mesh(d, p, m) for d in range(p))


def _dualpipe_v_mesh(d: int, p: int, m: int) -> tuple[Action, ...]:
    first, second = d, 2 * p - 1 - d
    row = _Row()
    deferred: list[Action] = []

    def backward(stage: int, defer: bool) -> None:
        row.add(stage, "I")
        weight = Action(stage, ActionKind.W, row.count(stage, "I") - 1)
        if defer:
            deferred.append(weight)
        else:
            row.actions.append(weight)

    def deferred_weight() -> None:
        row.actions.append(deferred.pop(0))

    for _ in range(2 * (p - d - 1)):
        row.add(first, "F")
    for _ in range(d + 1):
        row.add(first, "F")
        row.add(second, "F")
    for _ in range(p - d - 1):
        backward(second, defer=True)
        deferred_weight()
        row.add(second, "F")
    for _ in range(m - 2 * p + d + 1):
        row.add(first, "F")
        backward(second, defer=False)
        row.add(second, "F")
        backward(first, defer=False)
    for _ in range(p - d - 1):
        backward(second, defer=False)
        row.add(second, "F")
        backward(first, defer=False)
    # The second half of these backwards defer their weight gradients; on odd meshes
    # from the second stage's backward of the middle round, on even ones from the first's.
    half = (d + 1) // 2
    for i in range(d + 1):
        backward(second, defer=i > half or (i == half and d % 2 == 1))
        backward(first, defer=i >= half)
    for _ in range(p - d - 1):
        deferred_weight()
        backward(first, defer=True)
    while deferred:
        deferred_weight()
    return tuple(row.actions)


class ActionLists(Schedule):
    """A user-defined schedule: one action list per mesh (strings or ``Action`` sequences)."""

    name = "custom"

    def __init__(self, per_mesh):
        if isinstance(per_mesh, str) or not isinstance(per_mesh, Sequence):
            raise _not_lists(per_mesh, f"it is {_typed(per_mesh)}, not a list")
        lists = []
        for mesh, mesh_actions in enumerate(per_mesh):
            if isinstance(mesh_actions, str):
                mesh_actions = mesh_actions.split()
            if not isinstance(mesh_actions, Sequence):
                raise _not_lists(per_mesh, f"mesh {mesh}'s entry is {_typed(mesh_actions)}")
            lists.append(
                tuple(a if isinstance(a, Action) else Action.parse(a) for a in mesh_actions)
            )
        self.lists = tuple(lists)

    def stages_for(self, num_meshes):
        return 1 + max((a.stage for row in self.lists for a in row), default=0)

    def actions(self, layout):
        if len(self.lists) != layout.num_meshes:
            raise ScheduleError(
                f"the schedule has {len(self.lists)} action list(s) but the pipeline uses "
                f"{layout.num_meshes} meshes; give one list per mesh."
            )
        return self.lists

    def __repr__(self) -> str:
        return f"ActionLists({[' '.join(map(str, a)) for a in self.lists]!r})"


def _typed(value) -> str:
    return f"{value!r:.30}, of type {type(value).__name__}"


def _not_lists(per_mesh, problem: str) -> ScheduleError:
    """The ``ScheduleError`` for ``per_mesh`` given as action lists when it is none."""
    return ScheduleError(
        f"schedule={per_mesh!r:.60} is not per-mesh action lists: {problem}. Give one entry "
        f"per mesh, each a string of actions or a list of them, e.g. "
        f"['0F0 0F1 0B0 0B1', '1F0 1B0 1F1 1B1']; to put stages on meshes, use "
        f"mpmdc.compile(..., stage_to_mesh=...)."
    )


SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls
    for cls in (
        GPipe,
        OneFOneB,
        Interleaved1F1B,
        ZeroBubbleH1,
        ZeroBubbleH2,
        ZeroBubbleV,
        DualPipeV,
    )
}


class Chooser:
    """Chooses a schedule once the pipeline's costs are known: ``schedule="auto"``, or a
    function of the pipeline (:mod:`mpmdc.schedules.auto`)."""

    name: str = "chooser"
    costs = None  # measured costs to choose by, or None: estimated from the fragments
    memory_cap = None  # bytes of activations per mesh, or None: what the devices have

    def choose(self, pipeline):
        """``(schedule, ScheduleChoice)`` for ``pipeline``: the schedule and, as plain data,
        its predicted step time, bubble and memory, and what else was considered."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# "auto" and ``callable`` (a user's function) -> the Chooser that takes them; filled by
# ``mpmdc.schedules.auto``.
CHOOSERS: dict = {}


def get(schedule) -> Schedule | Chooser:
    """A schedule object from a name, a ``Schedule`` or per-mesh action lists; a
    ``Chooser`` from ``"auto"``, a ``Chooser`` or a function of the pipeline."""
    if isinstance(schedule, (Schedule, Chooser)):
        return schedule
    known = ", ".join([*SCHEDULES, *(k for k in CHOOSERS if isinstance(k, str))])
    if isinstance(schedule, str):
        if schedule in CHOOSERS:
            return CHOOSERS[schedule]()
        if schedule not in SCHEDULES:
            raise ScheduleError(
                f"unknown schedule {schedule!r}; known schedules: {known} "
                f"(or a list of per-mesh action strings, or a function of the pipeline)."
            )
        return SCHEDULES[schedule]()
    if isinstance(schedule, (list, tuple)):
        return ActionLists(schedule)
    if callable(schedule) and not isinstance(schedule, type):
        return CHOOSERS[callable](schedule)
    if isinstance(schedule, type) and issubclass(schedule, (Schedule, Chooser)):
        raise ScheduleError(
            f"schedule={schedule.__name__} is a class; pass an instance, "
            f"schedule={schedule.__name__}()."
        )
    raise ScheduleError(
        f"schedule must be a name ({known}), an mpmdc.schedules.Schedule, per-mesh action "
        f"lists or a function of the pipeline, got {type(schedule).__name__}."
    )
