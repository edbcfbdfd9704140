"""Test setup: 8 virtual CPU devices (before JAX starts), verification after every pass,
and the ``--update-golden`` option."""

import os

os.environ.setdefault("MPMDC_VERIFY", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest

import mpmdc


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite golden/ from the current compiler output instead of comparing",
    )


@pytest.fixture(scope="session")
def update_golden(request):
    """True when ``pytest --update-golden`` was asked for."""
    return request.config.getoption("--update-golden")


@pytest.fixture(scope="session")
def meshes4():
    """Four disjoint meshes of two devices, axis ``data``."""
    return mpmdc.make_meshes(4, {"data": 2})


@pytest.fixture(scope="session")
def meshes2():
    """Two disjoint meshes of two devices, axis ``data``."""
    return mpmdc.make_meshes(2, {"data": 2})
