"""Pytree helpers JAX 0.10 does not make public."""

from __future__ import annotations

import jax


class _Repeated:
    """One prefix leaf standing for ``count`` leaves of the full tree (an opaque pytree leaf)."""

    def __init__(self, value, count):
        self.value, self.count = value, count


def broadcast_prefix(prefix, tree, is_leaf) -> list:
    """One value of ``prefix`` per leaf of ``tree``, where ``prefix`` is a pytree prefix of it.

    ``is_leaf`` says which nodes of ``prefix`` are values; a structure mismatch is a
    ``ValueError`` showing both structures.
    """
    try:
        per_subtree = jax.tree_util.tree_map(
            lambda value, sub: _Repeated(value, len(jax.tree_util.tree_leaves(sub))),
            prefix,
            tree,
            is_leaf=is_leaf,
        )
    except ValueError:
        # JAX's own message is about `tree_map` arguments the caller never wrote.
        have = jax.tree_util.tree_structure(prefix, is_leaf=is_leaf)
        want = jax.tree_util.tree_structure(tree)
        raise ValueError(f"{have} is not a prefix of {want}") from None
    groups = jax.tree_util.tree_leaves(per_subtree, is_leaf=lambda x: isinstance(x, _Repeated))
    return [g.value for g in groups for _ in range(g.count)]
