"""Golden program: the step of ``pipeline_1f1b`` under the zero-bubble ZB-H1 schedule.

``after-schedule`` cuts each backward into an input-gradient fragment (``igrad``,
what the stage before needs) and a weight-gradient one (``wgrad``), and delays the
weight gradients into 1F1B's bubbles. Modules are pinned for CPU only.
"""

from _pipeline import lowered_under

GOLDEN_BACKENDS = ("cpu",)


def lowered():
    """The lowered program (``mpmdc dump tests/programs/pipeline_zb_h1.py:lowered``)."""
    return lowered_under("zb-h1")
