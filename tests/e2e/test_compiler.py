"""Compiler behaviour end to end: caching, deterministic dumps, donation, input shardings,
the demo, markers under jit/grad/vmap. Each pass's own rules are tested on small programs
in ``tests/passes/test_pass_<name>.py``."""

import importlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_results_own_their_buffers,
    assert_same_as_jit,
    assert_same_tree,
    mlp_loss,
)

import mpmdc
from mpmdc import backends

WS = [jnp.eye(8) * 0.5 + 0.01 * i for i in range(4)]
X = jnp.arange(32.0).reshape(4, 8) / 32


def test_second_call_does_not_retrace(meshes4):
    traces = []

    def loss(ws, x):
        traces.append(1)
        return mlp_loss(ws, x)

    step = mpmdc.compile(jax.grad(loss), meshes4)
    step(WS, X)
    step(WS, X + 1)
    assert len(traces) == 1
    step(WS, jnp.ones((2, 8)))
    assert len(traces) == 2


def test_the_call_path_never_prints_a_module(meshes4, monkeypatch):
    printed = []
    as_text = jax.stages.Lowered.as_text

    def counted(self, *args, **kwargs):
        printed.append(1)
        return as_text(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "as_text", counted)
    assert_same_as_jit(jax.grad(mlp_loss), meshes4, WS, X)
    assert printed == []
    assert (
        mpmdc.compile(jax.grad(mlp_loss), meshes4).lower(WS, X).stablehlo() and printed
    )  # (when asked)


def test_as_text_is_identical_across_compilations(meshes4):
    a = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes4).lower(WS, X)
    b = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes4).lower(WS, X)
    assert a.stages == (
        "input",
        "after-plan",
        "after-inline",
        "after-split-scans",
        "after-cond-fission",
        "after-slice-stacks",
        "after-dce",
        "after-partition",
        "after-vma-typecheck",
        "after-split",
        "after-split-backward",
        "after-schedule",
        "after-donate",
        "stablehlo",
    )
    for stage in a.stages:
        assert a.as_text(stage) == b.as_text(stage)
        assert "0x" not in a.as_text(stage)
    assert a.stablehlo(platform="tpu") == b.stablehlo(platform="tpu")


def test_donated_inputs_are_consumed(meshes2):
    step = mpmdc.compile(lambda w, x: mlp_loss([w, w], x), meshes2, donate_argnums=1)
    want = jax.jit(lambda w, x: mlp_loss([w, w], x))(WS[0], X)
    x = jax.device_put(
        np.asarray(X), jax.sharding.NamedSharding(meshes2[0], jax.sharding.PartitionSpec())
    )
    out = step(WS[0], x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert x.is_deleted()


def test_a_donated_argument_no_fragment_can_take_over_is_deleted_as_by_jit(meshes2):
    """A donated argument whose buffer no fragment's result can take over (an int
    counter read where only floats are made; a layer stack kept whole, read in rows and
    joined elsewhere) is deleted once the call has run, as ``jax.jit`` deletes every
    donated argument; one returned as it is stays, as the result."""

    def step(w, n, x, kept):
        loss = jnp.sum(mpmdc.stage(jnp.tanh(mpmdc.stage(x, 0) @ w), 1) * n)
        return loss, w * 2, kept

    compiled = mpmdc.compile(step, meshes2, donate_argnums=(0, 1, 3))
    n, kept = jnp.int32(3), jnp.ones(3)
    want = jax.jit(step)(WS[0], n, X, kept)
    # (Where the program reads it: an argument that must first move is copied, and kept.)
    n = jax.device_put(n, compiled.input_shardings(WS[0], n, X, kept)[0][1])
    got = compiled(WS[0] * 1, n, X, kept)
    assert_same_tree(got, want)
    assert n.is_deleted() and not kept.is_deleted() and not X.is_deleted()

    def stack_step(ws, x):
        def loss(ws):
            def layer(h, w):
                return jnp.tanh(mpmdc.stage(h, every=(3, 1)) @ w), None

            return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)

        return ws - 0.1 * jax.grad(loss)(ws)

    ws = jnp.stack([WS[0]] * 4)
    want = jax.jit(stack_step)(ws, X)
    with pytest.warns(mpmdc.errors.PlacementWarning, match="cannot be one array"):
        compiled = mpmdc.compile(stack_step, meshes2, donate_argnums=0)
        first = compiled(ws * 1, X)
    # The stack's rows cross fragment boundaries, summed otherwise than inside one
    # jax.jit module: noise floor 6e-8 relative (jax.jit against eager), margin 20x.
    assert_same_tree(first, want, rtol=1.2e-6, atol=1e-7)
    compiled(first, X)
    assert first.is_deleted()


