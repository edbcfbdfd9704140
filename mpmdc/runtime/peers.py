"""What a process of a multi-process run checks about its peers.

- :func:`program_entries`: what every process must agree on before the first call (the
  versions, each argument's type and place, each equation of the scheduled program,
  the constants), compared through :func:`mpmdc.distributed.check_agreement`.
- :class:`Progress`: this process's work in flight during a call. Waiting for it is
  bounded: a step that gets no further for ``fault_timeout`` seconds, a peer that
  announced a failure, or a transfer whose sender is gone ends in an
  ``MpmdRuntimeError`` naming the peer, the transfer or fragment waited on and its mesh;
  after the fault timeout, the process that the chain of waits ends at
  (:func:`mpmdc.distributed.gave_up`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from importlib import metadata

import jax
import numpy as np
from jax.extend import core as jcore

from mpmdc import _jax_compat as compat
from mpmdc import distributed, watchdog
from mpmdc.distributed import exchange
from mpmdc.errors import MpmdRuntimeError
from mpmdc.ir.keys import is_key
from mpmdc.ir.program import Program

_POLL_PEERS_EVERY = 0.25  # seconds between looks at the key-value store while waiting
# A sender whose own fragment failed breaks its connections as it fails, a moment before
# it announces why: the receiver waits this long for the news before blaming the sender.
_ANNOUNCEMENT_GRACE = 2.0


def _digest(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()[:16]


def program_entries(program: Program) -> list[tuple[str, str]]:
    """``(name, digest)`` of everything processes running ``program`` must share, in order."""
    jaxpr = program.jaxpr.jaxpr
    ctx = compat.JaxprPpContext()
    settings = compat.JaxprPpSettings()
    entries = [("the versions", f"jax {jax.__version__}, mpmdc {_version()}")]
    meshes = ", ".join(f"{dict(m.shape)}" for m in program.meshes)
    entries.append(("the meshes", _digest(meshes + repr(program.schedule))))
    for path, v, mesh, spec in zip(
        program.in_paths, jaxpr.invars, program.in_meshes, program.in_specs
    ):
        where = f"mesh{mesh} {'P()' if spec is None else spec}"
        weak = " (weak)" if v.aval.weak_type else ""
        entries.append((f"argument {path}", f"{v.aval.dtype}{list(v.aval.shape)}{weak} on {where}"))
    for v, c in zip(jaxpr.constvars, program.jaxpr.consts):
        value = np.asarray(jax.random.key_data(c) if is_key(c) else c)
        entries.append(
            (f"a constant {v.aval.str_short()} the function closes over", _digest(value.tobytes()))
        )
    modules: dict = {}  # id of a fragment body -> its modules' bytes (bodies are shared)
    for k, eqn in enumerate(jaxpr.eqns):
        p = eqn.params
        name = p["name"] if "name" in p else f"transfer #{k} mesh{p['src']}->mesh{p['dst']}"
        text = compat.pp_eqn(eqn, ctx, settings).format().encode()
        if "jaxpr" in p:
            body = p["jaxpr"]
            if id(body) not in modules:
                modules[id(body)] = b"".join(_exported_modules(body.jaxpr))
            text += modules[id(body)]
        entries.append((f"equation {k} ({name})", _digest(text)))
    return entries


def _exported_modules(jaxpr: jcore.Jaxpr):
    """The StableHLO bytes of the ``jax.export`` modules ``jaxpr`` calls, at any depth:
    printed, a call of one shows only its function's name, so two exported programs
    differing in a constant (a learning rate) would print alike."""
    for eqn in jaxpr.eqns:
        exported = eqn.params.get("exported")
        if isinstance(exported, jax.export.Exported):
            yield bytes(exported.mlir_module_serialized)
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _exported_modules(sub)


def _version() -> str:
    try:
        return metadata.version("mpmdc")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class _InFlight:
    step: object  # runtime.engine.Step
    arrays: list


def _announced_failure() -> str | None:
    """What a peer announced (:func:`mpmdc.distributed.first_failure`), waiting up to
    ``_ANNOUNCEMENT_GRACE`` seconds for it; ``None`` if none did (a sender that died)."""
    deadline = time.monotonic() + min(_ANNOUNCEMENT_GRACE, distributed.fault_timeout_seconds())
    while (failure := distributed.first_failure()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return failure


class Progress:
    """The results this process is waiting for during one call, oldest first.

    ``add`` records a step's results; ``settle`` drops those already computed (raising
    for one that failed); ``wait`` waits for the rest under the bounds of the module
    docstring. ``fault`` turns an error into the ``MpmdRuntimeError`` to raise, and
    announces it to the peers.
    """

    def __init__(self, fault):
        self.fault = fault
        self.in_flight: list[_InFlight] = []

    def add(self, step, results) -> None:
        arrays = [
            jax.random.key_data(r) if is_key(r) else r
            for r in results
            if isinstance(r, jax.Array) and r.addressable_shards
        ]
        if arrays:
            self.in_flight.append(_InFlight(step, arrays))

    def settle(self) -> int:
        """Drop the oldest entries whose results are ready; return how many went."""
        done = 0
        while self.in_flight and all(a.is_ready() for a in self.in_flight[0].arrays):
            entry = self.in_flight[0]
            try:
                jax.block_until_ready(entry.arrays)
            except Exception as err:
                raise self.fault(entry.step, err) from None
            self.in_flight.pop(0)
            done += 1
        return done

    def wait(self) -> None:
        """Wait until every result is computed; raise ``MpmdRuntimeError`` as the module says."""
        timeout = distributed.fault_timeout_seconds()
        last_progress = next_look = time.monotonic()
        pause = 0.0005
        with watchdog.waiting(self._waited_for):
            while True:
                if self.settle():
                    last_progress, pause = time.monotonic(), 0.0005
                if not self.in_flight:
                    return
                now = time.monotonic()
                if now >= next_look:
                    next_look = now + _POLL_PEERS_EVERY
                    failure = distributed.first_failure()
                    if failure is not None:
                        raise self._stopped(failure)
                if now - last_progress > timeout:
                    what, senders = self._waited_for()
                    self.in_flight.clear()
                    raise distributed.gave_up(what, senders, timeout)
                time.sleep(pause)
                pause = min(pause * 2, 0.02)

    def _waited_for(self) -> tuple[str, tuple[int, ...]] | None:
        """The oldest step in flight, as text, and the processes sending it (none for a
        fragment of this process); ``None`` when nothing is (asked from the watchdog's
        thread too)."""
        try:
            step = self.in_flight[0].step
        except IndexError:
            return None
        return waited_for(step), tuple(step.senders)

    def _stopped(self, why: str) -> MpmdRuntimeError:
        what, _ = self._waited_for()  # (named before the steps in flight are dropped)
        self.in_flight.clear()
        return stopped(what, why)


def waited_for(step) -> str:
    """``step`` as a process waiting for it names it: ``transfer mesh0->mesh1 on mesh1
    (sent by process 0)``."""
    what = f"{step.name} on mesh{step.mesh}"
    if step.senders:
        what += f" (sent by process {', '.join(map(str, step.senders))})"
    return what


def stopped(what: str, why: str) -> MpmdRuntimeError:
    """The error of this process, which stopped waiting for ``what`` because of a failure
    a peer announced (``why``), told to the others."""
    message = f"process {jax.process_index()} stopped waiting for {what}: {why.rstrip('.')}."
    distributed.announce_failure(message)
    return MpmdRuntimeError(message)


def failed_transfer(step) -> MpmdRuntimeError | None:
    """For a transfer from other processes (``step.senders``) that failed, the connection
    broken or the data sent a failed computation's: the error naming the failure a peer
    announced meanwhile (the sender says why it stopped; a peer, why it died), else
    ``None``. The loss is reported first, so that a process that waited on this one
    names where it began (:func:`mpmdc.distributed.exchange.lost_transfers`)."""
    exchange.report_lost_transfer(step.senders)
    failure = _announced_failure()
    return None if failure is None else stopped(waited_for(step), failure)
