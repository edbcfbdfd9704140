"""What one step moves between meshes, and what each mesh holds between steps.

Every ``transfer`` records, per value, what it carries (``split`` decides):

- ``activation`` / ``cotangent``: a value crossing a stage marker, forward or
  backward. These are what pipelining has to move; their bytes are the *floor*.
- ``state``: a program input or a value computed from program inputs alone —
  parameters, optimizer state, anything derived from them (and a batch that
  ``accumulate`` does not slice). A training step that keeps each parameter on its
  stage's mesh moves none of these, except a parameter several stages read (a tied
  embedding), which travels to each of them once per step.
- ``other``: the rest, e.g. the scalar partial results of a global gradient norm,
  gradient contributions of a shared parameter, the loss.

The counts are per step: a scheduled program has every microbatch's transfers, and a
rolled loop's (before ``schedule``) count once per microbatch.

An argument committed to another mesh than the one that reads it (``Program.arg_meshes``:
where each was when the program was traced) is moved by the runtime before every call;
the report counts it as ``state`` on its link and names it. A stack's rows held in
pieces are where their devices are (``Program.arg_blocks``): nowhere else when each
piece's rows are on the mesh reading them (as the step returned the stack), else moved
from the mesh holding them. One committed to devices that are no one mesh's (part of
a mesh, even the one reading it, or spread over several, or outside them) is named too
and counted in the totals, on no link.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpmdc.errors import PassError
from mpmdc.ir.loop import rolled_loop
from mpmdc.ir.primitives import Carries, transfer_p
from mpmdc.ir.program import Phase, Program, nbytes

CATEGORIES = ("activations/cotangents", "parameters/optimizer state", "other")
_CATEGORY_OF = {
    Carries.ACTIVATION: CATEGORIES[0],
    Carries.COTANGENT: CATEGORIES[0],
    Carries.STATE: CATEGORIES[1],
    Carries.OTHER: CATEGORIES[2],
}


@dataclass(frozen=True)
class Link:
    """Traffic from mesh ``src`` to mesh ``dst`` in one step: values and bytes per category."""

    src: int
    dst: int
    values: tuple[int, ...]  # per CATEGORIES
    bytes: tuple[int, ...]  # per CATEGORIES


@dataclass(frozen=True)
class ArgumentMove:
    """An argument the runtime moves from mesh ``src`` to mesh ``dst`` before each call;
    ``src`` is ``None`` for one on ``devices`` that no one mesh holds."""

    path: str
    src: int | None
    dst: int
    bytes: int
    devices: tuple[int, ...] = ()  # the device ids it is on, where ``src`` is None

    @property
    def source(self) -> str:
        """Where the argument is, in the report's words."""
        return f"mesh{self.src}" if self.src is not None else f"devices {list(self.devices)}"


@dataclass(frozen=True)
class TransferReport:
    """Per (source, destination) mesh pair, what one step moves; per mesh, what it holds."""

    links: tuple[Link, ...]
    inputs_held: tuple[int, ...]  # bytes of program inputs per mesh
    outputs_held: tuple[int, ...]  # bytes of program outputs per mesh
    arguments: tuple[ArgumentMove, ...] = ()  # also counted in ``links`` where ``src`` is a mesh

    def total(self, category: str | None = None) -> int:
        """Bytes moved per step (in ``category``, one of :data:`CATEGORIES`, if given),
        arguments on devices that are no one mesh's included."""
        columns = range(len(CATEGORIES)) if category is None else [CATEGORIES.index(category)]
        moved = sum(link.bytes[c] for link in self.links for c in columns)
        if category in (None, CATEGORIES[1]):
            moved += sum(move.bytes for move in self.arguments if move.src is None)
        return moved

    def __str__(self) -> str:
        return self.as_text()

    def as_text(self) -> str:
        """A table: one row per mesh pair, then the bytes each mesh holds."""
        head = ["link", "values"] + [f"{c} B" for c in CATEGORIES]
        rows = [
            [f"mesh{link.src} -> mesh{link.dst}", str(sum(link.values))]
            + [str(b) for b in link.bytes]
            for link in self.links
        ]
        rows.append(
            ["total", str(sum(sum(link.values) for link in self.links))]
            + [str(self.total(c)) for c in CATEGORIES]
        )
        widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        lines = ["transfers per step:"]
        for r in [head, *rows]:
            lines.append(
                "  "
                + "  ".join(
                    cell.ljust(w) if k == 0 else cell.rjust(w)
                    for k, (cell, w) in enumerate(zip(r, widths))
                )
            )
        lines.append(
            "held per mesh (bytes of the step's inputs / outputs: parameters, optimizer state, batch):"
        )
        for m, (i, o) in enumerate(zip(self.inputs_held, self.outputs_held)):
            lines.append(f"  mesh{m}: {i} in / {o} out")
        if self.arguments:
            lines.append(
                "arguments moved before each call (committed to another mesh than the one "
                "that reads them):"
            )
            for move in self.arguments:
                lines.append(f"  {move.path}: {move.source} -> mesh{move.dst}, {move.bytes} B")
        return "\n".join(lines) + "\n"


