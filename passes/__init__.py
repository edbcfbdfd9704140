"""mpmdc's passes, one per module; each is a frozen dataclass over a pure function."""

from mpmdc.passes.dce import Dce, dce
from mpmdc.passes.in_program_transfers import InProgramTransfers, in_program_transfers
from mpmdc.passes.inline import Inline, inline
from mpmdc.passes.lower import Lower, lower
from mpmdc.passes.partition import Partition, partition
from mpmdc.passes.schedule import SchedulePass, schedule
from mpmdc.passes.split import Split, split
from mpmdc.passes.vma_typecheck import VmaTypecheck, vma_typecheck

__all__ = [
    "Dce",
    "InProgramTransfers",
    "Inline",
    "Lower",
    "Partition",
    "SchedulePass",
    "Split",
    "VmaTypecheck",
    "dce",
    "in_program_transfers",
    "inline",
    "lower",
    "partition",
    "schedule",
    "split",
    "vma_typecheck",
]
