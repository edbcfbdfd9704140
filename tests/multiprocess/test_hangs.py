"""A process alive but stuck, under ``mpmdc launch`` (``hangs.py`` is what each runs).

A process that makes no progress for the fault timeout while the others wait for it
ends the run: every waiter raises within the fault timeout, naming the stuck process
and what it waited for (following the others' waits to the one that waits for
nobody), the stuck process's watchdog ends it and prints where it was stuck, and the
launcher blames it. A save's meetings wait as long as the peer works on the save,
however long its writes take, and not for one that never began its part.
"""

import re
import sys
import time

import pytest
from test_multiprocess import HERE, caught, process_lines, run_launch

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

FAULT_TIMEOUT = 10  # seconds; less makes a slow start on 2 busy cores look like a hang


def hang(mode: str, sleeper: int, processes: int, directory, grace: int = 30):
    """``mpmdc launch`` of ``hangs.py MODE SLEEPER DIRECTORY``; (status, output)."""
    return run_launch(
        "-n",
        str(processes),
        "--fault-timeout",
        str(FAULT_TIMEOUT),
        "--grace",
        str(grace),
        "--",
        sys.executable,
        str(HERE / "hangs.py"),
        mode,
        str(sleeper),
        str(directory),
        limit=120,
    )


def launcher_line(output: str) -> str:
    return [line for line in output.splitlines() if line.startswith("mpmdc launch:")][-1]


def test_a_stuck_process_ends_the_run_naming_it_and_where_the_others_waited(tmp_path):
    # Process 0 (the coordinator's host) sleeps before step 2: process 1 waits for its
    # activations, process 2 for process 1's.
    status, output = hang("step", 0, 3, tmp_path)
    assert status != 0
    line = launcher_line(output)
    assert re.fullmatch(
        rf"mpmdc launch: process 0 failed first: it made no progress for {FAULT_TIMEOUT} s while "
        r"process \d waited for transfer .*; it exited with status 1; processes 1 and 2 failed too",
        line,
    ), output[-3000:]
    stuck = (
        f"process 0 made no progress for {FAULT_TIMEOUT} s (the fault timeout) and waits for no "
        f"other process: it is stuck in its own code, stopped, or has died."
    )
    # Processes 1 and 2 start waiting together; each gives up on its own, or on hearing
    # that the other gave up first (blaming process 0), whichever comes first.
    waited = {
        1: "process 1 stopped waiting for transfer mesh0->mesh1 on mesh1 (sent by process 0)",
        2: "process 2 stopped waiting for transfer mesh1->mesh2 on mesh2 (sent by process 1)",
    }
    gave_up = {
        1: f"{waited[1]}: {stuck}",
        2: f"{waited[2]}: process 1 waits for transfer mesh0->mesh1 on mesh1 (sent by "
        f"process 0); {stuck}",
    }
    for process, other in ((1, 2), (2, 1)):
        seconds, message = caught(output, process)
        assert seconds < FAULT_TIMEOUT + 3, message
        assert message in (
            f"MpmdRuntimeError: {gave_up[process]}",
            f"MpmdRuntimeError: {waited[process]}: process {other}, blaming process 0, "
            f"failed: {gave_up[other]}",
        ), message
    # Its watchdog ended process 0 (the launcher's grace had not run out), saying where it was.
    said = "\n".join(process_lines(output, 0))
    assert "mpmdc: process 0 ends itself, since the others gave up on it: " in said
    assert re.search(r'File ".*hangs.py", line \d+, in main\n +time.sleep\(600\)', said), said


def test_a_stopped_process_is_blamed_and_the_run_ends_soon_after_its_peer_gave_up(tmp_path):
    """Process 1 stops itself (SIGSTOP): no thread of it runs, its watchdog included.
    Process 0 gives up after the fault timeout, blaming it, and exits at once: its
    coordination service is not shut down (that waits for the stopped peer's calls in
    flight until its heartbeat times out, 8 s more here). After the grace the launcher
    ends process 1 by SIGTERM and SIGCONT (a stopped process acts on a SIGTERM only when
    continued; else it would end at the SIGKILL, 3 s later). Waiting for both, the run
    would end 11 s after the grace; it ends within 1.5 s of it, bounded by 4 s here."""
    grace = 5
    status, output = hang("stop", 1, 2, tmp_path, grace=grace)
    ended = time.time()
    assert status == 3, output[-3000:]
    assert launcher_line(output) == (
        f"mpmdc launch: process 1 failed first: it made no progress for {FAULT_TIMEOUT} s "
        f"while process 0 waited for transfer mesh1->mesh0 on mesh0 (sent by process 1); "
        f"stopped process 1 ({grace} seconds after process 0 failed)"
    ), output[-3000:]
    seconds, message = caught(output, 0)
    assert seconds < FAULT_TIMEOUT + 3, message
    (exiting,) = [x for x in process_lines(output, 0) if x.startswith("exiting at ")]
    assert ended - float(exiting.split()[-1]) - grace < 4, output[-3000:]


def test_a_process_stopped_while_the_others_leave_is_blamed_and_the_run_ends(tmp_path):
    """Process 1 stops itself after its last save; process 0's script returns and waits
    for it at the exit. After the fault timeout process 0 blames it and exits with
    status 1 at once (its runtime's teardown would wait for the stopped process with
    no bound), and the launcher stops process 1 after the grace."""
    grace = 5
    status, output = hang("stop-at-end", 1, 2, tmp_path, grace=grace)
    assert status == 1, output[-3000:]
    waited = "the others at the end of the run (its script returned)"
    assert launcher_line(output) == (
        f"mpmdc launch: process 1 failed first: it made no progress for {FAULT_TIMEOUT} s "
        f"while process 0 waited for {waited}; stopped process 1 ({grace} seconds after "
        f"process 0 failed)"
    ), output[-3000:]
    assert (
        f"mpmdc: process 0 stopped waiting for {waited}: process 1 made no progress for "
        f"{FAULT_TIMEOUT} s (the fault timeout)"
    ) in "\n".join(process_lines(output, 0)), output[-3000:]
    assert (tmp_path / "saved").is_dir()


def test_a_save_waiting_for_a_process_that_never_began_its_part_ends_naming_it(tmp_path):
    status, output = hang("save", 1, 2, tmp_path, grace=5)
    assert status != 0
    saved = tmp_path / "saved"
    what = f"process 1 to reach the start of the save to {saved}"
    assert launcher_line(output).startswith(
        f"mpmdc launch: process 1 failed first: it made no progress for {FAULT_TIMEOUT} s while "
        f"process 0 waited for {what}"
    ), output[-3000:]
    seconds, message = caught(output, 0)
    assert seconds < FAULT_TIMEOUT + 3, message
    assert message.startswith(
        f"MpmdRuntimeError: process 0 stopped waiting for {what}: process 1 made no progress"
    )
    assert not saved.exists()


def test_a_save_whose_writes_take_longer_than_the_fault_timeout_completes(tmp_path):
    status, output = hang("slow-save", 1, 2, tmp_path)
    assert status == 0, output[-3000:]
    for index in range(2):
        (line,) = [x for x in process_lines(output, index) if x.startswith("saved after")]
        assert float(line.split()[2]) > FAULT_TIMEOUT, line
    assert (tmp_path / "saved").is_dir()