def holders_of_rows(blocks, rows: tuple[int, int, int]) -> set[int]:
    """The ids of the devices that, of ``blocks`` (``Program.arg_blocks``' form), hold any
    of rows ``lo:hi`` along ``axis`` (``rows`` as ``(axis, lo, hi)``)."""
    axis, lo, hi = rows
    return {device for device, spans in blocks if spans[axis][0] < hi and lo < spans[axis][1]}


def _source_of_piece(program: Program, k: int, leaf: int):
    """Where program input ``k``, rows of argument ``leaf`` committed to devices of several
    meshes (``Program.arg_blocks``), is before a call: the index of the mesh whose
    devices hold those rows, else the sorted ids of those devices."""
    rows = program.in_pieces[k].rows if program.in_pieces is not None else None
    blocks = program.arg_blocks[leaf] if program.arg_blocks else None
    if rows is None or blocks is None:
        return program.arg_meshes[leaf]
    return mesh_or_devices(holders_of_rows(blocks, rows), program.meshes)


def mesh_or_devices(ids: set[int], meshes) -> int | tuple[int, ...]:
    """The index of the mesh whose devices are the devices ``ids``, else ``ids`` sorted
    (on part of a mesh, on several, or outside them: moved even onto the mesh a part
    of which holds it)."""
    found = next((i for i, m in enumerate(meshes) if ids == {d.id for d in m.devices.flat}), None)
    return found if found is not None else tuple(sorted(ids))


def transfer_report(program: Program) -> TransferReport:
    """The traffic of a split (or scheduled) program; see the module docstring."""
    if program.phase < Phase.SPLIT:
        raise PassError("transfer_report needs a split program; run `split` before it.")
    jaxpr = program.jaxpr.jaxpr
    # A rolled loop's iteration runs once per microbatch.
    loop = rolled_loop(jaxpr.eqns)
    in_loop = {id(eqn) for eqn in loop.iteration} if loop else set()
    links: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive is not transfer_p:
            continue
        times = program.microbatches if id(eqn) in in_loop else 1
        values, moved = links.setdefault((eqn.params["src"], eqn.params["dst"]), ([0] * 3, [0] * 3))
        for v, carried in zip(eqn.invars, eqn.params["carries"]):
            c = CATEGORIES.index(_CATEGORY_OF[carried])
            values[c] += times
            moved[c] += times * nbytes(v.aval)
    arguments = []
    state = CATEGORIES.index(_CATEGORY_OF[Carries.STATE])
    for k, (v, dst) in enumerate(zip(jaxpr.invars, program.in_meshes)):
        leaf = program.argument_leaf(k)
        src = _source_of_piece(program, k, leaf) if program.arg_meshes else None
        if src is None or src == dst:
            continue
        if isinstance(src, tuple):  # on devices no one mesh holds: no link
            arguments.append(ArgumentMove(program.in_paths[k], None, dst, nbytes(v.aval), src))
            continue
        arguments.append(ArgumentMove(program.in_paths[k], src, dst, nbytes(v.aval)))
        values, moved = links.setdefault((src, dst), ([0] * 3, [0] * 3))
        values[state] += 1
        moved[state] += nbytes(v.aval)
    inputs_held = [0] * len(program.meshes)
    for v, m in zip(jaxpr.invars, program.in_meshes):
        inputs_held[m] += nbytes(v.aval)
    outputs_held = [0] * len(program.meshes)
    for v, m in zip(jaxpr.outvars, program.out_meshes):
        outputs_held[m] += nbytes(v.aval)
    return TransferReport(
        links=tuple(Link(s, d, tuple(n), tuple(b)) for (s, d), (n, b) in sorted(links.items())),
        inputs_held=tuple(inputs_held),
        outputs_held=tuple(outputs_held),
        arguments=tuple(arguments),
    )
