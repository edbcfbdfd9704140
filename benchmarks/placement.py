"""Where a real training step keeps its state, what it moves, and what a step costs.

The Flax NNX GPT of ``examples/nnx_gpt.py`` (8 blocks, 4 stages, tied embedding) with
``clip_by_global_norm`` + AdamW under 1F1B, 4 microbatches, on 4 meshes of 2 CPU
devices. Per mesh: bytes of parameters and optimizer state held, against the
parameters of the stages on that mesh times three (parameter, Adam's two moments);
per step: bytes moved against the activation + cotangent floor; step time against
``jax.jit`` of the same step on one device (median of interleaved runs).

    python benchmarks/placement.py
"""

import importlib.util
import math

import _common
import jax
from flax import nnx

import mpmdc

_spec = importlib.util.spec_from_file_location(
    "nnx_gpt", _common.Path(__file__).parents[1] / "examples" / "nnx_gpt.py"
)
nnx_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nnx_gpt)

BATCH, LENGTH, MICROBATCHES, STAGES, LAYERS, WIDTH = 16, 32, 4, 4, 8, 32


def stage_of_path(path: str):
    if "['blocks']" in path:
        return int(path.split("['blocks'][")[1].split("]")[0]) * STAGES // LAYERS
    if "['embed']" in path:
        return 0
    if "['norm']" in path:
        return STAGES - 1
    return None


def main():
    meshes = _common.four_meshes()
    graphdef, params = nnx.split(
        nnx_gpt.GPT(layers=LAYERS, stages=STAGES, rngs=nnx.Rngs(0)), nnx.Param
    )
    optimizer = nnx_gpt.default_optimizer()
    opt_state = optimizer.init(params)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH + 1), 0, 64)
    step = nnx_gpt.make_step(graphdef, optimizer, microbatches=MICROBATCHES)
    lowered = mpmdc.compile(step, meshes).lower(params, opt_state, tokens)
    program = lowered.program("after-split")

    own = [0] * STAGES  # parameter bytes of each stage's own parameters
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        own[stage_of_path(jax.tree_util.keystr(path))] += leaf.nbytes
    state_leaves = len(jax.tree_util.tree_leaves((params, opt_state)))
    held_in, held_out = [0] * len(meshes), [0] * len(meshes)
    for v, m_in, m_out in zip(
        program.jaxpr.jaxpr.invars[:state_leaves], program.in_meshes, program.out_meshes
    ):
        held_in[m_in] += math.prod(v.aval.shape) * v.aval.dtype.itemsize
        held_out[m_out] += math.prod(v.aval.shape) * v.aval.dtype.itemsize

    moved = lowered.transfer_report().total()
    floor = (
        2 * (STAGES - 1) * BATCH * LENGTH * WIDTH * 4
    )  # one activation and cotangent per boundary

    exe = lowered.compile()
    reference = jax.jit(step)
    args = (params, opt_state, tokens)
    exe_s, jit_s = _common.interleaved(
        [
            lambda: jax.block_until_ready(exe(*args)),
            lambda: jax.block_until_ready(reference(*args)),
        ],
        repeat=15,
    )
    rows = [
        {
            "mesh": m,
            "held in B": held_in[m],
            "held out B": held_out[m],
            "own params x3 B": 3 * own[m],
            "ratio": held_in[m] / (3 * own[m]),
        }
        for m in range(len(meshes))
    ]
    _common.report(
        "placement",
        rows,
        ["mesh", "held in B", "held out B", "own params x3 B", "ratio"],
        notes=(
            f"moved per step: {moved} B against a floor of {floor} B ({moved / floor:.3f}x); "
            f"step: mpmdc {exe_s * 1e3:.1f} ms, jax.jit on one device {jit_s * 1e3:.1f} ms "
            f"({exe_s / jit_s:.2f}x)"
        ),
    )


if __name__ == "__main__":
    main()
