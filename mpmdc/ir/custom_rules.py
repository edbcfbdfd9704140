"""Stage markers inside functions JAX differentiates by the user's own rules
(``jax.custom_vjp``, ``jax.custom_jvp``).

JAX's differentiation of a marker marks the cotangent of what entered stage ``s`` as
leaving stage ``s``'s backward (``primitives``), which is how ``partition`` finds where
each stage's backward ends. A function with a rule of its own is differentiated by that
rule, which holds no marker: left alone, the cotangent of an input that a marker in the
function moved into stage ``s`` would not leave stage ``s``'s backward, and the backward
of the stages before would run there too, on its mesh.

So while JAX runs such a function's rule for differentiation, a marker on one of the
function's inputs is noted, and:

- ``custom_vjp``: the input's cotangent from the backward rule gets the transposed
  marker that differentiating the marker would have made;
- ``custom_jvp``: the input's tangent gets the marker before the tangent rule's linear
  work reads it, so its transpose is that same transposed marker. Where JAX runs the
  tangent rule together with the primal work (forward-mode ``jax.jvp``, or
  ``jax_use_direct_linearize`` off), no marker can be added in time.

A marker on a value the function computed (or on its input inside a call it makes) has
no input to stand for, so its backward cannot be marked either. ``mpmdc.compile`` warns
about both, naming the marker's line.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from dataclasses import dataclass, field

from mpmdc import _jax_compat as compat
from mpmdc.errors import PlacementWarning

_PLACING = contextvars.ContextVar("mpmdc_placing", default=False)


@contextlib.contextmanager
def placing():
    """While active, markers are traced for ``mpmdc.compile`` to place the program by
    (rather than under ``jax.jit``, where they are identities and place nothing)."""
    token = _PLACING.set(True)
    try:
        yield
    finally:
        _PLACING.reset(token)


@dataclass
class _Running:
    """A rule JAX is running for differentiation, and the markers on its inputs seen."""

    inputs: list
    rule: object  # the backward rule (custom_vjp) or the tangent rule (custom_jvp)
    entered: dict = field(default_factory=dict)  # input index -> (stage, source line)
    unmarkable: list = field(default_factory=list)  # (stage, source line) of other markers
    marked: bool = False  # its tangents got their markers (custom_jvp)


class CustomRuleStages:
    """The hooks ``compat.hook_custom_differentiation`` installs, and what they note
    (per thread: a rule runs, and its backward is traced, where it is differentiated)."""

    LIMIT = 256  # backward rules remembered per thread (each kept alive until dropped)

    def __init__(self, mark=None):
        # (value, stage, transpose) -> the value marked (a symbolic zero as it is); set
        # by primitives
        self.mark = mark
        self._local = threading.local()

    @property
    def running(self) -> list[_Running]:
        """The rules running in this thread, innermost last."""
        if not hasattr(self._local, "running"):
            self._local.running = []
        return self._local.running

    @property
    def stages(self) -> dict:
        """``id(bwd) -> (bwd, the stages its function's inputs entered)``, this thread's."""
        if not hasattr(self._local, "stages"):
            self._local.stages = {}
        return self._local.stages

    def entering(self, leaves, stage: int) -> None:
        """A marker on ``leaves`` into ``stage``: noted where one is an input of the
        innermost rule running."""
        if not self.running:
            return
        now, line = self.running[-1], compat.user_line()
        inputs = [k for leaf in leaves for k, x in enumerate(now.inputs) if leaf is x]
        for k in inputs:
            now.entered.setdefault(k, (stage, line))
        if not inputs:
            now.unmarkable.append((stage, line))

    def vjp_forward(self, primals, bwd, differentiate):
        now = self._run(primals, bwd)
        try:
            out = differentiate()
        finally:
            self.running.pop()
        self._warn(now.unmarkable, "custom_vjp", bwd)
        if now.entered:
            stages = self.stages
            stages.pop(id(bwd), None)
            stages[id(bwd)] = (bwd, now.entered)
            while len(stages) > self.LIMIT:
                del stages[next(iter(stages))]
        return out

    def vjp_backward(self, bwd, in_zeros, cotangents):
        found = self.stages.get(id(bwd))
        if found is None or found[0] is not bwd:
            return cotangents
        nonzero = [k for k, zero in enumerate(in_zeros) if not zero]
        return self._marked(found[1], nonzero, cotangents, transpose=1)

    def jvp_forward(self, primals, jvp, differentiate):
        now = self._run(primals, jvp)
        try:
            return differentiate()
        finally:
            self.running.pop()
            unmarked = [] if now.marked else list(now.entered.values())
            self._warn(now.unmarkable + unmarked, "custom_jvp", jvp)

    def jvp_tangents(self, rule_info, tangents):
        """``tangents`` of the innermost ``custom_jvp`` function's inputs (its tangent rule
        told by ``rule_info``, the rule's debug info), those of marked inputs marked."""
        if not self.running or self.running[-1].rule.debug_info != rule_info:
            return tangents
        now = self.running[-1]
        now.marked = True
        return self._marked(now.entered, range(len(tangents)), tangents, transpose=0)

    @staticmethod
    def _warn(unmarked: list, kind: str, rule) -> None:
        """Warn of markers in a function of ``kind`` whose backward could not be marked."""
        if not unmarked or not _PLACING.get():
            return
        stage, line = min(unmarked)
        warnings.warn(
            f"mpmdc.stage at {line}, inside a {kind} function differentiated by its rule "
            f"{rule.debug_info.func_name}, moves a value into stage {stage} whose backward "
            f"mpmdc cannot mark (a value the function computed, or one JAX differentiates "
            f"with its primal work): the backward of the stages before stage {stage} runs "
            f"in stage {stage}'s. Mark the value before calling the function instead.",
            PlacementWarning,
            stacklevel=compat.user_stacklevel(),
        )

    def _run(self, primals, rule) -> _Running:
        now = _Running(list(primals), rule)
        self.running.append(now)
        return now

    def _marked(self, entered: dict, inputs, values, transpose: int) -> list:
        return [
            self.mark(v, entered[k][0], transpose) if k in entered and v is not None else v
            for k, v in zip(inputs, values)
        ]


RULES = CustomRuleStages()
compat.hook_custom_differentiation(RULES)
