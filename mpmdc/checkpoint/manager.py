"""Numbered checkpoints of a training run in one directory, saved in the background."""

from __future__ import annotations

import operator
import os
from concurrent.futures import Future, ThreadPoolExecutor

from mpmdc.checkpoint import storage
from mpmdc.checkpoint.layout import REPLACED_SUFFIX, step_name
from mpmdc.checkpoint.restoring import restore
from mpmdc.checkpoint.saving import Save
from mpmdc.errors import CheckpointError


class CheckpointManager:
    """Checkpoints of a training run, one per step, in ``directory/<step>``.

    As Orbax's ``CheckpointManager``: :meth:`save` saves at every
    ``save_interval_steps``-th step and keeps the newest ``max_to_keep`` (all when
    ``None``); :meth:`latest_step` is the newest complete one, and :meth:`restore`
    restores it (or another step) onto any layout. Every process calls each method,
    in the same order, as for :func:`~mpmdc.checkpoint.save`.

    With ``asynchronous=True`` (the default) :meth:`save` returns once this process's
    arrays are copied to the host, so the next training step may run (and donate them)
    while the copies are written; a save waits for the one before it, and
    :meth:`wait_until_finished` (or :meth:`close`, or leaving a ``with`` block) waits for
    the last and raises its error if it failed. Call one of them before the program
    ends.
    """

    def __init__(
        self,
        directory,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        asynchronous: bool = True,
    ):
        if max_to_keep is not None and not _is_count(max_to_keep):
            raise CheckpointError(
                f"max_to_keep must be a positive integer or None, got {max_to_keep!r}."
            )
        if not _is_count(save_interval_steps):
            raise CheckpointError(
                f"save_interval_steps must be a positive integer, got {save_interval_steps!r}."
            )
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
        self._closed = False

    def step_directory(self, step: int) -> str:
        """Where step ``step`` is saved."""
        return os.path.join(self.directory, str(step))

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first. Waits for a save in the
        background first, so that every process sees the same steps."""
        self.wait_until_finished()
        return _complete_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` saves ``step``: every ``save_interval_steps``-th step."""
        return _step_number(step) % self.save_interval_steps == 0

    def save(self, step: int, tree, *, force: bool = False) -> bool:
        """Save ``tree`` as step ``step`` if :meth:`should_save` (or ``force``); returns
        whether it saves. Saving a step that already has a checkpoint is an error."""
        step = _step_number(step)
        if not (force or self.should_save(step)):
            return False
        if self._closed:
            raise CheckpointError(
                f"the CheckpointManager of {self.directory} is closed; make a new one."
            )
        self.wait_until_finished()
        if step in _complete_steps(self.directory):
            raise CheckpointError(
                f"step {step} is already saved in {self.step_directory(step)}; save another step, "
                f"or remove that directory first."
            )
        asynchronous = self._executor is not None
        save = Save(
            self.step_directory(step), tree, copy=asynchronous, after_commit=self._remove_old
        )
        if asynchronous:
            self._pending = self._executor.submit(save.finish)
        else:
            save.finish()
        return True

    def restore(self, target=None, *, step: int | None = None):
        """Step ``step`` (the latest complete one by default) restored onto ``target``, as
        :func:`~mpmdc.checkpoint.restore` does."""
        self.wait_until_finished()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no complete checkpoint in {self.directory} to restore.")
        return restore(self.step_directory(step), target)

    def wait_until_finished(self) -> None:
        """Wait for the save in the background, if any; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the last save, then stop the background thread."""
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _remove_old(self) -> None:
        """After a commit (process 0): remove the complete steps beyond the newest
        ``max_to_keep``. Nothing else is removed: a partial folder belongs to the save
        writing it (perhaps another job's), and a step that is a link loses its link only."""
        if self.max_to_keep is not None:
            for step in _complete_steps(self.directory)[: -self.max_to_keep]:
                storage.remove(self.step_directory(step))
                storage.remove(self.step_directory(step) + REPLACED_SUFFIX)


def _step_number(step) -> int:
    """``step`` as a non-negative ``int`` (a numpy or JAX integer too)."""
    try:
        number = operator.index(step)
    except TypeError:
        number = -1
    if number < 0 or isinstance(step, bool):
        raise CheckpointError(f"a step is a non-negative integer, got {step!r}.")
    return number


def _complete_steps(directory: str) -> list[int]:
    """The steps with a complete checkpoint in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = {step_name(name.removesuffix(REPLACED_SUFFIX)) for name in names} - {None}
    return sorted(
        step for step in steps if storage.located(os.path.join(directory, str(step))) is not None
    )


def _is_count(value) -> bool:
    """Whether ``value`` is a positive ``int`` (not a ``bool``)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
