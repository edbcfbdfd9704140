"""What the processes of a run tell each other, through ``jax.distributed``'s key-value
store: failures a process announces before it raises (:func:`announce_failure`) and the
transfers it lost before that (:func:`report_lost_transfer`), waits that name the
process they are stuck on (:func:`gave_up`), meetings (:func:`barrier`,
:func:`rendezvous`), checks that all processes hold the same thing
(:func:`check_agreement`), values brought to every process (:func:`fetch`) and merged
timelines.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time

import jax
import numpy as np

from mpmdc import _jax_compat as compat
from mpmdc import watchdog
from mpmdc.distributed.settings import ENV_FAILURE_DIR, fault_timeout_seconds
from mpmdc.errors import DistributedError, MpmdRuntimeError, ProgramMismatchError
from mpmdc.ir.keys import is_key

PREFIX = "mpmdc/"
_failed = False  # this process announced a failure: it leaves without waiting for the others


def has_failed() -> bool:
    """Whether this process announced a failure of the run (:func:`announce_failure`)."""
    return _failed


def client():
    """The ``jax.distributed`` client whose key-value store the processes share."""
    kv = compat.distributed_client()
    if kv is None:
        raise DistributedError(
            "jax.distributed is not running; call mpmdc.distributed.initialize() first."
        )
    return kv


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
        client().key_value_set(f"{PREFIX}failed/{jax.process_index()}", json.dumps(record))
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


def report_lost_transfer(senders) -> None:
    """Tell the other processes that a transfer this process waited for from ``senders``
    failed (its connection broke, or the data sent was a failed computation's): a
    process waiting on this one then names what this one lost (:func:`lost_transfers`),
    not this one, which is alive and about to say so."""
    try:
        client().key_value_set(
            f"{PREFIX}lost/{jax.process_index()}", json.dumps(list(senders)), allow_overwrite=True
        )
    except Exception:  # the store itself may be gone: the direct sender is then named
        pass


def lost_transfers(sender: int) -> tuple[int, ...]:
    """The chain of processes from ``sender``, whose transfer to this process failed,
    along the transfers each of them reported lost (:func:`report_lost_transfer`) to
    one that reported none: ``(1, 2)`` where process 1 lost its transfer from process
    2. The last is where the failure began: it has probably died."""
    try:
        lost = {
            int(key.rsplit("/", 1)[1]): json.loads(value)
            for key, value in client().key_value_dir_get(f"{PREFIX}lost/")
        }
    except Exception:
        lost = {}
    chain = [sender]
    while (
        (nearer := lost.get(chain[-1]))
        and nearer[0] not in chain
        and nearer[0] != jax.process_index()
    ):
        chain.append(nearer[0])
    return tuple(chain)


def announced() -> dict[int, tuple[str, int | None]]:
    """The run failures processes announced: ``{process: (message, process it blames)}``."""
    try:
        entries = client().key_value_dir_get(f"{PREFIX}failed/")
    except Exception:
        return {}
    found = {}
    for key, value in entries:
        record = json.loads(value)
        found[int(key.rsplit("/", 1)[1])] = (record["message"], record["culprit"])
    return found


def peer_failures(exchange: str = "", runs: dict | None = None) -> dict[int, str]:
    """``{process: message}`` of the processes that announced a failure (of the whole run,
    or with ``exchange`` also of that one exchange: :func:`announce_exchange_failure`);
    ``runs``: what :func:`announced` returned, where the caller read it already."""
    runs = announced() if runs is None else runs
    found = {process: message for process, (message, _) in runs.items()}
    if exchange:
        try:
            entries = client().key_value_dir_get(f"{PREFIX}{exchange}/failed/")
        except Exception:
            entries = []
        found.update({int(key.rsplit("/", 1)[1]): message for key, message in entries})
    return found


def announce_exchange_failure(exchange: str, message: str) -> None:
    """Tell the processes meeting in ``exchange`` (:func:`rendezvous`) that this one failed
    there, and why, without failing the run: they raise, naming it, and the run may go on
    (a save that failed on a full disk need not end training)."""
    try:
        client().key_value_set(
            f"{PREFIX}{exchange}/failed/{jax.process_index()}", message, allow_overwrite=True
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
    found = watchdog.stuck(client(), here, peers) if peers else watchdog.Stuck(here, (), what)
    message = f"process {here} stopped waiting for {what}: {found.reason(seconds)}.{hint}"
    if found.process is None:
        announce_failure(message)
    else:
        announce_failure(message, culprit=found.process, blame=found.blame(seconds, here, what))
    return MpmdRuntimeError(message)


def first_failure(exchange: str = "") -> str | None:
    """The process of lowest index among those that announced a failure (of the run, or
    of ``exchange``) and why, for a waiter's error: ``"process 2, blaming process 0,
    failed: ..."`` where it failed for want of another; ``None`` if none did."""
    runs = announced()
    failed = peer_failures(exchange, runs)
    if not failed:
        return None
    here, first = jax.process_index(), min(failed)
    who = "this process" if first == here else f"process {first}"
    culprit = runs.get(first, (None, None))[1]
    if culprit is not None and culprit != first:
        who += f", blaming process {culprit},"
    return f"{who} failed: {failed[first]}"


def _failed_peer(what: str, exchange: str = "") -> MpmdRuntimeError | None:
    """The error of this process's wait for ``what`` when a process announced a failure
    (:func:`first_failure`); ``None`` if none did."""
    failure = first_failure(exchange)
    if failure is None:
        return None
    return MpmdRuntimeError(f"process {jax.process_index()} stopped waiting for {what}: {failure}")


def _wait_for(key: str, peer: int, what: str, *, patient: bool = False, exchange: str = "") -> str:
    """The value of ``key``, which process ``peer`` sets on reaching ``what``; raises
    ``MpmdRuntimeError`` once a process announces a failure (see :func:`peer_failures`
    for ``exchange``), or after the fault timeout with nothing from ``peer``
    (:func:`gave_up`). A ``patient`` wait goes on as long as ``peer`` works on
    ``exchange`` (:func:`mpmdc.watchdog.working_on`): work that may take long, such as
    writing a large checkpoint, is not a hang, but a peer that has not begun it is."""
    kv = client()
    timeout = fault_timeout_seconds()
    last_progress = time.monotonic()
    beat = None
    what = f"process {peer} to reach {what}"
    with watchdog.waiting_for(what, (peer,)):
        while True:
            try:
                return kv.blocking_key_value_get(key, 250)
            except Exception:
                failure = _failed_peer(what, exchange)
                if failure is not None:
                    raise failure from None
                now = time.monotonic()
                if patient:
                    seen = watchdog.beating(kv, exchange, peer)
                    if seen != beat:
                        beat, last_progress = seen, now
                if now - last_progress > timeout:
                    raise gave_up(what, (peer,), timeout) from None


def offer_agreement(topic: str, entries: list[tuple[str, str]]) -> None:
    """Publish this process's ``entries`` for :func:`check_agreement` on ``topic``, without
    waiting for anyone (so the peers' checks can go on before this process comes to its)."""
    client().key_value_set(
        f"{PREFIX}agree/{topic}/{jax.process_index()}", json.dumps(entries), allow_overwrite=True
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
            _wait_for(f"{PREFIX}agree/{topic}/{peer}", peer, f"{what} ({topic})", exchange=exchange)
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
            f"the same code (or load the same exported bytes) with arguments of the same types and "
            f"the same mpmdc and JAX versions."
        )


@compat.api_boundary
def fetch(tree):
    """The values of a pytree of arrays as numpy arrays, on every process.

    In one process this is ``jax.device_get``. With several, an output of a compiled
    step is addressable only on its mesh's processes; this brings it to all of them
    (for logging a loss, for checks). Every process must call it with a tree of the
    same structure, in the same order, like a collective. Values go through the
    ``jax.distributed`` key-value store: meant for losses and metrics, not for
    gigabytes of parameters. Typed PRNG keys come back as their key data (``uint32``,
    as ``jax.random.key_data`` gives it): numpy has no key type.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [jax.random.key_data(x) if is_key(x) else x for _, x in flat]
    if jax.process_count() == 1 or not any(isinstance(x, jax.Array) for x in leaves):
        return jax.tree_util.tree_unflatten(
            treedef, [np.asarray(jax.device_get(x)) for x in leaves]
        )
    kv = client()
    # Named by the leaves' paths and types: a treedef's text can hold addresses of
    # functions (``Partial``, modules' fields), different in every process.
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    about = topic("fetch", repr(paths) + repr([jax.typeof(x) for x in leaves]))
    prefix = f"{PREFIX}{about}"
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
                kv.key_value_set_bytes(
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
                    data = kv.blocking_key_value_get_bytes(f"{prefix}/{k}/{text}", timeout_ms)
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
            kv.key_value_delete(key)
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
            client().wait_at_barrier(f"{PREFIX}{topic}", int(fault_timeout_seconds() * 1000))
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
    kv = client()
    here = jax.process_index()
    kv.key_value_set(f"{PREFIX}meet/{topic}/{here}", value)
    values = {here: value}
    for peer in range(jax.process_count()):
        if peer != here:
            key = f"{PREFIX}meet/{topic}/{peer}"
            values[peer] = _wait_for(key, peer, what, patient=patient, exchange=exchange)
    return values


def forget(topic: str) -> None:
    """Delete this process's keys of a :func:`rendezvous` on ``topic`` and of a
    :func:`check_agreement` on it, once every process is past them (the key-value store
    keeps what is not deleted for the whole run)."""
    kv = client()
    here = jax.process_index()
    for key in (f"{PREFIX}meet/{topic}/{here}", f"{PREFIX}agree/{topic}/{here}"):
        try:
            kv.key_value_delete(key)
        except Exception:  # nothing there: nothing to forget
            pass


def merge_timelines(topic: str, timeline):
    """Every process's measured ``timeline`` merged into one, on every process: each
    mesh's row from the first process that measured it."""
    from mpmdc.schedules import Action, Slot, Timeline

    kv = client()
    rows = [
        [[str(s.action) if s.action is not None else None, s.start, s.end, s.name] for s in row]
        for row in timeline.meshes
    ]
    kv.key_value_set(f"{PREFIX}timeline/{topic}/{jax.process_index()}", json.dumps(rows))
    merged = [[] for _ in rows]
    timeout_ms = int(fault_timeout_seconds() * 1000)
    for peer in range(jax.process_count()):
        what = f"process {peer}'s timeline of {topic}"
        try:
            with watchdog.waiting_for(what, (peer,)):
                text = kv.blocking_key_value_get(f"{PREFIX}timeline/{topic}/{peer}", timeout_ms)
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
