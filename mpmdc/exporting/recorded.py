"""What an exported program records, as plain data, and the program rebuilt from it.

The recorded program is the scheduled, split program the runtime runs (after ``donate``):
its meshes' shapes, its inputs and outputs (types, meshes, specs, donation, pieces of
stacked arrays), its constants, and its top-level equations in the order they run:
fragments (mesh, stage, microbatch, specs, donated operands, and which module they
run) and transfers (source and destination meshes and specs). Variables are numbers
into one table of array types. Each distinct module is a ``jax.export`` artifact.

:func:`rebuild` makes a :class:`~mpmdc.ir.program.Program` of it for given meshes, each
fragment's body a call of its deserialized module, so the ``lower`` pass and the runtime
run it as they run a traced program.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jax
from jax.extend import core as jcore
from jax.sharding import Mesh
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mpmdc import _jax_compat as compat
from mpmdc.errors import ExportError
from mpmdc.exporting import plain
from mpmdc.ir.primitives import ActionKind, Carries, fragment_p, transfer_p
from mpmdc.ir.program import (
    LoopSchedule,
    Phase,
    Piece,
    Program,
    fragment_key,
    is_var,
    make_closed_jaxpr,
    module_key,
)
from mpmdc.ir.sharding import program_spec_forms
from mpmdc.lowering import export_fragment


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AvalModel(_Model):
    shape: list[Annotated[int, Field(ge=0)]]
    dtype: str
    weak: bool


class VarModel(AvalModel):
    drop: bool = False  # a result nobody reads (JAX's ``DropVar``)


class SpecModel(_Model):
    entries: list[str | list[str] | None]
    unreduced: list[str]
    reduced: list[str]


class MeshModel(_Model):
    axes: list[tuple[str, Annotated[int, Field(ge=1)]]]
    axis_types: list[str]


class OperandModel(_Model):
    var: int | None = None  # a variable's number, or a literal:
    literal: AvalModel | None = None
    bits: str | None = None  # the literal's bytes, hex


class FragmentModel(_Model):
    op: Literal["fragment"]
    name: str
    mesh: int
    stage: int
    transpose: int
    microbatch: int | None
    kind: str
    module: int
    in_specs: list[SpecModel | None]
    out_specs: list[SpecModel | None]
    donate_argnums: list[int]
    inputs: list[OperandModel]
    outputs: list[int]


class TransferModel(_Model):
    op: Literal["transfer"]
    src: int
    dst: int
    src_specs: list[SpecModel | None]
    dst_specs: list[SpecModel | None]
    carries: list[str]
    inputs: list[OperandModel]
    outputs: list[int]


class InputModel(_Model):
    var: int
    mesh: int
    spec: SpecModel | None
    path: str
    donated: bool


class OutputModel(_Model):
    value: OperandModel
    mesh: int
    spec: SpecModel | None
    path: str


class ConstModel(_Model):
    var: int
    array: int  # the ``arrays/<k>`` entry holding its bytes


class PieceModel(_Model):
    leaf: int
    rows: tuple[int, int, int] | None


class ScheduleModel(_Model):
    name: str
    stage_to_mesh: list[int]
    actions: list[list[str]]


class ProgramModel(_Model):
    """``program.json``: everything but the modules, constants' bytes and stage texts."""

    function: str  # the function's module and qualified name (what processes agree on)
    backend: str
    platform: str
    meshes: list[MeshModel]
    stage_to_mesh: list[int] | None
    vars: list[VarModel]
    inputs: list[InputModel]
    consts: list[ConstModel]
    eqns: list[Annotated[FragmentModel | TransferModel, Field(discriminator="op")]]
    outputs: list[OutputModel]
    in_pieces: list[PieceModel] | None
    out_pieces: list[PieceModel] | None
    microbatches: int | None
    schedule: ScheduleModel | None
    in_tree: Any
    out_tree: Any
    arguments: list[AvalModel]  # per leaf of the caller's arguments
    argument_paths: list[str]
    results: list[AvalModel]  # per leaf of the caller's results
    modules: list[int]  # per distinct module, its ``modules/<k>`` entry (equal ones shared)
    stages: list[str]  # recorded stage names, ``stages/<k>`` in this order


def parse(data) -> ProgramModel:
    """``program.json``, validated; anything else is an ``ExportError``."""
    try:
        return ProgramModel.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ExportError(
            f"the exported program's plain data is malformed at {where}: {first['msg']} "
            f"({err.error_count()} problem(s)); the bytes are damaged or were not written by "
            f"this format's Exported.serialize()."
        ) from None


# ------------------------------------------------------------------ recording


