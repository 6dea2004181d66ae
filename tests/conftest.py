"""Test configuration: 8 emulated CPU devices, a mesh factory and one tolerance table.

JAX is configured here, before any test module creates an array, so every test sees the
same 8-device CPU platform that CI sees.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_threefry_partitionable", True)

import pytest

from tests._util import make_test_mesh


@pytest.fixture
def mesh_factory():
    return make_test_mesh
