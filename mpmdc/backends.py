"""The backend registry: which platform a program lowers for and how it runs there.

Built in: ``cpu``, ``cuda``, ``rocm`` and ``tpu``. Other packages add backends by
calling :func:`register` or through the entry-point group ``mpmdc.backends`` (each
entry point loads to a :class:`Backend` or a zero-argument callable returning one).
Any backend can *emit* StableHLO on any machine; running needs its hardware.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import jax

from mpmdc import _jax_compat as compat
from mpmdc.errors import BackendError
from mpmdc.lowering.send_recv import IN_PROGRAM_PLATFORMS


class TransferMode(enum.StrEnum):
    """How a backend moves a value between meshes."""

    DEVICE_PUT = "device_put"  # the runtime copies it onto the destination mesh's sharding
    IN_PROGRAM = "in-program"  # send/recv pairs with matching channel ids inside fragments


PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # JAX's lowering platforms, one built-in backend each


@dataclass(frozen=True)
class Backend:
    """One way to lower, compile and run fragments, and to move values between meshes.

    ``platform`` is the JAX lowering platform (``cpu``, ``cuda``, ``rocm``, ``tpu``).
    ``transfers`` says how a value moves between meshes: ``"device_put"`` (the
    runtime copies it onto the destination mesh's sharding between fragment calls)
    or ``"in-program"`` (``send``/``recv`` pairs with matching channel ids inside the
    fragments; ``cuda`` and ``rocm`` only). ``compiler_options`` are passed to XLA
    when a fragment is compiled (``(("xla_flag", value), ...)``).
    """

    name: str
    platform: str
    transfers: TransferMode = TransferMode.DEVICE_PUT
    compiler_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        try:
            object.__setattr__(self, "transfers", TransferMode(self.transfers))
        except ValueError:
            modes = tuple(m.value for m in TransferMode)
            raise BackendError(
                f"backend {self.name!r}: transfers={self.transfers!r} is not one of {modes}."
            ) from None
        if self.transfers is TransferMode.IN_PROGRAM and self.platform not in IN_PROGRAM_PLATFORMS:
            raise BackendError(
                f"backend {self.name!r}: in-program transfers need device-to-device channels, "
                f"which only {', '.join(IN_PROGRAM_PLATFORMS)} have; use transfers='device_put' "
                f"for platform {self.platform!r}."
            )

    def describe(self) -> str:
        """One line: platform, how transfers happen, how fragments compile and run."""
        moves = {
            TransferMode.DEVICE_PUT: "runtime device_put onto the destination mesh",
            TransferMode.IN_PROGRAM: "send/recv pairs with matching channel ids inside the fragments",
        }[self.transfers]
        options = f" with {dict(self.compiler_options)}" if self.compiler_options else ""
        return (
            f"{self.name}: lowers for {self.platform}; transfers by {moves}; each fragment "
            f"is a jax.jit executable compiled by XLA{options}, run with asynchronous dispatch"
        )

    def lower_fragment(self, traced):
        """Lower a traced fragment (``jax.jit(...).trace(...)``) for this backend's platform."""
        return traced.lower(lowering_platforms=(self.platform,))

    def compile_fragment(self, lowered):
        """Compile a lowered fragment (from :meth:`lower_fragment`) into a callable executable.

        Called from several threads at once for a program's distinct fragments.
        """
        return lowered.compile(dict(self.compiler_options) or None)

    def load_fragment(self, compiled, devices):
        """``compiled`` (from :meth:`compile_fragment`, for one mesh) made to run on
        ``devices`` (another mesh of the same shape, in the same order) without compiling
        again, or ``None`` to have the fragment compiled for that mesh instead."""
        return compat.load_on_devices(compiled, devices)

    def check_can_run(self, meshes) -> None:
        """Raise ``BackendError`` unless this backend can run fragments on ``meshes`` here."""
        if self.transfers is TransferMode.IN_PROGRAM:
            raise BackendError(
                f"backend {self.name!r} moves values by send/recv inside the fragments; running "
                f"that needs the device-to-device channels between meshes set up by a multi-process "
                f"runtime, which mpmdc's single-process runtime does not have. Use it to emit "
                f"StableHLO (lower().stablehlo()), and compile with a device_put backend such as "
                f"{self.platform!r} to run."
            )
        for i, mesh in enumerate(meshes):
            device = mesh.devices.flat[0]
            found = for_platform(device.platform, device.client.platform_version)
            if found != self.platform:
                raise BackendError(
                    f"backend {self.name!r} compiles for {self.platform}, but mesh {i} has "
                    f"{found} devices; lower with it to see its StableHLO, and compile with "
                    f"backend={found!r} to run here."
                )

    def transfer(self, values, shardings):
        """Move ``values`` onto ``shardings`` of another mesh (``device_put`` transfers)."""
        return compat.copied_to(values, shardings) or jax.device_put(list(values), list(shardings))


_registry: dict[str, Backend] = {}
_entry_points_loaded = False


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` under its name; ``replace=True`` overrides an existing one."""
    if not isinstance(backend, Backend):
        raise BackendError(
            f"register() takes an mpmdc.backends.Backend, got {type(backend).__name__}."
        )
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
    for ep in metadata.entry_points(group="mpmdc.backends"):
        try:
            loaded = ep.load()
            register(loaded if isinstance(loaded, Backend) else loaded())
        except Exception as err:
            raise BackendError(
                f"the backend plugin {ep.name!r} ({ep.value}) of entry-point group "
                f"'mpmdc.backends' failed to load: {type(err).__name__}: {err}. Fix or "
                f"uninstall the package that provides it."
            ) from err
    _entry_points_loaded = True


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


def choose(platform: str | None = None, backend: str | None = None, *, default: str) -> str:
    """The backend to emit StableHLO with: the registered ``backend``; for ``platform``
    (one of :data:`PLATFORMS`) ``default`` where it lowers for that platform (keeping its
    transfers and compiler options), else the platform's built-in backend; ``default``
    when neither is given. A backend that is no platform (an in-program transfer variant,
    say) given as ``platform`` is a ``BackendError`` saying to pass it as ``backend``."""
    if platform is not None and backend is not None:
        raise BackendError(
            f"give a platform ({platform!r}) or a backend ({backend!r}), not both: a backend "
            f"already names its platform."
        )
    if backend is not None:
        return get(backend).name
    if platform is None:
        return default
    if platform not in PLATFORMS:
        hint = (
            f"; {platform!r} is a registered backend: choose it with backend={platform!r}"
            if platform in available()
            else ""
        )
        raise BackendError(
            f"unknown platform {platform!r}; platforms: {', '.join(PLATFORMS)}{hint}."
        )
    return default if get(default).platform == platform else platform


def for_platform(device_platform: str, platform_version: str = "") -> str:
    """The built-in backend name for a JAX device platform (``gpu`` means CUDA or ROCm)."""
    if device_platform == "gpu":
        return "rocm" if "rocm" in platform_version.lower() else "cuda"
    return device_platform


for _name in PLATFORMS:
    register(Backend(_name, _name))