def test_what_runs_is_what_lower_shows_also_when_donating(meshes2, monkeypatch):
    """Donation is decided by the `lower` pass (a fragment parameter), and the runtime
    compiles exactly the modules of the `stablehlo` stage; it never lowers donating
    fragments again by itself."""
    compiled = []

    class Recording(backends.Backend):
        def compile_fragment(self, lowered):
            compiled.append(lowered.as_text())
            return super().compile_fragment(lowered)

    monkeypatch.setattr(backends, "_registry", dict(backends._registry))
    backends.register(Recording("recording-cpu", "cpu"))

    def sgd(ws, x):
        grads = jax.grad(mlp_loss)(ws, x)
        return [w - 0.1 * g for w, g in zip(ws, grads)]

    ws = [jnp.array(w) for w in WS[:2]]
    want = jax.jit(sgd)(ws, X)
    lowered = mpmdc.compile(sgd, meshes2, donate_argnums=0, backend="recording-cpu").lower(ws, X)
    modules = lowered.stablehlo()
    donating = [
        name
        for name, text in modules.items()
        if "tf.aliasing_output" in text or "jax.buffer_donor" in text
    ]
    assert donating, "no module donates an argument"
    assert re.search(r"donate_argnums=\(\d", lowered.as_text("stablehlo"))
    executable = lowered.compile()
    assert sorted(compiled) == sorted(modules.values())
    ws = jax.device_put(ws, executable.input_shardings[0][0])
    got = executable(ws, X)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert all(w.is_deleted() for w in ws)


def _recording_backends(monkeypatch):
    """Two CPU backends that record each XLA compile: ``recording-cpu`` shares a stage's
    executable across meshes of one shape, ``compiling-cpu`` compiles it for each."""
    compiled = []

    class Recording(backends.Backend):
        def compile_fragment(self, lowered):
            compiled.append(lowered)
            return super().compile_fragment(lowered)

    class Compiling(Recording):
        def load_fragment(self, compiled, devices):
            return None

    monkeypatch.setattr(backends, "_registry", dict(backends._registry))
    backends.register(Recording("recording-cpu", "cpu"))
    backends.register(Compiling("compiling-cpu", "cpu"))
    return compiled


def scaled_mlp_loss(ws, x):
    for i, w in enumerate(ws):
        x = jnp.tanh(mpmdc.stage(x, i) @ w) * jnp.sqrt(jnp.float32(2.0))
    return jnp.sum(x**2)


# The scaled one has a scalar literal JAX keeps as an array, which cannot be hashed:
# each stage's is its own object, and keyed by identity they kept the stages apart.
@pytest.mark.parametrize("loss", [mlp_loss, scaled_mlp_loss], ids=["plain", "with-literal"])
@pytest.mark.slow
def test_a_stage_repeated_on_meshes_of_one_shape_is_compiled_once(meshes4, monkeypatch, loss):
    """Stages 0-2 are one body (tanh of a matmul) on three meshes of one shape: XLA
    compiles it once, and the other two meshes load that executable onto their devices,
    computing the same bits as an executable compiled for each."""
    compiled = _recording_backends(monkeypatch)
    step = jax.value_and_grad(loss)
    shared = mpmdc.compile(step, meshes4, backend="recording-cpu").lower(WS, X).compile()
    shared_compiles = len(compiled)
    compiled.clear()
    separate = mpmdc.compile(step, meshes4, backend="compiling-cpu").lower(WS, X).compile()
    assert shared.num_executables == separate.num_executables == len(compiled)
    assert len(compiled) - shared_compiles == 3  # three fragments repeat another mesh's module
    got, want = jax.tree.leaves(shared(WS, X)), jax.tree.leaves(separate(WS, X))
    for g, w in zip(got, want):
        assert g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert_same_as_jit(step, meshes4, WS, X)


