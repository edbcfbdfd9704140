"""The catalog of user mistakes: each raises an ``MpmdcError`` subclass whose message names
the culprit and says what to do, and leaves a compiled object that still works.

``golden/error_catalog/catalog.md`` is the documentation: one row per mistake with the
error class and the exact message, rendered from the errors raised here (so it cannot
drift from the code; ``pytest --update-golden`` rewrites it).
"""

import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CRASHING, passes_with
from jax.sharding import PartitionSpec as P

import mpmdc
from golden import check_golden
from mpmdc import backends, errors
from mpmdc.cli.main import main as cli_main
from mpmdc.schedules import ActionLists

REPO = str(Path(__file__).resolve().parents[2]) + "/"


def two_stage(w, x):
    h = jnp.tanh(mpmdc.stage(x, 0) @ w)
    return jnp.sum(mpmdc.stage(h, 1) ** 2)


def accumulating(w, x, **kwargs):
    def per_microbatch(mb):
        return two_stage(w, mb)

    return mpmdc.accumulate(per_microbatch, x, **{"microbatches": 2, **kwargs})


def _no_negatives(v):
    if (v < 0).any():
        raise ValueError("no negative inputs, please")


def rejecting_negatives(w, x):
    h = mpmdc.stage(jnp.tanh(x @ w), 1)
    jax.debug.callback(_no_negatives, h)
    return jnp.sum(h**2)


@dataclass
class World:
    """What the mistakes are made against: meshes, a working compiled step, its arguments."""

    meshes: list
    step: mpmdc.Wrapped
    w: jax.Array
    x: jax.Array
    tmp: Path


@dataclass(frozen=True)
class _TpuDevice:
    """A stand-in device of a platform this machine lacks (a Mesh reads only these fields)."""

    id: int
    platform: str = "tpu"
    process_index: int = 0


@dataclass(frozen=True)
class Mistake:
    what: str  # what the user did, as the catalog's first column
    error: type
    says: str  # a regular expression the message must match
    make: Callable[[World], object]


def lower(fn, world, *args, **compile_kwargs):
    return mpmdc.compile(fn, world.meshes, **compile_kwargs).lower(*(args or (world.w, world.x)))


def two_loops(w, x):
    first = mpmdc.accumulate(lambda mb: two_stage(w, mb), x, microbatches=2)
    return first + mpmdc.accumulate(lambda mb: two_stage(w, mb), x, microbatches=2)


def one_array_twice(world):
    """A step donating its first argument, called with one array for both arguments."""
    step = mpmdc.compile(
        lambda a, b: two_stage(a, world.x) + jnp.sum(b), world.meshes, donate_argnums=0
    )
    shared = world.w + 0
    return step(shared, shared)


def reusing_a_donated_argument(world):
    """A donating step called again with one of the arrays it consumed (the other fed back)."""

    def update(p, x):
        loss, grad = jax.value_and_grad(two_stage)(p[1], x)
        return loss, (p[0] + 1, p[1] - 0.1 * grad)

    step = mpmdc.compile(update, world.meshes, donate_argnums=0)
    state = (jnp.zeros(()), world.w + 0)
    state = jax.device_put(state, step.input_shardings(state, world.x)[0][0])
    _, new = step(state, world.x)
    return step((new[0], state[1]), world.x)


def marker_in_scan(w, x):
    return jax.lax.scan(lambda c, _: (mpmdc.stage(c @ w, 1), None), x, None, length=2)[0].sum()


