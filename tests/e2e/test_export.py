"""``mpmdc.export``: a training step (4 meshes, 1F1B, AdamW from Optax) exported, its bytes
loaded again, and run bitwise equal to the compiled function; every way the bytes, the
arguments or the meshes can be wrong is an ``MpmdcError`` naming it.

The program is exported once for the module. In another process that never imports
this file (``tests/multiprocess/run_exported.py``) it runs bitwise equal too (slow
tier, with ``mpmdc launch -n 4`` in ``tests/multiprocess/test_export_launch.py``).
"""

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import mpmdc
from mpmdc.errors import ArgumentError, ExportError
from mpmdc.exporting.plain import tree_data, tree_from

RUNNER = Path(__file__).parents[1] / "multiprocess" / "run_exported.py"
OPTIMIZER = optax.adamw(1e-2, weight_decay=1e-3)


def loss_fn(params, x, y):
    for i, w in enumerate(params):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(x @ w)
    return jnp.mean((x - y) ** 2)


def train_step(params, opt_state, x, y):
    loss, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(loss_fn)(params, *mb),
        (x, y),
        microbatches=4,
        schedule="1f1b",
        reduce="mean",
    )
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(k, (8, 8)) / 3 for k in keys[:4]]
    x = jax.random.normal(keys[4], (16, 8))
    y = jax.random.normal(keys[5], (16, 8))
    return params, OPTIMIZER.init(params), x, y


@pytest.fixture(scope="module")
def step(meshes4):
    return mpmdc.compile(train_step, meshes4)


@pytest.fixture(scope="module")
def data(step):
    return mpmdc.export(step)(*inputs()).serialize()


