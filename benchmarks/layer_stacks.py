"""A scanned layer stack pipelined by ``stage(h, every=k)``: compile time, state per mesh, traffic.

The model is ``examples/llama_nnx.py``'s Llama (width 64, 4 query and 2 key/value heads,
SwiGLU of 128, vocabulary 256), its blocks one ``nnx.scan``, trained by the example's
step (next-token loss over 4 microbatches under 1F1B, global-norm clipping and AdamW) on
4 meshes of 2 CPU devices, 16 sequences of 32 tokens. For 8, 32 and 64 layers it times,
for the scanned model and for the same blocks unrolled (a Python loop over ``nnx.List``
blocks with ``mpmdc.stage(h, i)`` where each stage begins), against ``jax.jit`` of the
same step:

- ``lower()``: tracing and every pass (median of 3, taken in turns with ``jax.jit``'s
  ``lower``);
- function to runnable: the first call of a new compiled function, to its result
  (tracing, passes, XLA, one step), one of each;
- bytes of parameters and optimizer state held per mesh, against the ideal (a quarter of
  the total each; the embedding sits on the first stage and the output layer on the
  last, so those two meshes hold a little more);
- bytes moved per step, against the floor: each microbatch's activation forward and its
  cotangent backward across the three stage boundaries.

    python benchmarks/layer_stacks.py [--layers 8 32 64]

With ``--kept-whole``, the scanned model in 8 stages on the 4 meshes (interleaved 1F1B and
DualPipeV: two stages to a mesh, so the stack is kept whole on one mesh) instead: per
step, the bytes of parameters and optimizer state sent between meshes and of the other
values (the gradients' rows) against the stacked parameters' rows of the stages off the
stack's mesh, and ``lower()``'s time (median of 3).
"""

import argparse
import importlib.util
import warnings
from pathlib import Path

import _common
import jax
import jax.numpy as jnp
from flax import nnx

import mpmdc
import mpmdc.pipeline

_spec = importlib.util.spec_from_file_location(
    "llama_nnx", Path(__file__).resolve().parents[1] / "examples" / "llama_nnx.py"
)
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)

CONFIG = dict(vocab=256, width=64, heads=4, kv_heads=2, hidden=128, stages=4)
BATCH, LENGTH, MICROBATCHES, STAGES = 16, 32, 4, 4
REPEAT = 3


