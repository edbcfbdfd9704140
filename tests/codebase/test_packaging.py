"""A wheel built from ``pyproject.toml`` holds every package of the source tree.

An editable install serves any folder under ``mpmdc/``, so only a regular install
(``pip install .``, a wheel) shows a package left out of the list; this test catches it
without building one.
"""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def listed_packages() -> dict[str, pathlib.Path]:
    """Each package the wheel holds, and the folder it is built from."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools.get("package-dir", {})

    def folder(name: str) -> pathlib.Path:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest mapped prefix
            prefix = ".".join(parts[:cut])
            if prefix in folders:
                return ROOT / folders[prefix] / pathlib.Path(*parts[cut:])
        return ROOT / pathlib.Path(*parts)

    return {name: folder(name) for name in setuptools["packages"]}


def test_every_package_folder_is_in_the_wheel():
    listed = {path.resolve() for path in listed_packages().values()}
    roots = {path.resolve() for path in listed_packages().values() if path.parent == ROOT}
    found = {
        init.parent.resolve()
        for root in roots
        for init in root.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    missing = sorted(str(path.relative_to(ROOT)) for path in found - listed)
    assert not missing, (
        f"packages missing from pyproject.toml's [tool.setuptools] packages: {missing}"
    )


def test_every_listed_package_is_a_folder_with_an_init():
    absent = [
        name for name, path in listed_packages().items() if not (path / "__init__.py").is_file()
    ]
    assert not absent, f"listed in pyproject.toml but not a package folder: {absent}"
