"""Specs, array types, values and pytree structures as JSON-able values, and back.

Nothing read is executed: a pytree node's type is named by module and qualified name
and found among the modules already imported (:func:`tree_from`), never imported.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from mpmdc._text import a_type
from mpmdc.errors import ExportError
from mpmdc.ir.keys import is_key, is_key_dtype, key_data_type

# ----------------------------------------------------------------- specs


def spec_data(spec: PartitionSpec | None):
    """``None`` (no spec), or ``{"entries": [...], "unreduced": [...], "reduced": [...]}``
    with each entry as written (``None``, an axis, or a list of axes)."""
    if spec is None:
        return None
    entries = [list(e) if isinstance(e, tuple) else e for e in spec]
    return {
        "entries": entries,
        "unreduced": sorted(spec.unreduced),
        "reduced": sorted(spec.reduced),
    }


def spec_from(data) -> PartitionSpec | None:
    """The spec :func:`spec_data` wrote."""
    if data is None:
        return None
    entries = [tuple(e) if isinstance(e, list) else e for e in data["entries"]]
    return PartitionSpec(
        *entries, unreduced=frozenset(data["unreduced"]), reduced=frozenset(data["reduced"])
    )


# ----------------------------------------------------------------- types and values


# The PRNG implementations a typed key of an exported program may use, by their names.
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


@functools.cache
def _key_dtypes() -> dict:
    """``{dtype name: (dtype, implementation)}`` of the typed PRNG keys (``key<fry>``)."""
    out = {}
    for impl in _KEY_IMPLS:
        dtype = jax.eval_shape(functools.partial(jax.random.key, 0, impl=impl)).dtype
        out[str(dtype)] = (dtype, impl)
    return out


def dtype_name(dtype, where: str) -> str:
    """The name of an array dtype (``float32``, ``bfloat16``, a typed PRNG key's
    ``key<fry>``); another extended dtype is an ``ExportError`` naming ``where``."""
    if is_key_dtype(dtype) and str(dtype) in _key_dtypes():
        return str(dtype)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        raise ExportError(
            f"{where} has dtype {dtype}, which an exported program cannot hold (it holds "
            f"array dtypes and typed PRNG keys of {', '.join(_KEY_IMPLS)})."
        )
    return np.dtype(dtype).name


def dtype_from(name: str):
    """The dtype :func:`dtype_name` named."""
    if name in _key_dtypes():
        return _key_dtypes()[name][0]
    try:
        return jax.numpy.dtype(name)
    except TypeError:
        raise ExportError(
            f"the exported program names dtype {name!r}, which this JAX does not know."
        ) from None


def aval_data(aval, where: str) -> dict:
    """``{"shape", "dtype", "weak"}`` of an array type."""
    return {
        "shape": [int(d) for d in aval.shape],
        "dtype": dtype_name(aval.dtype, where),
        "weak": bool(aval.weak_type),
    }


def aval_from(data: dict) -> jax.core.ShapedArray:
    """The array type :func:`aval_data` wrote."""
    return jax.core.ShapedArray(
        tuple(data["shape"]), dtype_from(data["dtype"]), weak_type=data["weak"]
    )


def value_data(value, where: str) -> tuple[dict, bytes]:
    """``(type, bytes)`` of an array value: its type and its raw bytes, C order (a typed
    key's: its key data's)."""
    data = jax.random.key_data(value) if is_key(jax.typeof(value)) else value
    host = np.ascontiguousarray(np.asarray(data))
    return aval_data(jax.typeof(value), where), host.tobytes()


def value_from(data: dict, raw: bytes, where: str):
    """The host value :func:`value_data` wrote (a typed key: a key array); bytes of the
    wrong length are an ``ExportError``."""
    aval = aval_from(data)
    impl = _key_dtypes()[data["dtype"]][1] if is_key(aval) else None
    # (A typed key is stored as its key data: unsigned words, more per key.)
    stored = aval if impl is None else key_data_type(aval)
    expected = int(np.prod(stored.shape, dtype=np.int64)) * np.dtype(stored.dtype).itemsize
    if len(raw) != expected:
        raise ExportError(
            f"{where} holds {len(raw)} bytes, but its type {aval.str_short()} needs "
            f"{expected}: the exported program is damaged; serialize it again."
        )
    host = np.frombuffer(raw, dtype=stored.dtype).reshape(stored.shape).copy()
    return host if impl is None else jax.random.wrap_key_data(host, impl=impl)


# ----------------------------------------------------------------- pytree structures

_LEAF = "*"
_BUILTIN = {
    "builtins:tuple": tuple,
    "builtins:list": list,
    "builtins:dict": dict,
    "builtins:NoneType": type(None),
}


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _aux_data(aux, where: str):
    """A node's auxiliary data as JSON-able values, tuples and lists told apart
    (``where``: what holds the node, and the node: "the arguments hold a TrainState,")."""
    if aux is None or isinstance(aux, (bool, int, float, str)):
        return aux
    if isinstance(aux, (tuple, list)):
        return {type(aux).__name__: [_aux_data(a, where) for a in aux]}
    raise ExportError(
        f"{where} a pytree node whose auxiliary data is {a_type(aux)}, which an "
        f"exported program cannot record; pass tuples, lists, dicts, namedtuples, or nodes "
        f"whose auxiliary data are numbers, strings or tuples of them (of a Flax "
        f"TrainState, its params and opt_state)."
    )


def _aux_from(data):
    if isinstance(data, dict):
        ((kind, items),) = data.items()
        values = [_aux_from(a) for a in items]
        return tuple(values) if kind == "tuple" else values
    return data


def tree_data(treedef, where: str = "the arguments") -> Any:
    """A pytree structure as nested JSON-able values: ``"*"`` for a leaf, else
    ``{"type": "module:qualname", "aux": ..., "children": [...]}``."""
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return _LEAF
    cls, aux = treedef.node_data()
    return {
        "type": _type_name(cls),
        "aux": _aux_data(aux, f"{where} hold a {cls.__qualname__},"),
        "children": [tree_data(c, where) for c in treedef.children()],
    }


def _resolved(name: str):
    """The class ``module:qualname`` names, among the modules imported here."""
    if name in _BUILTIN:
        return _BUILTIN[name]
    module_name, _, qualname = name.partition(":")
    found = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None) if found is not None else None
    if not isinstance(found, type):
        raise ExportError(
            f"the exported program's pytrees hold {qualname} of module {module_name}, which "
            f"is not imported in this process; `import {_public(module_name)}` (or the "
            f"package that imports it, as `from flax import nnx` does) before calling it. "
            f"Nothing in an exported program imports code."
        )
    return found


def _public(module_name: str) -> str:
    """The package a user imports for ``module_name``: its name up to the first private
    part (``optax._src.transform`` is imported as ``optax``)."""
    parts = module_name.split(".")
    public = next((i for i, part in enumerate(parts) if part.startswith("_")), len(parts))
    return ".".join(parts[: max(public, 1)])


def tree_from(data) -> Any:
    """The ``PyTreeDef`` :func:`tree_data` wrote, its node types taken from the modules
    imported here."""
    if data == _LEAF:
        return jax.tree_util.tree_structure(0)
    try:
        cls = _resolved(data["type"])
        children = [tree_from(c) for c in data["children"]]
        return jax.tree_util.PyTreeDef.from_node_data_and_children(
            jax.tree_util.default_registry, (cls, _aux_from(data["aux"])), children
        )
    except ExportError:
        raise
    except Exception as err:
        name = data.get("type") if isinstance(data, dict) else data
        raise ExportError(
            f"the exported program's pytree node {name!r:.80} cannot be rebuilt here "
            f"({type(err).__name__}: {err}); the type may have changed since the export."
        ) from None
