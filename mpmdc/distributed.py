"""Many processes: ``jax.distributed`` set up for mpmdc, and what processes tell each other.

Every process runs the same script (JAX's multi-controller model). :func:`initialize`
starts ``jax.distributed`` from what ``mpmdc launch`` put in the environment, or from
a cluster's environment (whatever ``jax.distributed`` detects: SLURM, Open MPI,
Kubernetes, TPU pods), and turns on what mpmdc's runtime relies on:

- JAX's cross-host ``device_put`` between disjoint device sets (the socket transport,
  on an address of this host; a backend with its own cross-host transfers uses those);
- recoverable tasks, so that a process that dies becomes an error in the others
  instead of JAX aborting them all;
- a bound on every wait (:func:`fault_timeout`): a transfer whose sender never comes,
  a peer that stops. A wait that gives up names the process its peers' waits lead to
  (:func:`gave_up`); :mod:`mpmdc.watchdog` keeps what that takes.

The rest goes through ``jax.distributed``'s key-value store: failures a process
announces before it raises (:func:`announce_failure`), and checks that all processes
hold the same thing (:func:`check_agreement`).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import math
import os
import re
import socket
import sys
import time

import jax
import numpy as np

from mpmdc import _jax_compat as compat
from mpmdc import watchdog
from mpmdc.errors import DistributedError, MpmdRuntimeError, ProgramMismatchError

# What ``mpmdc launch`` tells each process it starts.
ENV_COORDINATOR = "MPMDC_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MPMDC_NUM_PROCESSES"
ENV_PROCESS_ID = "MPMDC_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "MPMDC_DEVICES_PER_PROCESS"
ENV_TRANSFER_ADDRESS = "MPMDC_TRANSFER_ADDRESS"
ENV_FAULT_TIMEOUT = "MPMDC_FAULT_TIMEOUT"
ENV_FAILURE_DIR = "MPMDC_FAILURE_DIR"  # where a process's announced failure is also written
ENV_RESTART_COUNT = "MPMDC_RESTART_COUNT"  # how many times `mpmdc launch` restarted the run

DEFAULT_FAULT_TIMEOUT = 60.0
_PREFIX = "mpmdc/"
_fault_timeout: float | None = None
_failed = False  # this process announced a failure: it leaves without waiting for the others
_watchdog: watchdog.Watchdog | None = None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    devices_per_process: int | None = None,
    fault_timeout: float | None = None,
    transfer_address: str | None = None,
) -> None:
    """Start ``jax.distributed`` for an mpmdc program; call it first, before JAX runs anything.

    Arguments left out come from ``mpmdc launch`` (``MPMDC_*`` variables), else from
    the cluster's environment as ``jax.distributed.initialize()`` detects it. With
    neither, this is one process and nothing is started (``devices_per_process`` still
    sets the number of CPU devices), so a script calls it unconditionally.

    ``devices_per_process`` sets ``jax_num_cpu_devices`` (CPU only).
    ``fault_timeout`` (seconds, default 60 or ``MPMDC_FAULT_TIMEOUT``) bounds every
    wait on another process: a transfer that never arrives, a peer that died. A step
    that makes no progress for that long fails with ``MpmdRuntimeError``.
    ``transfer_address`` (``host:port``) is where this process serves cross-host
    transfers; by default a free port on the interface that reaches the coordinator.
    Calling it again, or after ``jax.distributed.initialize()``, changes nothing but
    ``fault_timeout``.
    """
    global _fault_timeout
    env = os.environ
    # the argument, else MPMDC_FAULT_TIMEOUT, else the default
    timeout = float(fault_timeout) if fault_timeout is not None else fault_timeout_seconds()
    if not timeout > 0:
        raise DistributedError(
            f"fault_timeout must be a positive number of seconds, got {timeout!r}."
        )
    if fault_timeout is not None:
        _fault_timeout = timeout
    if jax.distributed.is_initialized():
        return
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _int_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _int_env(ENV_PROCESS_ID)
    devices_per_process = (
        devices_per_process
        if devices_per_process is not None
        else _int_env(ENV_DEVICES_PER_PROCESS)
    )
    local_device_ids = None
    if coordinator_address is None:
        found = compat.detect_cluster()
        if found is not None:
            coordinator_address, num_processes, process_id, local_device_ids = found
    if compat.backends_are_initialized():
        if coordinator_address is None and devices_per_process in (None, len(jax.local_devices())):
            return
        raise DistributedError(
            "mpmdc.distributed.initialize() was called after JAX started its devices (by jax.devices(), "
            "creating an array, or a computation); call it first thing in the script."
        )
    if devices_per_process is not None:
        jax.config.update("jax_num_cpu_devices", devices_per_process)
    if coordinator_address is None or num_processes in (None, 1):
        return
    host = coordinator_address.rsplit(":", 1)[0].strip("[]")
    address = transfer_address or env.get(ENV_TRANSFER_ADDRESS) or _free_address(host)
    # A peer that dies must become an error in the others, not make JAX abort them.
    jax.config.update("jax_enable_recoverability", True)
    # CPU meshes that span processes run their collectives through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_cross_host_transfer_socket_address", address)
    jax.config.update("jax_cross_host_transport_addresses", address.rsplit(":", 1)[0] + ":0")
    jax.config.update("jax_cross_host_transfer_timeout_seconds", math.ceil(timeout))
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids=local_device_ids,
        heartbeat_timeout_seconds=max(2, math.ceil(timeout)),
    )
    # With recoverable tasks JAX's own shutdown no longer waits for every process, and
    # one leaving while the coordinator's process has gone aborts; so all leave together.
    atexit.register(_leave_together)
    sys.excepthook = _announcing(sys.excepthook)
    _start_watchdog()
    _connect_peers()


def _start_watchdog() -> None:
    """This process's :class:`~mpmdc.watchdog.Watchdog`: its lasting waits and saves
    published for the others, and its end when they gave up on it."""
    global _watchdog
    _watchdog = watchdog.Watchdog(
        jax.process_index(),
        compat.distributed_client,
        fault_timeout_seconds,
        _announced,
        lambda: _failed,
    )
    _watchdog.start()


def _announcing(excepthook):
    """``excepthook`` that first tells the peers this process dies of an uncaught error,
    so that they stop waiting for it now rather than after the fault timeout."""

    def hook(kind, value, traceback):
        if not _failed:
            last = (str(value).strip().splitlines() or [""])[-1]
            announce_failure(
                f"process {jax.process_index()} raised {kind.__name__}: {last}".rstrip(": ")
            )
        excepthook(kind, value, traceback)

    return hook


def _leave_together() -> None:
    """At exit: wait for every process (unless the run failed), then disconnect the
    others before the coordinator's process, which hosts the service they disconnect
    from (leaving after it aborts a process)."""
    if _watchdog is not None:
        _watchdog.stop()
    failed = _failed or bool(peer_failures())
    if failed:
        _keep_runtime_at_exit()
    client = _client()
    try:
        if not failed:
            client.wait_at_barrier(f"{_PREFIX}exit", int(fault_timeout_seconds() * 1000))
        if jax.process_index() != 0:
            jax.distributed.shutdown()
            return
        if failed:  # the others are leaving too, or dead (then asking blocks for a heartbeat)
            time.sleep(1)
            return
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and len(client.get_live_nodes(list(range(jax.process_count())))) > 1
        ):
            time.sleep(0.05)
    except Exception:  # leaving anyway; JAX's own shutdown follows
        pass


def _keep_runtime_at_exit() -> None:
    """Leak one reference to JAX's backend client so that it is never torn down.

    After a failure a transfer stays in flight that the failed peer will never finish,
    and the client's transfer server waits for it in its destructor, forever (both
    processes hung there about 1 run in 7 of ``tests/multiprocess/faults.py raise``).
    The process is leaving; the operating system reclaims what the client holds.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(jax.devices()[0].client))


