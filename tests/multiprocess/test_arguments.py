"""Arguments that live on another process's mesh than the one that reads them, under
``mpmdc launch`` (``arguments.py`` is what each process runs): the owning process
sends them as it sends transfers, and one no route can move fails every process at
once with an ``ArgumentError``, never a timeout. A step with a scaled tied embedding,
fed back, moves no argument at all."""

import re
import sys

import pytest
from test_multiprocess import HERE, caught, process_lines, run_launch

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

FAULT_TIMEOUT = 20  # seconds: the failure must come long before it


def test_arguments_on_another_processs_mesh_are_sent_or_refused_at_once():
    status, output = run_launch(
        "-n",
        "4",
        "--fault-timeout",
        str(FAULT_TIMEOUT),
        "--grace",
        "15",
        "--",
        sys.executable,
        str(HERE / "arguments.py"),
        limit=120,
    )
    assert status == 3, output[-3000:]
    for index in range(4):
        lines = process_lines(output, index)
        assert "ok: committed by hand to another process's mesh" in lines, output[-3000:]
        assert "ok: results fed back in another order" in lines, output[-3000:]
        assert "ok: a scaled tied embedding fed back stays on mesh 0" in lines, output[-3000:]
        seconds, message = caught(output, index)
        assert seconds < 5, message  # at once, not after the fault timeout
        assert re.match(
            r"ArgumentError: argument args\[0\]\[2\] is on devices \[0, \d+\] \(processes "
            r"\[0, 1\]\), but the program reads it on mesh2 \(processes \[2\]\)",
            message,
        ), message
        assert "input_shardings" in message
