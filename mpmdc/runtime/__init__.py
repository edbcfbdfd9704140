"""Running a lowered program: meshes, executables, transfers, memory, peers.

- ``meshes``: :func:`mpmdc.make_meshes` and the checks on user-given meshes;
- ``executable``: :class:`Compiled`, the facade named as ``jax.stages.Compiled``;
- ``engine``: one compiled executable per distinct fragment and mesh, planned as steps
  and called in program order (one process or many);
- ``timed``: a run with one thread per mesh that times every fragment and transfer;
- ``signature``: the argument types a program was built for, checked at each call;
- ``compiling``: each distinct module compiled once, as soon as it is lowered, and
  loaded onto other meshes of one shape;
- ``executable_cache``: a compiled function's executables per call signature, least
  recently used first out, cleared by ``jax.clear_caches()`` too;
- ``transfers``: how a value moves between two meshes (in one process or across);
- ``pieces``: a stacked argument handed to its per-stage pieces, and a result assembled
  from them, as one array over the stage meshes;
- ``memory``: the bytes each mesh holds along a step, from the release plan;
- ``peers``: what processes agree on before they run, and the progress of a call.

Layer 5: imports :mod:`mpmdc.passes`, :mod:`mpmdc.backends`, :mod:`mpmdc.distributed`'s
peers (the same layer) and below; never :mod:`mpmdc.api` or :mod:`mpmdc.cli`.
"""

from mpmdc.runtime.executable import Compiled

__all__ = ["Compiled"]
