"""mpmdc against the SPMD pipeline users would otherwise write, and against plain jax.jit.

The model: a residual MLP stack (``h + tanh(h @ w + b)``, width ``--width``, ``L``
layers stacked on a leading axis and run by one ``lax.scan``), mean squared error
against a target, one training step = loss and gradient over ``M`` microbatches of
``--microbatch-rows`` rows each, then SGD. Three programs of that step:

- **SPMD pipeline** (the peer): one ``jax.jit`` over a mesh ``{stage: 4, data: 2}``,
  as MaxText's and Praxis's pipeline layers do it. The weights are stacked
  ``(stages, L/4, ...)`` and sharded on ``stage``; one ``lax.scan`` of ``M + 3``
  iterations applies every stage at once (``jax.vmap`` over the stage axis with
  ``spmd_axis_name="stage"``), stage 0 taking the next microbatch, the last stage
  adding its microbatch's loss; the activations move one stage on with
  ``jax.lax.ppermute`` inside ``jax.shard_map``. The gradient is ``jax.grad`` of the
  whole loop: GPipe, every iteration's residuals kept for the backward scan, and each
  device computing its stage in every iteration, bubble iterations included.
- **mpmdc**: the same step written once with ``mpmdc.stage(h, every=L/4)`` in the
  scan's body and ``mpmdc.accumulate``, on 4 meshes ``{data: 2}`` (the SPMD mesh's
  rows) with the batch sharded on ``data``, under 1F1B and GPipe.
- **jax.jit**: that same function (markers are identities, ``accumulate`` a scan) on
  one device: the reference every result is checked against.

Per (L, M) and program: function to first result (trace, lower, XLA, one step), the
``lower()`` time of a fresh function, the XLA compiles that first call made (count,
seconds summed over modules, largest module), the steady step (median of ``--steps``,
the programs taking turns), bytes per device (arguments resident; and the peak
estimate: XLA's ``memory_analysis`` for one module, for mpmdc the mesh's arguments plus
its peak live intermediates plus its largest fragment's temporaries), and the loss and
parameters after one step against ``jax.jit``'s.

    python benchmarks/spmd_pipeline.py [--quick] [--L 8 32] [--M 4 8 16 32 64] [--scans shared]

With ``--profile``, only where the time goes at the first of ``--L`` and ``--M``: each of
mpmdc's distinct modules compiled alone (XLA seconds) and called alone (wall and CPU
milliseconds per call) against the SPMD step's one module, and per step the time until
the call returns (dispatch), the process CPU time and each mesh's busy time
(``run_timed``):

    python benchmarks/spmd_pipeline.py --profile --L 8 --M 32

On a machine with GPUs (``--platform gpu``, or ``auto``, the default, when
``nvidia-smi`` is there) it runs on the GPUs instead of 8 virtual CPU devices, with
``data`` = devices / 4. On fewer than 4 devices (or ``--devices N`` of them) each device
along ``stage`` holds several stages: mpmdc runs ``gcd(4, N)`` meshes under interleaved
1F1B in place of 1F1B, and the SPMD pipeline shifts the activations between the stages
a device holds.
"""

# The platform must be chosen before ``_common`` starts JAX.
# ruff: noqa: E402
import argparse
import os
import shutil
import sys

