"""Meshes for the multi-device tests (8 simulated CPU devices, see conftest.py).

On a machine whose default backend has fewer devices than a mesh needs (one GPU:
``jax.devices()`` then lists the GPU, not the simulated CPU devices) the helpers
skip the test with the reason, rather than fail or quietly build a smaller mesh
(``jax.devices()[:4]`` of one device is one device).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.sharding import AxisType


def require_devices(n: int) -> None:
    """Skip the calling test unless the default backend has at least ``n`` devices."""
    have, backend = jax.device_count(), jax.default_backend()
    if have < n:
        hint = ("conftest.py asks for 8 simulated CPU devices" if backend == "cpu" else
                "run with JAX_PLATFORMS=cpu for the 8 simulated CPU devices")
        pytest.skip(f"needs {n} devices of the default backend ({backend}), this "
                    f"machine has {have}; {hint}")


def devices(n: int, shape=None) -> np.ndarray:
    """The first ``n`` devices as an array (reshaped to ``shape`` if given), or skip."""
    require_devices(n)
    out = np.array(jax.devices()[:n])
    return out if shape is None else out.reshape(shape)


def make_mesh(shape, names, **kw):
    """``jax.make_mesh(shape, names, **kw)``, or skip if there are too few devices."""
    require_devices(math.prod(shape))
    return jax.make_mesh(shape, names, **kw)


def build_mesh(shape, names, kind):
    """``jax.make_mesh`` (Explicit axes) or a hand-built ``Mesh`` with Auto axes."""
    if kind == "explicit":
        mesh = make_mesh(shape, names)
        assert all(t == AxisType.Explicit for t in mesh.axis_types), mesh.axis_types
        return mesh
    assert kind == "auto", kind
    return jax.sharding.Mesh(devices(math.prod(shape), shape), names,
                             axis_types=(AxisType.Auto,) * len(shape))
