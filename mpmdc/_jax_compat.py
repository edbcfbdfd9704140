"""The one place mpmdc reaches into ``jax._src``.

Everything here is a private JAX name that mpmdc needs and that has no public
equivalent in JAX 0.10. Keeping them together makes a JAX upgrade a one-file job.
"""

import io
import sys

import jax
import numpy as np
from jax._src import array as _array
from jax._src import checkify as _checkify
from jax._src import compiler as _compiler
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import shard_map as _shard_map
from jax._src import source_info_util as _source_info_util
from jax._src import stages as _stages
from jax._src import traceback_util as _traceback_util
from jax._src import util as _util
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax
from jax._src.lib import xla_client as _xc
from jax.experimental import serialize_executable

Var = _core.Var
JaxprPpContext = _core.JaxprPpContext
JaxprPpSettings = _core.JaxprPpSettings
pp_eqn = _core.pp_eqn
# (A context manager: how many user frames a lowered operation's location names.)
traceback_in_locations_limit = _config.traceback_in_locations_limit
# (A context manager: the traceback operations traced inside it are made at.)
user_context = _source_info_util.user_context
pp_var = _core.pp_var
# (What ``jax.jit``'s cache keys a trace on besides the arguments: the context mesh,
# ``jax_enable_x64``, the default matmul precision and the other tracing settings.)
trace_context = _config.trace_context
custom_typechecks = _core.custom_typechecks
lowerable_effects = _effects.lowerable_effects
shard_map_p = _shard_map.shard_map_p
check_p = _checkify.check_p
# (Wraps an entry point as ``jax.jit``'s are wrapped: an exception leaving it has the
# frames of the files excluded from tracebacks removed, as ``JAX_TRACEBACK_FILTERING``
# says; a chained cause keeps its whole traceback.)
api_boundary = _traceback_util.api_boundary
ordered_effects = _effects.ordered_effects


def with_metadata(ctx, updates: dict):
    """Equation context ``ctx`` with its metadata updated by ``updates`` (a value of
    ``None`` removes its key). JAX's rewrites (DCE rules, ``eqn.replace``) keep an
    equation's context, so what is recorded here travels with the equation."""
    items = {k: v for k, v in (ctx.xla_metadata or {}).items() if k not in updates}
    items.update((k, v) for k, v in updates.items() if v is not None)
    return _core.JaxprEqnContext._create(
        ctx.compute_type,
        ctx.threefry_partitionable,
        ctx.cur_abstract_mesh,
        ctx.remove_size_one_mesh_axis,
        tuple(sorted(items.items())) or None,
    )


def register_cache(cache, what: str) -> None:
    """Have ``jax.clear_caches()`` clear ``cache`` too (it calls ``cache.cache_clear()``),
    as it clears JAX's own caches; JAX's registry holds ``cache`` weakly."""
    _util.register_cache(cache, what)


def exclude_from_source_lines(path: str) -> None:
    """Make source lines skip frames under ``path`` (mpmdc's own), as JAX skips its own."""
    _source_info_util.register_exclusion(path)


def exclude_from_tracebacks(path: str) -> None:
    """Make the tracebacks of exceptions leaving an :data:`api_boundary` skip frames
    under ``path`` (mpmdc's own), as JAX's skip its own."""
    _traceback_util.register_exclusion(path)


