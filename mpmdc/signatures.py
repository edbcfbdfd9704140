"""A call's arguments told apart as ``jax.jit`` does, and the signature it is cached by.

Static, dynamic and donated arguments (by number and by name), each leaf's path as the
user writes it (``args[2]['w']``), the ``in_specs``, ``out_specs`` and
``out_shardings`` per leaf, and the key of the executable cache: everything
``Wrapped`` reads off a call before it traces, as functions of the call and the
:class:`~mpmdc.options.CompileOptions`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from mpmdc import _jax_compat as compat
from mpmdc._text import a_type
from mpmdc.errors import ArgumentError, OutputError, SpecError
from mpmdc.ir.pytrees import broadcast_prefix, skeleton
from mpmdc.ir.sharding import STAGES_AXIS, canonical_spec, spec_problem, within_stage
from mpmdc.options import CompileOptions
from mpmdc.runtime.executable import Compiled
from mpmdc.runtime.signature import leaf_type, types_alone


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _check_argnums(argnums, nargs: int, what: str) -> tuple[int, ...]:
    out = []
    for a in argnums:
        if not -nargs <= a < nargs:
            raise ArgumentError(
                f"{what} contains {a}, but the function was called with {nargs} positional "
                f"argument(s); use indices in range({nargs})."
            )
        out.append(a % nargs)
    return tuple(sorted(set(out)))


def _path_text(prefix: str, path) -> str:
    return prefix + jax.tree_util.keystr(path)


def flat_arguments(dynamic, kwargs):
    """``(leaves, paths, tree)`` of the dynamic arguments ``[(index, value), ...]`` and
    ``kwargs``, each path as the user writes it (``args[2]['w']``)."""
    leaves_with_path, tree = jax.tree_util.tree_flatten_with_path(
        (tuple(a for _, a in dynamic), kwargs)
    )
    paths = []
    for path, _ in leaves_with_path:
        head, index, rest = path[0].idx, path[1], path[2:]
        if head == 0:
            paths.append(_path_text(f"args[{dynamic[index.idx][0]}]", rest))
        else:
            paths.append(_path_text(f"kwargs[{index.key!r}]", rest))
    return [x for _, x in leaves_with_path], paths, tree


def checked_outputs(out):
    """``(leaves, paths, tree)`` of ``out``; a leaf that is no array is an ``OutputError``."""
    leaves_with_path, tree = jax.tree_util.tree_flatten_with_path(out)
    paths = [_path_text("out", path) for path, _ in leaves_with_path]
    for path, (_, leaf) in zip(paths, leaves_with_path):
        try:
            jax.typeof(leaf)
        except TypeError:
            raise OutputError(
                f"output {path} is {a_type(leaf)} ({leaf!r:.60}), which is no array "
                f"type; compiled functions return arrays and numbers (as under jax.jit). "
                f"Return it from outside the compiled function."
            ) from None
    return [leaf for _, leaf in leaves_with_path], paths, tree


def _committed_sharding(leaf) -> NamedSharding | None:
    """A committed ``jax.Array``'s (or a ``ShapeDtypeStruct``'s) ``NamedSharding``,
    ``None`` for any other leaf; cheap, as the call cache reads it per leaf."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or (
        isinstance(leaf, jax.Array) and not leaf.committed
    ):
        return None
    return sharding


def committed_spec(leaf) -> PartitionSpec | None:
    """The ``PartitionSpec`` of a leaf's committed sharding (:func:`_committed_sharding`),
    ``None`` for any other leaf (its spec is free for propagation to choose)."""
    sharding = _committed_sharding(leaf)
    return None if sharding is None else canonical_spec(sharding.spec)


def typed_mesh(leaf):
    """The abstract mesh ``jax.jit`` puts in a leaf's type: that of its committed
    sharding (:func:`_committed_sharding`) over a mesh with an ``Explicit`` axis,
    ``None`` for any other leaf (its type holds no sharding). A stacked array held in
    pieces has none either: no stage's mesh is its mesh."""
    sharding = _committed_sharding(leaf)
    if (
        sharding is None
        or AxisType.Explicit not in sharding.mesh.axis_types
        or sharding.mesh.axis_names[0] == STAGES_AXIS
    ):
        return None
    return sharding.mesh.abstract_mesh


