"""Hangs among processes: where each process waits, which process is stuck, and the
watchdog thread that tells the others.

A process that is alive but makes no progress (stuck in its own code, stopped) sends
its peers no error: they only stop hearing from it, and a peer waiting for another
that itself waits cannot tell which of them is the cause. So each process keeps, in
the ``jax.distributed`` key-value store, what it is doing when that lasts:

- every wait on other processes (:class:`waiting`): what it waits for, and on which
  processes. A process that gives up waiting follows these waits from the process it
  waited for to the one at the end of the chain, which waits for nobody: that one is
  stuck (:func:`stuck`).
- the saves it works on (:func:`working_on`), with a beat that changes while it does,
  so that a save's meetings wait for a peer as long as it works on that save however
  long its writes take (:func:`beating`), and not for one that never began it.

One thread per process (:class:`Watchdog`) publishes both, once a beat (a tenth of the
fault timeout, between 0.2 and 5 s), and a wait only once it has lasted a beat: a
healthy step publishes nothing, and entering a wait costs a dictionary entry. The same
thread ends its process when the others gave up on it (:meth:`Watchdog.tick`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass

_WAITING = "mpmdc/waiting/"  # + process: the waits of that process that have lasted a beat
# What a process whose script returned waits for, at the exit all processes take together.
LEAVING = "the others at the end of the run (its script returned)"
_BEAT = "mpmdc/{exchange}/beat/{process}"  # a save's beat, while the process works on it

# The waits in progress in this process, by thread: (what it waits for, on whom), since when.
_waits: dict[int, tuple[Callable[[], tuple[str, tuple[int, ...]]], float]] = {}
_waits_begun = 0  # how many waits this process has begun, to tell that it came back
_working: set[str] = set()  # the exchanges (saves) this process works on now
# The running watchdog's :meth:`Watchdog.wait_ended`, called as each wait ends.
_wait_ended: Callable[[], None] | None = None


def beat_seconds(fault_timeout: float) -> float:
    """How often the watchdog publishes: often enough that a peer sees several beats
    within a fault timeout, rarely enough to cost nothing."""
    return min(max(fault_timeout / 10, 0.2), 5.0)


class waiting:
    """``with waiting(describe):`` around a wait on other processes; ``describe()``
    returns ``(what is waited for, the processes waited on)`` at the time it is asked
    (``()`` for this process's own computation), or ``None`` when it no longer applies.
    What is waited for names the process it is waited from (``transfer mesh0->mesh1
    on mesh1 (sent by process 0)``, ``process 0 to reach the save ...``)."""

    __slots__ = ("_describe", "_ident", "_outer")

    def __init__(self, describe: Callable[[], tuple[str, tuple[int, ...]] | None]):
        self._describe = describe

    def __enter__(self) -> None:
        global _waits_begun
        self._ident = threading.get_ident()
        self._outer = _waits.get(self._ident)
        _waits[self._ident] = (self._describe, time.monotonic())
        _waits_begun += 1

    def __exit__(self, *exc) -> None:
        if self._outer is None:
            _waits.pop(self._ident, None)
        else:
            _waits[self._ident] = self._outer
        if _wait_ended is not None:
            _wait_ended()


def waiting_for(what: str, peers: Iterable[int]) -> waiting:
    """:class:`waiting` for a wait whose description does not change."""
    entry = (what, tuple(peers))
    return waiting(lambda: entry)


@contextmanager
def working_on(exchange: str):
    """Beat for ``exchange`` (a save's topic) while in this block, so that the peers
    meeting this process there wait for it (:func:`beating`); nothing for ``""``."""
    if not exchange:
        yield
        return
    _working.add(exchange)
    try:
        yield
    finally:
        _working.discard(exchange)


def beating(client, exchange: str, process: int) -> str | None:
    """The last beat ``process`` published for ``exchange``, or ``None``: a patient wait
    goes on while this changes within each fault timeout."""
    try:
        return client.key_value_try_get(_BEAT.format(exchange=exchange, process=process))
    except Exception:  # not published (yet)
        return None


@dataclass(frozen=True)
class Stuck:
    """Where a chain of waits from the processes a wait was for ends.

    ``process`` waits for no other process (or for its own computation, ``computing``),
    or is ``None`` when every process on the way waits for another (a circle).
    ``chain`` is ``(waiter, waited for, what)`` for each link up to it.
    """

    process: int | None
    chain: tuple[tuple[int, int, str], ...]
    computing: str = ""
    left: bool = False  # its script returned: it waits only at the exit

    def reason(self, seconds: float) -> str:
        """The end of the chain, for the error of the process that gave up waiting."""
        links = ", ".join(f"process {a} waits for {what}" for a, _, what in self.chain)
        if self.process is None:
            return f"the processes wait for each other: {links}"
        via = f"{links}; " if links else ""
        if self.left:
            return (
                f"{via}process {self.process} has left the run (its script returned) while "
                f"the others still call the program: every process must make the same calls"
            )
        if self.computing:
            return (
                f"{via}process {self.process} is still computing {self.computing}, longer than "
                f"the fault timeout ({seconds:g} s)"
            )
        return (
            f"{via}process {self.process} made no progress for {seconds:g} s (the fault timeout) and "
            f"waits for no other process: it is stuck in its own code, stopped, or has died"
        )

    def blame(self, seconds: float, waiter: int, what: str) -> str:
        """What :attr:`process` did, for ``mpmdc launch`` to say when it blames it."""
        if self.left:
            did = "it left the run (its script returned)"
        elif self.computing:
            did = f"it was still computing {self.computing} after {seconds:g} s"
        else:
            did = f"it made no progress for {seconds:g} s"
        links = "".join(f" and process {a} for {link}" for a, _, link in self.chain)
        return f"{did} while process {waiter} waited for {what}{links}"


def _published_waits(client) -> dict[int, list] | None:
    """``{process: its published waits}``; ``None`` when the store is gone."""
    try:
        return {
            int(key.rsplit("/", 1)[1]): json.loads(value)
            for key, value in client.key_value_dir_get(_WAITING)
        }
    except Exception:
        return None


def stuck(client, here: int, peers: Iterable[int]) -> Stuck:
    """Follow the published waits from ``peers`` (the processes ``here`` waited for) to
    the nearest process that waits for nobody."""
    # (With the store gone, the direct peer is all there is to name.)
    entries = _published_waits(client) or {}
    # Breadth first, so that the shortest chain is named, each level in order of process id.
    seen = {here}
    level = [(peer, ()) for peer in sorted(set(peers) - seen)]
    seen.update(peer for peer, _ in level)
    while level:
        for process, chain in level:
            waits = entries.get(process)
            if not waits:
                return Stuck(process, chain)
            for what, on in waits:
                if what == LEAVING:
                    return Stuck(process, chain, left=True)
                if not on:
                    return Stuck(process, chain, what)
        following = []
        for process, chain in level:
            for what, on in entries[process]:
                for other in sorted(set(on) - seen):
                    seen.add(other)
                    following.append((other, (*chain, (process, other, what))))
        level = following
    circle = ((p, entries[p][0][1][0], entries[p][0][0]) for p in sorted(seen - {here}))
    return Stuck(None, tuple(circle))


def publish_leaving(client, here: int, processes: int) -> None:
    """Say that process ``here``'s script returned and it now waits for the others at the
    exit, so that a peer still waiting for it names that, not a stale wait of its."""
    others = [p for p in range(processes) if p != here]
    client.key_value_set(f"{_WAITING}{here}", json.dumps([[LEAVING, others]]), allow_overwrite=True)


def still_running(client, processes: Iterable[int]) -> list[int]:
    """Those of ``processes`` whose script has not returned (that have not published
    :data:`LEAVING`)."""
    entries = _published_waits(client)
    if entries is None:  # the store is gone: none can be told apart
        return list(processes)
    return [p for p in processes if not any(what == LEAVING for what, _ in entries.get(p, ()))]


def main_thread_stack() -> str:
    """Where this process's main thread is, as a traceback prints it."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""


def end(message: str) -> None:
    """Say why, then end this process at once (its main thread does not return)."""
    try:
        sys.stdout.flush()
        print(message, file=sys.stderr, flush=True)
    finally:
        os._exit(1)


class Watchdog:
    """The thread that publishes this process's lasting waits and its saves' beats,
    and ends the process when the others gave up on it.

    ``client()`` is the key-value store's client (``None`` once it is shut down),
    ``fault_timeout()`` the fault timeout in seconds, ``failures()`` the run failures
    the processes announced (``{process: (message, process blamed or None)}``) and
    ``told()`` whether this process announced one itself.
    """

    def __init__(
        self,
        here: int,
        client: Callable[[], object | None],
        fault_timeout: Callable[[], float],
        failures: Callable[[], dict[int, tuple[str, int | None]]],
        told: Callable[[], bool],
        end: Callable[[str], None] = end,
        processes: int | None = None,
    ):
        self.here = here
        self.processes = processes  # in the run; process 0 hosts the key-value store
        self.client = client
        self.fault_timeout = fault_timeout
        self.failures = failures
        self.told = told
        self.end = end
        self._published: str | None = None
        self._beating: set[str] = set()
        self._beats = 0
        self._seen: tuple[float, int] | None = None  # when a peer's failure was first seen
        self._learnt = False  # this process has been in a wait since: it learnt of the failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpmdc-watchdog", daemon=True)
        self._publishing = threading.Lock()

    def start(self) -> None:
        global _wait_ended
        _wait_ended = self.wait_ended
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (before the client it uses is shut down)."""
        global _wait_ended
        if _wait_ended == self.wait_ended:
            _wait_ended = None
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * beat_seconds(self.fault_timeout()))

    def _run(self) -> None:
        while not self._stop.wait(beat_seconds(self.fault_timeout())):
            client = self.client()
            if client is None:
                return
            try:
                self.tick(client)
            except Exception:  # the store is going away with the run: nothing left to tell
                pass

    def tick(self, client, now: float | None = None) -> None:
        """One beat: publish what lasts, and end the process if the others gave up on it."""
        now = time.monotonic() if now is None else now
        with self._publishing:
            self._publish_waits(client, now)
        self._publish_beats(client)
        self._check_peers(now)

    def wait_ended(self) -> None:
        """As a wait of this process ends: if waits are published, publish what is left
        at once, not a beat later. A process stopped (``SIGSTOP``) in between would leave
        the ended wait standing, and a peer following it would find a circle of waits
        and blame itself. Nothing to do (the common case) when nothing is published."""
        if self._published is None:
            return
        client = self.client()
        if client is None or not self._publishing.acquire(
            timeout=beat_seconds(self.fault_timeout())
        ):
            return
        try:
            self._publish_waits(client, time.monotonic())
        except Exception:  # the store is going away with the run: the next beat tries again
            pass
        finally:
            self._publishing.release()

    def _publish_waits(self, client, now: float) -> None:
        if self.told():
            # It gave up (or failed): the waits it published stay, for a peer that follows
            # them to the stuck process before it hears of this failure.
            return
        beat = beat_seconds(self.fault_timeout())
        lasting = []
        for describe, since in list(_waits.values()):
            entry = describe() if now - since >= beat else None
            if entry is not None:
                lasting.append([entry[0], list(entry[1])])
        text = json.dumps(lasting) if lasting else None
        if text != self._published:
            key = f"{_WAITING}{self.here}"
            if text is None:
                client.key_value_delete(key)
            else:
                client.key_value_set(key, text, allow_overwrite=True)
            self._published = text

    def _publish_beats(self, client) -> None:
        working = set(_working)
        self._beats += 1
        for exchange in working:
            key = _BEAT.format(exchange=exchange, process=self.here)
            client.key_value_set(key, str(self._beats), allow_overwrite=True)
        for exchange in self._beating - working:
            client.key_value_delete(_BEAT.format(exchange=exchange, process=self.here))
        self._beating = working

    def _hosts_waiters(self, failed: dict, seconds: float) -> bool:
        """Whether this process, blamed for a hang, still hosts the key-value store for
        peers that have not yet raised (each announces its failure as it does): ending
        now would take the store away and kill them before they say what they waited
        for. It waits for them at most a fault timeout."""
        return (
            self.here == 0
            and self.processes is not None
            and len(failed) < self.processes - 1
            and seconds <= self.fault_timeout()
        )

    def _check_peers(self, now: float) -> None:
        """End this process if a peer blamed it for a hang, or if a peer's failure has
        gone a fault timeout without this process coming back to mpmdc to learn of it
        (a process that has been in a wait since learnt of it there, and is left to its
        script)."""
        if self.told() or self._learnt:
            return
        failed = {p: f for p, f in self.failures().items() if p != self.here}
        if not failed:
            return
        if self._seen is None:
            self._seen = (now, _waits_begun)
        seen_at, begun = self._seen
        if _waits or _waits_begun != begun:
            self._learnt = True
            return
        blamed = [p for p, (_, culprit) in sorted(failed.items()) if culprit == self.here]
        if blamed and self._hosts_waiters(failed, now - seen_at):
            return
        if blamed:
            why = f"the others gave up on it: {failed[blamed[0]][0]}"
        elif now - seen_at > self.fault_timeout():
            first = min(failed)
            why = (
                f"process {first} failed ({failed[first][0].rstrip('.')}) and in "
                f"{self.fault_timeout():g} s since, this process has not come back to mpmdc"
            )
        else:
            return
        self.end(
            f"mpmdc: process {self.here} ends itself, since {why}\n"
            f"Its main thread was at (most recent call last):\n{main_thread_stack()}"
        )
