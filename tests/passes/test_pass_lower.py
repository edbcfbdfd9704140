"""The ``lower`` pass (``mpmdc.passes.lower``) on small hand-written programs.

What it promises: it needs a split program; each fragment's ``donate_argnums`` names
the donated program inputs it reads last; fragments with the same body, mesh, specs and
donation (every microbatch's fragment of a stage) share one module, named after the
first of them, so there is one module per distinct fragment and one kept
``jax.stages.Lowered`` for each; for a backend with in-program transfers the
fragment-to-fragment transfers are lowered to ``stablehlo.send``/``stablehlo.recv``
with matching channel ids.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import input_program, mlp_loss
from mpmdc.passes import inline, lower, partition, schedule, split

import mpmdc
from mpmdc import backends
from mpmdc.errors import PassError
from mpmdc.ir.primitives import fragment_p, transfer_p

X = jnp.arange(64.0).reshape(8, 8) / 64
W = jnp.eye(8) * 0.5


def scheduled(fn, meshes, *args, **kwargs):
    return schedule(split(partition(inline(input_program(fn, meshes, *args, **kwargs)))))


def fragments(program):
    return [e for e in program.jaxpr.jaxpr.eqns if e.primitive is fragment_p]


def test_one_module_per_distinct_fragment(meshes2):
    def step(ws, x):
        return mpmdc.accumulate(lambda xb: jax.grad(mlp_loss)(ws, xb), x, microbatches=4)

    program = scheduled(step, meshes2, [W, W], X)
    # 2 before the loop (one also slicing the batch), 3 per microbatch
    assert len(fragments(program)) == 14
    out = lower(program)
    assert out.backend == "cpu"
    assert [name for name, _ in out.modules] == [
        "s0_fwd",
        "s1_fwd",
        "s0_fwd_mb0",
        "s1_fwd_mb0",
        "s0_bwd_mb0",
    ]
    assert len(out.lowerings) == 5
    for name, text in out.modules:
        assert text.startswith(f"module @jit_{name} ")
    # Each module says which fragments share it.
    assert (
        "// ----- fragment s0_bwd_mb0 @mesh0 (cpu), also s0_bwd_mb1, s0_bwd_mb2, s0_bwd_mb3\n"
        in out.as_text()
    )
    assert "// ----- fragment s1_fwd @mesh1 (cpu)\n" in out.as_text()


def test_lower_emits_only_the_fragments_of_the_meshes_asked_for(meshes2):
    # (A process of a multi-process run lowers only its own meshes' fragments.)
    def step(ws, x):
        return mpmdc.accumulate(lambda xb: jax.grad(mlp_loss)(ws, xb), x, microbatches=4)

    program = scheduled(step, meshes2, [W, W], X)
    out = lower(program, meshes=(1,))
    assert [name for name, _ in out.modules] == ["s1_fwd", "s1_fwd_mb0"]
    assert len(out.lowerings) == 2
    assert lower(program, meshes=(0, 1)).modules == lower(program).modules


def test_the_call_path_of_a_process_lowers_only_its_meshes(meshes2, monkeypatch):
    compiled = mpmdc.compile(mlp_loss, meshes2)
    assert compiled._passes_for_call() is compiled.passes  # one process: every mesh
    monkeypatch.setattr(mpmdc.api, "is_here", lambda mesh: mesh is meshes2[1])
    passes = compiled._passes_for_call()
    assert [str(p) for p in passes][-1] == "lower{meshes=(1,)}"
    assert [p.name for p in passes] == [p.name for p in compiled.passes]


def test_lower_needs_a_split_program(meshes2):
    placed = partition(inline(input_program(mlp_loss, meshes2, [W, W], X)))
    with pytest.raises(
        PassError, match="the `lower` pass needs a split program; run `split` before it"
    ):
        lower(placed)


def test_a_donated_input_is_donated_by_its_last_reader_only(meshes2):
    def loss(w, x):
        a = jnp.tanh(mpmdc.stage(x, 0) @ w)
        return jnp.sum(jnp.sin(mpmdc.stage(a, 1)) ** 2)

    def sgd(w, x):  # w is read by stage 0's forward and by its backward (the update)
        return w - 0.1 * jax.grad(loss)(w, x)

    program = scheduled(sgd, meshes2, W, X, donate_argnums=0)
    assert program.donated == (True, False)
    w = program.jaxpr.jaxpr.invars[0]
    readers = [f.params["name"] for f in fragments(program) if w in f.invars]
    assert readers == ["s0_fwd", "s0_bwd"]
    out = lower(program)
    donated = {f.params["name"]: f.params["donate_argnums"] for f in fragments(out)}
    s0_bwd = fragments(out)[-1]
    assert donated == {"s0_fwd": (), "s1_fwd": (), "s0_bwd": (s0_bwd.invars.index(w),)}
    # The module of s0_bwd aliases that argument to a result; no other module donates.
    modules = dict(out.modules)
    assert "tf.aliasing_output" in modules["s0_bwd"]
    assert not any("tf.aliasing_output" in modules[name] for name in ("s0_fwd", "s1_fwd"))


def test_only_an_input_a_result_can_take_over_is_donated(meshes2):
    """A donated input whose last reader makes no result of its shape, dtype and spec
    is not donated there: XLA could not reuse its buffer and JAX would warn."""

    def step(w, n, x):  # n (an int counter) is read last where only floats are made
        loss = jnp.sum(mpmdc.stage(jnp.tanh(mpmdc.stage(x, 0) @ w), 1) * n)
        return loss, w * 2

    program = scheduled(step, meshes2, W, jnp.int32(3), X, donate_argnums=(0, 1))
    out = lower(program)
    n = program.jaxpr.jaxpr.invars[1]
    for f in fragments(out):
        donated = [f.invars[k] for k in f.params["donate_argnums"]]
        assert n not in donated, f.params["name"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable"
        mpmdc.compile(step, meshes2, donate_argnums=(0, 1))(W * 1, jnp.int32(3), X)


@pytest.fixture
def in_program_backend(monkeypatch):
    """A CUDA backend moving values by send/recv, registered for this test only."""
    monkeypatch.setattr(backends, "_registry", dict(backends._registry))
    return backends.register(
        backends.Backend("test-pass-lower-p2p", "cuda", transfers="in-program")
    ).name


def channel_ops(text):
    """``(op, channel, src mesh, dst mesh)`` of every send and recv in a module's text."""
    found = re.findall(
        r'"stablehlo\.(send|recv)".*?handle = (\d+),.*?mpmdc\.dst_mesh = "(\d+)", mpmdc\.src_mesh = "(\d+)"',
        text,
    )
    return [(op, int(channel), int(src), int(dst)) for op, channel, dst, src in found]


def test_an_in_program_backend_lowers_transfers_to_send_and_recv_with_matching_channels(
    meshes2, in_program_backend
):
    program = scheduled(jax.grad(mlp_loss), meshes2, [W, W], X)
    assert [e.primitive.name for e in program.jaxpr.jaxpr.eqns] == [
        "fragment",
        "transfer",
        "fragment",
        "transfer",
        "fragment",
    ]
    out = lower(program, backend=in_program_backend)
    assert out.backend == in_program_backend
    assert not [e for e in out.jaxpr.jaxpr.eqns if e.primitive is transfer_p]
    ops = {name: channel_ops(text) for name, text in out.modules}
    assert ops == {
        "s0_fwd": [("send", 2, 0, 1)],  # the activation
        "s1_fwd": [("recv", 2, 0, 1), ("send", 3, 1, 0)],  # ... and the cotangent back
        "s0_bwd": [("recv", 3, 1, 0)],
    }
    # With the default backend the same program keeps its transfers and has no send/recv.
    plain = lower(program)
    assert [e.primitive.name for e in plain.jaxpr.jaxpr.eqns].count("transfer") == 2
    assert not any(channel_ops(text) for _, text in plain.modules)
