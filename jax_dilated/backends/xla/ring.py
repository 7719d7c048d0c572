"""The XLA kernel's ring steps: keys and values in the blocked layout for a whole
ring, folded into accumulators carried in place (see :mod:`jax_dilated.backends.base`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import KernelArgs, KeySide, QuerySide, RowGrads, any_pair_allowed
from jax_dilated.backends.xla.block_math import (_backward_block, _block_mask, _block_mask_t,
                                                 _dropout_keep, _forward_block, _listed,
                                                 dq_from_transposed, dq_to_transposed,
                                                 flat_keys, flat_rows, keys_transposed,
                                                 unflat_rows)
from jax_dilated.backends.xla.chunks import _BLOCK_ELEMENTS, batch_chunk
from jax_dilated.backends.xla.layout import (_Blocking, _blocking, _from_blocks, _indices,
                                             _matmul_inputs, _take, _to_blocks)
from jax_dilated.core import softmax
from jax_dilated.core.skip import maybe_skip


class _RingSteps:
    """The XLA kernel's :class:`~jax_dilated.backends.base.RingSteps` for one geometry.

    Keys and values travel in the kernel's blocked layout ``[nk, N, Hkv, bk, D]``
    (converted once per ring by :meth:`pack_kv`), and every step folds its block
    into accumulators carried through the ring and updated in place: the running
    ``(o, lse, lse_lo)`` in the forward, ``dq`` and the blocked ``dk``/``dv`` in the
    backward. Query-side arrays stay in the caller's ``[N, L, H, ...]`` layout and
    are cut into blocks one query block at a time, so no shard-sized copy of
    ``q``, ``do``, ``o`` or ``dq`` is made per step.

    With ``keys.blocks`` (a :class:`~.base.BlockLists`) a step visits only the listed
    key blocks of each query block (block-sparse attention over a ring); the backward,
    query blocks outermost, needs only the row lists.

    Heads are visited in groups of ``heads`` kv heads (with their query heads): the
    work item is (query block, head group), so the logits and the per-block
    temporaries cover one group, not every head. Heads are independent, so this
    changes nothing in the result; it bounds what a step holds besides the shard-sized
    buffers, which is what a ring at many devices is left with (see
    :func:`_ring_head_group`).
    """

    keep_packed = True  # packing again in the backward would keep two copies alive

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

    @staticmethod
    def _segments(seg, block: int):
        """Document ids [N, L] -> blocks [L / block, N, block] (None stays None)."""
        return None if seg is None else _to_blocks(seg.astype(jnp.int32), 1, block)

    def _q_pos(self, q_positions):
        geo = self.geo
        qp = (jnp.arange(geo.len_q, dtype=jnp.int32) if q_positions is None
              else q_positions.astype(jnp.int32))
        return qp.reshape(geo.num_q, geo.block_q)

    def _blocked(self, query: QuerySide, keys: KeySide):
        """A step's positions, validity and document ids in blocks: ``(q_pos, q_seg,
        k_pos, k_valid, k_seg, post_scale)`` (:meth:`_q_pos`, :meth:`_segments`,
        :meth:`_keys`)."""
        k_pos, k_valid, post_scale = self._keys(query.q, keys.positions, keys.valid)
        return (self._q_pos(query.positions), self._segments(query.segments, self.geo.block_q),
                k_pos, k_valid, self._segments(keys.segments, self.geo.block_k), post_scale)

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

    def visit(self, query: QuerySide, keys: KeySide):
        return keys, any_pair_allowed(self.args.is_causal, query.positions, keys.positions,
                                      keys.valid, query.segments, keys.segments,
                                      window=self.args.window)

    def forward(self, query: QuerySide, keys: KeySide, acc):
        args, q, dropout_rng = self.args, query.q, keys.dropout_rng
        k_b, v_b = keys.kv
        o, lse, lse_lo = acc
        stats = o.dtype
        q_pos_b, q_seg_b, k_pos_b, k_valid_b, k_seg_b, post_scale = self._blocked(query, keys)

        def q_block(carry, xs):
            o, lse, lse_lo = carry
            i, h, row, row_ok = xs
            q_blk = self._q_block(q, i, h)
            q_pos, q_sb = q_pos_b[i], _take(q_seg_b, i)
            m = self._rows(self._slice(lse, i, h))
            # the normalised partial (o, lse, lse_lo) as a running state: m = lse,
            # l = exp(lse_lo) (m + log l is the exact log-sum-exp; 0 for no keys yet)
            # and acc = l o
            lo = self._rows(self._slice(lse_lo, i, h))
            l0 = jnp.where(jnp.isneginf(m), 0.0, jnp.exp(lo)).astype(stats)
            acc0 = l0[..., None] * self._rows(self._slice(o, i, h))
            rows_shape = m.shape
            state = softmax.RunningState(*(flat_rows(x, rows_shape) for x in (m, l0, acc0)))

            def k_block(state, ys):
                j, ok = ys
                k_pos, k_valid = _take(k_pos_b, j), self._kv(k_valid_b, j, h)
                k_sb = _take(k_seg_b, j)

                def compute(state):
                    # read inside the branch: a skipped block reads nothing
                    k_blk, v_blk = _matmul_inputs(self._kv(k_b, j, h), self._kv(v_b, j, h))
                    mask = _block_mask(args, q_pos, k_pos, k_valid, q_sb, k_sb)
                    keep = _dropout_keep(args, dropout_rng, i, j,
                                         q_blk.shape[:-1] + (k_blk.shape[-2],), stats)
                    return _forward_block(state, q_blk, k_blk, v_blk, mask, keep,
                                          post_scale, stats, args.logit_soft_cap)

                need = _listed(ok, any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid,
                                                    q_sb, k_sb, window=args.window))
                return maybe_skip(need, compute, state), None

            state, _ = jax.lax.scan(k_block, state, (row, row_ok))
            parts = (unflat_rows(x, rows_shape) for x in softmax.finalize_state(state))
            return tuple(self._put(x, self._unrows(blk), i, h)
                         for x, blk in zip((o, lse, lse_lo), parts)), None

        acc, _ = jax.lax.scan(q_block, (o, lse, lse_lo), self._items(keys.blocks))
        return acc

    def backward(self, query: QuerySide, keys: KeySide, rows: RowGrads, acc):
        args, q, dropout_rng = self.args, query.q, keys.dropout_rng
        do, lse, delta = rows.do, rows.lse, rows.delta  # (out: not needed here)
        k_b, v_b = keys.kv
        dq, dkv = acc
        stats = dq.dtype
        q_pos_b, q_seg_b, k_pos_b, k_valid_b, k_seg_b, post_scale = self._blocked(query, keys)

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
            q_pos, q_sb = q_pos_b[i], _take(q_seg_b, i)
            # dq of this block, transposed as _backward_block gives it: [N heads, D, G bq]
            dq_rows = self._rows(self._slice(dq, i, h))
            dqt = dq_to_transposed(dq_rows)

            def k_block(carry, ys):
                j, ok = ys
                k_pos, k_valid = _take(k_pos_b, j), self._kv(k_valid_b, j, h)
                k_sb = _take(k_seg_b, j)

                def compute(carry):
                    dqt, dk_b, dv_b = carry
                    k_blk, v_blk = _matmul_inputs(self._kv(k_b, j, h), self._kv(v_b, j, h))
                    mask = _block_mask_t(args, q_pos, k_pos, k_valid, q_sb, k_sb)
                    keep = _dropout_keep(args, dropout_rng, i, j,
                                         q_blk.shape[:-1] + (k_blk.shape[-2],), stats)
                    (dk_j, dv_j), dqt_blk = _backward_block(
                        (flat_keys(self._kv(dk_b, j, h)), flat_keys(self._kv(dv_b, j, h))),
                        q_blk, k_blk, keys_transposed(k_blk), v_blk, do_blk, lse_blk,
                        delta_blk, mask, keep, post_scale, args.scale, stats,
                        args.logit_soft_cap)
                    return (dqt + dqt_blk, self._put_kv(dk_b, dk_j.reshape(k_blk.shape), j, h),
                            self._put_kv(dv_b, dv_j.reshape(k_blk.shape), j, h))

                # the real entries of a row are distinct key blocks; padding is skipped
                need = _listed(ok, any_pair_allowed(args.is_causal, q_pos, k_pos, k_valid,
                                                    q_sb, k_sb, window=args.window))
                return maybe_skip(need, compute, carry), None

            (dqt, dk_b, dv_b), _ = jax.lax.scan(k_block, (dqt, dk_b, dv_b), (row, row_ok))
            dq = self._put(dq, self._unrows(dq_from_transposed(dqt, dq_rows.shape)), i, h)
            return (dq, (dk_b, dv_b)), None

        (dq, dkv), _ = jax.lax.scan(q_block, (dq, tuple(dkv)), self._items(keys.blocks))
        return dq, dkv


def ring_steps(q, k, args: KernelArgs):
    """The ring steps for queries like ``q`` and keys like ``k`` (a
    :class:`~jax_dilated.backends.base.RingSteps`).

    None (the ring then uses the generic adapter over :func:`forward` /
    :func:`backward`, :mod:`jax_dilated.ops.ring_steps`) when the lengths
    are not whole blocks or the batch would be cut into chunks.
    """
    geo = _blocking(q.shape[1], k.shape[1], args)
    if (geo.num_q * geo.block_q != geo.len_q or geo.num_k * geo.block_k != geo.len_k
            or batch_chunk(q.shape[0], q, k, args) < q.shape[0]):
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
    once the latter become a large share of the per-device memory as P grows.
    Looping over heads keeps the matmul shapes (heads are a batch axis of them), so
    on CPU it adds only loop overhead. Elsewhere the budget is the kernel's usual
    block size (``_BLOCK_ELEMENTS``): on a GPU one head of a 512 x 512 block is
    expected to be too little work per loop step to keep the device busy (an
    assumption, not yet checked on a GPU). With dropout every head stays in one
    group: the keep masks are drawn per (query block, key block) over all heads.
    """
    if args.dropout_rate:
        return kv_heads
    per_head = batch * group * geo.block_q * geo.block_k
    fits = [d for d in range(1, kv_heads + 1)
            if kv_heads % d == 0 and d * per_head <= _ring_block_budget()]
    return max(fits, default=1)


def block_sparse_ring_steps(q, k, args: KernelArgs):
    """Ring steps (as :func:`ring_steps`) whose ``forward``/``backward`` read
    ``keys.blocks`` lists in blocks of exactly ``args.block_q`` x ``args.block_k``;
    None where the shapes do not allow them."""
    steps = ring_steps(q, k, args)
    if steps is None or (steps.geo.block_q, steps.geo.block_k) != (args.block_q, args.block_k):
        return None
    return steps
