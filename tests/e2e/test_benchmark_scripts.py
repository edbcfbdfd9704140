"""The scripts that are run on accelerators when one is lent still run, here on the CPU:
``benchmarks/gpu_check.py`` (every check passes) and ``benchmarks/spmd_pipeline.py`` on
one device (every stage on one mesh, the SPMD pipeline's stages on one device)."""

import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def run(*args: str, timeout: int) -> str:
    result = subprocess.run(
        [sys.executable, *args],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_gpu_check_passes_on_the_cpu():
    out = run("gpu_check.py", "--platform", "cpu", timeout=600)
    rows = [line for line in out.splitlines() if line.startswith("| ") and "| check |" not in line]
    assert len(rows) == 8 and all("| yes |" in row for row in rows), out


@pytest.mark.slow
def test_spmd_pipeline_runs_with_every_stage_on_one_device():
    out = run(
        "spmd_pipeline.py",
        *("--platform", "cpu", "--devices", "1", "--L", "4", "--M", "2"),
        *("--width", "16", "--microbatch-rows", "4", "--steps", "1"),
        timeout=600,
    )
    programs = [line.split(" | ")[2] for line in out.splitlines() if line.startswith("| 4 |")]
    assert programs == [
        "jax.jit, 1 device",
        "SPMD pipeline (GPipe)",
        "mpmdc interleaved-1f1b",
        "mpmdc gpipe",
    ], out
    assert all(line.endswith("| yes |") for line in out.splitlines() if line.startswith("| 4 |"))