PARSER = argparse.ArgumentParser(description=__doc__.splitlines()[0])
PARSER.add_argument("--L", type=int, nargs="+", default=[8, 32], help="layer counts")
PARSER.add_argument("--M", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="microbatches")
PARSER.add_argument("--quick", action="store_true", help="L=8 and M in 4, 16, 64 only")
PARSER.add_argument("--width", type=int, default=256)
PARSER.add_argument("--microbatch-rows", type=int, default=16)
PARSER.add_argument("--steps", type=int, default=5, help="steps timed per program (median)")
PARSER.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto")
PARSER.add_argument("--devices", type=int, default=None, help="use only the first N devices")
PARSER.add_argument(
    "--scans",
    choices=["fused", "shared"],
    default="fused",
    help="the `split` pass's option: a stage's scan inside its fragment, or a fragment of "
    "its own that equal stages share",
)
PARSER.add_argument(
    "--profile",
    action="store_true",
    help="only where the time goes, at the first of --L and --M: each mpmdc module's XLA "
    "seconds, and per step the dispatch, CPU and per-mesh busy time of mpmdc (1F1B) and SPMD",
)
OPTIONS = PARSER.parse_args() if __name__ == "__main__" else PARSER.parse_args([])
if OPTIONS.platform == "gpu" or (OPTIONS.platform == "auto" and shutil.which("nvidia-smi")):
    os.environ["MPMDC_BENCHMARK_PLATFORM"] = "gpu"

import statistics
import time

import _common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpmdc
import mpmdc.backends
import mpmdc.pipeline
from mpmdc.ir.program import fragment_key
from mpmdc.runtime.compiling import XlaCompiles

STAGES = 4
LR = 0.1
# Largest differences from jax.jit accepted: of the loss, relative to it, and of the
# parameters, relative to the largest change one SGD step makes. Float32 sums in another
# order differ by a few ulps (measured here: loss below 1e-6, parameters below 1e-5 of
# the update, on CPU); the bounds leave a 100x margin, and TF32 matmuls on a GPU need
# the looser one.
TOLERANCE = {"cpu": (1e-4, 1e-3), "gpu": (1e-2, 5e-2)}


