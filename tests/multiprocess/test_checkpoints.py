"""Checkpoints of a pipelined run in several processes (``mpmdc launch``): the example
``examples/resume_training.py`` trains 8 steps, saving every 4, in 4 processes of one
device; resumed from step 4 in 4 processes it ends bit for bit where the uninterrupted
run ended; resumed in 2 processes of 2 devices on 2 meshes (another layout, another
process count), with a process killed while saving step 8, it keeps step 4, never reads
the half-written step 8, and ends where the uninterrupted run ended up to ``ATOL``.
Under ``mpmdc launch --max-restarts``, a run whose process is killed while saving step 8
starts again by itself, resumes from step 4 and ends bit for bit where the
uninterrupted run ended.

Tolerance: resumed on 2 meshes the last 4 steps are another program (2 stages of 4
layers); the noise floor of the example's 8 steps (``jax.jit`` against itself with the
microbatches reversed; CPU, float32, gradient clipping and AdamW) is 1.9e-6; ten times that.
"""

import os
import re
import shutil
import sys

import jax
import numpy as np
import pytest
from checkpointing import example
from test_multiprocess import HERE, process_lines, run_launch

from mpmdc.checkpoint import restore, storage

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

ATOL = 2e-5


def entries(folder) -> list[str]:
    """What ``folder`` holds, but the lock that commits into it take."""
    return sorted(set(os.listdir(folder)) - {storage.LOCK_FILE})


def launch_example(directory, *options, processes=4, devices=1, die_at="-", restarts=0):
    layout = ["-n", str(processes), "--devices-per-process", str(devices)]
    faults = ["--fault-timeout", "10", "--grace", "15", "--max-restarts", str(restarts)]
    script = [sys.executable, str(HERE / "checkpointing.py"), die_at, str(directory)]
    return run_launch(*layout, *faults, "--", *script, "--save-every", "4", "--keep", "3", *options)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    status, output = launch_example(directory, "--steps", "8")
    assert status == 0, output[-3000:]
    assert entries(directory) == ["4", "8"]
    # What processes 1-3 left process 0 of their chunks' checksums is in the index now
    # (every restore below checks each chunk against it).
    assert not [name for name in os.listdir(directory / "8") if name.startswith("__")]
    return directory


def test_a_run_resumed_in_four_processes_ends_where_the_uninterrupted_one_did(
    uninterrupted, tmp_path
):
    shutil.copytree(uninterrupted / "4", tmp_path / "4")
    status, output = launch_example(tmp_path, "--steps", "8")
    assert status == 0, output[-3000:]
    assert f"resumed from step 4 in {tmp_path}/4" in process_lines(output, 0)
    got, want = restore(tmp_path / "8"), restore(uninterrupted / "8")
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    # Restored by one process onto one device, for a plain jax.jit program.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = jax.eval_shape(example.init_params, jax.random.key(0))
    state = {"params": params, "opt_state": jax.eval_shape(example.TX.init, params)}
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), state)
    restored = restore(uninterrupted / "8", target)
    for path, value in jax.tree_util.tree_leaves_with_path(restored):
        assert value.sharding == one
        np.testing.assert_array_equal(value, want[jax.tree_util.keystr(path)])


def test_a_process_killed_saving_leaves_the_last_step_which_resumes_in_another_layout(
    uninterrupted, tmp_path
):
    shutil.copytree(uninterrupted / "4", tmp_path / "4")
    two_by_two = {"processes": 2, "devices": 2}
    status, output = launch_example(
        tmp_path, "--steps", "8", "--meshes", "2", die_at="8", **two_by_two
    )
    assert status != 0
    assert re.search(  # (after a peer's report of it, where one came first)
        r"mpmdc launch: process 1 failed first: (.*; )?it was killed by SIGKILL", output
    ), output[-3000:]
    [died] = [name for name in entries(tmp_path) if name != "4"]  # step 4 whole, 8 never committed
    assert re.fullmatch(r"8\.[0-9a-f]+\.partial", died)
    status, output = launch_example(tmp_path, "--steps", "8", "--meshes", "2", **two_by_two)
    assert status == 0, output[-3000:]
    assert f"resumed from step 4 in {tmp_path}/4" in process_lines(output, 0)
    assert entries(tmp_path) == ["4", "8"]  # the dead save's folder removed on the restart
    got, want = restore(tmp_path / "8"), restore(uninterrupted / "8")
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=0, atol=ATOL, err_msg=path)


