"""Layer stacks run by one ``scan``: which iterations each stage runs.

A ``scan`` whose body holds ``stage(h, every=k, first=f)`` markers (``layer_stage``
equations) is pipelined by iteration: iteration ``j`` belongs to group ``j // k`` (or,
for per-stage counts, the group whose rows hold ``j``), which runs in stage ``f + g``.
The ``split-scans`` pass reads :func:`scan_split` and cuts the scan at its
:attr:`ScanSplit.bounds`; ``mpmdc.compile`` reads :func:`layer_stages` at trace time to
know how many stages a program has.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims

from mpmdc import _jax_compat as compat
from mpmdc.errors import StageError
from mpmdc.ir.primitives import is_layer_marker
from mpmdc.ir.program import find_eqns, is_var


@dataclass(frozen=True)
class ScanSplit:
    """How one scan is cut: ``bounds[g]:bounds[g + 1]`` are group ``g``'s iterations,
    which run in stage ``first + g``; ``transpose`` is the largest transpose count of the
    markers in its body (1 for the transposed scan of a gradient)."""

    bounds: tuple[int, ...]
    first: int
    transpose: int

    @property
    def stages(self) -> range:
        """The stages the scan's groups run in, in iteration order."""
        return range(self.first, self.first + len(self.bounds) - 1)


def layer_markers(eqn) -> list:
    """The ``stage(h, every=...)`` markers of the scan ``eqn``: in its body at any depth,
    except inside a nested scan (whose markers are that scan's)."""
    out = []

    def visit(eqns):
        for e in eqns:
            if is_layer_marker(e):
                out.append(e)
            elif e.primitive is not jprims.scan_p:
                for sub in jcore.jaxprs_in_params(e.params):
                    visit(sub.eqns)

    for sub in jcore.jaxprs_in_params(eqn.params):
        visit(sub.eqns)
    return out


def scan_split(eqn) -> ScanSplit | None:
    """How the ``scan`` equation ``eqn`` is cut into stages, ``None`` if its body holds no
    ``every=`` marker. Markers that disagree, an ``every`` that does not divide the
    scan's length, or counts that do not sum to it, are ``StageError``s naming the scan."""
    markers = layer_markers(eqn)
    if not markers:
        return None
    length = eqn.params["length"]
    where = f"the scan at {compat.source_line(eqn)} (length {length})"
    every, first = markers[0].params["every"], markers[0].params["first"]
    for other in markers[1:]:
        if (other.params["every"], other.params["first"]) != (every, first):
            raise StageError(
                f"{where} holds mpmdc.stage markers with every={every!r}, first={first} (at "
                f"{compat.source_line(markers[0])}) and every={other.params['every']!r}, "
                f"first={other.params['first']} (at {compat.source_line(other)}); one scan "
                f"is cut one way: give its markers the same `every` and `first`."
            )
    if isinstance(every, int):
        if length % every:
            raise StageError(
                f"mpmdc.stage(..., every={every}) at {compat.source_line(markers[0])}: {where} "
                f"does not split into groups of {every}. Choose an `every` that divides "
                f"{length}, or give per-stage counts summing to {length}, e.g. "
                f"every={_uneven_example(length, every)}."
            )
        counts = (every,) * (length // every)
    else:
        counts = every
        if sum(counts) != length:
            raise StageError(
                f"mpmdc.stage(..., every={every!r}) at {compat.source_line(markers[0])}: the "
                f"counts sum to {sum(counts)}, but {where} runs {length} iterations; give "
                f"counts summing to {length}."
            )
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    transpose = max(m.params["transpose"] for m in markers)
    return ScanSplit(tuple(bounds), first, transpose)


def _uneven_example(length: int, every: int) -> tuple[int, ...]:
    groups = max(1, round(length / every))
    base, extra = divmod(length, groups)
    return tuple(base + (1 if g < extra else 0) for g in range(groups))


def layer_stages(eqns) -> set[int]:
    """The stages every ``every=``-marked scan among ``eqns`` (at any depth) runs in."""
    out: set[int] = set()
    for eqn in find_eqns(eqns, lambda e: e.primitive is jprims.scan_p):
        split = scan_split(eqn)
        if split is not None:
            out.update(split.stages)
    return out


def without_layer_markers(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """``jaxpr`` with every ``layer_stage`` equation (at any depth) removed: once a scan
    is cut per stage, its iterations' stage is the scan's, and the marker is an identity."""
    env: dict = {}

    def renamed(atoms):
        return [env.get(a, a) if is_var(a) else a for a in atoms]

    eqns = []
    for eqn in jaxpr.eqns:
        if is_layer_marker(eqn):
            env.update(zip(eqn.outvars, renamed(eqn.invars)))
            continue
        params = {k: _without_in_param(v) for k, v in eqn.params.items()}
        changed = any(params[k] is not v for k, v in eqn.params.items())
        invars = renamed(eqn.invars)
        if changed or any(a is not b for a, b in zip(invars, eqn.invars)):
            eqn = eqn.replace(invars=invars, params=params)
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns, outvars=renamed(jaxpr.outvars))


def _without_in_param(value):
    if isinstance(value, jcore.ClosedJaxpr):
        if not any(True for _ in find_eqns(value.jaxpr.eqns, is_layer_marker)):
            return value
        return jcore.ClosedJaxpr(without_layer_markers(value.jaxpr), value.consts)
    if isinstance(value, jcore.Jaxpr):
        if not any(True for _ in find_eqns(value.eqns, is_layer_marker)):
            return value
        return without_layer_markers(value)
    if isinstance(value, tuple) and any(
        isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in value
    ):
        return tuple(_without_in_param(v) for v in value)
    return value
