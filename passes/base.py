"""What a pass is, and the registry of passes by name.

A pass is a :class:`FunctionPass`: a kebab-case name, a one-line summary and a pure
function ``body(program, **options) -> program`` that tests call directly. Each pass
module registers its function with :func:`register`; options are the function's
keyword-only parameters, set by name (``lower{backend=tpu}`` in a pipeline text).

A pass also states its contract over the closed set of :class:`Property`: what it
``requires`` of the program it gets, what it ``produces`` and what it ``invalidates``
(leaves no longer true). ``mpmdc.pipeline.run_pipeline`` checks a pipeline's contracts
before running any of it.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pydantic

from mpmdc._text import split_top_level
from mpmdc.errors import PassError
from mpmdc.ir.program import Program

_PASS_TEXT = re.compile(r"^\s*([a-z][a-z0-9-]*)\s*(?:\{(.*)\})?\s*$")


class Property(enum.StrEnum):
    """What a program is known to be between two passes: the terms of pass contracts."""

    PLANNED = "planned"
    INLINED = "inlined"
    SCANS_SPLIT = "scans-split"
    PLACED = "placed"
    SPLIT = "split"
    SCHEDULED = "scheduled"
    DONATED = "donated"
    LOWERED = "lowered"

    @property
    def meaning(self) -> str:
        """The property in words, as error messages and the docs say it."""
        return _MEANINGS[self]


_MEANINGS = {
    Property.PLANNED: (
        "the stages grouped and the microbatch loop's schedule chosen, as the program asks"
    ),
    Property.INLINED: "every stage marker and loop edge at the top level, none in a nested call",
    Property.SCANS_SPLIT: "every scan marked with stage(every=...) cut into one scan per stage",
    Property.PLACED: "every top-level equation placed on a stage, every input and output on a mesh",
    Property.SPLIT: "top-level equations that are fragments and transfers",
    Property.SCHEDULED: (
        "fragment calls in the order they run, the microbatch loop stamped out and ordered by "
        "its schedule"
    ),
    Property.DONATED: "each fragment's donate_argnums decided",
    Property.LOWERED: "a StableHLO module attached per fragment",
}


@dataclass(frozen=True)
class FunctionPass:
    """A pass whose work is the plain function ``body``, called with ``options``.

    Its contract: the program it gets must have every property in ``requires``; its
    result has those in ``produces`` and loses those in ``invalidates``. A pass that
    declares none requires nothing and changes no property.
    """

    name: str
    summary: str
    body: Callable[..., Program]
    options: tuple[tuple[str, Any], ...] = ()
    requires: frozenset[Property] = frozenset()
    produces: frozenset[Property] = frozenset()
    invalidates: frozenset[Property] = frozenset()

    def __post_init__(self):
        # Any iterable of properties is accepted; equality and hashing need frozensets.
        for field in ("requires", "produces", "invalidates"):
            object.__setattr__(self, field, frozenset(map(Property, getattr(self, field))))

    def run(self, program: Program) -> Program:
        """Apply the pass."""
        return self.body(program, **dict(self.options))

    def option_names(self) -> tuple[str, ...]:
        """The options this pass takes (its function's keyword-only parameters)."""
        params = inspect.signature(self.body).parameters.values()
        return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)

    def with_options(self, **options) -> FunctionPass:
        """This pass with ``options`` set, each converted to its declared type (a list
        given for a tuple becomes one); an option it does not take, or a value that is not
        of its type, is a ``PassError`` naming the option."""
        unknown = sorted(set(options) - set(self.option_names()))
        if unknown:
            known = ", ".join(self.option_names()) or "none"
            raise PassError(
                f"pass `{self.name}` has no option {', '.join(unknown)}; its options: {known}."
            )
        types = typing.get_type_hints(self.body)
        converted = {}
        for key, value in options.items():
            kind = types.get(key, typing.Any)
            try:
                converted[key] = pydantic.TypeAdapter(kind).validate_python(value)
            except pydantic.ValidationError:
                raise PassError(
                    f"option {key}={value!r} of pass `{self.name}` is not a "
                    f"{_type_text(kind)}; e.g. {self.name}{{{key}={_example(kind)}}}."
                ) from None
        return dataclasses.replace(
            self, options=tuple(sorted({**dict(self.options), **converted}.items()))
        )

    def __str__(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}{{{options}}}" if options else self.name


def _type_text(kind) -> str:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "value of " + ", ".join(str(k.value) for k in kind)
    return str(kind).replace("typing.", "").replace("NoneType", "None")


def _example(kind) -> str:
    """An option value of type ``kind``, as a pass text writes it."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return str(next(iter(kind)).value)
    text = _type_text(kind)
    if "tuple[int" in text:
        return "(0,2)"
    if "int" in text:
        return "2"
    if "bool" in text:
        return "True"
    return "name"


PASSES: dict[str, FunctionPass] = {}


def register(
    name: str,
    summary: str,
    *,
    requires: Iterable[Property] = (),
    produces: Iterable[Property] = (),
    invalidates: Iterable[Property] = (),
):
    """Decorator: register ``body`` as the pass ``name`` with its contract (the function is
    returned as is)."""

    def add(body: Callable[..., Program]) -> Callable[..., Program]:
        if name in PASSES:
            raise PassError(
                f"a pass named `{name}` is already registered ({PASSES[name].body.__module__})."
            )
        PASSES[name] = FunctionPass(
            name,
            summary,
            body,
            requires=frozenset(requires),
            produces=frozenset(produces),
            invalidates=frozenset(invalidates),
        )
        return body

    return add


def _option_value(text: str):
    """A Python literal (``2``, ``True``, ``'x'``), else the text itself (``tpu``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def pass_from_text(text: str) -> FunctionPass:
    """The registered pass ``name`` or ``name{option=value,...}``."""
    match = _PASS_TEXT.match(text)
    if not match:
        raise PassError(
            f"{text!r} is not a pass; write a name or name{{option=value,...}}, e.g. lower{{backend=tpu}}."
        )
    name, options_text = match[1], match[2]
    if name not in PASSES:
        raise PassError(f"unknown pass {name!r}; known passes: {', '.join(sorted(PASSES))}.")
    options = {}
    # (Commas inside parentheses stay: ``lower{meshes=(0,2)}``.)
    try:
        items = split_top_level(options_text or "", "()")
    except ValueError:
        raise PassError(
            f"unbalanced parentheses in the options of pass `{name}`: {options_text!r}."
        ) from None
    for item in filter(None, (s.strip() for s in items)):
        key, sep, value = item.partition("=")
        if not sep:
            raise PassError(f"option {item!r} of pass `{name}` needs a value: {key.strip()}=VALUE.")
        options[key.strip()] = _option_value(value.strip())
    return PASSES[name].with_options(**options)
