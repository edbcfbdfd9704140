"""The watchdog of a multi-process run, on a key-value store in a dict: which process a
chain of waits ends at, what each beat publishes, and when it ends its process.
(Under ``mpmdc launch``: ``tests/multiprocess/test_hangs.py``.)"""

import json
import threading
from types import SimpleNamespace

import pytest

from mpmdc import watchdog
from mpmdc.distributed import exchange
from mpmdc.errors import MpmdRuntimeError
from mpmdc.runtime import engine, peers

TIMEOUT = 10.0
BEAT = watchdog.beat_seconds(TIMEOUT)


class Store:
    """The key-value calls the watchdog makes, on a dict."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.writes = 0

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.values
        self.values[key] = value
        self.writes += 1

    def key_value_delete(self, key):
        self.values.pop(key, None)
        self.writes += 1

    def key_value_try_get(self, key):
        if key not in self.values:
            raise KeyError(key)
        return self.values[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in sorted(self.values.items()) if k.startswith(prefix)]


def waits(store: Store, process: int, *entries) -> None:
    store.values[f"mpmdc/waiting/{process}"] = json.dumps([[w, list(on)] for w, on in entries])


def test_the_chain_of_waits_ends_at_the_process_that_waits_for_nobody():
    store = Store()
    waits(store, 1, ("transfer mesh2->mesh1 on mesh1 (sent by process 2)", [2]))
    waits(store, 2, ("transfer mesh3->mesh2 on mesh2 (sent by process 3)", [3]))
    found = watchdog.stuck(store, 0, [1])
    assert found.process == 3 and [link[:2] for link in found.chain] == [(1, 2), (2, 3)]
    assert found.reason(10) == (
        "process 1 waits for transfer mesh2->mesh1 on mesh1 (sent by process 2), process 2 waits "
        "for transfer mesh3->mesh2 on mesh2 (sent by process 3); process 3 made no progress for "
        "10 s (the fault timeout) and waits for no other process: it is stuck in its own code, "
        "stopped, or has died"
    )
    assert found.blame(10, 0, "transfer mesh1->mesh0 on mesh0 (sent by process 1)") == (
        "it made no progress for 10 s while process 0 waited for transfer mesh1->mesh0 on mesh0 "
        "(sent by process 1) and process 1 for transfer mesh2->mesh1 on mesh1 (sent by process 2) "
        "and process 2 for transfer mesh3->mesh2 on mesh2 (sent by process 3)"
    )


def test_the_nearest_process_that_waits_for_nobody_is_named():
    store = Store()  # a barrier: 1 waits for everyone, 2 is not there
    waits(store, 1, ("the other processes at fetch/x", [0, 2]))
    assert watchdog.stuck(store, 0, [1, 2]) == watchdog.Stuck(2, ())


def test_a_process_computing_its_own_fragment_ends_the_chain():
    store = Store()
    waits(store, 1, ("s1_fwd_mb0 on mesh1", []))
    found = watchdog.stuck(store, 0, [1])
    assert found == watchdog.Stuck(1, (), "s1_fwd_mb0 on mesh1")
    assert "process 1 is still computing s1_fwd_mb0 on mesh1" in found.reason(10)


def test_processes_waiting_for_each_other_name_no_one():
    store = Store()
    waits(store, 1, ("process 0 to reach the save to /a", [0]))
    found = watchdog.stuck(store, 0, [1])
    assert found.process is None
    assert found.reason(10) == (
        "the processes wait for each other: process 1 waits for process 0 to reach the save to /a"
    )


@pytest.fixture
def dog():
    """A watchdog of process 0 over a fresh store (``dog.watchdog``), the failures it
    sees, whether process 0 announced one, and the messages it would have ended with."""
    dog = SimpleNamespace(store=Store(), failed={}, told=[False], ended=[])
    dog.watchdog = watchdog.Watchdog(
        0,
        lambda: dog.store,
        lambda: TIMEOUT,
        lambda: dog.failed,
        lambda: dog.told[0],
        dog.ended.append,
    )
    dog.tick = lambda now: dog.watchdog.tick(dog.store, now)
    return dog


def test_a_wait_is_published_once_it_lasts_a_beat_and_removed_after(dog):
    describe = lambda: ("transfer mesh1->mesh0 on mesh0 (sent by process 1)", (1,))  # noqa: E731
    with watchdog.waiting(describe):
        start = watchdog._waits[threading.get_ident()][1]
        dog.tick(start + BEAT / 2)
        assert dog.store.values == {}  # a short wait costs nothing
        dog.tick(start + 1.5 * BEAT)
        assert json.loads(dog.store.values["mpmdc/waiting/0"]) == [[describe()[0], [1]]]
    dog.tick(start + 2.5 * BEAT)
    assert dog.store.values == {}


def test_a_published_wait_is_removed_as_it_ends_not_a_beat_later(dog, monkeypatch):
    """A process stopped (SIGSTOP) right after a long wait ended must not leave that wait
    published: a peer following it would find a circle of waits and blame itself. A
    wait ending while waits are published publishes what is left at once; one ending
    with nothing published (a healthy step) touches nothing."""
    monkeypatch.setattr(watchdog, "_wait_ended", dog.watchdog.wait_ended)
    describe = lambda: ("process 0 to reach the program they compiled", (1,))  # noqa: E731
    with watchdog.waiting(describe):
        start = watchdog._waits[threading.get_ident()][1]
        dog.tick(start + 1.5 * BEAT)
        assert "mpmdc/waiting/0" in dog.store.values
    assert dog.store.values == {}  # (no tick since)
    writes = dog.store.writes
    with watchdog.waiting(describe):
        pass
    assert dog.store.writes == writes


def test_the_waits_of_a_process_that_gave_up_stay_published(dog, monkeypatch):
    """Process 1 gives up waiting for process 0 and raises; process 2, giving up on
    process 1 before it hears of that, follows process 1's wait to process 0. Were it
    taken off as it ended, process 2 would blame process 1 as stuck (three processes,
    process 0 asleep: ``tests/multiprocess/test_hangs.py``)."""
    monkeypatch.setattr(watchdog, "_wait_ended", dog.watchdog.wait_ended)
    describe = lambda: ("transfer mesh1->mesh0 on mesh0 (sent by process 1)", (1,))  # noqa: E731
    with pytest.raises(RuntimeError), watchdog.waiting(describe):
        start = watchdog._waits[threading.get_ident()][1]
        dog.tick(start + 1.5 * BEAT)
        dog.told[0] = True  # (announced before it raises)
        raise RuntimeError("process 0 stopped waiting ...")
    dog.tick(start + 2.5 * BEAT)
    assert json.loads(dog.store.values["mpmdc/waiting/0"]) == [[describe()[0], [1]]]


def test_a_save_beats_while_worked_on_and_stops_after(dog):
    with watchdog.working_on("checkpoint/abc/1"):
        dog.tick(0.0)
        first = watchdog.beating(dog.store, "checkpoint/abc/1", 0)
        dog.tick(0.0)
        assert first is not None and watchdog.beating(dog.store, "checkpoint/abc/1", 0) != first
    dog.tick(0.0)
    assert watchdog.beating(dog.store, "checkpoint/abc/1", 0) is None


def test_a_process_blamed_for_a_hang_ends_itself_and_says_where(dog):
    dog.failed[1] = ("process 1 stopped waiting for transfer ...: process 0 made no progress", 0)
    dog.tick(0.0)
    (message,) = dog.ended
    assert message.startswith("mpmdc: process 0 ends itself, since the others gave up on it: ")
    assert "in test_a_process_blamed_for_a_hang_ends_itself_and_says_where" in message


def test_a_process_in_a_wait_learns_of_the_failure_there(dog):
    dog.failed[1] = ("process 1 stopped waiting ...", 0)
    with watchdog.waiting_for("transfer mesh1->mesh0 on mesh0 (sent by process 1)", (1,)):
        dog.tick(0.0)
    dog.tick(TIMEOUT + 1)  # the wait raised; what the script does next is its own
    assert dog.ended == []


def test_a_process_that_does_not_come_back_after_a_failure_ends_a_fault_timeout_later(dog):
    dog.failed[1] = ("process 1 raised ValueError: no", None)
    dog.tick(0.0)
    dog.tick(TIMEOUT - 1)
    assert dog.ended == []
    dog.tick(TIMEOUT + 1)
    assert dog.ended[0].startswith(
        "mpmdc: process 0 ends itself, since process 1 failed (process 1 raised ValueError: no) "
        "and in 10 s since, this process has not come back to mpmdc"
    )


def test_a_process_that_came_back_or_failed_itself_is_left_alone(dog):
    dog.failed[1] = ("process 1 raised ValueError: no", None)
    dog.tick(0.0)
    with watchdog.waiting_for("process 1 to reach the program", (1,)):
        pass
    dog.tick(TIMEOUT + 1)
    dog.told[0] = True
    dog.failed[2] = ("process 2 stopped waiting for ...", 0)
    dog.tick(TIMEOUT + 2)
    assert dog.ended == []


def test_a_blamed_process_hosting_the_store_ends_once_every_waiter_has_raised(dog):
    """Process 0 holds the key-value store the others learn of failures through: blamed
    for a hang, it ends once every other process has raised (announced its failure), or
    a fault timeout later, not while one is still to read the news."""
    dog.watchdog.processes = 3
    dog.failed[1] = ("process 1 stopped waiting for transfer ...: process 0 made no progress", 0)
    dog.tick(0.0)
    assert dog.ended == []
    dog.failed[2] = ("process 2 stopped waiting for transfer ...: process 0 made no progress", 0)
    dog.tick(1.0)
    assert dog.ended[0].startswith("mpmdc: process 0 ends itself, since the others gave up on it")
    dog.ended.clear()
    del dog.failed[2]
    dog.watchdog._seen = None
    dog.tick(2.0)
    dog.tick(2.0 + TIMEOUT + 1)  # process 2 never raised: ended a fault timeout later
    assert len(dog.ended) == 1


def test_a_waiter_hearing_of_a_failure_names_who_failed_first_and_whom_it_blamed(monkeypatch):
    """What a waiter says when another process gave up before it: the first to announce,
    and the process it blamed (the one the chain of waits ends at)."""
    store = Store()
    monkeypatch.setattr(exchange, "client", lambda: store)
    assert exchange.first_failure() is None
    store.key_value_set(
        "mpmdc/failed/2",
        json.dumps({"message": "process 2 stopped waiting: process 0 is stuck.", "culprit": 0}),
    )
    store.key_value_set(
        "mpmdc/failed/3", json.dumps({"message": "process 3 raised ValueError", "culprit": None})
    )
    assert exchange.first_failure() == (
        "process 2, blaming process 0, failed: process 2 stopped waiting: process 0 is stuck."
    )
    store.key_value_delete("mpmdc/failed/2")
    assert exchange.first_failure() == "process 3 failed: process 3 raised ValueError"


class _BrokenTransfer:
    """A received array whose sender broke the connection."""

    def is_ready(self):
        return True

    def block_until_ready(self):
        raise RuntimeError("recv() failed: Transport endpoint is not connected")


def waiting_on_process_1(monkeypatch, store, result) -> peers.Progress:
    """Process 0's ``Progress`` (with the runtime's ``announced_fault``) waiting for
    ``result`` of a transfer from process 1, the processes sharing ``store``."""
    monkeypatch.setattr(exchange, "client", lambda: store)
    monkeypatch.setattr(peers.jax, "process_index", lambda: 0)
    step = SimpleNamespace(name="transfer mesh1->mesh0", mesh=0, senders=(1,), action=None)
    progress = peers.Progress(engine.announced_fault)
    progress.in_flight.append(peers._InFlight(step, [result]))
    return progress


def broken_transfer(monkeypatch, store, grace=0.2):
    """``Progress.settle`` on a transfer from process 1 to process 0 whose connection
    broke; returns what it raised."""
    monkeypatch.setattr(peers, "_ANNOUNCEMENT_GRACE", grace)
    progress = waiting_on_process_1(monkeypatch, store, _BrokenTransfer())
    with pytest.raises(MpmdRuntimeError) as raised:
        progress.settle()
    assert json.loads(store.values["mpmdc/lost/0"]) == [1]  # (reported before the wait)
    return str(raised.value), json.loads(store.values["mpmdc/failed/0"])


def test_a_broken_transfer_names_the_failure_its_sender_announces_a_moment_later(monkeypatch):
    """A sender whose own fragment failed breaks its connections a moment before it
    announces why: the receiver waits for that news and names it (the sender blaming
    the process that died), not the sender as dead."""
    store, looks = Store(), []

    def dir_get(prefix):
        looks.append(prefix)
        if len(looks) == 6:  # the sender's announcement lands after a few looks
            store.values["mpmdc/failed/1"] = json.dumps(
                {"message": "process 1: transfer failed; process 2 died", "culprit": 2}
            )
        return Store.key_value_dir_get(store, prefix)

    store.key_value_dir_get = dir_get
    message, _ = broken_transfer(monkeypatch, store, grace=2.0)
    assert message == (
        "process 0 stopped waiting for transfer mesh1->mesh0 on mesh0 (sent by process 1): "
        "process 1, blaming process 2, failed: process 1: transfer failed; process 2 died."
    )


def test_a_broken_transfer_whose_sender_announces_nothing_blames_the_sender(monkeypatch):
    """A sender that died announces nothing: after the grace the receiver blames it."""
    message, announced = broken_transfer(monkeypatch, Store())
    assert "sent by process 1, failed while running: " in message
    assert "The connection to the sender broke: that process has probably died" in message
    assert announced["culprit"] == 1


def test_a_broken_transfer_whose_sender_lost_its_own_names_where_the_losses_began(monkeypatch):
    """Process 2 died: process 1 lost its transfer from it, and process 0 its transfer
    from process 1 at the same moment (the data sent was a failed computation's), before
    process 1 could say why. Process 0 names process 2, not process 1, which is alive."""
    store = Store()
    store.values["mpmdc/lost/1"] = json.dumps([2])
    message, announced = broken_transfer(monkeypatch, store)
    assert (
        "The transfer failed in process 1, which lost its transfer from process 2 first: "
        "process 2 has probably died" in message
    )
    assert announced["culprit"] == 2
    assert announced["blame"] == "process 1 lost its transfer from it"


def test_lost_transfers_in_a_circle_end_before_they_come_back():
    """Reports that point back (each process lost its transfer from the next) end at the
    last process not seen yet, and never at the process asking."""
    store = Store()
    for process, sender in [(1, 2), (2, 3), (3, 1)]:
        store.values[f"mpmdc/lost/{process}"] = json.dumps([sender])
    store.values["mpmdc/lost/0"] = json.dumps([1])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exchange, "client", lambda: store)
        patch.setattr(exchange.jax, "process_index", lambda: 0)
        assert exchange.lost_transfers(1) == (1, 2, 3)
        store.values["mpmdc/lost/3"] = json.dumps([0])
        assert exchange.lost_transfers(1) == (1, 2, 3)


class _Pending:
    """A transfer's result that never arrives."""

    def is_ready(self):
        return False


def test_a_wait_stopped_by_a_peers_announcement_names_what_it_waited_for(monkeypatch):
    """While results are in flight, a failure another process announced ends the wait,
    naming the step waited for (before the steps in flight are dropped)."""
    store = Store()
    store.values["mpmdc/failed/1"] = json.dumps(
        {"message": "process 1: s1_fwd failed on purpose", "culprit": None}
    )
    progress = waiting_on_process_1(monkeypatch, store, _Pending())
    with pytest.raises(MpmdRuntimeError) as raised:
        progress.wait()
    assert str(raised.value) == (
        "process 0 stopped waiting for transfer mesh1->mesh0 on mesh0 (sent by process 1): "
        "process 1 failed: process 1: s1_fwd failed on purpose."
    )
    assert not progress.in_flight