def test_a_run_restarted_after_a_process_was_killed_ends_where_the_uninterrupted_one_did(
    uninterrupted, tmp_path
):
    status, output = launch_example(tmp_path, "--steps", "8", die_at="8", restarts=2)
    assert status == 0, output[-3000:]
    assert re.search(  # (after a peer's report of it, where one came first)
        r"mpmdc launch: process 3 failed first: (.*; )?it was killed by SIGKILL", output
    ), output[-3000:]
    assert "mpmdc launch: restart 1 of 2: starting every process again" in output
    assert "restart 2 of 2" not in output  # the second attempt succeeded
    assert f"resumed from step 4 in {tmp_path}/4" in process_lines(output, 0), output[-3000:]
    assert entries(tmp_path) == ["4", "8"]  # the killed save's folder removed on the restart
    got, want = restore(tmp_path / "8"), restore(uninterrupted / "8")
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def test_a_preemption_notice_to_one_process_stops_every_process_at_one_saved_step(tmp_path):
    """The last process gets SIGTERM (JAX catches it as a preemption notice) as step 2
    begins: every process goes on to the step they agree on
    (``CheckpointManager.reached_preemption``), saves it whatever ``--save-every`` says,
    and stops there, long before ``--steps``; the run resumes from it."""
    status, output = launch_example(
        tmp_path, "--steps", "200", processes=2, devices=2, die_at="term@2"
    )
    assert status == 0, output[-3000:]
    stops = [line for line in process_lines(output, 0) if line.startswith("preempted:")]
    assert len(stops) == 1, output[-3000:]
    step = int(stops[0].rsplit(" ", 1)[1])
    assert 2 < step < 200, stops
    assert max(map(int, entries(tmp_path))) == step
    status, output = launch_example(tmp_path, "--steps", str(step + 1), processes=2, devices=2)
    assert status == 0, output[-3000:]
    assert f"resumed from step {step} in {tmp_path}/{step}" in process_lines(output, 0)


def test_a_save_failing_on_one_process_fails_that_save_everywhere_and_removes_its_folder(
    tmp_path,
):
    """Process 1's writes fail as on a full disk: it raises ``CheckpointError`` naming why,
    process 0 an ``MpmdRuntimeError`` naming process 1; the save's partial folder is gone
    once both have stopped, and the next save of the run succeeds."""
    script = [sys.executable, str(HERE / "failed_save.py"), str(tmp_path)]
    status, output = run_launch("-n", "2", "--fault-timeout", "10", "--", *script)
    assert status == 0, output[-3000:]
    assert any(
        line.startswith("caught CheckpointError: process 1 failed to save")
        and "No space left on device" in line
        for line in process_lines(output, 1)
    ), output[-3000:]
    assert any(
        line.startswith("caught MpmdRuntimeError") and "process 1 failed to save" in line
        for line in process_lines(output, 0)
    ), output[-3000:]
    assert entries(tmp_path) == ["second"]
    np.testing.assert_array_equal(restore(tmp_path / "second")["['w']"], np.ones((8, 4)))


def test_a_managers_processes_agree_on_its_steps_when_they_see_them_differently(tmp_path):
    """Process 1 sees the manager's directory late (only step 1, then not step 2): the
    steps, the latest step, the step restored and the refusal to save step 2 again are
    process 0's on both; a restore process 1 cannot read fails on both, and the run goes
    on. A plain save is judged by process 0 alone: one process 1 wrongly refuses goes
    ahead, and one process 0 refuses fails on both (process 1 names process 0)."""
    script = [sys.executable, str(HERE / "agreed_steps.py"), str(tmp_path)]
    status, output = run_launch("-n", "2", "--fault-timeout", "10", "--", *script)
    assert status == 0, output[-3000:]
    for index in (0, 1):
        lines = process_lines(output, index)
        assert "steps [1, 2] latest 2" in lines, output[-3000:]
        assert "restored 2.0" in lines, output[-3000:]
        caught = [
            line
            for line in lines
            if line.startswith("caught CheckpointError") and "plain" not in line
        ]
        assert len(caught) == 2, output[-3000:]
        assert "step 2 is already saved" in caught[0]
        assert "no checkpoint at" in caught[1] and "process 1" in caught[1]
        assert "done [1, 2, 3]" in lines, output[-3000:]
        assert "saved plain 1" in lines and "saved plain 2" not in lines, output[-3000:]
    refused = [line for line in process_lines(output, 1) if "a checkpoint is already at" in line]
    assert len(refused) == 1 and refused[0].startswith("caught MpmdRuntimeError"), output[-3000:]
    assert "process 0 failed to save" in refused[0]