class UnrolledLlama(nnx.Module):
    """The example's Llama with its blocks in a Python loop, a marker where each stage begins."""

    def __init__(self, vocab, width, heads, kv_heads, hidden, layers, stages, *, rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List(
            [
                llama.Block(width, heads, kv_heads, hidden, dtype=None, rngs=rngs)
                for _ in range(layers)
            ]
        )
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, use_bias=False, rngs=rngs)
        self.every = layers // stages

    def __call__(self, tokens):
        h = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i % self.every == 0:
                h = mpmdc.stage(h, i // self.every)
            h = block(h)
        return self.head(self.norm(h)).astype(jnp.float32)


def setup(layers: int, scanned: bool):
    model_class = llama.Llama if scanned else UnrolledLlama
    model = model_class(**CONFIG, layers=layers, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = llama.default_optimizer()
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH + 1), 0, CONFIG["vocab"])
    args = (params, optimizer.init(params), tokens)

    def make():  # a new function each time: JAX caches tracing per function
        step = llama.make_step(graphdef, optimizer, microbatches=MICROBATCHES)
        return lambda *a: step(*a)

    return make, args


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def measure(layers: int, scanned: bool, meshes, scans: str = "fused") -> dict:
    make, args = setup(layers, scanned)
    passes = [
        f"split{{scans={scans}}}" if p == "split" else p for p in mpmdc.pipeline.default_pipeline()
    ]
    lowers, jit_lowers = _common.interleaved(
        [
            lambda: mpmdc.compile(make(), meshes, passes=passes).lower(*args),
            lambda: jax.jit(make()).lower(*args),
        ],
        repeat=REPEAT,
    )
    first = _common.first_call(mpmdc.compile(make(), meshes, passes=passes), args)
    jit_first = _common.first_call(jax.jit(make()), args)
    report = mpmdc.compile(make(), meshes).lower(*args).transfer_report()
    state = nbytes(args[:2])
    batch_bytes = nbytes(args[2])
    held = list(report.inputs_held)
    held[0] -= batch_bytes  # (the tokens: on the first stage, and the labels on the last)
    held[-1] -= batch_bytes
    activation = (BATCH // MICROBATCHES) * LENGTH * CONFIG["width"] * 4
    floor = 2 * (STAGES - 1) * MICROBATCHES * activation
    moved = sum(sum(link.bytes) for link in report.links)
    return {
        "model": "scan" if scanned else "unrolled",
        "layers": layers,
        "lower s": lowers,
        "jax.jit lower s": jit_lowers,
        "lower / jit": lowers / jit_lowers,
        "first call s": first,
        "jax.jit first call s": jit_first,
        "first call / jit": first / jit_first,
        "state held per mesh / ideal": " ".join(f"{4 * h / state:.2f}" for h in held),
        "moved / floor": moved / floor,
    }


def kept_whole(layers: int, schedule: str, meshes) -> dict:
    """What a step of the scanned model in 8 stages on 4 meshes moves, the stack kept whole."""
    model = llama.Llama(**{**CONFIG, "stages": 8}, layers=layers, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = llama.default_optimizer()
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH + 1), 0, CONFIG["vocab"])
    args = (params, optimizer.init(params), tokens)
    step = llama.make_step(graphdef, optimizer, microbatches=8, schedule=schedule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mpmdc.errors.PlacementWarning)  # (kept whole: meant)
        lowers = _common.seconds(
            lambda: mpmdc.compile(lambda *a: step(*a), meshes).lower(*args), repeat=REPEAT
        )
        report = mpmdc.compile(step, meshes).lower(*args).transfer_report()
    off_home = nbytes(params["blocks"]) * (len(meshes) - 1) // len(meshes)
    state, other = (report.total(c) for c in ("parameters/optimizer state", "other"))
    return {
        "schedule": schedule,
        "layers": layers,
        "stack rows off its mesh B": off_home,
        "parameters/state sent B": state,
        "other sent B": other,
        "sent / rows": (state + other) / (2 * off_home),
        "lower s": lowers,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument(
        "--scans",
        choices=["fused", "shared"],
        default="fused",
        help="the `split` pass's option: a stage's scan inside its fragment, or a fragment "
        "of its own that equal stages share",
    )
    parser.add_argument(
        "--kept-whole",
        action="store_true",
        help="the scanned model in 8 stages on 4 meshes, its stack kept whole: what it moves",
    )
    options = parser.parse_args()
    meshes = _common.four_meshes()
    _common.warm_up(meshes)
    if options.kept_whole:
        rows = [
            kept_whole(layers, schedule, meshes)
            for layers in options.layers
            for schedule in ("interleaved-1f1b", "dualpipev")
        ]
        _common.report("layer_stacks_kept_whole", rows, list(rows[0]))
        return
    rows = [
        measure(layers, scanned, meshes, options.scans)
        for layers in options.layers
        for scanned in (True, False)
    ]
    scan = {r["layers"]: r["lower s"] for r in rows if r["model"] == "scan"}
    deep, shallow = max(scan), min(scan)
    notes = (
        f"scanned lower() at {deep} layers / at {shallow} layers: {scan[deep] / scan[shallow]:.2f}"
    )
    _common.report(
        "layer_stacks" + ("" if options.scans == "fused" else f"_{options.scans}"),
        rows,
        [
            "model",
            "layers",
            "lower s",
            "jax.jit lower s",
            "lower / jit",
            "first call s",
            "jax.jit first call s",
            "first call / jit",
            "state held per mesh / ideal",
            "moved / floor",
        ],
        notes,
    )


if __name__ == "__main__":
    main()
