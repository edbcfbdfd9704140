"""Compiling a lowered program's fragments for the meshes of this process.

Each distinct module is compiled once, in a thread pool (XLA releases the GIL while it
compiles), and as early as it exists: :class:`FragmentCompiler` takes modules one by
one, so the call path hands it each module the ``lower`` pass emits while Python goes
on lowering the next (the ``lower`` pass's ``on_module`` option). A module that differs
from one of another mesh only in its devices (the same stage body on meshes of one
shape) is compiled once and loaded onto the other mesh's devices
(``Backend.load_fragment``).
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
from tqdm.auto import tqdm

from mpmdc.ir.program import module_key
from mpmdc.runtime.transfers import is_here

PROGRESS_MIN_FRAGMENTS = 8  # fewer distinct fragments compile too fast to need a bar


class FragmentCompiler:
    """Executables for the fragments offered to it, each module compiled once.

    Use it as a context manager: leaving the block waits for compiles under way and
    cancels those not started (when lowering failed after some were offered).
    """

    def __init__(self, backend):
        self.backend = backend
        self._pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="mpmdc-compile")
        self._compiling: dict = {}  # fragment key -> Future of its executable
        self._first: dict = {}  # module key -> (fragment key, mesh) compiled for it
        self._loading: dict = {}  # fragment key -> (fragment key compiled, mesh, lowered)

    def __enter__(self) -> FragmentCompiler:
        return self

    def __exit__(self, *_) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def offer(self, key, eqn, mesh, backend, lowered) -> None:
        """Start compiling fragment ``eqn``'s module ``lowered`` (fragment key ``key``)
        for ``mesh``, unless it is already, ``mesh`` is another process's, the module
        was lowered for another backend, or an identical module of another mesh will be
        loaded for it instead."""
        if (
            backend is not self.backend
            or key in self._compiling
            or key in self._loading
            or not is_here(mesh)
        ):
            return
        first, first_mesh = self._first.setdefault(module_key(eqn, mesh), (key, mesh))
        if first != key and not eqn.effects and _can_share(first_mesh, mesh):
            self._loading[key] = (first, mesh, lowered)
        else:
            self._compiling[key] = self._pool.submit(self.backend.compile_fragment, lowered)

    def executables(self) -> dict:
        """``{fragment key: executable}`` of every fragment offered, once all are
        compiled; on a terminal a progress bar counts the compiles (silent when
        stderr is not a TTY, and for a handful of fragments)."""
        futures = {future: key for key, future in self._compiling.items()}
        bar = tqdm(
            total=len(futures),
            desc="mpmdc: compiling fragments",
            unit="fragment",
            disable=len(futures) < PROGRESS_MIN_FRAGMENTS or not sys.stderr.isatty(),
            leave=False,
        )
        out = {}
        with bar:
            for future in as_completed(futures):
                out[futures[future]] = future.result()
                bar.update()
        for key, (first, mesh, lowered) in self._loading.items():
            loaded = self.backend.load_fragment(out[first], list(mesh.devices.flat))
            out[key] = loaded if loaded is not None else self.backend.compile_fragment(lowered)
        return out


def _can_share(a, b) -> bool:
    """Whether an executable compiled for mesh ``a`` may be loaded onto mesh ``b``: both
    are this process's alone, and no persistent compilation cache is in use (an
    executable that came from it loses kernels when serialized again)."""
    me = jax.process_index()
    own = all(d.process_index == me for mesh in (a, b) for d in mesh.devices.flat)
    return own and not jax.config.jax_compilation_cache_dir


class XlaCompiles:
    """Counts XLA compilations while active, of mpmdc or anything else in the process
    (``with XlaCompiles() as c: step(...)``, then ``c.count``): JAX records one
    backend-compile event per executable it builds. A training loop that feeds its
    results back should count none after its first step."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listen(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)
