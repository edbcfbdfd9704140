"""Golden tests: every stage's text and every fragment's StableHLO for each example program.

The programs live in ``tests/programs/`` (each defines ``lowered()``; the same
files work with ``mpmdc dump``). A program may set ``GOLDEN_BACKENDS`` to pin the
modules of other backends than the four built-in ones (one per platform).

``golden/<program>/`` holds ``<stage>.txt`` for every stage and each distinct module
once (``module_files``): ``<fragment>.mlir`` where every platform emits the same text,
else ``<fragment>.<platform>.mlir`` for every platform. The file names thus record
which fragments are identical across platforms, and a platform that starts to differ
changes them, which the golden check reports.
"""

import functools
from pathlib import Path

import pytest

from golden import GOLDEN_ROOT, check_golden
from mpmdc.cli.parsing import load_module

PROGRAM_DIR = Path(__file__).resolve().parents[1] / "programs"
PROGRAMS = sorted(p.stem for p in PROGRAM_DIR.glob("*.py") if not p.name.startswith("_"))
BACKENDS = ("cpu", "cuda", "rocm", "tpu")  # one per platform
# Golden folders that belong to other tests, not to a program here.
NOT_PROGRAMS = {"error_catalog"}  # tests/e2e/test_bad_input_catalog.py


@functools.cache
def render(program: str) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``(stages, modules)`` of ``program``: ``{"<stage>.txt": text}`` and
    ``{fragment: {platform: StableHLO text}}`` for every platform it renders.

    Cached: several tests read the same program, and lowering is the slow part."""
    module = load_module(PROGRAM_DIR / f"{program}.py")
    lowered = module.lowered()
    stages = {f"{stage}.txt": lowered.as_text(stage) for stage in lowered.stages}
    modules: dict[str, dict[str, str]] = {}
    for backend in getattr(module, "GOLDEN_BACKENDS", BACKENDS):
        for fragment, text in lowered.stablehlo(backend=backend).items():
            modules.setdefault(fragment, {})[backend] = text
    return stages, modules


def rendered_files(program: str) -> dict[str, str]:
    """``{file name: text}`` for ``program``: every stage and every platform's module,
    without deduplication (``test_determinism`` hashes each of them)."""
    stages, modules = render(program)
    return stages | {
        f"{fragment}.{platform}.mlir": text
        for fragment, by_platform in modules.items()
        for platform, text in by_platform.items()
    }


def module_files(fragment: str, by_platform: dict[str, str]) -> dict[str, str]:
    """Golden files for one fragment's modules, ``by_platform`` holding every platform
    the program renders: ``{"<fragment>.mlir": text}`` when they all emit the same
    text, else ``{"<fragment>.<platform>.mlir": text}`` for every platform.

    When they differ, every platform keeps its own file (not only the odd ones), so
    each file is exactly what that platform emits."""
    texts = set(by_platform.values())
    if len(texts) == 1:
        return {f"{fragment}.mlir": texts.pop()}
    return {f"{fragment}.{platform}.mlir": text for platform, text in by_platform.items()}


def golden_files(program: str) -> dict[str, str]:
    """``{golden file name: text}`` for ``program``: its stages and its distinct modules."""
    stages, modules = render(program)
    files = dict(stages)
    for fragment, by_platform in modules.items():
        files |= module_files(fragment, by_platform)
    return files


def test_every_program_has_a_golden_folder_and_every_folder_a_program():
    """No program goes unchecked for want of a golden folder, and no folder outlives its program."""
    folders = {p.name for p in GOLDEN_ROOT.iterdir() if p.is_dir()} - NOT_PROGRAMS
    assert not set(PROGRAMS) - folders, (
        f"programs without golden/<program>/: {sorted(set(PROGRAMS) - folders)}; "
        "run `pytest --update-golden tests/e2e/test_golden.py` to create them"
    )
    assert not folders - set(PROGRAMS), (
        f"golden folders without a program in tests/programs/: {sorted(folders - set(PROGRAMS))}; delete them"
    )


@pytest.mark.parametrize("program", PROGRAMS)
def test_golden(program, update_golden):
    """``golden/<program>/`` holds exactly the program's stages and distinct modules."""
    check_golden(program, golden_files(program), update_golden)


@pytest.mark.parametrize("program", PROGRAMS)
def test_fragments_stored_once_are_identical_on_every_platform(program):
    """The golden folder stores a fragment once exactly when every platform emits the
    same module for it. ``test_golden`` fails on the same change (as missing and stale
    files); this names the fragment and which platforms emit which module."""
    folder = GOLDEN_ROOT / program
    held = {p.name.removesuffix(".mlir") for p in folder.glob("*.mlir")}
    problems = []
    for fragment, by_platform in sorted(render(program)[1].items()):
        groups: dict[str, list[str]] = {}
        for platform, text in by_platform.items():
            groups.setdefault(text, []).append(platform)
        stored_once = fragment in held
        per_platform = {f"{fragment}.{platform}" for platform in by_platform} <= held
        if stored_once and len(groups) > 1:
            stored = (folder / f"{fragment}.mlir").read_text()
            emitted = " | ".join(
                ", ".join(platforms) + (" (as stored)" if text == stored else " (different)")
                for text, platforms in groups.items()
            )
            problems.append(
                f"{fragment} is stored once as golden/{program}/{fragment}.mlir, "
                f"but the platforms now emit {len(groups)} different modules: {emitted}"
            )
        elif per_platform and len(groups) == 1:
            problems.append(
                f"{fragment} is stored per platform in golden/{program}/, "
                f"but {', '.join(by_platform)} now all emit the same module"
            )
    assert not problems, "\n".join(problems)
