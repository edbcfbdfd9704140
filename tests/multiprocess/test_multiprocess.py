"""Many processes: ``mpmdc launch`` starts local CPU processes on the loopback interface.

Every launch runs under two hard limits (``mpmdc launch --timeout`` and the
subprocess timeout), so nothing here can hang CI. The scripts the processes run are
next to this file; the training one checks numbers against ``jax.jit`` and
where every output lives on each process, and process 0 saves what it fetched, which
is compared here with single-process mpmdc, bit for bit.

The schedule x model x process-layout matrix is spread over the launches to keep
these tests near 2 minutes on 2 cores (a case costs 10-20 s of four processes each
tracing and compiling on 2 cores): every schedule runs (GPipe in 4 processes;
interleaved 1F1B with 8 stages on 4 meshes, ZB-H1 and 1F1B in the mixed-shape case in
2 processes; 1F1B in the 4-process demo), and each layout runs an MLP and the
transformer with Adam; a layer stack run as one scan trains in 4 processes. ``MPMDC_MULTIPROCESS_ALL=1`` runs
the whole matrix.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpmdc
from mpmdc.cli.launch import launch

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
LIMIT = 150  # seconds any launch may take
FULL = os.environ.get("MPMDC_MULTIPROCESS_ALL") == "1"
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "dualpipev")
FOUR_BY_ONE = (
    [f"{m}:{s}" for m in ("mlp", "transformer", "scanned", "dropout") for s in SCHEDULES]
    if FULL
    else ["transformer:gpipe", "scanned:1f1b", "dropout:1f1b"]
)
TWO_BY_TWO = (
    [f"{m}:{s}" for m in ("mlp", "transformer", "scanned") for s in SCHEDULES] + ["mixed:1f1b"]
    if FULL
    else ["mlp:interleaved-1f1b", "transformer:zb-h1", "mlp:zb-v", "mixed:1f1b"]
)


def run_launch(*argv: str, limit: int = LIMIT) -> tuple[int, str]:
    """``mpmdc launch ARGV`` in a subprocess; returns (exit status, output)."""
    env = dict(os.environ)
    env.pop("MPMDC_VERIFY", None)  # the processes verify nothing extra: 2 cores, 4 processes
    result = subprocess.run(
        [sys.executable, "-m", "mpmdc", "launch", "--timeout", str(limit - 10), *argv],
        capture_output=True,
        text=True,
        timeout=limit,
        env=env,
        cwd=HERE.parent,
    )
    return result.returncode, result.stdout + result.stderr


def process_lines(output: str, index: int) -> list[str]:
    return [
        line[len(f"[{index}] ") :] for line in output.splitlines() if line.startswith(f"[{index}] ")
    ]


def single_process_results(case: str):
    """What one process with 4 one-device meshes computes for ``case`` over two steps."""
    import train

    model, schedule = case.split(":")
    step, args, feed = train.case_inputs(model, schedule)
    compiled = mpmdc.compile(step, mpmdc.make_meshes(4, {"data": 1}), donate_argnums=(0,))
    results = []
    for _ in range(2):
        out = compiled(*args)
        results.append(train.plain(out))
        args = feed(out, args)
    return results


def check_training(tmp_path, cases, output, bitwise):
    for case in cases:
        for index in range(2):
            assert f"ok {case}" in process_lines(output, index), output[-3000:]
    for case in bitwise:
        saved = np.load(tmp_path / f"{case.replace(':', '-')}.npz")
        for step, leaves in enumerate(single_process_results(case)):
            for k, want in enumerate(leaves):
                np.testing.assert_array_equal(
                    saved[f"{step}/{k}"], want, err_msg=f"{case} step {step} leaf {k}"
                )


def test_four_processes_of_one_device_train_like_jit(tmp_path):
    status, output = run_launch(
        "-n",
        "4",
        "--",
        sys.executable,
        str(HERE / "train.py"),
        str(tmp_path),
        *FOUR_BY_ONE,
        limit=LIMIT * (4 if FULL else 1),
    )
    assert status == 0, output[-3000:]
    assert "meshes on processes [[0], [1], [2], [3]]" in process_lines(output, 0)
    check_training(
        tmp_path, FOUR_BY_ONE, output, bitwise=["transformer:gpipe", "scanned:1f1b", "dropout:1f1b"]
    )


def test_two_processes_of_two_meshes_and_meshes_of_different_shapes(tmp_path):
    status, output = run_launch(
        "-n",
        "2",
        "--devices-per-process",
        "2",
        "--",
        sys.executable,
        str(HERE / "train.py"),
        str(tmp_path),
        *TWO_BY_TWO,
        limit=LIMIT * (4 if FULL else 1),
    )
    assert status == 0, output[-3000:]
    assert "meshes on processes [[0], [0], [1], [1]]" in process_lines(output, 0)
    check_training(tmp_path, TWO_BY_TWO, output, bitwise=["transformer:zb-h1"] if FULL else [])


def faults(mode: str, processes: int = 2) -> tuple[int, str]:
    return run_launch(
        "-n",
        str(processes),
        "--fault-timeout",
        "10",
        "--grace",
        "15",
        "--",
        sys.executable,
        str(HERE / "faults.py"),
        mode,
        limit=60,
    )


def caught(output: str, index: int) -> tuple[float, str]:
    """(seconds, message) of the error process ``index`` caught."""
    for line in process_lines(output, index):
        found = re.match(r"caught (\w+) after ([\d.]+) s: (.*)", line)
        if found:
            return float(found.group(2)), f"{found.group(1)}: {found.group(3)}"
    raise AssertionError(f"process {index} caught nothing:\n{output[-3000:]}")


def test_a_process_killed_mid_step_fails_the_others_quickly():
    status, output = faults("kill")
    assert status != 0
    # (With what process 0 reported of it, when that came before the launcher saw it die.)
    assert re.search(
        r"mpmdc launch: process 1 failed first: (it stopped sending transfer mesh1->mesh0 "
        r"\(its connection broke\); )?it was killed by SIGKILL",
        output,
    ), output[-3000:]
    seconds, message = caught(output, 0)
    assert seconds < 10 + 2, message  # within the fault timeout
    assert message.startswith("MpmdRuntimeError: process 0: transfer mesh1->mesh0")
    assert "sent by process 1" in message


def test_a_process_killed_at_the_end_of_a_chain_is_the_one_every_process_names():
    """Process 2 of 3 dies: process 1 loses its transfer from it, and process 0 its
    transfer from process 1 at the same moment (the data sent was a failed
    computation's), before process 1 can say why. Process 0 names process 2, where the
    lost transfers began, not process 1, which is alive."""
    status, output = faults("kill", processes=3)
    assert status != 0
    assert "mpmdc launch: process 2 failed first: " in output, output[-3000:]
    # (Each names process 2 itself, or repeats a peer's announcement blaming it: which of
    # the two waits for news ends first varies.)
    _, message = caught(output, 1)
    assert re.search(r"sent by process 2, failed .* probably died|blaming process 2", message)
    seconds, message = caught(output, 0)
    assert seconds < 10 + 2, message
    assert re.search(
        r"The transfer failed in process 1, which lost its transfer from process 2 first: "
        r"process 2 has probably died|process 1, blaming process 2, failed",
        message,
    ), message
    assert "blaming process 1" not in output


def test_a_process_that_raises_fails_the_others_naming_it():
    status, output = faults("raise")
    assert status == 3, output[-3000:]
    assert re.search(
        r"mpmdc launch: process 1 failed first: process 1: s1_fwd_mb0 .* failed on purpose.*; it exited with status 3",
        output,
    )
    _, own = caught(output, 1)
    assert "s1_fwd_mb0 on mesh1 (stage 1, microbatch 0)" in own and "failed on purpose" in own
    seconds, message = caught(output, 0)
    assert seconds < 10 + 2, message
    assert (
        "process 0 stopped waiting for transfer mesh1->mesh0 on mesh0 (sent by process 1)"
        in message
    )
    assert "process 1 failed: " in message and "failed on purpose" in message


def test_a_process_that_ends_saying_nothing_is_blamed_with_its_status():
    """Process 1 exits at once (no error to announce): process 0, whose transfer from
    it broke, fails and may exit first, yet the launcher blames process 1 and ends
    with its status."""
    status, output = faults("exit")
    assert status == 4, output[-3000:]
    assert re.search(
        r"mpmdc launch: process 1 failed first: (it stopped sending transfer mesh1->mesh0 "
        r"\(its connection broke\); )?it exited with status 4",
        output,
    ), output[-3000:]


def test_a_process_that_leaves_the_loop_early_is_blamed():
    """Process 1's script returns after one step while process 0 waits for its second:
    process 0 names that, not a stale wait of process 1's, and so does the launcher."""
    status, output = faults("leave")
    assert status != 0
    assert (
        "mpmdc launch: process 1 failed first: it left the run (its script returned) while "
        "process 0 waited for process 1 to reach the program they compiled" in output
    ), output[-3000:]
    _, message = caught(output, 0)
    assert "process 1 has left the run (its script returned)" in message, message


def test_an_uncaught_error_in_one_script_fails_the_others_naming_it():
    _status, output = faults("uncaught")
    # Process 0 may exit before process 1 (it is told at once); the launcher still
    # blames process 1, whose announcement came first.
    assert re.search(
        r"mpmdc launch: process 1 failed first: process 1 raised ValueError: a mistake in the training loop; "
        r"it exited with status 1",
        output,
    ), output[-3000:]
    seconds, message = caught(output, 0)
    assert seconds < 10 + 2, message
    assert (
        "process 1 failed: process 1 raised ValueError: a mistake in the training loop" in message
    )


@pytest.mark.parametrize(
    "mode, differ",
    [
        ("code", "equation 4 (s1_fwd_mb0)"),
        ("code-timed", "equation 4 (s1_fwd_mb0)"),
        ("arguments", "argument args[1]"),
    ],
)
def test_processes_that_traced_different_programs_fail_at_the_first_call(mode, differ):
    status, output = faults(mode)
    assert status == 3
    for index in range(2):
        _, message = caught(output, index)
        assert (
            message.startswith("ProgramMismatchError: processes")
            and f"first at {differ}" in message
        )


def test_processes_may_compile_functions_in_different_orders():
    status, output = faults("order")
    assert status == 0, output[-3000:]
    for index in range(2):
        lines = process_lines(output, index)
        assert "step 2: loss" in " ".join(lines) and any(
            line.startswith("evaluated: loss") for line in lines
        ), output[-3000:]


def test_the_demo_runs_in_four_processes():
    status, output = run_launch("-n", "4", "--", sys.executable, "-m", "mpmdc", "demo")
    assert status == 0, output[-3000:]
    report = process_lines(output, 0)
    assert any("in 4 processes" in line for line in report), output[-3000:]
    assert any(
        line.startswith("max |mpmdc - jax.jit| = ") for line in report
    )  # the status says it was small
    for index in range(1, 4):
        assert any(
            line.startswith(f"process {index} ran mesh(es) [{index}]; max |mpmdc - jax.jit| = ")
            for line in process_lines(output, index)
        ), output[-3000:]


def test_too_few_devices_across_processes_names_the_launch_that_has_enough():
    status, output = run_launch("-n", "2", "--", sys.executable, "-m", "mpmdc", "demo")
    assert status != 0
    assert (
        "need 4 devices but only 2 are available; use fewer or smaller meshes, or give each of "
        "the 2 processes 2 devices: `mpmdc launch -n 2 --devices-per-process 2 -- ...`"
    ) in output, output[-3000:]


def test_launch_reports_the_first_failure_and_stops_the_rest(capsys):
    code = (
        "import os, sys, time; i = int(os.environ['MPMDC_PROCESS_ID']); print('hi', i, flush=True); "
        "sys.exit(7) if i == 1 else time.sleep(60)"
    )
    status = launch([sys.executable, "-c", code], 2, grace=0.5, timeout=30)
    out, err = capsys.readouterr()
    assert status == 7
    assert "[0] hi 0" in out and "[1] hi 1" in out
    assert (
        "process 1 failed first: it exited with status 7; stopped process 0 (0.5 seconds after process 1 failed)"
        in err
    )


def test_launch_times_out(capsys):
    status = launch([sys.executable, "-c", "import time; time.sleep(60)"], 2, timeout=1)
    assert status == 124
    assert "timed out after 1 second; stopped processes 0 and 1" in capsys.readouterr().err


def test_meshes_spanning_processes_run_their_fragments_as_spmd():
    status, output = run_launch(
        "-n", "4", "--", sys.executable, str(HERE / "spanning.py"), limit=90
    )
    assert status == 0, output[-3000:]
    for index in range(4):
        assert "ok [[0, 1], [2, 3]]" in process_lines(output, index), output[-3000:]
