"""Checkpoints: save and restore time and bytes written per process, against Orbax.

Two training states, laid out as a 4-stage pipeline keeps them:

- ``gpt``: ``examples/nnx_gpt.py``'s GPT parameters and AdamW state, each leaf on the
  mesh of its stage (the shardings of the compiled step's ``input_shardings``);
- ``1 GB``: two stacked layer arrays of 32 x 2048 x 2048 float32 (1 GiB), each stage's
  rows of 8 layers on its mesh (a ``stages`` axis, as a scanned stack is held).

Each is saved with ``mpmdc.checkpoint.save`` into a new directory and restored onto the
same layout (median of ``--repeat``), with the part of the save an asynchronous save
does before returning to the caller (checks, agreement, copies to the host), in one process (4 meshes of 2 CPU devices) and in
4 processes of one device each (``mpmdc launch -n 4``: each process writes and reads its
own stage's quarter). In one process also Orbax's ``StandardCheckpointer`` (save, then
wait until finished; restore onto the same shardings), and mpmdc's restore onto one
device (another layout: every chunk read by the one process).

Usage::

    python benchmarks/checkpoint.py [--repeat 3] [--dir /tmp]   # starts the 4 processes itself
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import mpmdc

WORKER = "--worker" in sys.argv
if WORKER:
    mpmdc.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from mpmdc.checkpoint import restore  # noqa: E402
from mpmdc.checkpoint.saving import Save  # noqa: E402

LAYERS, WIDTH = 32, 2048


def gpt_state(meshes):
    """The example GPT's parameters and AdamW state where its pipelined step keeps them."""
    import importlib.util

    from flax import nnx

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "nnx_gpt.py")
    spec = importlib.util.spec_from_file_location("nnx_gpt", path)
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    graphdef, params = nnx.split(gpt.GPT(rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = gpt.default_optimizer()
    opt_state = optimizer.init(params)
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, 64)
    step = mpmdc.compile(gpt.make_step(graphdef, optimizer), meshes)
    shardings = step.input_shardings(params, opt_state, tokens)[0][:2]
    return jax.device_put((params, opt_state), shardings)


def gigabyte_state(meshes):
    """1 GiB of stacked layers, each mesh holding its stage's rows."""
    devices = np.array([m.devices.flat[0] for m in meshes])
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(devices, ("stages",)), jax.sharding.PartitionSpec("stages")
    )
    shape = (LAYERS, WIDTH, WIDTH)

    def rows(index):
        lo = index[0].start or 0
        hi = LAYERS if index[0].stop is None else index[0].stop
        return np.random.default_rng(lo).standard_normal((hi - lo, WIDTH, WIDTH), np.float32)

    return {name: jax.make_array_from_callback(shape, sharding, rows) for name in ("w_in", "w_out")}


def shardings_of(state):
    return jax.tree.map(lambda a: a.sharding, state)


def measure(state, root: str, repeat: int, one_device: bool) -> dict:
    """Median save and restore seconds and this process's bytes written."""
    saves, callers, restores, to_one = [], [], [], []
    written = 0
    shardings = shardings_of(state)
    one = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), state)
    for k in range(repeat):
        directory = os.path.join(root, f"mpmdc-{k}")
        start = time.perf_counter()
        save = Save(directory, state)
        save.finish()
        saves.append(time.perf_counter() - start)
        # What an asynchronous save does before it returns (no file is touched yet).
        start = time.perf_counter()
        Save(directory + "-unwritten", state, copy=True)
        callers.append(time.perf_counter() - start)
        written = save.bytes_written
        start = time.perf_counter()
        restored = restore(directory, shardings)
        jax.block_until_ready([x for x in jax.tree.leaves(restored) if x.addressable_shards])
        restores.append(time.perf_counter() - start)
        del restored
        if one_device:
            start = time.perf_counter()
            jax.block_until_ready(restore(directory, one))
            to_one.append(time.perf_counter() - start)
        if WORKER:  # every process done reading before the directory goes
            mpmdc.distributed.barrier(f"bench/checkpoint/{directory}")
        if jax.process_index() == 0:
            shutil.rmtree(directory)
    return {
        "save_s": statistics.median(saves),
        "caller_s": statistics.median(callers),
        "restore_s": statistics.median(restores),
        "restore_one_device_s": statistics.median(to_one) if to_one else None,
        "written": written,
    }


