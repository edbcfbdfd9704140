"""Golden program: an SGD step over 4 microbatches of a 3-stage MLP under 1F1B.

``after-split`` has one fragment per (stage, forward/backward, microbatch) plus one
before the loop that slices the batch; ``after-schedule`` orders them so each mesh
runs its warm-up forwards, then one forward and one backward in turn. Modules are
pinned for CPU only: the fragments are the same ops as in ``mlp2_grad``, whose
modules are pinned for every platform.
"""

from _pipeline import lowered_under

GOLDEN_BACKENDS = ("cpu",)


def lowered():
    """The lowered program (``mpmdc dump tests/programs/pipeline_1f1b.py:lowered``)."""
    return lowered_under("1f1b")
