"""The ``mpmdc`` command line: ``dump`` output, dump folders, usage errors, help, pipes."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpmdc import cli
from mpmdc.cli.parsing import load_module

ROOT = Path(__file__).resolve().parents[2]
MLP2 = "tests/programs/mlp2_grad.py:lowered"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def mlp2():
    return load_module(ROOT / "tests/programs/mlp2_grad.py").lowered()


def run(capsys, *argv):
    """``(exit status, stdout, stderr)`` of ``mpmdc *argv`` run in this process."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_usage_error(capsys, *argv, says):
    status, out, err = run(capsys, *argv)
    assert status == 2, (out, err)
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in [says] if isinstance(says, str) else says:
        assert text in err, err
    return err


def test_list_stages(capsys, mlp2):
    status, out, _ = run(capsys, "dump", MLP2, "--list-stages")
    assert status == 0
    assert tuple(out.split()) == mlp2.stages


def test_list_stages_neither_traces_nor_lowers(capsys, tmp_path):
    # The names come from the pass pipeline: the target is found but never called.
    target = tmp_path / "slow.py"
    target.write_text("def lowered():\n    raise RuntimeError('lowered')\n")
    status, out, err = run(capsys, "dump", f"{target}:lowered", "--list-stages")
    assert status == 0, err
    assert out.split()[0] == "input" and out.split()[-1] == "stablehlo"


def test_one_stage_is_the_lowered_text(capsys, mlp2):
    status, out, _ = run(capsys, "dump", MLP2, "--stage", "after-partition")
    assert status == 0
    assert out == mlp2.as_text("after-partition")


def test_all_stages_each_under_a_header(capsys, mlp2):
    status, out, _ = run(capsys, "dump", MLP2, "--stage", "all")
    assert status == 0
    headers = [
        line for line in out.splitlines() if line.startswith("// ----- ") and "fragment" not in line
    ]
    assert headers == [f"// ----- {s}" for s in mlp2.stages]
    assert out.index("// ----- after-split") < out.index("// ----- stablehlo")


def test_a_backend_that_is_no_platform_is_chosen_with_backend(capsys):
    # The program registers cuda-in-program (CUDA with send/recv transfers) as it loads.
    program = "tests/programs/in_program_transfers.py:lowered"
    status, _, err = run(capsys, "dump", program, "--platform", "cuda-in-program")
    assert status == 2 and "choose it with --backend cuda-in-program" in err
    status, out, err = run(
        capsys, "dump", program, "--stage", "stablehlo", "--backend", "cuda-in-program"
    )
    assert status == 0, err
    assert "(cuda-in-program)" in out and "stablehlo.send" in out


def test_stablehlo_per_platform_names_fragment_and_mesh(capsys, mlp2):
    status, out, _ = run(
        capsys, "dump", MLP2, "--stage", "stablehlo", "--platform", "tpu", "--platform", "rocm"
    )
    assert status == 0
    for platform in ("tpu", "rocm"):
        for name, module in mlp2.stablehlo(platform).items():
            mesh = 0 if name.startswith("s0") else 1
            assert f"// ----- fragment {name} @mesh{mesh} ({platform})\n{module}" in out


