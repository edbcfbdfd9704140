"""Checkpoints (``mpmdc.checkpoint``) of a pipelined training state in one process: saved,
restored and trained on as if never stopped; restored onto other layouts (other meshes, a
plain ``jax.jit`` program on one device or on an SPMD mesh, and back); nothing half-written
ever read; the manager's steps; every error naming the leaf and the directory.

Numbers: restoring moves values, never computes them, so restored arrays equal the saved
ones bit for bit, and a run resumed on the same compiled step equals the uninterrupted
run bit for bit. Where the resumed run is another program (``jax.jit`` against the
pipeline), the bound is ``ATOL`` below.
"""

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorstore as ts
from flax import nnx
from helpers import largest_difference
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from training import mlp_data, scanned_loss, scanned_params

import mpmdc
from mpmdc.checkpoint import CheckpointManager, restore, save, storage
from mpmdc.errors import CheckpointError, PlacementWarning

LAYERS, MICROBATCHES = 8, 4
TX = optax.adamw(1e-2)
# The pipelined steps against jax.jit's of the same function: the noise floor (jax.jit of
# this step against itself with the microbatches reversed, CPU float32) is 6.0e-8 after two
# steps of Adam and 1.2e-7 after four, the most a test here runs; ten times the larger.
ATOL = 1.2e-6


def make_step(every):
    def step(params, opt_state, x, y):
        loss, grads = mpmdc.accumulate(
            lambda mb: jax.value_and_grad(scanned_loss)(params, *mb, every=every),
            (x, y),
            microbatches=MICROBATCHES,
            reduce="mean",
        )
        updates, opt_state = TX.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step


def initial_state():
    params = scanned_params(jax.random.key(0), layers=LAYERS)
    return params, TX.init(params)


def train(step, state, steps):
    """``steps`` training steps from ``state`` on fixed data; the state after them."""
    x, y = mlp_data(32)
    for _ in range(steps):
        _, *state = step(*state, x, y)
    return tuple(state)


def target_of(state, shardings):
    """``state``'s shapes and dtypes with ``shardings``: a restore target."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings
    )


def assert_bitwise(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.fixture(scope="module")
def meshes4():
    return mpmdc.make_meshes(4, {"data": 2})


@pytest.fixture(scope="module")
def pipelined(meshes4):
    """The pipelined step on 4 meshes (2 layers per stage) and the state after 2 steps."""
    step = mpmdc.compile(make_step(every=2), meshes4)
    return step, train(step, initial_state(), 2)


@pytest.fixture(scope="module")
def saved(pipelined, tmp_path_factory):
    """The checkpoint of the pipelined state after 2 steps."""
    directory = tmp_path_factory.mktemp("saved") / "step2"
    save(directory, pipelined[1])
    return directory


def input_shardings(step, state):
    """Where ``step`` runs a state of ``state``'s types (placed by no earlier program)."""
    x, y = mlp_data(32)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    return step.input_shardings(*abstract, x, y)[0][:2]


def entries(folder) -> list[str]:
    """What ``folder`` holds, but the lock that commits into it take."""
    return sorted(set(os.listdir(folder)) - {storage.LOCK_FILE})


def executables(step) -> int:
    """How many programs ``step`` compiled (its cache also files calls an existing
    program serves, such as results fed back, under their own keys: hits, not misses)."""
    return step.cache_info().misses


@pytest.mark.slow
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(pipelined, saved):
    step, state = pipelined
    restored = restore(saved, target_of(state, input_shardings(step, state)))
    assert_bitwise(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert got.sharding == want.sharding  # a stacked leaf: its rows on their stages' meshes
    compiles = executables(step)
    assert_bitwise(train(step, restored, 2), train(step, initial_state(), 4))
    assert executables(step) == compiles  # restored where the step wants it: nothing recompiles


def test_each_stages_rows_are_chunks_of_their_own(pipelined, saved):
    """Every shard is whole chunks: the stacked layers are cut at the stages' rows, so each
    mesh's process writes files no other process writes."""
    index = restore_index(saved)
    layers = next(leaf for leaf in index.leaves if leaf.path == "[0]['layers']")
    store = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{saved}/{layers.array}/"}}
    ).result()
    assert store.shape == (LAYERS, 16, 16)
    assert store.chunk_layout.read_chunk.shape == (2, 16, 16)  # 2 layers per stage


