"""The ``send`` and ``recv`` primitives of in-program transfers, and their lowering.

A ``send`` at the end of the producing fragment and a ``recv`` at the start of each
consuming one, with the same channel id, move a value between meshes inside the
programs (``mpmdc.passes.in_program_transfers`` places them). They lower to
``stablehlo.send``/``stablehlo.recv`` on device-to-device channels, and only for the
platforms that have those: the rules are registered per platform with
``jax.interpreters.mlir.register_lowering(..., platform=...)``, so lowering them for
any other platform fails inside JAX rather than emitting something that cannot run.
The frontend attributes ``mpmdc.src_mesh``/``mpmdc.dst_mesh`` name the two meshes.
"""

from __future__ import annotations

from jax.extend import core as jcore
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir

from mpmdc import _jax_compat as compat

IN_PROGRAM_PLATFORMS = ("cuda", "rocm")

# JAX gives every collective (psum, all_gather...) channel id 1; a send/recv pair
# sharing it with a collective in the same module would be ambiguous to XLA.
FIRST_CHANNEL_ID = 2


class PeerTransferEffect(jcore.Effect):
    """A send or recv: keeps the equation alive through DCE and orders nothing."""

    def __str__(self):
        return "PeerTransfer"


peer_transfer_effect = PeerTransferEffect()
compat.lowerable_effects.add_type(PeerTransferEffect)

send_p = jcore.Primitive("send")
send_p.multiple_results = True
send_p.def_effectful_abstract_eval(lambda x, **_: ([], {peer_transfer_effect}))

recv_p = jcore.Primitive("recv")
recv_p.def_effectful_abstract_eval(lambda *, aval, **_: (aval, {peer_transfer_effect}))


def _attributes(op, src: int, dst: int) -> None:
    op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
        {
            "mpmdc.src_mesh": ir.StringAttr.get(str(src)),
            "mpmdc.dst_mesh": ir.StringAttr.get(str(dst)),
        }
    )


def _send_lowering(ctx, x, *, channel, src, dst):
    op = hlo.SendOp(
        [x],
        hlo.create_token(),
        hlo.ChannelHandle.get(channel, mlir.DEVICE_TO_DEVICE_TYPE),
        is_host_transfer=ir.BoolAttr.get(False),
    )
    _attributes(op, src, dst)
    return []


def _recv_lowering(ctx, *, channel, src, dst, aval):
    value_type = mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])
    op = hlo.RecvOp(
        [value_type, hlo.TokenType.get()],
        hlo.create_token(),
        hlo.ChannelHandle.get(channel, mlir.DEVICE_TO_DEVICE_TYPE),
        is_host_transfer=ir.BoolAttr.get(False),
    )
    _attributes(op, src, dst)
    return [op.results[0]]


for _platform in IN_PROGRAM_PLATFORMS:
    mlir.register_lowering(send_p, _send_lowering, platform=_platform)
    mlir.register_lowering(recv_p, _recv_lowering, platform=_platform)
