"""Rendering a ``Lowered`` program for ``mpmdc dump``: printed stages and dump folders.

A dump folder holds ``NN.<stage>.txt`` for every stage in pipeline order and
``<fragment>.<platform>.mlir`` for every fragment and requested platform (or backend). It is
rendered completely in memory, written to a temporary sibling folder and renamed
into place, so a failure never leaves a half-written folder behind.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from mpmdc.errors import UsageError

_DUMP_FILE = re.compile(r"^(\d\d\.[\w-]+\.txt|[\w-]+\.[\w-]+\.mlir)$")


def stage_header(stage: str) -> str:
    """The line that introduces a stage in ``--stage all`` output."""
    return f"// ----- {stage}"


def targets(platforms: tuple[str, ...], backends: tuple[str, ...]) -> tuple[dict, ...]:
    """What to emit StableHLO for, as keyword arguments of ``Lowered.stablehlo``: each
    ``--platform`` then each ``--backend``."""
    return tuple({"platform": p} for p in platforms) + tuple({"backend": b} for b in backends)


def render_stages(lowered, stage: str, emit_for: tuple[dict, ...]) -> str:
    """Text of ``stage`` (or of every stage for ``"all"``, each under a header).

    The ``stablehlo`` stage is shown once per entry of ``emit_for`` (:func:`targets`;
    none: the program's own backend).
    """
    stages = lowered.stages if stage == "all" else (stage,)
    chunks = []
    for name in stages:
        for target in emit_for if name == "stablehlo" and emit_for else ({},):
            text = lowered.as_text(name, **target)
            chunks.append(f"{stage_header(name)}\n{text}" if stage == "all" else text)
    return "".join(chunks)


def dump_files(lowered, emit_for: tuple[dict, ...]) -> dict[str, str]:
    """``{file name: contents}`` of a dump folder: every stage, and every module for each
    entry of ``emit_for`` (:func:`targets`), named by its platform or backend."""
    files = {f"{i:02d}.{name}.txt": lowered.as_text(name) for i, name in enumerate(lowered.stages)}
    for target in emit_for:
        (label,) = target.values()
        for fragment, module in lowered.stablehlo(**target).items():
            files[f"{fragment}.{label}.mlir"] = module
    return files


def write_dump_dir(directory: Path, files: dict[str, str]) -> None:
    """Replace ``directory`` by exactly ``files``, atomically.

    An existing folder is replaced only if it holds nothing but earlier dump files;
    anything else in it is a ``UsageError`` and the folder is left alone.
    """
    directory = Path(directory)
    if directory.exists():
        if not directory.is_dir():
            raise UsageError(f"--dump-dir {directory} exists and is not a folder")
        foreign = sorted(p.name for p in directory.iterdir() if not _DUMP_FILE.match(p.name))
        if foreign:
            raise UsageError(
                f"--dump-dir {directory} holds files that are not mpmdc dump files "
                f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                f"choose an empty or new folder"
            )
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        if directory.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
            os.replace(directory, retired / directory.name)
            os.replace(staging, directory)
            shutil.rmtree(retired)
        else:
            os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
