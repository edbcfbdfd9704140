"""A save whose writes fail on one process of two; run it under ``mpmdc launch -n 2``
(``test_checkpoints.py`` does).

``python failed_save.py DIRECTORY``: both processes save one array split over them to
``DIRECTORY/first``, where process 1's writes fail as on a full disk; each prints what it
caught. Then both save to ``DIRECTORY/second``, which succeeds: a failed save fails that
save, not the run.
"""

import os
import sys

import mpmdc

mpmdc.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mpmdc.checkpoint import save, storage  # noqa: E402


def failing(opened):
    def opening(spec, context, **mode):
        if mode.get("write") and "/first." in spec["kvstore"]["path"]:
            raise OSError(28, "No space left on device")
        return opened(spec, context, **mode)

    return opening


def main(directory: str):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    w = jax.make_array_from_callback((8, 4), sharding, lambda i: np.ones((8, 4))[i])
    if jax.process_index() == 1:
        storage.opened = failing(storage.opened)
    try:
        save(os.path.join(directory, "first"), {"w": w})
    except mpmdc.MpmdcError as err:
        print(f"caught {type(err).__name__}: {err}", flush=True)
    save(os.path.join(directory, "second"), {"w": w})
    print("saved second", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
