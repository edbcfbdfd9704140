"""Pipeline schedules: what each mesh runs when, checked and timed before anything runs.

- ``actions``: :class:`Action` (``0F3``), :class:`Layout` and the action of a fragment;
- ``library``: :class:`Schedule` and the built-in schedules, by class or by name;
- ``accumulate``: :func:`mpmdc.accumulate`, the microbatch loop a schedule orders;
- ``simulate``: the dependency check and the timed simulation of a schedule;
- ``timeline``: :class:`Timeline`, simulated or measured, and its drawings.

Layer 2: imports :mod:`mpmdc.ir` and below.
"""

from mpmdc.ir.primitives import ActionKind
from mpmdc.schedules.actions import (
    Action,
    Layout,
    action_of,
    actions_of,
    layout_of,
    loop_schedule,
)
from mpmdc.schedules.library import (
    SCHEDULES,
    ActionLists,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ZeroBubbleH1,
    get,
)
from mpmdc.schedules.simulate import (
    UNIT_COSTS,
    bubble_formula,
    measured_costs,
    simulate,
)
from mpmdc.schedules.timeline import Slot, Timeline

__all__ = [
    "SCHEDULES",
    "UNIT_COSTS",
    "Action",
    "ActionKind",
    "ActionLists",
    "GPipe",
    "Interleaved1F1B",
    "Layout",
    "OneFOneB",
    "Schedule",
    "Slot",
    "Timeline",
    "ZeroBubbleH1",
    "action_of",
    "actions_of",
    "bubble_formula",
    "get",
    "layout_of",
    "loop_schedule",
    "measured_costs",
    "simulate",
]
