"""Arguments on another process's mesh than the one that reads them; run it under
``mpmdc launch -n 4`` (``test_arguments.py`` does).

``python arguments.py``: four processes, a mesh of one device each. A step runs with
its parameters as arrays the program places, then with a parameter committed by hand
to another process's mesh, then with its results fed back in another order (each
parameter on the mesh of the stage before or after its own), two calls each; every
call must equal the first. Then a Gemma-shaped step (an embedding scaled by ``sqrt(d)``
before the first marker and tied with the output projection, AdamW) fed back twice:
nothing moves before a call, the embedding and its moments come back on process 0's
mesh, and the results equal ``jax.jit``'s. Last, a parameter on a mesh spanning two
processes, which no route moves to a one-device mesh: every process gets an
``ArgumentError`` at once.
Each process prints ``ok ...`` lines, and ``caught <type> after <s> s: <message>``.
"""

import sys
import time
import warnings

import mpmdc

mpmdc.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mpmdc.errors import PlacementWarning  # noqa: E402


def loss(params, x):
    for i, w in enumerate(params):
        x = jnp.tanh(mpmdc.stage(x, i) @ w)
    return jnp.mean(x**2)


def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, [p - 0.1 * g for p, g in zip(params, grads)]


VOCAB, WIDTH = 16, 8
# Two AdamW steps against jax.jit: the tied embedding's gradient is summed from two
# fragments in another order. Noise floor over the two steps: jax.jit against the same
# step run eagerly, 1.6e-7 (mpmdc in one process against jax.jit: 6e-8); bound 6x it.
TIED_ATOL = 1e-6


def tied_loss(p, tokens):
    x = p["embed"][tokens] * jnp.sqrt(WIDTH).astype(jnp.float32)  # as Gemma scales it
    for i, w in enumerate(p["blocks"]):
        x = mpmdc.stage(x, i)
        x = x + jnp.tanh(x @ w)
    logits = x @ p["embed"].T  # tied output projection
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens))


TIED_OPT = optax.adamw(1e-2)


def tied_step(p, state, tokens):
    value, grads = jax.value_and_grad(tied_loss)(p, tokens)
    updates, state = TIED_OPT.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value


def tied_embedding_fed_back(meshes):
    """Two steps of ``tied_step`` fed back: no argument moves, the embedding and its
    moments stay on mesh 0 (process 0's), the numbers are ``jax.jit``'s."""
    keys = jax.random.split(jax.random.key(0), 5)
    params = {
        "embed": np.asarray(jax.random.normal(keys[0], (VOCAB, WIDTH))),
        "blocks": [np.asarray(jax.random.normal(k, (WIDTH, WIDTH))) / 4 for k in keys[1:]],
    }
    tokens = np.arange(24).reshape(4, 6) % VOCAB
    compiled = mpmdc.compile(tied_step, meshes, donate_argnums=(0, 1))
    got = (params, TIED_OPT.init(params))  # donated
    want = (params, TIED_OPT.init(params))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)  # nothing moved before a call
        for _ in range(2):
            got = compiled(*got[:2], tokens)
            if jax.process_index() == 0:  # one reference: all fetch the same numbers
                want = jax.jit(tied_step)(*want[:2], tokens)
    adam = got[1][0]
    for leaf in (got[0]["embed"], adam.mu["embed"], adam.nu["embed"]):
        assert leaf.sharding.device_set == set(meshes[0].devices.flat), leaf.sharding
    results = fetched(got)
    if jax.process_index() == 0:
        for g, w in zip(jax.tree.leaves(results), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, np.asarray(w), rtol=0, atol=TIED_ATOL)
    print("ok: a scaled tied embedding fed back stays on mesh 0", flush=True)


def fetched(out):
    return jax.tree.map(np.asarray, mpmdc.fetch(out))


def same(got, want) -> bool:
    return all(np.array_equal(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def main():
    meshes = mpmdc.make_meshes(4, {"data": 1})
    compiled = mpmdc.compile(step, meshes)
    host = [np.full((8, 8), 0.1 * (i + 1), np.float32) for i in range(4)]
    x = np.ones((4, 8), np.float32)
    want = fetched(compiled(host, x))

    by_hand = list(host)
    by_hand[2] = jax.device_put(host[2], NamedSharding(meshes[1], P()))  # process 1's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [fetched(compiled(by_hand, x)) for _ in range(2)]
    named = [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]
    assert all(same(r, want) for r in results), "a moved argument changed the results"
    assert len(named) == 1 and "args[0][2] is on mesh1" in named[0], named
    print("ok: committed by hand to another process's mesh", flush=True)

    _, placed = compiled(host, x)  # each parameter on its stage's mesh
    order = [1, 0, 3, 2]  # parameter i now read by stage order[i]
    swapped_want = fetched(compiled([fetched(placed)[k] for k in order], x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlacementWarning)
        swapped = [placed[k] for k in order]
        results = [fetched(compiled(swapped, x)) for _ in range(2)]
    assert all(same(r, swapped_want) for r in results), "a fed back argument changed the results"
    print("ok: results fed back in another order", flush=True)

    tied_embedding_fed_back(meshes)

    devices = jax.devices()
    spanning = Mesh(np.array(devices[:2]), ("data",))  # processes 0 and 1
    unmovable = list(host)
    unmovable[2] = jax.device_put(host[2], NamedSharding(spanning, P()))
    start = time.monotonic()
    try:
        compiled(unmovable, x)
    except mpmdc.MpmdcError as err:
        print(f"caught {type(err).__name__} after {time.monotonic() - start:.1f} s: {err}")
        sys.exit(3)


if __name__ == "__main__":
    main()