def test_dump_dir_writes_every_stage_and_module(capsys, tmp_path, mlp2):
    target = tmp_path / "out"
    status, out, _ = run(
        capsys, "dump", MLP2, "--dump-dir", str(target), "--platform", "cpu", "--platform", "tpu"
    )
    assert status == 0 and str(target) in out
    names = sorted(p.name for p in target.iterdir())
    stages = [f"{i:02d}.{s}.txt" for i, s in enumerate(mlp2.stages)]
    modules = [f"{f}.{p}.mlir" for p in ("cpu", "tpu") for f in mlp2.stablehlo(p)]
    assert names == sorted(stages + modules)
    assert (target / "09.after-split.txt").read_text() == mlp2.as_text("after-split")
    assert (target / "s1_fwd.tpu.mlir").read_text() == mlp2.stablehlo("tpu")["s1_fwd"]
    # A second dump replaces the first one: only the new platform's modules remain.
    assert run(capsys, "dump", MLP2, "--dump-dir", str(target))[0] == 0
    assert not list(target.glob("*.tpu.mlir")) and list(target.glob("*.cpu.mlir"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_dump_dir_is_atomic(capsys, tmp_path, monkeypatch):
    target = tmp_path / "out"
    real_write = Path.write_text
    written = []

    def failing_write(self, text, *args, **kwargs):
        if len(written) == 3:
            raise OSError("disk full")
        written.append(self)
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing_write)
    with pytest.raises(OSError, match="disk full"):
        cli.main(["dump", MLP2, "--dump-dir", str(target)])
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging copy


def test_dump_dir_refuses_a_folder_with_other_files(capsys, tmp_path):
    (tmp_path / "notes.md").write_text("mine")
    err = assert_usage_error(capsys, "dump", MLP2, "--dump-dir", str(tmp_path), says="notes.md")
    assert "not mpmdc dump files" in err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.md"]


PLAIN = """
import jax.numpy as jnp
import mpmdc

def loss(w, x):
    x = mpmdc.stage(x, 0)
    x = jnp.tanh(x @ w)
    x = mpmdc.stage(x, 1)
    return jnp.sum(x * x)

def broken():
    raise ValueError("no model today")

def not_lowered():
    return 42

def bad_stage():
    meshes = mpmdc.make_meshes(2, {"data": 2})
    return mpmdc.compile(lambda x: mpmdc.stage(x, -1), meshes).lower(jnp.ones(3))
"""


@pytest.fixture
def plain_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(PLAIN)
    return path


def dump_plain(capsys, plain_file, meshes):
    """``mpmdc dump`` of the plain file's ``loss`` on ``meshes``: (status, stdout, stderr)."""
    return run(
        capsys, "dump", f"{plain_file}:loss", "--args", "f32[8,16], f32[4,8]", "--meshes", meshes
    )


def test_plain_function_with_args_and_meshes(capsys, plain_file):
    status, out, _ = dump_plain(capsys, plain_file, "2x(data=2)")
    assert status == 0
    assert "name=s0_fwd" in out and "name=s1_fwd" in out and "transfer[" in out
    assert "b:float32[4,8] @mesh0 P()  # args[1]" in out


def test_a_warning_is_said_by_the_command_not_at_a_line_of_it(capsys, plain_file):
    """Once the program is traced no frame of the user's is on the stack: a warning says
    the command's name, its category and text, not the console script's line."""
    status, _, err = dump_plain(capsys, plain_file, "3x(data=2)")
    assert status == 0
    assert re.search(r"^mpmdc dump: warning: IdleMeshWarning: mesh2 .* runs no stage", err, re.M)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["dump", MLP2, "--stage", "after-nothing"],
            ["'after-nothing'", "after-split", "stablehlo"],
        ),
        (
            ["dump", MLP2, "--stage", "stablehlo", "--platform", "metal"],
            ["'metal'", "platforms: cpu, cuda, rocm, tpu"],
        ),
        (
            ["dump", MLP2, "--stage", "stablehlo", "--backend", "metal"],
            ["'metal'", "available backends: cpu, cuda, ", "tpu"],
        ),
        (["dump", "tests/programs/missing.py:lowered"], "no such file: tests/programs/missing.py"),
        (["dump", "tests/programs/mlp2_grad.py:lowerd"], ["'lowerd'", "lowered"]),
        (["dump", "tests/programs/mlp2_grad.py"], "is not FILE.py:TARGET"),
        (
            ["dump", "{plain}:loss", "--args", "f32[8,16], q7[2]", "--meshes", "2x(data=2)"],
            ["--args", "'q7[2]'"],
        ),
        (
            ["dump", "{plain}:loss", "--args", "f32[8,16]", "--meshes", "2x(data)"],
            ["--meshes", "4x(data=2)"],
        ),
        (["dump", "{plain}:loss", "--args", "f32[8,16], f32[4,8]"], "--args needs --meshes"),
        (
            ["dump", "{plain}:loss", "--args", "f32[16,4]", "--meshes", "2x(data=2)"],
            ["--args gives 1 argument type, but", ":loss(w, x) cannot take them", "'x'"],
        ),
        (["dump", "{plain}:loss"], ["takes arguments (w, x)", "--args"]),
        (["dump", "{plain}:not_lowered"], "returned int, not mpmdc.Lowered"),
        (["dump", MLP2, "--stages", "all"], "mpmdc dump: error: unrecognized arguments: --stages"),
        (
            ["launch", "-n", "2", "--bogus", "--", "true"],
            "mpmdc launch: error: unrecognized arguments: --bogus",
        ),
        (["dump"], "FILE.py:TARGET"),
        (
            ["launch", "-n", "2", "--max-restarts", "-1", "--", "true"],
            "mpmdc launch: error: --max-restarts must be at least 0, got -1",
        ),
        (
            ["launch", "-n", "2"],
            ["mpmdc launch: error: give the command", "(see `mpmdc launch --help`)"],
        ),
        ([], "COMMAND"),
    ],
)
def test_usage_mistakes_exit_2_with_one_line(capsys, plain_file, argv, says):
    argv = [a.replace("{plain}", str(plain_file)) for a in argv]
    assert_usage_error(capsys, *argv, says=says)


