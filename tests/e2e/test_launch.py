"""``mpmdc launch --max-restarts``: after a failure every process starts again, on fresh
ports and told how many restarts came before it, until an attempt succeeds or the
restarts run out, each failure's cause printed; ``--timeout`` bounds it all. The
processes here are plain Python (no JAX), so these run in a second; a training run
restarted from its checkpoint is in ``tests/multiprocess/test_checkpoints.py``."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpmdc.cli.launch import launch

SAYS_ATTEMPT = (
    "import os; print('attempt', os.environ['MPMDC_RESTART_COUNT'], "
    "os.environ['MPMDC_COORDINATOR_ADDRESS'], flush=True); "
    "i = int(os.environ['MPMDC_PROCESS_ID']); r = int(os.environ['MPMDC_RESTART_COUNT']); "
)


def test_every_process_starts_again_until_an_attempt_succeeds(capsys):
    code = SAYS_ATTEMPT + "raise SystemExit(5 if i == 1 and r < 2 else 0)"
    status = launch([sys.executable, "-c", code], 2, grace=0.5, timeout=60, max_restarts=3)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert err.count("mpmdc launch: process 1 failed first: it exited with status 5") == 2, err
    assert "restart 1 of 3: starting every process again" in err
    assert "restart 2 of 3" in err and "restart 3 of 3" not in err
    for index in range(2):
        said = re.findall(rf"^\[{index}\] attempt (\d) (\S+)$", out, re.M)
        assert [attempt for attempt, _ in said] == ["0", "1", "2"], out
        assert len({address for _, address in said}) == 3  # fresh ports every time


def test_a_run_that_always_fails_ends_after_its_restarts_with_each_cause_printed(capsys):
    # Process 1 is killed on the first attempt, and exits with 7 on the others.
    code = SAYS_ATTEMPT + (
        "import signal; os.kill(os.getpid(), signal.SIGKILL) if i == 1 and r == 0 else None; "
        "raise SystemExit(7 if i == 1 else 0)"
    )
    status = launch([sys.executable, "-c", code], 2, grace=0.5, timeout=60, max_restarts=2)
    out, err = capsys.readouterr()
    assert status == 7
    said = re.findall(r"^mpmdc launch: .*$", err, re.M)
    expected = [
        "mpmdc launch: process 1 failed first: it was killed by SIGKILL",
        "mpmdc launch: restart 1 of 2: starting every process again",
        "mpmdc launch: process 1 failed first: it exited with status 7",
        "mpmdc launch: restart 2 of 2: starting every process again",
        "mpmdc launch: process 1 failed first: it exited with status 7",
    ]
    assert len(said) == len(expected) and all(map(str.startswith, said, expected)), err
    assert re.findall(r"^\[0\] attempt (\d)", out, re.M) == ["0", "1", "2"]


def test_a_process_killed_after_a_peer_reported_it_stuck_is_blamed_with_the_report(capsys):
    """Process 0 announces that process 1 made no progress (as its watchdog does), then
    process 1 is killed by a signal (JAX's coordination service aborts it) before process
    0 exits: the launcher blames process 1 with the report, not with the signal alone."""
    code = SAYS_ATTEMPT + (
        "import json, signal, time, pathlib\n"
        "folder = pathlib.Path(os.environ['MPMDC_FAILURE_DIR'])\n"
        "if i == 0:\n"
        "    record = dict(time=time.time(), message='waited', culprit=1, "
        "blame='it made no progress for 20 s while process 0 waited for it')\n"
        "    (folder / '0').write_text(json.dumps(record)); time.sleep(2); raise SystemExit(1)\n"
        "while not (folder / '0').exists(): time.sleep(0.01)\n"
        "os.kill(os.getpid(), signal.SIGABRT)\n"
    )
    status = launch([sys.executable, "-c", code], 2, grace=5, timeout=60)
    _, err = capsys.readouterr()
    assert status != 0
    assert (
        "mpmdc launch: process 1 failed first: it made no progress for 20 s while process 0 "
        "waited for it; it was killed by SIGABRT" in err
    ), err


def test_a_stopped_process_is_continued_to_act_on_the_launchers_sigterm(tmp_path, capsys):
    """A stopped process (SIGSTOP) acts on a signal only when continued: the launcher's
    SIGTERM comes with a SIGCONT, so its handler runs (else the SIGKILL ends it)."""
    code = SAYS_ATTEMPT + (
        "import pathlib, signal, time\n"
        f"here = pathlib.Path({str(tmp_path)!r})\n"
        "if i == 1:\n"
        "    def end(*_): (here / 'terminated').write_text('yes'); os._exit(0)\n"
        "    signal.signal(signal.SIGTERM, end)\n"
        "    (here / 'stopping').write_text('yes'); os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    time.sleep(60)\n"
        "while not (here / 'stopping').exists(): time.sleep(0.01)\n"
        "raise SystemExit(1)\n"
    )
    status = launch([sys.executable, "-c", code], 2, grace=0.5, timeout=60)
    _, err = capsys.readouterr()
    assert status == 1, err
    assert (tmp_path / "terminated").exists(), err


@pytest.mark.slow
def test_the_timeout_bounds_the_whole_launch_restarts_included(capsys):
    code = "import time; time.sleep(0.3); raise SystemExit(1)"
    # (5 s leaves room for a first failure on a loaded machine; each round takes ~0.4 s.)
    status = launch([sys.executable, "-c", code], 2, grace=0.1, timeout=5, max_restarts=1000)
    err = capsys.readouterr().err
    assert status == 124
    assert "mpmdc launch: timed out after 5 seconds" in err
    assert 1 <= err.count("starting every process again") < 50, err


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_a_sigterm_to_the_launcher_stops_every_process_with_it(tmp_path, signal_name):
    """A scheduler's or a ``timeout``'s SIGTERM (or a closed terminal's SIGHUP) to
    ``mpmdc launch`` ends its processes too, not only the launcher: a process ignoring
    SIGTERM (as JAX's preemption handler makes a worker do) is killed after 3 s."""
    code = SAYS_ATTEMPT + (
        "import pathlib, signal, time\n"
        f"here = pathlib.Path({str(tmp_path)!r})\n"
        "if i == 1: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "(here / str(os.getpid())).write_text('running')\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mpmdc", "launch", "-n", "2", "--", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(path.name) for path in tmp_path.iterdir()]
    assert len(workers) == 2
    try:
        launcher.send_signal(getattr(signal, signal_name))
        _, err = launcher.communicate(timeout=20)
        assert launcher.returncode == 128 + getattr(signal, signal_name), err
        assert f"mpmdc launch: got {signal_name}; stopped processes 0 and 1" in err, err
        assert not alive(workers, within=5), "a process outlived the launcher"
    finally:
        for pid in alive(workers, within=0):
            os.kill(pid, signal.SIGKILL)


def alive(pids: list[int], within: float) -> list[int]:
    """Those of ``pids`` still there after ``within`` seconds (a killed process's entry
    lasts until it is reaped, by init once the launcher is gone)."""
    deadline = time.monotonic() + within
    while True:
        there = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                there.append(pid)
            except ProcessLookupError:
                pass
        if not there or time.monotonic() > deadline:
            return there
        time.sleep(0.05)
