"""Layer stacks run by one ``scan``: which iterations each stage runs.

A ``scan`` whose body holds ``stage(h, every=k, first=f)`` markers (``layer_stage``
equations) is pipelined by iteration: iteration ``j`` belongs to group ``j // k`` (or,
for per-stage counts, the group whose rows hold ``j``), which runs in stage ``f + g``.
The ``split-scans`` pass reads :func:`scan_split` and cuts the scan at its
:attr:`ScanSplit.bounds`; ``mpmdc.compile`` reads :func:`layer_stages` at trace time to
know how many stages a program has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jax.extend import core as jcore
from jax.extend.core import primitives as jprims

from mpmdc import _jax_compat as compat
from mpmdc.errors import StageError
from mpmdc.ir.primitives import BALANCED, is_layer_marker, is_marker
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
    if every == BALANCED:  # each iteration a segment of its own, until grouped
        counts = (1,) * length
    elif isinstance(every, int):
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
    """``length`` iterations in as few groups of at most ``every`` as can hold them, the
    groups' sizes differing by at most one."""
    groups = -(-length // every)
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


def regrouped(jaxpr: jcore.Jaxpr, stage_of: Callable[[int], int]) -> jcore.Jaxpr:
    """``jaxpr`` with its markers' segments grouped into stages: a ``stage(x, i)`` marker
    enters stage ``stage_of(i)``; a layer stack whose iteration groups are segments
    ``first, first + 1, ...`` runs per-stage counts (``every=(...)``) from
    ``stage_of(first)``. ``stage_of`` must keep consecutive segments in order."""

    def rewrite(jaxpr: jcore.Jaxpr, layer_params: dict | None) -> jcore.Jaxpr:
        eqns = []
        for eqn in jaxpr.eqns:
            params, inner = dict(eqn.params), layer_params
            if is_marker(eqn):
                params["stage"] = stage_of(params["stage"])
            elif is_layer_marker(eqn):
                params.update(layer_params)
            elif eqn.primitive is jprims.scan_p and (split := scan_split(eqn)) is not None:
                inner = _grouped_split(split, stage_of)
            params = {
                k: _in_param(v, lambda j, inner=inner: rewrite(j, inner)) for k, v in params.items()
            }
            eqns.append(eqn.replace(params=params))
        return jaxpr.replace(eqns=eqns)

    return rewrite(jaxpr, None)


def _grouped_split(split: ScanSplit, stage_of: Callable[[int], int]) -> dict:
    """The ``every`` and ``first`` of a scan cut by ``split`` once its groups (segments
    ``split.first + g``) are grouped into stages by ``stage_of``; unchanged (no
    parameters) for a scan of no iterations, which has no groups."""
    if len(split.bounds) == 1:
        return {}
    counts: list[int] = []
    stages: list[int] = []
    for g in range(len(split.bounds) - 1):
        size, stage = split.bounds[g + 1] - split.bounds[g], stage_of(split.first + g)
        if stages and stages[-1] == stage:
            counts[-1] += size
        else:
            counts.append(size)
            stages.append(stage)
    return {"every": tuple(counts), "first": stages[0]}


def _in_param(value, rewrite: Callable[[jcore.Jaxpr], jcore.Jaxpr]):
    """An equation parameter with ``rewrite`` applied to the jaxprs in it (the same
    object where ``rewrite`` changes none)."""
    if isinstance(value, jcore.ClosedJaxpr):
        new = rewrite(value.jaxpr)
        return value if new is value.jaxpr else jcore.ClosedJaxpr(new, value.consts)
    if isinstance(value, jcore.Jaxpr):
        return rewrite(value)
    if isinstance(value, tuple) and any(
        isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in value
    ):
        new = tuple(_in_param(v, rewrite) for v in value)
        return value if all(a is b for a, b in zip(new, value)) else new
    return value


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
        params = {k: _in_param(v, _without_if_marked) for k, v in eqn.params.items()}
        changed = any(params[k] is not v for k, v in eqn.params.items())
        invars = renamed(eqn.invars)
        if changed or any(a is not b for a, b in zip(invars, eqn.invars)):
            eqn = eqn.replace(invars=invars, params=params)
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns, outvars=renamed(jaxpr.outvars))


def _without_if_marked(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    if not any(True for _ in find_eqns(jaxpr.eqns, is_layer_marker)):
        return jaxpr
    return without_layer_markers(jaxpr)
