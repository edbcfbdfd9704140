"""Golden program: an SGD step over 4 microbatches of a 3-stage MLP under 1F1B.

``after-split`` holds one iteration of the loop (a fragment per stage, forward and
backward, named ``_loop``) between loop edges that slice the batch and carry the
running gradient sums; ``after-schedule`` stamps it out per microbatch (the batch cut
by the fragment before the loop on its mesh) and orders the calls so each mesh runs its
warm-up forwards, then one forward and one backward in turn. Modules are
pinned for CPU only: the fragments are the same ops as in ``mlp2_grad``, whose
modules are pinned for every platform.
"""

from _pipeline import lowered_under

GOLDEN_BACKENDS = ("cpu",)


def lowered():
    """The lowered program (``mpmdc dump tests/programs/pipeline_1f1b.py:lowered``)."""
    return lowered_under("1f1b")
