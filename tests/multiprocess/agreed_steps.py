"""A manager whose processes see its directory differently; run it under ``mpmdc launch -n
2`` (``test_checkpoints.py`` does).

``python agreed_steps.py DIRECTORY``: both processes save steps 1 and 2 of one array split
over them. Then process 1's view of the directory lags (it lists only step 1, then does
not see step 2 at all), as on a shared filesystem that shows a new folder late: the steps,
the latest step, the step a restore picks and the refusal to save step 2 again are still
process 0's on both, and a restore that one process cannot read fails on both. Last,
a plain save where process 1 wrongly sees a checkpoint goes ahead (what is there is
process 0's to judge), and the save after it, which process 0 refuses, fails on both at
once. Each process prints what it got or caught.
"""

import os
import sys

import mpmdc

mpmdc.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mpmdc.checkpoint import CheckpointManager, manager, save, storage  # noqa: E402
from mpmdc.errors import CheckpointError, MpmdcError  # noqa: E402


def main(directory: str):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))

    def tree(value):
        return {
            "w": jax.make_array_from_callback((8, 4), sharding, lambda i: np.full((8, 4), value)[i])
        }

    lagging = jax.process_index() == 1
    with CheckpointManager(directory) as checkpoints:
        checkpoints.save(1, tree(1.0))
        checkpoints.save(2, tree(2.0))
        checkpoints.wait_until_finished()
        if lagging:
            manager._complete_steps = lambda directory: [1]
        print(f"steps {checkpoints.all_steps()} latest {checkpoints.latest_step()}", flush=True)
        restored = checkpoints.restore({"w": sharding})
        print(f"restored {float(mpmdc.distributed.fetch(restored)['w'].mean())}", flush=True)
        try:
            checkpoints.save(2, tree(3.0))
        except CheckpointError as err:
            print(f"caught {type(err).__name__}: {err}", flush=True)
        if lagging:
            located = storage.located
            storage.located = lambda d: None if d.endswith("/2") else located(d)
        try:
            checkpoints.restore({"w": sharding}, step=2)
            print("restored step 2", flush=True)
        except CheckpointError as err:
            print(f"caught {type(err).__name__}: {err}", flush=True)
        if lagging:
            storage.located = located
        checkpoints.save(3, tree(3.0))
    print(f"done {checkpoints.all_steps()}", flush=True)
    plain = os.path.join(directory, "plain")
    if lagging:  # a checkpoint there, process 1 thinks, where there is none
        located = storage.located
        storage.located = lambda d: d if d == plain else located(d)
    for attempt in (1, 2):  # the second finds the first's checkpoint
        try:
            save(plain, tree(4.0))
            print(f"saved plain {attempt}", flush=True)
        except MpmdcError as err:
            print(f"caught {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
