"""The timeline of a pipeline run, simulated or measured: what each mesh did when.

A :class:`Timeline` holds one row of :class:`Slot` per mesh. It knows its makespan and
bubble fraction and draws itself as ASCII, as a Chrome/Perfetto trace or as a PNG.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mpmdc.errors import ScheduleError
from mpmdc.schedules.actions import Action


@dataclass(frozen=True)
class Slot:
    """One piece of work on the timeline of its mesh: a schedule action, or (in a
    measured run) a fragment outside the microbatch loop or a transfer, with ``name``."""

    action: Action | None
    start: float
    end: float
    name: str = ""

    @property
    def label(self) -> str:
        """What the slot shows: its action (``0F3``), else its name."""
        return self.name if self.action is None else str(self.action)

    @property
    def kind(self) -> str:
        """The action kind (F, B, I, W), or ``other``."""
        return self.action.kind if self.action is not None else "other"


@dataclass(frozen=True)
class Timeline:
    """Per-mesh slots of a simulated (or measured) run."""

    meshes: tuple[tuple[Slot, ...], ...]

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end."""
        return max((s.end for slots in self.meshes for s in slots), default=0.0)

    @property
    def bubble_time(self) -> float:
        """Idle time per mesh up to the makespan, averaged over the meshes."""
        busy = sum(s.end - s.start for slots in self.meshes for s in slots)
        return self.makespan - busy / len(self.meshes) if self.meshes else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all meshes' time up to the makespan."""
        return self.bubble_time / self.makespan if self.makespan else 0.0

    @property
    def busy_times(self) -> tuple[float, ...]:
        """Per mesh, the time its slots take."""
        return tuple(sum(s.end - s.start for s in slots) for slots in self.meshes)

    def __repr__(self) -> str:
        """A one-line summary (a step's slots run to tens of kilobytes; :meth:`ascii`
        draws them)."""
        busy = ", ".join(f"{t:.4g}" for t in self.busy_times)
        slots = sum(map(len, self.meshes))
        return (
            f"Timeline(makespan={self.makespan:.4g}, bubble_fraction={self.bubble_fraction:.3f}, "
            f"busy_times=({busy}), {slots} slots on {len(self.meshes)} meshes; .ascii() draws them)"
        )

    def ascii(self, width_per_unit: int | None = None, max_columns: int = 240) -> str:
        """One row per mesh; each action a box starting with its label, idle time ``.``.

        The shortest slot gets ``width_per_unit`` columns (default: the longest label
        plus one) unless the rows would exceed ``max_columns``.
        """
        if not any(self.meshes):
            return ""
        unit, width = self._grid(width_per_unit, max_columns)
        columns = round(self.makespan / unit * width)
        rows = []
        for mesh, row in enumerate(self.meshes):
            line = ["."] * columns
            for slot in row:
                a, b = round(slot.start / unit * width), round(slot.end / unit * width)
                box = (slot.label + " " * (b - a))[: b - a - 1] + "|" if b > a else ""
                line[a:b] = box
            rows.append(f"mesh{mesh} |{''.join(line)}")
        return "\n".join(rows)

    def column_time(self, width_per_unit: int | None = None, max_columns: int = 240) -> float:
        """The time one column of :meth:`ascii` (same arguments) stands for."""
        unit, width = self._grid(width_per_unit, max_columns)
        return unit / width

    def _grid(self, width_per_unit, max_columns) -> tuple[float, int]:
        """``(time unit, columns per unit)`` of the ASCII drawing."""
        slots = [s for row in self.meshes for s in row]
        width = width_per_unit or max((len(s.label) for s in slots), default=0) + 1
        unit = min((s.end - s.start for s in slots if s.end > s.start), default=1.0)
        return max(unit, self.makespan * width / max_columns), width

    def chrome_trace(self, time_unit_us: float = 1000.0) -> str:
        """The timeline as Chrome/Perfetto trace JSON (one track per mesh)."""
        events = [
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": mesh,
                "args": {"name": f"mesh{mesh}"},
            }
            for mesh in range(len(self.meshes))
        ]
        for mesh, row in enumerate(self.meshes):
            for slot in row:
                args = {"fragment": slot.name} if slot.name else {}
                if slot.action is not None:
                    args.update(stage=slot.action.stage, microbatch=slot.action.microbatch)
                events.append(
                    {
                        "name": slot.label,
                        "cat": slot.kind,
                        "ph": "X",
                        "pid": 0,
                        "tid": mesh,
                        "ts": slot.start * time_unit_us,
                        "dur": (slot.end - slot.start) * time_unit_us,
                        "args": args,
                    }
                )
        return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1)

    def save_png(self, path, title: str = "") -> None:
        """Draw the timeline with matplotlib (one bar row per mesh, coloured by kind)."""
        try:
            import matplotlib
        except ImportError:
            raise ScheduleError(
                "drawing a timeline needs matplotlib; install it with pip install 'mpmdc[plot]'."
            ) from None

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colours = {
            "F": "tab:blue",
            "B": "tab:orange",
            "I": "tab:orange",
            "W": "tab:green",
            "other": "tab:gray",
        }
        fig, ax = plt.subplots(figsize=(max(6.0, self.makespan / 3), 0.6 * len(self.meshes) + 1))
        for mesh, row in enumerate(self.meshes):
            for slot in row:
                ax.broken_barh(
                    [(slot.start, slot.end - slot.start)],
                    (mesh - 0.4, 0.8),
                    facecolors=colours[slot.kind],
                    edgecolor="black",
                    linewidth=0.5,
                )
                ax.text(
                    (slot.start + slot.end) / 2,
                    mesh,
                    slot.label,
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        ax.set_yticks(range(len(self.meshes)), [f"mesh{m}" for m in range(len(self.meshes))])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(title or f"bubble fraction {self.bubble_fraction:.3f}")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