class _Numbering:
    """Variable numbers in order of definition, and the table of their types."""

    def __init__(self):
        self.number: dict = {}
        self.table: list[dict] = []

    def define(self, var, where: str) -> int:
        self.number[var] = len(self.table)
        entry = plain.aval_data(var.aval, where)
        if isinstance(var, jcore.DropVar):
            entry["drop"] = True
        self.table.append(entry)
        return self.number[var]

    def operand(self, atom, where: str) -> dict:
        if is_var(atom):
            return {"var": self.number[atom]}
        aval, raw = plain.value_data(atom.val, where)
        aval["weak"] = bool(atom.aval.weak_type)
        return {"literal": aval, "bits": raw.hex()}


def record(program: Program, signature, results, stage_texts: dict[str, str]):
    """``(program.json's data, module blobs, constants' bytes, stage texts)`` of
    ``program`` (split, scheduled and donated), called with ``signature``'s arguments
    and returning ``results`` (their types, per caller leaf)."""
    backend = _backend(program.backend)
    jaxpr = program.jaxpr.jaxpr
    forms = program_spec_forms(program)
    vars_ = _Numbering()
    inputs = [
        {
            "var": vars_.define(v, f"argument {path}"),
            "mesh": mesh,
            "spec": plain.spec_data(spec),
            "path": path,
            "donated": donated,
        }
        for v, mesh, spec, path, donated in zip(
            jaxpr.invars, program.in_meshes, program.in_specs, program.in_paths, program.donated
        )
    ]
    consts, arrays = [], []
    for v, c in zip(jaxpr.constvars, program.jaxpr.consts):
        _, raw = plain.value_data(c, "a constant the function closes over")
        consts.append({"var": vars_.define(v, "a constant"), "array": len(arrays)})
        arrays.append(raw)
    modules: dict = {}  # fragment key -> module number
    # Fragments that differ only in their mesh's devices (the same stage on meshes of one
    # shape) share one entry, as they share one executable (``module_key``).
    blobs: dict = {}  # module key -> entry number
    module_blobs: list[int] = []
    entries: list[bytes] = []
    eqns = []
    for eqn in jaxpr.eqns:
        p = eqn.params
        ins = [vars_.operand(a, "a literal") for a in eqn.invars]
        if eqn.primitive is fragment_p:
            key = fragment_key(eqn)
            if key not in modules:
                shared = module_key(eqn, program.meshes[p["mesh"]])
                if shared not in blobs:
                    blobs[shared] = len(entries)
                    entries.append(_exported_module(program, eqn, backend, forms))
                modules[key] = len(module_blobs)
                module_blobs.append(blobs[shared])
            if not (p["microbatch"] is None or isinstance(p["microbatch"], int)):
                raise ExportError(
                    f"fragment {p['name']} is a rolled loop's: export a program whose "
                    f"`schedule` pass ran (the default pipeline)."
                )
            outs = [vars_.define(v, f"a result of {p['name']}") for v in eqn.outvars]
            eqns.append(
                {
                    "op": "fragment",
                    "name": p["name"],
                    "mesh": p["mesh"],
                    "stage": p["stage"],
                    "transpose": p["transpose"],
                    "microbatch": p["microbatch"],
                    "kind": str(p["kind"]),
                    "module": modules[key],
                    "in_specs": list(map(plain.spec_data, p["in_specs"])),
                    "out_specs": list(map(plain.spec_data, p["out_specs"])),
                    "donate_argnums": list(p["donate_argnums"]),
                    "inputs": ins,
                    "outputs": outs,
                }
            )
        elif eqn.primitive is transfer_p:
            outs = [vars_.define(v, "a transferred value") for v in eqn.outvars]
            eqns.append(
                {
                    "op": "transfer",
                    "src": p["src"],
                    "dst": p["dst"],
                    "src_specs": list(map(plain.spec_data, p["src_specs"])),
                    "dst_specs": list(map(plain.spec_data, p["dst_specs"])),
                    "carries": [str(c) for c in p["carries"]],
                    "inputs": ins,
                    "outputs": outs,
                }
            )
        else:
            raise ExportError(
                f"the program holds a {eqn.primitive.name} equation between fragments; only "
                f"programs whose backend moves values by device_put (fragments and transfers) "
                f"can be exported."
            )
    outputs = [
        {
            "value": vars_.operand(v, f"result {path}"),
            "mesh": mesh,
            "spec": plain.spec_data(spec),
            "path": path,
        }
        for v, mesh, spec, path in zip(
            jaxpr.outvars, program.out_meshes, program.out_specs, program.out_paths
        )
    ]
    plan = program.schedule
    data = {
        "function": signature.function,
        "backend": backend.name,
        "platform": backend.platform,
        "meshes": [
            {
                "axes": [[n, int(s)] for n, s in m.shape.items()],
                "axis_types": [t.name for t in m.axis_types],
            }
            for m in program.meshes
        ],
        "stage_to_mesh": None if program.stage_to_mesh is None else list(program.stage_to_mesh),
        "vars": vars_.table,
        "inputs": inputs,
        "consts": consts,
        "eqns": eqns,
        "outputs": outputs,
        "in_pieces": _pieces_data(program.in_pieces),
        "out_pieces": _pieces_data(program.out_pieces),
        "microbatches": program.microbatches,
        "schedule": None
        if plan is None
        else {
            "name": plan.name,
            "stage_to_mesh": list(plan.stage_to_mesh),
            "actions": [list(row) for row in plan.actions],
        },
        "in_tree": plain.tree_data(signature.in_tree, "the arguments"),
        "out_tree": plain.tree_data(signature.out_tree, "the results"),
        "arguments": [
            plain.aval_data(jax.core.ShapedArray(shape, dtype, weak_type=weak), f"argument {path}")
            for (shape, dtype, weak), path in zip(signature.in_types, signature.in_paths)
        ],
        "argument_paths": list(signature.in_paths),
        "results": [plain.aval_data(a, "a result") for a in results],
        "modules": module_blobs,
        "stages": list(stage_texts),
    }
    return data, entries, arrays, list(stage_texts.values())


