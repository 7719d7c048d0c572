"""Meshes for the multi-device tests (8 simulated CPU devices, see conftest.py)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType


def build_mesh(shape, names, kind):
    """``jax.make_mesh`` (Explicit axes) or a hand-built ``Mesh`` with Auto axes."""
    if kind == "explicit":
        mesh = jax.make_mesh(shape, names)
        assert all(t == AxisType.Explicit for t in mesh.axis_types), mesh.axis_types
        return mesh
    assert kind == "auto", kind
    devices = np.array(jax.devices()[:math.prod(shape)]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))