def test_user_code_and_compiler_failures_exit_1_with_one_line(capsys, plain_file):
    status, out, err = run(capsys, "dump", f"{plain_file}:broken")
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "raised ValueError at line 12: no model today" in err
    status, _, err = run(capsys, "dump", f"{plain_file}:bad_stage")
    assert status == 1 and "StageError" in err and err.count("\n") == 1


def test_help_explains_with_examples(capsys):
    for argv in (["--help"], ["dump", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "examples:" in out and "mpmdc dump" in out
    assert (
        "--dump-dir" in out and "--list-stages" in out and "--args" in out and "exit status" in out
    )


def test_backends_lists_the_built_ins(capsys):
    status, out, _ = run(capsys, "backends")
    assert status == 0
    for name in ("cpu", "cuda", "rocm", "tpu"):
        assert f"{name}: lowers for {name}; transfers by runtime device_put" in out


def test_dump_text_has_no_addresses_or_source_locations(capsys):
    # Across processes and hash seeds the text is identical: tests/e2e/test_determinism.py.
    status, out, err = run(
        capsys,
        "dump",
        "tests/programs/tied_embedding.py:lowered",
        "--stage",
        "all",
        "--platform",
        "cpu",
        "--platform",
        "tpu",
    )
    assert status == 0, err
    assert not re.search(r" at 0x[0-9a-f]+", out)  # no object addresses
    assert str(ROOT) not in out and ".py:" not in out  # no source locations
    assert "stablehlo.dot_general" in out and "transfer[" in out


def test_help_lists_each_command_once(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "dump", "schedule", "backends", "launch"):
        assert len(re.findall(rf"^\s+{command}\s", out, re.M)) == 1, out


def test_a_reader_that_leaves_early_gets_no_traceback():
    # `mpmdc schedule ... | head -1`: the pipe is closed before mpmdc writes.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpmdc",
            "schedule",
            "--schedule",
            "1f1b",
            "--stages",
            "4",
            "--microbatches",
            "8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err


def test_dump_with_passes_and_options(capsys, mlp2):
    status, out, err = run(
        capsys,
        "dump",
        "tests/programs/mlp2_grad.py:lowered",
        "--list-stages",
        "--passes",
        "inline,dce,partition,split,lower{backend=tpu}",
    )
    assert status == 0, err
    assert out.split() == [
        "input",
        "after-plan",
        "after-inline",
        "after-dce",
        "after-partition",
        "after-split",
        "stablehlo",
    ]
    assert_usage_error(
        capsys,
        "dump",
        "tests/programs/mlp2_grad.py:lowered",
        "--passes",
        "lower{x=1}",
        says="pass `lower` has no option x",
    )
