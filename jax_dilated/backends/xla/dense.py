"""Blockwise online-softmax attention over every key block (the kernel's
``forward``/``backward``/``attention``).

Memory stays linear in sequence length in both passes: the forward holds one
block of logits ``[N, H, block_q, block_k]`` at a time and keeps only the output
and the log-sum-exp; the backward (a ``jax.custom_vjp``) recomputes the
probabilities block by block from the saved log-sum-exp instead of storing them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dilated.backends.base import KernelArgs, any_pair_allowed
from jax_dilated.backends.xla import block_sparse
from jax_dilated.backends.xla.block_math import (_backward_block, _block_mask, _block_mask_t,
                                                 _dropout_keep, _forward_block, flat_keys,
                                                 flat_shape, keys_transposed,
                                                 transposed_dq_shape, unflat_rows)
from jax_dilated.backends.xla.chunks import (  # noqa: F401 (re-exported names)
    _BLOCK_ELEMENTS, _check_pair, _chunked, batch_chunk)
from jax_dilated.backends.xla.layout import (_backward_inputs, _blocking, _matmul_inputs,
                                             _Prepared)
from jax_dilated.core import softmax
from jax_dilated.core.skip import maybe_skip
from jax_dilated.core.vma import varying_like


def _forward_core(q, k, v, kv_valid, q_seg, k_seg, args: KernelArgs, *, q_positions=None,
                  k_positions=None, dropout_rng=None):
    """Blockwise forward of one batch chunk; arguments and results as in :func:`forward`."""
    out_dtype = q.dtype
    q, k, v = _matmul_inputs(q, k, v)
    geo = _blocking(q.shape[1], k.shape[1], args)
    prep = _Prepared(q, k, v, q_positions, k_positions, kv_valid, geo, args.scale, q_seg,
                     k_seg)
    stats = softmax.stats_dtype(q.dtype)
    rows_shape = prep.q.shape[1:-1]  # [N, Hkv, G, bq]
    d = q.shape[-1]

    def q_block(_, xs):
        i, q_blk, q_pos, q_sb = xs

        def k_block(state, ys):
            j, k_blk, v_blk, k_pos, k_valid, k_sb = ys

            def compute(state):
                mask = _block_mask(args, q_pos, k_pos, k_valid, q_sb, k_sb)
                keep = _dropout_keep(args, dropout_rng, i, j,
                                     q_blk.shape[:-1] + (k_blk.shape[-2],), stats)
                return _forward_block(state, q_blk, k_blk, v_blk, mask, keep,
                                      prep.post_scale, stats, args.logit_soft_cap)

            need = any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid, q_sb, k_sb,
                                    window=args.window)
            return maybe_skip(need, compute, state), None

        state = varying_like(softmax.init_state(flat_shape(rows_shape), d, stats), (q, k, v))
        ys = (jnp.arange(geo.num_k), prep.k, prep.v, prep.k_pos, prep.k_valid, prep.k_seg)
        state, _ = jax.lax.scan(k_block, state, ys)
        o, lse, lse_lo = (unflat_rows(x, rows_shape) for x in softmax.finalize_state(state))
        return None, (o.astype(out_dtype), lse, lse_lo)

    xs = (jnp.arange(geo.num_q), prep.q, prep.q_pos, prep.q_seg)
    _, (o, lse, lse_lo) = jax.lax.scan(q_block, None, xs)
    return prep.from_q_rows(o), prep.from_q_rows(lse), prep.from_q_rows(lse_lo)


def _backward_core(q, k, v, do, lse, delta, kv_valid, q_seg, k_seg, args: KernelArgs, *,
                   q_positions=None, k_positions=None, dropout_rng=None):
    """Blockwise backward of one batch chunk; arguments and results as in :func:`backward`."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    geo = _blocking(q.shape[1], k.shape[1], args)
    prep, do_b, lse_b, delta_b, stats = _backward_inputs(
        q, k, v, do, lse, delta, kv_valid, q_seg, k_seg, geo, args.scale, q_positions,
        k_positions)
    nq = prep.q.shape[0]
    dq_t_shape = transposed_dq_shape(prep.q.shape)

    def k_block(_, xs):
        j, k_blk, v_blk, k_pos, k_valid, k_sb = xs
        k_t = keys_transposed(k_blk)

        def q_block(carry, ys):
            i, q_blk, do_blk, lse_blk, delta_blk, q_pos, q_sb = ys

            def compute(carry):
                mask = _block_mask_t(args, q_pos, k_pos, k_valid, q_sb, k_sb)
                keep = _dropout_keep(args, dropout_rng, i, j,
                                     q_blk.shape[:-1] + (k_blk.shape[-2],), stats)
                return _backward_block(carry, q_blk, k_blk, k_t, v_blk, do_blk, lse_blk,
                                       delta_blk, mask, keep, prep.post_scale, args.scale,
                                       stats, args.logit_soft_cap)

            def skip(carry):
                return carry, varying_like(jnp.zeros(dq_t_shape, stats), (q, k, v, do))

            need = any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid, q_sb, k_sb,
                                    window=args.window)
            return maybe_skip(need, compute, carry, skip)

        zeros_kv = varying_like(jnp.zeros(flat_keys(k_blk).shape, stats), (q, k, v, do))
        ys = (jnp.arange(geo.num_q), prep.q, do_b, lse_b, delta_b, prep.q_pos, prep.q_seg)
        (dk_blk, dv_blk), dq_parts = jax.lax.scan(q_block, (zeros_kv, zeros_kv), ys)
        return None, (dk_blk.reshape(k_blk.shape), dv_blk.reshape(k_blk.shape), dq_parts)

    def k_block_acc(dq_acc, xs):
        _, (dk_blk, dv_blk, dq_parts) = k_block(None, xs)
        return dq_acc + dq_parts, (dk_blk, dv_blk)

    dq0 = varying_like(jnp.zeros((nq,) + dq_t_shape, stats), (q, k, v, do))
    xs = (jnp.arange(geo.num_k), prep.k, prep.v, prep.k_pos, prep.k_valid, prep.k_seg)
    dq_t, (dk, dv) = jax.lax.scan(k_block_acc, dq0, xs)
    return prep.grads(dq_t, dk, dv, dtypes)


