"""Blockwise online-softmax attention in pure XLA (the ``"xla"`` backend).

Memory stays linear in sequence length in both passes: the forward holds one
block of logits ``[N, H, block_q, block_k]`` at a time and keeps only the output
and the log-sum-exp; the backward (a ``jax.custom_vjp``) recomputes the
probabilities block by block from the saved log-sum-exp instead of storing them.

Layout inside: ``[N, H_kv, G, L, D]`` with ``G = H / H_kv`` query heads per kv
head, so grouped-query attention never repeats keys or values.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated import softmax
from jax_dilated._vma import varying_like
from jax_dilated.backends.base import BlockLists, KernelArgs, any_pair_allowed

__all__ = ["forward", "backward", "attention", "ring_steps", "block_sparse_forward",
           "block_sparse_backward", "block_sparse_ring_steps", "DEFAULT_BLOCK_Q",
           "DEFAULT_BLOCK_K"]

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


def _pad_axis(x, axis: int, size: int, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


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
                 scale: float):
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
        self.q = _to_blocks(_pad_axis(qh, 3, lq), 3, geo.block_q)
        self.k = _to_blocks(_pad_axis(k.transpose(0, 2, 1, 3), 2, lk), 2, geo.block_k)
        self.v = _to_blocks(_pad_axis(v.transpose(0, 2, 1, 3), 2, lk), 2, geo.block_k)
        qp = jnp.arange(geo.len_q, dtype=jnp.int32) if q_positions is None else q_positions
        kp = jnp.arange(geo.len_k, dtype=jnp.int32) if k_positions is None else k_positions
        self.q_pos = _pad_axis(qp.astype(jnp.int32), 0, lq, _PAD_Q_POS).reshape(geo.num_q, -1)
        self.k_pos = _pad_axis(kp.astype(jnp.int32), 0, lk, _PAD_K_POS).reshape(geo.num_k, -1)
        if kv_valid is None and lk == geo.len_k:
            self.k_valid = None
        else:
            valid = jnp.ones((n, geo.len_k), bool) if kv_valid is None else kv_valid
            # [N, Lk] or [N, Lk, Hkv] -> [N, Hkv or 1, Lk]
            valid = valid[:, None, :] if valid.ndim == 2 else valid.transpose(0, 2, 1)
            self.k_valid = _to_blocks(_pad_axis(valid, 2, lk, False), 2, geo.block_k)

    def q_rows(self, x):
        """[N, L, H, ...] -> blocks [nq, N, Hkv, G, bq, ...] (for do, o, lse)."""
        n, length, h = x.shape[:3]
        x = x.reshape(n, length, h // self.group, self.group, *x.shape[3:])
        x = jnp.moveaxis(x, 1, 3)
        return _to_blocks(_pad_axis(x, 3, self.geo.num_q * self.geo.block_q), 3,
                          self.geo.block_q)

    def from_q_rows(self, x):
        """Inverse of :meth:`q_rows`."""
        x = _from_blocks(x, 3, self.geo.len_q)
        x = jnp.moveaxis(x, 3, 1)
        return x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])

    def from_k_rows(self, x):
        """k/v blocks [nk, N, Hkv, bk, D] -> [N, Lk, Hkv, D]."""
        return _from_blocks(x, 2, self.geo.len_k).transpose(0, 2, 1, 3)


def _block_mask(args: KernelArgs, q_pos, k_pos, k_valid):
    """Allowed (query, key) pairs of one block, broadcastable to [N, Hkv, G, bq, bk].

    Returns None when every pair is allowed.
    """
    mask = None
    if args.is_causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None, None]
    if k_valid is not None:
        valid = k_valid[:, :, None, None, :]
        mask = valid if mask is None else mask & valid
    return mask


def _block_mask_t(args: KernelArgs, q_pos, k_pos, k_valid):
    """:func:`_block_mask` in the transposed layout, broadcastable to [N, Hkv, bk, G, bq]."""
    mask = None
    if args.is_causal:
        mask = (k_pos[:, None] <= q_pos[None, :])[None, None, :, None, :]
    if k_valid is not None:
        valid = k_valid[:, :, :, None, None]
        mask = valid if mask is None else mask & valid
    return mask


def _maybe_cond(pred, compute, skip, operand):
    """``lax.cond`` that is skipped entirely when the predicate is statically True."""
    if pred is None:
        return compute(operand)
    return jax.lax.cond(pred, compute, skip, operand)


def _dropout_keep(args: KernelArgs, rng, i, j, shape, dtype):
    """Scaled keep mask ``z / (1 - rate)`` of block (i, j), or None without dropout.

    Derived from (rng, i, j) alone, so the backward regenerates the same mask.
    """
    if args.dropout_rate == 0.0:
        return None
    key = jax.random.fold_in(jax.random.fold_in(rng, i), j)
    keep = jax.random.bernoulli(key, 1.0 - args.dropout_rate, shape)
    return keep.astype(dtype) / jnp.asarray(1.0 - args.dropout_rate, dtype)


def _logits(q_blk, k_blk, post_scale: float, mask, stats):
    """Masked logits [N, Hkv, G, bq, bk] of one block (q already carries the pre-scale)."""
    s = jnp.einsum("nhgqd,nhkd->nhgqk", q_blk, k_blk, preferred_element_type=stats)
    if post_scale != 1.0:
        s = s * jnp.asarray(post_scale, stats)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return s


def _forward_block(state, q_blk, k_blk, v_blk, mask, keep, post_scale: float, stats):
    """Fold one (query block, key block) pair into the running softmax state.

    q_blk [N, Hkv, G, bq, D] (carrying the pre-scale), k_blk/v_blk [N, Hkv, bk, D];
    ``mask`` as :func:`_block_mask` gives it, ``keep`` the scaled dropout mask or None.
    """
    s = _logits(q_blk, k_blk, post_scale, mask, stats)

    def pv(p):
        if keep is not None:
            p = p * keep
        return jnp.einsum("nhgqk,nhkd->nhgqd", p.astype(v_blk.dtype), v_blk,
                          preferred_element_type=stats)

    return softmax.update_state(state, s, pv)[0]


def _backward_block(carry, q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, mask_t, keep,
                    post_scale: float, scale: float, stats):
    """Gradient contributions of one (query block, key block) pair.

    ``carry`` = (dk_acc, dv_acc) [N, Hkv, bk, D] gets this block's dk, dv added;
    also returns this block's dq, transposed: [N, Hkv, D, G, bq]. ``mask_t`` as
    :func:`_block_mask_t` gives it; ``keep`` the dropout mask [N, Hkv, G, bq, bk] or None.
    """
    # Transposed block [N, Hkv, bk, G, bq]: four of the five products are
    # then plain (non-transposed) matmuls, which XLA:CPU runs fastest.
    dk_acc, dv_acc = carry
    post = jnp.asarray(post_scale, stats)
    # The elementwise work runs on the logits as the matmuls lay them out,
    # [N Hkv, bk, G bq] (a free reshape): with the shapes equal, XLA computes each
    # step in place of the previous one and holds two logits blocks, not three.
    n, h, bk = k_blk.shape[:3]
    g, bq = q_blk.shape[2:4]
    flat, full = (n * h, bk, g * bq), (n, h, bk, g, bq)

    def rows(x):  # [N, Hkv, G, bq] -> [N Hkv, 1, G bq]
        return x.reshape(n * h, 1, g * bq)

    st = jnp.einsum("nhkd,nhgqd->nhkgq", k_blk, q_blk, preferred_element_type=stats)
    st = st.reshape(flat)
    if post_scale != 1.0:
        st = st * post
    if mask_t is not None:
        st = jnp.where(jnp.broadcast_to(mask_t, full).reshape(flat), st, -jnp.inf)
    pt = jnp.exp(st - rows(lse_blk))
    if keep is not None:
        keep = jnp.moveaxis(keep, -1, 2).reshape(flat)
    pz = pt if keep is None else pt * keep
    dv_acc = dv_acc + jnp.einsum("nhkgq,nhgqd->nhkd", pz.astype(do_blk.dtype).reshape(full),
                                 do_blk, preferred_element_type=stats)
    dpt = jnp.einsum("nhkd,nhgqd->nhkgq", v_blk, do_blk, preferred_element_type=stats)
    dpt = dpt.reshape(flat)
    if keep is not None:
        dpt = dpt * keep
    dst = (pt * (dpt - rows(delta_blk))).astype(q_blk.dtype).reshape(full)
    # q_blk carries the pre-scale, so only the post-scale is left for dk.
    dk_blk = jnp.einsum("nhkgq,nhgqd->nhkd", dst, q_blk, preferred_element_type=stats)
    if post_scale != 1.0:
        dk_blk = dk_blk * post
    dk_acc = dk_acc + dk_blk
    # dq^T = k^T ds^T keeps ds^T as a plain right operand; asking for dq
    # directly makes XLA:CPU transpose the whole block (the slowest step).
    dqt_blk = jnp.einsum("nhkd,nhkgq->nhdgq", k_blk, dst,
                         preferred_element_type=stats) * jnp.asarray(scale, stats)
    return (dk_acc, dv_acc), dqt_blk


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


def _forward_core(q, k, v, kv_valid, args: KernelArgs, *, q_positions=None,
                  k_positions=None, dropout_rng=None):
    """Blockwise forward of one batch chunk; arguments and results as in :func:`forward`."""
    out_dtype = q.dtype
    q, k, v = _matmul_inputs(q, k, v)
    geo = _blocking(q.shape[1], k.shape[1], args)
    prep = _Prepared(q, k, v, q_positions, k_positions, kv_valid, geo, args.scale)
    stats = softmax.stats_dtype(q.dtype)
    rows_shape = prep.q.shape[1:-1]  # [N, Hkv, G, bq]
    d = q.shape[-1]

    def q_block(_, xs):
        i, q_blk, q_pos = xs

        def k_block(state, ys):
            j, k_blk, v_blk, k_pos, k_valid = ys

            def compute(state):
                mask = _block_mask(args, q_pos, k_pos, k_valid)
                keep = _dropout_keep(args, dropout_rng, i, j,
                                     q_blk.shape[:-1] + (k_blk.shape[-2],), stats)
                return _forward_block(state, q_blk, k_blk, v_blk, mask, keep,
                                      prep.post_scale, stats)

            need = any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid)
            return _maybe_cond(need, compute, lambda st: st, state), None

        state = varying_like(softmax.init_state(rows_shape, d, stats), (q, k, v))
        ys = (jnp.arange(geo.num_k), prep.k, prep.v, prep.k_pos, prep.k_valid)
        state, _ = jax.lax.scan(k_block, state, ys)
        o, lse = softmax.finalize_state(state)
        return None, (o.astype(out_dtype), lse)

    xs = (jnp.arange(geo.num_q), prep.q, prep.q_pos)
    _, (o, lse) = jax.lax.scan(q_block, None, xs)
    return prep.from_q_rows(o), prep.from_q_rows(lse)


def _backward_core(q, k, v, do, lse, delta, kv_valid, args: KernelArgs, *,
                   q_positions=None, k_positions=None, dropout_rng=None):
    """Blockwise backward of one batch chunk; arguments and results as in :func:`backward`."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, do = _matmul_inputs(q, k, v, do)
    geo = _blocking(q.shape[1], k.shape[1], args)
    prep = _Prepared(q, k, v, q_positions, k_positions, kv_valid, geo, args.scale)
    stats = softmax.stats_dtype(q.dtype)
    do_b = prep.q_rows(do)
    # rows without keys have lse = -inf and all logits -inf: exp(-inf - 0) = 0.
    lse_b = prep.q_rows(jnp.where(jnp.isneginf(lse), 0.0, lse).astype(stats))
    delta_b = prep.q_rows(delta.astype(stats))

    def k_block(_, xs):
        j, k_blk, v_blk, k_pos, k_valid = xs

        def q_block(carry, ys):
            i, q_blk, do_blk, lse_blk, delta_blk, q_pos = ys

            def compute(carry):
                mask = _block_mask_t(args, q_pos, k_pos, k_valid)
                keep = _dropout_keep(args, dropout_rng, i, j,
                                     q_blk.shape[:-1] + (k_blk.shape[-2],), stats)
                return _backward_block(carry, q_blk, k_blk, v_blk, do_blk, lse_blk,
                                       delta_blk, mask, keep, prep.post_scale, args.scale,
                                       stats)

            def skip(carry):
                return carry, varying_like(jnp.zeros(dq_t_shape, stats), (q, k, v, do))

            need = any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid)
            return _maybe_cond(need, compute, skip, carry)

        n_, h_, g_, bq_, d_ = prep.q.shape[1:]
        dq_t_shape = (n_, h_, d_, g_, bq_)
        zeros_kv = varying_like(jnp.zeros(k_blk.shape, stats), (q, k, v, do))
        ys = (jnp.arange(geo.num_q), prep.q, do_b, lse_b, delta_b, prep.q_pos)
        (dk_blk, dv_blk), dq_parts = jax.lax.scan(q_block, (zeros_kv, zeros_kv), ys)
        return None, (dk_blk, dv_blk, dq_parts)

    def k_block_acc(dq_acc, xs):
        _, (dk_blk, dv_blk, dq_parts) = k_block(None, xs)
        return dq_acc + dq_parts, (dk_blk, dv_blk)

    nq, n_, h_, g_, bq_, d_ = prep.q.shape
    dq0 = varying_like(jnp.zeros((nq, n_, h_, d_, g_, bq_), stats), (q, k, v, do))
    xs = (jnp.arange(geo.num_k), prep.k, prep.v, prep.k_pos, prep.k_valid)
    dq_t, (dk, dv) = jax.lax.scan(k_block_acc, dq0, xs)
    dq = jnp.moveaxis(dq_t, 3, -1)
    return (prep.from_q_rows(dq).astype(dtypes[0]), prep.from_k_rows(dk).astype(dtypes[1]),
            prep.from_k_rows(dv).astype(dtypes[2]))


