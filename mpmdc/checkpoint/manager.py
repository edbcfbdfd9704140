"""Numbered checkpoints of a training run in one directory, saved in the background."""

from __future__ import annotations

import json
import operator
import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import jax
from jax.experimental import multihost_utils

from mpmdc import _jax_compat as compat
from mpmdc import distributed
from mpmdc.checkpoint import storage
from mpmdc.checkpoint.layout import PARTIAL_SUFFIX, REPLACED_SUFFIX, step_name
from mpmdc.checkpoint.restoring import restore_committed
from mpmdc.checkpoint.saving import Save
from mpmdc.errors import CheckpointError


class CheckpointManager:
    """Checkpoints of a training run, one per step, in ``directory/<step>``.

    As Orbax's ``CheckpointManager``: :meth:`save` saves at every
    ``save_interval_steps``-th step and keeps the newest ``max_to_keep`` (all when
    ``None``); :meth:`latest_step` is the newest complete one, and :meth:`restore`
    restores it (or another step) onto any layout. Every process calls each method,
    in the same order, as for :func:`~mpmdc.checkpoint.save`. With several processes,
    what the directory holds (the steps, whether a step is saved) is what process 0
    sees, told to the others, so that all decide alike even where a shared filesystem
    shows them a folder at different times.

    With ``asynchronous=True`` (the default) :meth:`save` returns once this process's
    arrays are copied to the host, so the next training step may run (and donate them)
    while the copies are written; a save waits for the one before it, and
    :meth:`wait_until_finished` (or :meth:`close`, or leaving a ``with`` block) waits for
    the last. A background save that failed is a ``CheckpointError`` saying that its step
    was not saved, and why, raised by the next of these calls (or by the next
    :meth:`save`, which then saves nothing). Call one of them before the program ends: a
    manager dropped with a failure nobody was told of warns, naming the step.

    With ``remove_partial=True`` (Orbax's ``cleanup_tmp_directories``) process 0 removes,
    as the manager starts, the partial folders that saves of steps left in
    ``directory`` when they were killed or hung: for a directory no other job saves
    into, such as a run's restart after a failure (a save in progress would lose its
    folder). Otherwise nothing removes them.
    """

    def __init__(
        self,
        directory,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        asynchronous: bool = True,
        remove_partial: bool = False,
    ):
        if not isinstance(directory, str | os.PathLike):
            raise CheckpointError(
                f"directory must be a path (a str or os.PathLike), got {directory!r}."
            )
        if max_to_keep is not None and not _is_count(max_to_keep):
            raise CheckpointError(
                f"max_to_keep must be a positive integer or None, got {max_to_keep!r}."
            )
        if not _is_count(save_interval_steps):
            raise CheckpointError(
                f"save_interval_steps must be a positive integer, got {save_interval_steps!r}."
            )
        _check_flag(asynchronous, "asynchronous")
        _check_flag(remove_partial, "remove_partial")
        self.directory = os.path.abspath(os.fspath(directory))
        for path in (self.directory, storage.first_existing_above(self.directory)):
            if os.path.exists(path) and not os.path.isdir(path):
                raise CheckpointError(
                    f"{path} is a file; a CheckpointManager needs a directory at {self.directory}."
                )
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="mpmdc-checkpoint") if asynchronous else None
        )
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._closed = False
        self._many = distributed.is_multiprocess()
        self._answered: str | None = None  # the topic of the last answer from process 0
        self._preemption_asked: tuple[int | None, bool] = (None, False)  # (step, answer)
        self._skipped_warned = False  # (a step skipped in asking: warned once)
        self._saved: int | None = None  # the last step saved
        if remove_partial:
            self._decided("the removal of partial folders", lambda: _remove_partial(self.directory))

    def step_directory(self, step: int) -> str:
        """Where step ``step`` is saved."""
        return os.path.join(self.directory, str(_step_number(step)))

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first, as process 0 sees them.
        Waits for a save in the background first."""
        self.wait_until_finished()
        return self._decided("the list of steps", lambda: _complete_steps(self.directory))

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` saves ``step``: every ``save_interval_steps``-th step, and
        the step every process stops at after a preemption notice
        (:meth:`reached_preemption`)."""
        step = _step_number(step)
        preempted = self.reached_preemption(step)  # (asked at every step, saved or not)
        return preempted or step % self.save_interval_steps == 0

    def reached_preemption(self, step: int) -> bool:
        """Whether ``step`` is where every process stops to save before it is preempted,
        as Orbax's ``CheckpointManager.reached_preemption``: once any process of a
        ``jax.distributed`` run gets a preemption notice (``SIGTERM``, which JAX then
        catches), the processes agree on the step after the furthest any of them has
        reached (JAX's ``multihost_utils.reached_preemption_sync_point``), and this is
        ``True`` there in every process. Every process must ask at every step, in order
        (:meth:`save` asks for each step it is given); ``False`` without
        ``jax.distributed`` or with its ``jax_enable_preemption_service`` off."""
        step = _step_number(step)
        if compat.distributed_client() is None or not jax.config.jax_enable_preemption_service:
            return False
        asked = self._preemption_asked[0]
        if asked != step:  # (JAX's protocol counts each step once)
            if asked is not None and step > asked + 1 and not self._skipped_warned:
                self._skipped_warned = True
                warnings.warn(
                    f"the CheckpointManager of {self.directory} was asked whether step "
                    f"{asked}, then step {step}, is where the processes stop before a "
                    f"preemption: the step they agree on may be one never asked, and a "
                    f"preemption notice then goes unheeded. Call save (or "
                    f"reached_preemption) at every step; save saves only every "
                    f"save_interval_steps-th step by itself.",
                    RuntimeWarning,
                    stacklevel=compat.user_stacklevel(),
                )
            self._preemption_asked = (step, multihost_utils.reached_preemption_sync_point(step))
        return self._preemption_asked[1]

    @compat.api_boundary
    def save(self, step: int, tree, *, force: bool = False) -> bool:
        """Save ``tree`` as step ``step`` if :meth:`should_save` (or ``force``); returns
        whether it saves. Saving a step that already has a checkpoint is an error, and so
        is saving one that ``max_to_keep`` would remove at once (older than that many
        saved steps). A failed background save of an earlier step is raised here, and
        this call then saves nothing."""
        step = _step_number(step)
        _check_flag(force, "force")
        if not (force or self.should_save(step)):
            return False
        if self._closed:
            raise CheckpointError(
                f"the CheckpointManager of {self.directory} is closed; make a new one."
            )
        self._raise_failed_save(f" This call saved nothing: save step {step} again.")
        self._decided(f"whether step {step} may be saved", lambda: self._check_new(step))
        asynchronous = self._executor is not None
        save = Save(
            self.step_directory(step), tree, copy=asynchronous, after_commit=self._remove_old
        )
        if asynchronous:
            self._pending, self._pending_step = self._executor.submit(save.finish), step
        else:
            save.finish()
        self._saved = step
        return True

    @compat.api_boundary
    def restore(self, target=None, *, step: int | None = None):
        """Step ``step`` (the latest complete one by default) restored onto ``target``, as
        :func:`~mpmdc.checkpoint.restore` does. With several processes, every process
        restores the same commit of that step, or all raise."""
        if step is not None:
            step = _step_number(step)
        self.wait_until_finished()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no complete checkpoint in {self.directory} to restore.")
        if not self._many:
            return restore_committed(self.step_directory(step), target)[0]
        return self._restored_everywhere(step, target)

    @compat.api_boundary
    def wait_until_finished(self) -> None:
        """Wait for the save in the background, if any; a ``CheckpointError`` saying which
        step was not saved, and why, if it failed."""
        self._raise_failed_save()

    @compat.api_boundary
    def close(self) -> None:
        """Wait for the last save, then stop the background thread. Warns where the
        processes agreed to stop at a step for a preemption (:meth:`reached_preemption`)
        and it was not saved."""
        step, preempted = self._preemption_asked
        if preempted and self._saved != step:
            warnings.warn(
                f"step {step} is where every process stopped for a preemption, but the "
                f"CheckpointManager of {self.directory} did not save it: a run started "
                f"again resumes from the latest step saved before it. Call save(step, tree) "
                f"at every step: it saves that step by itself.",
                RuntimeWarning,
                stacklevel=compat.user_stacklevel(),
            )
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
            return
        try:  # the error leaving the block is the one to see; a failed save only warns
            self.close()
        except CheckpointError as failed:
            warnings.warn(str(failed), RuntimeWarning, stacklevel=2)

    def __del__(self) -> None:
        pending, step = getattr(self, "_pending", None), getattr(self, "_pending_step", None)
        if pending is not None and pending.done() and pending.exception() is not None:
            failed = _failure(step, self.step_directory(step), pending.exception())
            warnings.warn(
                f"a CheckpointManager of {self.directory} was dropped without being told that "
                f"{failed} Call wait_until_finished() or close() before dropping a manager.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _raise_failed_save(self, more: str = "") -> None:
        """Wait for the save in the background, if any; if it failed, a
        ``CheckpointError`` naming its step and why, followed by ``more``."""
        pending, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as err:
            where = self.step_directory(step)
            raise CheckpointError(_failure(step, where, err) + more) from err

    def _decided(self, what: str, decide: Callable[[], object]):
        """What ``decide()`` returns on process 0 (JSON data), on every process; its
        ``CheckpointError`` raised on every process. In one process, ``decide()``."""
        if not self._many:
            return decide()
        answer = ""
        if jax.process_index() == 0:
            try:
                answer = json.dumps({"value": decide()})
            except CheckpointError as err:
                answer = json.dumps({"error": str(err)})
        topic = distributed.topic("checkpoint-manager", self.directory)
        answer = distributed.rendezvous(
            topic, f"process 0's answer to {what} in {self.directory}", value=answer
        )[0]
        self._forget_answer(topic)
        record = json.loads(answer)
        if "error" in record:
            raise CheckpointError(record["error"])
        return record["value"]

    def _forget_answer(self, topic: str) -> None:
        """Drop this process's key of the answer before ``topic``: every process has read
        it, since each brought its key of ``topic`` only after."""
        if self._answered is not None:
            distributed.forget(self._answered)
        self._answered = topic

    def _check_new(self, step: int) -> None:
        """A ``CheckpointError`` unless ``step`` may be saved: not saved already, and not
        older than ``max_to_keep`` saved steps (it would be removed at once)."""
        steps = _complete_steps(self.directory)
        if step in steps:
            raise CheckpointError(
                f"step {step} is already saved in {self.step_directory(step)}; save another step, "
                f"or remove that directory first."
            )
        newer = [s for s in steps if s > step]
        if self.max_to_keep is not None and len(newer) >= self.max_to_keep:
            kept = ", ".join(map(str, newer[-self.max_to_keep :]))
            raise CheckpointError(
                f"step {step} is older than the {self.max_to_keep} newest steps in "
                f"{self.directory} ({kept}), which max_to_keep={self.max_to_keep} keeps: it would "
                f"be removed as soon as it is saved. Save a step after {steps[-1]}, or keep more."
            )

    def _restored_everywhere(self, step: int, target):
        """Step ``step`` restored on every process, from one commit: a process that fails,
        or reads another commit than process 0 (the step was replaced meanwhile), fails
        the restore on every process."""
        restored, error = None, ""
        try:
            restored, marker = restore_committed(self.step_directory(step), target)
            said = json.dumps({"save": marker.get("save"), "time": marker.get("time")})
        except CheckpointError as err:
            error = f"process {jax.process_index()}: {err}"
            said = json.dumps({"error": error})
        topic = distributed.topic("checkpoint-manager", self.directory)
        said = distributed.rendezvous(topic, f"the restore of step {step}", value=said)
        self._forget_answer(topic)
        records = [json.loads(value) for _, value in sorted(said.items())]
        failures = [record["error"] for record in records if "error" in record]
        if error:
            raise CheckpointError(error)
        if failures:
            raise CheckpointError(
                f"step {step} in {self.directory} was not restored on every process; {failures[0]}"
            )
        if any(record != records[0] for record in records):
            raise CheckpointError(
                f"step {step} in {self.directory} was replaced while the processes restored it "
                f"(they read different saves of it); restore it again."
            )
        return restored

    def _remove_old(self) -> None:
        """After a commit (process 0): remove the complete steps beyond the newest
        ``max_to_keep``. Nothing else is removed: a partial folder belongs to the save
        writing it (perhaps another job's), and a step that is a link loses its link only.
        Under the commit lock: a commit into this folder (another job's overwrite of the
        step) never interleaves with removing it, which could leave half of either."""
        if self.max_to_keep is None:
            return
        with storage.commit_lock(self.directory):
            storage.remove_leftovers(self.directory)
            for step in _complete_steps(self.directory)[: -self.max_to_keep]:
                storage.remove_checkpoint(self.step_directory(step) + REPLACED_SUFFIX)
                storage.remove_checkpoint(self.step_directory(step))


def _failure(step: int, where: str, err: BaseException) -> str:
    """What a failed background save of ``step`` to ``where`` says."""
    why = str(err).rstrip(".") or type(err).__name__
    return f"step {step} was NOT saved: its save to {where} failed in the background: {why}."


def _step_number(step) -> int:
    """``step`` as a non-negative ``int`` (a numpy or JAX integer too); a
    ``CheckpointError`` naming the argument otherwise."""
    try:
        number = operator.index(step)
    except TypeError:
        number = -1
    if number < 0 or isinstance(step, bool):
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}.")
    return number