def forward(q, k, v, args: KernelArgs, *, q_positions=None, k_positions=None,
            kv_valid=None, dropout_rng=None, q_segment_ids=None, k_segment_ids=None):
    """Blockwise attention forward.

    Args:
      q: [N, Lq, H, D]; k, v: [N, Lk, Hkv, D] with ``H % Hkv == 0``.
      args: static kernel arguments (scale, causality, dropout, block sizes).
      q_positions: [Lq] int positions of the queries (for causality; default arange).
      k_positions: [Lk] int positions of the keys (default arange).
      kv_valid: [N, Lk] or [N, Lk, Hkv] bool, False = key may not be attended to.
      dropout_rng: PRNG key, needed when ``args.dropout_rate > 0``.
      q_segment_ids, k_segment_ids: [N, Lq] / [N, Lk] int document ids (both or
        neither): query ``p`` attends to key ``t`` only if their ids are equal.

    Returns:
      ``o`` [N, Lq, H, D] in q's dtype and the log-sum-exp as ``lse``, ``lse_lo``
      [N, Lq, H] in the stats dtype (float32, or float64 for float64 inputs; the
      two parts of :mod:`jax_dilated.core.softmax`); ``o = 0``, ``lse = -inf``,
      ``lse_lo = 0`` for rows with no allowed key.
    """
    _check_pair(q_segment_ids, k_segment_ids)
    if args.window is not None:
        if block_sparse.window_banded(args, q_positions, k_positions):
            return block_sparse.window_forward(q, k, v, args, kv_valid=kv_valid,
                                               q_segment_ids=q_segment_ids,
                                               k_segment_ids=k_segment_ids)
    chunk = batch_chunk(q.shape[0], q, k, args)
    return _chunked(_forward_core, (q, k, v, kv_valid, q_segment_ids, k_segment_ids),
                    dict(q_positions=q_positions, k_positions=k_positions), args,
                    dropout_rng, chunk)


