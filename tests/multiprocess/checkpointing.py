"""``examples/resume_training.py`` with a process that dies saving; run it under ``mpmdc launch``
(``test_checkpoints.py`` does).

``python checkpointing.py DIE_AT ARGS...``: the example with ``ARGS``; with ``DIE_AT`` a
step number, the last process kills itself (SIGKILL) while saving that step, its first
array's writes begun and the rest not (``-`` for none); with ``term@N``, the last
process sends itself a preemption notice (SIGTERM) as it begins step ``N``, and
goes on. Only the first attempt dies or is preempted:
under ``mpmdc launch --max-restarts`` the processes started again
(``MPMDC_RESTART_COUNT`` above 0) run to the end.
"""

import importlib.util
import os
import pathlib
import re
import signal
import sys

from mpmdc.checkpoint import storage

_spec = importlib.util.spec_from_file_location(
    "resume_training", pathlib.Path(__file__).parents[2] / "examples" / "resume_training.py"
)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def dying_at(step: str):
    """``storage.opened`` that kills this process as it opens the second array of ``step``
    for writing."""
    opened = storage.opened
    seen = []

    def dying(spec, context, **mode):
        if mode.get("write") and re.search(
            rf"/{step}\.[0-9a-f]+\.partial/", spec["kvstore"]["path"]
        ):
            seen.append(spec)
            if len(seen) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return opened(spec, context, **mode)

    return dying


def preempted_at(step: int):
    """``example.batch`` that sends this process SIGTERM as it makes step ``step``'s."""
    batch = example.batch

    def preempting(n):
        if n == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch(n)

    return preempting


if __name__ == "__main__":
    die_at, argv = sys.argv[1], sys.argv[2:]
    last = os.environ.get("MPMDC_PROCESS_ID") == str(int(os.environ["MPMDC_NUM_PROCESSES"]) - 1)
    first_attempt = os.environ.get("MPMDC_RESTART_COUNT", "0") == "0"
    if die_at.startswith("term@") and last and first_attempt:
        example.batch = preempted_at(int(die_at[len("term@") :]))
    elif die_at != "-" and last and first_attempt:
        storage.opened = dying_at(die_at)
    example.main(argv)