def test_the_first_call_compiles_each_module_while_the_next_is_lowered(meshes4, monkeypatch):
    """On the call path XLA starts on a module as soon as ``lower`` has emitted it: the
    last module's lowering waits (up to 30 s) for the first compile to begin, which
    happens only if compiles start before lowering ends. The result is jax.jit's."""
    lower_pass = importlib.import_module(
        "mpmdc.passes.lower"
    )  # (the package exports the pass by that name)
    compiled = _recording_backends(monkeypatch)
    started = threading.Event()
    lowered_names, waited = [], []
    original = lower_pass.lower_fragment

    class Signalling(backends.Backend):
        def compile_fragment(self, lowered):
            started.set()
            compiled.append(lowered)
            return super().compile_fragment(lowered)

    def lower_fragment(program, eqn, backend, forms):
        lowered_names.append(eqn.params["name"])
        if eqn.params["name"] == "s0_bwd":  # the last fragment
            waited.append(started.wait(30))
        return original(program, eqn, backend, forms)

    backends.register(Signalling("signalling-cpu", "cpu"))
    monkeypatch.setattr(lower_pass, "lower_fragment", lower_fragment)
    step = jax.value_and_grad(mlp_loss)
    got = mpmdc.compile(step, meshes4, backend="signalling-cpu")(WS, X)
    assert waited == [True] and lowered_names[-1] == "s0_bwd"
    assert len(compiled) == 4  # 7 modules; s1's and s2's forward and s1's backward are loaded
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(jax.jit(step)(WS, X)[0]))


def test_a_stage_with_a_callback_is_compiled_for_each_mesh(meshes4, monkeypatch):
    """A host callback is a Python object the executable keeps: it does not travel to
    another mesh, so each mesh compiles its own."""
    compiled = _recording_backends(monkeypatch)
    seen = []

    def loss(ws, x):
        for i, w in enumerate(ws):
            x = jnp.tanh(mpmdc.stage(x, i) @ w)
            jax.debug.callback(lambda v: seen.append(float(v)), jnp.sum(x))
        return jnp.sum(x**2)

    executable = mpmdc.compile(loss, meshes4, backend="recording-cpu").lower(WS, X).compile()
    assert len(compiled) == executable.num_executables == 4
    got = executable(WS, X)
    jax.effects_barrier()
    assert np.asarray(got) == np.asarray(jax.jit(loss)(WS, X))
    jax.effects_barrier()
    assert len(seen) == 8 and seen[:4] == seen[4:]  # each stage's callback once, as under jit


CACHED_PROGRAM = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
from jax import monitoring
from helpers import mlp_loss
import mpmdc

events = {}
monitoring.register_event_listener(lambda name, **_: events.__setitem__(name, events.get(name, 0) + 1))
ws = [jnp.eye(8) * 0.5 + 0.01 * i for i in range(4)]
x = jnp.arange(32.0).reshape(4, 8) / 32
step = jax.value_and_grad(mlp_loss)
loss, _ = mpmdc.compile(step, mpmdc.make_meshes(4, {"data": 2}))(ws, x)
print(events.get("/jax/compilation_cache/compile_requests_use_cache", 0),
      events.get("/jax/compilation_cache/cache_hits", 0), float(loss))
