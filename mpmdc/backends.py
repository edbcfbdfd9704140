"""The backend registry: which platform a program lowers for and how it runs there.

Built in: ``cpu``, ``cuda``, ``rocm`` and ``tpu``. Other packages add backends by
calling :func:`register` or through the entry-point group ``mpmdc.backends`` (each
entry point loads to a :class:`Backend` or a zero-argument callable returning one).
Any backend can *emit* StableHLO on any machine; running needs its hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from mpmdc.errors import BackendError

TRANSFER_KINDS = ("device_put", "in-program")


@dataclass(frozen=True)
class Backend:
    """One way to lower and run fragments.

    ``platform`` is the JAX lowering platform (``cpu``, ``cuda``, ``rocm``, ``tpu``).
    ``transfers`` says how a value moves between meshes: ``"device_put"`` (the
    runtime copies it onto the destination mesh's sharding between fragment calls)
    or ``"in-program"`` (send/recv pairs inside the fragments, where the platform
    supports them).
    """

    name: str
    platform: str
    transfers: str = "device_put"

    def __post_init__(self):
        if self.transfers not in TRANSFER_KINDS:
            raise BackendError(
                f"backend {self.name!r}: transfers={self.transfers!r} is not one of {TRANSFER_KINDS}."
            )


_registry: dict[str, Backend] = {}
_entry_points_loaded = False


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` under its name; ``replace=True`` overrides an existing one."""
    if not isinstance(backend, Backend):
        raise BackendError(f"register() takes an mpmdc.backends.Backend, got {type(backend).__name__}.")
    if backend.name in _registry and not replace and _registry[backend.name] != backend:
        raise BackendError(
            f"a backend named {backend.name!r} is already registered; pass replace=True to override it."
        )
    _registry[backend.name] = backend
    return backend


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group="mpmdc.backends"):
        loaded = ep.load()
        register(loaded if isinstance(loaded, Backend) else loaded())


def available() -> tuple[str, ...]:
    """Names of all registered backends, sorted."""
    _load_entry_points()
    return tuple(sorted(_registry))


def get(name: str) -> Backend:
    """The backend called ``name``; an unknown name lists the available ones."""
    _load_entry_points()
    try:
        return _registry[name]
    except KeyError:
        raise BackendError(
            f"unknown backend {name!r}; available backends: {', '.join(available())}."
        ) from None


def for_platform(device_platform: str, platform_version: str = "") -> str:
    """The built-in backend name for a JAX device platform (``gpu`` means CUDA or ROCm)."""
    if device_platform == "gpu":
        return "rocm" if "rocm" in platform_version.lower() else "cuda"
    return device_platform


for _name in ("cpu", "cuda", "rocm", "tpu"):
    register(Backend(_name, _name))
