"""Pytree helpers: prefix broadcasting with a one-line message on a mismatch (saying
where the two structures differ rather than printing both), and placeholders."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from mpmdc._text import a_type


def broadcast_prefix(prefix, tree, is_leaf) -> list:
    """One value of ``prefix`` per leaf of ``tree``, where ``prefix`` is a pytree prefix of it.

    ``is_leaf`` says which nodes of ``prefix`` are values; a structure mismatch is a
    ``ValueError`` saying where the two differ.
    """
    try:
        full = jax.tree.broadcast(prefix, tree, is_leaf=is_leaf)
    except ValueError:
        # JAX's own message is about `broadcast_prefix` arguments the caller never wrote,
        # and prints both whole structures.
        found = first_difference(
            prefix, tree, is_prefix_leaf=is_leaf, labels=("{} not in the tree", "{} not in it")
        )
        if found is None:
            raise
        detail = f" ({found.entries})" if found.entries else ""
        raise ValueError(
            f"at {found.where} it has {found.want} where the tree has {found.got}{detail}"
        ) from None
    # Read the values at ``tree``'s leaves: a value may itself be a pytree (None is one).
    return jax.tree.structure(tree).flatten_up_to(full)


class _Slot:
    """A leaf standing in for an array in a structure rebuilt from its ``PyTreeDef``."""

    def __repr__(self) -> str:
        return "*"


def skeleton(treedef):
    """A pytree of ``treedef``'s structure with a placeholder for every leaf."""
    return jax.tree_util.tree_unflatten(treedef, [_Slot() for _ in range(treedef.num_leaves)])


def _is_leaf(x) -> bool:
    structure = jax.tree_util.tree_structure(x)
    return structure.num_nodes == 1 and structure.num_leaves == 1


def _children(x) -> list:
    """``(key, child)`` pairs of ``x``'s top node."""
    return [
        (path[0], child)
        for path, child in jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
    ]


def _shown(items, limit=6) -> str:
    text = [jax.tree_util.keystr((k,)) for k in items[:limit]]
    return ", ".join(text) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _what(x) -> str:
    if _is_leaf(x):
        if isinstance(x, (_Slot, jax.Array, np.ndarray, np.generic, int, float, complex)):
            return "an array"
        return a_type(x)
    n = len(_children(x))
    return f"{a_type(x)} of {n} entr{'y' if n == 1 else 'ies'}"


class Difference(NamedTuple):
    """Where two pytree structures first differ: the key path, what each side has
    there, and which entries one has and the other lacks ("" where the types differ)."""

    path: tuple
    want: str
    got: str
    entries: str

    @property
    def where(self) -> str:
        """The key path as text (``['b'][0]``, or ``the top``)."""
        return jax.tree_util.keystr(self.path) or "the top"


def first_difference(
    want, got, is_prefix_leaf=None, path=(), labels=("missing {}", "unexpected {}")
) -> Difference | None:
    """Where pytree ``got`` first differs in structure from ``want``, or ``None``.

    Leaves are not compared, so ``want`` may be a :func:`skeleton`. With
    ``is_prefix_leaf``, ``want`` is a prefix of ``got``: a node of ``want`` it accepts
    stands for a whole subtree of ``got``. ``labels`` word the entries only ``want`` has
    and those only ``got`` has (from ``got``'s side by default: missing, unexpected).
    """
    if is_prefix_leaf is not None and is_prefix_leaf(want):
        return None
    if _is_leaf(want) and _is_leaf(got):
        return None
    if _is_leaf(want) or _is_leaf(got) or type(want) is not type(got):
        return Difference(path, _what(want), _what(got), "")
    want_children, got_children = _children(want), _children(got)
    want_keys, got_keys = [k for k, _ in want_children], [k for k, _ in got_children]
    if want_keys != got_keys:
        missing = [k for k in want_keys if k not in got_keys]
        extra = [k for k in got_keys if k not in want_keys]
        parts = [labels[0].format(_shown(missing))] if missing else []
        parts += [labels[1].format(_shown(extra))] if extra else []
        return Difference(
            path, _what(want), _what(got), "; ".join(parts) or "the same entries in another order"
        )
    for (key, w), (_, g) in zip(want_children, got_children):
        found = first_difference(w, g, is_prefix_leaf, (*path, key), labels)
        if found is not None:
            return found
    if jax.tree_util.tree_structure(want) != jax.tree_util.tree_structure(got):
        return Difference(path, _what(want), f"{_what(got)} with other static data", "")
    return None