# Elements of one logits block [n, H, block_q, block_k] processed at once. The
# batch (segments x batch) is cut into chunks that keep a block near this size:
# blocks that fit in cache run the matmuls 2-3x faster on CPU than one huge block
# batched over every segment, and temp memory stops growing with the batch.
_BLOCK_ELEMENTS = 1 << 21


def _batch_chunk(n: int, q, k, args: KernelArgs) -> int:
    geo = _blocking(q.shape[1], k.shape[1], args)
    per_item = q.shape[2] * geo.block_q * geo.block_k
    return max(1, min(n, _BLOCK_ELEMENTS // per_item))


def _chunked(core, batched, shared, args, dropout_rng, chunk: int):
    """Run ``core`` over the leading (batch) axis of ``batched`` in chunks of ``chunk``.

    ``batched``: arrays (or None) with a leading batch axis; ``shared``: keyword
    arrays passed whole. Each chunk gets its own dropout key (fold_in of the chunk
    index), so forward and backward draw the same masks.
    """
    n = next(x for x in batched if x is not None).shape[0]
    if chunk >= n:
        return core(*batched, args, dropout_rng=dropout_rng, **shared)
    num = -(-n // chunk)

    def split(x):
        if x is None:
            return None
        x = jnp.pad(x, [(0, num * chunk - n)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num, chunk, *x.shape[1:])

    def one(xs):
        i, parts = xs
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        return core(*parts, args, dropout_rng=rng, **shared)

    outs = jax.lax.map(one, (jnp.arange(num), tuple(split(x) for x in batched)))
    return jax.tree.map(lambda y: y.reshape(num * chunk, *y.shape[2:])[:n], outs)


def forward(q, k, v, args: KernelArgs, *, q_positions=None, k_positions=None,
            kv_valid=None, dropout_rng=None):
    """Blockwise attention forward.

    Args:
      q: [N, Lq, H, D]; k, v: [N, Lk, Hkv, D] with ``H % Hkv == 0``.
      args: static kernel arguments (scale, causality, dropout, block sizes).
      q_positions: [Lq] int positions of the queries (for causality; default arange).
      k_positions: [Lk] int positions of the keys (default arange).
      kv_valid: [N, Lk] or [N, Lk, Hkv] bool, False = key may not be attended to.
      dropout_rng: PRNG key, needed when ``args.dropout_rate > 0``.

    Returns:
      ``o`` [N, Lq, H, D] in q's dtype and ``lse`` [N, Lq, H] in the stats dtype
      (float32, or float64 for float64 inputs); ``o = 0``, ``lse = -inf`` for rows
      with no allowed key.
    """
    chunk = _batch_chunk(q.shape[0], q, k, args)
    return _chunked(_forward_core, (q, k, v, kv_valid),
                    dict(q_positions=q_positions, k_positions=k_positions), args,
                    dropout_rng, chunk)


def backward(q, k, v, do, lse, delta, args: KernelArgs, *, q_positions=None,
             k_positions=None, kv_valid=None, dropout_rng=None):
    """Blockwise attention backward from saved statistics.

    With ``p = exp(scale q.k - lse)`` (dropout mask ``z`` applied to ``p`` in
    the output only) the gradients are ``dv = (p z)^T do``, ``dp = z (do v^T)``,
    ``ds = p (dp - delta)``, ``dq = scale ds k``, ``dk = scale ds^T q``.

    ``lse`` and ``delta`` may be *global* statistics (over more keys than this call
    sees), which is how a ring or a branch merge differentiates through a
    partial: ``delta = rowsum(do * o) - dlse`` with the global ``o``.

    Args:
      q, k, v, q_positions, k_positions, kv_valid, dropout_rng: as in :func:`forward`.
      do: [N, Lq, H, D] output cotangent.
      lse: [N, Lq, H] log-sum-exp (stats dtype, ``-inf`` for rows without keys).
      delta: [N, Lq, H] as above (stats dtype).

    Returns:
      ``dq`` [N, Lq, H, D], ``dk``/``dv`` [N, Lk, Hkv, D], in the input dtypes.
    """
    chunk = _batch_chunk(q.shape[0], q, k, args)
    return _chunked(_backward_core, (q, k, v, do, lse, delta, kv_valid),
                    dict(q_positions=q_positions, k_positions=k_positions), args,
                    dropout_rng, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, args, q_positions, k_positions, kv_valid, dropout_rng):
    return forward(q, k, v, args, q_positions=q_positions, k_positions=k_positions,
                   kv_valid=kv_valid, dropout_rng=dropout_rng)


def _attention_fwd(q, k, v, args, q_positions, k_positions, kv_valid, dropout_rng):
    o, lse = _attention(q, k, v, args, q_positions, k_positions, kv_valid, dropout_rng)
    return (o, lse), (q, k, v, o, lse, q_positions, k_positions, kv_valid, dropout_rng)


def _attention_bwd(args, res, cotangents):
    q, k, v, o, lse, q_positions, k_positions, kv_valid, dropout_rng = res
    do, dlse = cotangents
    stats = softmax.stats_dtype(q.dtype)
    # d lse / d s = p, so an lse cotangent enters exactly like -delta.
    delta = softmax.row_dot(do.astype(stats), o.astype(stats)) - dlse.astype(stats)
    dq, dk, dv = backward(q, k, v, do, lse, delta, args, q_positions=q_positions,
                          k_positions=k_positions, kv_valid=kv_valid,
                          dropout_rng=dropout_rng)
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, args: KernelArgs, *, q_positions=None, k_positions=None,
              kv_valid=None, dropout_rng=None):
    """Differentiable blockwise attention: :func:`forward` with a recomputing VJP.

    Gradients flow to q, k, v from both outputs, ``o`` and ``lse``.
    """
    return _attention(q, k, v, args, q_positions, k_positions, kv_valid, dropout_rng)


# ------------------------------------------------------------------- ring steps


class _RingSteps:
    """The optional ring entry points (see :mod:`.base`) for one geometry.

    Keys and values travel in the kernel's blocked layout ``[nk, N, Hkv, bk, D]``
    (converted once per ring by :meth:`pack_kv`), and every step folds its block
    into accumulators carried through the ring and updated in place: the running
    ``(o, lse)`` in the forward, ``dq`` and the blocked ``dk``/``dv`` in the
    backward. Query-side arrays stay in the caller's ``[N, L, H, ...]`` layout and
    are cut into blocks one query block at a time, so no shard-sized copy of
    ``q``, ``do``, ``o`` or ``dq`` is made per step.

    With ``blocks=`` (a :class:`~.base.BlockLists`) a step visits only the listed key
    blocks of each query block (block-sparse attention over a ring); the backward,
    query blocks outermost, needs only the row lists.

    Heads are visited in groups of ``heads`` kv heads (with their query heads): the
    work item is (query block, head group), so the logits and the per-block
    temporaries cover one group, not every head. Heads are independent, so this
    changes nothing in the result; it bounds what a step holds besides the shard-sized
    buffers, which is what a ring at many devices is left with (see
    :func:`_ring_head_group`).
    """

    def __init__(self, geo: _Blocking, group: int, kv_heads: int, heads: int,
                 args: KernelArgs):
        self.geo, self.group, self.heads, self.args = geo, group, heads, args
        self.num_groups = kv_heads // heads

    # [N, bq, H, ...] <-> [N, Hkv, G, bq, ...]
    def _rows(self, x):
        n, bq, h = x.shape[:3]
        x = x.reshape(n, bq, h // self.group, self.group, *x.shape[3:])
        return jnp.moveaxis(x, 1, 3)

    def _unrows(self, x):
        x = jnp.moveaxis(x, 3, 1)
        return x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])

    def _start(self, x, i, h):
        # rows of query block i, query heads of head group h: x [N, L, H, ...]
        hq = self.heads * self.group
        return _indices(0, i * self.geo.block_q, h * hq, *(0,) * (x.ndim - 3))

    def _slice(self, x, i, h):
        sizes = (x.shape[0], self.geo.block_q, self.heads * self.group) + x.shape[3:]
        return jax.lax.dynamic_slice(x, self._start(x, i, h), sizes)

    def _put(self, x, blk, i, h):
        return jax.lax.dynamic_update_slice(x, blk.astype(x.dtype), self._start(x, i, h))

    def _kv(self, x, j, h):
        """Key block j of head group h from blocked [nk, N, Hkv | 1, bk, ...] (a
        broadcast head axis of size 1 is not cut)."""
        if x is None:
            return None
        cut = x.shape[2] > 1
        start = _indices(j, 0, h * self.heads if cut else 0, *(0,) * (x.ndim - 3))
        size = (1, x.shape[1], self.heads if cut else 1) + x.shape[3:]
        return jax.lax.dynamic_slice(x, start, size)[0]

    def _put_kv(self, x, blk, j, h):
        start = _indices(j, 0, h * self.heads, *(0,) * (x.ndim - 3))
        return jax.lax.dynamic_update_slice(x, blk[None].astype(x.dtype), start)

    def _items(self, blocks):
        """Scan operands of the work items (query block i, head group h), i outermost:
        (i, h, the key blocks the item visits, which of them are real)."""
        rows, rows_ok = self._rows_of(blocks)
        nh = self.num_groups
        items = np.arange(self.geo.num_q * nh)
        i, h = items // nh, items % nh
        take = (lambda x: None if x is None else x[i]) if nh > 1 else (lambda x: x)
        return (jnp.asarray(i, jnp.int32), jnp.asarray(h, jnp.int32), take(rows),
                take(rows_ok))

    def _q_block(self, q, i, h):
        """Query block i of head group h, pre-scaled, [N, heads, G, bq, D] (as
        :class:`_Prepared` makes it)."""
        (q_blk,) = _matmul_inputs(self._slice(q, i, h))
        stats = softmax.stats_dtype(q_blk.dtype)
        if jnp.dtype(q_blk.dtype) == stats:
            q_blk = q_blk * jnp.asarray(self.args.scale, q_blk.dtype)
        return self._rows(q_blk)

    def _keys(self, q, k_positions, kv_valid):
        """Blocked key positions [nk, bk], validity [nk, N, Hkv|1, bk] or None, post-scale."""
        geo = self.geo
        kp = (jnp.arange(geo.len_k, dtype=jnp.int32) if k_positions is None
              else k_positions.astype(jnp.int32))
        k_pos = kp.reshape(geo.num_k, geo.block_k)
        k_valid = None
        if kv_valid is not None:
            valid = kv_valid[:, None, :] if kv_valid.ndim == 2 else kv_valid.transpose(0, 2, 1)
            k_valid = _to_blocks(valid, 2, geo.block_k)
        # the scale is folded into q blocks of the stats dtype (see _q_block)
        wide = jax.default_backend() == "cpu" or softmax.stats_dtype(q.dtype) == q.dtype
        return k_pos, k_valid, 1.0 if wide else self.args.scale

    def _q_pos(self, q_positions):
        geo = self.geo
        qp = (jnp.arange(geo.len_q, dtype=jnp.int32) if q_positions is None
              else q_positions.astype(jnp.int32))
        return qp.reshape(geo.num_q, geo.block_q)

    def pack_kv(self, k, v):
        # in the input dtype: blocks travel at their own size (widened, on CPU, one
        # block at a time as they are used)
        bk = self.geo.block_k
        return (_to_blocks(k.transpose(0, 2, 1, 3), 2, bk),
                _to_blocks(v.transpose(0, 2, 1, 3), 2, bk))

    def unpack_kv(self, kv):
        return tuple(_from_blocks(x, 2, self.geo.len_k).transpose(0, 2, 1, 3) for x in kv)

    def _rows_of(self, blocks):
        """Key blocks each query block visits: (rows [nq, L], rows_ok or None).

        Without ``blocks`` every key block, in order.
        """
        geo = self.geo
        if blocks is None:
            return np.broadcast_to(np.arange(geo.num_k, dtype=np.int32),
                                   (geo.num_q, geo.num_k)), None
        if self.args.dropout_rate:
            raise ValueError("block-sparse kernels do not implement dropout.")
        if blocks.rows.shape[0] != geo.num_q:
            raise ValueError(
                f"block lists for {blocks.rows.shape[0]} query blocks do not fit "
                f"{geo.num_q} query blocks of {geo.block_q}.")
        ok = None if blocks.rows_ok is None else jnp.asarray(blocks.rows_ok, bool)
        return jnp.asarray(blocks.rows, jnp.int32), ok

    def forward(self, q, kv, o, lse, *, q_positions=None, k_positions=None, kv_valid=None,
                dropout_rng=None, blocks=None):
        args = self.args
        k_b, v_b = kv
        stats = o.dtype
        q_pos_b = self._q_pos(q_positions)
        k_pos_b, k_valid_b, post_scale = self._keys(q, k_positions, kv_valid)

        def q_block(carry, xs):
            o, lse = carry
            i, h, row, row_ok = xs
            q_blk = self._q_block(q, i, h)
            q_pos = q_pos_b[i]
            m = self._rows(self._slice(lse, i, h))
            # the normalised partial (o, lse) as a running state: m = lse, l = 1
            state = softmax.RunningState(
                m, jnp.where(jnp.isneginf(m), 0.0, 1.0).astype(stats),
                self._rows(self._slice(o, i, h)))

            def k_block(state, ys):
                j, ok = ys
                k_pos, k_valid = _take(k_pos_b, j), self._kv(k_valid_b, j, h)

                def compute(state):
                    # read inside the branch: a skipped block reads nothing
                    k_blk, v_blk = _matmul_inputs(self._kv(k_b, j, h), self._kv(v_b, j, h))
                    mask = _block_mask(args, q_pos, k_pos, k_valid)
                    keep = _dropout_keep(args, dropout_rng, i, j,
                                         q_blk.shape[:-1] + (k_blk.shape[-2],), stats)
                    return _forward_block(state, q_blk, k_blk, v_blk, mask, keep,
                                          post_scale, stats)

                need = _listed(ok, any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid))
                return _maybe_cond(need, compute, lambda st: st, state), None

            state, _ = jax.lax.scan(k_block, state, (row, row_ok))
            o_blk, lse_blk = softmax.finalize_state(state)
            return (self._put(o, self._unrows(o_blk), i, h),
                    self._put(lse, self._unrows(lse_blk), i, h)), None

        (o, lse), _ = jax.lax.scan(q_block, (o, lse), self._items(blocks))
        return o, lse

    def backward(self, q, kv, do, lse, delta, dq, dkv, *, q_positions=None,
                 k_positions=None, kv_valid=None, dropout_rng=None, blocks=None):
        args = self.args
        k_b, v_b = kv
        stats = dq.dtype
        q_pos_b = self._q_pos(q_positions)
        k_pos_b, k_valid_b, post_scale = self._keys(q, k_positions, kv_valid)

        def q_block(carry, xs):
            dq, (dk_b, dv_b) = carry
            i, h, row, row_ok = xs
            q_blk = self._q_block(q, i, h)
            (do_blk,) = _matmul_inputs(self._slice(do, i, h))
            do_blk = self._rows(do_blk)
            lse_i = self._slice(lse, i, h).astype(stats)
            # rows without keys have lse = -inf and all logits -inf: exp(-inf - 0) = 0.
            lse_blk = self._rows(jnp.where(jnp.isneginf(lse_i), 0.0, lse_i))
            delta_blk = self._rows(self._slice(delta, i, h).astype(stats))
            q_pos = q_pos_b[i]
            # dq of this block, transposed as _backward_block gives it: [N, heads, D, G, bq]
            dqt = jnp.moveaxis(self._rows(self._slice(dq, i, h)), -1, 2)

            def k_block(carry, ys):
                j, ok = ys
                k_pos, k_valid = _take(k_pos_b, j), self._kv(k_valid_b, j, h)

                def compute(carry):
                    dqt, dk_b, dv_b = carry
                    k_blk, v_blk = _matmul_inputs(self._kv(k_b, j, h), self._kv(v_b, j, h))
                    mask = _block_mask_t(args, q_pos, k_pos, k_valid)
                    keep = _dropout_keep(args, dropout_rng, i, j,
                                         q_blk.shape[:-1] + (k_blk.shape[-2],), stats)
                    (dk_j, dv_j), dqt_blk = _backward_block(
                        (self._kv(dk_b, j, h), self._kv(dv_b, j, h)), q_blk, k_blk, v_blk,
                        do_blk, lse_blk, delta_blk, mask, keep, post_scale, args.scale, stats)
                    return (dqt + dqt_blk, self._put_kv(dk_b, dk_j, j, h),
                            self._put_kv(dv_b, dv_j, j, h))

                # the real entries of a row are distinct key blocks; padding is skipped
                need = _listed(ok, any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid))
                return _maybe_cond(need, compute, lambda c: c, carry), None

            (dqt, dk_b, dv_b), _ = jax.lax.scan(k_block, (dqt, dk_b, dv_b), (row, row_ok))
            dq = self._put(dq, self._unrows(jnp.moveaxis(dqt, 2, -1)), i, h)
            return (dq, (dk_b, dv_b)), None

        (dq, dkv), _ = jax.lax.scan(q_block, (dq, tuple(dkv)), self._items(blocks))
        return dq, dkv


