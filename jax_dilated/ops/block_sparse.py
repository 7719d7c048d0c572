"""Block-sparse attention: exact softmax over the active blocks of a block mask.

The sequence is cut into blocks of ``block_size`` tokens; a block mask over
(query block, key block) (a :mod:`~jax_dilated.block_patterns` pattern or a bool
array) says which key blocks each query block attends to. Every query attends,
with ONE softmax, to the keys of all the active key blocks of its query block
(AND the causal rule and the key padding mask).

How the work follows the density (everything below is decided at trace time):

* The mask is turned into NumPy *block lists*: for every query block the indices
  of its active key blocks, padded to the longest row, and the transpose (for
  every key block, the query blocks that read it). The kernel
  (``block_sparse_forward``/``backward`` of :mod:`jax_dilated.backends.xla`)
  scans these lists, gathers the listed key blocks and folds them into the online
  softmax of :mod:`jax_dilated.core.softmax`; padding entries are skipped with
  ``lax.cond``. The backward (``jax.custom_vjp``, recomputing probabilities from
  the saved log-sum-exp) walks the transposed lists for dk/dv and scatters dq.
  Time is proportional to the number of active blocks, memory is linear in the
  sequence length.
* Heads: a shared mask is one list for all heads (GQA keys are never repeated).
  A per-head mask is split into classes of heads with identical masks, each with
  its own lists; a class that is a union of whole GQA groups keeps the compact
  kv heads, any other class reads the kv head of each of its query heads.
* A mask given as a *traced* array (computed inside ``jit``) cannot be listed at
  trace time: every key block is then listed and the traced mask decides, per
  entry, whether the ``lax.cond`` computes it. The result is the same; the time
  saved is only the skipped blocks' compute (the loop still visits every block),
  and per-head traced masks run head by head.
* Over a ring (``seq_axis=`` inside ``shard_map``, or ``jd.sharded``) the lists
  are tabulated for every (device, visiting shard) pair and picked by device
  index; a ring step in which no block of the visiting shard is active (for any
  head) is skipped with ``lax.cond``, forward and backward, and the steps' partial
  results are merged by :func:`jax_dilated.core.softmax.merge_partials` in the ring core
  (:func:`jax_dilated.ops.ring.ring_partials`). Where all heads share one set of lists
  and the kernel has block-sparse ring steps (``block_sparse_ring_steps``, see
  :mod:`jax_dilated.backends.base`), the ring uses those instead: keys and values
  travel in the kernel's blocked layout and each step folds its listed blocks into
  accumulators carried in place (o/lse forward; dq and blocked dk/dv backward), so
  a device holds a few shard-sized buffers rather than per-step copies. The
  key/value transfer itself is not skipped: see :func:`block_sparse_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends import KernelArgs, get_kernel
from jax_dilated.backends.base import BlockLists
from jax_dilated.block_patterns import BlockPattern
from jax_dilated.core import layouts, softmax, validation
from jax_dilated.core.vma import varying_like
from jax_dilated.ops.ring import RingConfig, ring_partials

__all__ = ["block_sparse_attention", "block_lists"]


# ----------------------------------------------------------------- mask -> lists


def block_lists(mask: np.ndarray) -> BlockLists:
    """Padded block lists of a bool mask ``[..., num_q_blocks, num_k_blocks]``.

    Active blocks come first, in increasing order; padding entries repeat a valid
    index and are marked False in ``rows_ok``/``cols_ok`` (None when there is none).
    """
    mask = np.asarray(mask, bool)

    def lists(m):
        width = int(m.sum(-1).max(initial=0))
        order = np.argsort(~m, axis=-1, kind="stable")[..., :width].astype(np.int32)
        ok = np.take_along_axis(m, order, axis=-1)
        return order, (None if ok.all() else ok)

    rows, rows_ok = lists(mask)
    cols, cols_ok = lists(np.swapaxes(mask, -1, -2))
    return BlockLists(rows, rows_ok, cols, cols_ok)


def _pick(x, me, src):
    """``x[me, src]``: static when both indices are Python ints, else a gather."""
    if x is None:
        return None
    if isinstance(me, int) and isinstance(src, int):
        return x[me, src]
    return jnp.asarray(x)[me, src]


class _HeadClass:
    """Query heads sharing one block mask, with their kv heads and block lists.

    q_heads: query-head indices (None: all heads, in order).
    kv_heads: kv-head indices fed to the kernel (None: all kv heads): whole GQA
      groups when the class is made of whole groups, else one per query head
      (the kernel then sees group size 1).
    tables: BlockLists over [P, P, ...] (device, visiting shard) and ``active``
      bool [P, P] (static masks); or None with ``mask_head`` the head of the traced
      mask (``aux``) to read.
    """

    def __init__(self, q_heads, kv_heads, tables=None, active=None, mask_head=None):
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.tables, self.active, self.mask_head = tables, active, mask_head


class _Step:
    """One ring step (or the whole single-device call) of block-sparse attention.

    Implements the ``RingConfig.step`` protocol of :mod:`jax_dilated.ops.ring`. The
    identity is the hash: a fresh object per trace, never compared by value.
    """

    def __init__(self, kernel, args: KernelArgs, classes, num_heads: int, gq, gk):
        self.kernel, self.args, self.classes = kernel, args, classes
        self.num_heads = num_heads
        self.gq, self.gk = gq, gk  # global block index of each local block, [P, n_blocks]
        order = np.concatenate([np.arange(num_heads) if c.q_heads is None else c.q_heads
                                for c in classes])
        self.inverse = None if np.array_equal(order, np.arange(num_heads)) else np.argsort(order)

    # lists and activity of one class for (this device, visiting shard)
    def _lists(self, c: _HeadClass, me, src, aux):
        if c.tables is not None:
            lists = BlockLists(*(_pick(x, me, src) for x in c.tables))
            if c.active.all() or not c.active.any():  # the same for every pair: static
                return lists, bool(c.active.any())
            active = _pick(c.active, me, src)
            return lists, (bool(active) if isinstance(active, np.bool_) else active)
        sub = aux[c.mask_head]
        gq, gk = _pick_row(self.gq, me), _pick_row(self.gk, src)
        sub = jnp.take(jnp.take(sub, gq, axis=0), gk, axis=1)  # [nbq, nbk]
        nbq, nbk = sub.shape
        rows = np.broadcast_to(np.arange(nbk, dtype=np.int32), (nbq, nbk))
        cols = np.broadcast_to(np.arange(nbq, dtype=np.int32), (nbk, nbq))
        return BlockLists(rows, sub, cols, sub.T), jnp.any(sub)

    @staticmethod
    def _heads(x, idx):
        return x if idx is None else jnp.take(x, jnp.asarray(idx), axis=2)

    def _run(self, need, compute, skip):
        if need is True or need is None:
            return compute()
        if need is False:
            return skip()
        return jax.lax.cond(need, compute, skip)

    def _need(self, c, me, src, aux, kv_valid):
        lists, active = self._lists(c, me, src, aux)
        if kv_valid is not None and active is not False:
            active = jnp.any(kv_valid) if active is True else active & jnp.any(kv_valid)
        return lists, active

    def _assemble(self, parts):
        out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)
        return out if self.inverse is None else jnp.take(out, jnp.asarray(self.inverse), axis=2)

    def forward(self, q, k, v, kv_valid, q_pos, k_pos, me, src, aux):
        stats = softmax.stats_dtype(q.dtype)
        outs, lses = [], []
        for c in self.classes:
            qc, kc, vc = self._heads(q, c.q_heads), self._heads(k, c.kv_heads), \
                self._heads(v, c.kv_heads)
            lists, need = self._need(c, me, src, aux, kv_valid)

            def compute(qc=qc, kc=kc, vc=vc, lists=lists):
                o, lse = self.kernel.block_sparse_forward(
                    qc, kc, vc, self.args, blocks=lists, q_positions=q_pos,
                    k_positions=k_pos, kv_valid=kv_valid)
                return o.astype(stats), lse.astype(stats)

            def skip(qc=qc, kc=kc):
                return varying_like((jnp.zeros(qc.shape, stats),
                                     jnp.full(qc.shape[:3], -jnp.inf, stats)), (qc, kc))

            o, lse = self._run(need, compute, skip)
            outs.append(o)
            lses.append(lse)
        return self._assemble(outs), self._assemble(lses)

    # --- the kernel's ring steps (RingConfig.step protocol of jax_dilated.ops.ring)

    def ring_steps(self, kernel, q, k):
        """The kernel's block-sparse ring steps, or None (then forward/backward).

        Used when all heads share one class (one set of lists): keys and values
        then travel in the kernel's layout and every step folds its listed blocks
        into accumulators carried in place. Several head classes keep the
        per-step path.
        """
        make = getattr(kernel, "block_sparse_ring_steps", None)
        if make is None or len(self.classes) != 1 or self.classes[0].q_heads is not None:
            return None
        return make(q, k, self.args)

    @staticmethod
    def _fold(need, compute, acc):
        if need is True or need is None:
            return compute(acc)
        if need is False:
            return acc
        return jax.lax.cond(need, compute, lambda a: a, acc)

    def fold_forward(self, steps, q, kv, kv_valid, acc, q_pos, k_pos, me, src, aux):
        lists, need = self._need(self.classes[0], me, src, aux, kv_valid)

        def compute(acc):
            return steps.forward(q, kv, *acc, blocks=lists, q_positions=q_pos,
                                 k_positions=k_pos, kv_valid=kv_valid)

        return self._fold(need, compute, acc)

    def fold_backward(self, steps, q, kv, kv_valid, do, lse, delta, acc, q_pos, k_pos, me,
                      src, aux):
        lists, need = self._need(self.classes[0], me, src, aux, kv_valid)

        def compute(acc):
            return steps.backward(q, kv, do, lse, delta, *acc, blocks=lists,
                                  q_positions=q_pos, k_positions=k_pos, kv_valid=kv_valid)

        return self._fold(need, compute, acc)

    def backward(self, q, k, v, kv_valid, do, lse, delta, q_pos, k_pos, me, src, aux):
        stats = softmax.stats_dtype(q.dtype)
        dqs = []
        dk = dv = None
        for c in self.classes:
            qc, kc, vc = self._heads(q, c.q_heads), self._heads(k, c.kv_heads), \
                self._heads(v, c.kv_heads)
            doc, lsec, deltac = (self._heads(x, c.q_heads) for x in (do, lse, delta))
            lists, need = self._need(c, me, src, aux, kv_valid)

            def compute(qc=qc, kc=kc, vc=vc, doc=doc, lsec=lsec, deltac=deltac, lists=lists):
                grads = self.kernel.block_sparse_backward(
                    qc, kc, vc, doc, lsec, deltac, self.args, blocks=lists,
                    q_positions=q_pos, k_positions=k_pos, kv_valid=kv_valid)
                return tuple(g.astype(stats) for g in grads)

            def skip(qc=qc, kc=kc, doc=doc):
                return varying_like((jnp.zeros(qc.shape, stats), jnp.zeros(kc.shape, stats),
                                     jnp.zeros(kc.shape, stats)), (qc, kc, doc))

            dqc, dkc, dvc = self._run(need, compute, skip)
            dqs.append(dqc)
            if c.kv_heads is None:
                dk = dkc if dk is None else dk + dkc
                dv = dvc if dv is None else dv + dvc
            else:
                zeros = varying_like(jnp.zeros(k.shape, stats), (k, dkc))
                dk = zeros if dk is None else dk
                dv = zeros if dv is None else dv
                idx = jnp.asarray(c.kv_heads)
                dk = dk.at[:, :, idx].add(dkc)
                dv = dv.at[:, :, idx].add(dvc)
        return self._assemble(dqs), dk, dv


def _pick_row(x, i):
    return x[i] if isinstance(i, int) else jnp.take(jnp.asarray(x), i, axis=0)


# --------------------------------------------------------------------- planning


def _resolve_mask(pattern, nq: int, nk: int, num_heads: int):
    """The block mask, [1 or num_heads, nq, nk]: NumPy when static, else traced."""
    if isinstance(pattern, BlockPattern):
        mask = pattern.to_mask(nq, nk, num_heads if pattern.per_head else None)
    elif isinstance(pattern, (np.ndarray, jax.Array)):
        dtype = pattern.dtype
        if dtype != np.bool_:
            raise TypeError(
                f"pattern as an array must be bool [q_blocks, k_blocks] or [heads, "
                f"q_blocks, k_blocks], got dtype {dtype}.")
        mask = pattern
        if not isinstance(pattern, jax.core.Tracer):
            mask = np.asarray(pattern)
    else:
        raise TypeError(
            f"pattern must be a jax_dilated.block_patterns.BlockPattern or a bool array "
            f"[q_blocks, k_blocks] / [heads, q_blocks, k_blocks], got "
            f"{type(pattern).__name__}.")
    want = f"({nq}, {nk}) or ({num_heads}, {nq}, {nk})"
    given = tuple(mask.shape)
    if mask.ndim == 2:
        mask = mask[None]
    if mask.ndim != 3 or tuple(mask.shape[1:]) != (nq, nk) or mask.shape[0] not in (1, num_heads):
        raise ValueError(
            f"pattern mask has shape {given} but the call has {nq} query blocks, {nk} key blocks and {num_heads} heads: "
            f"expected shape {want} (sequence lengths divided by block_size, rounded up; "
            f"with heads sharded, the heads of one shard).")
    return mask


def _head_classes(mask, num_heads: int, num_kv_heads: int, gq, gk, is_causal: bool):
    """Head classes of a resolved mask, with their block lists (see :class:`_HeadClass`)."""
    nq, nk = mask.shape[1:]
    causal = np.arange(nk)[None, :] <= np.arange(nq)[:, None]
    group = num_heads // num_kv_heads
    static = isinstance(mask, np.ndarray)
    if static:
        if is_causal:  # whole blocks above the diagonal hold no allowed pair
            mask = mask & causal
        groups: dict[bytes, list[int]] = {}
        for h in range(mask.shape[0]):
            groups.setdefault(np.packbits(mask[h]).tobytes(), []).append(h)
        members = list(groups.values())
    else:
        if is_causal:
            mask = mask & jnp.asarray(causal)
        members = [[h] for h in range(mask.shape[0])]
    if len(members) == 1:
        members = [list(range(num_heads))]

    classes = []
    for heads in members:
        heads = np.asarray(heads)
        if len(heads) == num_heads:
            q_heads = kv_heads = None
        else:
            q_heads = heads
            kv = np.unique(heads // group)
            whole = len(heads) == len(kv) * group and np.array_equal(
                heads, (kv[:, None] * group + np.arange(group)).reshape(-1))
            kv_heads = kv if whole else heads // group
        if static:
            m = mask[heads[0] if mask.shape[0] > 1 else 0]
            sub = m[gq[:, None, :, None], gk[None, :, None, :]]  # [P, P, nbq, nbk]
            tables = block_lists(sub)
            classes.append(_HeadClass(q_heads, kv_heads, tables=tables,
                                      active=sub.any(axis=(-1, -2))))
        else:
            classes.append(_HeadClass(q_heads, kv_heads, mask_head=int(heads[0])))
    return classes, (None if static else mask)


def _ring_blocks(n: int, num_devices: int, layout: str, block_size: int):
    """Global block index of every local block, [P, n / block_size], for a ring layout."""
    if layout == "striped":
        raise ValueError(
            'block_sparse_attention does not support layout="striped": a striped shard '
            "holds every P-th token, so its blocks are not blocks of the global sequence; "
            'use "contiguous" or "zigzag".')
    piece = n // 2 if layout == "zigzag" else n
    if n % block_size or piece % block_size:
        raise ValueError(
            f"block_size={block_size} must divide the "
            f"{'zigzag chunk' if layout == 'zigzag' else 'shard'} length {piece} (shard "
            f"length {n} on {num_devices} devices, layout={layout!r}) so that no block "
            f"straddles two devices.")
    order = layouts.global_order(n * num_devices, num_devices, layout)
    return (order.reshape(num_devices, n // block_size, block_size)[:, :, 0]
            // block_size).astype(np.int32)


# ------------------------------------------------------------------ single device


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _local(q, k, v, kv_valid, step, aux):
    return step.forward(q, k, v, kv_valid, None, None, 0, 0, aux)


def _local_fwd(q, k, v, kv_valid, step, aux):
    o, lse = step.forward(q, k, v, kv_valid, None, None, 0, 0, aux)
    return (o, lse), (q, k, v, kv_valid, aux, o, lse)


def _local_bwd(step, res, cotangents):
    q, k, v, kv_valid, aux, o, lse = res
    do, dlse = cotangents
    delta = softmax.backward_delta(do, o, dlse)
    dq, dk, dv = step.backward(q, k, v, kv_valid, do, lse, delta, None, None, 0, 0, aux)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_local.defvjp(_local_fwd, _local_bwd)


# --------------------------------------------------------------------------- API


def block_sparse_attention(query, key, value, *, block_size: int, pattern,
                           is_causal: bool = False, scale: float | None = None,
                           kv_mask=None, seq_axis: str | None = None,
                           layout: str = "contiguous", implementation: str | None = None,
                           return_lse: bool = False, axis_name: str | None = None):
    """Attention over the active blocks of a block mask, exact over their union.

    Args:
      query: [batch, q_len, num_heads, head_dim].
      key, value: [batch, kv_len, num_kv_heads, head_dim] (``num_heads %
        num_kv_heads == 0``: grouped-query attention).
      block_size: tokens per block (queries and keys): the block of the pattern, which
        is also the kernel's block (``block_q = block_k = block_size``; there are no
        separate kernel block sizes here). On one device the lengths
        need not be multiples of it (the last block is short); over a ring it must
        divide the shard length (the zigzag chunk length for ``layout="zigzag"``).
      pattern: a :class:`~jax_dilated.block_patterns.BlockPattern`, or a bool array
        ``[q_blocks, k_blocks]`` (shared) or ``[num_heads, q_blocks, k_blocks]``
        (per head), True = query block attends to key block. Blocks count the
        *global* sequence (``ceil(len / block_size)``). NumPy / concrete masks are
        listed at trace time (work proportional to the active blocks); a traced
        mask makes every block a ``lax.cond`` (see the module docstring).
        Per-head patterns address the heads of this call: with heads sharded
        (``jd.sharded(..., head_axis=...)``) a shard's heads are numbered from 0,
        so give a shared pattern there, or per-shard arrays.
      is_causal: additionally key position <= query position (AND-ed with the
        pattern; blocks above the diagonal are dropped from the lists).
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      kv_mask: bool [batch, kv_len] (this shard's, inside ``shard_map``), True = may
        be attended to.
      seq_axis: inside ``jax.shard_map``, the mesh axis the sequence is sharded
        over: the computation becomes a ring (key/value shards travel with
        ``ppermute``) equal to the single-device result. Prefer ``jd.sharded``.
      layout: ring layout, ``"contiguous"`` or ``"zigzag"`` (``"striped"`` shards
        are not made of global blocks and are refused).
      implementation: kernel; None chooses by device kind.
      return_lse: also return the log-sum-exp [batch, q_len, num_heads] (float32;
        float64 for float64 inputs), ``-inf`` for rows without keys.
      axis_name: deprecated spelling of ``seq_axis`` (DeprecationWarning).

    Returns:
      [batch, q_len, num_heads, head_dim] in the input dtype. A query whose block
      has no active, allowed key outputs zeros (finite gradients).

    Over a ring a step whose visiting shard has no active block is skipped, but
    the key/value shard is still passed on: the ring is one ``ppermute`` per hop
    with a fixed permutation, every device forwarding what it holds, and the shard
    a device skips is in general needed further down the ring (it can only get
    there through this device). A transfer could be dropped only where no later
    device needs the shard; with a static mask that schedule is known at trace
    time (e.g. causal: shard ``d`` is needed by devices ``>= d`` only; a local
    window: by its neighbours only), so an unrolled ring with a partial
    permutation per hop, or one cut short after the last needed hop (with dk/dv
    sent back to their owners), could skip it. That is not implemented; with a
    traced mask nothing can be skipped statically.

    Example:
      >>> import jax, jax_dilated as jd
      >>> from jax_dilated import block_patterns as bp
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
      >>> pattern = bp.LocalWindow(1) | bp.GlobalBlocks([0])   # 4 blocks of 16 tokens
      >>> jd.block_sparse_attention(q, k, v, block_size=16, pattern=pattern,
      ...                           is_causal=True).shape
      (1, 64, 2, 8)
    """
    seq_axis = validation.renamed(axis_name, seq_axis, old="axis_name", new="seq_axis",
                                  where="block_sparse_attention")
    b, tq, h, hkv, tk = validation.check_qkv(query, key, value)
    block_size = validation.check_positive_int("block_size", block_size)
    is_causal = validation.check_flag("is_causal", is_causal)
    kv_mask = validation.check_kv_mask(kv_mask, b, tk)
    scale = validation.check_scale(scale, query.shape[-1])
    layouts.check_layout(layout)
    kernel = get_kernel(implementation)
    if not hasattr(kernel, "block_sparse_forward"):
        raise ValueError(
            f"implementation={implementation!r} has no block-sparse kernel; use 'xla'.")
    args = KernelArgs(scale=scale, is_causal=is_causal, block_q=block_size,
                      block_k=block_size)

    if seq_axis is None:
        if layout != "contiguous":
            raise ValueError(
                f"layout={layout!r} only applies over a ring (seq_axis=...); got "
                f"seq_axis=None.")
        nq, nk = -(-tq // block_size), -(-tk // block_size)
        gq, gk = np.arange(nq, dtype=np.int32)[None], np.arange(nk, dtype=np.int32)[None]
        mask = _resolve_mask(pattern, nq, nk, h)
        classes, aux = _head_classes(mask, h, hkv, gq, gk, is_causal)
        step = _Step(kernel, args, classes, h, gq, gk)
        o, lse = _local(query, key, value, kv_mask, step, aux)
    else:
        num_devices = validation.axis_size(seq_axis, "block_sparse_attention")
        if tk != tq:
            raise ValueError(
                f"over a ring, query and key/value shards must have the same length, got "
                f"query {tuple(query.shape)} and key {tuple(key.shape)}.")
        gq = _ring_blocks(tq, num_devices, layout, block_size)
        nb = gq.size
        mask = _resolve_mask(pattern, nb, nb, h)
        classes, aux = _head_classes(mask, h, hkv, gq, gq, is_causal)
        step = _Step(kernel, args, classes, h, gq, gq)
        cfg = RingConfig(seq_axis, num_devices, num_devices, layout, args, implementation,
                         step=step)
        o, lse = ring_partials(query, key, value, kv_mask, None, cfg, aux)
    o = o.astype(query.dtype)
    return (o, lse) if return_lse else o