def restore_index(directory):
    from mpmdc.checkpoint.restoring import resolve

    return resolve(directory)[1]


def test_a_checkpoint_is_read_without_mpmdc(pipelined, saved):
    """Zarr v3 arrays under the leaf's name, the index in the root group's attributes."""
    import json

    with open(saved / "zarr.json") as f:
        leaves = json.load(f)["attributes"]["mpmdc"]["leaves"]
    params = pipelined[1][0]
    for leaf in leaves:
        if leaf["path"].startswith("[0]"):
            key = leaf["path"][len("[0]['") : -len("']")]
            store = ts.open(
                {
                    "driver": "zarr3",
                    "kvstore": {"driver": "file", "path": f"{saved}/{leaf['array']}/"},
                }
            ).result()
            np.testing.assert_array_equal(store.read().result(), np.asarray(params[key]))


def two_mesh_layout():
    meshes = mpmdc.make_meshes(2, {"data": 4})
    step = mpmdc.compile(make_step(every=4), meshes)
    return step, None


def one_device_layout():
    return jax.jit(make_step(every=2)), SingleDeviceSharding(jax.devices()[5])


def spmd_layout():
    """An SPMD program on all 8 devices, the stacked layers split over them one per device."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    return jax.jit(make_step(every=2)), mesh


def interleaved_layout():
    """8 stages of one layer on 4 meshes (stage s on mesh s mod 4, interleaved 1F1B): the
    stacked layers are kept whole on one mesh (with a warning), as the guide says."""
    meshes = mpmdc.make_meshes(4, {"data": 2})
    return mpmdc.compile(make_step(every=1), meshes, schedule="interleaved-1f1b"), None


PIPELINES = ("two meshes", "stage_to_mesh interleaved")
LAYOUTS = {
    "two meshes": two_mesh_layout,
    "stage_to_mesh interleaved": interleaved_layout,
    "one device": one_device_layout,
    "spmd": spmd_layout,
}


def layout_shardings(kind, state):
    step, where = LAYOUTS[kind]()
    if kind in PIPELINES:
        return step, input_shardings(step, state)
    if kind == "one device":
        return step, jax.tree.map(lambda _: where, state)
    return step, jax.tree.map(lambda a: NamedSharding(where, P("x") if a.ndim == 3 else P()), state)


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.slow
def test_restore_onto_another_layout_moves_the_values_unchanged(pipelined, saved, kind):
    _, state = pipelined
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlacementWarning)
        step, shardings = layout_shardings(kind, state)
        restored = restore(saved, target_of(state, shardings))
        assert_bitwise(restored, state)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
            assert got.sharding == want
        # and trains on from there as the pipeline would, on the program that placed it
        compiles = executables(step) if kind in PIPELINES else None
        resumed = train(step, restored, 1)
    assert largest_difference(resumed, train(pipelined[0], state, 1)) <= ATOL
    if kind in PIPELINES:
        assert executables(step) == compiles
    kept_whole = [w for w in caught if issubclass(w.category, PlacementWarning)]
    assert len(kept_whole) == (kind == "stage_to_mesh interleaved")


def test_a_plain_programs_checkpoint_restores_onto_a_pipeline(pipelined, tmp_path):
    step, _ = pipelined
    plain = train(jax.jit(make_step(every=2)), initial_state(), 2)
    save(tmp_path / "plain", plain)
    bare = input_shardings(step, plain)  # a bare sharding per leaf: the saved shape and dtype
    restored = restore(tmp_path / "plain", bare)
    assert_bitwise(restored, plain)
    assert (
        largest_difference(train(step, restored, 2), train(jax.jit(make_step(2)), plain, 2)) <= ATOL
    )


def test_keys_numpy_values_and_an_nnx_models_state_round_trip(tmp_path):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

    model = Model(nnx.Rngs(params=0, dropout=1))
    tree = {
        "model": nnx.state(model),
        "keys": jax.random.split(jax.random.key(3, impl="rbg"), 4),
        "bf16": jnp.arange(6, dtype=jnp.bfloat16),
        "table": np.arange(5, dtype=np.int16),
        "epoch": 7,
    }
    save(tmp_path / "c", tree)
    restored = restore(tmp_path / "c", tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    assert restored["keys"].dtype == tree["keys"].dtype
    np.testing.assert_array_equal(
        jax.random.key_data(restored["keys"]), jax.random.key_data(tree["keys"])
    )
    for got, want in zip(jax.tree.leaves(restored["model"]), jax.tree.leaves(tree["model"])):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(got, want)
    assert isinstance(restored["table"], np.ndarray) and restored["epoch"] == 7
    nnx.update(model, restored["model"])  # the model takes its state back
    everything = restore(tmp_path / "c")  # no target: every leaf whole, by path
    assert everything["['bf16']"].dtype == jnp.bfloat16 and len(everything) == len(
        jax.tree.leaves(tree)
    )


def test_a_leaf_kept_on_the_host_keeps_its_64_bits(tmp_path):
    wide = np.array([2**40, 2**40 + 1, 3])
    save(tmp_path / "c", {"n": wide})
    np.testing.assert_array_equal(restore(tmp_path / "c", {"n": wide * 0})["n"], wide)


def test_keys_the_format_uses_or_a_filesystem_refuses_are_escaped(tmp_path):
    tree = {
        "zarr.json": jnp.ones(2),
        "COMMITTED": jnp.full(2, 2.0),
        "x" * 300: jnp.full(2, 3.0),
        "a.tmp": jnp.full(2, 4.0),
        "nested": {"zarr.json": jnp.full(2, 5.0), "a/b": jnp.full(2, 6.0), "..": jnp.zeros(1)},
        "numbered": {1: jnp.full(2, 7.0)},
    }
    save(tmp_path / "c", tree)
    assert_bitwise(restore(tmp_path / "c", tree), tree)


def test_weak_types_come_back_as_saved_or_as_the_target_says(meshes4, tmp_path):
    """A weakly typed scalar (a step counter from ``jnp.asarray(0)``) fed back to a compiled
    step after a restore hits its cache."""
    count = jnp.asarray(0)
    save(tmp_path / "c", {"count": count})
    one = SingleDeviceSharding(jax.devices()[0])
    assert jax.typeof(restore(tmp_path / "c", {"count": one})["count"]).weak_type
    assert jax.typeof(restore(tmp_path / "c", {"count": count})["count"]).weak_type
    strong = jax.ShapeDtypeStruct((), jnp.int32, sharding=one)
    assert not jax.typeof(restore(tmp_path / "c", {"count": strong})["count"]).weak_type

    def step(w, count):
        return mpmdc.stage(mpmdc.stage(w, 0) * 2, 1) + 1, count + 1

    compiled = mpmdc.compile(step, meshes4[:2])
    compiled(jnp.ones(4), count)
    compiles = executables(compiled)
    compiled(jnp.ones(4), restore(tmp_path / "c", {"count": one})["count"])
    assert executables(compiled) == compiles


def test_a_checkpoint_being_replaced_is_read_from_beside_it(tmp_path):
    """``overwrite=True`` moves the old checkpoint aside for a moment; a reader in that
    moment, or after a save that died in it, reads it there, and the next save clears it."""
    save(tmp_path / "c", {"w": jnp.ones(3)})
    os.replace(tmp_path / "c", tmp_path / "c.replaced")  # where a save that died left it
    np.testing.assert_array_equal(restore(tmp_path / "c")["['w']"], np.ones(3))
    with pytest.raises(CheckpointError, match="a checkpoint is already at"):
        save(tmp_path / "c", {"w": jnp.zeros(3)})
    save(tmp_path / "c", {"w": jnp.zeros(3)}, overwrite=True)
    assert entries(tmp_path) == ["c"]
    np.testing.assert_array_equal(restore(tmp_path / "c")["['w']"], np.zeros(3))


def test_a_lost_chunk_is_an_error_not_zeros(tmp_path):
    """Every chunk is written, zeros too, and a chunk that is not there fails the read."""
    save(tmp_path / "c", {"w": jnp.zeros((4, 4))})
    chunks = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "c" / "w" / "c") for f in fs]
    assert chunks  # zeros are written as any other values
    os.remove(chunks[0])
    with pytest.raises(
        CheckpointError, match=r"the checkpoint at .*c is damaged or was removed while read"
    ):
        restore(tmp_path / "c", {"w": jnp.zeros((4, 4))})


def test_a_checkpoint_replaced_while_read_is_read_again_whole(tmp_path, monkeypatch):
    """An ``overwrite=True`` save that commits while a restore reads (its old folder moved
    aside and removed, the new one renamed in): the restore reads again where the
    checkpoint is now and returns the new one whole, never a mix of the two, whether the
    trees have the same leaves or not."""
    opened = storage.opened
    for new_tree, target in (
        ({"w": jnp.full(3, 2.0), "b": jnp.full(2, 2.0)}, {"w": jnp.ones(3), "b": jnp.ones(2)}),
        ({"w": jnp.full((4, 4), 2.0)}, None),  # another tree: its metadata differs mid-read
    ):
        directory = tmp_path / str(len(new_tree))
        save(directory, {"w": jnp.ones(3), "b": jnp.ones(2)})
        saves = [new_tree]

        def replacing(spec, context, saves=saves, directory=directory, **mode):
            if saves:
                save(directory, saves.pop(), overwrite=True)
            return opened(spec, context, **mode)

        monkeypatch.setattr(storage, "opened", replacing)
        restored = restore(directory, target)
        monkeypatch.setattr(storage, "opened", opened)
        assert not saves  # the overwrite did land mid-read
        values = jax.tree.leaves(restored)
        assert len(values) == len(new_tree)
        for value in values:
            np.testing.assert_array_equal(value, np.full(np.shape(value), 2.0))


def test_a_checkpoint_replaced_while_read_twice_is_an_error(tmp_path, monkeypatch):
    save(tmp_path / "c", {"w": jnp.ones(3)})
    opened = storage.opened
    commits = iter(range(1000))

    def replacing(spec, context, **mode):  # another save's commit lands at every read
        root = os.path.dirname(spec["kvstore"]["path"].rstrip("/"))
        storage.write_json(os.path.join(root, "COMMITTED"), {"save": next(commits)})
        return opened(spec, context, **mode)

    monkeypatch.setattr(storage, "opened", replacing)
    with pytest.raises(
        CheckpointError, match="was replaced while it was read, and again while it was read a"
    ):
        restore(tmp_path / "c", {"w": jnp.ones(3)})


def test_manager_mistakes_name_what_to_do(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file; a CheckpointManager needs a directory"):
        CheckpointManager(tmp_path / "file")
    manager = CheckpointManager(tmp_path / "run")
    assert manager.save(np.int64(3), {"w": jnp.ones(2)})  # a numpy step number
    manager.wait_until_finished()
    with pytest.raises(
        CheckpointError, match=r"step 3 is already saved in .*run/3; save another step"
    ):
        manager.save(3, {"w": jnp.ones(2)})
    with pytest.raises(CheckpointError, match="step must be a non-negative integer, got -1"):
        manager.save(-1, {"w": jnp.ones(2)})
    manager.close()
    with pytest.raises(CheckpointError, match="is closed; make a new one"):
        manager.save(4, {"w": jnp.ones(2)})


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda m: m.restore(step="x"), "step must be a non-negative integer, got 'x'"),
        (lambda m: m.restore(step=True), "step must be a non-negative integer, got True"),
        (lambda m: m.restore(step=-2), "step must be a non-negative integer, got -2"),
        (lambda m: m.save(2.0, {"w": jnp.ones(2)}), "step must be a non-negative integer"),
        (lambda m: m.save(2, {"w": jnp.ones(2)}, force="yes"), "force must be True or False"),
        (lambda m: CheckpointManager(m.directory, asynchronous="yes"), "asynchronous must be"),
        (lambda m: CheckpointManager(m.directory, remove_partial=1), "remove_partial must be"),
        (lambda m: CheckpointManager(m.directory, max_to_keep=0), "max_to_keep must be"),
        (lambda m: CheckpointManager(m.directory, save_interval_steps=True), "save_interval_st"),
        (lambda m: CheckpointManager(7), "directory must be a path"),
    ],
)
def test_a_manager_refuses_arguments_of_the_wrong_kind_naming_them(tmp_path, call, named):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        call(manager)
    manager.close()


def test_a_replaced_folder_is_its_step_for_a_moment_never_a_step_of_its_own(tmp_path):
    """``7.replaced`` is step 7 while an ``overwrite=True`` save swaps it (or after one died
    doing so): listed once, as 7, restored from there, and removed with step 7."""
    save(tmp_path / "7", {"w": jnp.full(2, 7.0)})
    os.replace(tmp_path / "7", tmp_path / "7.replaced")  # where a save that died left it
    save(tmp_path / "8", {"w": jnp.full(2, 8.0)})
    shutil.copytree(tmp_path / "8", tmp_path / "8.replaced")  # beside its step: the same step
    with CheckpointManager(tmp_path, max_to_keep=2) as manager:
        assert manager.all_steps() == [7, 8]
        np.testing.assert_array_equal(manager.restore(step=7)["['w']"], np.full(2, 7.0))
        manager.save(9, {"w": jnp.full(2, 9.0)})
    assert manager.all_steps() == [8, 9]
    assert "7.replaced" not in os.listdir(tmp_path)


def test_a_step_max_to_keep_would_remove_at_once_is_refused(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=2, asynchronous=False) as manager:
        for step in (4, 6):
            manager.save(step, {"w": jnp.ones(2)})
        assert manager.save(5, {"w": jnp.ones(2)})  # among the 2 newest: kept
        assert manager.all_steps() == [5, 6]
        with pytest.raises(
            CheckpointError,
            match=r"step 3 is older than the 2 newest steps in .* \(5, 6\), which max_to_keep=2 "
            r"keeps: it would be removed as soon as it is saved",
        ):
            manager.save(3, {"w": jnp.ones(2)})
        assert manager.all_steps() == [5, 6]


def failing_writes(monkeypatch):
    """Make every save's writes fail as on a full disk."""
    opened = storage.opened

    def failing(spec, context, **mode):
        if mode.get("write"):
            raise OSError(28, "No space left on device")
        return opened(spec, context, **mode)

    monkeypatch.setattr(storage, "opened", failing)
    return lambda: monkeypatch.setattr(storage, "opened", opened)