def ring_steps(q, k, args: KernelArgs):
    """The ring entry points for queries like ``q`` and keys like ``k`` (see :mod:`.base`).

    None (the ring then uses :func:`forward` / :func:`backward`) when the lengths
    are not whole blocks or the batch would be cut into chunks.
    """
    geo = _blocking(q.shape[1], k.shape[1], args)
    if (geo.num_q * geo.block_q != geo.len_q or geo.num_k * geo.block_k != geo.len_k
            or _batch_chunk(q.shape[0], q, k, args) < q.shape[0]):
        return None
    group, kv_heads = q.shape[2] // k.shape[2], k.shape[2]
    return _RingSteps(geo, group, kv_heads, _ring_head_group(q.shape[0], kv_heads, group,
                                                             geo, args), args)


# logits elements of one ring step's block (one head group) on CPU: 1 MiB in float32
_RING_BLOCK_ELEMENTS = 1 << 18


def _ring_block_budget() -> int:
    """Logits elements one ring step's block may hold (see :func:`_ring_head_group`)."""
    return _RING_BLOCK_ELEMENTS if jax.default_backend() == "cpu" else _BLOCK_ELEMENTS


def _ring_head_group(batch: int, kv_heads: int, group: int, geo: _Blocking,
                     args: KernelArgs) -> int:
    """kv heads per head group of the ring steps: the most that keep a logits block
    within the budget (at least one), a divisor of ``kv_heads``.

    A ring at P devices holds a few shard-sized buffers, which shrink as 1/P, and
    per-step temporaries (logits, query/key blocks), which do not: with every head at
    once the latter were a third of the per-device memory at P = 8 (n = 32768, 8
    heads). Looping over heads keeps the matmul shapes (heads are a batch axis of
    them), so on CPU it costs only loop overhead (measured: no slower). Elsewhere the
    budget is the kernel's usual block size (``_BLOCK_ELEMENTS``): on a GPU one head
    of a 512 x 512 block is too little work per loop step to keep the device busy
    (not measured yet). With dropout every head stays in one group: the keep masks
    are drawn per (query block, key block) over all heads.
    """
    if args.dropout_rate:
        return kv_heads
    per_head = batch * group * geo.block_q * geo.block_k
    fits = [d for d in range(1, kv_heads + 1)
            if kv_heads % d == 0 and d * per_head <= _ring_block_budget()]
    return max(fits, default=1)


