"""The backend registry: built-ins, plugins, run checks and in-program send/recv transfers."""

import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from mpmdc.passes import PASSES

import mpmdc
from mpmdc import backends, errors
from mpmdc.backends import Backend
from mpmdc.cli.demo import mlp_loss

ROOT = Path(__file__).resolve().parents[2]


def two_stage(ws, x):
    x = mpmdc.stage(x, 0)
    x = jnp.tanh(x @ ws[0])
    x = mpmdc.stage(x, 1)
    return jnp.sum(jnp.tanh(x @ ws[1]) ** 2)


def args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k1, (8, 8)), jax.random.normal(k2, (8, 8))], jax.random.normal(
        k3, (4, 8)
    )


@pytest.fixture(autouse=True)
def _registry_restored(monkeypatch):
    """Backends registered by a test are gone after it."""
    monkeypatch.setattr(backends, "_registry", dict(backends._registry))
    for name, platform in (("test-cuda-p2p", "cuda"), ("test-rocm-p2p", "rocm")):
        backends.register(Backend(name, platform, transfers="in-program"))


def test_built_ins_say_platform_transfers_and_how_they_run():
    assert set(backends.available()) >= {"cpu", "cuda", "rocm", "tpu"}
    for name in ("cpu", "cuda", "rocm", "tpu"):
        backend = backends.get(name)
        assert backend.platform == name and backend.transfers == "device_put"
        assert "jax.jit executable compiled by XLA" in backend.describe()


def test_register_rules():
    custom = Backend(
        "test-cpu-fast", "cpu", compiler_options=(("xla_embed_ir_in_executable", True),)
    )
    assert backends.register(custom) is custom
    assert backends.register(custom) is custom  # registering the same backend again is harmless
    with pytest.raises(errors.BackendError, match="already registered; pass replace=True"):
        backends.register(Backend("test-cpu-fast", "tpu"))
    backends.register(Backend("test-cpu-fast", "cpu"), replace=True)
    assert backends.get("test-cpu-fast").compiler_options == ()
    with pytest.raises(errors.BackendError, match=r"takes an mpmdc\.backends\.Backend, got str"):
        backends.register("cpu")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"transfers": "pigeon"}, "transfers='pigeon' is not one of"),
        ({"platform": "cpu", "transfers": "in-program"}, "only cuda, rocm have"),
        (
            {"platform": "tpu", "transfers": "in-program"},
            "use transfers='device_put' for platform 'tpu'",
        ),
    ],
)
def test_bad_backend_definitions(kwargs, says):
    with pytest.raises(errors.BackendError, match=re.escape(says)):
        Backend("bad", **{"platform": "cpu", **kwargs})


def test_compiler_options_reach_xla(meshes2):
    backends.register(
        Backend("test-cpu-options", "cpu", compiler_options=(("xla_no_such_flag", True),)),
        replace=True,
    )
    step = mpmdc.compile(two_stage, meshes2, backend="test-cpu-options")
    with pytest.raises(Exception, match="xla_no_such_flag"):
        step(*args())


def test_a_backend_for_other_hardware_lowers_but_does_not_run_here(meshes2):
    step = mpmdc.compile(two_stage, meshes2, backend="tpu")
    lowered = step.lower(*args())
    assert "(tpu)" in lowered.as_text("stablehlo")
    with pytest.raises(errors.BackendError, match="compiles for tpu, but mesh 0 has cpu devices"):
        step(*args())


def _plugin_dist(root: Path) -> None:
    """A package installed outside mpmdc that registers backend ``counting-cpu``."""
    (root / "mpmdc_counting_backend").mkdir()
    (root / "mpmdc_counting_backend" / "__init__.py").write_text(
        textwrap.dedent(
            """
            from mpmdc.backends import Backend

            COMPILED = []

            class CountingBackend(Backend):
                def compile_fragment(self, lowered):
                    COMPILED.append(lowered.as_text())
                    return super().compile_fragment(lowered)

            def make():
                return CountingBackend("counting-cpu", "cpu")
            """
        )
    )
    info = root / "mpmdc_counting_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mpmdc-counting-backend\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[mpmdc.backends]\ncounting = mpmdc_counting_backend:make\n"
    )


PLUGIN_USER = """
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 4)
import mpmdc, mpmdc_counting_backend
print("available:", ",".join(mpmdc.backends.available()))

def f(w, x):
    x = mpmdc.stage(x, 0)
    x = jnp.tanh(x @ w)
    return mpmdc.stage(x, 1) * 2.0

w, x = jnp.ones((4, 4)) * 0.1, jnp.arange(8.0).reshape(2, 4)
got = mpmdc.compile(f, mpmdc.make_meshes(2, {"d": 2}), backend="counting-cpu")(w, x)
np.testing.assert_array_equal(got, jax.jit(f)(w, x))
print("compiled fragments:", len(mpmdc_counting_backend.COMPILED))
"""


