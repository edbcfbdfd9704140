"""Typed errors: every mistake a user can make surfaces as an ``MpmdcError``.

Each message names the culprit (stage, mesh, argument path, or equation with
its source line) and says what to do about it.
"""


class MpmdcError(Exception):
    """Base class of every error mpmdc raises for a user mistake."""


class MeshError(MpmdcError):
    """The meshes handed to mpmdc are empty, overlapping, or inconsistent."""


class StageError(MpmdcError):
    """A stage marker or ``stage_to_mesh`` entry is invalid."""


class SpecError(MpmdcError):
    """``in_specs`` / ``out_specs`` do not fit the arguments, outputs or meshes."""


class ArgumentError(MpmdcError):
    """Arguments do not fit the compiled signature, or argnums are out of range."""


class OutputError(MpmdcError):
    """The compiled function returned something that is no array."""


class PlacementError(MpmdcError):
    """The program cannot be placed on meshes (e.g. a marker inside a loop body)."""


class TypeCheckError(MpmdcError):
    """The ``vma-typecheck`` pass found an ill-typed program."""


class BackendError(MpmdcError):
    """An unknown backend or platform was requested."""


class PassError(MpmdcError):
    """An unknown pass, stage name or pass option was requested, or a pipeline in which a
    pass would not get a program with what its contract requires."""


class InternalError(MpmdcError):
    """A pass failed, or left a program that fails verification: a bug in mpmdc (or in a
    pass the user wrote), not in the user's program.

    ``pass_name`` is the pass, ``stage`` the dump stage of the program it got, and
    ``program`` that program (``program.as_text()`` is what to report).
    """

    def __init__(self, message: str, pass_name: str, stage: str, program):
        super().__init__(message)
        self.pass_name, self.stage, self.program = pass_name, stage, program


class MpmdRuntimeError(MpmdcError):
    """A fragment or transfer failed while running, or a peer process failed or stopped."""


class DistributedError(MpmdcError):
    """``mpmdc.distributed`` or ``mpmdc launch`` was set up wrongly (too late, bad settings)."""


class ProgramMismatchError(MpmdcError):
    """Processes of one multi-process run traced different programs or arguments."""


class UsageError(MpmdcError):
    """A command-line option, file or target given to ``mpmdc`` is wrong (exit status 2)."""


class TargetError(MpmdcError):
    """The user's file or target function given to ``mpmdc dump`` raised an exception."""


class ScheduleError(MpmdcError):
    """A pipeline schedule is unknown, malformed, deadlocks or breaks a data dependency."""


class AccumulateError(MpmdcError):
    """``mpmdc.accumulate`` got microbatches, inputs or reductions it cannot use."""


class CheckpointError(MpmdcError):
    """A checkpoint is missing, partial or already there, or does not fit the tree saved to
    it or restored from it (named with the leaf's path and the checkpoint's directory)."""


class ExportError(MpmdcError):
    """An exported program cannot be made, read or run here: damaged or truncated bytes,
    another format version, modules this JAX cannot load, or meshes of other shapes
    (named with what differs and what to do)."""


class PlacementWarning(UserWarning):
    """Work that mpmdc could not keep next to its values: it runs on one mesh and reads
    arrays that live on others every step (named with its source line)."""


class IdleMeshWarning(UserWarning):
    """A mesh handed to ``mpmdc.compile`` that runs no stage of the program: it sits idle
    every step (named with the stages and the meshes they run on)."""
