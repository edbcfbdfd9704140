"""The shape every pass shares: a frozen dataclass wrapping one pure function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

from mpmdc.ir import Program


@dataclass(frozen=True)
class FunctionPass:
    """A pass whose work is the plain function ``body`` (which tests call directly).

    Subclasses set ``name`` (kebab-case), ``summary`` (one line) and ``body``.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    body: ClassVar[Callable[[Program], Program]]

    def run(self, program: Program) -> Program:
        """Apply the pass."""
        return type(self).body(program)
