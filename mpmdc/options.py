"""``mpmdc.compile``'s options, checked once: one frozen :class:`CompileOptions`.

``compile`` takes its keywords as ``jax.jit`` does and builds one ``CompileOptions``
(as ``jax.jit`` builds its ``JitInfo``); everything after it (``Wrapped``, the call
path, tracing) reads that object, so an option is named, defaulted and checked in
one place.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpmdc import backends, schedules
from mpmdc.errors import ArgumentError, StageError
from mpmdc.ir.primitives import BALANCED
from mpmdc.pipeline import Pass, resolve, with_plan
from mpmdc.runtime.executable_cache import DEFAULT_CACHE_SIZE
from mpmdc.runtime.meshes import check_meshes


@dataclass(frozen=True)
class CompileOptions:
    """What ``mpmdc.compile`` was asked for, normalised and checked (see its docstring).

    Build it with :meth:`parse`, which checks every option and reads ``fn``'s
    signature: ``static_argnames`` and ``donate_argnames`` then also hold the names of
    the parameters numbered in ``*_argnums``, and ``static_by_name`` and
    ``donate_by_name`` the numbers of the parameters named in ``*_argnames``, as
    ``jax.jit`` reads them.
    """

    meshes: tuple
    in_specs: Any = None
    out_specs: Any = None
    out_shardings: Any = None
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()
    stage_to_mesh: tuple[int, ...] | None = None
    schedule: Any = None  # an ``mpmdc.schedules`` schedule or chooser, or None
    partition: str | None = None
    backend: str = "cpu"
    passes: tuple[Pass, ...] = ()
    cache_size: int | None = DEFAULT_CACHE_SIZE
    # Read off ``fn``'s signature: the names of its positional parameters, and those
    # passed by position that ``*_argnames`` make static (or donated).
    positional: tuple[str, ...] = ()
    static_by_name: tuple[int, ...] = ()
    donate_by_name: tuple[int, ...] = ()

    @classmethod
    def parse(
        cls,
        fn: Callable,
        meshes,
        *,
        in_specs=None,
        out_specs=None,
        out_shardings=None,
        static_argnums=(),
        static_argnames=(),
        donate_argnums=(),
        donate_argnames=(),
        stage_to_mesh=None,
        schedule=None,
        partition=None,
        backend: str | None = None,
        passes=None,
        cache_size: int | None = DEFAULT_CACHE_SIZE,
    ) -> CompileOptions:
        """The options of ``mpmdc.compile(fn, meshes, ...)``, each checked: a mistake is an
        ``MpmdcError`` naming the option, raised here, as it is one in this call and not
        in the traced function."""
        if not callable(fn):
            raise ArgumentError(f"mpmdc.compile expects a callable, got {type(fn).__name__}.")
        meshes = tuple(check_meshes(meshes))
        static_nums = _normalize_argnums(static_argnums, "static_argnums")
        donate_nums = _normalize_argnums(donate_argnums, "donate_argnums")
        static_names = _normalize_argnames(static_argnames, "static_argnames")
        donate_names = _normalize_argnames(donate_argnames, "donate_argnames")
        # What the numbers and names mean in the other form: parameters named in the
        # ``*_argnames`` when passed by position, and those numbered when passed by name.
        params = _parameters(fn)
        static_by_name, more_static = _by_other_name(
            fn, params, static_nums, static_names, "static_argnames"
        )
        donate_by_name, more_donated = _by_other_name(
            fn, params, donate_nums, donate_names, "donate_argnames"
        )
        stage_to_mesh = _checked_stage_to_mesh(stage_to_mesh, len(meshes))
        schedule = None if schedule is None else schedules.get(schedule)
        if partition not in (None, BALANCED):
            raise StageError(f"partition must be None or {BALANCED!r}, got {partition!r}.")
        first = meshes[0].devices.flat[0]
        backend = backends.get(
            backend or backends.for_platform(first.platform, first.client.platform_version)
        ).name
        return cls(
            meshes=meshes,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shardings=out_shardings,
            static_argnums=static_nums,
            static_argnames=tuple(dict.fromkeys(static_names + more_static)),
            donate_argnums=donate_nums,
            donate_argnames=tuple(dict.fromkeys(donate_names + more_donated)),
            stage_to_mesh=stage_to_mesh,
            schedule=schedule,
            partition=partition,
            backend=backend,
            passes=tuple(with_plan(resolve(passes, backend))),
            cache_size=_checked_cache_size(cache_size),
            positional=tuple(_positional_names(params)),
            static_by_name=static_by_name,
            donate_by_name=donate_by_name,
        )

    def replace(self, **changes) -> CompileOptions:
        """These options with ``changes``."""
        return dataclasses.replace(self, **changes)


def _normalize_argnums(argnums, what: str) -> tuple[int, ...]:
    if isinstance(argnums, int):
        argnums = (argnums,)
    try:
        out = tuple(int(a) for a in argnums)
    except TypeError:
        raise ArgumentError(
            f"{what} must be an int or a sequence of ints, got {argnums!r}."
        ) from None
    return out


def _normalize_argnames(argnames, what: str) -> tuple[str, ...]:
    if isinstance(argnames, str):
        argnames = (argnames,)
    try:
        out = tuple(argnames)
    except TypeError:
        out = (None,)
    if not all(isinstance(a, str) for a in out):
        raise ArgumentError(f"{what} must be a str or a sequence of str, got {argnames!r}.")
    return out


def _parameters(fn) -> list[inspect.Parameter] | None:
    """``fn``'s parameters, ``None`` for a callable without a signature to read."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _positional_names(params) -> list[str]:
    """The names of the parameters an argument may be passed to by position."""
    return [p.name for p in params or () if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _by_other_name(fn, params, argnums, argnames, what: str):
    """``(argnums, argnames)`` that ``argnames`` and ``argnums`` also mean, read from
    ``fn``'s ``params`` as ``jax.jit`` does: a parameter named in ``argnames`` is also
    static (or donated) when passed by position, one whose index is in ``argnums`` also
    when passed by keyword. A name ``fn`` takes no keyword argument by is an
    ``ArgumentError`` (unless it takes ``**kwargs``)."""
    if params is None:
        return (), ()
    positional = _positional_names(params)
    keyword = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [a for a in argnames if a not in keyword]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params):
        raise ArgumentError(
            f"{what} names {unknown}, but {getattr(fn, '__name__', 'the function')} takes no "
            f"keyword argument so named; its keyword parameters: {', '.join(keyword) or 'none'}."
        )
    nums = tuple(i for i, name in enumerate(positional) if name in argnames)
    names = tuple(
        positional[i]
        for i in argnums
        if -len(positional) <= i < len(positional) and positional[i] in keyword
    )
    return nums, names


