"""The ``mpmdc`` command line (also ``python -m mpmdc``).

Exit status: 0 on success, 1 when the compiler or the user's code fails on a valid
request, 2 for a usage mistake. Every failure prints one line, never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import traceback
import warnings
from pathlib import Path

import jax

from mpmdc import _jax_compat as compat
from mpmdc import backends, distributed, schedules
from mpmdc import exporting as mpmdc_exporting
from mpmdc.cli.demo import run as run_demo
from mpmdc.cli.dump import dump_files, render_stages, stage_header, targets, write_dump_dir
from mpmdc.cli.launch import launch
from mpmdc.cli.parsing import DumpOptions, find_target, load_module, lowered_from_target
from mpmdc.errors import (
    InternalError,
    MpmdcError,
    ScheduleError,
    TargetError,
    UsageError,
)
from mpmdc.passes import PASSES
from mpmdc.pipeline import DEFAULT_PIPELINE, stage_names, verifying
from mpmdc.schedules import (
    BUBBLE_FORMULAS,
    UNIT_COSTS,
    Layout,
    bubble_formula,
    bubble_time_formula,
    cost_of,
    formula_holds,
    simulate,
    steady_bubble,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_MAIN_EPILOG = """\
examples:
  mpmdc demo
  mpmdc launch -n 4 -- mpmdc demo
  mpmdc dump tests/programs/mlp2_grad.py:lowered --stage all
  mpmdc dump model.py:loss --args "f32[8,16], f32[16,4]" --meshes "4x(data=2)" --stage stablehlo

exit status: 0 success, 1 compile or user-code failure, 2 usage mistake.
"""

_LAUNCH_DESCRIPTION = """\
Run CMD as N processes of one multi-process mpmdc program on this machine (like
torchrun, for local runs and CI). Each process learns the coordinator address, its
id and its cross-host transfer address (all on the loopback interface) from MPMDC_*
variables that mpmdc.distributed.initialize() reads, and gets K CPU devices. Output
lines are prefixed with the process id. The exit status is 0 only if every process
exits 0; when one fails, the others are stopped after --grace seconds and the
launcher says which process failed first and how. A process that makes no progress
for --fault-timeout seconds while the others wait for it is the one that failed.
With --max-restarts R, after a failure every process starts again (up to R times),
with MPMDC_RESTART_COUNT set to the number of restarts so far: a script that resumes
from its CheckpointManager's latest step finishes on its own.
"""

_LAUNCH_EPILOG = """\
examples:
  mpmdc launch -n 4 -- mpmdc demo
  mpmdc launch -n 2 --devices-per-process 2 --timeout 300 -- python train.py
  mpmdc launch -n 4 --max-restarts 3 -- python examples/resume_training.py /tmp/run

exit status: 0 all processes succeeded (in some attempt); else the first failing
process's status in the last attempt (1 for a signal); 124 --timeout; 2 usage mistake.
"""

_DUMP_DESCRIPTION = """\
Show what every pass of mpmdc does to a program.

TARGET is FILE.py:NAME. NAME is either a zero-argument function returning an
mpmdc.Lowered (e.g. `return mpmdc.compile(step, meshes).lower(params, x)`), or a
plain JAX function together with --args (its argument types) and --meshes (the
meshes to compile for). The file's folder is importable while it loads.

Stages are `input`, `after-<pass>` for each pass and `stablehlo` (one module per
fragment, each under a header naming fragment, mesh and backend). Output is
deterministic: no addresses, device ids or source paths.

The command runs on virtual CPU devices (8, or as many as --meshes needs) unless
JAX_PLATFORMS says otherwise; --platform and --backend only choose what StableHLO
is emitted for, so TPU, CUDA and ROCm modules can be produced on any machine.
"""

_DUMP_EPILOG = """\
examples:
  mpmdc dump tests/programs/mlp4_grad.py:lowered --list-stages
  mpmdc dump step.mpmdc --stage after-split      (an exported program: Exported.serialize())
  mpmdc dump tests/programs/mlp4_grad.py:lowered --stage all
  mpmdc dump tests/programs/mlp4_grad.py:lowered --stage stablehlo --platform tpu
  mpmdc dump tests/programs/mlp4_grad.py:lowered --dump-dir /tmp/mlp4 --platform cpu --platform cuda
  mpmdc dump model.py:loss --args "f32[8,16], f32[16,4]" --meshes "4x(data=2)"
  mpmdc dump tests/programs/mlp4_grad.py:lowered --passes "inline,dce,partition,split,lower{backend=tpu}" --stage all

