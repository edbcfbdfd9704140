"""Starting ``jax.distributed`` for mpmdc, and leaving it.

:func:`initialize` starts ``jax.distributed`` from what ``mpmdc launch`` put in the
environment, or from a cluster's environment (whatever ``jax.distributed`` detects: SLURM,
Open MPI, Kubernetes, TPU pods), and turns on what mpmdc's runtime relies on:

- JAX's cross-host ``device_put`` between disjoint device sets (the socket transport,
  on an address of this host; a backend with its own cross-host transfers uses those);
- recoverable tasks, so that a process that dies becomes an error in the others
  instead of JAX aborting them all;
- a bound on every wait (:func:`~mpmdc.distributed.settings.fault_timeout_seconds`),
  a watchdog that publishes this process's waits (:mod:`mpmdc.watchdog`), and an exit
  that all processes take together.
"""

from __future__ import annotations

import atexit
import ctypes
import math
import os
import socket
import sys
import time

import jax
import numpy as np

from mpmdc import _jax_compat as compat
from mpmdc import watchdog
from mpmdc.distributed import exchange
from mpmdc.distributed.exchange import PREFIX, announce_failure, client, peer_failures
from mpmdc.distributed.ports import free_ports
from mpmdc.distributed.settings import (
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TRANSFER_ADDRESS,
    fault_timeout_seconds,
    int_env,
    set_fault_timeout,
)
from mpmdc.errors import DistributedError

_watchdog: watchdog.Watchdog | None = None


@compat.api_boundary
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
    env = os.environ
    # the argument, else MPMDC_FAULT_TIMEOUT, else the default
    timeout = float(fault_timeout) if fault_timeout is not None else fault_timeout_seconds()
    if not timeout > 0:
        raise DistributedError(
            f"fault_timeout must be a positive number of seconds, got {timeout!r}."
        )
    if fault_timeout is not None:
        set_fault_timeout(timeout)
    if jax.distributed.is_initialized():
        return
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else int_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else int_env(ENV_PROCESS_ID)
    devices_per_process = (
        devices_per_process if devices_per_process is not None else int_env(ENV_DEVICES_PER_PROCESS)
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
        exchange.announced,
        exchange.has_failed,
        processes=jax.process_count(),
    )
    _watchdog.start()


def _announcing(excepthook):
    """``excepthook`` that first tells the peers this process dies of an uncaught error,
    so that they stop waiting for it now rather than after the fault timeout."""

    def hook(kind, value, traceback):
        if not exchange.has_failed():
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
    failed = exchange.has_failed() or bool(peer_failures())
    if failed:
        _keep_runtime_at_exit()
    kv = client()
    try:
        if not failed:
            watchdog.publish_leaving(kv, jax.process_index(), jax.process_count())
            try:
                kv.wait_at_barrier(f"{PREFIX}exit", int(fault_timeout_seconds() * 1000))
            except Exception:
                _left_waiting(kv)
                raise
        if jax.process_index() != 0:
            jax.distributed.shutdown()
            return
        if failed:  # the others are leaving too, or dead (then asking blocks for a heartbeat)
            time.sleep(1)
            return
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and len(kv.get_live_nodes(list(range(jax.process_count())))) > 1
        ):
            time.sleep(0.05)
    except Exception:  # leaving anyway; JAX's own shutdown follows
        pass


def _left_waiting(kv) -> None:
    """The exit's wait for every process ended without them. Where the waits of the
    processes still running end at one stuck in its own code (or stopped), blame it as
    any wait that gives up blames the process it waited for, and end this process now
    with status 1: its runtime's teardown would wait for the stuck one with no bound.
    Where they wait for a process that has left (this one, its script returning after
    fewer calls), give them a fault timeout more to say so and blame it. Either way the
    runtime is kept, as by a process that saw a failure before leaving."""
    here, timeout = jax.process_index(), fault_timeout_seconds()
    running = watchdog.still_running(kv, [p for p in range(jax.process_count()) if p != here])
    found = watchdog.stuck(kv, here, running) if running else None
    _keep_runtime_at_exit()
    if peer_failures() or found is None:
        return
    if found.process is not None and not found.left:
        watchdog.end(f"mpmdc: {exchange.gave_up(watchdog.LEAVING, running, timeout)}")
    deadline = time.monotonic() + timeout
    while not peer_failures() and time.monotonic() < deadline:
        time.sleep(0.05)


def _keep_runtime_at_exit() -> None:
    """Leak one reference to JAX's backend client, and to the coordination service this
    process hosts, so that neither is torn down.

    After a failure a transfer stays in flight that the failed peer will never finish,
    and the client's transfer server waits for it in its destructor, forever (both
    processes hung there about 1 run in 7 of ``tests/multiprocess/faults.py raise``).
    The service's shutdown waits for each peer's calls in flight: a stopped peer's end
    only at its heartbeat timeout, after the fault timeout (process 0 took 8 s more to
    exit). The process is leaving; the operating system reclaims what both hold.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(jax.devices()[0].client))
    service = compat.detach_distributed_service()
    if service is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(service))


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
    return f"{host}:{free_ports(host, 1)[0]}"
