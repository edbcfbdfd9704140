"""``mpmdc.export``, ``mpmdc.deserialize`` and :class:`Exported`, shaped as ``jax.export``.

``export(step)(*args)`` lowers a compiled function for its arguments' types and records
the program the runtime would run (:mod:`mpmdc.exporting.recorded`) with one
``jax.export`` artifact per distinct fragment module. ``Exported.call`` rebuilds that
program on meshes of the recorded shapes and runs it on the same runtime as a compiled
function: the ``lower`` pass lowers each fragment (its body a call of its deserialized
module) with its mesh shardings and donation, and :class:`~mpmdc.runtime.Compiled` runs
the fragments and transfers in their recorded order, so the results are those of the
function it was exported from, to the bit.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, PartitionSpec

from mpmdc import _jax_compat as compat
from mpmdc import backends
from mpmdc._text import a_type
from mpmdc.api import Lowered, Wrapped
from mpmdc.errors import ArgumentError, ExportError, MpmdcError
from mpmdc.exporting import container, plain, recorded
from mpmdc.ir.program import LoopSchedule
from mpmdc.passes.lower import lower
from mpmdc.runtime.compiling import FragmentCompiler
from mpmdc.runtime.executable import Compiled
from mpmdc.runtime.meshes import check_meshes, make_meshes
from mpmdc.runtime.signature import Signature
from mpmdc.runtime.transfers import is_here


class MeshSpec(NamedTuple):
    """Where one program input or output lives: its mesh's index, its spec inside that
    mesh (``None``: the program chose none), and for a piece of a stacked array its
    rows ``(axis, lo, hi)``."""

    mesh: int
    spec: PartitionSpec | None
    rows: tuple[int, int, int] | None = None


@compat.api_boundary
def export(fn: Wrapped):
    """``export(fn)(*args, **kwargs)``: the :class:`Exported` program of ``fn`` (a function
    from ``mpmdc.compile``) for these arguments (arrays or ``jax.ShapeDtypeStruct``s,
    static arguments as for ``fn.lower``)."""
    if not isinstance(fn, Wrapped):
        raise ExportError(
            f"mpmdc.export takes a function from mpmdc.compile, got {a_type(fn)}; "
            f"export mpmdc.compile(fn, meshes)."
        )

    @functools.wraps(fn.fn)
    def exporting(*args, **kwargs) -> Exported:
        return Exported._of(fn.lower(*args, **kwargs))

    return exporting


@compat.api_boundary
def deserialize(data: bytes) -> Exported:
    """The :class:`Exported` program ``Exported.serialize()`` wrote. Damaged or truncated
    bytes, another format version, and modules this JAX cannot load are an
    ``ExportError``; nothing in the bytes is executed."""
    archive = container.Archive(data)
    model = recorded.parse(archive.json("program.json"))
    blobs = [archive.read(f"modules/{k}") for k in range(max(model.modules, default=-1) + 1)]
    arrays = [archive.read(f"arrays/{c.array}") for c in model.consts]
    texts = [archive.read(f"stages/{k}").decode() for k in range(len(model.stages))]
    return Exported(model, blobs, arrays, texts, archive.written_by)


class Exported:
    """A compiled pipeline as plain data and StableHLO, callable without the function it
    came from (as ``jax.export.Exported``): :meth:`serialize` gives its bytes,
    :meth:`call` runs it."""

    def __init__(self, model, blobs, arrays, texts, written_by):
        self._model = model
        self._blobs = blobs
        self._arrays = arrays
        self._texts = dict(zip(model.stages, texts))
        self.written_by: dict[str, str] = dict(written_by)  # JAX, jaxlib, mpmdc versions
        self._modules: dict[int, jax.export.Exported] = {}
        self._compiled: dict = {}

    @classmethod
    def _of(cls, lowered: Lowered) -> Exported:
        program = lowered._lowered()
        texts = {stage: lowered.as_text(stage) for stage in lowered.stages}
        results = lowered.program(lowered.stages[0]).jaxpr.out_avals
        data, blobs, arrays, texts = recorded.record(program, lowered.signature, results, texts)
        model = recorded.parse(data)
        return cls(model, blobs, arrays, texts, container.versions())

    def serialize(self) -> bytes:
        """The program as bytes (see docs/design.md, "Exported programs")."""
        return container.write(
            self._model.model_dump(mode="json"),
            self._blobs,
            self._arrays,
            list(self._texts.values()),
        )

    # ---------------------------------------------------------------- what it is

    @property
    def fun_name(self) -> str:
        """The exported function's module and qualified name."""
        return self._model.function

    @property
    def platform(self) -> str:
        """The platform its modules were lowered for (``cpu``, ``cuda``, ...)."""
        return self._model.platform

    @functools.cached_property
    def in_tree(self):
        """The pytree structure of ``(args, kwargs)`` (static arguments left out)."""
        return plain.tree_from(self._model.in_tree)

    @functools.cached_property
    def out_tree(self):
        """The pytree structure of the results."""
        return plain.tree_from(self._model.out_tree)

    @property
    def in_avals(self) -> tuple[jax.core.ShapedArray, ...]:
        """Each flat argument's type."""
        return tuple(plain.aval_from(a.model_dump()) for a in self._model.arguments)

    @property
    def out_avals(self) -> tuple[jax.core.ShapedArray, ...]:
        """Each flat result's type."""
        return tuple(plain.aval_from(a.model_dump()) for a in self._model.results)

    @property
    def mesh_shapes(self) -> tuple[dict[str, int], ...]:
        """Each mesh's axes and sizes, as the meshes of :meth:`call` must have them."""
        return tuple(dict(m.axes) for m in self._model.meshes)

    @property
    def in_shardings(self):
        """Where each argument runs, as ``(args, kwargs)`` pytrees of :class:`MeshSpec`
        (a tuple of them for a stacked array held in pieces, one per stage)."""
        places = [
            MeshSpec(i.mesh, plain.spec_from(recorded._d(i.spec))) for i in self._model.inputs
        ]
        return self.in_tree.unflatten(_per_leaf(places, self._model.in_pieces, len(self.in_avals)))

    @property
    def out_shardings(self):
        """Where each result lives, a pytree of :class:`MeshSpec` (as :attr:`in_shardings`)."""
        places = [
            MeshSpec(o.mesh, plain.spec_from(recorded._d(o.spec))) for o in self._model.outputs
        ]
        return self.out_tree.unflatten(
            _per_leaf(places, self._model.out_pieces, len(self.out_avals))
        )

    @property
    def schedule(self) -> LoopSchedule | None:
        """The microbatch loop's schedule: its name, layout and each mesh's actions."""
        plan = self._model.schedule
        if plan is None:
            return None
        return LoopSchedule(
            plan.name, tuple(plan.stage_to_mesh), tuple(tuple(r) for r in plan.actions)
        )

    @property
    def microbatches(self) -> int | None:
        """The microbatch loop's count (``None``: no loop)."""
        return self._model.microbatches

    @property
    def stages(self) -> tuple[str, ...]:
        """The recorded stages (``input``, ``after-inline``, ..., ``stablehlo``)."""
        return tuple(self._texts)

    def as_text(self, stage: str = "after-split") -> str:
        """The text of the IR after ``stage``, as ``Lowered.as_text`` printed it at export."""
        if stage not in self._texts:
            raise ExportError(
                f"unknown stage {stage!r}; recorded stages: {', '.join(self._texts)}."
            )
        return self._texts[stage]

    # ---------------------------------------------------------------- running it

    def call(self, *args, meshes=None, **kwargs):
        """Run on ``meshes`` (default: :func:`mpmdc.make_meshes` of the recorded shapes over
        the devices here); returns what the exported function returns, on the meshes.

        Arguments must have the recorded structure, shapes and dtypes; a committed array
        must already have the sharding the program runs it with (``compile().input_shardings``).
        """
        compiled = self.compile(meshes)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        compiled.signature.check(args, kwargs, leaves, treedef)
        _check_placed(leaves, compiled)
        return compiled.call_flat(leaves)

    def compile(self, meshes=None) -> Compiled:
        """The program on ``meshes``, compiled (once per set of meshes): the runtime's
        ``Compiled``, with ``input_shardings``, ``memory`` and the analyses."""
        meshes = self._meshes(meshes)
        key = tuple((tuple(m.device_ids.flat), tuple(m.shape.items())) for m in meshes)
        if key not in self._compiled:
            self._compiled[key] = self._compile(meshes)
        return self._compiled[key]

    def _compile(self, meshes) -> Compiled:
        model = self._model
        backend = backends.get(model.backend)
        backend.check_can_run(meshes)
        program = recorded.rebuild(model, meshes, self._module, self._arrays.__getitem__)
        signature = Signature(
            in_tree=self.in_tree,
            in_types=tuple((tuple(a.shape), a.dtype, a.weak_type) for a in self.in_avals),
            in_paths=tuple(model.argument_paths),
            out_tree=self.out_tree,
            function=model.function,
            remedy="export the compiled function again",
        )
        here = tuple(m for m, mesh in enumerate(meshes) if is_here(mesh))
        with FragmentCompiler(backend) as compiler:
            try:
                lowered = lower(
                    program,
                    backend=backend.name,
                    meshes=here if len(here) < len(meshes) else None,
                    on_module=compiler.offer,
                )
            except MpmdcError:
                raise
            except Exception as err:
                raise self._cannot_load("compiled", err) from err
            return Compiled(lowered, signature, compiler=compiler)

    def _module(self, k: int) -> jax.export.Exported:
        """Entry ``modules/<k>``, deserialized by ``jax.export`` (once)."""
        if k not in self._modules:
            blob = self._blobs[k]
            try:
                self._modules[k] = jax.export.deserialize(bytearray(blob))
            except Exception as err:
                raise self._cannot_load("loaded", err) from err
        return self._modules[k]

    def _cannot_load(self, what: str, err: Exception) -> ExportError:
        mine = container.versions()
        detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
        theirs = {k: self.written_by.get(k) for k in ("jax", "mpmdc")}
        if theirs == {k: mine[k] for k in ("jax", "mpmdc")}:
            # The same versions load what they wrote: the module itself is damaged.
            advice = "the versions are the same, so the bytes are damaged: serialize it again."
        else:
            advice = "export the program again with this version."
        return ExportError(
            f"the exported modules cannot be {what} here ({type(err).__name__}: {detail}); "
            f"they were exported by jax {theirs['jax']} / mpmdc {theirs['mpmdc']} for "
            f"{self.platform}, this is jax {mine['jax']} / mpmdc {mine['mpmdc']}; {advice}"
        )

    def _meshes(self, meshes) -> tuple:
        """``meshes``, checked against the recorded shapes; by default made of the devices
        here."""
        recorded_meshes = self._model.meshes
        if meshes is None:
            first = recorded_meshes[0]
            if any(m != first for m in recorded_meshes) or len(set(first.axis_types)) > 1:
                raise ExportError(
                    f"the program runs on meshes of several shapes {list(self.mesh_shapes)}; "
                    f"pass meshes= (jax.sharding.Mesh objects of these shapes)."
                )
            return make_meshes(
                len(recorded_meshes),
                dict(first.axes),
                axis_types=AxisType[first.axis_types[0]] if first.axis_types else None,
            )
        meshes = check_meshes(meshes)
        if len(meshes) != len(recorded_meshes):
            raise ExportError(
                f"meshes= holds {len(meshes)} mesh(es), but the program was exported for "
                f"{len(recorded_meshes)} of shapes {list(self.mesh_shapes)}; pass a sequence of "
                f"{len(recorded_meshes)} meshes."
            )
        for i, (mesh, want) in enumerate(zip(meshes, recorded_meshes)):
            got = [[n, int(s)] for n, s in mesh.shape.items()]
            types = [t.name for t in mesh.axis_types]
            if got != [list(a) for a in want.axes] or types != want.axis_types:
                raise ExportError(
                    f"meshes[{i}] is {dict(mesh.shape)} with axis types {types}, but the program "
                    f"was exported for {dict(want.axes)} with {want.axis_types}; give a mesh of "
                    f"that shape."
                )
        return meshes