def _checked_stage_to_mesh(stage_to_mesh, num_meshes: int) -> tuple[int, ...] | None:
    if stage_to_mesh is None:
        return None
    if isinstance(stage_to_mesh, dict):
        if sorted(stage_to_mesh) != list(range(len(stage_to_mesh))):
            raise StageError(
                f"stage_to_mesh keys must be the stages 0..n-1, got {sorted(stage_to_mesh)}."
            )
        stage_to_mesh = [stage_to_mesh[s] for s in range(len(stage_to_mesh))]
    if len(stage_to_mesh) == 0:
        raise StageError("stage_to_mesh is empty; give one mesh index per stage, or None.")
    out = []
    for s, m in enumerate(stage_to_mesh):
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 0 <= m < num_meshes:
            raise StageError(
                f"stage_to_mesh maps stage {s} to {m!r}, which is no index of the "
                f"{num_meshes} meshes: give each stage a mesh index 0..{num_meshes - 1}."
            )
        out.append(int(m))
    return tuple(out)


def _checked_cache_size(size):
    """``compile(cache_size=)``: a positive int, or ``None`` for no bound."""
    if size is None or (isinstance(size, (int, np.integer)) and not isinstance(size, bool)):
        if size is None or size > 0:
            return None if size is None else int(size)
    raise ArgumentError(
        f"cache_size must be a positive int (the call signatures whose executables are "
        f"kept) or None (no bound), got {size!r}."
    )