def orbax(state, root: str, repeat: int) -> dict:
    import orbax.checkpoint as ocp

    saves, restores = [], []
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    for k in range(repeat):
        directory = os.path.join(root, f"orbax-{k}")
        with ocp.StandardCheckpointer() as checkpointer:
            start = time.perf_counter()
            checkpointer.save(directory, state)
            checkpointer.wait_until_finished()
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.block_until_ready(checkpointer.restore(directory, target))
            restores.append(time.perf_counter() - start)
        shutil.rmtree(directory)
    return {"save_s": statistics.median(saves), "restore_s": statistics.median(restores)}


def total_bytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


def run_states(meshes, root: str, repeat: int, in_one_process: bool) -> dict:
    out = {}
    for name, make in (("gpt", gpt_state), ("1 GB", gigabyte_state)):
        state = make(meshes)
        result = measure(state, root, repeat, one_device=in_one_process)
        result["total"] = total_bytes(state)
        if in_one_process:
            result["orbax"] = orbax(state, root, repeat)
        out[name] = result
        del state
    return out


def worker(root: str, repeat: int) -> None:
    meshes = mpmdc.make_meshes(4, {"data": 1})
    results = run_states(meshes, root, repeat, in_one_process=False)
    client = mpmdc._jax_compat.distributed_client()
    here = jax.process_index()
    client.key_value_set(f"mpmdc/bench/checkpoint/{here}", json.dumps(results))
    if here == 0:
        every = [
            json.loads(client.blocking_key_value_get(f"mpmdc/bench/checkpoint/{i}", 600_000))
            for i in range(jax.process_count())
        ]
        print("RESULT " + json.dumps(every), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="mpmdc-bench-", dir=args.dir) if not WORKER else args.dir
    if WORKER:
        worker(root, args.repeat)
        return
    try:
        many = _common.launched(__file__, "--dir", root, "--repeat", str(args.repeat), timeout=900)
        one = run_states(_common.four_meshes(), root, args.repeat, in_one_process=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for name, result in one.items():
        size = result["total"] / 1e6
        rows.append(_row(name, "mpmdc", "1", size, result["written"] / 1e6, result))
        rows.append(_row(name, "Orbax", "1", size, None, result["orbax"]))
        rows.append(
            {
                **_row(name, "mpmdc, onto 1 device", "1", size, None, result),
                "restore s": result["restore_one_device_s"],
                "restore MB/s": size / result["restore_one_device_s"],
                "save s": "",
                "save MB/s": "",
                "async save blocks s": "",
            }
        )
        slowest = {
            key: max(process[name][key] for process in many)
            for key in ("save_s", "caller_s", "restore_s")
        }
        per_process = "/".join(f"{p[name]['written'] / 1e6:.3g}" for p in many)
        rows.append(_row(name, "mpmdc", "4", size, per_process, slowest))
    _common.report(
        "checkpoint",
        rows,
        [
            "state",
            "writer",
            "processes",
            "MB",
            "MB written per process",
            "save s",
            "save MB/s",
            "async save blocks s",
            "restore s",
            "restore MB/s",
        ],
        f"median of {args.repeat}; with 4 processes the slowest process's time; local disk",
    )


def _row(name, writer, processes, size, written, result) -> dict:
    return {
        "state": name,
        "writer": writer,
        "processes": processes,
        "MB": size,
        "MB written per process": "" if written is None else written,
        "save s": result["save_s"],
        "save MB/s": size / result["save_s"],
        "async save blocks s": result.get("caller_s", ""),
        "restore s": result["restore_s"],
        "restore MB/s": size / result["restore_s"],
    }


if __name__ == "__main__":
    main()
