"""Training steps on meshes of several processes, checked against ``jax.jit``; run it
under ``mpmdc launch`` (``test_multiprocess.py`` does).

``python train.py OUT CASE [CASE ...]`` where a case is ``mlp:<schedule>``,
``transformer:<schedule>``, ``scanned:<schedule>`` (a layer stack run as one scan, 2 layers
per stage; on ``make_meshes(4, {"data": D})``, D from the devices there are),
``dropout:<schedule>`` (an MLP whose every stage draws dropout masks from a typed PRNG key
of its microbatch, the step's key split and the next one returned) or ``mixed:<schedule>`` (a 3-stage MLP on a 2-device mesh of process 0 and two
1-device meshes of process 1). Each case runs two steps fed back (the second donating its
parameters), checks on every process that

- the fetched results equal one-device ``jax.jit`` of the same step (process 0),
- every output lives on exactly one mesh (a stacked one: its rows on their stages'
  meshes) and is addressable only on its processes,
- no transfer between processes carries parameters or optimizer state (MLP, process 0),

prints ``ok <case>`` and, on process 0, saves the results to ``OUT/<case>.npz`` for the
test to compare with single-process mpmdc.
"""

import sys

import mpmdc

mpmdc.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mpmdc.cli.demo import init_params  # noqa: E402
from mpmdc.cli.models import TransformerConfig, adam_init, init_transformer, transformer_step  # noqa: E402
from mpmdc.ir.keys import is_key  # noqa: E402
from mpmdc.ir.traffic import transfer_report  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from training import mlp_data, scanned_loss, scanned_params, sgd_step  # noqa: E402

SCHEDULE_STAGES = {"interleaved-1f1b": 8, "zb-v": 8, "dualpipev": 8}
# The V schedules' warm-up fills the pipeline: 2M microbatches on M meshes (4 otherwise).
SCHEDULE_MICROBATCHES = {"zb-v": 8, "dualpipev": 8}
# Absolute bounds per model (a case's own where given). The MLP's SGD steps equal
# jax.jit's bit for bit. Adam divides by sqrt(v), so a one-ulp difference in a small
# gradient moves its weight far more: noise floors over the two steps (jax.jit of the
# step against eager and against itself with the microbatches reversed, the larger)
# 2.0e-06 with 4 layers and 1.4e-04 with 8 (interleaved); margin 10x.
TOLERANCE = {
    "mlp": 0,
    "dropout": 0,
    "scanned": 0,
    "mixed": 0,
    "transformer": 2e-5,
    "transformer:interleaved-1f1b": 1.4e-3,
    "transformer:zb-v": 1.4e-3,
    "transformer:dualpipev": 1.4e-3,
}


def mixed_meshes():
    """Meshes of different shapes in different processes: process 0's two devices as one
    mesh, then each device of process 1 as a mesh of its own."""
    first, second = ([d for d in jax.devices() if d.process_index == p] for p in (0, 1))
    return (
        jax.sharding.Mesh(np.array(first[:2]), ("data",)),
        jax.sharding.Mesh(np.array(second[:1]), ("data",)),
        jax.sharding.Mesh(np.array(second[1:2]), ("data",)),
    )


def plain(tree) -> list:
    """The leaves of ``tree`` as numpy arrays, typed PRNG keys as their key data."""
    return [
        np.asarray(jax.random.key_data(x) if is_key(x) else x)
        for x in jax.tree_util.tree_leaves(tree)
    ]


def dropout_loss(params, x, y, key):
    """The MLP's loss with a dropout mask in every stage, drawn from the microbatch's key."""
    for i, (w, b) in enumerate(params):
        x = mpmdc.stage(x, i)
        x = jnp.tanh(x @ w + b)
        x = x * jax.random.bernoulli(jax.random.fold_in(key[0], i), 0.9, x.shape) / 0.9
    return jnp.mean((x - y) ** 2)


