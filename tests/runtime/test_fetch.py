"""``mpmdc.fetch`` in one process: numpy arrays, a typed PRNG key as its key data (numpy
has no key type). Several processes: ``tests/multiprocess``."""

import jax
import numpy as np

import mpmdc


def test_fetch_gives_numpy_and_a_typed_key_as_its_key_data():
    key = jax.random.key(7, impl="rbg")
    got = mpmdc.fetch({"loss": jax.numpy.float32(0.5), "key": key})
    assert isinstance(got["loss"], np.ndarray) and got["loss"] == 0.5
    assert got["key"].dtype == np.uint32
    np.testing.assert_array_equal(got["key"], np.asarray(jax.random.key_data(key)))
