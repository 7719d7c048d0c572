"""A branch of one-device dilated attention, walked a chunk of segments at a time.

:class:`BranchView` holds one branch's static geometry (its items: segments, padded
where the rate does not divide them; the chunks they are cut into) and its views of
the call's arrays: a chunk's dilated queries, keys and values, and its results written
back into the accumulators in place, also through the slots of packed rows.
:meth:`BranchView.runs` lists the chunks as loops of equal chunks, which
:mod:`jax_dilated.ops.dilated_local` runs its streamed forward and backward bodies
over (inline there: the chunk body calls the kernel directly from the program).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import Kernel, KernelArgs
from jax_dilated.core import branch_plans, dilation
from jax_dilated.core.arrays import pad_axis

__all__ = ["BranchView", "ChunkRun", "slice_items", "branch_rng", "chunk_rng"]


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """How a branch's ``items`` dilated segments are walked: ``full`` chunks of
    ``size`` in a loop, then one static chunk of ``rest`` (0: none)."""

    size: int
    full: int
    rest: int

    @property
    def count(self) -> int:
        return self.full + (1 if self.rest else 0)


def _chunks(items: int, target: int) -> _Chunks:
    """Chunks of about ``target`` items; a divisor of ``items`` when one is close."""
    target = max(1, min(items, target))
    for size in range(target, (target + 1) // 2 - 1, -1):
        if size >= 1 and items % size == 0:
            return _Chunks(size, items // size, 0)
    return _Chunks(target, items // target, items % target)


@dataclasses.dataclass(frozen=True)
class ChunkRun:
    """A loop over ``trips`` chunks of ``size`` items: trip ``i`` runs chunk
    :meth:`chunk` ``(i)``, whose first item is ``chunk * stride``. ``need``: None, or
    for the slots of packed rows [trips] bool, False for a chunk of empty slots only
    (it would compute nothing: :meth:`skipping` skips it)."""

    size: int
    stride: int
    first: int
    trips: int
    need: jax.Array | None = None

    def chunk(self, i):
        """The chunk that trip ``i`` runs."""
        return i if self.first == 0 else self.first + i

    def skipping(self, step):
        """``step(i, acc)`` as the loop's body, run only for the chunks in ``need``.
        A ``lax.cond`` of its own per chunk (as :func:`~jax_dilated.core.skip.maybe_skip`
        with a traced predicate): XLA then keeps a chunk's buffers inside the
        conditional, where a loop over the needed chunks only held 3% more."""
        if self.need is None:
            return step
        need = self.need

        def step_if_needed(i, acc):
            return jax.lax.cond(need[i], step, _unchanged, i, acc)

        return step_if_needed


def _unchanged(i, acc):
    return acc


def branch_rng(rng, i: int):
    return None if rng is None else jax.random.fold_in(rng, i)


def chunk_rng(rng, c):
    return None if rng is None else jax.random.fold_in(rng, c)


class BranchView:
    """One branch's static geometry and its views of the call's arrays.

    Arrays of the call, ``[B, T, ...]``, are seen as ``[B * S, w, ...]`` (``S``
    segments of ``w`` tokens; a free reshape when ``w`` divides ``T``, else the
    sequence is padded to ``S w`` first). Where the rate does not divide the segment,
    every segment is padded at its end to ``Branch.padded_length`` tokens, and ``w``
    is that length: each item is then one segment whose rate divides it (``cut``).

    ``plan``: the branch's plan; ``kernel`` runs its chunks (its ``batch_chunk`` sizes
    them, for ``args``); ``source``: None, or the slots of packed rows
    (:mod:`jax_dilated.ops.dilated_local`).
    """

    def __init__(self, plan: branch_plans.BranchPlan, kernel: Kernel, args: KernelArgs,
                 query, key, source=None):
        self.plan = plan
        self.kernel = kernel  # runs the chunks
        self.branch = self.plan.branch
        b, t, h, d = query.shape
        self.batch, self.seq_len, self.heads = b, t, h
        self.kv_heads = key.shape[2]
        self.w = self.branch.padded_length  # an item's tokens
        # one item as a branch of its own: the views' chunks are dilated by it
        self.cut = branch_plans.Branch(self.w, self.branch.rate, self.w)
        # slots: the chunks' rows come from (and go back to) the packed arrays, through
        # ``index`` [B T'] (flat packed row of every slot, B T for an empty one)
        self.index = self.filled = None
        if source is not None:
            t = source.shape[1]
            if t % self.w or self.w != self.branch.effective_length:
                raise AssertionError("the slots are cut by every segment")  # pragma: no cover
            self.filled = source < self.seq_len
            rows = source + jnp.arange(b, dtype=source.dtype)[:, None] * self.seq_len
            self.index = jnp.where(self.filled, rows, b * self.seq_len).reshape(-1)
        self.segments = self.branch.num_segments(t)
        self.items = b * self.segments
        heads = self.plan.query_heads
        self.h0, self.hs = int(heads[0]), len(heads)
        if not np.array_equal(heads, np.arange(self.h0, self.h0 + self.hs)):
            raise AssertionError("branch plans give contiguous head ranges")  # pragma: no cover
        rate = self.branch.rate
        d_shape = (self.w // rate, self.hs, d)
        k_shape = (self.w // rate, len(self.plan.kv_heads), d)
        target = self.kernel.batch_chunk(
            self.items, jax.ShapeDtypeStruct((self.items, *d_shape), query.dtype),
            jax.ShapeDtypeStruct((self.items, *k_shape), key.dtype), args)
        self.chunks = _chunks(self.items, target)
        # gathered kv head g is kv head kv_heads[g]: the kv heads' contributions
        # are sums over the gathered heads that read them
        self.kv_sources = [np.flatnonzero(self.plan.kv_heads == j) for j in range(self.kv_heads)]

    def runs(self) -> list[ChunkRun]:
        """The branch's chunks as loops (:class:`ChunkRun`): the ``full`` chunks, then
        the ``rest`` (one static chunk); for slots, which chunks hold a filled slot."""
        ch = self.chunks
        runs = [(0, ch.full, ch.size)] if ch.full else []
        if ch.rest:
            runs.append((ch.full, 1, ch.rest))
        if self.index is None:
            return [ChunkRun(size, ch.size, first, count) for first, count, size in runs]
        out = []
        for first, count, size in runs:
            rows = jax.lax.slice_in_dim(self.index, first * ch.size * self.w,
                                        (first * ch.size + count * size) * self.w)
            need = jnp.any(rows.reshape(count, size * self.w) < self.batch * self.seq_len,
                           axis=1)
            out.append(ChunkRun(size, ch.size, first, count, need))
        return out

    def view(self, x, fill=0):
        """[B, T, ...] -> [B S, w, ...] (slots: the packed rows, [B T, ...])."""
        if self.index is not None:
            return x.reshape(self.batch * self.seq_len, *x.shape[2:])
        w = self.branch.effective_length
        x = pad_axis(x, 1, self.segments * w, fill)
        x = pad_axis(x.reshape(self.items, w, *x.shape[2:]), 1, self.w, fill)
        return x

    def unview(self, x):
        """Inverse of :meth:`view`: [B S, w, ...] -> [B, T, ...]."""
        if self.index is not None:
            return x.reshape(self.batch, self.seq_len, *x.shape[1:])
        w = self.branch.effective_length
        if self.w != w:  # the segment's own tokens, without the slots completing it
            x = jax.lax.slice_in_dim(x, 0, w, axis=1)
        x = x.reshape(self.batch, self.segments * w, *x.shape[2:])
        return jax.lax.slice_in_dim(x, 0, self.seq_len, axis=1)

    def _rows(self, start, size: int):
        """Slots: the packed rows of items ``[start, start + size)``, [size w]."""
        return jax.lax.dynamic_slice_in_dim(self.index, start * self.w, size * self.w)

    def _selected_rows(self, start, size: int, offset: int):
        """Slots: the packed rows that offset ``offset`` selects in items ``[start,
        start + size)``, [size, w/r]."""
        r = self.branch.rate
        return self._rows(start, size).reshape(size, self.w // r, r)[:, :, offset]

    def load(self, x_v, start, size: int, fill=None):
        """Items ``[start, start + size)`` of a view: [size, w, ...]. Slots: gathered
        from the packed rows; an empty slot holds ``fill`` (None: any finite row, for
        keys masked invalid and queries whose results are dropped)."""
        if self.index is None:
            return slice_items(x_v, start, size)
        rows = self._rows(start, size)
        got = (jnp.take(x_v, rows, axis=0, mode="clip") if fill is None else
               jnp.take(x_v, rows, axis=0, mode="fill", fill_value=fill))
        return got.reshape(size, self.w, *x_v.shape[1:])

    def dilated(self, x_v, start, size: int, kind: str, fill=None):
        """The dilated chunk [size, w/r, H_b, ...] of a view for the branch's query
        (``kind="q"``) or gathered kv heads (``"kv"``). Slots, when the heads form one
        run at one offset (head_groups; every rate-1 branch): only the selected rows
        and heads are gathered, where :meth:`load` would fetch every row and head."""
        offsets, heads = ((self.plan.offsets, self.plan.query_heads) if kind == "q"
                          else (self.plan.kv_offsets, self.plan.kv_heads))
        gather = self.gather_q if kind == "q" else self.gather_kv
        one_run = (np.all(offsets == offsets[0])
                   and np.array_equal(heads, np.arange(heads[0], heads[0] + len(heads))))
        if self.index is None or not one_run:
            return gather(self.load(x_v, start, size, fill))
        r = self.branch.rate
        rows = self._selected_rows(start, size, int(offsets[0]))
        starts = jnp.stack([rows.reshape(-1), jnp.full((rows.size,), int(heads[0]),
                                                       rows.dtype)], axis=-1)
        dims = jax.lax.GatherDimensionNumbers(offset_dims=tuple(range(1, x_v.ndim)),
                                              collapsed_slice_dims=(0,),
                                              start_index_map=(0, 1))
        mode = (jax.lax.GatherScatterMode.CLIP if fill is None
                else jax.lax.GatherScatterMode.FILL_OR_DROP)
        got = jax.lax.gather(x_v, starts, dims, (1, len(heads), *x_v.shape[2:]), mode=mode,
                             fill_value=fill)
        return got.reshape(size, self.w // r, len(heads), *x_v.shape[2:])

    def store(self, acc, part, start, head0: int):
        """``acc`` with ``part`` [n, w, H_b, ...] written at items ``start`` on, heads
        ``head0`` on (slots: scattered to the packed rows, empty slots dropped)."""
        if self.index is None:
            return _update(acc, part, start, head0)
        rows = self._rows(start, part.shape[0])
        part = part.reshape(-1, *part.shape[2:]).astype(acc.dtype)
        return acc.at[rows, head0:head0 + part.shape[1]].set(part, mode="drop")

    def read(self, acc, start, size: int, head0: int, heads: int):
        """The ``[size, w, heads, ...]`` part of ``acc`` that :meth:`store` writes."""
        if self.index is None:
            return _read(acc, start, size, head0, heads)
        return self.load(acc, start, size)[:, :, head0:head0 + heads]

    def gather_q(self, x):
        """Chunk [n, w, H, ...] -> its dilated query heads [n, w/r, H_b, ...]."""
        return dilation.gather_dilated(x, self.cut, self.plan.offsets, self.plan.query_heads)

    def gather_kv(self, x):
        """Chunk [n, w, H_kv, ...] -> the branch's gathered kv heads [n, w/r, H_g, ...]."""
        return dilation.gather_dilated(x, self.cut, self.plan.kv_offsets, self.plan.kv_heads)

    def scatter_q(self, y, fill):
        """[n, w/r, H_b, ...] -> [n, w, H_b, ...] (``fill`` where a head selects nothing)."""
        return dilation.scatter_dilated(y, self.cut, self.plan.offsets, y.shape[0], self.w,
                                        fill)

    def put_selected(self, acc, y, start):
        """``acc`` [B S, w, H, ...] with ``y`` [n, w/r, H_b, ...] written at the positions
        the branch's heads select, item ``start`` on; nothing else is touched.

        For head_groups, whose heads all share one offset and no other branch writes:
        one strided in-place write of exactly ``y``, where scattering first would write
        ``r`` times as much (mostly zeros the accumulator already holds).
        """
        r = self.branch.rate
        offset = int(self.plan.offsets[0])
        if self.index is not None:  # the selected slots' packed rows
            rows = self._selected_rows(start, y.shape[0], offset)
            return acc.at[rows.reshape(-1), self.h0:self.h0 + self.hs].set(
                y.reshape(-1, *y.shape[2:]).astype(acc.dtype), mode="drop")
        view = acc.reshape(acc.shape[0], self.w // r, r, *acc.shape[2:])
        idx = (start, 0, offset, self.h0) + (0,) * (acc.ndim - 3)
        view = jax.lax.dynamic_update_slice(view, jnp.expand_dims(y, 2).astype(acc.dtype), idx)
        return view.reshape(acc.shape)

    def scatter_kv(self, y):
        """Gathered kv-head gradients [n, w/r, H_g, D] -> [n, w, H_kv, D] (summed per kv head)."""
        y = dilation.scatter_dilated(y, self.cut, self.plan.kv_offsets, y.shape[0], self.w, 0)
        parts = []
        for sources in self.kv_sources:
            if len(sources) == 0:
                parts.append(jnp.zeros_like(y[:, :, 0]))
            else:
                parts.append(functools.reduce(jnp.add, [y[:, :, g] for g in sources]))
        return jnp.stack(parts, axis=2)

    def valid(self, kv_mask):
        """Key validity [B S, w, H_kv] or None (every key of every segment exists);
        slots: a filled slot whose packed key is valid."""
        if self.index is not None:
            valid = self.filled
            if kv_mask is not None:
                valid = valid & jnp.take(kv_mask.reshape(-1), self.index, mode="clip").reshape(
                    valid.shape)
            valid = jnp.broadcast_to(valid[:, :, None], (*valid.shape, self.kv_heads))
            return valid.reshape(self.items, self.w, self.kv_heads)
        valid = dilation.key_validity(kv_mask, self.branch, self.batch, self.seq_len)
        if valid is None:
            return None
        valid = jnp.broadcast_to(valid[:, :, None], (self.batch, self.seq_len, self.kv_heads))
        return self.view(valid, False)


def slice_items(x, start, size):
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)


def _update(acc, part, start, head0: int):
    """``acc`` [B S, w, H, ...] with ``part`` [n, w, H_b, ...] written at item ``start``, head ``head0``."""
    idx = (start, 0, head0) + (0,) * (acc.ndim - 3)
    return jax.lax.dynamic_update_slice(acc, part.astype(acc.dtype), idx)


def _read(acc, start, size: int, head0: int, heads: int):
    """The ``[size, w, heads, ...]`` slice of ``acc`` that :func:`_update` writes."""
    idx = (start, 0, head0) + (0,) * (acc.ndim - 3)
    return jax.lax.dynamic_slice(acc, idx, (size, acc.shape[1], heads) + acc.shape[3:])