def block_sparse_ring_steps(q, k, args: KernelArgs):
    """Ring steps (as :func:`ring_steps`) whose ``forward``/``backward`` take
    ``blocks=`` lists in blocks of exactly ``args.block_q`` x ``args.block_k``;
    None where the shapes do not allow them."""
    steps = ring_steps(q, k, args)
    if steps is None or (steps.geo.block_q, steps.geo.block_k) != (args.block_q, args.block_k):
        return None
    return steps


# ----------------------------------------------------------------- block-sparse


def _sparse_blocking(len_q: int, len_k: int, args: KernelArgs, blocks: BlockLists) -> _Blocking:
    """Exact block geometry of a block-sparse call, checked against the lists."""
    if not args.block_q or not args.block_k:
        raise ValueError(f"block-sparse kernels need block_q and block_k, got {args}.")
    if args.dropout_rate:
        raise ValueError("block-sparse kernels do not implement dropout.")
    geo = _Blocking(len_q, len_k, args.block_q, args.block_k)
    if blocks.rows.shape[0] != geo.num_q or blocks.cols.shape[0] != geo.num_k:
        raise ValueError(
            f"block lists for {blocks.rows.shape[0]} query blocks and "
            f"{blocks.cols.shape[0]} key blocks do not fit lengths ({len_q}, {len_k}) in "
            f"blocks of ({args.block_q}, {args.block_k}): expected ({geo.num_q}, "
            f"{geo.num_k})."
        )
    return geo


