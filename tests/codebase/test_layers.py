"""The package layout: no module imports from a layer above its own.

The layers, lowest first, are listed in docs/design.md ("Package layout") and in
each package's ``__init__`` docstring. An import inside ``if TYPE_CHECKING:`` counts
too: a lower layer's types do not name a higher layer's.
"""

import ast
import pathlib

import pytest

import mpmdc

ROOT = pathlib.Path(mpmdc.__file__).resolve().parent
# (module prefix, layer); the longest matching prefix decides.
LAYERS = [
    ("mpmdc.errors", 0),
    ("mpmdc._jax_compat", 0),
    ("mpmdc._text", 0),
    ("mpmdc.ir", 1),
    ("mpmdc.schedules", 2),
    ("mpmdc.lowering", 3),
    ("mpmdc.backends", 3),
    ("mpmdc.passes", 4),
    ("mpmdc.pipeline", 4),  # the passes' registry order and runner
    ("mpmdc.planning", 4),  # the plan pass's estimates and choices: it runs a pipeline
    ("mpmdc.distributed", 5),
    ("mpmdc.runtime", 5),
    ("mpmdc.watchdog", 5),
    ("mpmdc.api", 6),
    ("mpmdc.options", 6),  # compile's options, parsed once: they name passes and schedules
    ("mpmdc.signatures", 6),  # a call's arguments and cache key: read off a Compiled
    ("mpmdc.checkpoint", 6),
    ("mpmdc.exporting", 6),
    ("mpmdc.cli", 7),
    ("mpmdc.__main__", 8),
    ("mpmdc", 8),  # the package's own __init__: the public API
]


def layer_of(module: str) -> int:
    for prefix, layer in sorted(LAYERS, key=lambda p: -len(p[0])):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} is in no layer; add it to LAYERS and docs/design.md's layout")


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package, by dotted name (passes/ and lowering/
    are installed as mpmdc.passes and mpmdc.lowering)."""
    found = {}
    for package, folder in [
        ("mpmdc", ROOT),
        ("mpmdc.passes", pathlib.Path(mpmdc.passes.__file__).parent),
        ("mpmdc.lowering", pathlib.Path(mpmdc.lowering.__file__).parent),
    ]:
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imported(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) for every mpmdc module ``path`` imports, lazily or not."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("mpmdc")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpmdc"):
            if node.module == "mpmdc":  # ``from mpmdc import backends`` imports a submodule
                out += [(node.lineno, f"mpmdc.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_from_a_layer_above(module):
    own = layer_of(module)
    upward = [
        f"line {line}: {target} (layer {layer_of(target)})"
        for line, target in imported(MODULES[module])
        if layer_of(target) > own
    ]
    assert not upward, f"{module} (layer {own}) imports from above: " + "; ".join(upward)


def test_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from mpmdc.api import compile\nif TYPE_CHECKING:\n    from mpmdc.cli import main\n"
    )
    assert imported(bad) == [(1, "mpmdc.api"), (3, "mpmdc.cli")]
    assert layer_of("mpmdc.api") > layer_of("mpmdc.ir.program")