class XlaTimes(XlaCompiles):
    """:class:`XlaCompiles` that also keeps each compile's seconds."""

    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []

    def _listen(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1
            self.seconds.append(duration)


# ----------------------------------------------------------------- the model


def pipelined_step(layers: int, microbatches: int, schedule: str):
    """The training step as one writes it for mpmdc (and runs under jax.jit as is); a new
    function on each call, so that no cache of JAX's or mpmdc's serves it."""
    loss_fn = _common.residual_stack_loss(every=layers // STAGES)

    def step(params, x, y):
        loss, grads = _common.mean_loss_and_grad(loss_fn, params, (x, y), microbatches, schedule)
        return loss, jax.tree.map(lambda p, g: p - LR * g, params, grads)

    return step


def passes(options) -> list[str]:
    """The default pipeline, its ``split`` with ``--scans``."""
    return [
        f"split{{scans={options.scans}}}" if p == "split" else p
        for p in mpmdc.pipeline.default_pipeline()
    ]


def spmd_step(mesh: Mesh, microbatches: int):
    """The SPMD pipeline's training step over ``mesh`` (axes ``stage`` and ``data``);
    parameters stacked ``(stages, layers per stage, ...)``."""
    stages, holders = STAGES, mesh.shape["stage"]  # holders: devices along `stage`
    state_spec = P("stage", "data")

    def constrain(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def run_stage(w, b, h):  # one stage's layers on one microbatch
        return jax.lax.scan(_common.residual_layer, h, (w, b))[0]

    # Each stage hands its output to the next; the last stage's goes nowhere, and
    # stage 0 reads a new microbatch in place of what it receives. A device holding
    # several stages (fewer devices along `stage` than stages) shifts them in place and
    # sends its last one on.
    def shift_block(block):
        sent = jax.lax.ppermute(block[-1:], "stage", [(i, i + 1) for i in range(holders - 1)])
        return jnp.concatenate([sent, block[:-1]])

    shift = jax.shard_map(shift_block, mesh=mesh, in_specs=state_spec, out_specs=state_spec)

    def loss_fn(params, x, y):
        rows, width = x.shape[0] // microbatches, x.shape[1]
        xs = constrain(x.reshape(microbatches, rows, width), P(None, "data"))
        ys = constrain(y.reshape(microbatches, rows, width), P(None, "data"))
        stage_ids = jnp.arange(stages)
        first = (stage_ids == 0)[:, None, None]

        def iteration(carry, t):
            state, total = carry
            fresh = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, microbatches - 1), 0, False)
            stage_in = constrain(jnp.where(first, fresh[None], state), state_spec)
            out = jax.vmap(run_stage, spmd_axis_name="stage")(params["w"], params["b"], stage_in)
            out = constrain(out, state_spec)
            done = t - (stages - 1)  # the microbatch the last stage finished, if >= 0
            target = jax.lax.dynamic_index_in_dim(ys, jnp.clip(done, 0, microbatches - 1), 0, False)
            losses = jax.vmap(
                lambda o, s: jnp.where(s == stages - 1, jnp.mean((o - target) ** 2), 0.0),
                spmd_axis_name="stage",
            )(out, stage_ids)
            total = total + jnp.where(done >= 0, jnp.sum(losses), 0.0)
            return (shift(out), total), None

        state = constrain(jnp.zeros((stages, rows, width), x.dtype), state_spec)
        steps = jnp.arange(microbatches + stages - 1)
        (_, total), _ = jax.lax.scan(iteration, (state, jnp.zeros((), x.dtype)), steps)
        return total / microbatches

    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return loss, jax.tree.map(lambda p, g: p - LR * g, params, grads)

    return step


def spmd_params(params, stages: int = STAGES):
    """The stacked parameters as the SPMD pipeline holds them: ``(stages, L/stages, ...)``."""
    return jax.tree.map(lambda a: a.reshape(stages, a.shape[0] // stages, *a.shape[1:]), params)


# ----------------------------------------------------------------- measuring


def platform() -> str:
    return jax.devices()[0].platform


def layout() -> tuple[Mesh, tuple[Mesh, ...]]:
    """The SPMD mesh ``{stage: s, data: n/s}`` and mpmdc's ``s`` meshes ``{data: n/s}``
    over the same devices (``_common.stage_layout``)."""
    return _common.stage_layout(STAGES, jax.devices()[: OPTIONS.devices])


def schedules(meshes) -> tuple[str, ...]:
    return _common.stage_schedules(STAGES, meshes)


def resident_bytes(arrays) -> int:
    """The most bytes of ``arrays``' shards any one device holds."""
    per_device: dict = {}
    for a in jax.tree.leaves(arrays):
        for shard in a.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def xla_peak(compiled) -> int:
    """Per device: XLA's arguments + outputs + temporaries - aliased, of one module."""
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def mpmdc_peak(compiled, placed) -> int:
    """Per device, an upper bound: the most, over meshes, of the arguments one device of
    the mesh holds, the mesh's peak live intermediates (``Compiled.memory``, whole
    arrays, though the activations are split over the mesh's devices) and its largest
    fragment's XLA temporaries."""
    args_on: dict = {}
    for a in jax.tree.leaves(placed):
        for shard in a.addressable_shards:
            args_on[shard.device] = args_on.get(shard.device, 0) + shard.data.nbytes
    temps = compiled.memory_analysis()
    peaks = []
    for m, (mesh, live) in enumerate(zip(compiled.program.meshes, compiled.memory)):
        held = max(args_on.get(d, 0) for d in mesh.devices.flat)
        peaks.append(held + live.peak_bytes + temps.get(m, {}).get("temp_size_in_bytes", 0))
    return max(peaks)


def blocked(fn, *args):
    return lambda: jax.block_until_ready(fn(*args))


def first_result(fn, args):
    """(seconds from calling ``fn`` to its result, XLA compile seconds per module, result)."""
    with XlaTimes() as xla:
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        seconds = time.perf_counter() - start
    return seconds, xla.seconds, out


def lower_seconds(make):
    start = time.perf_counter()
    lowered = make()
    return time.perf_counter() - start, lowered


def differences(out, want, params0, flat) -> tuple[float, float]:
    """(|loss - jax.jit's| / |jax.jit's|, max |param - jax.jit's| / max |jax.jit's update|)."""
    loss, params = out
    want_loss, want_params = want
    params = jax.tree.map(lambda a: np.asarray(a).reshape(-1), flat(params))
    want_params = jax.tree.map(lambda a: np.asarray(a).reshape(-1), want_params)
    start = jax.tree.map(lambda a: np.asarray(a).reshape(-1), params0)
    step = max(
        np.abs(w - s).max() for w, s in zip(jax.tree.leaves(want_params), jax.tree.leaves(start))
    )
    err = max(
        np.abs(p - w).max() for p, w in zip(jax.tree.leaves(params), jax.tree.leaves(want_params))
    )
    return abs(float(loss) - float(want_loss)) / abs(float(want_loss)), float(err / step)


def measure(layers: int, microbatches: int, options) -> list[dict]:
    spmd_mesh, meshes = layout()
    rows = options.microbatch_rows * microbatches
    params = _common.residual_stack(layers, options.width)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (rows, options.width))
    y = jax.random.normal(ky, (rows, options.width))
    batch = P("data")
    runs = {}

    # jax.jit on one device: the reference.
    jit_args = jax.device_put((params, x, y), jax.devices()[0])
    seconds, xla, want = first_result(
        jax.jit(pipelined_step(layers, microbatches, "1f1b")), jit_args
    )
    lower_s, lowered = lower_seconds(
        lambda: jax.jit(pipelined_step(layers, microbatches, "1f1b")).lower(*jit_args)
    )
    compiled = lowered.compile()
    runs["jax.jit, 1 device"] = dict(
        first=seconds,
        xla=xla,
        lower=lower_s,
        out=want,
        call=blocked(compiled, *jit_args),
        resident=resident_bytes(jit_args),
        peak=xla_peak(compiled),
        flat=lambda p: p,
        calls=1,
    )

    # The SPMD pipeline over {stage: 4, data: 2}.
    param_sharding = NamedSharding(spmd_mesh, P("stage"))
    batch_sharding = NamedSharding(spmd_mesh, batch)
    spmd_args = (
        jax.device_put(spmd_params(params), param_sharding),
        jax.device_put(x, batch_sharding),
        jax.device_put(y, batch_sharding),
    )

    def spmd_jit():
        return jax.jit(
            spmd_step(spmd_mesh, microbatches),
            out_shardings=(NamedSharding(spmd_mesh, P()), param_sharding),
        )

    seconds, xla, out = first_result(spmd_jit(), spmd_args)
    lower_s, lowered = lower_seconds(lambda: spmd_jit().lower(*spmd_args))
    compiled = lowered.compile()
    runs["SPMD pipeline (GPipe)"] = dict(
        first=seconds,
        xla=xla,
        lower=lower_s,
        out=out,
        call=blocked(compiled, *spmd_args),
        resident=resident_bytes(spmd_args),
        peak=xla_peak(compiled),
        flat=lambda p: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), p),
        calls=1,
    )

    # mpmdc on 4 meshes, under each schedule.
    for schedule in schedules(meshes):

        def compiled_fn(schedule=schedule):
            return mpmdc.compile(
                pipelined_step(layers, microbatches, schedule),
                meshes,
                in_specs=(None, batch, batch),
                passes=passes(options),
            )

        seconds, xla, out = first_result(compiled_fn(), (params, x, y))
        lower_s, lowered = lower_seconds(lambda: compiled_fn().lower(params, x, y))
        compiled = lowered.compile()
        placed = jax.device_put((params, x, y), compiled.input_shardings[0])
        eqns = compiled.program.jaxpr.jaxpr.eqns
        runs[f"mpmdc {schedule}"] = dict(
            first=seconds,
            xla=xla,
            lower=lower_s,
            out=out,
            call=blocked(compiled, *placed),
            resident=resident_bytes(placed),
            peak=mpmdc_peak(compiled, placed),
            flat=lambda p: p,
            calls=sum(e.primitive.name == "fragment" for e in eqns),
        )

    for run in runs.values():  # warm: each once more before timing
        run["call"]()
    steps = _common.interleaved([r["call"] for r in runs.values()], repeat=options.steps)
    loss_tol, param_tol = TOLERANCE.get(platform(), TOLERANCE["gpu"])
    spmd = runs["SPMD pipeline (GPipe)"]
    spmd_step_s = steps[list(runs).index("SPMD pipeline (GPipe)")]
    out_rows = []
    for (name, run), step_s in zip(runs.items(), steps):
        loss_err, param_err = differences(run["out"], want, params, run["flat"])
        out_rows.append(
            {
                "L": layers,
                "M": microbatches,
                "program": name,
                "first result s": run["first"],
                "lower() s": run["lower"],
                "XLA modules": len(run["xla"]),
                "XLA s (sum)": sum(run["xla"]),
                "XLA s (largest)": max(run["xla"], default=0.0),
                "fragment calls": run["calls"],
                "step ms": step_s * 1e3,
                "args MB/device": run["resident"] / 2**20,
                "peak MB/device": run["peak"] / 2**20,
                "loss err": loss_err,
                "param err": param_err,
                "agrees": "yes" if loss_err <= loss_tol and param_err <= param_tol else "NO",
                "first / SPMD": run["first"] / spmd["first"],
                "step / SPMD": step_s / spmd_step_s,
                "peak / SPMD": run["peak"] / spmd["peak"],
            }
        )
    return out_rows


