"""What the ``plan`` pass decides from estimates: the stages the marked segments are
grouped into (:mod:`~mpmdc.planning.balancing`) and the microbatch loop's schedule
(:mod:`~mpmdc.planning.scheduling`), from each fragment's estimated seconds and bytes
(:mod:`~mpmdc.planning.estimates`) on a trial run of the pipeline's passes up to
``split``.

Layer 4, beside :mod:`mpmdc.passes` and :mod:`mpmdc.pipeline` (it runs a pipeline):
imports :mod:`mpmdc.ir`, :mod:`mpmdc.schedules`, :mod:`mpmdc.lowering`,
:mod:`mpmdc.backends` and those two; never the runtime, the API or the command line.
"""
