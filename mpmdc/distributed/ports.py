"""Free TCP ports for the addresses processes serve, chosen before they start serving.

``mpmdc launch`` names the coordinator's port and each process's transfer port before
the processes start, seconds before they listen on them. A port taken from the kernel's
ephemeral range (what binding port 0 gives) can meanwhile be handed to any socket of
the machine that binds port 0 or connects out, the gloo and gRPC connections the
starting processes open among them; a peer then reaches the wrong listener, or none.
Below that range the kernel hands out nothing by itself, so the ports come from there.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from mpmdc.errors import DistributedError

# Linux's ephemeral range; macOS and Windows start theirs higher still.
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_LOW = 32768
# The lowest port tried: above the well-known and most registered services' ports.
_LOWEST = 10000
_TRIES = 1000


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now, below the kernel's ephemeral
    range where it leaves room for them (else from it, as binding port 0 gives).

    Each is checked by binding it, and all are held until every one is chosen, so none
    is picked twice.
    """
    low = _ephemeral_low()
    candidates = range(_LOWEST, low) if low - _LOWEST >= 4 * count else range(0)
    picks = random.Random().sample(candidates, min(len(candidates), _TRIES))
    held: list[socket.socket] = []
    try:
        for port in [*picks, *[0] * count]:  # port 0: the kernel's choice, last
            if len(held) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            held.append(s)
        if len(held) < count:
            raise DistributedError(
                f"found {len(held)} of the {count} free TCP ports needed on {host}; free some "
                f"ports on that interface, or name the addresses (MPMDC_TRANSFER_ADDRESS)."
            )
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
