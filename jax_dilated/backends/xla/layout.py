"""Block geometry and the blocked layout of the XLA kernel.

Inside the kernel arrays are ``[N, H_kv, G, L, D]`` with ``G = H / H_kv`` query heads
per kv head (grouped-query attention never repeats keys or values), cut into blocks
of ``block_q`` queries and ``block_k`` keys along ``L``, blocks first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import KernelArgs
from jax_dilated.backends.xla.block_math import dq_from_transposed
from jax_dilated.core import softmax
from jax_dilated.core.arrays import pad_axis

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
_PAD_Q_POS = -1  # padded query rows: causally see nothing
_PAD_K_POS = np.iinfo(np.int32).max  # padded keys: never the earliest key of a block


@dataclasses.dataclass(frozen=True)
class _Blocking:
    """Static block geometry of one call."""

    len_q: int
    len_k: int
    block_q: int
    block_k: int

    @property
    def num_q(self) -> int:
        return -(-self.len_q // self.block_q)

    @property
    def num_k(self) -> int:
        return -(-self.len_k // self.block_k)


def _balanced_block(length: int, target: int) -> int:
    """Block size near ``target`` that splits ``length`` into equal blocks (multiple of 8)."""
    if length % target == 0:
        return target  # callers that align blocks to chunk boundaries get them exactly
    n = max(1, -(-length // target))
    b = -(-length // n)
    return min(-(-b // 8) * 8, max(length, 1)) if n > 1 else max(length, 1)


def _blocking(len_q: int, len_k: int, args: KernelArgs) -> _Blocking:
    return _Blocking(len_q, len_k, _balanced_block(len_q, args.block_q or DEFAULT_BLOCK_Q),
                     _balanced_block(len_k, args.block_k or DEFAULT_BLOCK_K))


def _to_blocks(x, axis: int, block: int):
    """Split ``axis`` (already a multiple of ``block``) into blocks, blocks first."""
    shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _from_blocks(x, axis: int, length: int):
    """Inverse of :func:`_to_blocks`, cropped to ``length``."""
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:]
    return jax.lax.slice_in_dim(x.reshape(shape), 0, length, axis=axis)


class _Prepared:
    """Inputs laid out in blocks: q [nq, N, Hkv, G, bq, D], k/v [nk, N, Hkv, bk, D]."""

    def __init__(self, q, k, v, q_positions, k_positions, kv_valid, geo: _Blocking,
                 scale: float, q_seg=None, k_seg=None):
        n, _, h, d = q.shape
        # Fold the scale into q once (saves a pass over every logits block) when q
        # is at least float32; half-precision q would be rounded again, so there the
        # scale multiplies the float32 logits instead. logits = (q * pre) . k * post.
        stats = softmax.stats_dtype(q.dtype)
        pre = scale if jnp.dtype(q.dtype) == stats else 1.0
        self.post_scale = scale / pre
        if pre != 1.0:
            q = (q * jnp.asarray(pre, q.dtype)).astype(q.dtype)
        hkv = k.shape[2]
        self.geo = geo
        self.group = h // hkv
        lq, lk = geo.num_q * geo.block_q, geo.num_k * geo.block_k
        # [N, L, H, D] -> [N, Hkv, G, L, D]
        qh = q.reshape(n, q.shape[1], hkv, self.group, d).transpose(0, 2, 3, 1, 4)
        self.q = _to_blocks(pad_axis(qh, 3, lq), 3, geo.block_q)
        self.k = _to_blocks(pad_axis(k.transpose(0, 2, 1, 3), 2, lk), 2, geo.block_k)
        self.v = _to_blocks(pad_axis(v.transpose(0, 2, 1, 3), 2, lk), 2, geo.block_k)
        qp = jnp.arange(geo.len_q, dtype=jnp.int32) if q_positions is None else q_positions
        kp = jnp.arange(geo.len_k, dtype=jnp.int32) if k_positions is None else k_positions
        self.q_pos = pad_axis(qp.astype(jnp.int32), 0, lq, _PAD_Q_POS).reshape(geo.num_q, -1)
        self.k_pos = pad_axis(kp.astype(jnp.int32), 0, lk, _PAD_K_POS).reshape(geo.num_k, -1)
        if kv_valid is None and lk == geo.len_k:
            self.k_valid = None
        else:
            valid = jnp.ones((n, geo.len_k), bool) if kv_valid is None else kv_valid
            # [N, Lk] or [N, Lk, Hkv] -> [N, Hkv or 1, Lk]
            valid = valid[:, None, :] if valid.ndim == 2 else valid.transpose(0, 2, 1)
            self.k_valid = _to_blocks(pad_axis(valid, 2, lk, False), 2, geo.block_k)
        # document ids [N, L] -> blocks [n_blocks, N, block]; padded keys are invalid
        # (k_valid above) and padded query rows are cropped, so the pad id is moot
        self.q_seg = self.k_seg = None
        if q_seg is not None:
            self.q_seg = _to_blocks(pad_axis(q_seg.astype(jnp.int32), 1, lq), 1, geo.block_q)
            self.k_seg = _to_blocks(pad_axis(k_seg.astype(jnp.int32), 1, lk), 1, geo.block_k)

    def q_rows(self, x):
        """[N, L, H, ...] -> blocks [nq, N, Hkv, G, bq, ...] (for do, o, lse)."""
        n, length, h = x.shape[:3]
        x = x.reshape(n, length, h // self.group, self.group, *x.shape[3:])
        x = jnp.moveaxis(x, 1, 3)
        return _to_blocks(pad_axis(x, 3, self.geo.num_q * self.geo.block_q), 3,
                          self.geo.block_q)

    def from_q_rows(self, x):
        """Inverse of :meth:`q_rows`."""
        x = _from_blocks(x, 3, self.geo.len_q)
        x = jnp.moveaxis(x, 3, 1)
        return x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])

    def from_k_rows(self, x):
        """k/v blocks [nk, N, Hkv, bk, D] -> [N, Lk, Hkv, D]."""
        return _from_blocks(x, 2, self.geo.len_k).transpose(0, 2, 1, 3)

    def grads(self, dq_t, dk, dv, dtypes):
        """A backward's results out of blocks: dq^T (as :func:`~.block_math._backward_block`
        accumulates it) and dk, dv blocks -> dq, dk, dv, in ``dtypes``."""
        dq = self.from_q_rows(dq_from_transposed(dq_t, self.q.shape))
        return (dq.astype(dtypes[0]), self.from_k_rows(dk).astype(dtypes[1]),
                self.from_k_rows(dv).astype(dtypes[2]))


def _backward_inputs(q, k, v, do, lse, delta, kv_valid, q_seg, k_seg, geo: _Blocking,
                     scale: float, q_positions=None, k_positions=None):
    """A backward's operands in blocks: ``(prep, do_b, lse_b, delta_b, stats)``, the
    per-row ones (:meth:`_Prepared.q_rows`) in the statistics dtype ``stats``. Rows
    without keys have lse = -inf and all logits -inf: their lse becomes 0, so that
    exp(-inf - 0) = 0."""
    q, k, v, do = _matmul_inputs(q, k, v, do)
    prep = _Prepared(q, k, v, q_positions, k_positions, kv_valid, geo, scale, q_seg, k_seg)
    stats = softmax.stats_dtype(q.dtype)
    lse = jnp.where(jnp.isneginf(lse), 0.0, lse).astype(stats)
    return prep, prep.q_rows(do), prep.q_rows(lse), prep.q_rows(delta.astype(stats)), stats


def _matmul_inputs(*arrays):
    """Operands in a dtype the platform's matmuls accept.

    XLA:CPU has no half-precision dot with float32 accumulation, so on CPU bf16 and
    fp16 inputs are widened to float32 once, up front (exact; the math is then the
    float32 math on the rounded inputs). Other platforms keep the input dtype and
    accumulate in float32 through ``preferred_element_type``.
    """
    if jax.default_backend() != "cpu":
        return arrays
    return tuple(x.astype(softmax.stats_dtype(x.dtype)) for x in arrays)


def _indices(*starts):
    """Start indices of one dynamic slice, all int32 (Python ints are int64 under x64)."""
    return tuple(jnp.asarray(v, jnp.int32) for v in starts)


def _take(x, i):
    return None if x is None else jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
