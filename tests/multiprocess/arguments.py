"""Arguments on another process's mesh than the one that reads them; run it under
``mpmdc launch -n 4`` (``test_arguments.py`` does).

``python arguments.py``: four processes, a mesh of one device each. A step runs with
its parameters as arrays the program places, then with a parameter committed by hand
to another process's mesh, then with its results fed back in another order (each
parameter on the mesh of the stage before or after its own), two calls each; every
call must equal the first. Last, a parameter on a mesh spanning two processes, which
no route moves to a one-device mesh: every process gets an ``ArgumentError`` at once.
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