"""


@pytest.mark.slow
def test_the_persistent_compilation_cache_serves_every_fragment(tmp_path):
    """JAX's persistent cache keys each fragment's module and devices: a second process
    finds every one of its compiles there (no executable is shared across meshes when
    the cache is on, since one loaded from it cannot be serialized again)."""
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", CACHED_PROGRAM],
            env=env,
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        requests, hits, loss = done.stdout.split()
        runs.append((int(requests), int(hits), loss))
    (cold_requests, cold_hits, cold_loss), (warm_requests, warm_hits, warm_loss) = runs
    assert cold_hits == 0 and cold_requests >= 7  # at least the 7 fragments
    assert warm_hits == warm_requests == cold_requests
    assert warm_loss == cold_loss


def test_input_shardings_say_where_each_argument_runs(meshes4):
    P = jax.sharding.PartitionSpec
    step = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes4, in_specs=(None, P("data")))
    executable = step.lower(WS, X).compile()
    (ws_at, x_at), kwargs_at = executable.input_shardings
    assert kwargs_at == {}
    assert [s.mesh for s in ws_at] == list(meshes4)  # each layer's weight where it is used
    assert x_at.spec == P("data") and x_at.mesh == meshes4[0]
    placed_ws, placed_x = jax.device_put((WS, X), (ws_at, x_at))
    got = executable(placed_ws, placed_x)
    want = jax.jit(jax.value_and_grad(mlp_loss))(WS, X)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        # Noise floor 1.2e-07 relative (jax.jit against eager), margin 10x.
        np.testing.assert_allclose(g, w, rtol=1.2e-6)


def test_an_argument_already_where_it_runs_is_not_copied(monkeypatch):
    mesh = mpmdc.make_meshes(1, {"data": 1})
    x = jax.device_put(X, mesh[0].devices.flat[0])  # one device: the same placement as the mesh's
    compiled = mpmdc.compile(lambda x: 2 * x, mesh).lower(x).compile()
    puts = []
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a))
    doubled = compiled(x)
    assert puts == []
    np.testing.assert_array_equal(doubled, 2 * X)


def test_results_share_no_buffer_with_arguments_constants_or_each_other(meshes2):
    """A result that is an argument, a constant or another result is a copy, as under
    ``jax.jit``: donating it deletes nothing else, and the next call still runs."""
    constant = jnp.arange(4.0)

    def f(w, x):
        h = jnp.tanh(mpmdc.stage(x, 0) @ w)
        h = mpmdc.stage(h, 1) * 2
        return {"h": h, "again": h, "w": w, "constant": constant}

    step = mpmdc.compile(f, meshes2)
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    want = jax.jit(f)(w, x)
    consume = jax.jit(lambda a: a * 2, donate_argnums=0)
    for name in want:
        out = step(w, x)
        assert_results_own_their_buffers(out, (w, x, constant))
        others = [w, x, constant] + [out[k] for k in out if k != name]
        consume(out[name])
        assert not any(o.is_deleted() for o in others), name
    assert_same_tree(step(w, x), want)


@pytest.mark.slow
def test_demo_matches_jit():
    from mpmdc.cli.demo import run

    lines = []
    assert run(lines.append, schedule="gpipe") <= 2e-5
    assert any("layer 3 updated" in line and "on mesh3" in line for line in lines)
    assert any(
        line.startswith("  mesh0: 8, ") for line in lines
    )  # GPipe: every microbatch's activations on the first mesh
    assert sum(1 for line in lines if line.startswith("  mesh") and "|" in line) == 4


def test_stage_called_eagerly_returns_what_it_was_given():
    """Outside any transformation the marker is the identity itself: a Python int stays
    that int, a NumPy array that array (not converted to JAX types)."""
    for value in (3, 2.5, np.float32(1.0), np.arange(3), {"h": np.ones(2), "n": 1}):
        assert mpmdc.stage(value, 1) is value
        assert mpmdc.stage(value, every=2) is value


@pytest.mark.parametrize("fn_args", ["tuple", "dict"])
def test_vmap_and_grad_treat_stage_as_identity(fn_args):
    x = jnp.arange(6.0).reshape(2, 3)
    tree = (x, x) if fn_args == "tuple" else {"a": x}
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: bool(jnp.all(a == b)), mpmdc.stage(tree, 3), tree)
    )
    np.testing.assert_array_equal(jax.vmap(lambda v: mpmdc.stage(v, 1) * 2)(x), x * 2)
    np.testing.assert_array_equal(jax.grad(lambda v: jnp.sum(mpmdc.stage(v, 1) ** 2))(x), 2 * x)
    np.testing.assert_array_equal(
        jax.hessian(lambda v: jnp.sum(mpmdc.stage(v, 0) ** 3))(x[0]), jnp.diag(6 * x[0])
    )
