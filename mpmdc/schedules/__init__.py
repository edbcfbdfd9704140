"""Pipeline schedules: what each mesh runs when, checked and timed before anything runs.

- ``actions``: :class:`Action` (``0F3``), :class:`Layout` and the action of a fragment;
- ``library``: :class:`Schedule` and the built-in schedules, by class or by name;
- ``auto``: choosing a schedule from the pipeline's costs (``"auto"`` or a function);
- ``balance``: consecutive segments grouped into balanced stages;
- ``accumulate``: :func:`mpmdc.accumulate`, the microbatch loop a schedule orders;
- ``greedy``: list scheduling under an in-flight cap, which ZB-H2 is built by;
- ``simulate``: the dependency check, the timed simulation of a schedule, steady-state
  step time, in-flight peaks and the published bubble formulas;
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
from mpmdc.schedules.auto import (
    Auto,
    ChosenBy,
    Pipeline,
    Synthesized,
    candidates,
    evaluate,
    measured,
)
from mpmdc.schedules.library import (
    SCHEDULES,
    ActionLists,
    Chooser,
    DualPipeV,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ZeroBubbleH1,
    ZeroBubbleH2,
    ZeroBubbleV,
    get,
    v_placement,
)
from mpmdc.schedules.simulate import (
    BUBBLE_FORMULAS,
    UNIT_COSTS,
    back_to_back,
    bubble_formula,
    bubble_time_formula,
    by_kind,
    cost_of,
    formula_holds,
    in_flight,
    measured_costs,
    simulate,
    steady_bubble,
    step_time,
)
from mpmdc.schedules.timeline import Slot, Timeline

__all__ = [
    "BUBBLE_FORMULAS",
    "SCHEDULES",
    "UNIT_COSTS",
    "Action",
    "ActionKind",
    "ActionLists",
    "Auto",
    "Chooser",
    "ChosenBy",
    "DualPipeV",
    "GPipe",
    "Interleaved1F1B",
    "Layout",
    "OneFOneB",
    "Pipeline",
    "Schedule",
    "Slot",
    "Synthesized",
    "Timeline",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "ZeroBubbleV",
    "action_of",
    "actions_of",
    "back_to_back",
    "bubble_formula",
    "bubble_time_formula",
    "by_kind",
    "candidates",
    "cost_of",
    "evaluate",
    "formula_holds",
    "get",
    "in_flight",
    "layout_of",
    "loop_schedule",
    "measured",
    "measured_costs",
    "simulate",
    "steady_bubble",
    "step_time",
    "v_placement",
]
