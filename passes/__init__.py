"""mpmdc's passes, one per module, importable as ``mpmdc.passes``.

Each module holds one pure function ``program -> program`` registered under its
kebab-case name with :func:`~mpmdc.passes.base.register`, with its contract over
:class:`~mpmdc.passes.base.Property`; :data:`PASSES` maps every name to its
:class:`~mpmdc.passes.base.FunctionPass`. ``mpmdc.pipeline`` orders them.

Layer 4: imports :mod:`mpmdc.ir`, :mod:`mpmdc.schedules`, :mod:`mpmdc.lowering`,
:mod:`mpmdc.backends` and below; never the runtime, the API or the command line.
"""

from mpmdc.passes.base import PASSES, FunctionPass, Property, pass_from_text, register
from mpmdc.passes.cond_fission import cond_fission
from mpmdc.passes.dce import dce
from mpmdc.passes.donate import donate
from mpmdc.passes.in_program_transfers import in_program_transfers
from mpmdc.passes.inline import inline
from mpmdc.passes.lower import lower
from mpmdc.passes.partition import partition
from mpmdc.passes.plan import plan
from mpmdc.passes.schedule import schedule
from mpmdc.passes.slice_stacks import slice_stacks
from mpmdc.passes.split import split
from mpmdc.passes.split_backward import split_backward
from mpmdc.passes.split_scans import split_scans
from mpmdc.passes.vma_typecheck import vma_typecheck

__all__ = [
    "PASSES",
    "FunctionPass",
    "Property",
    "cond_fission",
    "dce",
    "donate",
    "in_program_transfers",
    "inline",
    "lower",
    "partition",
    "pass_from_text",
    "plan",
    "register",
    "schedule",
    "slice_stacks",
    "split",
    "split_backward",
    "split_scans",
    "vma_typecheck",
]
