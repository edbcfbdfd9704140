"""The argument types a compiled program was built for, and how a call is checked
against them (as ``jax.stages.Compiled`` checks its arguments)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from mpmdc._text import a_type
from mpmdc.errors import ArgumentError
from mpmdc.ir.pytrees import first_difference, skeleton


@dataclass(frozen=True)
class Signature:
    """The pytree and leaf types an executable was built for."""

    in_tree: Any
    in_types: tuple[tuple, ...]  # per leaf: ``leaf_type``'s (shape, dtype, weak type)
    in_paths: tuple[str, ...]
    out_tree: Any
    function: str = "the function"  # the user's function's name: what processes agree about
    # What a caller does for other argument types: lower again, or export again.
    remedy: str = "lower again"

    def args_info(self, donated: tuple[bool, ...]):
        """Each argument's type and whether it is ``donated`` (one flag per leaf), as
        ``(args, kwargs)`` pytrees of ``jax.stages.ArgInfo`` (static arguments left out)."""
        infos = [
            jax.stages.ArgInfo(jax.core.ShapedArray(shape, dtype, weak_type=weak), d)
            for (shape, dtype, weak), d in zip(self.in_types, donated)
        ]
        return jax.tree_util.tree_unflatten(self.in_tree, infos)

    def check(self, args, kwargs, leaves, treedef) -> None:
        """Raise ``ArgumentError`` naming the first argument that does not fit.

        A weak type may differ, as with ``jax.stages.Compiled``: the executable then
        computes with the types it was lowered for.
        """
        if treedef != self.in_tree:
            want_args, want_kwargs = skeleton(self.in_tree)
            if len(args) != len(want_args) or sorted(kwargs) != sorted(want_kwargs):
                static = (
                    " (static arguments were fixed by lower(): leave them out)"
                    if len(args) > len(want_args)
                    else ""
                )
                raise ArgumentError(
                    f"called with {len(args)} positional argument(s) and keywords {sorted(kwargs)}, "
                    f"but the executable was lowered for {len(want_args)} and keywords "
                    f"{sorted(want_kwargs)}; pass each argument the way it was passed to lower(){static}."
                )
            found = first_difference((want_args, want_kwargs), (args, kwargs))
            detail = f" ({found.entries})" if found.entries else ""
            raise ArgumentError(
                f"argument {argument_path(found.path)} is {found.got}{detail}, but the executable "
                f"was lowered for {found.want}; call it with the same structure, or {self.remedy}."
            )
        for leaf, (shape, dtype, _), path in zip(leaves, self.in_types, self.in_paths):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise ArgumentError(types_alone(path))
            got_shape, got_dtype, _ = leaf_type(leaf, path)
            if got_shape != shape or got_dtype != dtype:
                raise ArgumentError(
                    f"argument {path} is {got_dtype}{list(got_shape)} but the executable was "
                    f"lowered for {dtype}{list(shape)}; {self.remedy} for the new type."
                )


def types_alone(path: str) -> str:
    """The message of a call given a ``jax.ShapeDtypeStruct`` at ``path`` for a value."""
    return (
        f"argument {path} is a jax.ShapeDtypeStruct, a type without values, but a call runs "
        f"on arrays; pass an array of that type (lower() and trace() take types alone)."
    )


def leaf_type(x, path: str | None = None) -> tuple:
    """``(shape, dtype, weak type)`` of an argument leaf (array, Python scalar, typed PRNG
    key or ``jax.ShapeDtypeStruct``): what ``jax.jit`` tells argument types apart by.

    A value that is no array, or a traced one, is an ``ArgumentError`` naming ``path``.
    """
    if isinstance(x, jax.core.Tracer):
        raise ArgumentError(
            f"argument {path or '(unnamed)'} is a traced value: the mpmdc program is being "
            f"called inside a JAX transformation (jax.jit, jax.grad, jax.vmap...). It runs on "
            f"its own meshes and cannot be traced; apply the transformation inside instead, "
            f"e.g. mpmdc.compile(jax.grad(fn), meshes)."
        )
    if isinstance(x, jax.Array):
        aval = x.aval
    elif isinstance(x, jax.ShapeDtypeStruct):
        aval = x
    else:
        try:
            aval = jax.typeof(x)
        except TypeError:
            raise ArgumentError(
                f"argument {path or '(unnamed)'} is {a_type(x)}, which is no array type; "
                f"pass arrays, numbers or jax.ShapeDtypeStructs, or make the argument "
                f"static with static_argnums."
            ) from None
    return tuple(aval.shape), aval.dtype, bool(aval.weak_type)


def argument_path(path) -> str:
    """A key path into ``(args, kwargs)`` as the user writes it: ``args[0]['w']``."""
    if not path:
        return "(all arguments)"
    head = "args" if path[0].idx == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))
