"""A fragment that fails while running: a named error, no leaked buffers, a working next call.

Two ways to fail: a ``jax.debug.callback`` that raises, and a ``checkify.check`` (which
``jax.jit`` accepts only under ``checkify.checkify``; mpmdc runs it inside the fragment).
"""

import gc
import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import mpmdc
from mpmdc.errors import MpmdRuntimeError


def refuse_large(h):
    if np.any(np.asarray(h) > 100):
        raise ValueError("activation above 100")


def step_with_callback(w, x):
    def per_microbatch(mb):
        h = mpmdc.stage(jnp.tanh(mb @ w), 1) * 1000.0
        jax.debug.callback(refuse_large, h)
        return jnp.sum(h)

    return mpmdc.accumulate(per_microbatch, x, microbatches=4, schedule="gpipe")


def step_with_check(w, x):
    def per_microbatch(mb):
        h = mpmdc.stage(jnp.tanh(mb @ w), 1) * 1000.0
        checkify.check(jnp.all(h <= 100), "activation above 100: {}", jnp.max(h))
        return jnp.sum(h)

    return mpmdc.accumulate(per_microbatch, x, microbatches=4, schedule="gpipe")


FAILURES = {
    "callback": (step_with_callback, "ValueError: activation above 100"),
    "check": (step_with_check, "JaxRuntimeError: activation above 100: 905.14"),
}


def args(bad_microbatch=None):
    x = jnp.full((8, 3), -1.0)
    if bad_microbatch is not None:
        x = x.at[2 * bad_microbatch : 2 * bad_microbatch + 2].set(1.0)
    return jnp.full((3, 3), 0.5), x


def live_buffers() -> int:
    gc.collect()
    return len(jax.live_arrays())


def reference(step):
    """``jax.jit`` needs ``checkify.checkify`` around a function with checks."""
    if step is step_with_check:
        return lambda *a: jax.jit(checkify.checkify(step))(*a)[1]
    return jax.jit(step)


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.slow
def test_a_failing_fragment_is_named_and_the_next_call_works(meshes2, timed, failure, monkeypatch):
    # JAX logs the callback's exception; pytest keeps log records, and a record's
    # traceback keeps the failed call's arguments alive, which would count as a leak.
    monkeypatch.setattr(logging.getLogger("jax._src.debugging"), "disabled", True)
    step, cause = FAILURES[failure]
    executable = mpmdc.compile(step, meshes2).lower(*args()).compile()
    good, bad = args(), args(bad_microbatch=2)
    want = reference(step)(*good)
    run = executable.run_timed if timed else executable
    run(*good)
    before = live_buffers()
    with pytest.raises(MpmdRuntimeError) as caught:
        run(*bad)
    message = str(caught.value)
    assert re.search(r"s1_fwd_mb2 on mesh1 \(stage 1, microbatch 2\) failed while running", message)
    assert cause in message
    del caught
    assert live_buffers() == before
    got = run(*good)
    # Noise floor 9.0e-08 relative (jax.jit against eager), margin 10x.
    np.testing.assert_allclose(np.asarray(got[0] if timed else got), np.asarray(want), rtol=1e-6)


def test_a_checkified_function_returns_its_error_as_jax_jit_does(meshes2):
    checked = checkify.checkify(step_with_check)
    bad = args(bad_microbatch=2)
    error, total = mpmdc.compile(checked, meshes2)(*bad)
    want_error, want_total = jax.jit(checked)(*bad)
    assert error.get() == want_error.get()
    assert "activation above 100" in error.get()
    # Noise floor 9.0e-08 relative (jax.jit against eager), margin 10x.
    np.testing.assert_allclose(np.asarray(total), np.asarray(want_total), rtol=1e-6)
    assert mpmdc.compile(checked, meshes2)(*args())[0].get() is None


FAILS_THEN_EXITS = """
import jax, jax.numpy as jnp, logging, mpmdc
logging.getLogger("jax._src.debugging").disabled = True
def reject(v):
    if (v < 0).any():
        raise ValueError("negative")
def step(x):
    h = mpmdc.stage(jnp.tanh(x), 1)
    jax.debug.callback(reject, h)
    return h.sum()
compiled = mpmdc.compile(step, mpmdc.make_meshes(2, {"data": 2}))
try:
    compiled(-jnp.ones(4))
except mpmdc.errors.MpmdRuntimeError:
    print("caught")
"""


@pytest.mark.slow
def test_a_caught_fragment_failure_is_not_raised_again_at_exit():
    # JAX keeps the failed fragment's effect token (on meshes of 2 devices) and waits on
    # it at exit; the error must not be printed a second time as "Exception ignored in
    # atexit callback".
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")
    done = subprocess.run(
        [sys.executable, "-c", FAILS_THEN_EXITS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "caught", done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