def fault_timeout_seconds() -> float:
    """How long a process waits on another before it fails (see :func:`initialize`)."""
    if _fault_timeout is not None:
        return _fault_timeout
    if ENV_FAULT_TIMEOUT in os.environ:
        return _number(os.environ[ENV_FAULT_TIMEOUT], ENV_FAULT_TIMEOUT)
    return DEFAULT_FAULT_TIMEOUT


def is_multiprocess() -> bool:
    """True when this program runs in several processes (``jax.process_count() > 1``)."""
    return jax.process_count() > 1


def _connect_peers() -> None:
    """Open every process pair's transfer connection now.

    JAX opens the socket between two processes at their first transfer, which waits
    (about 2 s) for the peer's address; paid inside a first training step, that would
    look like a slow step. One byte from every process to every other, pair after
    pair in the same order on every process, those not in a pair too: JAX pairs
    cross-host transfers by the order processes issue them (a batch mixing sends and
    receives stalls).
    """
    first = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    here = jax.process_index()
    for src, dst in ((a, b) for a in first for b in first if a != b):
        sharding = jax.sharding.SingleDeviceSharding(first[src])
        if src == here:
            source = jax.device_put(np.zeros((1,), np.uint8), sharding)
        else:
            source = jax.make_array_from_single_device_arrays((1,), sharding, [], dtype=np.uint8)
        jax.block_until_ready(jax.device_put(source, jax.sharding.SingleDeviceSharding(first[dst])))