def _backend(name: str):
    from mpmdc import backends

    backend = backends.get(name)
    if backend.transfers is not backends.TransferMode.DEVICE_PUT:
        raise ExportError(
            f"backend {name!r} moves values by send/recv inside the fragments, which no "
            f"runtime here runs; export a program compiled for a device_put backend."
        )
    return backend


def _exported_module(program: Program, eqn, backend, forms) -> bytes:
    """Fragment ``eqn``'s module, serialized by ``jax.export``."""
    try:
        return bytes(export_fragment(program, eqn, backend, forms).serialize())
    except Exception as err:
        raise ExportError(
            f"fragment {eqn.params['name']} cannot be exported by jax.export: "
            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}. "
            f"Host callbacks (jax.debug.callback, jax.pure_callback, checkify checks) and "
            f"custom calls without a stable version cannot be serialized; remove them from "
            f"the function to export it."
        ) from err


def _pieces_data(pieces) -> list[dict] | None:
    if pieces is None:
        return None
    return [{"leaf": p.leaf, "rows": None if p.rows is None else list(p.rows)} for p in pieces]


# ------------------------------------------------------------------ rebuilding


def rebuild(model: ProgramModel, meshes: tuple[Mesh, ...], module_of, array_of) -> Program:
    """The program ``model`` records, on ``meshes`` (checked to have its shapes), each
    fragment's body a call of its module (``module_of(k)``: the deserialized
    ``jax.export.Exported`` of entry ``modules/<k>``); ``array_of(k)`` is constant ``k``'s bytes.

    Numbers out of range, or types that do not fit, are an ``ExportError``.
    """
    try:
        return _rebuild(model, meshes, module_of, array_of)
    except (IndexError, KeyError, ValueError, TypeError) as err:
        raise ExportError(
            f"the exported program's plain data does not hold together ({type(err).__name__}: "
            f"{err}); the bytes are damaged or were not written by Exported.serialize()."
        ) from None