def finished(manager) -> None:
    """Wait until ``manager``'s save in the background ended, without asking how."""
    while not manager._pending.done():
        time.sleep(0.01)


def test_a_failed_background_save_is_raised_by_the_next_call_naming_its_step(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    healed = failing_writes(monkeypatch)
    assert manager.save(1, {"w": jnp.ones(2)})  # fails in the background
    finished(manager)
    healed()
    with pytest.raises(
        CheckpointError,
        match=r"step 1 was NOT saved: its save to .*/1 failed in the background: .*No space left"
        r".* This call saved nothing: save step 2 again",
    ):
        manager.save(2, {"w": jnp.ones(2)})
    assert manager.all_steps() == []
    manager.save(2, {"w": jnp.ones(2)})  # told once; saving goes on
    manager.wait_until_finished()
    failing_writes(monkeypatch)
    manager.save(3, {"w": jnp.ones(2)})
    with pytest.raises(CheckpointError, match="step 3 was NOT saved"):
        manager.wait_until_finished()
    manager.wait_until_finished()  # told once
    assert manager.all_steps() == [2]
    manager.close()


def test_a_failed_background_save_nobody_was_told_of_warns(tmp_path, monkeypatch):
    failing_writes(monkeypatch)
    with pytest.warns(RuntimeWarning, match="step 1 was NOT saved"):  # an error leaves the block
        with pytest.raises(KeyError), CheckpointManager(tmp_path / "a") as manager:
            manager.save(1, {"w": jnp.ones(2)})
            raise KeyError("the training step failed")
    manager = CheckpointManager(tmp_path / "b")
    manager.save(7, {"w": jnp.ones(2)})
    finished(manager)
    with pytest.warns(RuntimeWarning, match="dropped without being told that step 7 was NOT"):
        del manager
        gc.collect()


def test_overwrite_replaces_a_checkpoint_whole(tmp_path):
    save(tmp_path / "c", {"w": jnp.zeros(3)})
    with pytest.raises(CheckpointError, match="already at"):
        save(tmp_path / "c", {"w": jnp.ones(3)})
    save(tmp_path / "c", {"w": jnp.ones(3), "b": jnp.ones(2)}, overwrite=True)
    assert sorted(restore(tmp_path / "c")) == ["['b']", "['w']"]
    assert entries(tmp_path) == ["c"]


ERRORS = {
    "missing": (
        lambda d, t: restore(d / "nowhere", t),
        "no checkpoint at .*nowhere: the directory does not exist",
    ),
    "partial": (
        lambda d, t: (os.makedirs(d / "half.partial"), restore(d / "half", t)),
        r"no checkpoint at .*half: only .*half\.partial is there: a save to it has not finished, or died",
    ),
    "not a checkpoint": (
        lambda d, t: (os.makedirs(d / "other"), restore(d / "other", t)),
        r"no checkpoint at .*other: it has no COMMITTED marker",
    ),
    "path missing": (
        lambda d, t: restore(d / "c", {**t, "extra": jnp.zeros(2)}),
        r"in the target, not in the checkpoint: \['extra'\]",
    ),
    "path extra": (
        lambda d, t: restore(d / "c", {"w": t["w"]}),
        r"in the checkpoint, not in the target: \['b'\]",
    ),
    "shape": (
        lambda d, t: restore(d / "c", {**t, "w": jnp.zeros((3, 2))}),
        r"leaf \['w'\] of the checkpoint at .*c is float32\[2, 3\]; the target asks for float32\[3, 2\]",
    ),
    "dtype": (
        lambda d, t: restore(d / "c", {**t, "b": jnp.zeros(2, jnp.int32)}),
        r"leaf \['b'\] .* is float32\[2\]; the target asks for int32\[2\]",
    ),
    "abstract sharding": (
        lambda d, t: restore(
            d / "c",
            {
                **t,
                "b": jax.ShapeDtypeStruct(
                    (2,),
                    jnp.float32,
                    sharding=NamedSharding(jax.make_mesh((8,), ("x",)).abstract_mesh, P()),
                ),
            },
        ),
        r"target leaf \['b'\] .* names no devices",
    ),
    "no array": (
        lambda d, t: save(d / "new", {**t, "name": "run-1"}),
        r"leaf \['name'\] saved to .*new is a str, not an array",
    ),
    "donated": (
        lambda d, t: save(d / "new", {"w": donated()}),
        r"leaf \['w'\] saved to .*new was deleted",
    ),
    "exists": (lambda d, t: save(d / "c", t), r"a checkpoint is already at .*c;"),
    "under a file": (
        lambda d, t: ((d / "file").write_text("x"), save(d / "file" / "c", t)),
        r"cannot save to .*file/c: .*file is a file, not a directory",
    ),
    "a file": (
        lambda d, t: ((d / "file").write_text("x"), restore(d / "file", t)),
        r"no checkpoint at .*file: it is a file",
    ),
    "indivisible": (
        lambda d, t: restore(
            d / "c", {**t, "w": NamedSharding(jax.make_mesh((4,), ("x",)), P("x"))}
        ),
        r"target leaf \['w'\] for the checkpoint at .*c: NamedSharding.* does not fit its shape \[2, 3\]",
    ),
    "64-bit": (
        lambda d, t: (
            save(d / "wide", {"n": np.array([2**40, 3])}),
            restore(d / "wide", {"n": SingleDeviceSharding(jax.devices()[0])}),
        ),
        r"leaf \['n'\] of the checkpoint at .*wide is int64, which JAX holds as int32 while "
        r"64-bit types are off",
    ),
    "occupied": (
        lambda d, t: (
            os.makedirs(d / "folder"),
            (d / "folder" / "notes.txt").write_text("mine"),
            save(d / "folder", t, overwrite=True),
        ),
        r"folder exists and is no checkpoint; .*overwrite=True replaces only a complete checkpoint",
    ),
}


def donated():
    x = jnp.ones(3)
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    return x


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_name_the_leaf_and_the_directory(tmp_path, case):
    tree = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(2)}
    save(tmp_path / "c", tree)
    make, says = ERRORS[case]
    with pytest.raises(CheckpointError, match=says):
        make(tmp_path, tree)
    assert not os.path.exists(tmp_path / "new")  # a refused save writes nothing
    if case == "occupied":
        assert os.listdir(tmp_path / "folder") == ["notes.txt"]