--dump-dir writes NN.<stage>.txt for every stage and <fragment>.<platform>.mlir
for every fragment and --platform or --backend (default: the program's backend), all
at once: on failure nothing is written. An existing folder is replaced only if it
holds nothing but an earlier dump.

exit status: 0 success, 1 compile or user-code failure, 2 usage mistake.
"""


def _passes_table() -> str:
    """The registered passes with their options and summaries, for ``dump --help``."""
    lines = ["", "passes (--passes, in this order by default: " + ",".join(DEFAULT_PIPELINE) + "):"]
    for p in PASSES.values():
        options = (
            "{" + ",".join(f"{o}=..." for o in p.option_names()) + "}" if p.option_names() else ""
        )
        lines.append(f"  {p.name + options:<26} {p.summary}")
    return "\n".join(lines) + "\n"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes become one-line ``UsageError``s."""

    def error(self, message):
        err = UsageError(message)
        err.command = self.prog
        raise err


def _start_jax(devices_needed: int) -> None:
    """CPU devices for the command (before JAX starts its backends, where still possible)."""
    if compat.backends_are_initialized():
        return
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(8, devices_needed))


def _user_code(run, options):
    """Call ``run()``; an exception from the user's file becomes a one-line ``TargetError``."""
    try:
        return run()
    except MpmdcError:
        raise
    except Exception as err:
        user_file = str(options.file.resolve())
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == user_file]
        where = f" at line {frames[-1].lineno}" if frames else ""
        raise TargetError(
            f"{options.target} raised {type(err).__name__}{where}: {err}".rstrip(": ")
        ) from err


def _dump_exported(args) -> int:
    """``mpmdc dump FILE.mpmdc``: the stages an exported program recorded (nothing is
    traced, compiled or run)."""
    given = [
        name
        for name, value in (
            ("--platform", args.platform),
            ("--backend", args.backend),
            ("--dump-dir", args.dump_dir),
            ("--transfers", args.transfers),
            ("--args", args.args),
            ("--meshes", args.meshes),
            ("--passes", args.passes),
        )
        if value
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be used with an exported program, which holds the "
            f"text of its stages only; use --stage or --list-stages"
        )
    path = Path(args.target)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror or err}") from None
    exported = mpmdc_exporting.deserialize(data)
    if args.list_stages:
        print("\n".join(exported.stages))
        return EXIT_OK
    if args.stage != "all" and args.stage not in exported.stages:
        raise UsageError(f"unknown stage {args.stage!r}; stages: all, {', '.join(exported.stages)}")
    if args.stage != "all":
        sys.stdout.write(exported.as_text(args.stage))
        return EXIT_OK
    for name in exported.stages:
        sys.stdout.write(f"{stage_header(name)}\n{exported.as_text(name)}")
    return EXIT_OK


def _dump(args) -> int:
    if args.target.endswith(".mpmdc"):
        return _dump_exported(args)
    options = DumpOptions.from_cli(
        target=args.target,
        stage=args.stage,
        platforms=tuple(args.platform or ()),
        backends=tuple(args.backend or ()),
        dump_dir=args.dump_dir,
        list_stages=args.list_stages,
        transfers=args.transfers,
        args=args.args,
        meshes=args.meshes,
        passes=args.passes,
    )
    _start_jax(options.meshes.devices_needed if options.meshes else 0)
    module = _user_code(lambda: load_module(options.file), options)
    # Checked once the file is loaded: it may register backends.
    for platform in options.platforms:
        if platform not in backends.PLATFORMS:
            hint = (
                f"; {platform!r} is a registered backend: choose it with --backend {platform}"
                if platform in backends.available()
                else ""
            )
            raise UsageError(
                f"unknown platform {platform!r}; platforms: {', '.join(backends.PLATFORMS)}{hint}"
            )
    for name in options.backends:
        if name not in backends.available():
            raise UsageError(
                f"unknown backend {name!r}; available backends: {', '.join(backends.available())}"
            )
    emit_for = targets(options.platforms, options.backends)
    target = find_target(module, options.file, options.target_name)
    if options.list_stages:
        # The pass pipeline names the stages: nothing needs tracing or lowering.
        backend = options.backends[0] if len(options.backends) == 1 else None
        print("\n".join(stage_names(options.passes, backend)))
        return EXIT_OK
    with verifying():  # a dump is for looking closely: every pass's output is checked
        lowered = _user_code(lambda: lowered_from_target(target, options), options)
        if options.passes is not None:
            lowered = lowered.rerun(options.passes)

    if options.transfers:
        sys.stdout.write(lowered.transfer_report().as_text())
        return EXIT_OK
    if options.dump_dir is not None:
        own = {"backend": lowered.program(lowered.stages[-1]).backend}
        files = dump_files(lowered, emit_for or (own,))
        write_dump_dir(options.dump_dir, files)
        print(f"wrote {len(files)} files to {options.dump_dir}")
        return EXIT_OK
    if options.stage != "all" and options.stage not in lowered.stages:
        raise UsageError(
            f"unknown stage {options.stage!r}; stages: all, {', '.join(lowered.stages)}"
        )
    sys.stdout.write(render_stages(lowered, options.stage, emit_for))
    return EXIT_OK