def _rebuild(model: ProgramModel, meshes, module_of, array_of) -> Program:
    table = []
    for entry in model.vars:
        aval = plain.aval_from(entry.model_dump())
        table.append(jcore.DropVar(aval) if entry.drop else compat.Var(aval))
    used = set()

    def var(k: int):
        if k < 0 or k in used:
            raise _damaged(f"variable {k} defined twice or negative")
        used.add(k)
        return table[k]

    def operand(o: OperandModel):
        if o.var is not None:
            if o.var not in used:
                raise _damaged(f"variable {o.var} read before it is defined")
            return table[o.var]
        if o.literal is None or o.bits is None:
            raise _damaged("an operand that is neither a variable nor a literal")
        value = plain.value_from(o.literal.model_dump(), bytes.fromhex(o.bits), "a literal")
        return jcore.Literal(
            value[()] if value.ndim == 0 else value, plain.aval_from(o.literal.model_dump())
        )

    invars = [var(i.var) for i in model.inputs]
    constvars = [var(c.var) for c in model.consts]
    consts = [
        plain.value_from(table_entry.model_dump(exclude={"drop"}), array_of(c.array), "a constant")
        for c, table_entry in ((c, model.vars[c.var]) for c in model.consts)
    ]
    bodies: dict[int, Any] = {}
    eqns = []
    for e in model.eqns:
        ins = [operand(o) for o in e.inputs]
        outs = [var(k) for k in e.outputs]
        if isinstance(e, FragmentModel):
            if not 0 <= e.mesh < len(meshes):
                raise _damaged(f"fragment {e.name} on mesh {e.mesh} of {len(meshes)}")
            # One body per module entry and types, so fragments sharing an entry share an
            # executable, as they did when exported.
            shape = (model.modules[e.module], tuple(_type(a.aval) for a in ins))
            shape += (tuple(v.aval.weak_type for v in outs),)
            if shape not in bodies:
                bodies[shape] = _body(module_of(model.modules[e.module]), ins, outs, e.name)
            body = bodies[shape]
            if [_type(v.aval) for v in body.jaxpr.invars] != [_type(a.aval) for a in ins]:
                raise _damaged(f"fragment {e.name}'s operands do not fit its module")
            params = dict(
                jaxpr=body,
                mesh=e.mesh,
                name=e.name,
                stage=e.stage,
                transpose=e.transpose,
                microbatch=e.microbatch,
                kind=ActionKind(e.kind),
                in_specs=tuple(plain.spec_from(_d(s)) for s in e.in_specs),
                out_specs=tuple(plain.spec_from(_d(s)) for s in e.out_specs),
                donate_argnums=tuple(e.donate_argnums),
            )
            eqns.append(jcore.new_jaxpr_eqn(ins, outs, fragment_p, params, body.effects))
        else:
            if [_type(a.aval) for a in ins] != [_type(v.aval) for v in outs]:
                raise _damaged("a transfer whose results' types differ from its values'")
            params = dict(
                src=e.src,
                dst=e.dst,
                src_specs=tuple(plain.spec_from(_d(s)) for s in e.src_specs),
                dst_specs=tuple(plain.spec_from(_d(s)) for s in e.dst_specs),
                carries=tuple(Carries(c) for c in e.carries),
            )
            eqns.append(jcore.new_jaxpr_eqn(ins, outs, transfer_p, params, jcore.no_effects))
    outvars = [operand(o.value) for o in model.outputs]
    closed = make_closed_jaxpr(
        constvars, consts, invars, outvars, eqns, name=model.function.rpartition(".")[2]
    )
    plan = model.schedule
    return Program(
        jaxpr=closed,
        meshes=tuple(meshes),
        stage_to_mesh=None if model.stage_to_mesh is None else tuple(model.stage_to_mesh),
        in_specs=tuple(plain.spec_from(_d(i.spec)) for i in model.inputs),
        out_specs=tuple(plain.spec_from(_d(o.spec)) for o in model.outputs),
        in_paths=tuple(i.path for i in model.inputs),
        out_paths=tuple(o.path for o in model.outputs),
        donated=tuple(i.donated for i in model.inputs),
        backend=model.backend,
        phase=Phase.SCHEDULED,
        in_meshes=tuple(_mesh_index(i.mesh, meshes) for i in model.inputs),
        out_meshes=tuple(_mesh_index(o.mesh, meshes) for o in model.outputs),
        schedule=None
        if plan is None
        else LoopSchedule(
            plan.name, tuple(plan.stage_to_mesh), tuple(tuple(row) for row in plan.actions)
        ),
        microbatches=model.microbatches,
        in_pieces=_pieces_from(model.in_pieces),
        out_pieces=_pieces_from(model.out_pieces),
    )


def _damaged(what: str) -> ExportError:
    return ExportError(
        f"the exported program's plain data does not hold together ({what}); the bytes are "
        f"damaged or were not written by Exported.serialize()."
    )


def _d(spec: SpecModel | None):
    return None if spec is None else spec.model_dump()


def _mesh_index(k: int, meshes) -> int:
    if not 0 <= k < len(meshes):
        raise _damaged(f"mesh {k} of {len(meshes)}")
    return k


def _pieces_from(pieces: list[PieceModel] | None):
    if pieces is None:
        return None
    return tuple(Piece(p.leaf, None if p.rows is None else tuple(p.rows)) for p in pieces)


def _type(aval) -> tuple:
    """What the program records of a type: shape, dtype and weak type."""
    return (tuple(aval.shape), aval.dtype, aval.weak_type)


def _body(exported: jax.export.Exported, ins, outs, name: str):
    """A fragment body calling ``exported``, with the weak types its results had (a
    module's types have none: results computed from a weakly typed value are weak)."""
    weak = [v.aval.weak_type for v in outs]

    def call(*args):
        results = exported.call(*args)
        return [compat.with_weak_type(r, True) if w else r for r, w in zip(results, weak)]

    args = [
        jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype, weak_type=a.aval.weak_type) for a in ins
    ]
    try:
        body = jax.make_jaxpr(call)(*args)
    except Exception as err:
        raise ExportError(
            f"fragment {name}'s module does not take its recorded operands "
            f"({type(err).__name__}: {err}); the exported program is damaged."
        ) from None
    if list(map(_type, body.out_avals)) != [_type(v.aval) for v in outs]:
        raise ExportError(
            f"fragment {name}'s module returns {[a.str_short() for a in body.out_avals]}, but "
            f"the program records {[v.aval.str_short() for v in outs]}; the exported program "
            f"is damaged."
        )
    return body
