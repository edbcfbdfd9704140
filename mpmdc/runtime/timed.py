"""A timed run: one thread per mesh, each fragment and transfer timed where it runs
(``Compiled.run_timed``), as a :class:`~mpmdc.schedules.Timeline`."""

from __future__ import annotations

import threading
import time

import jax

from mpmdc.runtime.engine import Step, finished
from mpmdc.runtime.engine import fault as default_fault
from mpmdc.schedules import Slot, Timeline


def run_per_mesh_threads(steps: list[Step], env: list, num_meshes: int, fault=None) -> Timeline:
    """Run ``steps`` with one thread per mesh, each in program order; bind results in ``env``.

    A step waits until its inputs exist. Values are dropped once every reader has
    run, as in a plain call. The first error stops every thread and is raised
    (made by ``fault(step, error)``, default ``fault``).

    Transfers every process issues (between processes) go from one more thread, in
    program order, as JAX pairs them by that order; the mesh that reads a value
    received so then waits for its arrival, and that wait is its transfer's slot.
    """
    fault = fault or default_fault
    ready = {v: threading.Event() for step in steps for v in step.outputs}
    readers: dict = {}
    for step in steps:
        for a in step.inputs:
            if a in ready:
                readers[a] = readers.get(a, 0) + 1
    released = {v for step in steps for v in step.release}
    in_order = [s for s in steps if getattr(s.call, "everyone", False)]
    lane_of = {id(s): None if getattr(s.call, "everyone", False) else s.mesh for s in steps}
    arriving = {v: s for s in in_order if s.call.receives for v in s.outputs}
    lock = threading.Lock()
    failed: list[BaseException] = []  # the first error, as raised to the caller
    slots: list[list[Slot]] = [[] for _ in range(num_meshes)]
    t0 = time.perf_counter()

    def wait(v) -> bool:
        while not ready[v].wait(0.05):
            if failed:
                return False
        return True

    def bind(step, results):
        with lock:
            for i, value in zip(step.outputs, results):
                env[i] = value
            for a in step.inputs:
                if a in readers:
                    readers[a] -= 1
                    if readers[a] == 0 and a in released:
                        env[a] = None
        for v in step.outputs:
            ready[v].set()

    def await_arrivals(step, mesh: int):
        for a in step.inputs:
            transfer = arriving.pop(a, None)
            if transfer is not None:
                start = time.perf_counter()
                try:
                    jax.block_until_ready([env[i] for i in transfer.outputs])
                except Exception as err:
                    raise StepFailed(transfer, err) from None
                slots[mesh].append(
                    Slot(None, (start - t0) * 1e3, (time.perf_counter() - t0) * 1e3, transfer.name)
                )

    def worker(mesh: int | None):
        step = None
        try:
            for step in (s for s in steps if lane_of[id(s)] == mesh):
                if not all(wait(a) for a in step.inputs if a in ready):
                    return
                if mesh is not None:
                    await_arrivals(step, mesh)
                    start = time.perf_counter()
                    results = finished(step.call(*[env[i] for i in step.inputs]), step.effectful)
                    end = time.perf_counter()
                    slots[mesh].append(
                        Slot(step.action, (start - t0) * 1e3, (end - t0) * 1e3, step.name)
                    )
                else:
                    results = step.call(*[env[i] for i in step.inputs])
                bind(step, results)
        except StepFailed as err:
            failed.append(fault(err.step, err.error))
        except Exception as err:  # re-raised by the caller's thread
            results = None
            failed.append(fault(step, err))

    lanes = sorted({m for m in lane_of.values() if m is not None})
    threads = [threading.Thread(target=worker, args=(m,), name=f"mpmdc-mesh{m}") for m in lanes]
    if in_order:
        threads.append(threading.Thread(target=worker, args=(None,), name="mpmdc-transfers"))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        env.clear()
        raise failed[0]
    return Timeline(tuple(tuple(row) for row in slots))


class StepFailed(Exception):
    """A step's results failed where another step waited for them."""

    def __init__(self, step: Step, error: Exception):
        super().__init__(str(error))
        self.step, self.error = step, error