def type_shardings(leaves, committed_specs) -> list:
    """Per leaf, the sharding it is traced with, as ``jax.jit`` traces it: its own for a
    leaf whose type holds one (:func:`typed_mesh`) and whose spec the program keeps
    (``committed_specs``, of :func:`input_specs`), else ``None``.

    One trace has one abstract mesh, as under ``jax.jit``; leaves on meshes of other
    shapes, axis names or types would make every operation joining them a type error,
    so then no leaf's type holds a sharding (they are traced by shape and dtype)."""
    meshes = [typed_mesh(x) if own else None for x, own in zip(leaves, committed_specs)]
    if len({m for m in meshes if m is not None}) != 1:
        return [None] * len(leaves)
    return [None if m is None else x.sharding for x, m in zip(leaves, meshes)]


def _sharding_spec(leaf, meshes) -> PartitionSpec | None:
    """The committed spec as written (see :func:`committed_spec`) if a mesh can shard
    the leaf that way: the argument's default ``in_spec`` (``partition`` keeps it where
    the mesh reading it can, :attr:`Program.committed_specs`)."""
    if committed_spec(leaf) is None:
        return None
    spec = leaf.sharding.spec
    if leaf.sharding.mesh.axis_names[0] == STAGES_AXIS:  # a stacked array held in pieces
        spec = within_stage(spec)
    if all(spec_problem(spec, mesh, leaf.shape) for mesh in meshes):
        return None
    return spec


class CallKey(NamedTuple):
    """What the executable cache is keyed on (see ``signature_key``)."""

    static: tuple
    treedef: Any
    types: tuple
    specs: tuple  # per leaf: its committed spec, canonical, or None
    typed: tuple  # per leaf: the abstract mesh of its type's sharding (typed_mesh), or None
    donated: tuple
    context: Any  # what tracing reads besides the arguments (compat.trace_context)


def serves(exe_key: CallKey, exe: Compiled, key: CallKey, given) -> bool:
    """Whether ``exe`` (built for ``exe_key``) is the program for a call keyed ``key``:
    every argument leaf has the spec it had then, or one the program ignores (an
    ``in_specs`` entry was ``given`` for it), or the spec the program chose for a leaf
    that had none (uncommitted). So arguments placed by ``step.input_shardings`` and
    results fed back run on the executable that placed them, as under ``jax.jit``. A
    leaf whose type held a sharding then (:func:`typed_mesh`) must hold the same now."""
    if exe_key._replace(specs=(), typed=()) != key._replace(specs=(), typed=()):
        return False
    return all(then is None or now == then for now, then in zip(key.typed, exe_key.typed)) and all(
        now == then or user is not None or (then is None and now == canonical_spec(chosen))
        for now, then, chosen, user in zip(key.specs, exe_key.specs, exe.argument_specs, given)
    )


def _flat_specs(specs, tree, nleaves_prefix: str, what: str):
    """Broadcast a spec pytree prefix over ``tree``; a mismatch, or a leaf that is no
    ``PartitionSpec`` (``"data"`` for ``P("data")``), is a ``SpecError``."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec_leaf)[0]:
        if isinstance(leaf, NamedSharding):
            mesh = (
                "to choose the mesh too, pass the sharding as out_shardings="
                if what == "out_specs"
                else "the mesh is that of the stage reading the argument"
            )
            raise SpecError(
                f"{what}{jax.tree_util.keystr(path)} is a NamedSharding ({leaf.spec} on a mesh "
                f"{dict(leaf.mesh.shape)}), not a PartitionSpec: a spec is the sharding within "
                f"whichever mesh holds the value. Give its spec, {leaf.spec}; {mesh}."
            )
        if not _is_spec_leaf(leaf):
            shown = f"{leaf!r:.40}"
            raise SpecError(
                f"{what}{jax.tree_util.keystr(path)} is {a_type(leaf)} ({shown}), not a "
                f"PartitionSpec; write jax.sharding.PartitionSpec({shown}) or None."
            )
    try:
        return broadcast_prefix(specs, tree, _is_spec_leaf)
    except ValueError as err:
        raise SpecError(
            f"{what} does not match the structure of {nleaves_prefix}: {err}. Give a "
            f"PartitionSpec (or None) per leaf, or a prefix of the pytree."
        ) from None


@dataclass(frozen=True)
class Call:
    """A call's arguments told apart as ``jax.jit`` does."""

    static_args: tuple  # ((index, value), ...): the static positional arguments
    static_kwargs: tuple  # ((name, value), ...) by name: the static keyword arguments
    dynamic: tuple  # ((index, value), ...): the other positional arguments
    kwargs: dict  # the other keyword arguments
    donate: tuple[int, ...]  # donated positional arguments
    donate_names: tuple[str, ...]  # donated keyword arguments (of those passed)

    def donated(self) -> tuple[bool, ...]:
        """Per flat input (positional arguments, then keywords by name), whether it is donated."""
        flags = []
        for i, a in self.dynamic:
            flags += [i in self.donate] * len(jax.tree_util.tree_leaves(a))
        for name in sorted(self.kwargs):  # the order a dict's leaves flatten in
            flags += [name in self.donate_names] * len(jax.tree_util.tree_leaves(self.kwargs[name]))
        return tuple(flags)