def _parse_costs(text: str | None) -> dict[str, float]:
    """``--costs``: non-negative numbers by kind; a backward given only as ``I`` and ``W``
    costs their sum as ``B``, one given only as ``B`` costs half of it as each."""
    given: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        kind, _, value = (x.strip() for x in part.partition("="))
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if kind not in UNIT_COSTS or not number >= 0:
            raise UsageError(
                f"--costs: {part!r} is not KIND=NUMBER with KIND one of F, B, I, W and a "
                f"non-negative number (e.g. F=1,B=2,I=1,W=1)"
            )
        given[kind] = number
    costs = {**UNIT_COSTS, **given}
    if "B" not in given and ("I" in given or "W" in given):
        costs["B"] = costs["I"] + costs["W"]
    elif "B" in given and not ("I" in given or "W" in given):
        costs["I"] = costs["W"] = given["B"] / 2
    return costs


def _as_flags(message: str) -> str:
    """A schedule error's advice as this command's flag: the library names the Python
    call (``mpmdc.compile(..., schedule='gpipe')``), this command takes ``--schedule``."""
    message = re.sub(r"mpmdc\.compile\(\.\.\., (schedule='[\w-]+')\)", r"\1", message)
    return re.sub(r"schedule='([\w-]+)'", r"--schedule \1", message)


def _formula_note(name: str, costs, layout) -> str:
    """The published steady bubble of schedule ``name``, or why it does not apply."""
    if not formula_holds(name, costs):
        return " (the published formula does not hold at these costs: W is too large)"
    if not formula_holds(name, costs, layout.num_meshes, layout.microbatches):
        return (
            f" (the published formula does not hold at {layout.microbatches} microbatches: "
            f"too few to fill the pipeline)"
        )
    return f" (published formula {bubble_time_formula(name, layout.num_meshes, costs):g})"


