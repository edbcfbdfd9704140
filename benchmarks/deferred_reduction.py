"""What deferring the data-parallel gradient reduction out of the layer loop would save.

One stage's backward of the residual stack of ``benchmarks/spmd_pipeline.py`` (width
256, a microbatch of 16 rows split over a mesh of 2 devices), as mpmdc's backward
fragment and the SPMD pipeline's backward scan both compute it: the weight gradient of
every layer all-reduced over ``data`` inside the layer loop (XLA puts the all-reduce in
the loop's body). Against it, the same backward with each device's rows a group of
their own (``jax.vmap`` over the groups with ``spmd_axis_name``): per-device partial
gradients and no collective, their sum over devices left for later, once per step.
Per stage size: the all-reduces in each module and the call time (median of
``--repeat``, the two taking turns).

    python benchmarks/deferred_reduction.py
"""

import argparse

import _common
import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

WIDTH, ROWS, DATA = 256, 16, 2  # the benchmark's microbatch, over a mesh of 2 devices


def stage_backward(params, h, dh):
    """The backward of one stage's layer scan: gradients of the weights and the input."""

    def forward(params, h):
        return jax.lax.scan(_common.residual_layer, h, (params["w"], params["b"]))[0]

    _, pullback = jax.vjp(forward, params, h)
    return pullback(dh)


def grouped_backward(params, h, dh):
    """``stage_backward`` on each device's rows apart: per-device partial gradients."""
    hg = h.reshape(DATA, -1, h.shape[-1])
    dg = dh.reshape(DATA, -1, h.shape[-1])
    partial, dhg = jax.vmap(lambda a, d: stage_backward(params, a, d), spmd_axis_name="data")(
        hg, dg
    )
    return partial, dhg.reshape(h.shape)


def reduction_rows(repeat: int, calls: int = 20) -> list[dict]:
    mesh = jax.make_mesh(
        (DATA,), ("data",), devices=jax.devices()[:DATA], axis_types=(AxisType.Auto,)
    )
    rows = []
    for layers in (2, 8):
        params = jax.device_put(_common.residual_stack(layers, WIDTH), NamedSharding(mesh, P()))
        h = jax.device_put(
            jax.random.normal(jax.random.key(1), (ROWS, WIDTH)), NamedSharding(mesh, P("data"))
        )
        row = {"layers in the stage": layers}
        runs = []
        for name, fn in (("per layer", stage_backward), ("deferred", grouped_backward)):
            compiled = jax.jit(fn).lower(params, h, h).compile()
            row[f"all-reduce ops, {name}"] = compiled.as_text().count(" all-reduce(")

            def many(compiled=compiled, args=(params, h, h)):
                jax.block_until_ready([compiled(*args) for _ in range(calls)])

            many()
            runs.append(many)
        per_layer, deferred = _common.interleaved(runs, repeat=repeat)
        row["call ms, per layer"] = per_layer / calls * 1e3
        row["call ms, deferred"] = deferred / calls * 1e3
        row["deferred / per layer"] = row["call ms, deferred"] / row["call ms, per layer"]
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="timings per variant (median)")
    rows = reduction_rows(parser.parse_args().repeat)
    _common.report("deferred_reduction", rows, list(rows[0]))


if __name__ == "__main__":
    main()