def backward(q, k, v, do, lse, delta, args: KernelArgs, *, q_positions=None,
             k_positions=None, kv_valid=None, dropout_rng=None, q_segment_ids=None,
             k_segment_ids=None):
    """Blockwise attention backward from saved statistics.

    With ``p = exp(scale q.k - lse)`` (dropout mask ``z`` applied to ``p`` in
    the output only) the gradients are ``dv = (p z)^T do``, ``dp = z (do v^T)``,
    ``ds = p (dp - delta)``, ``dq = scale ds k``, ``dk = scale ds^T q``.

    ``lse`` and ``delta`` may be *global* statistics (over more keys than this call
    sees), which is how a ring or a branch merge differentiates through a
    partial: ``delta = rowsum(do * o) - dlse`` with the global ``o``. Only the
    rounded ``lse`` is read: the caller folds its low part into ``do`` and ``delta``
    (:func:`jax_dilated.core.softmax.backward_rows`).

    Args:
      q, k, v, q_positions, k_positions, kv_valid, dropout_rng, q_segment_ids,
        k_segment_ids: as in :func:`forward`.
      do: [N, Lq, H, D] output cotangent.
      lse: [N, Lq, H] log-sum-exp (stats dtype, ``-inf`` for rows without keys).
      delta: [N, Lq, H] as above (stats dtype).

    Returns:
      ``dq`` [N, Lq, H, D], ``dk``/``dv`` [N, Lk, Hkv, D], in the input dtypes.
    """
    _check_pair(q_segment_ids, k_segment_ids)
    if args.window is not None:
        if block_sparse.window_banded(args, q_positions, k_positions):
            return block_sparse.window_backward(q, k, v, do, lse, delta, args,
                                                kv_valid=kv_valid,
                                                q_segment_ids=q_segment_ids,
                                                k_segment_ids=k_segment_ids)
    chunk = batch_chunk(q.shape[0], q, k, args)
    return _chunked(_backward_core, (q, k, v, do, lse, delta, kv_valid, q_segment_ids,
                                     k_segment_ids),
                    dict(q_positions=q_positions, k_positions=k_positions), args,
                    dropout_rng, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 11))
def _attention(q, k, v, args, q_positions, k_positions, kv_valid, dropout_rng, q_seg, k_seg,
               sinks, forward_fn):
    return _attention_fwd(q, k, v, args, q_positions, k_positions, kv_valid, dropout_rng,
                          q_seg, k_seg, sinks, forward_fn)[0]


def _attention_fwd(q, k, v, args, q_positions, k_positions, kv_valid, dropout_rng, q_seg,
                   k_seg, sinks, forward_fn):
    out = softmax.fold_sinks(*(forward_fn or forward)(
        q, k, v, args, q_positions=q_positions, k_positions=k_positions, kv_valid=kv_valid,
        dropout_rng=dropout_rng, q_segment_ids=q_seg, k_segment_ids=k_seg), sinks)
    o, lse, lse_lo = out
    return out, (q, k, v, o, lse, lse_lo, q_positions, k_positions, kv_valid, dropout_rng,
                 q_seg, k_seg, sinks)


def _attention_bwd(args, forward_fn, res, cotangents):
    del forward_fn  # the backward is this module's, whichever forward ran
    (q, k, v, o, lse, lse_lo, q_positions, k_positions, kv_valid, dropout_rng, q_seg, k_seg,
     sinks) = res
    do, dlse, _ = cotangents  # lse_lo is a constant correction (core/softmax.py)
    do, delta = softmax.backward_rows(do, o, lse_lo, dlse)
    dq, dk, dv = backward(q, k, v, do, lse, delta, args, q_positions=q_positions,
                          k_positions=k_positions, kv_valid=kv_valid,
                          dropout_rng=dropout_rng, q_segment_ids=q_seg, k_segment_ids=k_seg)
    return (dq, dk, dv, None, None, None, None, None, None,
            softmax.sink_gradient(lse, delta, sinks))


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, args: KernelArgs, *, q_positions=None, k_positions=None,
              kv_valid=None, dropout_rng=None, q_segment_ids=None, k_segment_ids=None,
              sinks=None, forward_fn=None):
    """Differentiable blockwise attention: :func:`forward` with a recomputing VJP.

    Gradients flow to q, k, v from every output, ``o`` and both parts of the
    log-sum-exp; ``sinks`` [H] (or None) are folded into the result and get theirs
    (:meth:`jax_dilated.backends.base.Kernel.attention`). ``forward_fn``: another
    forward with :func:`forward`'s signature and results (the native CPU kernel's);
    the backward is :func:`backward` from its log-sum-exp either way.
    """
    return _attention(q, k, v, args, q_positions, k_positions, kv_valid, dropout_rng,
                      q_segment_ids, k_segment_ids, sinks, forward_fn)
