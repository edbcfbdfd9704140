"""The ports ``mpmdc launch`` names before its processes listen: none of them is one the
kernel could hand to another socket meanwhile."""

import random
import socket
import sys

from mpmdc.cli.launch import launch
from mpmdc.distributed import ports
from mpmdc.distributed.ports import free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    chosen = free_ports("127.0.0.1", 9)
    assert len(set(chosen)) == 9
    assert all(ports._LOWEST <= p < low for p in chosen), (chosen, low)
    for port in chosen:  # free: each can be bound now
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        low = ports._ephemeral_low()
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: max(low, taken + 1))
        # The busy port is the first candidate drawn.
        monkeypatch.setattr(
            random.Random, "sample", lambda self, population, k: [taken, *population[-k + 1 :]]
        )
        chosen = free_ports("127.0.0.1", 2)
    assert taken not in chosen and len(set(chosen)) == 2


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports._LOWEST + 1)
    chosen = free_ports("127.0.0.1", 3)
    assert len(set(chosen)) == 3 and all(p > ports._LOWEST for p in chosen), chosen


def test_launch_names_addresses_from_below_the_ephemeral_range(capsys):
    code = "import os; print(os.environ['MPMDC_COORDINATOR_ADDRESS'], os.environ['MPMDC_TRANSFER_ADDRESS'])"
    assert launch([sys.executable, "-c", code], 3, timeout=30) == 0
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    named = {int(address.rsplit(":", 1)[1]) for line in lines for address in line.split()}
    assert len(named) == 4, lines  # one coordinator, three transfer ports
    assert all(ports._LOWEST <= p < ports._ephemeral_low() for p in named), named
