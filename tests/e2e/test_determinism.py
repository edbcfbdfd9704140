"""Every stage's text and every StableHLO module of every golden program is the same in
processes with different ``PYTHONHASHSEED``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

RENDER_ALL = """
import hashlib, jax
jax.config.update("jax_num_cpu_devices", 8)
import test_golden
for program in test_golden.PROGRAMS:
    for name, text in sorted(test_golden.rendered_files(program).items()):
        print(program, name, hashlib.sha256(text.encode()).hexdigest())
"""


def _render_in_subprocess(seed: str) -> list[str]:
    # test_golden here, and the helpers it imports one folder up.
    path = os.pathsep.join([str(HERE), str(HERE.parent)])
    env = dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-c", RENDER_ALL],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


@pytest.mark.slow
def test_every_stage_and_module_is_identical_across_hash_seeds():
    first, second = _render_in_subprocess("0"), _render_in_subprocess("4242")
    assert len(first) > 300  # every stage and module of every program
    assert first == second
