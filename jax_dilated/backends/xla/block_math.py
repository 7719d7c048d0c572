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


# tanh in float32: x + x^3 P(x^2) for |x| < _TANH_POLY_BELOW (P fitted to float64 tanh
# by weighted least squares in x^2: 0.7 ulp), 1 - 2e / (1 + e) with e = exp(-2|x|)
# above (1.2 ulp with XLA's 1-ulp exp; (1 - e) / (1 + e) reaches 1.5).
_TANH_POLY_BELOW = 0.7
_TANH_POLY = (-0.33333325386047363, 0.1333303600549698, -0.0539264902472496,
              0.021595967933535576, -0.00793357565999031, 0.001933074090629816)


def _tanh_and_exp(x):
    """``(tanh(x), exp(-2|x|))``. In float32 ``tanh`` to about an ulp (XLA:CPU's own
    float32 tanh is off by up to 5 ulps, which is ``2.5e-7 c`` in a logit capped at
    ``c``: 1.2e-5 at c = 50, several times float32's rounding of the logit); XLA's
    tanh in float64, where it is exact to well below the float64 tolerance."""
    a = jnp.abs(x)
    e = jnp.exp(-2.0 * a)
    if x.dtype != jnp.float32:
        return jnp.tanh(x), e
    y = a * a
    poly = jnp.asarray(_TANH_POLY[-1], x.dtype)
    for c in _TANH_POLY[-2::-1]:
        poly = poly * y + jnp.asarray(c, x.dtype)
    small = a + (a * y) * poly
    big = 1.0 - 2.0 * e / (1.0 + e)
    return jnp.copysign(jnp.where(a < _TANH_POLY_BELOW, small, big), x), e


def soft_cap_tanh(x):
    """``tanh(x)`` as the soft-cap computes it (:func:`_tanh_and_exp`: about an ulp in
    float32)."""
    return _tanh_and_exp(x)[0]


def _slope_from_exp(e):
    """``sech^2(x) = 4 e / (1 + e)^2`` from ``e = exp(-2|x|)``."""
    return 4.0 * e / jnp.square(1.0 + e)


def soft_cap_slope(x):
    """``d tanh(x)/dx = sech^2(x)``, as ``4 e / (1 + e)^2`` with ``e = exp(-2|x|)``.

    ``1 - tanh(x)^2`` cancels where tanh saturates: its relative error grows like
    ``eps e^{2|x|}`` (in float32 past 1e-5 from ``|x|`` about 3, 1e-3 at 5, and 0
    past about 9, tanh having rounded to 1; how badly, below that, depends on the
    CPU's tanh). This form keeps a few ulps of relative accuracy at every ``x``.
    """
    return _slope_from_exp(jnp.exp(-2.0 * jnp.abs(x)))


def _soft_cap(s, cap, slope: bool = False):
    """Soft-capped logits ``cap tanh(s / cap)`` (:func:`soft_cap_tanh`) and, with
    ``slope``, the backward's ``d(capped)/ds = sech^2(s / cap)``
    (:func:`soft_cap_slope`, from the same exponential; else None); ``(s, None)``
    without a cap."""
    if cap is None:
        return s, None
    x = s * jnp.asarray(1.0 / cap, s.dtype)
    t, e = _tanh_and_exp(x)
    return t * jnp.asarray(cap, s.dtype), _slope_from_exp(e) if slope else None


def _raw_logits(q3, k3, post_scale: float, stats):
    """``(q k^T) post_scale`` [B, rows, keys] of three-axis operands (q3 [B, rows, D]
    carrying the pre-scale, k3 [B, keys, D]), before any cap: the one product the
    forward and a capped backward both compute the logits with."""
    s = jnp.einsum("bqd,bkd->bqk", q3, k3, preferred_element_type=stats)
    if post_scale != 1.0:
        s = s * jnp.asarray(post_scale, stats)
    return s


def _logits(q_blk, k_blk, post_scale: float, stats, cap=None):
    """Logits [B, bq, bk] of one block, soft-capped by ``cap`` (q_blk [B, bq, D]
    already carries the pre-scale; k_blk [B, bk, D])."""
    return _soft_cap(_raw_logits(q_blk, k_blk, post_scale, stats), cap)[0]


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
    if cap is None:
        st = jnp.einsum("bkd,bqd->bkq", kf, qf, preferred_element_type=stats)
        if post_scale != 1.0:
            st = st * post
        slope = None
    else:
        # Capped logits are the forward's own, bit for bit: its product (q k^T, not
        # k q^T), transposed. The two orders of the product may add the D terms in
        # different orders (XLA:CPU does where one side is 8 wide: 16x8 blocks against
        # 8x16), and then p = exp(s - lse) no longer sums to 1 against the forward's
        # lse and delta: sum_t ds_t != 0, and dq takes that error times the mean key.
        # Soft-capping is for logits of order c by design, where those orderings differ
        # by ~eps sum |q_i k_i| ~ 1e-5 (a 5e-5 error in dq at c = 50). The barrier keeps
        # XLA from folding the transpose back into the product.
        s = jax.lax.optimization_barrier(_raw_logits(qf, kf, post_scale, stats))
        st, slope = _soft_cap(jnp.swapaxes(s, 1, 2), cap, slope=True)
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
