"""What a checkpoint guarantees when writers race and files are damaged or hostile.

- A save that returns normally committed exactly what it wrote: of saves racing to one
  directory (threads, separate processes) exactly one commits; the others raise.
- A save's partial folder is its own: nothing else, no other save or manager, removes it.
- A restore checks everything it reads: the index and every array's metadata (against
  each other and the target), a checksum per chunk, which the index records too (a chunk
  put in another's place is found), every array inside the checkpoint;
  damaged or hostile files are ``CheckpointError``s naming the file, never a crash, a raw
  Python error or wrong values.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from unittest.mock import patch

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpmdc.checkpoint import CheckpointManager, layout, restore, save, storage
from mpmdc.checkpoint.saving import Save
from mpmdc.errors import CheckpointError

TRIALS = 40


def entries(folder) -> list[str]:
    """What ``folder`` holds, but the lock that commits into it take."""
    return sorted(set(os.listdir(folder)) - {storage.LOCK_FILE})


def tree_of(value: float) -> dict:
    return {"w": jnp.full((64, 64), value), "b": jnp.full((8,), value)}


def value_of(directory) -> float:
    """The value a :func:`tree_of` checkpoint holds (every element the same)."""
    restored = restore(directory)
    values = {float(v) for leaf in restored.values() for v in np.unique(leaf)}
    assert len(values) == 1, values
    return values.pop()


def race(directory, overwrite: bool) -> dict[int, str]:
    """Two threads save trees of different values to ``directory`` at once: what each
    call did (``"ok"`` or the error's text), by value."""
    outcome = {}
    start = threading.Barrier(2)

    def saving(value):
        tree = tree_of(value)
        start.wait()
        try:
            save(directory, tree, overwrite=overwrite)
            outcome[value] = "ok"
        except CheckpointError as err:
            outcome[value] = str(err)

    threads = [threading.Thread(target=saving, args=(v,)) for v in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcome


def test_of_two_threads_saving_to_one_new_directory_exactly_one_commits(tmp_path):
    for trial in range(TRIALS):
        directory = tmp_path / str(trial)
        outcome = race(directory, overwrite=False)
        done = [v for v, what in outcome.items() if what == "ok"]
        assert len(done) == 1, outcome
        assert value_of(directory) == done[0]  # the one that returned is what is there
        [refused] = [what for what in outcome.values() if what != "ok"]
        assert re.search("already at|another save committed", refused), refused
        assert entries(tmp_path) == sorted(str(t) for t in range(trial + 1))  # no partial left


def test_saves_overwriting_one_checkpoint_at_once_never_lose_a_returned_save(tmp_path):
    """With ``overwrite=True`` each save replaces only the checkpoint it found: of two
    saves that both found the first checkpoint, one commits and the other raises; a save
    that started after the other's commit replaces it knowingly."""
    for trial in range(TRIALS // 2):
        directory = tmp_path / str(trial)
        save(directory, tree_of(0))
        outcome = race(directory, overwrite=True)
        done = [v for v, what in outcome.items() if what == "ok"]
        assert done, outcome
        assert value_of(directory) in done
        for what in outcome.values():
            assert what == "ok" or "another save committed" in what, what


RACING_PROCESS = textwrap.dedent(
    """
    import fcntl, json, os, sys, time
    import jax.numpy as jnp
    from mpmdc.checkpoint import save
    from mpmdc.errors import CheckpointError

    folder, value, trials, lock = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if lock == "lock file":  # as on NFS, where folders cannot be locked
        def flock(fd, operation):
            raise OSError(9, "Bad file descriptor")
        fcntl.flock = flock
    outcome = {}
    for trial in range(trials):
        ready = os.path.join(folder, f"ready-{trial}-{value:g}")
        open(ready, "w").close()
        while len([n for n in os.listdir(folder) if n.startswith(f"ready-{trial}-")]) < 2:
            time.sleep(0.001)
        try:
            save(os.path.join(folder, "runs", str(trial)), {"w": jnp.full((64, 64), value)})
            outcome[trial] = "ok"
        except CheckpointError as err:
            outcome[trial] = str(err)
    print(json.dumps(outcome))
    """
)


@pytest.mark.parametrize("lock", ["folder lock", "lock file"])
@pytest.mark.slow
def test_of_two_processes_saving_to_one_new_directory_exactly_one_commits(tmp_path, lock):
    """Two jobs (separate processes, as a zombie job and its restart) race to the same
    checkpoints: in every trial exactly one save returns, and its values are there; with
    the folder locked, or a lock file beside the checkpoints where folders cannot be."""
    trials = TRIALS // 2
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", RACING_PROCESS, str(tmp_path), str(value), str(trials), lock],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for value in (1, 2)
    ]
    outcomes = {}
    for value, run in zip((1, 2), runs):
        out, err = run.communicate(timeout=240)
        assert run.returncode == 0, err.decode()[-3000:]
        outcomes[value] = json.loads(out.decode().strip().splitlines()[-1])
    for trial in range(trials):
        said = {value: outcomes[value][str(trial)] for value in (1, 2)}
        done = [value for value, what in said.items() if what == "ok"]
        assert len(done) == 1, said
        assert value_of(tmp_path / "runs" / str(trial)) == done[0]
    assert entries(tmp_path / "runs") == sorted(str(t) for t in range(trials))


def test_a_managers_commit_leaves_another_saves_partial_folder_alone(tmp_path):
    """Two managers on one folder (a job that did not die and its restart): one's commit
    and pruning remove nothing of the other's save in flight, which then commits whole."""
    first = Save(tmp_path / "1", tree_of(1))
    first._start()  # its partial folder is there, written into
    [partial] = entries(tmp_path)
    with CheckpointManager(tmp_path, max_to_keep=1) as other:
        other.save(2, tree_of(2))
        other.save(3, tree_of(3))
    assert partial in entries(tmp_path)
    first._finish()
    assert entries(tmp_path) == ["1", "3"]
    assert value_of(tmp_path / "1") == 1


def test_a_manager_asked_removes_the_partial_folders_of_killed_saves_as_it_starts(tmp_path):
    """A run restarted after its saves were killed (two partial folders of steps, one
    holding its commit marker) opens its manager with ``remove_partial=True``: those
    go, the complete steps and a partial folder of something else stay, and saving
    goes on. Without it, nothing is removed."""
    for step in (1, 2, 3):
        save(tmp_path / str(step), tree_of(step))
    os.rename(tmp_path / "2", tmp_path / "2.0123456789abcdef.partial")  # killed renaming
    os.makedirs(tmp_path / "3.fedcba9876543210.partial" / "w")  # killed writing
    os.makedirs(tmp_path / "notes.0123456789abcdef.partial")  # not a step's
    before = entries(tmp_path)
    CheckpointManager(tmp_path).close()
    assert entries(tmp_path) == before
    with CheckpointManager(tmp_path, remove_partial=True, asynchronous=False) as manager:
        assert entries(tmp_path) == ["1", "3", "notes.0123456789abcdef.partial"]
        manager.save(4, tree_of(4))
    assert value_of(tmp_path / "4") == 4


def test_a_removal_killed_midway_leaves_no_step_that_is_listed_but_fails(tmp_path):
    """A manager renames an old step out of its place before deleting anything: killed
    while deleting its files (here, after its first leaf), the step is gone from the
    listing, not listed with half its files; a restore of what is left says what it is,
    and the next pruning clears it."""
    manager = CheckpointManager(tmp_path, max_to_keep=1, asynchronous=False)
    manager.save(1, tree_of(1))
    deleting = storage.remove

    def killed(path):
        if str(path).endswith(layout.REMOVING_SUFFIX):
            shutil.rmtree(os.path.join(path, "w"))
            raise KeyboardInterrupt  # (the process dies here)
        deleting(path)

    with patch.object(storage, "remove", killed), pytest.raises(KeyboardInterrupt):
        manager.save(2, tree_of(2))
    [left] = [name for name in entries(tmp_path) if name.endswith(layout.REMOVING_SUFFIX)]
    restarted = CheckpointManager(tmp_path, max_to_keep=1, asynchronous=False)
    assert restarted.all_steps() == [2] and restarted.latest_step() == 2
    with pytest.raises(CheckpointError, match=r"is a folder a removal empties, not a checkpoint"):
        restore(tmp_path / left)
    restarted.save(3, tree_of(3))
    assert entries(tmp_path) == ["3"]
    assert value_of(tmp_path / "3") == 3


def test_a_step_removed_while_it_is_read_is_named_so_not_as_damage(tmp_path):
    """A reader whose checkpoint vanished whole under it (a manager's pruning renamed it)
    is told that, not that a file of a committed checkpoint was removed."""
    with pytest.raises(CheckpointError, match="its folder is gone, so the checkpoint was removed"):
        storage.read_json(str(tmp_path / "7" / "w" / "zarr.json"))
    os.makedirs(tmp_path / "7" / "w")
    with pytest.raises(CheckpointError, match="it is not there, so the checkpoint is damaged"):
        storage.read_json(str(tmp_path / "7" / "w" / "zarr.json"))


def test_a_finished_partial_folder_is_not_restored_by_its_path(tmp_path):
    """A save killed after its commit marker but before its rename leaves a partial
    folder holding a marker: restoring it by its path says it is a save's folder (the
    checkpoint is its directory, once a save finishes there), not what it holds."""
    save(tmp_path / "1", tree_of(1))
    os.rename(tmp_path / "1", tmp_path / "1.0123456789abcdef.partial")
    with pytest.raises(CheckpointError, match=r"is a folder a save writes, not a checkpoint"):
        restore(tmp_path / "1.0123456789abcdef.partial")


def test_a_manager_prunes_under_the_commit_lock(tmp_path):
    """Removing old steps waits for a commit into the folder in progress (another job's
    overwrite of that step), so neither is left half done."""
    manager = CheckpointManager(tmp_path, max_to_keep=1, asynchronous=False)
    manager.save(1, tree_of(1))
    save(tmp_path / "2", tree_of(2))
    held, release = threading.Event(), threading.Event()

    def committing():
        with storage.commit_lock(str(tmp_path)):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=committing)
    holder.start()
    held.wait(30)
    pruning = threading.Thread(target=manager._remove_old)
    pruning.start()
    pruning.join(0.3)
    assert pruning.is_alive() and entries(tmp_path) == ["1", "2"]
    release.set()
    holder.join()
    pruning.join(30)
    assert entries(tmp_path) == ["2"]
    manager.close()


def test_a_failed_save_removes_its_own_partial_folder_and_only_that(tmp_path):
    os.makedirs(tmp_path / "c.0123456789abcdef.partial")  # another save's, in flight
    saving = Save(tmp_path / "c", tree_of(1))
    saving.writes[0].shards[0] = (saving.writes[0].shards[0][0], np.zeros((3, 3)))  # wrong shape
    with pytest.raises(CheckpointError):
        saving.finish()
    assert entries(tmp_path) == ["c.0123456789abcdef.partial"]


# ----- damaged and hostile files -------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    directory = tmp_path / "c"
    save(directory, {"w": jnp.arange(24.0).reshape(4, 6), "k": jax.random.key(3)})
    return directory


def edit_json(path, change):
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def index_leaves(document) -> list[dict]:
    return document["attributes"]["mpmdc"]["leaves"]


def chunk_files(array_folder) -> list[str]:
    return sorted(
        os.path.join(d, f) for d, _, fs in os.walk(os.path.join(array_folder, "c")) for f in fs
    )


ARRAY_EDITS = {
    "data_type": (lambda a: a.update(data_type="int32"), 'it says data_type "int32"'),
    "transpose codec": (
        lambda a: a["codecs"].insert(0, {"name": "transpose", "configuration": {"order": [1, 0]}}),
        "it says codecs [",
    ),
    "no checksum": (lambda a: a["codecs"].pop(), "it says codecs ["),
    "big endian": (
        lambda a: a["codecs"][0].update(configuration={"endian": "big"}),
        "it says codecs [",
    ),
    "huge shape": (lambda a: a.update(shape=[10**13, 6]), "it says shape [10000000000000, 6]"),
    "chunk grid": (
        lambda a: a["chunk_grid"]["configuration"].update(chunk_shape=[2, 6]),
        "it says chunk_grid",
    ),
    "storage transformer": (
        lambda a: a.update(storage_transformers=[{"name": "sharding"}]),
        "storage_transformers",
    ),
    "shape text": (lambda a: a.update(shape="ab"), "shape"),
}


@pytest.mark.parametrize("case", list(ARRAY_EDITS))
def test_an_arrays_metadata_must_say_what_the_index_says(saved, case):
    change, says = ARRAY_EDITS[case]
    edit_json(saved / "w" / "zarr.json", change)
    for target in (None, {"w": jnp.zeros((4, 6)), "k": jax.random.key(0)}):
        with pytest.raises(CheckpointError, match=re.escape(str(saved / "w" / "zarr.json"))) as e:
            restore(saved, target)
        assert says in str(e.value)


def test_a_shape_beyond_memory_in_index_and_array_is_refused_before_anything_is_read(saved):
    """Index and array agreeing on a shape no machine holds: refused before any read
    (without a target, onto a bare sharding, which takes the index's shape, and spread
    over every device), never an allocation that aborts the process."""
    huge = [10**13, 6]  # in one chunk, as the index records one chunk's checksum
    edit_json(saved / "zarr.json", lambda d: index_leaves(d)[1].update(shape=huge, chunks=huge))
    edit_json(
        saved / "w" / "zarr.json",
        lambda a: (a.update(shape=huge), a["chunk_grid"]["configuration"].update(chunk_shape=huge)),
    )
    mesh = jax.make_mesh((8,), ("x",))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    says = r"would read .* bytes into this process \(the largest: leaf \['w'\], float32\[1000"
    for w in (None, one, NamedSharding(mesh, P("x"))):
        with pytest.raises(CheckpointError, match=says):
            restore(saved, None if w is None else {"w": w, "k": jax.random.key(0)})


def test_a_chunk_changed_in_place_fails_its_checksum_naming_leaf_and_chunk(saved):
    [chunk] = chunk_files(saved / "w")
    data = bytearray(open(chunk, "rb").read())
    data[8] ^= 0x40  # one bit of one float; the file keeps its size
    open(chunk, "wb").write(bytes(data))
    with pytest.raises(
        CheckpointError,
        match=r"damaged: leaf \['w'\], chunk w/c/0/0 does not match its checksum",
    ):
        restore(saved, {"w": jnp.zeros((4, 6)), "k": jax.random.key(0)})


@pytest.mark.parametrize("name", ["zarr.json", "w/zarr.json"])
def test_a_file_removed_after_the_save_committed_says_the_checkpoint_is_damaged(saved, name):
    os.remove(saved / name)
    with pytest.raises(
        CheckpointError,
        match=rf"cannot read .*{name}: it is not there, so the checkpoint is damaged .* "
        r"Restore another checkpoint",
    ):
        restore(saved)


def test_a_truncated_chunk_is_an_error(saved):
    [chunk] = chunk_files(saved / "w")
    os.truncate(chunk, 10)
    with pytest.raises(CheckpointError, match=r"leaf \['w'\], chunk w/c/0/0"):
        restore(saved)


def test_an_array_outside_the_checkpoint_is_refused(tmp_path, saved):
    save(tmp_path / "other", {"w": jnp.ones((4, 6)), "k": jax.random.key(0)})
    for name in (str(tmp_path / "other" / "w"), "../other/w", "w/../../other/w", "w//x"):
        edit_json(saved / "zarr.json", lambda d, name=name: index_leaves(d)[1].update(array=name))
        with pytest.raises(CheckpointError, match="is not a relative path inside the checkpoint"):
            restore(saved)
    edit_json(saved / "zarr.json", lambda d: index_leaves(d)[1].update(array="w"))
    restore(saved)
    os.rename(saved / "w", saved / "w.real")
    os.symlink(tmp_path / "other" / "w", saved / "w")  # a link inside, pointing out
    with pytest.raises(CheckpointError, match=r"damaged: leaf \['w'\]: w is a link to .*other/w"):
        restore(saved)


def replace_with(path, make) -> None:
    """Put what ``make(path)`` creates where file ``path`` is."""
    os.remove(path)
    make(path)


FILE_SWAPS = {
    "a chunk that links out": (
        lambda saved: replace_with(
            chunk_files(saved / "w")[0], lambda p: os.symlink("/dev/zero", p)
        ),
        r"leaf \['w'\]: w/c/0/0 is a link",
    ),
    "a chunk folder that links out": (
        lambda saved: (
            shutil.rmtree(saved / "w" / "c"),
            os.symlink(saved.parent / "other" / "w" / "c", saved / "w" / "c"),
        ),
        r"leaf \['w'\]: w/c is a link",
    ),
    "a chunk that is a pipe": (
        lambda saved: replace_with(chunk_files(saved / "w")[0], os.mkfifo),
        r"leaf \['w'\]: w/c/0/0 is a pipe",
    ),
    "an array's metadata that links out": (
        lambda saved: replace_with(
            saved / "w" / "zarr.json",
            lambda p: os.symlink(saved.parent / "other" / "w" / "zarr.json", p),
        ),
        r"c/w/zarr.json is a link",
    ),
    "an index that is a pipe": (
        lambda saved: replace_with(saved / "zarr.json", os.mkfifo),
        r"c/zarr.json is not a regular file",
    ),
    "a marker that links to a device": (
        lambda saved: replace_with(saved / "COMMITTED", lambda p: os.symlink("/dev/zero", p)),
        r"c/COMMITTED is a link",
    ),
    "a chunk that grew": (
        lambda saved: open(chunk_files(saved / "w")[0], "ab").write(b"\0" * 8),
        r"chunk w/c/0/0 holds 108 bytes, not the 100 of its chunk",
    ),
    "a file beside the chunks": (
        lambda saved: (saved / "w" / "notes.txt").write_text("hi"),
        r"leaf \['w'\]: w/notes.txt is no part of a Zarr array; a save writes only zarr.json "
        r"and the chunks of its grid \[1, 1\] there",
    ),
    "a file among the chunks": (
        lambda saved: (saved / "w" / "c" / "notes.txt").write_text("hi"),
        r"leaf \['w'\]: w/c/notes.txt is no chunk of this array",
    ),
    "a chunk outside the grid": (
        lambda saved: shutil.copy(chunk_files(saved / "w")[0], saved / "w" / "c" / "0" / "2"),
        r"leaf \['w'\]: w/c/0/2 is no chunk of this array; a save writes only zarr.json and the "
        r"chunks of its grid \[1, 1\] there",
    ),
}


@pytest.mark.parametrize("case", list(FILE_SWAPS))
def test_links_pipes_and_files_of_the_wrong_size_are_refused_before_they_are_read(
    tmp_path, saved, case
):
    """Nothing inside a checkpoint is a link, a pipe or a device, and every chunk has its
    size: anything else is refused before a read could leave the checkpoint, wait on a
    pipe or run on without end."""
    save(tmp_path / "other", {"w": jnp.ones((4, 6)), "k": jax.random.key(0)})
    change, says = FILE_SWAPS[case]
    change(saved)
    for target in (None, {"w": jnp.zeros((4, 6)), "k": jax.random.key(0)}):
        with pytest.raises(CheckpointError, match=says):
            restore(saved, target)


ROOT_EDITS = {
    "not utf-8": (b"\xff\xfe{}", "it is not JSON text"),
    "not json": (b"{", "it is not JSON text"),
    "a list": (b"[1, 2]", "it holds a list, not a JSON object"),
    "no leaves": (
        lambda d: d["attributes"]["mpmdc"].pop("leaves"),
        "Field required at leaves",
    ),
    "leaves empty": (
        lambda d: d["attributes"]["mpmdc"].update(leaves=[]),
        "its index lists no leaves",
    ),
    "leaves a number": (
        lambda d: d["attributes"]["mpmdc"].update(leaves=5),
        "Input should be a valid list at leaves",
    ),
    "leaf a list": (lambda d: index_leaves(d).__setitem__(0, [1]), "at leaves.0"),
    "shape text": (lambda d: index_leaves(d)[1].update(shape="ab"), "at leaves.1.shape"),
    "shape negative": (lambda d: index_leaves(d)[1].update(shape=[-4, 6]), "negative length"),
    "shape floats": (lambda d: index_leaves(d)[1].update(shape=[4.0, 6]), "at leaves.1.shape.0"),
    "dtype": (
        lambda d: index_leaves(d)[1].update(dtype="not_a_dtype"),
        "dtype 'not_a_dtype' is not one JAX knows",
    ),
    "object dtype": (lambda d: index_leaves(d)[1].update(dtype="object"), "which no checkpoint"),
    "key impl": (
        lambda d: index_leaves(d)[0].update(key_impl="nope"),
        "PRNG implementation 'nope' is not one JAX knows",
    ),
    "chunks": (lambda d: index_leaves(d)[1].update(chunks=[0, 6]), "chunk shape"),
    "no chunks": (lambda d: index_leaves(d)[1].pop("chunks"), "no chunk shape"),
    "twice": (
        lambda d: index_leaves(d)[0].update(path=index_leaves(d)[1]["path"]),
        "lists the leaf path",
    ),
    "version": (
        lambda d: d["attributes"]["mpmdc"].update(version=99),
        "format version 99; this mpmdc reads versions 1, 2, 3",
    ),
    "no checksums": (lambda d: index_leaves(d)[1].pop("checksums"), "it has no chunk checksums"),
    "checksums cut short": (
        lambda d: index_leaves(d)[1].update(checksums=index_leaves(d)[1]["checksums"][:6]),
        "its chunk checksums are 6 hex digits, not the 8 of the 1 chunks of its grid",
    ),
    "checksums not hex": (
        lambda d: index_leaves(d)[1].update(checksums="checksum"),
        "String should match pattern",
    ),
    "checksums in version 2": (
        lambda d: d["attributes"]["mpmdc"].update(version=2),
        "it has chunk checksums, which format version 2 does not record",
    ),
    "not ours": (lambda d: d["attributes"].pop("mpmdc"), "Field required at attributes.mpmdc"),
    "nested deep": (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nested deeper"),
    "shape not a number": (b'{"a": NaN}', "at zarr_format"),
    "shape beyond any index": (
        lambda d: index_leaves(d)[1].update(shape=[2**62, 6]),
        "less than 4611686018427387904 at leaves.1.shape.0",
    ),
    "an extra field": (lambda d: index_leaves(d)[1].update(offset=8), "leaves.1.offset"),
    "a nul in a name": (
        lambda d: index_leaves(d)[1].update(array="w\0x"),
        "is not a relative path inside the checkpoint",
    ),
    "a space in a name": (
        lambda d: index_leaves(d)[1].update(array="w x"),
        "is not a relative path inside the checkpoint",
    ),
    "a name too long": (
        lambda d: index_leaves(d)[1].update(array="w" * 300),
        "is not a relative path inside the checkpoint",
    ),
    "a dtype spelled otherwise": (
        lambda d: index_leaves(d)[1].update(dtype="<f4"),
        "its dtype '<f4' is not spelled as a save writes it (float32)",
    ),
    "a group no more": (lambda d: d.update(node_type="array"), "at node_type"),
}


@pytest.mark.parametrize("case", list(ROOT_EDITS))
def test_a_damaged_or_hostile_index_is_an_error_naming_the_file(saved, case):
    change, says = ROOT_EDITS[case]
    if isinstance(change, bytes):
        (saved / "zarr.json").write_bytes(change)
    else:
        edit_json(saved / "zarr.json", change)
    with pytest.raises(CheckpointError, match=re.escape(str(saved / "zarr.json"))) as e:
        restore(saved, {"w": jnp.zeros((4, 6)), "k": jax.random.key(0)})
    assert says in str(e.value)


def test_an_index_that_is_a_folder_or_a_marker_that_is_damaged_is_an_error(saved):
    os.rename(saved / "zarr.json", saved / "moved")
    os.mkdir(saved / "zarr.json")
    with pytest.raises(CheckpointError, match=r"cannot read .*c/zarr.json: it is a folder"):
        restore(saved)
    os.rmdir(saved / "zarr.json")
    os.rename(saved / "moved", saved / "zarr.json")
    (saved / "COMMITTED").write_bytes(b"\x00\x01")
    with pytest.raises(CheckpointError, match=r"c/COMMITTED is damaged .* not JSON text"):
        restore(saved)


UNPRIVILEGED = textwrap.dedent(
    """
    import ctypes, os, sys
    if os.geteuid() == 0:  # root: drop the rights to read past permissions (Linux)
        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Sets(ctypes.Structure):
            _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]
        libc = ctypes.CDLL(None, use_errno=True)
        header, sets = Header(0x20080522, 0), (Sets * 2)()
        assert libc.capget(ctypes.byref(header), sets) == 0
        sets[0].effective &= ~(1 << 1 | 1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        assert libc.capset(ctypes.byref(header), sets) == 0
    from mpmdc.checkpoint import restore
    from mpmdc.errors import CheckpointError
    try:
        restore(sys.argv[1])
    except CheckpointError as err:
        print(err)
    """
)


def as_unprivileged(directory) -> str:
    """What restoring ``directory`` says to a process that permissions apply to."""
    done = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED, str(directory)], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout.decode()


@pytest.mark.slow
def test_files_this_process_may_not_read_say_permission_denied(tmp_path):
    save(tmp_path / "c", tree_of(1))
    os.chmod(tmp_path / "c" / "zarr.json", 0o000)
    said = as_unprivileged(tmp_path / "c")
    assert re.search(r"cannot read .*c/zarr.json: permission denied", said), said
    os.chmod(tmp_path / "c" / "zarr.json", 0o644)
    os.chmod(tmp_path / "c", 0o000)
    said = as_unprivileged(tmp_path / "c")
    assert re.search(r"cannot read .*c: permission denied", said), said
    os.chmod(tmp_path / "c", 0o755)


def test_a_chunk_this_process_may_not_read_says_permission_denied(tmp_path):
    save(tmp_path / "c", tree_of(1))
    [chunk] = chunk_files(tmp_path / "c" / "b")
    os.chmod(chunk, 0o000)
    said = as_unprivileged(tmp_path / "c")
    assert re.search(r"cannot read .*: leaf \['b'\], chunk b/c/0: permission denied", said), said


def test_a_name_too_long_for_the_partial_folder_is_refused_before_anything_is_written(tmp_path):
    name = "n" * 250  # a file name may have 255 bytes; the partial folder's has 25 more
    with pytest.raises(CheckpointError, match="use a name of at most 230 bytes"):
        save(tmp_path / name, tree_of(1))
    assert os.listdir(tmp_path) == []
    save(tmp_path / name[:230], tree_of(1), overwrite=True)
    save(tmp_path / name[:230], tree_of(2), overwrite=True)
    assert value_of(tmp_path / name[:230]) == 2


def test_a_target_sharding_of_another_rank_says_it_does_not_fit(saved):
    mesh = jax.make_mesh((2,), ("x",))
    for spec in (P(None, None, "x"), P("x", None, None)):
        with pytest.raises(CheckpointError, match=r"target leaf \['w'\] .* does not fit") as e:
            restore(saved, {"w": NamedSharding(mesh, spec), "k": jax.random.key(0)})
        assert "damaged" not in str(e.value)


def test_a_chunk_put_in_another_chunks_place_is_named(tmp_path):
    """A chunk ends in a checksum of its own bytes, which a chunk swapped with another of
    the same size, or copied from the same leaf of another step, passes: the index
    records every chunk's checksum, and a restore names the chunk that is not its own."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("x"))

    def tree(step: int) -> dict:
        return {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4) + step, rows)}

    save(tmp_path / "1", tree(1))
    save(tmp_path / "2", tree(2))
    chunks = tmp_path / "2" / "w" / "c"
    first, second = chunks / "1" / "0", chunks / "2" / "0"

    def swap() -> None:
        os.rename(first, tmp_path / "aside")
        os.rename(second, first)
        os.rename(tmp_path / "aside", second)

    swap()
    for target in (None, {"w": rows}):
        with pytest.raises(
            CheckpointError, match=r"leaf \['w'\], chunk w/c/1/0 is not the chunk saved there"
        ):
            restore(tmp_path / "2", target)
    swap()
    np.testing.assert_array_equal(restore(tmp_path / "2", {"w": rows})["w"], tree(2)["w"])
    shutil.copy(tmp_path / "1" / "w" / "c" / "3" / "0", chunks / "3" / "0")
    with pytest.raises(
        CheckpointError, match=r"leaf \['w'\], chunk w/c/3/0 is not the chunk saved there"
    ):
        restore(tmp_path / "2", {"w": rows})


def test_a_checkpoint_of_the_second_format_version_reads_without_the_indexs_checksums(saved):
    """Version 2 recorded no chunk checksums in the index: made so here, it restores the
    same values."""
    want = restore(saved)

    def version_two(document):
        document["attributes"]["mpmdc"]["version"] = 2
        for leaf in index_leaves(document):
            leaf.pop("checksums")

    edit_json(saved / "zarr.json", version_two)
    got = restore(saved)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path])


def test_a_checkpoint_of_the_first_format_version_reads_without_checksums(saved):
    """Version 1 recorded no chunk shapes and wrote no checksums: made so here from a
    checkpoint of today's version, it restores the same values."""
    want = restore(saved)
    for folder in ("w", "k"):
        edit_json(saved / folder / "zarr.json", lambda a: a["codecs"].pop())
        for chunk in chunk_files(saved / folder):
            os.truncate(chunk, os.path.getsize(chunk) - 4)  # the CRC32C at each chunk's end

    def version_one(document):
        document["attributes"]["mpmdc"]["version"] = 1
        for leaf in index_leaves(document):
            leaf.pop("chunks")
            leaf.pop("checksums")

    edit_json(saved / "zarr.json", version_one)
    got = restore(saved)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path])