def _listed(ok, need):
    """Skip predicate of one list entry: real (``ok``) and not masked out (``need``)."""
    if ok is None:
        return need
    return ok if need is None else ok & need


def _indices(*starts):
    """Start indices of one dynamic slice, all int32 (Python ints are int64 under x64)."""
    return tuple(jnp.asarray(v, jnp.int32) for v in starts)


def _take(x, i):
    return None if x is None else jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _sparse_forward_core(q, k, v, kv_valid, args: KernelArgs, *, blocks: BlockLists,
                         q_positions=None, k_positions=None, dropout_rng=None):
    del dropout_rng
    out_dtype = q.dtype
    q, k, v = _matmul_inputs(q, k, v)
    geo = _sparse_blocking(q.shape[1], k.shape[1], args, blocks)
    prep = _Prepared(q, k, v, q_positions, k_positions, kv_valid, geo, args.scale)
    stats = softmax.stats_dtype(q.dtype)
    rows_shape = prep.q.shape[1:-1]  # [N, Hkv, G, bq]
    d = q.shape[-1]
    rows = jnp.asarray(blocks.rows, jnp.int32)
    rows_ok = None if blocks.rows_ok is None else jnp.asarray(blocks.rows_ok, bool)

    def q_block(_, xs):
        q_blk, q_pos, row, row_ok = xs

        def k_step(state, ys):
            j, ok = ys

            def compute(state):
                # gathered inside the branch: a skipped entry reads nothing
                k_valid = _take(prep.k_valid, j)
                mask = _block_mask(args, q_pos, _take(prep.k_pos, j), k_valid)
                return _forward_block(state, q_blk, _take(prep.k, j), _take(prep.v, j),
                                      mask, None, prep.post_scale, stats)

            need = _listed(ok, any_pair_allowed(args.is_causal, q_pos, _take(prep.k_pos, j),
                                                _take(prep.k_valid, j)))
            return _maybe_cond(need, compute, lambda st: st, state), None

        state = varying_like(softmax.init_state(rows_shape, d, stats), (q, k, v, row))
        state, _ = jax.lax.scan(k_step, state, (row, row_ok))
        o, lse = softmax.finalize_state(state)
        return None, (o.astype(out_dtype), lse)

    _, (o, lse) = jax.lax.scan(q_block, None, (prep.q, prep.q_pos, rows, rows_ok))
    return prep.from_q_rows(o), prep.from_q_rows(lse)


