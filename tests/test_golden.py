"""Golden tests: every stage's text and every fragment's StableHLO for each example program.

The programs live in ``tests/programs/`` (each defines ``lowered()``; the same
files work with ``mpmdc dump``). A program may set ``GOLDEN_PLATFORMS`` to emit
for more backends than the four built-in ones.
"""

from pathlib import Path

import pytest

from golden import check_golden
from mpmdc.cli.parsing import load_module

PROGRAM_DIR = Path(__file__).resolve().parent / "programs"
PROGRAMS = sorted(p.stem for p in PROGRAM_DIR.glob("*.py") if not p.name.startswith("_"))
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def rendered_files(program: str) -> dict[str, str]:
    """``{golden file name: text}`` for ``program``: stages and per-platform modules."""
    module = load_module(PROGRAM_DIR / f"{program}.py")
    lowered = module.lowered()
    files = {f"{stage}.txt": lowered.as_text(stage) for stage in lowered.stages}
    for platform in getattr(module, "GOLDEN_PLATFORMS", PLATFORMS):
        for fragment, text in lowered.stablehlo(platform).items():
            files[f"{fragment}.{platform}.mlir"] = text
    return files


def test_there_are_enough_programs():
    assert len(PROGRAMS) >= 8, PROGRAMS


@pytest.mark.parametrize("program", PROGRAMS)
def test_golden(program, update_golden):
    check_golden(program, rendered_files(program), update_golden)
