"""Small array helpers shared by the core and the kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["pad_axis", "round_to", "take_rows", "take_static"]


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


def take_rows(x, idx):
    """``x`` [B, T, *rest] taken along axis 1, row by row: ``out[b, l, i...] = x[b,
    idx[b, l, i...], i...]`` for ``idx`` int [B, L, *m], ``m`` broadcastable to the
    first ``len(m)`` dims of ``rest`` (the rest are carried whole); indices in ``[0,
    T)`` (clipped). ``jnp.take_along_axis(x, idx, axis=1)`` for in-range indices.

    One gather from the flattened array at flat indices, whose gradient is one
    scatter-add: no gather or scatter with batching dimensions, which
    ``take_along_axis`` over several rows lowers to (``operand_batching_dims`` over
    ``B`` and the other taken dims). On an H200 (JAX 0.11.2) every packed-rows test
    of dilated attention whose streams held two rows or more gave wrong results
    (relative errors 0.06 to 1.08), those of one row were right, and every CPU was
    right: batching dimensions over ``B`` were the difference between those programs.
    The flat form is the plain gather that every platform runs (whether it fixes that
    GPU is still to be run there).
    """
    b, t = x.shape[:2]
    k = idx.ndim - 2
    mid = x.shape[2:2 + k]
    carried = x.shape[2 + k:]
    count = b * t * int(np.prod(mid, dtype=np.int64))
    itype = jnp.int32 if count < np.iinfo(np.int32).max else jnp.int64
    flat = jnp.clip(jnp.broadcast_to(idx, (b, idx.shape[1], *mid)).astype(itype), 0, t - 1)
    flat = flat + (jnp.arange(b, dtype=itype) * t).reshape((b,) + (1,) * (k + 1))
    for j, n in enumerate(mid):  # row-major over (B T, *mid)
        flat = flat * n + jnp.arange(n, dtype=itype).reshape((1, 1) + (1,) * j + (n,)
                                                             + (1,) * (k - j - 1))
    got = jnp.take(x.reshape(count, *carried), flat.reshape(-1), axis=0, mode="clip")
    return got.reshape(*flat.shape, *carried)


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