def _sparse_backward_core(q, k, v, do, lse, delta, kv_valid, args: KernelArgs, *,
                          blocks: BlockLists, q_positions=None, k_positions=None,
                          dropout_rng=None):
    del dropout_rng
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, do = _matmul_inputs(q, k, v, do)
    geo = _sparse_blocking(q.shape[1], k.shape[1], args, blocks)
    prep = _Prepared(q, k, v, q_positions, k_positions, kv_valid, geo, args.scale)
    stats = softmax.stats_dtype(q.dtype)
    do_b = prep.q_rows(do)
    lse_b = prep.q_rows(jnp.where(jnp.isneginf(lse), 0.0, lse).astype(stats))
    delta_b = prep.q_rows(delta.astype(stats))
    cols = jnp.asarray(blocks.cols, jnp.int32)
    cols_ok = None if blocks.cols_ok is None else jnp.asarray(blocks.cols_ok, bool)
    nq, n_, h_, g_, bq_, d_ = prep.q.shape
    dq_t_shape = (n_, h_, d_, g_, bq_)
    like = (q, k, v, do, cols)

    def k_block(dq_acc, xs):
        k_blk, v_blk, k_pos, k_valid, col, col_ok = xs

        def q_step(carry, ys):
            i, ok = ys
            q_pos = _take(prep.q_pos, i)

            def compute(carry):
                mask = _block_mask_t(args, q_pos, k_pos, k_valid)
                return _backward_block(carry, _take(prep.q, i), k_blk, v_blk,
                                       _take(do_b, i), _take(lse_b, i), _take(delta_b, i),
                                       mask, None, prep.post_scale, args.scale, stats)

            def skip(carry):
                return carry, varying_like(jnp.zeros(dq_t_shape, stats), like)

            need = _listed(ok, any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid))
            return _maybe_cond(need, compute, skip, carry)

        zeros_kv = varying_like(jnp.zeros(k_blk.shape, stats), like)
        (dk_blk, dv_blk), dq_parts = jax.lax.scan(q_step, (zeros_kv, zeros_kv), (col, col_ok))
        # padding entries added zeros; real entries of one column are distinct blocks
        return dq_acc.at[col].add(dq_parts), (dk_blk, dv_blk)

    dq0 = varying_like(jnp.zeros((nq, n_, h_, d_, g_, bq_), stats), like)
    xs = (prep.k, prep.v, prep.k_pos, prep.k_valid, cols, cols_ok)
    dq_t, (dk, dv) = jax.lax.scan(k_block, dq0, xs)
    dq = jnp.moveaxis(dq_t, 3, -1)
    return (prep.from_q_rows(dq).astype(dtypes[0]), prep.from_k_rows(dk).astype(dtypes[1]),
            prep.from_k_rows(dv).astype(dtypes[2]))


