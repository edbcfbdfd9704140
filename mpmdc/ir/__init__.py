"""The IR: a JAX jaxpr at every step, with mpmdc's primitives and the side data they carry.

- ``primitives``: the ``stage``, ``layer_stage`` and ``microbatch`` markers, a rolled loop's
  ``loop_edge``, ``fragment`` and ``transfer`` (each with its abstract eval, DCE and
  typecheck rules), and the enums :class:`ActionKind`, :class:`LoopEdge`, :class:`Carries`;
- ``program``: :class:`Program` (a closed jaxpr plus meshes, specs and paths, and a
  loop's :class:`LoopSchedule`, inputs and outputs held in pieces), placements carried
  on equations, helpers that build
  jaxprs, fragment identity and the printer;
- ``loop``: a split program's rolled loop told apart, and stamped out per microbatch;
- ``layers``: which iterations of a scan over layers each stage runs (``every=``);
- ``stack_rules``: work on a stacked value run per stage's piece, a rule registry keyed
  by primitive;
- ``graph``: producers, readers and last uses of a program's values;
- ``pytrees``: prefix broadcasting and the first difference between two pytrees;
- ``keys``: typed PRNG keys, and the plain array of key data that stands for them;
- ``sharding``: PartitionSpec checks and the mesh axes a spec entry names;
- ``spec_rules``: batch sharding carried through equations, a rule registry keyed by
  primitive;
- ``traffic``: what a split program moves between meshes.

Layer 1: imports only :mod:`mpmdc.errors` and :mod:`mpmdc._jax_compat` from mpmdc.
"""