def _check_flag(value, name: str) -> None:
    """A ``CheckpointError`` unless option ``name`` is a ``bool``."""
    if not isinstance(value, bool):
        raise CheckpointError(f"{name} must be True or False, got {value!r}.")


def _remove_partial(directory: str) -> list[str]:
    """Remove the partial folders of saves of steps in ``directory`` (``<step>.<id>.partial``)
    under the lock commits take, so that none is removed while it is renamed into place;
    their names."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    partial = sorted(
        name
        for name in names
        if name.endswith(PARTIAL_SUFFIX) and step_name(name.split(".", 1)[0]) is not None
    )
    if partial:
        with storage.commit_lock(directory):
            for name in partial:
                storage.remove_checkpoint(os.path.join(directory, name))
    return partial


def _complete_steps(directory: str) -> list[int]:
    """The steps with a complete checkpoint in ``directory``, oldest first. A step being
    replaced (``overwrite=True``) is for a moment only at ``<step>.replaced``: that folder
    is the same step, not one of its own. A step whose commit marker cannot be read or is
    damaged is listed: restoring it says what is wrong, and an earlier step stays
    restorable."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = {step_name(name.removesuffix(REPLACED_SUFFIX)) for name in names} - {None}
    return sorted(step for step in steps if _committed(os.path.join(directory, str(step))))


def _committed(folder: str) -> bool:
    """Whether ``folder`` holds a checkpoint's commit marker, readable or not."""
    try:
        return storage.located(folder) is not None
    except CheckpointError:
        return True


def _is_count(value) -> bool:
    """Whether ``value`` is a positive ``int`` (not a ``bool``)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
