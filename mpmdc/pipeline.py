"""The pass registry, the default pipeline and the runner that applies it.

Stage names are ``input`` (the traced program) and ``after-<pass>`` for each pass;
the ``lower`` pass's result is called ``stablehlo``.
"""

from __future__ import annotations

import gc
from typing import Callable, Iterable, Protocol

from mpmdc.errors import PassError
from mpmdc.ir import Program
from mpmdc.passes import (
    Dce,
    Inline,
    Lower,
    Partition,
    SchedulePass,
    Split,
    VmaTypecheck,
)


class Pass(Protocol):
    """What the runner needs of a pass."""

    name: str
    summary: str

    def run(self, program: Program) -> Program: ...


PASSES: dict[str, Pass] = {
    p.name: p for p in (Inline(), Partition(), Dce(), VmaTypecheck(), Split(), SchedulePass(), Lower())
}

DEFAULT_PIPELINE: tuple[str, ...] = (
    "inline",  # first: markers hidden in nested jit/custom_vjp calls must be visible
    "partition",  # needs every marker at top level; decides stage and mesh per equation
    "dce",  # after placement, so work that only fed dropped outputs is gone before split
    "vma-typecheck",  # checks types, specs against the chosen meshes, shard_map meshes
    "split",  # cuts the checked, placed program into fragments and transfers
    "schedule",  # needs fragments per microbatch; orders them as the loop's schedule says
    "lower",  # last: StableHLO per fragment
)


def stage_name(pass_name: str) -> str:
    """The dump-stage name of the program after ``pass_name``."""
    return "stablehlo" if pass_name == "lower" else f"after-{pass_name}"


def resolve(passes: Iterable[str | Pass] | None) -> list[Pass]:
    """Pass objects for a list of names or objects (``None``: the default pipeline)."""
    out = []
    for p in DEFAULT_PIPELINE if passes is None else passes:
        if isinstance(p, str):
            if p not in PASSES:
                raise PassError(f"unknown pass {p!r}; known passes: {', '.join(PASSES)}.")
            p = PASSES[p]
        out.append(p)
    return out


def run_pipeline(
    program: Program,
    passes: Iterable[Pass],
    callback: Callable[[str, Program], None] | None = None,
    *,
    verify: bool = False,
) -> Program:
    """Apply ``passes`` in order, calling ``callback(stage_name, program)`` after each.

    With ``verify`` every intermediate program is also run through ``vma-typecheck``
    (the test suite turns this on with ``MPMDC_VERIFY=1``).
    """
    if callback is not None:
        callback("input", program)
    # Passes allocate millions of small objects and free them by reference counting;
    # the cyclic collector's passes over them took a quarter of the time (57 vs 78
    # microseconds per equation on a 100k-equation program), so it waits until the end.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for p in passes:
            program = p.run(program)
            if verify:
                PASSES["vma-typecheck"].run(program)
            if callback is not None:
                callback(stage_name(p.name), program)
    finally:
        if was_enabled:
            gc.enable()
    return program