def _schedule(args) -> int:
    costs = _parse_costs(args.costs)
    try:
        schedule = schedules.get(args.schedule)
        # Default: the meshes the schedule runs that many stages on (one per stage, or
        # half as many for interleaved 1F1B and the V schedules).
        per_mesh = schedule.stages_for(1) if isinstance(schedule, schedules.Schedule) else 1
        meshes = args.meshes or max(1, args.stages // per_mesh)
        choice = None
        if isinstance(schedule, schedules.Chooser):
            pipeline = schedules.Pipeline(
                args.stages,
                meshes,
                args.microbatches,
                None,
                lambda action: cost_of(costs, action),
                (1.0,) * args.stages,
                (None,) * meshes,
            )
            schedule, choice = schedule.choose(pipeline)
        placement = schedule.placement(args.stages, meshes)
        layout = Layout.make(args.stages, args.microbatches, placement, num_meshes=meshes)
        per_mesh = schedule.actions(layout)
        timeline = simulate(per_mesh, layout, costs)
        steady = steady_bubble(per_mesh, layout, costs)
    except ScheduleError as err:
        raise UsageError(_as_flags(str(err))) from None
    cost_text = " ".join(f"{k}={v:g}" for k, v in costs.items())
    if choice is not None:
        print(
            f"auto chose {choice.name}: step {choice.step_time:g}, bubble {choice.bubble:g} per "
            f"mesh (steps back to back, in the units of --costs)"
        )
    print(
        f"schedule {schedule.name}: {layout.num_stages} stages on {layout.num_meshes} meshes, "
        f"{layout.microbatches} microbatches, costs {cost_text}"
    )
    print(timeline.ascii())
    line = f"makespan {timeline.makespan:g}, bubble fraction {timeline.bubble_fraction:.4f}"
    if schedule.name in ("gpipe", "1f1b", "interleaved-1f1b"):
        v = layout.num_stages // layout.num_meshes
        formula = bubble_formula(schedule.name, layout.num_meshes, layout.microbatches, v)
        line += f" (formula (p-1)/(v*m+p-1) = {formula:.4f})"
    print(line)
    line = f"steady training (steps back to back): bubble {steady:g} per mesh and step"
    if schedule.name in BUBBLE_FORMULAS:
        line += _formula_note(schedule.name, costs, layout)
    print(line)
    if args.png:
        timeline.save_png(args.png, title=f"{schedule.name}: bubble {timeline.bubble_fraction:.3f}")
        print(f"wrote {args.png}")
    if args.trace:
        Path(args.trace).write_text(timeline.chrome_trace())
        print(f"wrote {args.trace}")
    return EXIT_OK


def _backends(args) -> int:
    for name in backends.available():
        print(backends.get(name).describe())
    return EXIT_OK


def _demo(args) -> int:
    distributed.initialize()  # under `mpmdc launch`; nothing in one process
    _start_jax(8)
    worst = run_demo(schedule=args.schedule, trace=args.trace)
    return EXIT_OK if worst <= 2e-5 else EXIT_FAILED


def _launch(args) -> int:
    command = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not command:
        raise UsageError(
            "give the command to run after --, e.g. mpmdc launch -n 2 -- python train.py"
        )
    for name in ("processes", "devices_per_process"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    for name in ("timeout", "fault_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UsageError(
                f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}"
            )
    return launch(
        command,
        args.processes,
        devices_per_process=args.devices_per_process,
        timeout=args.timeout,
        fault_timeout=args.fault_timeout,
        grace=args.grace,
        max_restarts=args.max_restarts,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpmdc`` command."""
    parser = _Parser(
        prog="mpmdc",
        description="mpmdc: an MPMD compiler middle-end for JAX. It splits one JAX function "
        "marked with mpmdc.stage into per-mesh programs joined by transfers, and runs them.",
        epilog=_MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    demo = sub.add_parser(
        "demo",
        help="run a pipelined 4-stage MLP training step on 4 meshes of 2 virtual CPU devices",
        description="Compile and run one SGD step of a 4-stage MLP over 8 microbatches on 8 "
        "virtual CPU devices split into 4 meshes; compare with jax.jit, and show memory per "
        "mesh and the measured timeline.",
    )
    demo.add_argument(
        "--schedule",
        default="1f1b",
        # The demo's 4 stages on 4 meshes: the schedules of one stage per mesh.
        choices=[n for n, cls in schedules.SCHEDULES.items() if cls().stages_for(4) == 4]
        + ["auto"],
        help="pipeline schedule (default: 1f1b)",
    )
    demo.add_argument(
        "--trace", metavar="FILE", help="write the measured timeline as Chrome/Perfetto JSON"
    )
    demo.set_defaults(handler=_demo)

    dump = sub.add_parser(
        "dump",
        help="print or save the IR after any pass, and the StableHLO per fragment",
        description=_DUMP_DESCRIPTION,
        epilog=_DUMP_EPILOG + _passes_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dump.add_argument(
        "target",
        metavar="FILE.py:TARGET",
        help="the program to dump, or FILE.mpmdc: an exported program's recorded stages",
    )
    dump.add_argument(
        "--stage",
        default="after-split",
        metavar="NAME",
        help="stage to print: `all`, `input`, `after-<pass>` or `stablehlo` (default: after-split)",
    )
    dump.add_argument(
        "--platform",
        action="append",
        metavar="PLATFORM",
        help="platform to emit StableHLO for: cpu, cuda, rocm or tpu; repeat for several "
        "(default: the program's backend)",
    )
    dump.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="registered backend to emit StableHLO with, such as an in-program transfer "
        "variant (`mpmdc backends` lists them); repeat for several",
    )
    dump.add_argument(
        "--dump-dir", type=Path, metavar="DIR", help="write every stage and module into DIR"
    )
    dump.add_argument(
        "--list-stages",
        action="store_true",
        help="print the stage names of the pass pipeline (--passes, or the default one) and "
        "exit, without tracing or lowering",
    )
    dump.add_argument(
        "--transfers",
        action="store_true",
        help="print what one step moves between meshes and what each mesh holds, and exit",
    )
    dump.add_argument(
        "--args",
        metavar="TYPES",
        help='argument types of a plain-function TARGET, e.g. "f32[8,16], f32[16,4], i32[]"',
    )
    dump.add_argument(
        "--meshes",
        metavar="MESHES",
        help='meshes for a plain-function TARGET, e.g. "4x(data=2)" or "2x(data=2,model=2)"',
    )
    dump.add_argument(
        "--passes",
        metavar="PIPELINE",
        help="run these passes on the traced program instead, with options by name, e.g. "
        '"inline,dce,partition,split,lower{backend=tpu}" (the passes are listed below)',
    )
    dump.set_defaults(handler=_dump)

    schedule = sub.add_parser(
        "schedule",
        help="simulate a pipeline schedule: ASCII timeline and bubble fraction",
        description="Simulate a pipeline schedule with per-action costs and print each mesh's "
        "timeline (one box per action: <stage><F|B|I|W><microbatch>, idle time as dots), the "
        "makespan and the bubble fraction, with the textbook formula where there is one.",
        epilog="examples:\n  mpmdc schedule --schedule 1f1b --stages 4 --microbatches 8\n"
        "  mpmdc schedule --schedule interleaved-1f1b --stages 8 --meshes 4 --microbatches 8\n"
        "  mpmdc schedule --schedule zb-h1 --stages 4 --microbatches 8 --png zb.png --trace zb.json\n"
        "  mpmdc schedule --schedule zb-v --stages 8 --meshes 4 --microbatches 8 --costs F=1,I=1,W=1\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    schedule.add_argument(
        "--schedule",
        default="1f1b",
        metavar="NAME",
        help=f"one of {', '.join(schedules.SCHEDULES)}, or auto (the fastest at --costs)",
    )
    schedule.add_argument("--stages", type=int, required=True, help="pipeline stages")
    schedule.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    schedule.add_argument(
        "--meshes",
        type=int,
        help="meshes (default: one per stage, half as many for interleaved-1f1b, zb-v and "
        "dualpipev); stage s on mesh s mod N, or the V order of zb-v and dualpipev",
    )
    schedule.add_argument(
        "--costs", metavar="K=V,...", help="costs per kind (default F=1,B=2,I=1,W=1)"
    )
    schedule.add_argument("--png", metavar="FILE", help="also draw the timeline with matplotlib")
    schedule.add_argument("--trace", metavar="FILE", help="also write a Chrome/Perfetto trace JSON")
    schedule.set_defaults(handler=_schedule)

    backends_cmd = sub.add_parser(
        "backends",
        help="list the registered backends",
        description="List every registered backend (built-in and from the `mpmdc.backends` "
        "entry-point group): its platform, how it moves values between meshes and how it "
        "compiles and runs fragments.",
    )
    backends_cmd.set_defaults(handler=_backends)

    launch_cmd = sub.add_parser(
        "launch",
        help="run a command as N local processes of one multi-process mpmdc program",
        description=_LAUNCH_DESCRIPTION,
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch_cmd.add_argument(
        "-n", "--processes", type=int, required=True, metavar="N", help="processes to start"
    )
    launch_cmd.add_argument(
        "--devices-per-process",
        type=int,
        metavar="K",
        help="CPU devices per process (jax_num_cpu_devices; default JAX's own: 1, or XLA_FLAGS' count)",
    )
    launch_cmd.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="stop everything after S seconds, restarts included (exit 124)",
    )
    launch_cmd.add_argument(
        "--fault-timeout",
        type=float,
        metavar="S",
        help=f"how long a process waits on another before it fails (default {distributed.DEFAULT_FAULT_TIMEOUT:g})",
    )
    launch_cmd.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="S",
        help="after a process fails, how long the others may run to report what they saw (default 5)",
    )
    launch_cmd.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="after a failure, start every process again, up to R times (default 0)",
    )
    launch_cmd.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ARGS",
        help="the command every process runs",
    )
    launch_cmd.set_defaults(handler=_launch)
    return parser


def _show_warning(command, message, category, filename, lineno, file=None, line=None):
    """A warning as the command says it: its category and text, without a source line."""
    print(f"{command}: warning: {category.__name__}: {message}", file=file or sys.stderr)


def main(argv=None) -> int:
    """Entry point of the ``mpmdc`` console script; returns the exit status."""
    parser = build_parser()
    command = "mpmdc"
    try:
        args, unknown = parser.parse_known_args(argv)
        command = f"mpmdc {args.command}"
        if unknown:  # (said by the subcommand, whose options they are not)
            raise UsageError(f"unrecognized arguments: {' '.join(unknown)}")
        with warnings.catch_warnings():
            # (No frame of the user's is on the stack once their program is traced: a
            # warning's file and line would be this script's.)
            warnings.showwarning = functools.partial(_show_warning, command)
            status = args.handler(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # The reader left (`mpmdc demo | head -3`): what it wanted has been written.
        # Point stdout at nothing so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except UsageError as err:
        command = getattr(err, "command", command)
        print(f"{command}: error: {err} (see `{command} --help`)", file=sys.stderr)
        return EXIT_USAGE
    except InternalError as err:
        # What a bug report needs: the program the failing pass got.
        print(f"{stage_header(err.stage)}\n{err.program.as_text()}", end="")
        print(f"{command}: error: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_FAILED
    except MpmdcError as err:
        print(f"{command}: error: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
