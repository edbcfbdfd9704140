"""``plan``: decide what the traced program asks to be decided from estimates, before any
other pass sees it.

The traced program carries its request (:class:`~mpmdc.ir.program.PlanRequest`): the
microbatch loop's schedule as the user gave it, and whether the marked segments are to
be grouped into stages (``partition="balanced"``, a layer stack's ``every="balanced"``).
The pass

1. groups the segments, where asked (:func:`mpmdc.planning.balancing.balanced`): the
   markers renumbered to their stages, the grouping kept as ``program.stage_plan``;
2. where the schedule is a chooser (``schedule="auto"`` or a function), lets it choose
   from the pipeline's estimated costs (the choice kept with the schedule);
3. runs the schedule on the stages' layout (the schedule's placement becomes
   ``stage_to_mesh`` where none was given) as ``program.schedule``.

Steps 1 and 2 estimate a trial run of the option ``through``: the pipeline's passes up
to ``split`` (``mpmdc.compile`` sets it from its own ``passes``; by default the default
pipeline's). A program that asks for nothing comes out as it went in, planned.
"""

from __future__ import annotations

from mpmdc.passes.base import Property, register

from mpmdc import schedules
from mpmdc.errors import ScheduleError
from mpmdc.ir.program import Phase, Program


@register(
    "plan",
    "group the marked segments into stages and choose the loop's schedule, as asked",
    produces={Property.PLANNED},
)
def plan(program: Program, *, through: tuple | None = None) -> Program:
    """``program`` planned as its ``plan_request`` asks, estimated on a trial run of
    ``through`` (pass names, texts or objects; ``None``: the default pipeline's passes
    up to ``split``); a planned program passes unchanged."""
    # (Imported here: the planner runs a pipeline, whose runner imports this package.)
    from mpmdc.pipeline import default_trial, resolve
    from mpmdc.planning.balancing import balanced
    from mpmdc.planning.scheduling import pipeline_of, scheduled

    if program.phase >= Phase.PLANNED:
        return program
    request = program.plan_request
    program = program.replace(plan_request=None)
    if request is not None:
        trial = resolve(list(default_trial() if through is None else through))
        schedule = request.schedule
        choosing = isinstance(schedule, schedules.Chooser)
        if request.balanced:
            # A chooser's stages are one per mesh, balanced as for 1F1B's memory.
            program = balanced(program, schedules.OneFOneB() if choosing else schedule, trial)
        if schedule is not None:
            choice = None
            if choosing:
                pipeline = pipeline_of(program, schedule, program.microbatches, trial)
                schedule, choice = schedule.choose(pipeline)
            try:
                program = scheduled(program, schedule, program.microbatches, choice)
            except ScheduleError as err:
                if not request.schedule_from:
                    raise
                raise ScheduleError(
                    f"{err} (The schedule is the one mpmdc.accumulate at "
                    f"{request.schedule_from} gives; mpmdc.compile(schedule=) overrides it.)"
                ) from None
    return program.replace(phase=Phase.PLANNED)