def qualified_name(fn) -> str:
    """``module.qualname`` of ``fn``, seen through ``functools.partial``: the same in every
    process running the same script, unlike an address."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"{module}.{name or type(fn).__qualname__}"


def _numbered(
    options: CompileOptions, argnums, by_name, nargs: int, kwargs, what: str
) -> tuple[int, ...]:
    """The positional arguments of a call with ``nargs`` of them and keywords ``kwargs``
    that ``argnums`` (each in range, but for a parameter passed by keyword, which its
    name selects) or a parameter name (``by_name``, where passed by position) selects."""
    by_keyword = {i for i, name in enumerate(options.positional) if name in kwargs}
    given = [a for a in argnums if a not in by_keyword]
    checked = _check_argnums(given, nargs, what) if given else ()
    return tuple(sorted(set(checked) | {i for i in by_name if i < nargs}))


def split_args(options: CompileOptions, args, kwargs) -> Call:
    static = _numbered(
        options, options.static_argnums, options.static_by_name, len(args), kwargs, "static_argnums"
    )
    donate = _numbered(
        options, options.donate_argnums, options.donate_by_name, len(args), kwargs, "donate_argnums"
    )
    static_names = tuple(sorted(k for k in kwargs if k in options.static_argnames))
    donate_names = tuple(sorted(k for k in kwargs if k in options.donate_argnames))
    for both, what in (
        (sorted(set(static) & set(donate)), "arguments"),
        (sorted(set(static_names) & set(donate_names)), "keyword arguments"),
    ):
        if both:
            raise ArgumentError(f"{what} {both} are both static and donated.")
    static_args = tuple((i, args[i]) for i in static)
    static_kwargs = tuple((k, kwargs[k]) for k in static_names)
    try:
        hash((static_args, static_kwargs))
    except TypeError:
        named = [f"args[{i}]" for i in static] + [f"kwargs[{k!r}]" for k in static_names]
        raise ArgumentError(
            f"static arguments {', '.join(named)} must be hashable (like jax.jit's "
            f"static_argnums and static_argnames)."
        ) from None
    return Call(
        static_args=static_args,
        static_kwargs=static_kwargs,
        dynamic=tuple((i, a) for i, a in enumerate(args) if i not in static),
        kwargs={k: v for k, v in kwargs.items() if k not in static_names},
        donate=donate,
        donate_names=donate_names,
    )


def signature_key(options: CompileOptions, args, kwargs):
    """What the executable cache is keyed on: static values, pytree structure, each
    leaf's shape, dtype, weak type and sharding spec, donated arguments, and what else
    tracing reads, as ``jax.jit``'s cache does: the mesh of the caller's
    ``jax.set_mesh``, ``jax_enable_x64``, the default matmul precision."""
    call = split_args(options, args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((tuple(a for _, a in call.dynamic), call.kwargs))
    try:
        types = tuple(map(leaf_type, leaves))
    except ArgumentError:
        _, paths, _ = flat_arguments(call.dynamic, call.kwargs)
        types = tuple(map(leaf_type, leaves, paths))  # raises, naming the argument
    specs = tuple(map(committed_spec, leaves))
    typed = tuple(map(typed_mesh, leaves))
    static = (call.static_args, call.static_kwargs)
    donated = (call.donate, call.donate_names)
    return CallKey(static, treedef, types, specs, typed, donated, compat.trace_context()), leaves


def refuse_types_alone(options: CompileOptions, args, kwargs, leaves) -> None:
    """An ``ArgumentError`` naming the first of ``leaves`` (of :func:`signature_key`) that
    is a ``jax.ShapeDtypeStruct``: a call runs on values (before compiling for them)."""
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            call = split_args(options, args, kwargs)
            _, paths, _ = flat_arguments(call.dynamic, call.kwargs)
            raise ArgumentError(types_alone(paths[k]))


def input_specs(options: CompileOptions, args, static: dict, kwargs, leaves) -> tuple:
    """``(specs, committed)``: per flat input, ``in_specs``' entry, else the argument's
    own sharding's, and whether it is the latter (:attr:`Program.committed_specs`)."""
    given = flat_in_specs(options, args, static, kwargs)
    own = [
        None if g is not None else _sharding_spec(x, options.meshes) for g, x in zip(given, leaves)
    ]
    specs = tuple(g if g is not None else o for g, o in zip(given, own))
    return specs, tuple(o is not None for o in own)