def case_inputs(model: str, schedule: str):
    stages = 3 if model == "mixed" else SCHEDULE_STAGES.get(schedule, 4)
    microbatches = SCHEDULE_MICROBATCHES.get(schedule, 4)
    if model in ("mlp", "mixed"):
        params = init_params(jax.random.key(0), [16] + [16] * (stages - 1) + [8])
        x, y = mlp_data(32)

        def step(params, x, y):
            return sgd_step(params, x, y, microbatches=microbatches, schedule=schedule)

        return step, (params, x, y), lambda out, args: (out[1], *args[1:])
    if model == "dropout":
        params = init_params(jax.random.key(0), [16] * stages + [8])
        x, y = mlp_data(32)

        def step(params, x, y, key):
            key, *keys = jax.random.split(key, microbatches + 1)
            loss, grads = mpmdc.accumulate(
                lambda mb: jax.value_and_grad(dropout_loss)(params, *mb),
                (x, y, jnp.stack(keys)),
                microbatches=microbatches,
                schedule=schedule,
                reduce="mean",
            )
            return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), key

        args = (params, x, y, jax.random.key(7))
        return step, args, lambda out, args: (out[1], *args[1:3], out[2])
    if model == "scanned":
        x, y = mlp_data(32)

        def step(params, x, y):
            return sgd_step(params, x, y, microbatches, schedule, loss_fn=scanned_loss)

        params = scanned_params(jax.random.key(0), layers=2 * stages)
        return step, (params, x, y), lambda out, args: (out[1], *args[1:])
    config = TransformerConfig(layers=stages)
    params = init_transformer(jax.random.key(0), config)
    tokens = jax.random.randint(jax.random.key(3), (8, 9), 0, config.vocab)

    def step(params, state, tokens):
        return transformer_step(
            params, state, tokens, config, microbatches=microbatches, schedule=schedule
        )

    return step, (params, adam_init(params), tokens), lambda out, args: (out[0], out[1], args[2])


def check_placement(tree, meshes):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        owners = [
            i for i, m in enumerate(meshes) if leaf.sharding.device_set == set(m.devices.flat)
        ]
        if leaf.sharding.mesh.axis_names[0] == "stages":  # a layer stack, a row block per mesh
            for shard in leaf.addressable_shards:
                mesh = next(i for i, m in enumerate(meshes) if shard.device in m.devices.flat)
                rows = shard.index[0]
                assert (rows.start, rows.stop) == (2 * mesh, 2 * mesh + 2), path
            continue
        assert len(owners) == 1, f"{jax.tree_util.keystr(path)} is not on one mesh"
        mine = jax.process_index() in {d.process_index for d in leaf.sharding.device_set}
        assert bool(leaf.addressable_shards) == mine, (
            f"{jax.tree_util.keystr(path)} addressable elsewhere"
        )


def run(out_dir: str, case: str, meshes):
    model, schedule = case.split(":")
    if model == "mixed":
        meshes = mixed_meshes()
    step, args, feed = case_inputs(model, schedule)
    compiled = mpmdc.compile(step, meshes, donate_argnums=(0,))
    checker = jax.process_index() == 0  # one reference is enough: all fetch the same numbers
    reference = jax.jit(step)
    results = []
    ref_args = args
    for _ in range(2):
        ref = reference(*ref_args) if checker else None
        out = compiled(*args)
        check_placement(out, meshes)
        got = mpmdc.fetch(out)
        if checker:
            for a, b in zip(plain(got), plain(ref)):
                bound = TOLERANCE.get(case, TOLERANCE[model])
                np.testing.assert_allclose(a, b, rtol=0, atol=bound)
            ref_args = feed(ref, ref_args)
        results.append(got)
        args = feed(out, args)
    # (What crosses between processes. A layer stack on interleaved or V stages is kept
    # whole on one mesh, and its rows move every step, as documented.)
    whole_stack = model == "scanned" and schedule in SCHEDULE_STAGES
    if model != "transformer" and not whole_stack and checker:
        report = transfer_report(compiled._executable(args, {})[0].program)
        owner = [m.devices.flat[0].process_index for m in meshes]
        for link in report.links:
            if owner[link.src] != owner[link.dst]:
                assert link.bytes[1] == 0, f"parameters or optimizer state cross processes: {link}"
    if jax.process_index() == 0:
        flat = {f"{i}/{k}": v for i, r in enumerate(results) for k, v in enumerate(plain(r))}
        np.savez(f"{out_dir}/{case.replace(':', '-')}.npz", **flat)
    print(f"ok {case}", flush=True)


def main():
    out_dir, cases = sys.argv[1], sys.argv[2:]
    per_mesh = max(1, jax.device_count() // 4)
    meshes = mpmdc.make_meshes(4, {"data": per_mesh})
    print(
        f"meshes on processes {[sorted({d.process_index for d in m.devices.flat}) for m in meshes]}",
        flush=True,
    )
    for case in cases:
        run(out_dir, case, meshes)


if __name__ == "__main__":
    main()
