"""A process that stops making progress while alive, in a run of N processes of one
device each; run it under ``mpmdc launch`` (``test_hangs.py`` does).

``python hangs.py MODE SLEEPER DIRECTORY``: an N-stage pipelined MLP (one mesh per
process) trains three steps, fetching each loss, then saves its parameters to
``DIRECTORY/saved``. MODE says what process SLEEPER does:

- ``step``: it sleeps in its own code before step 2, so the others wait for its
  transfers (each for its neighbour's, a chain ending at the sleeper);
- ``save``: it agrees on the save, then sleeps before its part of it, so the others
  wait for it at the save's first meeting;
- ``slow-save``: its writes take 1.5 fault timeouts: it is working, not stuck, and the
  save completes;
- ``stop``: it stops itself (SIGSTOP) before step 2, as ``step`` but with no thread of
  it left running;
- ``stop-at-end``: it stops itself after the save, while the others' scripts return
  and wait for it at the exit.

A process that gets an ``mpmdc.MpmdcError`` prints ``caught <type> after <seconds> s:
<message>`` (seconds since the step or save began), then ``exiting at <time.time()>``,
and exits with status 3.
"""

import os
import signal
import sys
import time

import mpmdc

mpmdc.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mpmdc.checkpoint import saving, storage  # noqa: E402

MODE, DIRECTORY = sys.argv[1], sys.argv[3]
SLEEPER = jax.process_index() == int(sys.argv[2])
FAULT_TIMEOUT = mpmdc.distributed.fault_timeout_seconds()


def loss(params, x):
    for i, w in enumerate(params):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


def step(params, x):
    value, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(loss)(params, mb), x, microbatches=2, reduce="mean"
    )
    return value, [p - 0.1 * g for p, g in zip(params, grads)]


def sleeping_before(finish):
    """``Save.finish`` that sleeps first: the save agreed on, its work never begun."""

    def sleepy(self):
        time.sleep(600)
        finish(self)

    return sleepy


def slow(opened):
    """``storage.opened`` whose first array opened for writing takes 1.5 fault timeouts."""
    writes = []

    def slow_opened(spec, context, **mode):
        if mode.get("write"):
            writes.append(spec)
            if len(writes) == 1:
                time.sleep(1.5 * FAULT_TIMEOUT)
        return opened(spec, context, **mode)

    return slow_opened


def caught(err, start) -> None:
    print(f"caught {type(err).__name__} after {time.monotonic() - start:.1f} s: {err}", flush=True)
    print(f"exiting at {time.time():.3f}", flush=True)
    sys.exit(3)


def main():
    meshes = mpmdc.make_meshes(jax.process_count(), {"data": 1})
    params = [jnp.full((8, 8), 0.1 * (i + 1)) for i in range(len(meshes))]
    x = jnp.ones((4, 8))
    compiled = mpmdc.compile(step, meshes)
    for k in range(3):
        if MODE == "step" and SLEEPER and k == 2:
            time.sleep(600)
        if MODE == "stop" and SLEEPER and k == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        start = time.monotonic()
        try:
            value, params = compiled(params, x)
            print(f"step {k}: loss {float(mpmdc.fetch(value)):.6f}", flush=True)
        except mpmdc.MpmdcError as err:
            caught(err, start)
    if SLEEPER and MODE == "save":
        saving.Save.finish = sleeping_before(saving.Save.finish)
    if SLEEPER and MODE == "slow-save":
        storage.opened = slow(storage.opened)
    start = time.monotonic()
    try:
        mpmdc.checkpoint.save(os.path.join(DIRECTORY, "saved"), params)
    except mpmdc.MpmdcError as err:
        caught(err, start)
    print(f"saved after {time.monotonic() - start:.1f} s", flush=True)
    if MODE == "stop-at-end" and SLEEPER:
        os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    main()
