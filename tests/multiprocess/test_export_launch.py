"""An exported training step under ``mpmdc launch -n 4``: exported here in one process
(4 meshes of 2 devices), loaded by 4 processes of 2 devices that never import the
function (``run_exported.py``), each running its own mesh; two steps bitwise equal to
the compiled function here. Hard time limits as in ``test_multiprocess.py``."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_multiprocess import LIMIT, process_lines, run_launch

import mpmdc

pytestmark = pytest.mark.slow  # the heavy tier: `pytest -m slow`

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "e2e"))
import test_export  # noqa: E402  (the step exported: defined once, beside the fast tests)


def test_four_processes_run_an_exported_step_bitwise(tmp_path, meshes4):
    step = mpmdc.compile(test_export.train_step, meshes4)
    args = test_export.inputs()
    (tmp_path / "step.mpmdc").write_bytes(mpmdc.export(step)(*args).serialize())
    np.savez(tmp_path / "inputs.npz", *test_export.leaves(args))
    status, output = run_launch(
        "-n",
        "4",
        "--devices-per-process",
        "2",
        "--",
        sys.executable,
        str(HERE / "run_exported.py"),
        str(tmp_path / "step.mpmdc"),
        str(tmp_path / "inputs.npz"),
        str(tmp_path / "out.npz"),
        "2",
        limit=LIMIT,
    )
    assert status == 0, output[-3000:]
    for index in range(4):
        assert any(line.startswith("ok 4 process(es)") for line in process_lines(output, index))
    saved = np.load(tmp_path / "out.npz")
    for k in range(2):
        out = step(*args)
        for i, want in enumerate(jax.tree_util.tree_leaves(out)):
            np.testing.assert_array_equal(saved[f"{k}/{i}"], np.asarray(want), err_msg=f"{k}/{i}")
        args = (out[1], out[2], *args[2:])
