"""``mpmdc launch``: run one command as N local processes of one multi-process program.

Like ``torchrun`` for local runs and CI: it picks a coordinator address and one
cross-host transfer address per process on the loopback interface, tells each
process its id through ``MPMDC_*`` variables (read by
:func:`mpmdc.distributed.initialize`), and streams each process's output with its
id in front. It exits 0 only if every process does. When one process fails (a
non-zero status or a signal) the others get ``grace`` seconds to report what they
saw, then are stopped; the launcher says which process failed first and how (a
process that announced it gave up waiting for a stuck one blames that one). With
``max_restarts``, it then starts every process again, as ``torchrun --max-restarts``
does, telling each how many restarts came before (``MPMDC_RESTART_COUNT``), so that a
script resuming from its latest checkpoint finishes on its own. A SIGTERM or SIGHUP
to the launcher (Ctrl-C too) stops every process before it exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from mpmdc import distributed
from mpmdc.distributed.ports import free_ports

EXIT_TIMEOUT = 124


class _Ended(Exception):
    """The launch ends with ``status``, whatever restarts are left (a timeout, an
    interrupt, a command that cannot start)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


class _Signals:
    """The SIGTERM or SIGHUP the launcher got, if any (a scheduler's ``scancel``, a
    ``timeout`` around it, a closed terminal): it then stops every process and exits
    with 128 + the signal's number, as a shell reports a process ended by it. Recorded
    here and acted on by the loop that supervises, not in the handler, so that no
    process is started unsupervised."""

    CAUGHT = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.got: signal.Signals | None = None
        self._before: dict = {}

    def __enter__(self) -> _Signals:
        # (Only the main thread may set handlers; elsewhere the caller's stay.)
        if threading.current_thread() is threading.main_thread():
            for sig in self.CAUGHT:
                self._before[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _record(self, signum, frame) -> None:
        self.got = self.got or signal.Signals(signum)

    def check(self, processes: list[_Process], err) -> None:
        """Stop every process and end the launch if a signal came."""
        if self.got is None:
            return
        running = [p.index for p in processes if p.popen.poll() is None]
        _stop(processes)
        stopped = f"; stopped {_processes(running)}" if running else ""
        print(f"mpmdc launch: got {self.got.name}{stopped}", file=err, flush=True)
        raise _Ended(128 + self.got)


@dataclass
class _Process:
    index: int
    popen: subprocess.Popen
    reader: threading.Thread


def _stream(index: int, pipe, out, lock: threading.Lock) -> None:
    """Copy ``pipe`` to ``out`` line by line, each line prefixed with the process id."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            try:
                out.write(f"[{index}] {line}\n")
                out.flush()
            except (BrokenPipeError, ValueError):
                pass
    pipe.close()


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def _stop(processes: list[_Process], wait: float = 3.0) -> None:
    """SIGTERM every running process group, then SIGKILL what is left after ``wait`` s.
    A stopped process (SIGSTOP) is continued after the SIGTERM, as a shell's ``kill``
    does, so that it ends now rather than at the SIGKILL."""
    for sig, pause in ((signal.SIGTERM, wait), (signal.SIGKILL, 0)):
        alive = [p for p in processes if p.popen.poll() is None]
        for p in alive:
            try:
                os.killpg(p.popen.pid, sig)
                if sig == signal.SIGTERM:
                    os.killpg(p.popen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + pause
        while pause and time.monotonic() < deadline and any(p.popen.poll() is None for p in alive):
            time.sleep(0.05)


def launch(
    command: list[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    timeout: float | None = None,
    fault_timeout: float | None = None,
    grace: float = 5.0,
    max_restarts: int = 0,
    out=None,
    err=None,
) -> int:
    """Run ``command`` as ``num_processes`` processes; return the exit status (see module doc).

    ``timeout`` (seconds) bounds the whole launch, restarts included: it stops every
    process and returns 124. ``fault_timeout`` is passed to each process
    (``MPMDC_FAULT_TIMEOUT``). After a failure, every process starts again, on fresh
    ports, up to ``max_restarts`` times; the status is 0 once an attempt succeeds,
    else the last failure's.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    deadline = None if timeout is None else time.monotonic() + timeout
    restart = 0
    with _Signals() as signals:
        while True:
            try:
                status = _attempt(
                    command,
                    num_processes,
                    restart,
                    devices_per_process=devices_per_process,
                    fault_timeout=fault_timeout,
                    grace=grace,
                    timeout=timeout,
                    deadline=deadline,
                    signals=signals,
                    out=out,
                    err=err,
                )
                if status != 0 and restart < max_restarts:
                    signals.check([], err)
            except _Ended as ended:
                return ended.status
            if status == 0 or restart == max_restarts:
                return status
            if deadline is not None and time.monotonic() > deadline:
                print(f"mpmdc launch: timed out after {_seconds(timeout)}", file=err)
                return EXIT_TIMEOUT
            restart += 1
            print(
                f"mpmdc launch: restart {restart} of {max_restarts}: starting every process again",
                file=err,
                flush=True,
            )


def _attempt(
    command: list[str],
    num_processes: int,
    restart: int,
    *,
    devices_per_process: int | None,
    fault_timeout: float | None,
    grace: float,
    timeout: float | None,
    deadline: float | None,
    signals: _Signals,
    out,
    err,
) -> int:
    """Start every process once (``restart`` restarts came before) and supervise them;
    the exit status of this attempt."""
    ports = free_ports("127.0.0.1", num_processes + 1)
    base = dict(os.environ)
    base.update(
        {
            distributed.ENV_COORDINATOR: f"127.0.0.1:{ports[0]}",
            distributed.ENV_NUM_PROCESSES: str(num_processes),
            distributed.ENV_RESTART_COUNT: str(restart),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if devices_per_process is not None:
        base[distributed.ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
    if fault_timeout is not None:
        base[distributed.ENV_FAULT_TIMEOUT] = str(fault_timeout)
    failure_dir = tempfile.mkdtemp(prefix="mpmdc-launch-")
    base[distributed.ENV_FAILURE_DIR] = failure_dir
    lock = threading.Lock()
    processes: list[_Process] = []
    try:
        for i in range(num_processes):
            env = dict(base)
            env[distributed.ENV_PROCESS_ID] = str(i)
            env[distributed.ENV_TRANSFER_ADDRESS] = f"127.0.0.1:{ports[i + 1]}"
            try:
                popen = subprocess.Popen(
                    command,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as error:
                _stop(processes)
                print(f"mpmdc launch: cannot start {command[0]!r}: {error.strerror}", file=err)
                raise _Ended(127) from None
            reader = threading.Thread(
                target=_stream, args=(i, popen.stdout, out, lock), daemon=True
            )
            reader.start()
            processes.append(_Process(i, popen, reader))
        return _supervise(processes, timeout, deadline, grace, signals, err, failure_dir)
    except KeyboardInterrupt:
        _stop(processes)
        print("mpmdc launch: interrupted; stopped every process", file=err)
        raise _Ended(130) from None
    finally:
        for p in processes:
            p.reader.join(timeout=2)
        shutil.rmtree(failure_dir, ignore_errors=True)


def _announcements(failure_dir: str) -> list[tuple[float, int, dict]]:
    """``(when, process, record)`` of each failure a process announced
    (:func:`mpmdc.distributed.announce_failure`)."""
    found = []
    for name in os.listdir(failure_dir):
        if name.isdigit():
            with open(os.path.join(failure_dir, name)) as f:
                record = json.load(f)
            found.append((record["time"], int(name), record))
    return found


def _first_failure(processes: list[_Process], first_exit: tuple[float, _Process], failure_dir: str):
    """``(process, what happened)`` of the failure to blame.

    ``first_exit`` is the first process seen exiting with an error (when, and which).
    Killed by a signal, it could not say why and is the one to blame, with what a peer
    announced of it (that it made no progress). Otherwise the
    earliest error a process announced may be older than that exit: a process raising
    tells its peers at once, and they can exit before it does. An announcement that
    blames another process (one that made no progress while the announcer waited for
    it) blames that one.
    """
    seen, process = first_exit
    announcements = _announcements(failure_dir)
    if process.popen.returncode < 0:
        # A peer's report of it made before it was seen killed is why it was (JAX's
        # coordination service aborts a process another one reported stuck); one made
        # after is the peer noticing that it died.
        blame = min(
            (
                (when, r["blame"])
                for when, _, r in announcements
                if r["culprit"] == process.index and when <= seen
            ),
            default=None,
        )
        ending = f"it {_how(process.popen.returncode)}"
        return process, f"{blame[1].rstrip('.')}; {ending}" if blame else ending
    events = [(seen, process.index, None), *announcements]
    _, index, record = min(events, key=lambda event: event[:2])
    message = ""
    if record is not None:
        culprit = record["culprit"]
        if culprit is not None and culprit != index:
            index, message = culprit, record["blame"]
        else:
            message = record["message"]
    process = processes[index]
    status = process.popen.returncode
    ending = "" if status is None else f"it {_how(status)}"
    return process, "; ".join(part for part in (message.rstrip("."), ending) if part)


def _supervise(
    processes: list[_Process],
    timeout: float | None,
    deadline: float | None,
    grace: float,
    signals: _Signals,
    err,
    failure_dir: str,
) -> int:
    first: _Process | None = None
    first_seen = 0.0  # wall-clock time, as processes write in their announcements
    stop_at = None
    while True:
        signals.check(processes, err)
        running = [p for p in processes if p.popen.poll() is None]
        if first is None:
            failed = [p for p in processes if p.popen.returncode not in (None, 0)]
            if failed:
                first, first_seen = failed[0], time.time()
                stop_at = time.monotonic() + grace
        if not running:
            break
        now = time.monotonic()
        if deadline is not None and now > deadline:
            _stop(processes)
            print(
                f"mpmdc launch: timed out after {_seconds(timeout)}; stopped "
                f"{_processes([p.index for p in running])}",
                file=err,
            )
            raise _Ended(EXIT_TIMEOUT)
        if stop_at is not None and now > stop_at:
            culprit, what = _first_failure(processes, (first_seen, first), failure_dir)
            _stop(processes)
            print(
                f"mpmdc launch: process {culprit.index} failed first: {what}; stopped "
                f"{_processes([p.index for p in running])} ({_seconds(grace)} after process "
                f"{first.index} failed)",
                file=err,
            )
            return _status(culprit, first)
        time.sleep(0.05)
    if first is not None:
        culprit, what = _first_failure(processes, (first_seen, first), failure_dir)
        others = [p.index for p in processes if p is not culprit and p.popen.returncode != 0]
        also = f"; {_processes(others)} failed too" if others else ""
        print(f"mpmdc launch: process {culprit.index} failed first: {what}{also}", file=err)
        return _status(culprit, first)
    return 0


def _status(culprit: _Process, first: _Process) -> int:
    """The launcher's status: the blamed process's, else the first failed one's, as a
    positive number (a process killed by a signal has a negative one)."""
    for process in (culprit, first):
        if process.popen.returncode is not None and process.popen.returncode > 0:
            return process.popen.returncode
    return 1


def _processes(indices: list[int]) -> str:
    """``process 0``, ``processes 0 and 2``, ``processes 0, 2 and 3``."""
    names = [str(i) for i in indices]
    if len(names) == 1:
        return f"process {names[0]}"
    return f"processes {', '.join(names[:-1])} and {names[-1]}"


def _seconds(seconds: float) -> str:
    """``1 second``, ``5 seconds``, ``0.5 seconds``."""
    return f"{seconds:g} second" + ("" if seconds == 1 else "s")
