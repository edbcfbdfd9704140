"""The single-process runtime: run a split program on its meshes.

Each fragment is compiled ahead of time for its mesh with the static shardings
``split`` gave its operands and results, so every call is a plain executable
call and what runs is exactly the StableHLO that ``lower`` shows. Fragments with the same
body, mesh and shardings share one executable. Transfers are ``device_put`` onto
the destination mesh. JAX's asynchronous dispatch lets meshes overlap; each
intermediate value is dropped right after its last use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from mpmdc import backends
from mpmdc.errors import ArgumentError
from mpmdc.ir import Program, is_var, vars_of
from mpmdc.lowering import fragment_jit
from mpmdc.primitives import fragment_p
from mpmdc.sharding import named


@dataclass(frozen=True)
class Signature:
    """The pytree and leaf types an executable was built for."""

    in_tree: Any
    in_types: tuple[tuple[tuple[int, ...], np.dtype], ...]
    in_paths: tuple[str, ...]
    out_tree: Any

    def check(self, leaves, treedef) -> None:
        """Raise ``ArgumentError`` naming the first argument that does not fit."""
        if treedef != self.in_tree:
            raise ArgumentError(
                f"arguments have pytree structure {treedef} but the executable was lowered "
                f"for {self.in_tree}; call it with the same structure or lower again."
            )
        for leaf, (shape, dtype), path in zip(leaves, self.in_types, self.in_paths):
            got_shape, got_dtype = np.shape(leaf), leaf_dtype(leaf)
            if tuple(got_shape) != shape or got_dtype != dtype:
                raise ArgumentError(
                    f"argument {path} is {got_dtype}{list(got_shape)} but the executable was "
                    f"lowered for {dtype}{list(shape)}; lower again for the new type."
                )


def leaf_dtype(x) -> np.dtype:
    """The dtype of an argument leaf (array, ``ShapeDtypeStruct`` or Python scalar)."""
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None else jax.typeof(x).dtype


@dataclass
class _Step:
    """One top-level equation, ready to run: read ``inputs``, call, bind ``outputs``."""

    call: Callable
    inputs: list
    outputs: list
    release: list


class Executable:
    """A compiled MPMD program: call it like the function it was lowered from."""

    def __init__(self, program: Program, signature: Signature):
        self.program = program
        self.signature = signature
        jaxpr = program.jaxpr.jaxpr
        meshes = program.meshes
        backend = backends.get(program.backend)
        backend.check_can_run(meshes)
        self._in_shardings = [
            named(meshes[m], s) for m, s in zip(program.in_meshes, program.in_specs)
        ]
        donated = {v for v, d in zip(jaxpr.invars, program.donated) if d}
        last_use = {}
        for i, eqn in enumerate(jaxpr.eqns):
            last_use.update((a, i) for a in eqn.invars if is_var(a))
        for v in vars_of(jaxpr.outvars):
            last_use.pop(v, None)
        releases = [[] for _ in jaxpr.eqns]
        for v, i in last_use.items():
            releases[i].append(v)

        executables: dict = {}
        self._steps = []
        for i, eqn in enumerate(jaxpr.eqns):
            if eqn.primitive is fragment_p:
                donate = tuple(
                    k
                    for k, a in enumerate(eqn.invars)
                    if a in donated and last_use.get(a) == i and eqn.invars.count(a) == 1
                )
                key = (
                    str(eqn.params["jaxpr"]),
                    eqn.params["mesh"],
                    eqn.params["in_specs"],
                    eqn.params["out_specs"],
                    donate,
                )
                if key not in executables:
                    jitted, arg_types = fragment_jit(eqn, program, donate)
                    executables[key] = backend.compile_fragment(jitted.trace(*arg_types))
                call = executables[key]
            else:
                dst_mesh = meshes[eqn.params["dst"]]
                call = _transfer_call(backend, [named(dst_mesh, s) for s in eqn.params["dst_specs"]])
            self._steps.append(_Step(call, list(eqn.invars), list(eqn.outvars), releases[i]))
        self._executables = executables
        self._outputs = []
        for v, m, spec in zip(jaxpr.outvars, program.out_meshes, program.out_specs):
            self._outputs.append((v, named(meshes[m], spec)))
        self._consts = dict(zip(jaxpr.constvars, program.jaxpr.consts))

    @property
    def num_executables(self) -> int:
        """How many distinct compiled fragment executables back this program."""
        return len(self._executables)

    def __call__(self, *args, **kwargs):
        """Run on the meshes; returns ``jax.Array``s on the meshes that produced them."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        self.signature.check(leaves, treedef)
        return self.call_flat(leaves)

    def call_flat(self, leaves):
        """Run with already-checked flat arguments; returns the output pytree."""
        jaxpr = self.program.jaxpr.jaxpr
        env = dict(self._consts)
        env.update(
            (v, jax.device_put(x, s)) for v, x, s in zip(jaxpr.invars, leaves, self._in_shardings)
        )
        for step in self._steps:
            results = step.call(*[env[a] if is_var(a) else a.val for a in step.inputs])
            env.update(zip(step.outputs, results))
            for v in step.release:
                del env[v]
        outs = []
        for v, target in self._outputs:
            value = env[v] if is_var(v) else v.val
            outs.append(jax.device_put(value, target))
        return jax.tree_util.tree_unflatten(self.signature.out_tree, outs)


def _transfer_call(backend, shardings):
    def transfer(*values):
        return backend.transfer(values, shardings)

    return transfer
