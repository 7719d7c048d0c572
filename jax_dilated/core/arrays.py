"""Small array helpers shared by the core and the kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["pad_axis", "round_to", "take_static"]


def round_to(x, dtype):
    """``x`` rounded to ``dtype``'s precision and range, kept in ``x``'s dtype.

    ``x.astype(dtype).astype(x.dtype)`` means the same, but XLA may drop that round
    trip inside a fusion (it allows excess precision, and does so on GPUs);
    ``reduce_precision`` it keeps. ``x`` itself where ``dtype`` is not narrower.
    """
    src, dst = jnp.finfo(x.dtype), jnp.finfo(dtype)
    if dst.nmant >= src.nmant and dst.nexp >= src.nexp:
        return x
    y = jax.lax.reduce_precision(x, exponent_bits=dst.nexp, mantissa_bits=dst.nmant)
    if dst.nexp < src.nexp:
        # reduce_precision flushes dtype's subnormals to zero (float16 below 6.1e-5);
        # they are rounded on their own grid, multiples of the smallest one
        step = jnp.asarray(dst.smallest_subnormal, x.dtype)
        y = jnp.where(jnp.abs(x) < jnp.asarray(dst.tiny, x.dtype), jnp.round(x / step) * step, y)
    return y


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


def take_static(x, indices, axis: int):
    """``jnp.take(x, indices, axis)`` for static ``indices`` (a sequence of ints, in
    range), whose gradient is a gather too.

    JAX differentiates ``jnp.take`` into a scatter-add of the cotangent into a zeroed
    array of ``x``'s shape, which XLA materialises on its own: a dilated gather that
    picks 8 of 128 columns gets a 16x larger buffer in its backward, one per gathered
    array. With static indices each column of the gradient is known up front: it is
    the cotangent of the entries that read it (summed when several do) or zero, so
    the backward takes those entries back and zeroes the rest in one elementwise
    pass that XLA fuses into the gradients' sum.
    """
    indices = tuple(int(i) for i in np.asarray(indices).reshape(-1))
    axis = axis % x.ndim
    if any(not 0 <= i < x.shape[axis] for i in indices):
        raise ValueError(f"take_static: indices {indices} out of range for axis {axis} "
                         f"of shape {x.shape}.")
    if not jnp.issubdtype(x.dtype, jnp.inexact):  # masks and ids: nothing to differentiate
        return jnp.take(x, np.asarray(indices, np.int32), axis=axis)
    return _take_static(x, indices, axis, x.shape[axis])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _take_static(x, indices, axis, width):
    return jnp.take(x, np.asarray(indices, np.int32), axis=axis)


def _take_static_fwd(x, indices, axis, width):
    return _take_static(x, indices, axis, width), None


def _take_static_bwd(indices, axis, width, _, g):
    dx = None
    # the k-th reader of every column, for k up to the most readers a column has
    readers: list[list[int]] = [[] for _ in range(width)]
    for i, col in enumerate(indices):
        readers[col].append(i)
    for k in range(max(len(r) for r in readers)):
        hit = np.array([len(r) > k for r in readers])
        src = np.array([r[k] if len(r) > k else 0 for r in readers], np.int32)
        part = jnp.take(g, src, axis=axis)
        part = jnp.where(hit.reshape((-1,) + (1,) * (g.ndim - 1 - axis)), part,
                         jnp.zeros((), g.dtype))
        dx = part if dx is None else dx + part
    if dx is None:  # no index at all: nothing read, a zero gradient
        dx = jnp.zeros(g.shape[:axis] + (width,) + g.shape[axis + 1:], g.dtype)
    return (dx,)


_take_static.defvjp(_take_static_fwd, _take_static_bwd)
