"""Text for users: the small languages of mpmdc's options (pass lists, argument types)
split at commas, and a value's type named with its article.

A leaf module (layer 0): it imports nothing of mpmdc.
"""

from __future__ import annotations


def split_top_level(text: str, brackets: str) -> list[str]:
    """``text`` split at the commas outside ``brackets`` (an opening and a closing character).

    ``split_top_level("a,b{x=1,y=2}", "{}")`` is ``["a", "b{x=1,y=2}"]``. Unbalanced
    brackets are a ``ValueError`` for the caller to turn into its own error.
    """
    opening, closing = brackets
    items, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == opening) - (ch == closing)
        if depth < 0:
            break
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise ValueError(f"unbalanced {opening}{closing} in {text!r}")
    return [*items, current]


def a_type(value) -> str:
    """``value``'s type name with its article, for messages: ``"an EmptyState"``, ``"a list"``."""
    name = type(value).__name__
    # (By sound: "a uint8" and "a UUID", "an ndarray".)
    an = name[:1].lower() in "aeio" or name.startswith("nd")
    return f"{'an' if an else 'a'} {name}"