def traced_stage_in_scan(w, x):
    def layer(c, i):
        return mpmdc.stage(c @ w, i // 2), None

    return jax.lax.scan(layer, x, jnp.arange(4))[0].sum()


def every_not_dividing(w, x):
    return jax.lax.scan(lambda c, _: (mpmdc.stage(c, every=2) @ w, None), x, None, length=3)[
        0
    ].sum()


def every_outside_a_scan(w, x):
    return (mpmdc.stage(x, every=2) @ w).sum()


def cli_fails(world, *argv, status):
    code = cli_main(list(argv))
    assert code == status
    raise errors.UsageError("see stderr") if status == 2 else errors.TargetError("see stderr")


MISTAKES = [
    # meshes and stages
    Mistake(
        "two meshes share a device",
        errors.MeshError,
        r"meshes\[0\] and meshes\[1\] share device",
        lambda w: mpmdc.compile(two_stage, [w.meshes[0], w.meshes[0]]),
    ),
    Mistake(
        "an empty list of meshes",
        errors.MeshError,
        "non-empty sequence of jax.sharding.Mesh",
        lambda w: mpmdc.compile(two_stage, []),
    ),
    Mistake(
        "something that is no Mesh among the meshes",
        errors.MeshError,
        r"meshes\[1\] is an object, not a jax.sharding.Mesh",
        lambda w: mpmdc.compile(two_stage, [w.meshes[0], object()]),
    ),
    Mistake(
        "more meshes than the devices JAX shows",
        errors.MeshError,
        r'need 32 devices but only 8 are available; .*jax.config.update\("jax_num_cpu_devices", 32\)',
        lambda w: mpmdc.make_meshes(16, {"data": 2}),
    ),
    Mistake(
        "axis types for fewer axes than the meshes have",
        errors.MeshError,
        r"axis_types must be one jax.sharding.AxisType for every axis or one per axis of "
        r"\['data', 'model'\] \(2\)",
        lambda w: mpmdc.make_meshes(
            2, {"data": 2, "model": 2}, axis_types=(jax.sharding.AxisType.Explicit,)
        ),
    ),
    Mistake(
        "meshes on two platforms",
        errors.MeshError,
        r"mix platforms: cpu \(meshes\[0\]\), tpu \(meshes\[1\]\)",
        lambda w: mpmdc.compile(
            two_stage,
            [
                w.meshes[0],
                jax.sharding.Mesh(np.array([_TpuDevice(100), _TpuDevice(101)]), ("data",)),
            ],
        ),
    ),
    Mistake(
        "a negative stage index",
        errors.StageError,
        r"mpmdc.stage at .*test_bad_input_catalog.py:\d+:\d+ \(<lambda>\): .*non-negative, got -1",
        lambda w: mpmdc.stage(w.x, -1),
    ),
    Mistake(
        "a stage index and every= both",
        errors.StageError,
        r"it was given both a stage index and every=; give one: a stage index",
        lambda w: mpmdc.stage(w.x, 1, every=2),
    ),
    Mistake(
        "a stage index that is no int",
        errors.StageError,
        "stage index must be a non-negative int, got float 1.5",
        lambda w: mpmdc.stage(w.x, 1.5),
    ),
    Mistake(
        "a marked value that is no array",
        errors.StageError,
        r"x\['label'\] is a str, which is no array type",
        lambda w: mpmdc.stage({"h": w.x, "label": "hidden"}, 0),
    ),
    Mistake(
        "a stage index that is a traced value",
        errors.StageError,
        "depends on a traced value",
        lambda w: jax.jit(lambda x: mpmdc.stage(x, jnp.int32(0) + x.shape[0] * 0))(w.x),
    ),
    Mistake(
        "an empty stage_to_mesh",
        errors.StageError,
        r"stage_to_mesh is empty; give one mesh index per stage, or None",
        lambda w: mpmdc.compile(two_stage, w.meshes, stage_to_mesh=()),
    ),
    Mistake(
        "stage_to_mesh shorter than the stages",
        errors.StageError,
        r"stage 1 .*no entry in stage_to_mesh, which maps stages 0..0",
        lambda w: lower(two_stage, w, stage_to_mesh=(0,)),
    ),
    Mistake(
        "stage_to_mesh naming a mesh that does not exist",
        errors.StageError,
        "which is no index of the 2 meshes",
        lambda w: mpmdc.compile(two_stage, w.meshes, stage_to_mesh=(0, 5)),
    ),
    Mistake(
        "a stage marker inside a scan body",
        errors.PlacementError,
        r"runs inside `(scan|while)` .*\(at .*mpmdc.stage\(h, every=k\)",
        lambda w: lower(marker_in_scan, w),
    ),
    Mistake(
        "a stage index computed from a scan's iteration",
        errors.StageError,
        r"test_bad_input_catalog.py:\d+.*traced value.*every=k",
        lambda w: lower(traced_stage_in_scan, w),
    ),
    Mistake(
        "every= that does not divide the scan's length",
        errors.StageError,
        r"every=2\) at .*the scan at .*\(length 3\) does not split into groups of 2.*"
        r"every=\(2, 1\)",
        lambda w: lower(every_not_dividing, w),
    ),
    Mistake(
        "every= outside a scan",
        errors.StageError,
        r"every=2\) at .*is not inside a scan",
        lambda w: lower(every_outside_a_scan, w),
    ),
    # specs and arguments
    Mistake(
        "in_specs with the wrong pytree structure",
        errors.SpecError,
        r"in_specs\[0\] does not match",
        lambda w: lower(two_stage, w, in_specs=([P(), P()], P())),
    ),
    Mistake(
        "in_specs missing an entry of a dict argument",
        errors.SpecError,
        r"in_specs\[0\] does not match .* \(\['n'\] not in it\)",
        lambda w: lower(
            lambda state, x: two_stage(state["w"], x),
            w,
            {"w": w.w, "n": w.w},
            w.x,
            in_specs=({"w": P()}, P()),
        ),
    ),
    Mistake(
        "in_specs with the wrong number of entries",
        errors.SpecError,
        "one entry per argument",
        lambda w: lower(two_stage, w, in_specs=(P(),)),
    ),
    Mistake(
        "in_specs with an argument passed by keyword",
        errors.SpecError,
        r"called with 1 positional arguments and keyword arguments x: in_specs gives "
        r"positional arguments their specs, so pass those arguments positionally",
        lambda w: mpmdc.compile(two_stage, w.meshes, in_specs=(P(), P())).lower(w.w, x=w.x),
    ),
    Mistake(
        "in_specs naming an axis the mesh lacks",
        errors.SpecError,
        r"args\[1\].*names axis 'model'",
        lambda w: lower(two_stage, w, in_specs=(P(), P("model"))),
    ),
    Mistake(
        "in_specs splitting two dimensions over one axis",
        errors.SpecError,
        r"args\[1\].*splits two dimensions over axis 'data'",
        lambda w: lower(two_stage, w, in_specs=(P(), P("data", "data"))),
    ),
    Mistake(
        "in_specs giving an axis name where a PartitionSpec goes",
        errors.SpecError,
        r"in_specs\[1\] is a str \('data'\), not a PartitionSpec",
        lambda w: lower(two_stage, w, in_specs=(P(), "data")),
    ),
    Mistake(
        "out_shardings given as a PartitionSpec",
        errors.SpecError,
        r"out_shardings for out is P\('data',\), which is not a NamedSharding",
        lambda w: lower(two_stage, w, out_shardings=P("data")),
    ),
    Mistake(
        "in_specs splitting a dimension the axis does not divide",
        errors.SpecError,
        "does not divide",
        lambda w: lower(
            two_stage, w, jnp.ones((3, 3)), jnp.ones((3, 3)), in_specs=(P(), P("data"))
        ),
    ),
    Mistake(
        "out_specs that do not match the outputs",
        errors.SpecError,
        "out_specs does not match",
        lambda w: lower(two_stage, w, out_specs=[P(), P()]),
    ),
    Mistake(
        "donate_argnums out of range",
        errors.ArgumentError,
        r"donate_argnums contains 5",
        lambda w: lower(two_stage, w, donate_argnums=5),
    ),
    Mistake(
        "static_argnames naming no parameter",
        errors.ArgumentError,
        r"static_argnames names \['scale'\], but two_stage takes no keyword argument so named",
        lambda w: mpmdc.compile(two_stage, w.meshes, static_argnames="scale"),
    ),
    Mistake(
        "reusing an argument donated by an earlier call",
        errors.ArgumentError,
        r"argument args\[0\]\[1\] was donated to an earlier call",
        reusing_a_donated_argument,
    ),
    Mistake(
        "one array passed twice, once donated",
        errors.ArgumentError,
        r"arguments args\[0\] and args\[1\] are one array, and args\[0\] is donated",
        one_array_twice,
    ),
    Mistake(
        "calling with a different shape",
        errors.ArgumentError,
        r"args\[1\] is float32\[4, 9\]",
        lambda w: w.step.lower(w.w, w.x).compile()(w.w, jnp.ones((4, 9))),
    ),
    Mistake(
        "calling with a different dtype",
        errors.ArgumentError,
        r"args\[0\] is int32",
        lambda w: w.step.lower(w.w, w.x).compile()(w.w.astype(jnp.int32), w.x),
    ),
    Mistake(
        "calling with a different pytree",
        errors.ArgumentError,
        r"argument args\[0\] is a tuple of 1 entry, but the executable was lowered for an array",
        lambda w: w.step.lower(w.w, w.x).compile()((w.w,), w.x),
    ),
    Mistake(
        "calling with a dict missing a key",
        errors.ArgumentError,
        r"argument args\[0\] is a dict of 1 entry \(missing \['b'\]\), but the .* lowered for a dict of 2 entries",
        lambda w: (
            mpmdc.compile(lambda p, x: two_stage(p["a"] + p["b"], x), w.meshes)
            .lower({"a": w.w, "b": w.w}, w.x)
            .compile()({"a": w.w}, w.x)
        ),
    ),
    Mistake(
        "an argument that is no array",
        errors.ArgumentError,
        r"argument args\[1\]\['name'\] is a str",
        lambda w: mpmdc.compile(lambda w_, x: two_stage(w_, x["x"]), w.meshes)(
            w.w, {"x": w.x, "name": "hi"}
        ),
    ),
    Mistake(
        "a NamedSharding given as a spec",
        errors.SpecError,
        r"out_specs is a NamedSharding \(P\('data',\) on a mesh \{'data': 2\}\), not a "
        r"PartitionSpec: .* Give its spec, P\('data',\); .* out_shardings=",
        lambda w: lower(
            two_stage,
            w,
            out_specs=jax.sharding.NamedSharding(w.meshes[1], P("data")),
        ),
    ),
    Mistake(
        "calling with a ShapeDtypeStruct for an array",
        errors.ArgumentError,
        r"argument args\[1\] is a jax.ShapeDtypeStruct, a type without values",
        lambda w: w.step(w.w, jax.ShapeDtypeStruct(w.x.shape, w.x.dtype)),
    ),
    Mistake(
        "calling the compiled program with a ShapeDtypeStruct",
        errors.ArgumentError,
        r"argument args\[0\] is a jax.ShapeDtypeStruct, a type without values",
        lambda w: w.step.lower(w.w, w.x).compile()(jax.ShapeDtypeStruct(w.w.shape, w.w.dtype), w.x),
    ),
    Mistake(
        "returning something that is no array",
        errors.OutputError,
        r"output out\[1\] is a str \('done'\)",
        lambda w: lower(lambda w_, x: (two_stage(w_, x), "done"), w),
    ),
    Mistake(
        "a shard_map built for devices no mesh has",
        errors.TypeCheckError,
        r"shard_map at .* mesh1 .* built for the mesh \{'data': 2\} on devices \[6, 7\]",
        lambda w: lower(
            lambda a, x: mpmdc.stage(
                jax.shard_map(
                    lambda v: v * 2,
                    mesh=jax.sharding.Mesh(jax.devices()[6:8], ("data",)),
                    in_specs=P("data"),
                    out_specs=P("data"),
                )(mpmdc.stage(x, 1)),
                1,
            ).sum(),
            w,
        ),
    ),
    Mistake(
        "a shard_map built for a mesh no stage of it runs on",
        errors.TypeCheckError,
        r"shard_map at .* is in stage 1, which runs on mesh1 .* build it with that stage's mesh",
        lambda w: lower(
            lambda a, x: jax.shard_map(
                lambda v: v * 2, mesh=w.meshes[0], in_specs=P("data"), out_specs=P("data")
            )(mpmdc.stage(x, 1)).sum(),
            w,
            stage_to_mesh=(1, 1),
        ),
    ),
    # names: passes, stages, backends
    Mistake(
        "an unknown pass",
        errors.PassError,
        "known passes: cond-fission, dce, donate, in-program-transfers, inline",
        lambda w: lower(two_stage, w, passes=["inline", "fuse"]),
    ),
    Mistake(
        "a pass option the pass does not take",
        errors.PassError,
        r"pass `lower` has no option platform; its options: backend",
        lambda w: lower(two_stage, w, passes="inline,partition,dce,split,lower{platform=tpu}"),
    ),
    Mistake(
        "a pass of one's own that raises",
        errors.InternalError,
        r"internal error in pass `crashing`",
        lambda w: lower(two_stage, w, passes=passes_with(CRASHING, after="dce")),
    ),
    Mistake(
        "an unknown dump stage",
        errors.PassError,
        "stages: input, after-plan, after-inline",
        lambda w: w.step.lower(w.w, w.x).as_text("after-fusion"),
    ),
    Mistake(
        "an unknown backend",
        errors.BackendError,
        r"unknown backend 'metal'; available backends: .*cpu",
        lambda w: mpmdc.compile(two_stage, w.meshes, backend="metal"),
    ),
    Mistake(
        "a backend that is no platform given as the platform",
        errors.BackendError,
        "choose it with backend='catalog-p2p'",
        lambda w: w.step.lower(w.w, w.x).stablehlo(platform="catalog-p2p"),
    ),
    Mistake(
        "running a TPU backend on CPU meshes",
        errors.BackendError,
        "compiles for tpu, but mesh 0 has cpu devices",
        lambda w: mpmdc.compile(two_stage, w.meshes, backend="tpu")(w.w, w.x),
    ),
    Mistake(
        "running an in-program-transfer backend",
        errors.BackendError,
        "multi-process runtime",
        lambda w: mpmdc.compile(two_stage, w.meshes, backend="catalog-p2p")(w.w, w.x),
    ),
    Mistake(
        "a host callback that raises at run time",
        errors.MpmdRuntimeError,
        r"s1_fwd on mesh1 failed while running: ValueError: no negative inputs",
        lambda w: mpmdc.compile(rejecting_negatives, w.meshes)(w.w, -w.x),
    ),
    Mistake(
        "a fault timeout that is not positive",
        errors.DistributedError,
        "fault_timeout must be a positive number",
        lambda w: mpmdc.distributed.initialize(fault_timeout=0),
    ),
    # accumulate
    Mistake(
        "microbatches that do not divide the batch",
        errors.AccumulateError,
        r"mpmdc.accumulate at .*test_bad_input_catalog.py:\d+:\d+ \(accumulating\): xs has "
        r"leading size 4, which 5 microbatches do not divide",
        lambda w: lower(lambda a, x: accumulating(a, x, microbatches=5), w),
    ),
    Mistake(
        "zero microbatches",
        errors.AccumulateError,
        "positive int, got 0",
        lambda w: lower(lambda a, x: accumulating(a, x, microbatches=0), w),
    ),
    Mistake(
        "a batch where the function goes",
        errors.AccumulateError,
        r"fn is an array, not a function; pass the function of one microbatch first",
        lambda w: lower(lambda a, x: mpmdc.accumulate(x, x, microbatches=2), w),
    ),
    Mistake(
        "an unknown reduction",
        errors.AccumulateError,
        "unknown reduction 'median'",
        lambda w: lower(lambda a, x: accumulating(a, x, reduce="median"), w),
    ),
    Mistake(
        "a reduction pytree not matching the outputs",
        errors.AccumulateError,
        "does not match the structure",
        lambda w: lower(lambda a, x: accumulating(a, x, reduce=["sum", "sum"]), w),
    ),
    Mistake(
        "concat of scalar outputs",
        errors.AccumulateError,
        "needs outputs with a leading axis; fn's output is a scalar",
        lambda w: lower(lambda a, x: accumulating(a, x, reduce="concat"), w),
    ),
    Mistake(
        "concat of a scalar among other outputs",
        errors.AccumulateError,
        r"fn's output\['loss'\] is a scalar. Return it with one",
        lambda w: lower(
            lambda a, x: mpmdc.accumulate(
                lambda mb: {"loss": two_stage(a, mb), "rows": mb},
                x,
                microbatches=2,
                reduce="concat",
            ),
            w,
        ),
    ),
    Mistake(
        "a scalar leaf in the batch",
        errors.AccumulateError,
        r"xs\[1\] is a scalar",
        lambda w: lower(
            lambda a, x: mpmdc.accumulate(lambda mb: mb[0].sum(), (x, 2.0), microbatches=2), w
        ),
    ),
    Mistake(
        "two accumulate loops in one function",
        errors.AccumulateError,
        r"runs mpmdc.accumulate 2 times \(at .*:\d+:\d+ \(two_loops\) and at .*:\d+:\d+ "
        r"\(two_loops\)\)",
        lambda w: lower(two_loops, w),
    ),
    # schedules
    Mistake(
        "an unknown schedule name",
        errors.ScheduleError,
        "known schedules: gpipe, 1f1b",
        lambda w: lower(lambda a, x: accumulating(a, x, schedule="pipedream"), w),
    ),
    Mistake(
        "a schedule function that raises",
        errors.ScheduleError,
        r"the schedule function <lambda> raised KeyError: 'big'",
        lambda w: lower(lambda a, x: accumulating(a, x, schedule=lambda p: {}["big"]), w),
    ),
    Mistake(
        "an action that is not <stage><F|B|I|W><microbatch>",
        errors.ScheduleError,
        "'0X1' is not an action",
        lambda w: ActionLists(["0F0 0X1"]),
    ),
    Mistake(
        "a schedule given as a list of stage numbers",
        errors.ScheduleError,
        r"schedule=\[0, 1\] is not per-mesh action lists: mesh 0's entry is 0, of type int",
        lambda w: mpmdc.compile(two_stage, w.meshes, schedule=[0, 1]),
    ),
    Mistake(
        "costs for schedule='auto' that are not measured costs",
        errors.ScheduleError,
        "costs='fast' is str, not measured costs",
        lambda w: mpmdc.schedules.Auto(costs="fast"),
    ),
    Mistake(
        "action lists that deadlock",
        errors.ScheduleError,
        "the schedule deadlocks",
        lambda w: lower(
            lambda a, x: accumulating(a, x, schedule=["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]), w
        ),
    ),
    Mistake(
        "action lists that miss an action",
        errors.ScheduleError,
        "never runs 0F1",
        lambda w: lower(lambda a, x: accumulating(a, x, schedule=["0F0 0B0", "1F0 1B0"]), w),
    ),
    Mistake(
        "an unknown schedule name given to compile",
        errors.ScheduleError,
        "known schedules: gpipe, 1f1b",
        lambda w: mpmdc.compile(two_stage, w.meshes, schedule="pipedream"),
    ),
    Mistake(
        "1F1B with two stages on one mesh",
        errors.ScheduleError,
        r"use mpmdc.compile\(\.\.\., schedule='interleaved-1f1b'\).*"
        r"mpmdc.accumulate at \S*test_bad_input_catalog.py:\d+",
        lambda w: lower(lambda a, x: accumulating(a, x), w, stage_to_mesh=(0, 0)),
    ),
    Mistake(
        "a V schedule on one stage per mesh",
        errors.ScheduleError,
        "zb-v runs two stages per mesh in V order",
        lambda w: lower(lambda a, x: accumulating(a, x, schedule="zb-v"), w),
    ),
    Mistake(
        "balanced stages from fewer marked segments than stages",
        errors.StageError,
        "need at least 4 marked segments",
        lambda w: lower(
            lambda a, x: accumulating(a, x, schedule="dualpipev"), w, partition="balanced"
        ),
    ),
    Mistake(
        "schedule='auto' with a memory cap per mesh for too few meshes",
        errors.ScheduleError,
        "memory_cap has 1 entries for 2 meshes",
        lambda w: lower(
            lambda a, x: accumulating(a, x), w, schedule=mpmdc.schedules.Auto(memory_cap=(1e9,))
        ),
    ),
    # the command line (exit status 2: usage; 1: the program failed)
    Mistake(
        "`mpmdc dump` of a file that does not exist",
        errors.UsageError,
        "see stderr",
        lambda w: cli_fails(w, "dump", str(w.tmp / "missing.py") + ":f", status=2),
    ),
    Mistake(
        "`mpmdc dump --args` that is not a type list",
        errors.UsageError,
        "see stderr",
        lambda w: cli_fails(
            w, "dump", str(w.tmp / "model.py") + ":f", "--args", "f32[8,", status=2
        ),
    ),
    Mistake(
        "`mpmdc dump --dump-dir` into a folder with other files",
        errors.UsageError,
        "see stderr",
        lambda w: cli_fails(
            w,
            "dump",
            str(w.tmp / "model.py") + ":f",
            "--args",
            "f32[4,4], f32[4,4]",
            "--meshes",
            "2x(data=2)",
            "--dump-dir",
            str(w.tmp / "occupied"),
            status=2,
        ),
    ),
    Mistake(
        "`mpmdc dump --args` that the function cannot take",
        errors.TargetError,
        "see stderr",
        lambda w: cli_fails(
            w,
            "dump",
            str(w.tmp / "model.py") + ":f",
            "--args",
            "f32[4,4], f32[4,5]",
            "--meshes",
            "2x(data=2)",
            "--dump-dir",
            str(w.tmp / "new"),
            status=1,
        ),
    ),
    # checkpoints
    Mistake(
        "restoring a checkpoint that is not there",
        errors.CheckpointError,
        r"no checkpoint at .*nowhere: the directory does not exist",
        lambda w: mpmdc.checkpoint.restore(w.tmp / "nowhere", {"w": w.w}),
    ),
    Mistake(
        "restoring into a target with other leaves than were saved",
        errors.CheckpointError,
        r"in the target, not in the checkpoint: \['x'\]",
        lambda w: mpmdc.checkpoint.restore(w.tmp / "checkpoint", {"w": w.w, "x": w.x}),
    ),
    Mistake(
        "restoring into a target of another shape",
        errors.CheckpointError,
        r"leaf \['w'\] of the checkpoint at .* is float32\[4, 4\]; the target asks for float32\[2, 8\]",
        lambda w: mpmdc.checkpoint.restore(w.tmp / "checkpoint", {"w": w.w.reshape(2, 8)}),
    ),
    Mistake(
        "saving over a checkpoint",
        errors.CheckpointError,
        r"a checkpoint is already at .*checkpoint; .* overwrite=True",
        lambda w: mpmdc.checkpoint.save(w.tmp / "checkpoint", {"w": w.w}),
    ),
    Mistake(
        "saving a leaf that is no array",
        errors.CheckpointError,
        r"leaf \['note'\] saved to .*new is a str, not an array",
        lambda w: mpmdc.checkpoint.save(w.tmp / "new", {"w": w.w, "note": "step 1"}),
    ),
    # exported programs
    Mistake(
        "loading truncated bytes as an exported program",
        errors.ExportError,
        r"these 4 bytes are no exported mpmdc program, or they are truncated or damaged",
        lambda w: mpmdc.deserialize(b"PK\x03\x04"),
    ),
]


@pytest.fixture(scope="module")
def world(meshes2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("catalog")
    (tmp / "model.py").write_text(
        "import jax.numpy as jnp, mpmdc\ndef f(w, x):\n    return jnp.sum(mpmdc.stage(x @ w, 1))\n"
    )
    (tmp / "occupied").mkdir()
    (tmp / "occupied" / "notes.txt").write_text("mine\n")
    w, x = jnp.full((4, 4), 0.25), jnp.arange(16.0).reshape(4, 4) / 16
    mpmdc.checkpoint.save(tmp / "checkpoint", {"w": w})
    return World(meshes2, mpmdc.compile(two_stage, meshes2), w, x, tmp)


@pytest.fixture(autouse=True)
def in_program_backend(monkeypatch):
    # JAX logs a failing callback's traceback; the mistake's error is what the catalog shows.
    monkeypatch.setattr(logging.getLogger("jax._src.debugging"), "disabled", True)
    # The built-in backends only, whatever other tests registered: the catalog shows the list.
    builtin = ("cpu", "cuda", "rocm", "tpu")
    monkeypatch.setattr(
        backends, "_registry", {k: v for k, v in backends._registry.items() if k in builtin}
    )
    backends.register(backends.Backend("catalog-p2p", "cuda", transfers="in-program"))


def test_every_error_a_user_can_cause_is_in_the_catalog():
    """Each ``MpmdcError`` subclass is shown by at least one mistake, and each mistake once."""
    assert len({m.what for m in MISTAKES}) == len(MISTAKES)
    user_errors = {
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type)
        and issubclass(cls, errors.MpmdcError)
        and cls is not errors.MpmdcError
    }
    # Two processes holding different programs: tests/multiprocess/test_multiprocess.py
    # makes that mistake.
    multiprocess_only = {errors.ProgramMismatchError}
    missing = user_errors - multiprocess_only - {m.error for m in MISTAKES}
    assert not missing, f"no catalog entry shows {sorted(c.__name__ for c in missing)}"


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.what for m in MISTAKES])
def test_each_mistake_is_named_and_leaves_things_working(mistake, world):
    want = jax.jit(two_stage)(world.w, world.x)
    world.step(world.w, world.x)
    with pytest.raises(errors.MpmdcError) as caught:
        mistake.make(world)
    assert type(caught.value) is mistake.error, caught.value
    assert re.search(mistake.says, str(caught.value)), str(caught.value)
    # The compiled step made before the mistake still runs and still agrees with jax.jit.
    np.testing.assert_array_equal(np.asarray(world.step(world.w, world.x)), np.asarray(want))
    # Nothing half-written: the occupied folder is untouched, no dump folder appeared.
    assert sorted(p.name for p in (world.tmp / "occupied").iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in world.tmp.iterdir()) == ["checkpoint", "model.py", "occupied"]


def _message(mistake, world, capsys) -> str:
    capsys.readouterr()
    try:
        # The catalog lists errors; a warning printed on the way (shown or not, depending
        # on which test warned at its line before) is not part of one.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mistake.make(world)
    except errors.MpmdcError as err:
        text = capsys.readouterr().err.strip() if str(err) == "see stderr" else str(err)
    text = text.replace(REPO, "").replace(str(world.tmp) + "/", "<tmp>/")
    return re.sub(r" at 0x[0-9a-f]+", "", text).replace("|", "\\|").replace("\n", " ")


def test_catalog_document(world, capsys, update_golden):
    rows = ["| mistake | error | message |", "|---|---|---|"]
    for mistake in MISTAKES:
        rows.append(
            f"| {mistake.what} | `{mistake.error.__name__}` | {_message(mistake, world, capsys)} |"
        )
    check_golden("error_catalog", {"catalog.md": "\n".join(rows) + "\n"}, update_golden)
