"""The ``lower`` pass (``mpmdc.passes.lower``) on small hand-written programs.

What it promises: it needs a split program; fragments with the same body, mesh, specs and
donation (every microbatch's fragment of a stage) share one module, named after the
first of them, so there is one module per distinct fragment and one kept
``jax.stages.Lowered`` for each; for a backend with in-program transfers the
fragment-to-fragment transfers are lowered to ``stablehlo.send``/``stablehlo.recv``
with matching channel ids.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import fragments, input_program, mlp_loss, scheduled
from mpmdc.passes import dce, in_program_transfers, inline, lower, partition

import mpmdc
from mpmdc import backends
from mpmdc.errors import PassError
from mpmdc.ir.primitives import transfer_p
from mpmdc.pipeline import default_pipeline

X = jnp.arange(64.0).reshape(8, 8) / 64
W = jnp.eye(8) * 0.5


def test_one_module_per_distinct_fragment(meshes2):
    def step(ws, x):
        return mpmdc.accumulate(lambda xb: jax.grad(mlp_loss)(ws, xb), x, microbatches=4)

    program = scheduled(step, meshes2, [W, W], X)
    # 2 before the loop (one also laying the batch out by microbatch), 3 per microbatch
    # (its 3 stage fragments, the first taking its microbatch of the batch)
    assert len(fragments(program)) == 14
    out = lower(program)
    assert out.backend == "cpu"
    assert [name for name, _ in out.modules] == [
        "s0_fwd",
        "s0_fwd_mb0",
        "s1_fwd",
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
    """The call path hands each module to its compiler as ``lower`` makes it (the pass's
    ``on_module`` option) and, in a process holding some meshes, lowers only theirs."""
    compiled = mpmdc.compile(mlp_loss, meshes2)
    offered = []

    def on_module(*args):
        offered.append(args)

    passes = compiled._passes_for_call(on_module)  # one process: every mesh
    assert passes[-1].options == (("on_module", on_module),)
    monkeypatch.setattr(mpmdc.api, "is_here", lambda mesh: mesh is meshes2[1])
    passes = compiled._passes_for_call(on_module)
    assert passes[-1].options == (("meshes", (1,)), ("on_module", on_module))
    assert [p.name for p in passes] == [p.name for p in compiled.passes]


def test_lower_needs_a_split_program(meshes2):
    placed = partition(dce(inline(input_program(mlp_loss, meshes2, [W, W], X))))
    with pytest.raises(
        PassError, match="the `lower` pass needs a split program; run `split` before it"
    ):
        lower(placed)


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
    out = lower(in_program_transfers(program), backend=in_program_backend)
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


def test_the_default_pipeline_of_an_in_program_backend_shows_its_transfers_as_a_stage(
    meshes2, in_program_backend
):
    """``in-program-transfers`` is a pass of the pipeline, right before ``lower``, with its
    own dump; another backend's modules come from the same two passes run by the runner."""
    assert default_pipeline(in_program_backend)[-2:] == ("in-program-transfers", "lower")
    assert "in-program-transfers" not in default_pipeline("cpu")
    lowered = mpmdc.compile(jax.grad(mlp_loss), meshes2, backend=in_program_backend).lower(
        [W, W], X
    )
    assert lowered.stages[-3:] == ("after-donate", "after-in-program-transfers", "stablehlo")
    assert "send[" in lowered.as_text("after-in-program-transfers")
    plain = mpmdc.compile(jax.grad(mlp_loss), meshes2).lower([W, W], X)
    assert plain.stablehlo(backend=in_program_backend) == lowered.stablehlo()
