"""The executables a compiled function keeps, one per call signature, least recently
used first out.

:class:`ExecutableCache` is ``Wrapped``'s cache (``mpmdc.compile(..., cache_size=)``):
bounded by a number of entries as JAX bounds its own caches, cleared by
``step.clear_cache()``, and registered with JAX so that ``jax.clear_caches()`` clears it
too (the registry holds it weakly: a function that is gone leaves nothing behind).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from mpmdc import _jax_compat as compat

# Signatures a compiled function keeps by default: see docs/design.md, "The runtime".
DEFAULT_CACHE_SIZE = 64


class CacheInfo(NamedTuple):
    """What an :class:`ExecutableCache` has done: lookups that found an executable
    (``hits``) or none (``misses``: the call compiled), entries dropped to stay within
    ``maxsize`` (``evictions``; ``None``: unbounded), and entries held now."""

    hits: int
    misses: int
    evictions: int
    maxsize: int | None
    currsize: int


class ExecutableCache:
    """An LRU map from call signature to executable, of at most ``maxsize`` entries
    (``None``: unbounded); safe to use from several threads."""

    def __init__(self, maxsize: int | None, what: str):
        self.maxsize = maxsize
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0
        compat.register_cache(self, what)

    def get(self, key, serves: Callable[[Any, Any], bool] | None = None):
        """The executable kept for ``key``, now the most recently used; else the first
        one for which ``serves(its key, it)`` holds, kept under ``key`` too; else ``None``."""
        with self._lock:
            exe = self._entries.get(key)
            if exe is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return exe
            served = [] if serves is None else list(self._entries.items())
        exe = next((e for k, e in served if serves(k, e)), None)
        if exe is None:
            with self._lock:
                self._misses += 1
            return None
        with self._lock:
            self._hits += 1
        return self.put(key, exe)

    def peek(self, key):
        """The executable kept for ``key`` or ``None``, the cache's use and counts as they
        were (what ``Lowered.compile`` looks for before compiling)."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key, exe):
        """Keep ``exe`` for ``key`` (unless one is kept already: that one is returned),
        dropping the least recently used entries beyond ``maxsize``."""
        with self._lock:
            kept = self._entries.setdefault(key, exe)
            self._entries.move_to_end(key)
            while self.maxsize is not None and len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
                self._evictions += 1
            return kept

    def cache_clear(self) -> None:
        """Drop every entry (what ``jax.clear_caches()`` calls)."""
        with self._lock:
            self._entries.clear()

    def cache_info(self) -> CacheInfo:
        """Hits, misses, evictions, the bound and the entries held now."""
        with self._lock:
            return CacheInfo(
                self._hits, self._misses, self._evictions, self.maxsize, len(self._entries)
            )

    def cache_keys(self) -> list:
        """The signatures held, least recently used first."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
