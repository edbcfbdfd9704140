"""Many processes: ``jax.distributed`` set up for mpmdc, and what processes tell each other.

Every process runs the same script (JAX's multi-controller model).

- ``settings``: what ``mpmdc launch`` tells each process (``MPMDC_*`` variables) and the
  fault timeout that bounds every wait on another process;
- ``setup``: :func:`initialize` (``jax.distributed`` started from ``mpmdc launch`` or the
  cluster's environment, with what mpmdc's runtime relies on) and leaving together;
- ``ports``: free ports for the addresses processes serve, named before they listen;
- ``exchange``: what goes through ``jax.distributed``'s key-value store: failures a
  process announces before it raises, meetings, checks that all processes hold the same
  thing, values fetched to every process, merged timelines.

Layer 5, beside the runtime: imports :mod:`mpmdc.watchdog` and below.
"""

from mpmdc.distributed.exchange import (
    announce_exchange_failure,
    announce_failure,
    barrier,
    check_agreement,
    fetch,
    first_failure,
    forget,
    gave_up,
    merge_timelines,
    offer_agreement,
    peer_failures,
    rendezvous,
    topic,
)
from mpmdc.distributed.settings import (
    DEFAULT_FAULT_TIMEOUT,
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_FAILURE_DIR,
    ENV_FAULT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    ENV_TRANSFER_ADDRESS,
    fault_timeout_seconds,
    is_multiprocess,
)
from mpmdc.distributed.setup import initialize

__all__ = [
    "DEFAULT_FAULT_TIMEOUT",
    "ENV_COORDINATOR",
    "ENV_DEVICES_PER_PROCESS",
    "ENV_FAILURE_DIR",
    "ENV_FAULT_TIMEOUT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_RESTART_COUNT",
    "ENV_TRANSFER_ADDRESS",
    "announce_exchange_failure",
    "announce_failure",
    "barrier",
    "check_agreement",
    "fault_timeout_seconds",
    "fetch",
    "first_failure",
    "forget",
    "gave_up",
    "initialize",
    "is_multiprocess",
    "merge_timelines",
    "offer_agreement",
    "peer_failures",
    "rendezvous",
    "topic",
]