@pytest.mark.slow
def test_the_manager_keeps_the_newest_steps_and_saves_while_the_next_step_runs(
    pipelined, saved, tmp_path
):
    """Asynchronous saves copy to the host first: a step donating the saved arrays right
    after ``save`` returns changes nothing in the checkpoint."""
    step, state = pipelined
    donating = mpmdc.compile(make_step(every=2), step.meshes, donate_argnums=(0, 1))
    x, y = mlp_data(32)
    state = restore(saved, target_of(state, input_shardings(step, state)))  # arrays of its own
    expected = {}
    with CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as manager:
        for n in range(7):
            values = jax.tree.map(np.array, state)
            if manager.save(n, state):
                expected[n] = values
            _, *state = donating(*state, x, y)
            state = tuple(state)
        assert manager.latest_step() == 6  # waits for the save of 6 in the background
    assert manager.all_steps() == [4, 6]
    assert entries(tmp_path) == ["4", "6"]
    target = target_of(state, input_shardings(step, state))
    assert_bitwise(manager.restore(target), expected[6])
    assert_bitwise(manager.restore(target, step=4), expected[4])


KILLED_DURING_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    from mpmdc.checkpoint import CheckpointManager, storage

    manager = CheckpointManager(sys.argv[1], asynchronous=False)
    manager.save(1, {"w": jnp.full((64, 64), 1.0), "b": jnp.ones(64)})
    opened = storage.opened

    def dying(spec, context, **mode):  # dies with its first chunk written, the rest not
        store = opened(spec, context, **mode)
        store[...].write(jnp.full(store.shape, 2.0, store.dtype.numpy_dtype)).result()
        os.kill(os.getpid(), signal.SIGKILL)

    storage.opened = dying
    manager.save(2, {"w": jnp.full((64, 64), 2.0), "b": jnp.ones(64)})
    """
)


def test_a_process_killed_during_a_save_leaves_the_last_checkpoint_and_nothing_readable(
    tmp_path,
):
    done = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_SAVE, str(tmp_path)], capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    [died] = [name for name in entries(tmp_path) if name != "1"]
    assert re.fullmatch(r"2\.[0-9a-f]{16}\.partial", died)  # a folder of that save's own
    manager = CheckpointManager(tmp_path)
    assert manager.latest_step() == 1
    with pytest.raises(CheckpointError, match="a save to it has not finished, or died"):
        manager.restore(step=2)
    assert float(manager.restore()["['w']"][0, 0]) == 1.0
    manager.save(2, {"w": jnp.full((64, 64), 3.0), "b": jnp.ones(64)})  # the step saved again
    manager.close()
    assert entries(tmp_path) == ["1", "2", died]  # nothing removes another save's folder
    assert float(manager.restore()["['w']"][0, 0]) == 3.0


@pytest.mark.slow
def test_the_example_resumes_in_one_process_where_the_uninterrupted_run_ends(tmp_path, capsys):
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "resume_training", pathlib.Path(__file__).parents[2] / "examples" / "resume_training.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main([str(tmp_path / "whole"), "--steps", "8"])
    example.main([str(tmp_path / "resumed"), "--steps", "4"])
    example.main([str(tmp_path / "resumed"), "--steps", "8"])
    assert f"resumed from step 4 in {tmp_path}/resumed/4" in capsys.readouterr().out
    got, want = restore(tmp_path / "resumed" / "8"), restore(tmp_path / "whole" / "8")
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def preemption_protocol(monkeypatch, answer):
    """JAX's preemption protocol as in a ``jax.distributed`` run of one process, answering
    ``answer(step)``."""
    from jax.experimental import multihost_utils

    from mpmdc import _jax_compat

    monkeypatch.setattr(_jax_compat, "distributed_client", lambda: object())
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", answer)


def test_the_manager_saves_and_says_so_at_the_step_of_a_preemption(tmp_path, monkeypatch):
    """JAX's preemption protocol is asked once per step, at every step, saved or not (it
    agrees on a step the processes have not passed, so a step never asked would never
    come): the step it names is saved whatever ``save_interval_steps`` says, and
    ``reached_preemption`` says so there."""
    asked = []

    def sync_point(step):
        asked.append(step)
        return step == 7

    preemption_protocol(monkeypatch, sync_point)
    manager = CheckpointManager(tmp_path, save_interval_steps=4, asynchronous=False)
    saved = []
    for step in range(1, 9):
        if manager.save(step, {"w": jnp.full((2,), float(step))}):
            saved.append(step)
        assert manager.reached_preemption(step) == (step == 7)
    assert asked == list(range(1, 9))
    assert saved == manager.all_steps() == [4, 7, 8]


def test_a_manager_without_jaxs_preemption_service_saves_by_its_interval(tmp_path, monkeypatch):
    """With ``jax_enable_preemption_service`` off, JAX's protocol raises when asked (in a
    ``jax.distributed`` run): the manager does not ask, and saves by
    ``save_interval_steps`` alone."""

    def refused(step):
        raise RuntimeError("Preemption sync manager has not been initialized.")

    preemption_protocol(monkeypatch, refused)
    was = jax.config.jax_enable_preemption_service
    jax.config.update("jax_enable_preemption_service", False)
    try:
        manager = CheckpointManager(tmp_path, save_interval_steps=2, asynchronous=False)
        saved = [manager.save(step, {"w": jnp.zeros(2)}) for step in range(1, 5)]
        assert saved == [False, True, False, True]
        assert not manager.reached_preemption(5)
    finally:
        jax.config.update("jax_enable_preemption_service", was)


def test_a_manager_asked_every_few_steps_or_not_saving_the_agreed_step_warns(tmp_path, monkeypatch):
    """Misuse JAX's protocol cannot tell: a loop calling ``save`` only every 4 steps by
    its own ``if`` skips steps the processes may agree on (warned once, naming the
    steps), and a loop stopping at the agreed step without saving it loses the steps
    since the last save (warned as the manager closes)."""
    preemption_protocol(monkeypatch, lambda step: step == 7)
    with pytest.warns(RuntimeWarning, match=r"step 4, then step 8, is where the processes"):
        manager = CheckpointManager(tmp_path / "skipping", asynchronous=False)
        for step in (4, 8, 12):
            manager.save(step, {"w": jnp.zeros(2)})
    with pytest.warns(RuntimeWarning, match=r"step 7 is where every process stopped for a"):
        with CheckpointManager(tmp_path / "unsaved", save_interval_steps=4) as manager:
            for step in range(1, 9):
                if step % 4 == 0:
                    manager.save(step, {"w": jnp.zeros(2)})
                if manager.reached_preemption(step):
                    break
    with warnings.catch_warnings():  # (the loop as the guide writes it: no warning)
        warnings.simplefilter("error")
        with CheckpointManager(tmp_path / "right", save_interval_steps=4) as manager:
            for step in range(1, 9):
                manager.save(step, {"w": jnp.zeros(2)})
                if manager.reached_preemption(step):
                    break
        assert manager.all_steps() == [4, 7]


def test_a_manager_without_jax_distributed_neither_asks_nor_warns(tmp_path, monkeypatch):
    """Without ``jax.distributed`` there is no preemption protocol (``SIGTERM`` ends the
    process): steps saved far apart are no mistake, and nothing is asked."""
    from jax.experimental import multihost_utils

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CheckpointManager(tmp_path, asynchronous=False) as manager:
            for step in (4, 8, 100):
                assert manager.save(step, {"w": jnp.zeros(2)})
                assert not manager.reached_preemption(step)