@pytest.mark.slow
def test_backend_from_an_entry_point_of_another_package(tmp_path):
    _plugin_dist(tmp_path)
    env = {"PYTHONPATH": str(tmp_path), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", PLUGIN_USER], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "available: counting-cpu,cpu,cuda,rocm,tpu" in result.stdout
    assert "compiled fragments: 2" in result.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "mpmdc", "backends"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert "counting-cpu: lowers for cpu" in listing.stdout


def test_a_broken_plugin_is_named(monkeypatch):
    broken = metadata.EntryPoint("broken", "no_such_module_xyz:make", "mpmdc.backends")
    monkeypatch.setattr(backends.metadata, "entry_points", lambda group: [broken])
    monkeypatch.setattr(backends, "_entry_points_loaded", False)
    with pytest.raises(
        errors.BackendError, match=r"plugin 'broken' \(no_such_module_xyz:make\).*failed to load"
    ):
        backends.get("cpu")


# ------------------------------------------------------------ in-program transfers

_OP = re.compile(
    r'"stablehlo\.(send|recv)".*?channel_handle<handle = (\d+), type = 1>.*?'
    r'mpmdc\.dst_mesh = "(\d+)", mpmdc\.src_mesh = "(\d+)"'
)


def channel_ops(lowered, backend):
    """``{(op, channel): (fragment mesh, src, dst)}`` over every module of ``backend``."""
    mesh_of = {
        e.params["name"]: e.params["mesh"]
        for e in lowered.program("after-split").jaxpr.jaxpr.eqns
        if e.primitive.name == "fragment"
    }
    ops = {}
    for name, module in lowered.stablehlo(backend=backend).items():
        for op, channel, dst, src in _OP.findall(module):
            assert (op, int(channel)) not in ops, f"channel {channel} used twice for {op}"
            ops[(op, int(channel))] = (mesh_of[name], int(src), int(dst))
    return ops


@pytest.mark.parametrize("backend", ["test-cuda-p2p", "test-rocm-p2p"])
def test_every_send_has_one_recv_with_its_channel(meshes4, backend):
    params = [(jnp.ones((8, 8)), jnp.ones(8))] * 4
    step = mpmdc.compile(jax.value_and_grad(mlp_loss), meshes4, backend=backend)
    lowered = step.lower(params, jnp.ones((4, 8)), jnp.ones((4, 8)))
    ops = channel_ops(lowered, backend)
    sends = {c: v for (op, c), v in ops.items() if op == "send"}
    recvs = {c: v for (op, c), v in ops.items() if op == "recv"}
    assert sends.keys() == recvs.keys() and len(sends) == 6  # 3 forward + 3 backward boundaries
    for channel, (mesh, src, dst) in sends.items():
        assert mesh == src and recvs[channel] == (dst, src, dst)
    # No transfer is left for the runtime: all cross-mesh values travel in-program.
    program_text = lowered.as_text("stablehlo")
    assert "transfer[" not in program_text and "send[" in program_text


def test_send_recv_channels_do_not_collide_with_collectives(meshes2):
    def loss(w, x):
        x = mpmdc.stage(x, 0)
        x = jnp.tanh(x @ w)
        x = mpmdc.stage(x, 1)
        total = jax.shard_map(
            lambda v: jax.lax.psum(v.sum(0, keepdims=True), "data"),
            mesh=meshes2[1],
            in_specs=P("data"),
            out_specs=P(),
        )(x)
        return jnp.sum(total**2)

    lowered = mpmdc.compile(jax.value_and_grad(loss), meshes2).lower(
        jnp.ones((8, 8)), jnp.ones((8, 8))
    )
    modules = lowered.stablehlo(backend="test-cuda-p2p")
    collective = set(
        re.findall(r"all_reduce.*?channel_handle<handle = (\d+)", "".join(modules.values()))
    )
    assert collective
    assert collective.isdisjoint(str(c) for _, c in channel_ops(lowered, "test-cuda-p2p"))


def test_in_program_backend_refuses_to_run_here(meshes2):
    step = mpmdc.compile(two_stage, meshes2, backend="test-cuda-p2p")
    assert "stablehlo.send" in step.lower(*args()).as_text("stablehlo")
    with pytest.raises(errors.BackendError, match="single-process runtime does not have"):
        step(*args())
    # The same program runs with the default device_put transfers.
    ws, x = args()
    np.testing.assert_array_equal(
        mpmdc.compile(two_stage, meshes2)(ws, x), jax.jit(two_stage)(ws, x)
    )


def test_lower_refuses_transfers_its_backend_does_not_make(meshes2):
    program = mpmdc.compile(two_stage, meshes2).lower(*args()).program("after-donate")
    with pytest.raises(errors.PassError, match="run `in-program-transfers` right before"):
        PASSES["lower"].with_options(backend="test-cuda-p2p").run(program)
    paired = PASSES["in-program-transfers"].run(program)
    with pytest.raises(errors.PassError, match="leave that pass out for this backend"):
        PASSES["lower"].run(paired)
    assert PASSES["lower"].with_options(backend="test-cuda-p2p").run(paired).modules
