"""What ``mpmdc dump`` reads from outside: ``FILE.py:TARGET``, ``--args`` and ``--meshes``.

The options are validated by pydantic models, so every malformed value becomes one
:class:`~mpmdc.errors.UsageError` naming the option and showing the expected form.
Nothing here starts JAX's backends before the command has set the device count.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from mpmdc._text import a_type, split_top_level
from mpmdc.api import Lowered, compile
from mpmdc.errors import PassError, UsageError
from mpmdc.pipeline import resolve
from mpmdc.runtime.meshes import make_meshes

DTYPES = {
    "bool": "bool",
    "pred": "bool",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "c64": "complex64",
    "c128": "complex128",
}

_ARG = re.compile(r"^([a-z][a-z0-9]*)\[([0-9,\s]*)\]$")
_MESHES = re.compile(r"^(?:(\d+)\s*x\s*)?\((.*)\)$")
_AXIS = re.compile(r"^([A-Za-z_]\w*)\s*=\s*(\d+)$")
_TARGET = re.compile(r"^(.+\.py):([A-Za-z_][\w.]*)$")


class ArgType(BaseModel):
    """One ``--args`` entry such as ``f32[8,16]``: a dtype and a shape."""

    model_config = ConfigDict(frozen=True)
    dtype: str
    shape: tuple[int, ...]

    def to_struct(self):
        """The ``jax.ShapeDtypeStruct`` this entry describes."""
        return jax.ShapeDtypeStruct(self.shape, jnp.dtype(self.dtype))


class MeshesSpec(BaseModel):
    """``--meshes 4x(data=2)``: how many meshes and the axes of each."""

    model_config = ConfigDict(frozen=True)
    count: int
    axes: dict[str, int]

    @property
    def devices_needed(self) -> int:
        """Devices the meshes use together."""
        return self.count * math.prod(self.axes.values())


def parse_args(text: str) -> tuple[ArgType, ...]:
    """``"f32[8,16], i32[]"`` as argument types (a bad entry is a ``ValueError``)."""
    try:
        entries = split_top_level(text, "[]")
    except ValueError:  # an unclosed bracket: the whole text is the entry that is no type
        entries = [text]
    out = []
    for entry in (e.strip() for e in entries):
        match = _ARG.match(entry)
        dtype = match and DTYPES.get(match[1], match[1])
        if not match or dtype not in DTYPES.values():
            raise ValueError(
                f"{entry!r} is not a type like f32[8,16] (dtypes: {', '.join(DTYPES)})"
            )
        dims = [d.strip() for d in match[2].split(",") if d.strip()]
        out.append(ArgType(dtype=dtype, shape=tuple(int(d) for d in dims)))
    return tuple(out)


def parse_meshes(text: str) -> MeshesSpec:
    """``"4x(data=2)"`` or ``"(data=2,model=2)"`` as a mesh count and axes."""
    match = _MESHES.match(text.strip())
    axes = {}
    if match:
        for part in match[2].split(","):
            axis = _AXIS.match(part.strip())
            if not axis or axis[1] in axes or int(axis[2]) < 1:
                match = None
                break
            axes[axis[1]] = int(axis[2])
    if not match or not axes or (match[1] is not None and int(match[1]) < 1):
        raise ValueError(f"{text!r} is not a mesh list like 4x(data=2) or 2x(data=2,model=2)")
    return MeshesSpec(count=int(match[1] or 1), axes=axes)


class DumpOptions(BaseModel):
    """The options of ``mpmdc dump``, validated before anything is imported or traced."""

    model_config = ConfigDict(frozen=True)
    target: str
    stage: str = "after-split"
    platforms: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    dump_dir: Path | None = None
    list_stages: bool = False
    transfers: bool = False
    args: tuple[ArgType, ...] | None = None
    meshes: MeshesSpec | None = None
    passes: str | None = None

    @field_validator("target")
    @classmethod
    def _target_form(cls, value: str) -> str:
        if not _TARGET.match(value):
            raise ValueError(f"{value!r} is not FILE.py:TARGET (e.g. model.py:lowered)")
        return value

    @field_validator("args", mode="before")
    @classmethod
    def _parse_args(cls, value):
        return parse_args(value) if isinstance(value, str) else value

    @field_validator("passes")
    @classmethod
    def _known_passes(cls, value):
        if value is not None:
            try:
                resolve(value)
            except PassError as err:
                raise ValueError(str(err)) from None
        return value

    @field_validator("meshes", mode="before")
    @classmethod
    def _parse_meshes(cls, value):
        return parse_meshes(value) if isinstance(value, str) else value

    @classmethod
    def from_cli(cls, **values) -> DumpOptions:
        """Validate command-line values; the first problem becomes a one-line ``UsageError``."""
        try:
            return cls(**values)
        except ValidationError as err:
            first = err.errors()[0]
            option = "--" + str(first["loc"][0]).replace("_", "-") if first["loc"] else "options"
            message = first["msg"].removeprefix("Value error, ")
            raise UsageError(f"{option}: {message}") from None

    @property
    def file(self) -> Path:
        """The Python file named by ``target``."""
        return Path(_TARGET.match(self.target)[1])

    @property
    def target_name(self) -> str:
        """The (possibly dotted) attribute named by ``target``."""
        return _TARGET.match(self.target)[2]


def load_module(path: Path):
    """Import the Python file ``path`` as a fresh module (its folder goes on ``sys.path``)."""
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    folder = str(path.resolve().parent)
    name = "mpmdc_target_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def find_target(module, path: Path, name: str):
    """The callable ``name`` (dotted for nested attributes) in ``module``."""
    value = module
    for part in name.split("."):
        if not hasattr(value, part):
            defined = sorted(
                k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
            )
            raise UsageError(
                f"{path} has no target {name!r}; callables it defines: {', '.join(defined) or 'none'}"
            )
        value = getattr(value, part)
    if not callable(value):
        raise UsageError(f"target {path}:{name} is {a_type(value)}, not a function")
    return value


def lowered_from_target(target, options: DumpOptions):
    """Turn the target into an ``mpmdc.Lowered`` as the options say."""
    where = f"{options.file}:{options.target_name}"
    if options.args is not None:
        if options.meshes is None:
            raise UsageError(
                f"--args needs --meshes (e.g. --meshes '4x(data=2)') to compile {where}"
            )
        structs = [a.to_struct() for a in options.args]
        try:
            inspect.signature(target).bind(*structs)
        except TypeError as err:  # (the signature says what the call would fail on)
            raise UsageError(
                f"--args gives {len(structs)} argument type{'' if len(structs) == 1 else 's'}, but "
                f"{where}{_parameters(target)} "
                f"cannot take them ({err}); give one type per positional argument"
            ) from None
        except ValueError:  # (no signature to check: the call will say)
            pass
        meshes = make_meshes(options.meshes.count, options.meshes.axes)
        return compile(target, meshes).lower(*structs)
    required = [
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if required:
        raise UsageError(
            f"{where} takes arguments ({', '.join(required)}); give their types with --args "
            f"(e.g. --args 'f32[8,16], f32[16,4]') and --meshes, or name a zero-argument "
            f"function returning mpmdc.Lowered"
        )
    result = target()
    if not isinstance(result, Lowered):
        raise UsageError(
            f"{where} returned {type(result).__name__}, not mpmdc.Lowered; return "
            f"mpmdc.compile(fn, meshes).lower(...) from it, or pass --args and --meshes"
        )
    return result


def _parameters(target) -> str:
    """``target``'s parameter list as its signature prints it, ``(x, w)``."""
    return str(inspect.signature(target))
