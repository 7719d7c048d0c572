"""The XLA kernel over listed blocks only (block-sparse attention)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import BlockLists, KernelArgs, any_pair_allowed
from jax_dilated.backends.xla.block_math import (_backward_block, _block_mask, _block_mask_t,
                                                 _forward_block, _listed, flat_keys, flat_shape,
                                                 keys_transposed, transposed_dq_shape,
                                                 unflat_rows)
from jax_dilated.backends.xla.chunks import _check_pair, _chunked, batch_chunk
from jax_dilated.backends.xla.layout import (_backward_inputs, _Blocking, _blocking,
                                             _matmul_inputs, _Prepared, _take)
from jax_dilated.core import softmax
from jax_dilated.core.skip import maybe_skip
from jax_dilated.core.vma import varying_like


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


def _sparse_forward_core(q, k, v, kv_valid, q_seg, k_seg, args: KernelArgs, *,
                         blocks: BlockLists,
                         q_positions=None, k_positions=None, dropout_rng=None):
    del dropout_rng
    out_dtype = q.dtype
    q, k, v = _matmul_inputs(q, k, v)
    geo = _sparse_blocking(q.shape[1], k.shape[1], args, blocks)
    prep = _Prepared(q, k, v, q_positions, k_positions, kv_valid, geo, args.scale, q_seg,
                     k_seg)
    stats = softmax.stats_dtype(q.dtype)
    rows_shape = prep.q.shape[1:-1]  # [N, Hkv, G, bq]
    d = q.shape[-1]
    rows = jnp.asarray(blocks.rows, jnp.int32)
    rows_ok = None if blocks.rows_ok is None else jnp.asarray(blocks.rows_ok, bool)

    def q_block(_, xs):
        q_blk, q_pos, q_sb, row, row_ok = xs

        def k_step(state, ys):
            j, ok = ys

            def compute(state):
                # gathered inside the branch: a skipped entry reads nothing
                k_valid = _take(prep.k_valid, j)
                mask = _block_mask(args, q_pos, _take(prep.k_pos, j), k_valid, q_sb,
                                   _take(prep.k_seg, j))
                return _forward_block(state, q_blk, _take(prep.k, j), _take(prep.v, j),
                                      mask, None, prep.post_scale, stats,
                                      args.logit_soft_cap)

            need = _listed(ok, any_pair_allowed(args.is_causal, q_pos, _take(prep.k_pos, j),
                                                _take(prep.k_valid, j), q_sb,
                                                _take(prep.k_seg, j), window=args.window))
            return maybe_skip(need, compute, state), None

        state = varying_like(softmax.init_state(flat_shape(rows_shape), d, stats),
                             (q, k, v, row))
        state, _ = jax.lax.scan(k_step, state, (row, row_ok))
        o, lse, lse_lo = (unflat_rows(x, rows_shape) for x in softmax.finalize_state(state))
        return None, (o.astype(out_dtype), lse, lse_lo)

    _, (o, lse, lse_lo) = jax.lax.scan(q_block, None,
                                       (prep.q, prep.q_pos, prep.q_seg, rows, rows_ok))
    return prep.from_q_rows(o), prep.from_q_rows(lse), prep.from_q_rows(lse_lo)


def _sparse_backward_core(q, k, v, do, lse, delta, kv_valid, q_seg, k_seg,
                          args: KernelArgs, *,
                          blocks: BlockLists, q_positions=None, k_positions=None,
                          dropout_rng=None):
    del dropout_rng
    dtypes = (q.dtype, k.dtype, v.dtype)
    geo = _sparse_blocking(q.shape[1], k.shape[1], args, blocks)
    prep, do_b, lse_b, delta_b, stats = _backward_inputs(
        q, k, v, do, lse, delta, kv_valid, q_seg, k_seg, geo, args.scale, q_positions,
        k_positions)
    cols = jnp.asarray(blocks.cols, jnp.int32)
    cols_ok = None if blocks.cols_ok is None else jnp.asarray(blocks.cols_ok, bool)
    nq = prep.q.shape[0]
    dq_t_shape = transposed_dq_shape(prep.q.shape)
    like = (q, k, v, do, cols)

    def k_block(dq_acc, xs):
        k_blk, v_blk, k_pos, k_valid, k_sb, col, col_ok = xs
        k_t = keys_transposed(k_blk)

        def q_step(carry, ys):
            i, ok = ys
            q_pos, q_sb = _take(prep.q_pos, i), _take(prep.q_seg, i)

            def compute(carry):
                mask = _block_mask_t(args, q_pos, k_pos, k_valid, q_sb, k_sb)
                return _backward_block(carry, _take(prep.q, i), k_blk, k_t, v_blk,
                                       _take(do_b, i), _take(lse_b, i), _take(delta_b, i),
                                       mask, None, prep.post_scale, args.scale, stats,
                                       args.logit_soft_cap)

            def skip(carry):
                return carry, varying_like(jnp.zeros(dq_t_shape, stats), like)

            need = _listed(ok, any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid, q_sb,
                                                k_sb, window=args.window))
            return maybe_skip(need, compute, carry, skip)

        zeros_kv = varying_like(jnp.zeros(flat_keys(k_blk).shape, stats), like)
        (dk_blk, dv_blk), dq_parts = jax.lax.scan(q_step, (zeros_kv, zeros_kv), (col, col_ok))
        # padding entries added zeros; real entries of one column are distinct blocks
        return dq_acc.at[col].add(dq_parts), (dk_blk.reshape(k_blk.shape),
                                              dv_blk.reshape(k_blk.shape))

    dq0 = varying_like(jnp.zeros((nq,) + dq_t_shape, stats), like)
    xs = (prep.k, prep.v, prep.k_pos, prep.k_valid, prep.k_seg, cols, cols_ok)
    dq_t, (dk, dv) = jax.lax.scan(k_block, dq0, xs)
    return prep.grads(dq_t, dk, dv, dtypes)


def block_sparse_forward(q, k, v, args: KernelArgs, *, blocks: BlockLists, q_positions=None,
                         k_positions=None, kv_valid=None, q_segment_ids=None,
                         k_segment_ids=None):
    """Attention over the listed blocks only (see :class:`~.base.BlockLists`).

    Arguments and results as in :func:`forward`; ``args.block_q``/``block_k`` are the
    exact block sizes the lists refer to. Query block ``i`` attends, with one softmax,
    to the keys of blocks ``blocks.rows[i]`` (entries with ``rows_ok`` False
    skipped); the cost is proportional to the number of listed blocks. Within a
    listed block only pairs with equal segment ids (when given) are allowed.
    """
    _check_pair(q_segment_ids, k_segment_ids)
    chunk = batch_chunk(q.shape[0], q, k, args)
    return _chunked(_sparse_forward_core, (q, k, v, kv_valid, q_segment_ids, k_segment_ids),
                    dict(q_positions=q_positions, k_positions=k_positions, blocks=blocks),
                    args, None, chunk)


def block_sparse_backward(q, k, v, do, lse, delta, args: KernelArgs, *, blocks: BlockLists,
                          q_positions=None, k_positions=None, kv_valid=None,
                          q_segment_ids=None, k_segment_ids=None):
    """Backward of :func:`block_sparse_forward` (as :func:`backward`; ``lse``/``delta``
    may be global statistics). dk/dv loop over ``blocks.cols``, the transposed lists."""
    _check_pair(q_segment_ids, k_segment_ids)
    chunk = batch_chunk(q.shape[0], q, k, args)
    return _chunked(_sparse_backward_core, (q, k, v, do, lse, delta, kv_valid, q_segment_ids,
                                            k_segment_ids),
                    dict(q_positions=q_positions, k_positions=k_positions, blocks=blocks),
                    args, None, chunk)


# ------------------------------------------------------------- sliding windows


def window_blocks(geo: _Blocking, window, is_causal: bool) -> BlockLists:
    """The key blocks each query block of ``geo`` needs under ``window = (left,
    right)`` (and the causal rule), positions ``arange``: NumPy lists of the band.

    Query block ``i`` holds positions ``[i bq, min((i + 1) bq, Lq))``, key block ``j``
    ``[j bk, min((j + 1) bk, Lk))``; ``j`` is listed where the key range meets the
    query range widened to ``[lo - left, hi + right]`` (``hi`` alone with causality).
    The band is contiguous, so each row is a run of blocks padded to the widest run.
    """
    left, right = window
    right = 0 if is_causal else right

    def ranges(length, block, num):
        lo = np.arange(num) * block
        return lo, np.minimum(lo + block, length) - 1

    q_lo, q_hi = ranges(geo.len_q, geo.block_q, geo.num_q)
    k_lo, k_hi = ranges(geo.len_k, geo.block_k, geo.num_k)
    mask = ((k_lo[None, :] <= q_hi[:, None] + right)
            & (k_hi[None, :] >= q_lo[:, None] - left))

    def runs(m):
        count = m.sum(-1)
        first = np.where(count > 0, np.argmax(m, axis=-1), 0)
        width = max(1, int(count.max(initial=0)))
        idx = first[:, None] + np.arange(width)[None, :]
        ok = np.arange(width)[None, :] < count[:, None]
        idx = np.where(ok, idx, first[:, None]).astype(np.int32)  # padding: a valid index
        return idx, (None if ok.all() else ok)

    rows, rows_ok = runs(mask)
    cols, cols_ok = runs(mask.T)
    return BlockLists(rows, rows_ok, cols, cols_ok)


def window_banded(args: KernelArgs, q_positions, k_positions) -> bool:
    """Whether a dense call runs as the band of :func:`window_blocks`: a window with
    the default positions (so the band is known at trace time) and no dropout (the
    block-sparse kernels draw none). Other windowed calls visit every block and skip
    those outside the window at run time."""
    return (args.window is not None and q_positions is None and k_positions is None
            and not args.dropout_rate)


def _band(q, k, args: KernelArgs):
    geo = _blocking(q.shape[1], k.shape[1], args)
    exact = dataclasses.replace(args, block_q=geo.block_q, block_k=geo.block_k)
    return exact, window_blocks(geo, args.window, args.is_causal)


def window_forward(q, k, v, args: KernelArgs, *, kv_valid=None, q_segment_ids=None,
                   k_segment_ids=None):
    """Dense attention under ``args.window`` over the blocks of its band only
    (O(window) work per query block): :func:`block_sparse_forward` with the lists of
    :func:`window_blocks`. Arguments and results as in :func:`.dense.forward`."""
    exact, blocks = _band(q, k, args)
    return block_sparse_forward(q, k, v, exact, blocks=blocks, kv_valid=kv_valid,
                                q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids)


def window_backward(q, k, v, do, lse, delta, args: KernelArgs, *, kv_valid=None,
                    q_segment_ids=None, k_segment_ids=None):
    """Backward of :func:`window_forward` (as :func:`.dense.backward`)."""
    exact, blocks = _band(q, k, args)
    return block_sparse_backward(q, k, v, do, lse, delta, exact, blocks=blocks,
                                 kv_valid=kv_valid, q_segment_ids=q_segment_ids,
                                 k_segment_ids=k_segment_ids)
