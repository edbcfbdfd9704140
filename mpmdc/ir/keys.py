"""Typed PRNG keys (``key<fry>``) as values: what holds them, and the plain array of
their key data that stands for them where JAX takes only plain arrays (numpy, moves
between processes, files)."""

from __future__ import annotations

import jax


def is_key_dtype(dtype) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``key<fry>``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_key(x) -> bool:
    """Whether ``x`` (an array, an aval or a ``jax.ShapeDtypeStruct``) holds typed PRNG
    keys; anything without a dtype does not."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and is_key_dtype(dtype)


def key_data_type(x) -> jax.ShapeDtypeStruct:
    """The shape and dtype of the key data of keys shaped as ``x``: the keys' shape,
    then the implementation's, in ``uint32``."""
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
