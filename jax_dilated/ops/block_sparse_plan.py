"""Planning of block-sparse attention: from a block mask to the block lists each
(device, visiting shard) pair visits, per class of heads sharing a mask.

Everything here runs at trace time on NumPy, except for traced masks, whose lists
are every block with the mask deciding per entry (see
:mod:`jax_dilated.ops.block_sparse`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import BlockLists, any_pair_allowed
from jax_dilated.block_patterns import BlockPattern
from jax_dilated.core import layouts

__all__ = ["HeadClass", "block_lists", "head_classes", "resolve_mask", "ring_blocks",
           "window_mask"]


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


def _pick_row(x, i):
    return x[i] if isinstance(i, int) else jnp.take(jnp.asarray(x), i, axis=0)


class HeadClass:
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

    def lists(self, me, src, aux, gq, gk):
        """The class's lists for (this device ``me``, visiting shard ``src``) and
        whether any of their blocks is active (a Python bool where it is the same
        for every pair, else traced). ``aux``: the traced mask [heads, nb, nb] (or
        None); ``gq``/``gk``: global block index of every local block [P, nb]."""
        if self.tables is not None:
            lists = BlockLists(*(_pick(x, me, src) for x in self.tables))
            if self.active.all() or not self.active.any():  # the same for every pair
                return lists, bool(self.active.any())
            active = _pick(self.active, me, src)
            return lists, (bool(active) if isinstance(active, np.bool_) else active)
        sub = aux[self.mask_head]
        sub = jnp.take(jnp.take(sub, _pick_row(gq, me), axis=0), _pick_row(gk, src), axis=1)
        nbq, nbk = sub.shape
        rows = np.broadcast_to(np.arange(nbk, dtype=np.int32), (nbq, nbk))
        cols = np.broadcast_to(np.arange(nbq, dtype=np.int32), (nbk, nbq))
        return BlockLists(rows, sub, cols, sub.T), jnp.any(sub)

    def need(self, me, src, aux, gq, gk, kv_valid, q_seg=None, k_seg=None):
        """:meth:`lists`, with the activity also requiring a valid key and, with
        document ids (``q_seg`` [N, Lq], ``k_seg`` [N, Lk]), a query and a key of
        one document."""
        lists, active = self.lists(me, src, aux, gq, gk)
        if active is False:
            return lists, active
        more = any_pair_allowed(False, None, None, kv_valid, q_seg, k_seg)
        if more is not None:
            active = more if active is True else active & more
        return lists, active


def resolve_mask(pattern, nq: int, nk: int, num_heads: int):
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


def head_classes(mask, num_heads: int, num_kv_heads: int, gq, gk, is_causal: bool):
    """Head classes of a resolved mask, with their block lists (see :class:`HeadClass`)."""
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
            classes.append(HeadClass(q_heads, kv_heads, tables=tables,
                                      active=sub.any(axis=(-1, -2))))
        else:
            classes.append(HeadClass(q_heads, kv_heads, mask_head=int(heads[0])))
    return classes, (None if static else mask)


def ring_blocks(n: int, num_devices: int, layout: str, block_size: int):
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


def window_mask(mask, len_q: int, len_k: int, block_size: int, window):
    """``mask`` [heads, nq, nk] (NumPy or traced) AND the blocks that hold a (query,
    key) pair within ``window = (left, right)`` (None: ``mask`` unchanged).

    Block ``i`` holds the global positions ``[i b, min((i + 1) b, len))``; key block
    ``j`` is kept for query block ``i`` where its range meets the query range widened
    to ``[lo - left, hi + right]``. Dropping the others from the lists makes a
    windowed call cost O(window) per query block, on one device and over a ring.
    """
    if window is None:
        return mask
    left, right = window
    nq, nk = mask.shape[1:]
    q_lo = np.arange(nq) * block_size
    k_lo = np.arange(nk) * block_size
    q_hi = np.minimum(q_lo + block_size, len_q) - 1
    k_hi = np.minimum(k_lo + block_size, len_k) - 1
    band = ((k_lo[None, :] <= q_hi[:, None] + right)
            & (k_hi[None, :] >= q_lo[:, None] - left))[None]
    return band & mask if isinstance(mask, np.ndarray) else jnp.asarray(band) & mask