def source_line(eqn) -> str:
    """Return ``file:line (function)`` of the user code that created ``eqn``."""
    return _source_info_util.summarize(eqn.source_info)


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` naming the innermost frame of the user's code
    (outside JAX, mpmdc and the libraries left out of source lines), counted from the
    caller; 1, the caller, where no such frame is on the stack."""
    frame, level = sys._getframe(1), 1
    while frame is not None and not _source_info_util.is_user_filename(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def user_line() -> str:
    """Return ``file:line (function)`` of the user code running now (the innermost frame
    outside JAX and mpmdc): where a mistake found while tracing was made."""
    return _source_info_util.summarize(_source_info_util.current())


def drop_failed_effect_tokens() -> None:
    """Forget the effect tokens of computations that failed.

    JAX keeps each device's last effect token (and each ordered effect's) until the next
    effectful computation replaces it, and waits for all of them at exit. A fragment that
    failed (a callback raised) leaves a token holding that error; once mpmdc has raised
    it, the token would raise it again at exit as "Exception ignored in atexit callback".
    """
    tokens = _dispatch.runtime_tokens
    for table in (tokens.output_runtime_tokens, tokens.current_tokens):
        for key, token in list(table.items()):
            try:
                token.block_until_ready()
            except Exception:
                del table[key]


def backends_are_initialized() -> bool:
    """True once JAX has started its backends (device-count settings are then fixed)."""
    return _xla_bridge.backends_are_initialized()


def direct_call(executable):
    """The C++ dispatch function behind a ``jax.stages.Compiled`` (what its ``__call__``
    forwards to), or ``executable`` itself where there is none: calling it directly saves
    a Python frame per fragment call, about a tenth of a small fragment's dispatch.

    An executable reading a sub-byte array (``int4``, ``float4_e2m1fn``) is called as
    ``jax.jit`` calls its own, without the check of the arguments' layouts: JAX reports
    such an input's layout with its element size (4 bits) and every array of it, even one
    an executable made, without (0), so the check refuses arrays it runs correctly."""
    if not isinstance(executable, _stages.Compiled):
        return executable
    if any(_sub_byte(aval.dtype) for aval in executable._executable.in_avals):
        unchecked, consts = executable._executable.unsafe_call, executable._params.const_args
        return lambda *args: unchecked(*consts, *args)
    make = getattr(executable._executable, "create_cpp_call", None)
    call = make(executable._params) if make is not None else None
    return call if call is not None else executable


def _sub_byte(dtype) -> bool:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # (a typed PRNG key's)
        return False
    return jax.dtypes.itemsize_bits(dtype) < 8


def load_on_devices(compiled, devices):
    """``compiled`` (a ``jax.stages.Compiled`` for one mesh) loaded to run on ``devices``
    instead, the same number in the same order, without compiling it again; ``None``
    where that cannot be done safely.

    The executable is serialized and deserialized with its device assignment, shardings
    and meshes moved onto ``devices`` (milliseconds, against a compile's tenths of a
    second). Executables with host callbacks or effects keep Python objects that do not
    travel, so they are left to be compiled.
    """
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None or unloaded.host_callbacks or unloaded.keepalive:
        return None
    if unloaded.ordered_effects or unloaded.unordered_effects:
        return None
    old = list(unloaded.device_list)
    if len(old) != len(devices):
        return None
    moved = {d.id: new for d, new in zip(old, devices)}
    client = devices[0].client
    options = _compiler.get_compile_options(
        num_replicas=1,
        num_partitions=len(devices),
        device_assignment=np.array(list(devices)).reshape(1, -1),
        backend=client,
    )
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)

    class Moving(serialize_executable._JaxPjrtUnpickler):
        def persistent_load(self, pid):
            if pid[0] == "device":
                return moved[pid[1]]
            if pid[0] == "exec":
                return self.backend.deserialize_executable(pid[1], self.execution_devices, options)
            return super().persistent_load(pid)

    executable, args_info, no_kwargs = Moving(io.BytesIO(payload), client, list(devices)).load()
    return _stages.Compiled(
        executable.load(), [], in_tree.unflatten(args_info), out_tree, no_kwargs=no_kwargs
    )


def copied_to(values, shardings) -> list | None:
    """``values`` (arrays of this process) copied onto ``shardings``, each laid out as
    its value is but on other devices, by one call into JAX's runtime; ``None`` where
    one is not (``jax.device_put`` then reshards it). What ``jax.device_put`` does for
    such values, without its Python layers (a fifth of the time per value)."""
    for x, sharding in zip(values, shardings):
        if not (
            type(x) is _array.ArrayImpl
            and x.is_fully_addressable
            and _array._sharding_indices_and_eq(x.sharding, sharding, x.ndim)
        ):
            return None
    return _xc.batched_copy_array_to_devices_with_sharding(
        list(values),
        [s._internal_device_list.addressable_device_list for s in shardings],
        list(shardings),
        [_xc.ArrayCopySemantics.REUSE_INPUT] * len(shardings),
    )


def key_impl(dtype):
    """The PRNG implementation of a typed key dtype (``key<fry>``), as
    ``jax.random.wrap_key_data(..., impl=)`` takes it; the public ``jax.random.key_impl``
    wants an array."""
    return dtype._impl


def with_weak_type(x, weak: bool):
    """``x`` with its type's weak flag set to ``weak`` (JAX's promotion treats a weak
    value as a Python scalar's)."""
    return _lax._convert_element_type(x, weak_type=weak)


def weakly_typed(x):
    """The global array ``x`` (from ``make_array_from_single_device_arrays``, whose result
    is never weakly typed) with a weak type, over the same buffers; no computation runs,
    so it works for an array with no shard on this process too."""
    aval = _core.update_aval_with_sharding(
        _core.ShapedArray(x.shape, x.dtype, weak_type=True), x.sharding
    )
    return _array.ArrayImpl(aval, x.sharding, x._arrays, committed=True)


# Equations that change only a value's shape or type: zeros in, zeros out.
_ZERO_PRESERVING = frozenset(
    {"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "expand_dims", "copy"}
)


def known_zero(x) -> bool:
    """Whether ``x``, a value of the jaxpr being traced, is zeros by construction: a
    literal zero, or one broadcast, reshaped or cast (what ``jax.grad`` makes for an
    argument the result does not depend on). ``False`` where that is not known, such as
    for a value of another kind of trace."""
    while isinstance(x, _pe.DynamicJaxprTracer):
        if isinstance(x.val, _core.Literal):
            return bool(np.all(np.asarray(x.val.val) == 0))
        parent = x.parent
        if parent is None or parent.primitive.name not in _ZERO_PRESERVING:
            return False
        x = parent.in_tracers[0]
    return False


def current_trace():
    """The trace JAX binds primitives with now (an object to compare by identity)."""
    return _core.trace_ctx.trace


def evaluating_eagerly() -> bool:
    """Whether JAX runs primitives as they are bound (no transformation or trace on)."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def replay_in_trace(closed, *args):
    """``closed``'s equations emitted as they are into the jaxpr being traced, on
    ``args``; its outputs, or ``None`` outside a jaxpr trace (under ``vmap``, say).

    What ``jax.core.jaxpr_as_fun(closed)(*args)`` does, without asking every primitive
    for its output types again: the equations already carry them (JAX's own
    ``inline_jaxpr_into_trace`` does the same, but gives every equation the call
    site's source line, where this keeps each equation's own).
    """
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace:
        return None
    jaxpr = closed.jaxpr
    env = {}
    for var, value in zip((*jaxpr.constvars, *jaxpr.invars), (*closed.consts, *args)):
        env[var] = trace.to_jaxpr_tracer(value, _source_info_util.current())

    def read(atom, source_info):
        if isinstance(atom, _core.Literal):
            return _pe.DynamicJaxprTracer(trace, atom.aval, atom, source_info)
        return env[atom]

    for eqn in jaxpr.eqns:
        ins = [read(a, eqn.source_info) for a in eqn.invars]
        effects = {
            e.replace(env[e.input].val) if isinstance(e, _effects.JaxprInputEffect) else e
            for e in eqn.effects
        }
        outs = trace.emit_eqn(
            ins,
            [v.aval for v in eqn.outvars],
            eqn.primitive,
            eqn.params,
            effects,
            eqn.source_info,
            eqn.ctx,
        )
        env.update(zip(eqn.outvars, outs))
    return [read(a, _source_info_util.current()) for a in jaxpr.outvars]


def replaying_fun(closed):
    """``jax.core.jaxpr_as_fun(closed)`` that replays the equations as they are
    (:func:`replay_in_trace`) where it is called inside a jaxpr trace, and binds them
    again elsewhere (under ``vmap`` or ``checkify``, say)."""
    bound = _core.jaxpr_as_fun(closed)

    def run(*args):
        outs = replay_in_trace(closed, *args)
        return bound(*args) if outs is None else outs

    return run


def detect_cluster():
    """``(coordinator address, process count, process id, local device ids)`` as
    ``jax.distributed`` detects them from a cluster's environment (SLURM, Open MPI,
    Kubernetes, TPU pods), or ``None`` outside any cluster it knows."""
    from jax._src import clusters

    if not any(
        not env.opt_in_only_method and env.is_env_present()
        for env in clusters.ClusterEnv._cluster_types
    ):
        return None
    return clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, 300
    )


def distributed_client():
    """The key-value store client of ``jax.distributed``, or ``None`` before it starts."""
    from jax._src import distributed

    return distributed.global_state.client


def detach_distributed_service():
    """The ``jax.distributed`` coordination service this process hosts, taken from JAX
    so that its exit does not shut it down (``None`` where it hosts none). Shutting it
    down waits for every peer's calls in flight, which a stopped peer never ends; the
    caller keeps it alive for as long as the process lives."""
    from jax._src import distributed

    service, distributed.global_state.service = distributed.global_state.service, None
    return service


def hook_custom_differentiation(hooks) -> None:
    """Have JAX call ``hooks`` where it differentiates a function by a rule of its own:

    - ``hooks.vjp_forward(primals_in, bwd, differentiate)`` for a ``custom_vjp`` function,
      where ``differentiate()`` is JAX's own handling (which runs the forward rule) and
      what it returns is returned;
    - ``hooks.vjp_backward(bwd, in_zeros, cotangents)`` on the cotangents that the
      backward rule ``bwd`` returned for the inputs with nonzero tangents, returning the
      ones to use;
    - ``hooks.jvp_forward(primals_in, jvp, differentiate)`` likewise for a ``custom_jvp``
      function and its tangent rule ``jvp``;
    - ``hooks.jvp_tangents(rule_info, tangents)`` on the input tangents (``ad.Zero``
      where zero) that a ``custom_jvp``'s linearized tangent rule, told by its debug
      info, is about to read, returning the ones it reads (under ``jax.linearize``, and
      so ``jax.grad``, with direct linearization on; elsewhere JAX runs the rule on the
      tangents with its primal work, and this is not called).

    Each hook sees every such function differentiated in this process, so each must leave
    alone what is not its own. JAX has no public hook there: the rules are user code.
    """
    for trace in (_ad.JVPTrace, _ad.LinearizeTrace):
        trace.process_custom_vjp_call = _hooked(trace.process_custom_vjp_call, hooks.vjp_forward)
        trace.process_custom_jvp_call = _hooked(trace.process_custom_jvp_call, hooks.jvp_forward)
    transpose = _ad.primitive_transposes[_ad.custom_lin_p]

    def custom_lin_transpose(cts_out, *invals, num_res, bwd, in_zeros, **params):
        cts = transpose(cts_out, *invals, num_res=num_res, bwd=bwd, in_zeros=in_zeros, **params)
        return cts[:num_res] + list(hooks.vjp_backward(bwd, in_zeros, cts[num_res:]))

    _ad.primitive_transposes[_ad.custom_lin_p] = custom_lin_transpose
    linearize_from_jvp = _ad.linearize_from_jvp

    def linearize_with_hook(jvp, *args, **kwargs):
        *rest, linearized = linearize_from_jvp(jvp, *args, **kwargs)

        def hooked(residuals, *tangents):
            return linearized(residuals, *hooks.jvp_tangents(jvp.debug_info, tangents))

        return (*rest, hooked)

    _ad.linearize_from_jvp = linearize_with_hook


def _hooked(process, forward):
    """``process`` (a trace's ``process_custom_{vjp,jvp}_call``, whose arguments end with
    the rule its hook is told of and the input tracers) run through ``forward``."""

    def process_custom_call(self, primitive, *rules_and_tracers, **params):
        *_, rule, tracers = rules_and_tracers
        primals = [self.to_primal_tangent_pair(t)[0] for t in tracers]
        return forward(
            primals, rule, lambda: process(self, primitive, *rules_and_tracers, **params)
        )

    return process_custom_call
