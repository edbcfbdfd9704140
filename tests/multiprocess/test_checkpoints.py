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
import shutil
import sys

import jax
import numpy as np
import pytest
from checkpointing import example
from test_multiprocess import HERE, process_lines, run_launch

from mpmdc.checkpoint import restore

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

ATOL = 2e-5


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
    assert sorted(os.listdir(directory)) == ["4", "8"]
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
    assert "mpmdc launch: process 1 failed first: it was killed by SIGKILL" in output, output[
        -3000:
    ]
    assert sorted(os.listdir(tmp_path)) == ["4", "8.partial"]  # step 4 whole, 8 never committed
    status, output = launch_example(tmp_path, "--steps", "8", "--meshes", "2", **two_by_two)
    assert status == 0, output[-3000:]
    assert f"resumed from step 4 in {tmp_path}/4" in process_lines(output, 0)
    assert sorted(os.listdir(tmp_path)) == ["4", "8"]  # the partial save cleared away
    got, want = restore(tmp_path / "8"), restore(uninterrupted / "8")
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=0, atol=ATOL, err_msg=path)


def test_a_run_restarted_after_a_process_was_killed_ends_where_the_uninterrupted_one_did(
    uninterrupted, tmp_path
):
    status, output = launch_example(tmp_path, "--steps", "8", die_at="8", restarts=2)
    assert status == 0, output[-3000:]
    assert "mpmdc launch: process 3 failed first: it was killed by SIGKILL" in output, output[
        -3000:
    ]
    assert "mpmdc launch: restart 1 of 2: starting every process again" in output
    assert "restart 2 of 2" not in output  # the second attempt succeeded
    assert f"resumed from step 4 in {tmp_path}/4" in process_lines(output, 0), output[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["4", "8"]  # the killed save's partial one cleared
    got, want = restore(tmp_path / "8"), restore(uninterrupted / "8")
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