def profile(layers: int, microbatches: int, options) -> None:
    """Where mpmdc's time goes against the SPMD pipeline's, at one (L, M)."""
    spmd_mesh, meshes = layout()
    params = _common.residual_stack(layers, options.width)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (options.microbatch_rows * microbatches, options.width))
    y = jax.random.normal(ky, (options.microbatch_rows * microbatches, options.width))
    batch = P("data")
    schedule = schedules(meshes)[0]
    step = mpmdc.compile(
        pipelined_step(layers, microbatches, schedule),
        meshes,
        in_specs=(None, batch, batch),
        passes=passes(options),
    )
    lowered = step.lower(params, x, y)
    program = lowered.program("stablehlo")
    calls: dict = {}
    for eqn in program.jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "fragment":
            key = fragment_key(eqn)
            calls.setdefault(key, [eqn, 0])[1] += 1
    modules = []
    for name, key in program.module_keys:  # one after another: XLA's seconds alone
        eqn, count = calls[key]
        start = time.perf_counter()
        module = program.lowerings[key].compile()
        compile_seconds = time.perf_counter() - start
        wall, cpu = call_times(module, options.steps)
        modules.append(
            {
                "module": name,
                "mesh": eqn.params["mesh"],
                "calls per step": count,
                "equations": len(eqn.params["jaxpr"].jaxpr.eqns),
                "XLA compile s": compile_seconds,
                "call ms": wall * 1e3,
                "call CPU ms": cpu * 1e3,
            }
        )
    compiled = lowered.compile()
    placed = jax.device_put((params, x, y), compiled.input_shardings[0])

    param_sharding = NamedSharding(spmd_mesh, P("stage"))
    batch_sharding = NamedSharding(spmd_mesh, batch)
    spmd_args = (
        jax.device_put(spmd_params(params), param_sharding),
        jax.device_put(x, batch_sharding),
        jax.device_put(y, batch_sharding),
    )
    spmd_lowered = jax.jit(
        spmd_step(spmd_mesh, microbatches),
        out_shardings=(NamedSharding(spmd_mesh, P()), param_sharding),
    ).lower(*spmd_args)
    start = time.perf_counter()
    spmd_compiled = spmd_lowered.compile()
    compile_seconds = time.perf_counter() - start
    wall, cpu = call_times(spmd_compiled, options.steps, calls=3)
    modules.append(
        {
            "module": "SPMD pipeline (the whole step)",
            "mesh": "all",
            "calls per step": 1,
            "equations": len(jax.make_jaxpr(spmd_step(spmd_mesh, microbatches))(*spmd_args).eqns),
            "XLA compile s": compile_seconds,
            "call ms": wall * 1e3,
            "call CPU ms": cpu * 1e3,
        }
    )
    _common.report(
        f"spmd_pipeline_profile_modules_L{layers}_M{microbatches}", modules, list(modules[0])
    )
    fixed = fixed_costs(meshes, options)
    _common.report(f"spmd_pipeline_profile_fixed_costs_W{options.width}", fixed, list(fixed[0]))

    def split_times(fn, args):
        """(seconds until the call returns, having dispatched everything; seconds until
        the results are ready; process CPU seconds) of one step."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        dispatched = time.perf_counter() - wall
        jax.block_until_ready(out)
        return dispatched, time.perf_counter() - wall, time.process_time() - cpu

    rows = []
    for name, fn, args in (
        (f"mpmdc {schedule}", compiled, placed),
        ("SPMD pipeline (GPipe)", spmd_compiled, spmd_args),
    ):
        jax.block_until_ready(fn(*args))
        samples = [split_times(fn, args) for _ in range(options.steps)]
        dispatched, wall, cpu = (statistics.median(s[i] for s in samples) for i in range(3))
        rows.append(
            {
                "program": name,
                "step ms": wall * 1e3,
                "dispatch ms": dispatched * 1e3,
                "dispatch ms per microbatch": dispatched * 1e3 / microbatches,
                "process CPU ms": cpu * 1e3,
                "CPU ms per microbatch": cpu * 1e3 / microbatches,
            }
        )
    _common.report(f"spmd_pipeline_profile_step_L{layers}_M{microbatches}", rows, list(rows[0]))

    # One mesh thread each, every slot waited for: per mesh, the busy time per microbatch.
    timelines = [compiled.run_timed(*placed)[1] for _ in range(options.steps)]
    timeline = min(timelines, key=lambda t: t.makespan)
    mesh_rows = []
    for m, slots in enumerate(timeline.meshes):
        mesh_rows.append(
            {
                "mesh": m,
                "slots": len(slots),
                "busy ms per microbatch": sum(s.end - s.start for s in slots) / microbatches,
                "in the loop ms per microbatch": sum(
                    s.end - s.start for s in slots if s.action is not None
                )
                / microbatches,
                "makespan ms": timeline.makespan,
            }
        )
    _common.report(
        f"spmd_pipeline_profile_meshes_L{layers}_M{microbatches}", mesh_rows, list(mesh_rows[0])
    )


def fixed_costs(meshes, options) -> list[dict]:
    """What a module, a call and a transfer cost whatever the work: ``x + 1`` on one
    microbatch's activation compiled for a mesh, called on one device and on a whole
    mesh, and that activation moved to the next mesh as the runtime moves it, where there
    is one (each call or transfer a median of ``--steps`` runs of 200, until the results
    are ready)."""
    rows, width = options.microbatch_rows, options.width
    activation = jnp.zeros((rows, width), jnp.float32)
    one_device = NamedSharding(Mesh(meshes[0].devices.flat[:1], ("one",)), P())
    on_mesh = NamedSharding(meshes[0], P("data"))
    backend = mpmdc.backends.get(mpmdc.backends.for_platform(meshes[0].devices.flat[0].platform))
    runs = []
    for what, sharding in (("call on 1 device", one_device), ("call on a mesh", on_mesh)):
        x = jax.device_put(activation, sharding)
        add_one = jax.jit(lambda a: a + 1).lower(x).compile()
        runs.append((what, sharding, lambda add_one=add_one, x=x: add_one(x)))
    if len(meshes) > 1:
        on_next = NamedSharding(meshes[1], P("data"))
        x = jax.device_put(activation, on_mesh)
        runs.append(
            ("transfer to the next mesh", on_mesh, lambda: backend.transfer([x], [on_next]))
        )
    table = [compile_cost(activation, on_mesh, options.steps)]
    for what, sharding, run in runs:
        jax.block_until_ready(run())
        samples = []
        for _ in range(options.steps):
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready([run() for _ in range(200)])
            samples.append(((time.perf_counter() - wall) / 200, (time.process_time() - cpu) / 200))
        table.append(
            {
                "what": what,
                "devices": len(sharding.device_set),
                "ms": statistics.median(s[0] for s in samples) * 1e3,
                "CPU ms": statistics.median(s[1] for s in samples) * 1e3,
            }
        )
    return table


def compile_cost(activation, sharding, repeats: int) -> dict:
    """What XLA takes to compile a module whatever its work: ``x + c`` on the activation
    laid out on a mesh, a new constant each time so that no cache serves it (median of
    ``repeats``)."""
    x = jax.device_put(activation, sharding)
    samples = []
    for c in range(repeats):
        lowered = jax.jit(lambda a, c=float(c): a + c).lower(x)
        wall, cpu = time.perf_counter(), time.process_time()
        lowered.compile()
        samples.append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        "what": "XLA compile for a mesh",
        "devices": len(sharding.device_set),
        "ms": statistics.median(s[0] for s in samples) * 1e3,
        "CPU ms": statistics.median(s[1] for s in samples) * 1e3,
    }


def call_times(module, repeats: int, calls: int = 20) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call of the compiled ``module`` alone,
    on zeros already on its devices, until its results are ready; median of
    ``repeats`` runs of ``calls`` calls (fresh arguments each, as a module may donate
    them)."""
    avals = jax.tree.leaves(module.in_avals)
    shardings = jax.tree.leaves(module.input_shardings)
    samples = []
    for _ in range(repeats):
        arguments = [
            jax.tree.unflatten(
                module.in_tree,
                [jax.device_put(np.zeros(a.shape, a.dtype), s) for a, s in zip(avals, shardings)],
            )
            for _ in range(calls + 1)
        ]
        args, kwargs = arguments.pop()
        jax.block_until_ready(module(*args, **kwargs))
        wall, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready([module(*args, **kwargs) for args, kwargs in arguments])
        samples.append(((time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls))
    return tuple(statistics.median(s[i] for s in samples) for i in range(2))


def warm_up(options) -> None:
    """First-use costs of JAX and mpmdc (rules, caches) paid before anything is timed."""
    small = argparse.Namespace(**{**vars(options), "width": 16, "steps": 1})
    measure(STAGES, 2, small)


COLUMNS = [
    "L", "M", "program", "first result s", "first / SPMD", "lower() s", "XLA modules",
    "XLA s (sum)", "XLA s (largest)", "fragment calls", "step ms", "step / SPMD",
    "args MB/device", "peak MB/device", "peak / SPMD", "loss err", "param err", "agrees",
]  # fmt: skip


def main():
    options = OPTIONS
    if options.quick:
        options.L, options.M = [8], [4, 16, 64]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"platform {platform()}, {jax.device_count()} devices; load average {load:.2f}",
        file=sys.stderr,
    )
    warm_up(options)
    if options.profile:
        return profile(options.L[0], options.M[0], options)
    rows = []
    for layers in options.L:
        for microbatches in options.M:
            start = time.perf_counter()
            rows += measure(layers, microbatches, options)
            print(
                f"L={layers} M={microbatches}: {time.perf_counter() - start:.0f} s", file=sys.stderr
            )
    name = "spmd_pipeline" + ("_quick" if options.quick else "")
    name += "" if options.scans == "fused" else f"_{options.scans}"
    after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    _common.report(
        name,
        rows,
        COLUMNS,
        notes=f"load average {load:.2f} before, {after:.2f} after; steps: median of {options.steps}",
    )


if __name__ == "__main__":
    main()
