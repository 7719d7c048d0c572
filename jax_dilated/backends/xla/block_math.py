"""What the XLA kernel computes for one (query block, key block) pair: masks,
logits, dropout keep masks, the forward fold into the running softmax and the
backward's gradient contributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dilated.backends.base import KernelArgs
from jax_dilated.core import softmax


def _block_mask(args: KernelArgs, q_pos, k_pos, k_valid, q_seg=None, k_seg=None):
    """Allowed (query, key) pairs of one block, broadcastable to [N, Hkv, G, bq, bk].

    ``q_seg`` [N, bq] / ``k_seg`` [N, bk]: document ids (a pair is allowed only
    within one document), or None. Returns None when every pair is allowed.
    """
    mask = None
    if args.is_causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None, None]
    if k_valid is not None:
        valid = k_valid[:, :, None, None, :]
        mask = valid if mask is None else mask & valid
    if q_seg is not None:
        same = (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
        mask = same if mask is None else mask & same
    if args.window is not None:
        near = _in_window(args.window, q_pos[:, None], k_pos[None, :])[None, None, None]
        mask = near if mask is None else mask & near
    return mask


def _in_window(window, q_pos, k_pos):
    """``q_pos - left <= k_pos <= q_pos + right`` (broadcasting int32 positions;
    :data:`~jax_dilated.backends.base.WINDOW_CAP` keeps the sums inside int32)."""
    left, right = window
    return (k_pos >= q_pos - left) & (k_pos <= q_pos + right)


def _block_mask_t(args: KernelArgs, q_pos, k_pos, k_valid, q_seg=None, k_seg=None):
    """:func:`_block_mask` in the transposed layout, broadcastable to [N, Hkv, bk, G, bq]."""
    mask = None
    if args.is_causal:
        mask = (k_pos[:, None] <= q_pos[None, :])[None, None, :, None, :]
    if k_valid is not None:
        valid = k_valid[:, :, :, None, None]
        mask = valid if mask is None else mask & valid
    if q_seg is not None:
        same = (k_seg[:, :, None] == q_seg[:, None, :])[:, None, :, None, :]
        mask = same if mask is None else mask & same
    if args.window is not None:
        near = _in_window(args.window, q_pos[None, :], k_pos[:, None])[None, None, :, None, :]
        mask = near if mask is None else mask & near
    return mask


def _dropout_keep(args: KernelArgs, rng, i, j, shape, dtype):
    """Scaled keep mask ``z / (1 - rate)`` of block (i, j), or None without dropout.

    Derived from (rng, i, j) alone, so the backward regenerates the same mask.
    """
    if args.dropout_rate == 0.0:
        return None
    key = jax.random.fold_in(jax.random.fold_in(rng, i), j)
    keep = jax.random.bernoulli(key, 1.0 - args.dropout_rate, shape)
    return keep.astype(dtype) / jnp.asarray(1.0 - args.dropout_rate, dtype)


def soft_cap_slope(x):
    """``d tanh(x)/dx = sech^2(x)``, as ``4 e / (1 + e)^2`` with ``e = exp(-2|x|)``.

    ``1 - tanh(x)^2`` cancels where tanh saturates: its relative error grows like
    ``eps e^{2|x|}`` (in float32 past 1e-5 from ``|x|`` about 3, 1e-3 at 5, and 0
    past about 9, tanh having rounded to 1; how badly, below that, depends on the
    CPU's tanh). This form keeps a few ulps of relative accuracy at every ``x``.
    """
    e = jnp.exp(-2.0 * jnp.abs(x))
    return 4.0 * e / jnp.square(1.0 + e)


def _soft_cap(s, cap, slope: bool = False):
    """Soft-capped logits ``cap tanh(s / cap)`` and, with ``slope``, the backward's
    ``d(capped)/ds = sech^2(s / cap)`` (:func:`soft_cap_slope`; else None);
    ``(s, None)`` without a cap."""
    if cap is None:
        return s, None
    x = s * jnp.asarray(1.0 / cap, s.dtype)
    return jnp.tanh(x) * jnp.asarray(cap, s.dtype), soft_cap_slope(x) if slope else None


def _logits(q_blk, k_blk, post_scale: float, stats, cap=None):
    """Logits [B, bq, bk] of one block, soft-capped by ``cap`` (q_blk [B, bq, D]
    already carries the pre-scale; k_blk [B, bk, D])."""
    s = jnp.einsum("bqd,bkd->bqk", q_blk, k_blk, preferred_element_type=stats)
    if post_scale != 1.0:
        s = s * jnp.asarray(post_scale, stats)
    return _soft_cap(s, cap)[0]


def flat_shape(rows_shape):
    """Rows (N, Hkv, G, bq) as the forward's running state holds them: (N Hkv, G bq)."""
    n, h, g, bq = rows_shape
    return (n * h, g * bq)


def flat_rows(x, rows_shape):
    """``x`` [N, Hkv, G, bq, ...] -> [N Hkv, G bq, ...] (:func:`flat_shape`)."""
    return x.reshape(*flat_shape(rows_shape), *x.shape[4:])


def unflat_rows(x, rows_shape):
    """Inverse of :func:`flat_rows`."""
    return x.reshape(*rows_shape, *x.shape[2:])


def flat_keys(k_blk):
    """Key block [N, Hkv, bk, D] -> [N Hkv, bk, D], as the block's products take it
    (and the backward's dk/dv accumulators hold it)."""
    n, h, bk, d = k_blk.shape
    return k_blk.reshape(n * h, bk, d)


def _forward_block(state, q_blk, k_blk, v_blk, mask, keep, post_scale: float, stats,
                   cap=None):
    """Fold one (query block, key block) pair into the running softmax state.

    q_blk [N, Hkv, G, bq, D] (carrying the pre-scale), k_blk/v_blk [N, Hkv, bk, D];
    ``state`` over the flat rows [N Hkv, G bq] (:func:`flat_shape`); ``mask`` as
    :func:`_block_mask` gives it, ``keep`` the scaled dropout mask or None, ``cap``
    the logit soft-cap or None.
    """
    n, h, g, bq, d = q_blk.shape
    bk = k_blk.shape[-2]
    flat = (n * h, g * bq, bk)
    # The block's work runs on three-axis operands [N Hkv, rows, D]: with the size-1
    # axes of the five-axis layout (one item per chunk, no GQA) XLA:CPU transposes
    # k and copies the logits into another layout in every step, two copies per
    # block that flat operands do not need (docs/benchmarks_history.md, "Degenerate
    # axes and a slow matmul path").
    kf, vf = flat_keys(k_blk), flat_keys(v_blk)
    s = _logits(q_blk.reshape(n * h, g * bq, d), kf, post_scale, stats, cap)
    if mask is not None:
        s = jnp.where(jnp.broadcast_to(mask, (n, h, g, bq, bk)).reshape(flat), s, -jnp.inf)

    def pv(p):
        if keep is not None:
            p = p * keep.reshape(flat)
        return jnp.einsum("bqk,bkd->bqd", p.astype(vf.dtype), vf,
                          preferred_element_type=stats)

    return softmax.update_state(state, s, pv)[0]


def keys_transposed(k_blk):
    """Key block [N, Hkv, bk, D] -> [N Hkv, D, bk], the operand of the backward's dq.

    Callers whose loop over query blocks runs inside one key block make it once,
    before that loop: given ``k`` itself, XLA:CPU folds the transpose into that
    matmul and runs it on a slower path (Eigen rather than YNNPACK) that also stalls
    the steps around it (docs/benchmarks_history.md, "Degenerate axes and a slow
    matmul path").
    """
    return jnp.swapaxes(flat_keys(k_blk), 1, 2)


def transposed_dq_shape(q_blocks_shape):
    """Shape of one block's dq^T as :func:`_backward_block` gives it, [N Hkv, D, G bq],
    from the blocked q's [nq, N, Hkv, G, bq, D] (or one block's [N, Hkv, G, bq, D])."""
    n, h, g, bq, d = q_blocks_shape[-5:]
    return (n * h, d, g * bq)


def dq_to_transposed(dq_rows):
    """One block's dq rows [N, Hkv, G, bq, D] -> dq^T [N Hkv, D, G bq] (the layout
    :func:`_backward_block` accumulates into)."""
    return jnp.swapaxes(flat_rows(dq_rows, dq_rows.shape[:4]), 1, 2)


def dq_from_transposed(dq_t, shape):
    """dq^T [..., N Hkv, D, G bq] (as :func:`_backward_block` gives it) -> ``shape``
    [..., N, Hkv, G, bq, D] (one block's q rows, or the blocked q's)."""
    return jnp.swapaxes(dq_t, -1, -2).reshape(shape)


def _backward_block(carry, q_blk, k_blk, k_t, v_blk, do_blk, lse_blk, delta_blk, mask_t,
                    keep, post_scale: float, scale: float, stats, cap=None):
    """Gradient contributions of one (query block, key block) pair.

    q_blk/do_blk [N, Hkv, G, bq, D], k_blk/v_blk [N, Hkv, bk, D], ``k_t`` =
    :func:`keys_transposed` of k_blk; ``carry`` = (dk_acc, dv_acc) [N Hkv, bk, D]
    (:func:`flat_keys`) gets this block's dk, dv added; also returns this block's
    dq, transposed: [N Hkv, D, G bq]. ``mask_t`` as :func:`_block_mask_t` gives it;
    ``keep`` the dropout mask [N, Hkv, G, bq, bk] or None; ``cap`` the logit
    soft-cap or None (the gradient of the capped logits is multiplied by
    ``sech^2(s / cap)``, :func:`soft_cap_slope`).
    """
    # Every product runs on three-axis operands [N Hkv, ., .] (see _forward_block),
    # on the transposed block [N Hkv, bk, G bq]: four of the five products are then
    # plain (non-transposed) matmuls, which XLA:CPU runs fastest, and with the
    # shapes equal XLA computes each elementwise step in place of the previous one
    # (two logits blocks held, not three).
    dk_acc, dv_acc = carry
    post = jnp.asarray(post_scale, stats)
    n, h, g, bq, d = q_blk.shape
    bk = k_blk.shape[2]
    b = n * h
    flat, full = (b, bk, g * bq), (n, h, bk, g, bq)

    def rows(x):  # [N, Hkv, G, bq] -> [N Hkv, 1, G bq]
        return x.reshape(b, 1, g * bq)

    qf, dof = q_blk.reshape(b, g * bq, d), do_blk.reshape(b, g * bq, d)
    kf, vf = flat_keys(k_blk), flat_keys(v_blk)
    st = jnp.einsum("bkd,bqd->bkq", kf, qf, preferred_element_type=stats)
    if post_scale != 1.0:
        st = st * post
    st, slope = _soft_cap(st, cap, slope=True)
    if mask_t is not None:
        st = jnp.where(jnp.broadcast_to(mask_t, full).reshape(flat), st, -jnp.inf)
    pt = jnp.exp(st - rows(lse_blk))
    if keep is not None:
        keep = jnp.moveaxis(keep, -1, 2).reshape(flat)
    pz = pt if keep is None else pt * keep
    dv_acc = dv_acc + jnp.einsum("bkq,bqd->bkd", pz.astype(dof.dtype), dof,
                                 preferred_element_type=stats)
    dpt = jnp.einsum("bkd,bqd->bkq", vf, dof, preferred_element_type=stats)
    if keep is not None:
        dpt = dpt * keep
    dst = pt * (dpt - rows(delta_blk))
    if slope is not None:  # d(cap tanh(s / cap))/ds = sech^2(s / cap)
        dst = dst * slope
    dst = dst.astype(qf.dtype)
    # q_blk carries the pre-scale, so only the post-scale is left for dk.
    dk_blk = jnp.einsum("bkq,bqd->bkd", dst, qf, preferred_element_type=stats)
    if post_scale != 1.0:
        dk_blk = dk_blk * post
    dk_acc = dk_acc + dk_blk
    # dq^T = k^T ds^T keeps ds^T as a plain right operand; asking for dq
    # directly makes XLA:CPU transpose the whole block (the slowest step).
    dqt_blk = jnp.einsum("bdk,bkq->bdq", k_t, dst,
                         preferred_element_type=stats) * jnp.asarray(scale, stats)
    return (dk_acc, dv_acc), dqt_blk


def _listed(ok, need):
    """Skip predicate of one list entry: real (``ok``) and not masked out (``need``)."""
    if ok is None:
        return need
    return ok if need is None else ok & need
