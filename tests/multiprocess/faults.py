"""Failures in a run of two processes; run it under ``mpmdc launch -n 2``
(``test_multiprocess.py`` does).

``python faults.py MODE``, MODE one of

- ``kill``: the last process kills itself (SIGKILL) inside its stage's fragment, in
  step 2 (under ``-n 3``, process 0 loses its connection from process 1, which lost
  its own from process 2);
- ``raise``: a callback in the last process's fragment raises, in step 2;
- ``uncaught``: process 1's script raises an exception of its own before step 2;
- ``exit``: process 1 ends at once (``os._exit(4)``), saying nothing, before step 2;
- ``leave``: process 1 leaves its training loop after step 1, ending well (status 0);
- ``code``: process 1 traces a different function (``code-timed``: and the first call is
  ``run_timed``);
- ``arguments``: process 1 passes an argument of another shape;
- ``order``: no failure: the processes compile two functions ahead of the first call in
  opposite orders (their agreement checks meet by function, not by count).

A process that gets an ``mpmdc.MpmdcError`` prints ``caught <type>: <message>`` with
the seconds since the step began and exits with status 3.
"""

import os
import signal
import sys
import time

import mpmdc

mpmdc.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

MODE = sys.argv[1]
HERE = jax.process_index()
LAST = jax.process_count() - 1  # (one stage, and mesh, per process)
calls = {"n": 0}


def misbehave(x):
    calls["n"] += 1
    if calls["n"] > 2:  # two microbatches per step: the third call is in step 2
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if MODE == "raise":
            raise ValueError("the callback of stage 1 failed on purpose")


def loss(params, x):
    for i, w in enumerate(params):
        x = mpmdc.stage(x, i)
        if i == LAST and MODE in ("kill", "raise"):
            jax.debug.callback(misbehave, x)
        scale = 2.0 if (MODE.startswith("code") and HERE == 1 and i == 1) else 1.0
        x = jnp.tanh(x @ w) * scale
    return jnp.mean(x**2)


def step(params, x):
    value, grads = mpmdc.accumulate(
        lambda mb: jax.value_and_grad(loss)(params, mb), x, microbatches=2, reduce="mean"
    )
    return value, [p - 0.1 * g for p, g in zip(params, grads)]


def main():
    meshes = mpmdc.make_meshes(LAST + 1, {"data": 1})
    params = [jnp.full((8, 8), 0.1 * (i + 1)) for i in range(LAST + 1)]
    rows = 6 if (MODE == "arguments" and HERE == 1) else 4
    x = jnp.ones((rows, 8))
    compiled = mpmdc.compile(step, meshes)
    evaluate = mpmdc.compile(loss, meshes)
    if MODE == "order":
        ahead = [compiled, evaluate] if HERE == 0 else [evaluate, compiled]
        for fn in ahead:
            fn.lower(params, x).compile()
    for k in range(3):
        if MODE == "uncaught" and HERE == 1 and k == 1:
            raise ValueError("a mistake in the training loop")
        if MODE == "exit" and HERE == 1 and k == 1:
            os._exit(4)
        if MODE == "leave" and HERE == 1 and k == 1:
            return
        start = time.monotonic()
        try:
            if MODE == "code-timed":
                (value, params), _ = compiled.lower(params, x).compile().run_timed(params, x)
            else:
                value, params = compiled(params, x)
            print(f"step {k}: loss {float(mpmdc.fetch(value)):.6f}", flush=True)
        except mpmdc.MpmdcError as err:
            print(
                f"caught {type(err).__name__} after {time.monotonic() - start:.1f} s: {err}",
                flush=True,
            )
            sys.exit(3)
    # A tree whose structure prints differently in every process (a function's address).
    fetched = mpmdc.fetch(jax.tree_util.Partial(loss, evaluate(params, x)))
    print(f"evaluated: loss {float(fetched.args[0]):.6f}", flush=True)


if __name__ == "__main__":
    main()
