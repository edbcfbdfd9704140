"""Which result of a program a training loop feeds back for each of its inputs.

A step returns its new parameters and optimizer state at the places of the pytree where
it took the old ones; the next call reads each where the result fed back for it is made
and with the spec that result has. Placement and spec propagation both pair them, by
the paths of the program's inputs and results.
"""

from __future__ import annotations

import re

from mpmdc.ir.program import Program, is_var

_PATH_KEY = re.compile(r"\[[^\]]*\]|\.\w+")
_INDEX = re.compile(r"\[\d+\]")


def place(path: str, *, result: bool) -> tuple[str, ...]:
    """The keys of pytree ``path`` below the argument it is in, or below the result of
    a tuple (``args[1][0].mu['w']`` and ``out[2][0].mu['w']``: ``[0]``, ``.mu``,
    ``['w']``): where in its pytree a leaf is. A function returning one pytree, not a
    tuple, has its whole result in that place (``out['w']``: ``['w']``)."""
    keys = _PATH_KEY.findall(path)
    if not result or (keys and _INDEX.fullmatch(keys[0])):
        keys = keys[1:]
    return tuple(keys)


def fed_back(program: Program) -> dict:
    """``{input: result}`` pairing each program input with the one result of its shape and
    dtype at the same :func:`place` (``args[1][0].mu['w']`` and ``out[2][0].mu['w']``;
    ``args[0]['w']`` and ``out['w']`` of a function returning one pytree): what a
    training loop passes back for it, so the next call reads the input where that
    result is made. An argument that is an array has no place (the results may come in
    another order): unpaired, but for a layer stack's stacked array kept whole and its
    result (``Program.stack_feedback``). A place two inputs or two results share pairs
    nothing: which is fed back is not known."""
    jaxpr = program.jaxpr.jaxpr
    inputs = set(jaxpr.invars)

    def key(path, v, result):
        return place(path, result=result), v.aval.shape, v.aval.dtype

    results: dict = {}
    for path, v in zip(program.out_paths, jaxpr.outvars):
        if is_var(v) and v not in inputs:
            results.setdefault(key(path, v, True), []).append(v)
    places: dict = {}
    for path, v in zip(program.in_paths, jaxpr.invars):
        places.setdefault(key(path, v, False), []).append(v)
    pairs = {}
    for where, found in places.items():
        if where[0] and len(found) == 1 and len(made := results.get(where, [])) == 1:
            pairs[found[0]] = made[0]
    for ins, outs in program.stack_feedback or ():
        paired = set(pairs.values())
        left = [jaxpr.invars[k] for k in ins if jaxpr.invars[k] not in pairs]
        made = [v for v in (jaxpr.outvars[i] for i in outs) if is_var(v) and v not in paired]
        if len(left) == len(made) == 1:
            pairs[left[0]] = made[0]
    return pairs
