"""Golden-file comparison: expected dumps under ``golden/<program>/``.

``check_golden`` compares a program's rendered files with the folder. Any
difference fails with a unified diff; a missing file fails and says how to create
it; a file the program no longer produces fails as stale. With
``pytest --update-golden`` the folder is rewritten to exactly the rendered files.
"""

import difflib
from pathlib import Path

import pytest

GOLDEN_ROOT = Path(__file__).resolve().parent.parent / "golden"
UPDATE_HINT = (
    "run `pytest --update-golden` to rewrite the golden files, then read and commit the diff"
)


def check_golden(program: str, files: dict[str, str], update: bool) -> None:
    """Compare ``files`` (name -> text) with ``golden/<program>/``; rewrite it if ``update``."""
    folder = GOLDEN_ROOT / program
    if update:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in set(p.name for p in folder.iterdir()) - set(files):
            (folder / stale).unlink()
        for name, text in files.items():
            path = folder / name
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
        return
    problems = []
    for name, text in sorted(files.items()):
        path = folder / name
        if not path.exists():
            problems.append(f"missing golden file golden/{program}/{name}")
            continue
        expected = path.read_text()
        if expected != text:
            diff = difflib.unified_diff(
                expected.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"golden/{program}/{name}",
                tofile=f"{name} (now)",
            )
            problems.append("".join(diff))
    if folder.is_dir():
        for stale in sorted(set(p.name for p in folder.iterdir()) - set(files)):
            problems.append(f"stale golden file golden/{program}/{stale} (no longer produced)")
    if problems:
        pytest.fail("\n".join(problems) + f"\n{UPDATE_HINT}", pytrace=False)
