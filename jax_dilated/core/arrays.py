"""Small array helpers shared by the core and the kernels."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["pad_axis"]


def pad_axis(x, axis: int, size: int, value=0):
    """``x`` padded at the end of ``axis`` with ``value`` up to ``size`` entries.

    ``x`` itself when ``axis`` already has ``size`` entries (no copy, no op traced);
    ``size`` must not be smaller than ``x.shape[axis]``.
    """
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)
