"""Run an exported training step without the code that defined it; under ``mpmdc
launch`` or as one process (``test_export.py`` and ``test_export_launch.py`` do both).

``python run_exported.py PROGRAM.mpmdc INPUTS.npz OUT.npz STEPS``: loads the bytes,
runs STEPS steps ``(loss, params, opt_state) = step(params, opt_state, x, y)`` fed
back, on the default meshes (``mpmdc.make_meshes`` of the recorded shapes over every
process's devices), prints ``ok`` and, on process 0, saves every result leaf of every
step to OUT.npz as ``<step>/<leaf>``. Only mpmdc, JAX, NumPy and Optax (whose state
types the pytrees name) are imported: nothing of the function's own code.
"""

import sys

import mpmdc

mpmdc.distributed.initialize()  # one process without `mpmdc launch` (JAX_NUM_CPU_DEVICES)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402, F401  (the optimizer state's namedtuples are its types)


def main(program: str, inputs: str, out: str, steps: int) -> None:
    with open(program, "rb") as f:
        exported = mpmdc.deserialize(f.read())
    saved = np.load(inputs)
    leaves = [saved[f"arr_{k}"] for k in range(len(saved.files))]
    (args, kwargs) = exported.in_tree.unflatten(leaves)
    results = {}
    for step in range(steps):
        out_tree = exported.call(*args, **kwargs)
        for k, leaf in enumerate(mpmdc.fetch(jax.tree_util.tree_leaves(out_tree))):
            results[f"{step}/{k}"] = np.asarray(leaf)
        _, params, opt_state = out_tree
        args = (params, opt_state, *args[2:])
    if jax.process_index() == 0:
        np.savez(out, **results)
    print(f"ok {jax.process_count()} process(es), {len(exported.stages)} stages", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