def block_sparse_forward(q, k, v, args: KernelArgs, *, blocks: BlockLists, q_positions=None,
                         k_positions=None, kv_valid=None):
    """Attention over the listed blocks only (see :class:`~.base.BlockLists`).

    Arguments and results as in :func:`forward`; ``args.block_q``/``block_k`` are the
    exact block sizes the lists refer to. Query block ``i`` attends, with one softmax,
    to the keys of blocks ``blocks.rows[i]`` (entries with ``rows_ok`` False
    skipped); the cost is proportional to the number of listed blocks.
    """
    chunk = _batch_chunk(q.shape[0], q, k, args)
    return _chunked(_sparse_forward_core, (q, k, v, kv_valid),
                    dict(q_positions=q_positions, k_positions=k_positions, blocks=blocks),
                    args, None, chunk)


def block_sparse_backward(q, k, v, do, lse, delta, args: KernelArgs, *, blocks: BlockLists,
                          q_positions=None, k_positions=None, kv_valid=None):
    """Backward of :func:`block_sparse_forward` (as :func:`backward`; ``lse``/``delta``
    may be global statistics). dk/dv loop over ``blocks.cols``, the transposed lists."""
    chunk = _batch_chunk(q.shape[0], q, k, args)
    return _chunked(_sparse_backward_core, (q, k, v, do, lse, delta, kv_valid),
                    dict(q_positions=q_positions, k_positions=k_positions, blocks=blocks),
                    args, None, chunk)