def output_specs(options: CompileOptions, out_tree, out_paths):
    """``(spec per output, mesh asked for per output or None)`` from ``out_specs``
    and ``out_shardings``."""
    if options.out_specs is None:
        out_specs = [None] * out_tree.num_leaves
    else:
        out_specs = _flat_specs(options.out_specs, skeleton(out_tree), "the outputs", "out_specs")
    if options.out_shardings is None:
        return tuple(out_specs), None
    wanted_out_meshes, out_specs = _flat_out_shardings(options, out_tree, out_paths, out_specs)
    return tuple(out_specs), wanted_out_meshes


def _flat_out_shardings(options: CompileOptions, out_tree, out_paths, out_specs):
    """``(mesh index or None, spec)`` per output from ``out_shardings``: a pytree
    (prefix) of ``NamedSharding`` on one of the meshes, or ``None``."""
    try:
        flat = broadcast_prefix(
            options.out_shardings,
            skeleton(out_tree),
            lambda s: s is None or isinstance(s, (jax.sharding.Sharding, PartitionSpec)),
        )
    except ValueError as err:
        raise SpecError(
            f"out_shardings does not match the structure of the outputs: {err}. Give a "
            f"NamedSharding (or None) per output, or a prefix of the pytree."
        ) from None
    ids = [tuple(m.device_ids.flat) for m in options.meshes]
    meshes, specs = [], list(out_specs)
    for k, (sharding, path) in enumerate(zip(flat, out_paths)):
        if sharding is None:
            meshes.append(None)
            continue
        if (
            not isinstance(sharding, NamedSharding)
            or tuple(sharding.mesh.device_ids.flat) not in ids
        ):
            raise SpecError(
                f"out_shardings for {path} is {sharding!r}, which is not a NamedSharding on one "
                f"of the {len(options.meshes)} meshes; build it as NamedSharding(meshes[i], spec)."
            )
        meshes.append(ids.index(tuple(sharding.mesh.device_ids.flat)))
        specs[k] = sharding.spec
    return tuple(meshes), specs


def flat_in_specs(options: CompileOptions, args, static, kwargs):
    if options.in_specs is None:
        per_arg = [None] * len(args)
    elif _is_spec_leaf(options.in_specs):
        per_arg = [options.in_specs] * len(args)
    else:
        per_arg = list(options.in_specs)
        dynamic = [i for i in range(len(args)) if i not in static]
        if (
            len(per_arg) == len(dynamic) < len(args)
        ):  # static ones left out, as jax.jit's in_shardings
            given = iter(per_arg)
            per_arg = [None if i in static else next(given) for i in range(len(args))]
        elif len(per_arg) != len(args):
            also = f" (or one per non-static argument, {len(dynamic)})" if static else ""
            keywords = (
                f" and keyword arguments {', '.join(kwargs)}: in_specs gives positional "
                f"arguments their specs, so pass those arguments positionally, or"
                if kwargs
                else ";"
            )
            raise SpecError(
                f"in_specs has {len(per_arg)} entries but the function was called with "
                f"{len(args)} positional arguments{keywords} give one entry per "
                f"argument{also}."
            )
    flat = []
    for i, (spec, arg) in enumerate(zip(per_arg, args)):
        if i in static:
            continue
        flat += _flat_specs(spec, arg, f"argument args[{i}]", f"in_specs[{i}]")
    flat += [None] * len(jax.tree_util.tree_leaves(kwargs))
    return flat