def _free_address(coordinator_host: str) -> str:
    """``host:port`` with this machine's address towards the coordinator and a free port."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(coordinator_host), 9))
            host = probe.getsockname()[0]
    except OSError:
        host = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(
            f"environment variable {name}={value!r} is not an integer."
        ) from None


def _number(value: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not a number of seconds.") from None


def _client():
    client = compat.distributed_client()
    if client is None:
        raise DistributedError(
            "jax.distributed is not running; call mpmdc.distributed.initialize() first."
        )
    return client


def announce_failure(message: str, *, culprit: int | None = None, blame: str = "") -> None:
    """Tell the other processes that this one failed, and why (before raising here).

    ``culprit`` is the process to blame when it is another (one that made no progress
    while this one waited for it), and ``blame`` what it did, for ``mpmdc launch`` to
    say; that process's watchdog ends it.
    """
    global _failed
    _failed = True
    record = {"message": message, "culprit": culprit, "blame": blame}
    try:
        _client().key_value_set(f"{_PREFIX}failed/{jax.process_index()}", json.dumps(record))
    except Exception:  # the store itself may be gone: the peers then time out instead
        pass
    folder = os.environ.get(ENV_FAILURE_DIR)
    if (
        folder
    ):  # for `mpmdc launch`, which blames the process that failed first, not the first to exit
        path = os.path.join(folder, str(jax.process_index()))
        with open(path + ".tmp", "w") as f:
            json.dump({"time": time.time(), **record}, f)
        os.replace(path + ".tmp", path)


def _announced() -> dict[int, tuple[str, int | None]]:
    """The run failures processes announced: ``{process: (message, process it blames)}``."""
    try:
        entries = _client().key_value_dir_get(f"{_PREFIX}failed/")
    except Exception:
        return {}
    found = {}
    for key, value in entries:
        record = json.loads(value)
        found[int(key.rsplit("/", 1)[1])] = (record["message"], record["culprit"])
    return found


def peer_failures(exchange: str = "") -> dict[int, str]:
    """``{process: message}`` of the processes that announced a failure (of the whole run,
    or with ``exchange`` also of that one exchange: :func:`announce_exchange_failure`)."""
    found = {process: message for process, (message, _) in _announced().items()}
    if exchange:
        try:
            entries = _client().key_value_dir_get(f"{_PREFIX}{exchange}/failed/")
        except Exception:
            entries = []
        found.update({int(key.rsplit("/", 1)[1]): message for key, message in entries})
    return found


def announce_exchange_failure(exchange: str, message: str) -> None:
    """Tell the processes meeting in ``exchange`` (:func:`rendezvous`) that this one failed
    there, and why, without failing the run: they raise, naming it, and the run may go on
    (a save that failed on a full disk need not end training)."""
    try:
        _client().key_value_set(
            f"{_PREFIX}{exchange}/failed/{jax.process_index()}", message, allow_overwrite=True
        )
    except Exception:  # the store itself may be gone: the peers then find it dead
        pass


def gave_up(what: str, peers, seconds: float, hint: str = "") -> MpmdRuntimeError:
    """The error of this process's wait for ``what`` on ``peers``, which got nothing for
    ``seconds``: it names the process that the chain of the processes' waits ends at
    (:func:`mpmdc.watchdog.stuck`; this one when ``peers`` is empty: the wait was for its
    own computation), and is announced to the others, blaming that process. ``hint``
    ends the message."""
    here = jax.process_index()
    peers = tuple(peers)
    found = watchdog.stuck(_client(), here, peers) if peers else watchdog.Stuck(here, (), what)
    message = f"process {here} stopped waiting for {what}: {found.reason(seconds)}.{hint}"
    if found.process is None:
        announce_failure(message)
    else:
        announce_failure(message, culprit=found.process, blame=found.blame(seconds, here, what))
    return MpmdRuntimeError(message)


def _failed_peer(what: str, exchange: str = "") -> MpmdRuntimeError | None:
    """The error of this process's wait for ``what`` when a process announced a failure
    (of the run, or of ``exchange``), naming the first; ``None`` if none did."""
    failed = peer_failures(exchange)
    if not failed:
        return None
    first = min(failed)
    return MpmdRuntimeError(
        f"process {jax.process_index()} stopped waiting for {what}: process {first} failed: {failed[first]}"
    )


def _wait_for(key: str, peer: int, what: str, *, patient: bool = False, exchange: str = "") -> str:
    """The value of ``key``, which process ``peer`` sets on reaching ``what``; raises
    ``MpmdRuntimeError`` once a process announces a failure (see :func:`peer_failures`
    for ``exchange``), or after the fault timeout with nothing from ``peer``
    (:func:`gave_up`). A ``patient`` wait goes on as long as ``peer`` works on
    ``exchange`` (:func:`mpmdc.watchdog.working_on`): work that may take long, such as
    writing a large checkpoint, is not a hang, but a peer that has not begun it is."""
    client = _client()
    timeout = fault_timeout_seconds()
    last_progress = time.monotonic()
    beat = None
    what = f"process {peer} to reach {what}"
    with watchdog.waiting_for(what, (peer,)):
        while True:
            try:
                return client.blocking_key_value_get(key, 250)
            except Exception:
                failure = _failed_peer(what, exchange)
                if failure is not None:
                    raise failure from None
                now = time.monotonic()
                if patient:
                    seen = watchdog.beating(client, exchange, peer)
                    if seen != beat:
                        beat, last_progress = seen, now
                if now - last_progress > timeout:
                    raise gave_up(what, (peer,), timeout) from None


def offer_agreement(topic: str, entries: list[tuple[str, str]]) -> None:
    """Publish this process's ``entries`` for :func:`check_agreement` on ``topic``, without
    waiting for anyone (so the peers' checks can go on before this process comes to its)."""
    _client().key_value_set(
        f"{_PREFIX}agree/{topic}/{jax.process_index()}", json.dumps(entries), allow_overwrite=True
    )


def check_agreement(
    topic: str, entries: list[tuple[str, str]], what: str, *, exchange: str = ""
) -> None:
    """Raise ``ProgramMismatchError`` unless every process holds the same ``entries``.

    ``entries`` are ``(name, digest)`` pairs in order; the error names the first name
    whose digest differs between this process and another, or the first one missing.
    ``what`` says what the entries are ("the program compiled at the first call").
    Every process must call this with the same ``topic``; it waits for the others'
    entries (offered here, or earlier by :func:`offer_agreement`), and stops waiting when
    a process announces a failure of ``exchange`` (:func:`announce_exchange_failure`).
    """
    here = jax.process_index()
    offer_agreement(topic, entries)
    for peer in range(jax.process_count()):
        if peer == here:
            continue
        theirs = json.loads(
            _wait_for(
                f"{_PREFIX}agree/{topic}/{peer}", peer, f"{what} ({topic})", exchange=exchange
            )
        )
        mine = [tuple(e) for e in entries]
        theirs = [tuple(e) for e in theirs]
        if mine == theirs:
            continue
        for (name, digest), other in zip(mine, theirs):
            if other[0] != name or other[1] != digest:
                if other[0] != name:
                    differ = f"{name} (process {peer} has {other[0]})"
                elif re.fullmatch("[0-9a-f]{16}", digest):  # a hash: nothing to show
                    differ = name
                else:
                    differ = f"{name}: {digest} on process {here}, {other[1]} on process {peer}"
                break
        else:
            longer, count = (mine, len(theirs)) if len(mine) > len(theirs) else (theirs, len(mine))
            differ = f"{longer[count][0]} (only one of the two has it)"
        raise ProgramMismatchError(
            f"processes {here} and {peer} differ in {what}: first at {differ}. Every process must run "
            f"the same code with arguments of the same types and the same mpmdc and JAX versions."
        )


def fetch(tree):
    """The values of a pytree of arrays as numpy arrays, on every process.

    In one process this is ``jax.device_get``. With several, an output of a compiled
    step is addressable only on its mesh's processes; this brings it to all of them
    (for logging a loss, for checks). Every process must call it with a tree of the
    same structure, in the same order, like a collective. Values go through the
    ``jax.distributed`` key-value store: meant for losses and metrics, not for
    gigabytes of parameters.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in flat]
    if jax.process_count() == 1 or not any(isinstance(x, jax.Array) for x in leaves):
        return jax.tree_util.tree_unflatten(
            treedef, [np.asarray(jax.device_get(x)) for x in leaves]
        )
    client = _client()
    # Named by the leaves' paths and types: a treedef's text can hold addresses of
    # functions (``Partial``, modules' fields), different in every process.
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    about = topic("fetch", repr(paths) + repr([jax.typeof(x) for x in leaves]))
    prefix = f"{_PREFIX}{about}"
    timeout_ms = int(fault_timeout_seconds() * 1000)
    everyone = set(range(jax.process_count()))
    written = []
    for k, x in enumerate(leaves):
        if not isinstance(x, jax.Array) or not x.addressable_shards:
            continue
        if x.is_fully_replicated and {d.process_index for d in x.sharding.device_set} == everyone:
            continue  # every process has it whole
        for shard in x.addressable_shards:
            key = f"{prefix}/{k}/{_index_text(shard.index, x.shape)}"
            if key not in written:
                client.key_value_set_bytes(
                    key,
                    np.ascontiguousarray(np.asarray(shard.data)).tobytes(),
                    allow_overwrite=True,
                )
                written.append(key)
    out = []
    for k, x in enumerate(leaves):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            out.append(np.asarray(jax.device_get(x)))
            continue
        value = np.empty(x.shape, x.dtype)
        indices = {
            _index_text(i, x.shape): i for i in x.sharding.devices_indices_map(x.shape).values()
        }
        owners = sorted({d.process_index for d in x.sharding.device_set})
        what = f"leaf {k} ({x.dtype}{list(x.shape)}) of mpmdc.fetch from process(es) {owners}"
        for text, index in indices.items():
            try:
                with watchdog.waiting_for(what, owners):
                    data = client.blocking_key_value_get_bytes(f"{prefix}/{k}/{text}", timeout_ms)
            except Exception:
                raise _failed_peer(what) or gave_up(
                    what,
                    owners,
                    fault_timeout_seconds(),
                    " Every process must call fetch with the same tree.",
                ) from None
            value[index] = np.frombuffer(data, x.dtype).reshape(value[index].shape)
        out.append(value)
    try:
        barrier(about)
    finally:
        for key in written:
            client.key_value_delete(key)
    return jax.tree_util.tree_unflatten(treedef, out)


def _index_text(index, shape) -> str:
    """A shard's index as text, the same on every process: ``0:4,0:8``."""
    return (
        ",".join(f"{s.start or 0}:{n if s.stop is None else s.stop}" for s, n in zip(index, shape))
        or "scalar"
    )


_topic_uses: dict[str, int] = {}


def topic(kind: str, about: str) -> str:
    """A key-value topic for the next exchange of ``kind`` about ``about``.

    Named by what the exchange is about (a digest of ``about``: a function's name, a
    program, a checkpoint's path) and how many exchanges of that kind about it this
    process began, never by a count of all exchanges: a process that compiles or fetches
    something once more than its peers then waits alone on that one topic (and says
    so) instead of shifting every later exchange onto the wrong partner.
    """
    digest = hashlib.sha256(about.encode()).hexdigest()[:16]
    key = f"{kind}/{digest}"
    _topic_uses[key] = _topic_uses.get(key, 0) + 1
    return f"{key}/{_topic_uses[key]}"


def barrier(topic: str) -> None:
    """Wait until every process reaches ``topic`` (bounded by the fault timeout)."""
    others = [p for p in range(jax.process_count()) if p != jax.process_index()]
    what = f"the other processes at {topic}"
    try:
        with watchdog.waiting_for(what, others):
            _client().wait_at_barrier(f"{_PREFIX}{topic}", int(fault_timeout_seconds() * 1000))
    except Exception:
        raise _failed_peer(what) or gave_up(what, others, fault_timeout_seconds()) from None


def rendezvous(
    topic: str, what: str, *, patient: bool = False, exchange: str = "", value: str = "1"
) -> dict[int, str]:
    """Wait until every process reaches ``topic``, as :func:`barrier` does, but stop as
    soon as a process announces a failure, of the run or of ``exchange``
    (:func:`announce_exchange_failure`), with an ``MpmdRuntimeError`` naming it and why,
    instead of at the fault timeout. ``what`` says what is waited for, for the error;
    ``patient`` waits as long as the peers answer (see :func:`_wait_for`). Returns the
    ``value`` each process brought, by process."""
    client = _client()
    here = jax.process_index()
    client.key_value_set(f"{_PREFIX}meet/{topic}/{here}", value)
    values = {here: value}
    for peer in range(jax.process_count()):
        if peer != here:
            key = f"{_PREFIX}meet/{topic}/{peer}"
            values[peer] = _wait_for(key, peer, what, patient=patient, exchange=exchange)
    return values


def forget(topic: str) -> None:
    """Delete this process's keys of a :func:`rendezvous` on ``topic`` and of a
    :func:`check_agreement` on it, once every process is past them (the key-value store
    keeps what is not deleted for the whole run)."""
    client = _client()
    here = jax.process_index()
    for key in (f"{_PREFIX}meet/{topic}/{here}", f"{_PREFIX}agree/{topic}/{here}"):
        try:
            client.key_value_delete(key)
        except Exception:  # nothing there: nothing to forget
            pass


def merge_timelines(topic: str, timeline):
    """Every process's measured ``timeline`` merged into one, on every process: each
    mesh's row from the first process that measured it."""
    from mpmdc.schedules import Action, Slot, Timeline

    client = _client()
    rows = [
        [[str(s.action) if s.action is not None else None, s.start, s.end, s.name] for s in row]
        for row in timeline.meshes
    ]
    client.key_value_set(f"{_PREFIX}timeline/{topic}/{jax.process_index()}", json.dumps(rows))
    merged = [[] for _ in rows]
    timeout_ms = int(fault_timeout_seconds() * 1000)
    for peer in range(jax.process_count()):
        what = f"process {peer}'s timeline of {topic}"
        try:
            with watchdog.waiting_for(what, (peer,)):
                text = client.blocking_key_value_get(
                    f"{_PREFIX}timeline/{topic}/{peer}", timeout_ms
                )
        except Exception:
            raise _failed_peer(what) or gave_up(what, (peer,), fault_timeout_seconds()) from None
        theirs = json.loads(text)
        for m, row in enumerate(theirs):
            if row and not merged[m]:
                merged[m] = [
                    Slot(Action.parse(a) if a else None, start, end, name)
                    for a, start, end, name in row
                ]
    return Timeline(tuple(tuple(row) for row in merged))