# ----- links and a manager's folder --------------------------------------------------


def test_saving_through_a_link_writes_where_it_points_and_keeps_the_link(tmp_path):
    os.makedirs(tmp_path / "real")
    os.symlink(tmp_path / "real" / "c", tmp_path / "c")
    for value in (1, 2, 3):
        save(tmp_path / "c", tree_of(value), overwrite=True)
        assert os.path.islink(tmp_path / "c")
        assert value_of(tmp_path / "c") == value
    assert entries(tmp_path / "real") == ["c"]


def test_a_link_planted_at_a_partial_name_is_never_written_through(tmp_path):
    os.makedirs(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "c.partial")
    save(tmp_path / "c", tree_of(1))
    assert os.listdir(tmp_path / "elsewhere") == []
    assert value_of(tmp_path / "c") == 1


def test_a_manager_reads_steps_by_their_exact_names_and_prunes_links_not_targets(tmp_path):
    run = tmp_path / "run"
    for name in ("²", "007", "-1", "1e3", "٣"):  # folders that are no step's
        os.makedirs(run / name)
    os.makedirs(tmp_path / "kept")
    save(tmp_path / "kept" / "5", tree_of(5))
    os.symlink(tmp_path / "kept" / "5", run / "5")  # a step that is a link
    manager = CheckpointManager(run, max_to_keep=2)
    assert manager.all_steps() == [5]
    for step in (6, 7):
        manager.save(step, tree_of(step))
    manager.close()
    assert manager.all_steps() == [6, 7]
    assert not os.path.lexists(run / "5")  # the link went,
    assert value_of(tmp_path / "kept" / "5") == 5  # what it pointed to stayed
    assert entries(run) == sorted(["-1", "007", "1e3", "²", "٣", "6", "7"])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 64), min_size=1, max_size=3).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            st.tuples(*[st.sampled_from([k for k in (1, 2, 4, 8) if n % k == 0]) for n in shape]),
            st.sampled_from([1, 2, 4, 8]),
            st.sampled_from([64, 1000, 4096, 2**20]),
        )
    )
)
def test_chunks_are_whole_in_every_shard_and_no_larger_than_the_shards_allow(case):
    """Chunks tile every shard of an even split and hold at most ``CHUNK_BYTES``, cut from
    the leading dimensions: a dimension is cut only where those after it are whole."""
    shape, parts, itemsize, limit = case
    blocks = [n // k for n, k in zip(shape, parts)]
    indices = [
        tuple(slice(i * b, (i + 1) * b) for i, b in zip(position, blocks))
        for position in np.ndindex(*parts)
    ]
    with patch.object(layout, "CHUNK_BYTES", limit):
        chunks = layout.chunk_shape(shape, indices, itemsize)
    assert all(b % c == 0 for b, c in zip(blocks, chunks))  # every shard is whole chunks
    assert math.prod(chunks) * itemsize <= limit
    cut = [d for d, (b, c) in enumerate(zip(blocks, chunks)) if c < b]
    assert not cut or all(c == b for b, c in zip(blocks[cut[-1] + 1 :], chunks[cut[-1] + 1 :]))


def test_a_damaged_latest_step_is_listed_and_an_earlier_one_restores(tmp_path):
    """The guide's idiom: the latest step's marker replaced by a link fails its restore,
    naming the file, and the step before it restores."""
    manager = CheckpointManager(tmp_path / "run", asynchronous=False)
    for step in (1, 2):
        manager.save(step, tree_of(step))
    marker = tmp_path / "run" / "2" / "COMMITTED"
    os.remove(marker)
    os.symlink("/dev/zero", marker)
    assert manager.all_steps() == [1, 2]
    restored = None
    for step in reversed(manager.all_steps()):
        try:
            restored = manager.restore(step=step)
            break
        except CheckpointError as err:
            assert "2/COMMITTED is a link" in str(err)
    assert step == 1 and float(restored["['w']"][0, 0]) == 1.0
    manager.close()