def _per_leaf(places: list, pieces, leaves: int) -> list[Any]:
    """Per caller leaf, its place, or a tuple of its pieces' places."""
    if pieces is None:
        return places
    out: list[list] = [[] for _ in range(leaves)]
    for place, piece in zip(places, pieces):
        rows = None if piece.rows is None else tuple(piece.rows)
        out[piece.leaf].append(place._replace(rows=rows))
    return [
        group[0] if len(group) == 1 and group[0].rows is None else tuple(group) for group in out
    ]


def _check_placed(leaves, compiled: Compiled) -> None:
    """An ``ArgumentError`` for a committed argument not placed as the program runs it
    (``jax.jit`` refuses a committed argument on other devices likewise)."""
    wanted = jax.tree_util.tree_leaves(compiled.input_shardings)
    for x, sharding, path in zip(leaves, wanted, compiled.signature.in_paths):
        if not (isinstance(x, jax.Array) and x.committed):
            continue
        if x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim):
            continue
        got = getattr(x.sharding, "spec", x.sharding)
        raise ArgumentError(
            f"argument {path} is committed to devices "
            f"{sorted(d.id for d in x.sharding.device_set)} with "
            f"{got}, but the exported program runs it on devices "
            f"{sorted(d.id for d in sharding.device_set)} with {sharding.spec}; "
            f"jax.device_put it onto exported.compile().input_shardings, or pass a host value."
        )