@pytest.fixture(scope="module")
def exported(data):
    return mpmdc.deserialize(data)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def assert_bitwise(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype and g.weak_type == w.weak_type and g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_two_steps_run_bitwise_equal_to_the_compiled_function(step, exported):
    args = inputs()
    got, want = exported.call(*args), step(*args)
    assert_bitwise(got, want)
    got, want = exported.call(*got[1:], *args[2:]), step(*want[1:], *args[2:])
    assert_bitwise(got, want)


def test_it_says_what_it_is(exported, step):
    args = inputs()
    lowered = step.lower(*args)
    assert exported.in_tree == jax.tree_util.tree_structure((args, {}))
    assert exported.in_avals == tuple(jax.typeof(x) for x in jax.tree_util.tree_leaves(args))
    assert exported.out_avals == tuple(
        jax.typeof(x) for x in jax.tree_util.tree_leaves(jax.eval_shape(train_step, *args))
    )
    assert exported.mesh_shapes == ({"data": 2},) * 4
    assert exported.schedule.actions == lowered.program("after-plan").schedule.actions
    assert exported.microbatches == 4
    assert exported.stages == lowered.stages
    assert exported.as_text("after-split") == lowered.as_text("after-split")
    params_places = exported.in_shardings[0][0]
    assert [p.mesh for p in params_places] == [0, 1, 2, 3]
    assert exported.fun_name.endswith("train_step")
    assert exported.written_by["jax"] == jax.__version__
    with pytest.raises(ExportError, match="unknown stage 'after-nothing'"):
        exported.as_text("after-nothing")


def test_serializing_again_gives_the_same_bytes(data, exported):
    assert exported.serialize() == data


def test_mpmdc_dump_prints_a_recorded_stage(tmp_path, data, exported):
    path = tmp_path / "step.mpmdc"
    path.write_bytes(data)
    result = subprocess.run(
        [sys.executable, "-m", "mpmdc", "dump", str(path), "--stage", "after-split"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == exported.as_text("after-split")


# ------------------------------------------------------------------- damaged bytes


def rewritten(data: bytes, change) -> bytes:
    """``data`` with each entry's bytes replaced by ``change(name, bytes)``."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name in source.namelist():
            archive.writestr(name, change(name, source.read(name)))
    return out.getvalue()


def test_truncated_bytes_are_an_export_error(data):
    with pytest.raises(ExportError, match="truncated or damaged"):
        mpmdc.deserialize(data[: len(data) // 2])


def test_a_damaged_module_is_an_export_error(data):
    archive = zipfile.ZipFile(io.BytesIO(data))
    info = archive.getinfo("modules/0")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    damaged = bytearray(data)
    damaged[start + info.compress_size // 2] ^= 0xFF
    with pytest.raises(ExportError, match=r"'modules/0' .* damaged"):
        mpmdc.deserialize(bytes(damaged))


def test_any_flipped_byte_of_an_entry_is_an_export_error_or_harmless(data):
    """Every entry is read whole, its CRC checked: a flipped byte anywhere in a module's
    compressed stream (where a decompressor error may come before the CRC check) is an
    ``ExportError`` naming the entry, never a raw ``zlib`` or ``zipfile`` error."""
    from mpmdc.exporting.container import Archive

    info = zipfile.ZipFile(io.BytesIO(data)).getinfo("modules/0")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for offset in range(start, start + info.compress_size, max(1, info.compress_size // 97)):
        damaged = bytearray(data)
        damaged[offset] ^= 0xFF
        with pytest.raises(ExportError, match="'modules/0'"):
            Archive(bytes(damaged)).read("modules/0")


def test_no_bytes_and_other_archives_are_export_errors():
    with pytest.raises(ExportError, match="takes the bytes"):
        mpmdc.deserialize("step.mpmdc")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("header.json", "{}")
    with pytest.raises(ExportError, match="no exported mpmdc program"):
        mpmdc.deserialize(out.getvalue())


def test_another_format_version_is_an_export_error(data):
    def newer(name, raw):
        if name != "header.json":
            return raw
        return json.dumps({**json.loads(raw), "version": 99}).encode()

    with pytest.raises(ExportError, match=r"format version 99.*reads version 1"):
        mpmdc.deserialize(rewritten(data, newer))


def test_malformed_plain_data_is_an_export_error(data):
    def broken(name, raw):
        if name != "program.json":
            return raw
        program = json.loads(raw)
        program["eqns"][0]["mesh"] = "zero"
        return json.dumps(program).encode()

    with pytest.raises(ExportError, match=r"malformed at eqns\.0"):
        mpmdc.deserialize(rewritten(data, broken))


def test_modules_this_jax_cannot_load_are_an_export_error(data):
    def unloadable(name, raw):
        if name == "header.json":
            return json.dumps({**json.loads(raw), "jax": "0.0.1"}).encode()
        return b"not a jax.export artifact" if name.startswith("modules/") else raw

    exported = mpmdc.deserialize(rewritten(data, unloadable))
    with pytest.raises(ExportError, match=r"cannot be loaded here.*exported by jax 0.0.1.*again"):
        exported.call(*inputs())


def test_a_garbage_module_of_this_version_is_called_damaged(data):
    """A module entry that is no ``jax.export`` artifact, written by these very versions
    (its CRC rewritten to match), is damage, not a version mismatch."""

    def garbage(name, raw):
        return b"not a jax.export artifact" if name.startswith("modules/") else raw

    exported = mpmdc.deserialize(rewritten(data, garbage))
    with pytest.raises(ExportError, match=r"versions are the same, so the bytes are damaged"):
        exported.call(*inputs())


# ------------------------------------------------------------------- wrong arguments


def test_arguments_of_another_tree_shape_or_dtype_are_argument_errors(exported):
    params, opt_state, x, y = inputs()
    with pytest.raises(ArgumentError, match=r"args\[0\]"):
        exported.call(params[:3], opt_state, x, y)
    with pytest.raises(ArgumentError, match=r"args\[2\] is float32\[8, 8\].*float32\[16, 8\]"):
        exported.call(params, opt_state, x[:8], y)
    with pytest.raises(ArgumentError, match=r"args\[3\] is int32.*export the compiled function"):
        exported.call(params, opt_state, x, y.astype(jnp.int32))


def test_an_argument_committed_elsewhere_is_an_argument_error(exported, meshes4):
    params, opt_state, x, y = inputs()
    params[1] = jax.device_put(params[1], NamedSharding(meshes4[0], PartitionSpec()))
    with pytest.raises(ArgumentError, match=r"args\[0\]\[1\] is committed to devices \[0, 1\]"):
        exported.call(params, opt_state, x, y)


def test_meshes_of_another_shape_or_count_are_export_errors(exported, meshes4):
    with pytest.raises(ExportError, match=r"holds 2 mesh.*exported for 4"):
        exported.call(*inputs(), meshes=meshes4[:2])
    other = mpmdc.make_meshes(4, {"model": 2})
    with pytest.raises(ExportError, match=r"meshes\[0\] is \{'model': 2\}"):
        exported.call(*inputs(), meshes=other)


def test_export_takes_compiled_functions_only():
    with pytest.raises(ExportError, match=r"takes a function from mpmdc.compile"):
        mpmdc.export(train_step)


def test_a_host_callback_cannot_be_exported(meshes4):
    def fn(x):
        x = mpmdc.stage(x, 0)
        jax.debug.callback(lambda v: None, x)
        return mpmdc.stage(x * 2, 1)

    with pytest.raises(ExportError, match=r"cannot be exported by jax.export.*callbacks"):
        mpmdc.export(mpmdc.compile(fn, meshes4[:2]))(jnp.ones(4))


def test_a_step_on_explicit_axes_exports_under_the_callers_set_mesh():
    """Under ``jax.set_mesh(meshes[0])``, as the placement guide says to call a model with
    ``Explicit`` axes, each fragment is exported under its own mesh (it was refused:
    arguments on mesh 1 against the context's devices); it runs bitwise as compiled."""
    meshes = mpmdc.make_meshes(2, {"x": 2}, axis_types=jax.sharding.AxisType.Explicit)

    def fn(ws, x):
        for i, w in enumerate(ws):
            x = jax.sharding.reshard(jnp.tanh(mpmdc.stage(x, i) @ w), PartitionSpec())
        return jnp.sum(x)

    ws = [
        jax.device_put(jnp.eye(8) * (0.5 + i), NamedSharding(m, PartitionSpec(None, "x")))
        for i, m in enumerate(meshes)
    ]
    x = jnp.linspace(-1, 1, 32, dtype=jnp.float32).reshape(4, 8)
    compiled = mpmdc.compile(jax.value_and_grad(fn), meshes)
    with jax.set_mesh(meshes[0]):
        exported = mpmdc.export(compiled)(ws, x)
        assert_bitwise(exported.call(ws, x), compiled(ws, x))


# ------------------------------------------------------------------- another process


@pytest.mark.slow
def test_another_process_runs_it_bitwise_without_the_function(tmp_path, data, step):
    (tmp_path / "step.mpmdc").write_bytes(data)
    np.savez(tmp_path / "inputs.npz", *leaves(inputs()))
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            str(tmp_path / "step.mpmdc"),
            str(tmp_path / "inputs.npz"),
            str(tmp_path / "out.npz"),
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok 1 process(es)" in result.stdout
    saved = np.load(tmp_path / "out.npz")
    args = inputs()
    for k in range(2):
        out = step(*args)
        for i, want in enumerate(leaves(out)):
            np.testing.assert_array_equal(saved[f"{k}/{i}"], want, err_msg=f"step {k} leaf {i}")
        args = (out[1], out[2], *args[2:])


def test_programs_differing_only_inside_a_module_are_not_the_same_program():
    """What processes compare before their first call covers the exported modules'
    contents: two programs differing only in a constant (a learning rate) print alike,
    and processes loading one each must not run them together."""
    from mpmdc.runtime.peers import program_entries

    meshes = mpmdc.make_meshes(1, {"data": 2})

    def entries(lr):
        def step(w, x):
            return w - lr * jnp.tanh(x @ w)

        step.__qualname__ = "step"  # the same function name for both
        w = jnp.eye(4, dtype=jnp.float32)
        data = mpmdc.export(mpmdc.compile(step, meshes))(w, w).serialize()
        return program_entries(mpmdc.deserialize(data).compile(meshes).program)

    first, second = entries(0.1), entries(0.2)
    assert [name for name, _ in first] == [name for name, _ in second]
    assert [name for (name, a), (_, b) in zip(first, second) if a != b] == ["equation 0 (s0_fwd)"]


@pytest.mark.slow  # (4 s: a second program exported and compiled)
def test_typed_prng_keys_are_exported_as_arguments_results_and_between_stages():
    """A step taking a typed key, sending a split of it to the next stage, closing over
    another and returning a new one runs from its bytes bitwise as compiled."""
    meshes = mpmdc.make_meshes(2, {"data": 2})
    closed_over = jax.random.key(7)

    def step(w, key, x):
        def loss(w):
            k0, k1 = jax.random.split(key)
            h = jnp.tanh(x @ w[0]) * jax.random.bernoulli(k0, 0.9, x.shape)
            h, k1 = mpmdc.stage((h, k1), 1)
            h = h + 0.01 * jax.random.normal(jax.random.fold_in(closed_over, 1), h.shape)
            return jnp.sum(jnp.tanh(h @ w[1]) * jax.random.uniform(k1, x.shape))

        value, grads = jax.value_and_grad(loss)(w)
        return value, [a - 0.1 * g for a, g in zip(w, grads)], jax.random.split(key)[1]

    w = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.3]
    args = (w, jax.random.key(0), jnp.linspace(-1, 1, 32, dtype=jnp.float32).reshape(4, 8))
    compiled = mpmdc.compile(step, meshes)
    exported = mpmdc.deserialize(mpmdc.export(compiled)(*args).serialize())
    assert str(exported.in_avals[2].dtype) == "key<fry>"
    got, want = exported.call(*args), compiled(*args)
    assert jax.random.key_impl(got[2]) == jax.random.key_impl(want[2])
    assert_bitwise(_key_data(got), _key_data(want))


def _key_data(tree):
    """``tree`` with each typed key replaced by its key data (bits to compare)."""

    def data(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(a)
        return a

    return jax.tree.map(data, tree)


def test_one_program_exported_from_two_places_gives_the_same_bytes():
    """A module's locations name the model's lines only, not where ``export`` was called
    (nor the caller of the first call that traced the function)."""
    meshes = mpmdc.make_meshes(2, {"data": 2})

    def f(w, x):
        return jnp.sum(jnp.tanh(mpmdc.stage(jnp.tanh(x @ w), 1) @ w))

    step = mpmdc.compile(f, meshes)
    w = jnp.eye(4, dtype=jnp.float32)
    first = mpmdc.export(step)(w, w).serialize()
    second = mpmdc.export(step)(w, w).serialize()
    assert first == second


def test_a_node_type_from_a_module_not_imported_names_the_package_to_import(monkeypatch):
    data = tree_data(jax.tree_util.tree_structure(optax.adam(1e-3).init({"w": jnp.ones(2)})))
    monkeypatch.delitem(sys.modules, "optax._src.transform")
    with pytest.raises(
        ExportError,
        match=r"ScaleByAdamState of module optax\._src\.transform, "
        r"which is not imported in this process; `import optax`",
    ):
        tree_from(data)


def test_a_node_whose_auxiliary_data_is_code_names_it_and_what_to_pass(meshes4):
    """A Flax ``TrainState`` keeps ``apply_fn`` and ``tx`` as its node's auxiliary data,
    which plain data cannot record: an ``ExportError`` at export names the node."""
    from flax.training import train_state

    state = train_state.TrainState.create(
        apply_fn=lambda p, x: x @ p["w"], params={"w": jnp.eye(4)}, tx=optax.sgd(0.1)
    )

    def step(state, x):
        loss, g = jax.value_and_grad(
            lambda p: jnp.sum(mpmdc.stage(state.apply_fn(p, mpmdc.stage(x, 0)), 1))
        )(state.params)
        return state.apply_gradients(grads=g), loss

    compiled = mpmdc.compile(step, meshes4[:2])
    with pytest.raises(
        ExportError, match=r"the arguments hold a TrainState, a pytree node whose auxiliary data is"
    ):
        mpmdc.export(compiled)(state, jnp.ones((2, 4)))
