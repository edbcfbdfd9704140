"""mpmdc raises its own errors: every exception class raised in mpmdc's code is an
``MpmdcError`` subclass, so ``except mpmdc.MpmdcError`` catches what a user can cause.

The mistakes themselves, and the message each one gives, are the catalog's
(``tests/e2e/test_bad_input_catalog.py``).
"""

import ast
import builtins
import pathlib

import mpmdc
from mpmdc import errors

SOURCES = [
    pathlib.Path(package.__file__).parent for package in (mpmdc, mpmdc.passes, mpmdc.lowering)
]
# Raised on purpose and documented where they are: a broken invariant (AssertionError
# style), protocols Python defines (StopIteration, NotImplementedError in a base class),
# or an exception re-raised after being caught (``raise`` of a name bound by ``except``).
PYTHON_PROTOCOL = {"NotImplementedError", "StopIteration", "KeyboardInterrupt", "SystemExit"}
# Raised to be caught one frame up and turned into an MpmdcError there: pydantic
# validators must raise ValueError (the CLI turns it into a UsageError), and prefix
# broadcasting's ValueError becomes the SpecError or AccumulateError of its caller, and
# an unbalanced bracket in option text the PassError or UsageError of its caller; a
# pass's broken invariant becomes the pipeline's InternalError naming the pass.
CAUGHT_BY_CALLER = {
    ("parsing.py", "ValueError"),
    ("pytrees.py", "ValueError"),
    ("_text.py", "ValueError"),
    ("slice_stacks.py", "RuntimeError"),
}


def raised_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, class name)`` for every ``raise Name(...)`` / ``raise Name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name):
                found.append((node.lineno, target.id))
    return found


def test_every_raised_class_is_an_mpmdc_error():
    foreign = []
    for folder in SOURCES:
        for path in folder.rglob("*.py"):
            for line, name in raised_names(path):
                cls = getattr(errors, name, None) or getattr(builtins, name, None)
                if cls is None or name in PYTHON_PROTOCOL or (path.name, name) in CAUGHT_BY_CALLER:
                    continue  # a caught exception re-raised, or a Python protocol
                if not issubclass(cls, errors.MpmdcError):
                    foreign.append(f"{path.name}:{line} raises {name}")
    assert not foreign, "raise an mpmdc.errors class instead: " + "; ".join(foreign)


def test_the_check_sees_a_foreign_raise(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    raise ValueError('x')\n")
    assert raised_names(bad) == [(2, "ValueError")]


def test_the_debugging_guide_lists_every_error_a_user_can_cause():
    """Each ``MpmdcError`` subclass is a row of the error table in docs/guides/debugging.md
    (the runtime's and mpmdc's own bugs have sections of their own there)."""
    guide = (pathlib.Path(__file__).parents[2] / "docs" / "guides" / "debugging.md").read_text()
    rows = {line.split("|")[1] for line in guide.splitlines() if line.startswith("| `")}
    listed = {name.strip(" `") for row in rows for name in row.split(",")}
    own_sections = {"MpmdRuntimeError", "InternalError"}
    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.MpmdcError)
    }
    classes -= {"MpmdcError"}
    assert classes - own_sections <= listed, sorted(classes - own_sections - listed)
