"""What a process of a multi-process run is told, and how long it waits on another.

The ``MPMDC_*`` environment variables ``mpmdc launch`` sets for each process it starts,
and the fault timeout (:func:`fault_timeout_seconds`) that bounds every wait on a peer.
"""

from __future__ import annotations

import os

import jax

from mpmdc.errors import DistributedError

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
_fault_timeout: float | None = None


def set_fault_timeout(seconds: float) -> None:
    """Make ``seconds`` this process's fault timeout (``initialize(fault_timeout=)``)."""
    global _fault_timeout
    _fault_timeout = seconds


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


def int_env(name: str) -> int | None:
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
