"""Dilated attention over packed rows (``segment_ids``): the segment grid restarts at
every document (docs/semantics.md, section 2, "Packed sequences").

A document is a maximal run of equal ids. Inside it, positions count from its first
token (``rel = p - start``), and the selection rule of the unpacked operation applies
to ``rel``: in branch ``(w, r)`` a head with offset ``o`` selects ``p`` when
``(rel mod w) mod r == o``, and a selected query attends to the selected keys of its
*group*, the segment ``floor(rel / w)`` of its document. That is running every document
alone, exactly.

Where segments no longer sit at fixed positions, the dense gather of the unpacked path
(``core/dilation.py``: a reshape and a strided slice) cannot cut them out. Instead every
head's selected positions are compacted, in order, into one stream per (row, head):
groups then lie contiguously in the stream, the stream of offset ``o`` holds about
``T / r`` tokens, and one kernel call over all streams, with each token's group as its
segment id, is attention inside every group: the kernel skips the blocks with no pair
of one group, so the work stays ``w / r`` keys per selected query, as unpacked. The
results go back to the positions they came from, and the branches merge as unpacked.

Shapes: query [B, T, H, D], key/value [B, T, Hkv, D], segment_ids [B, T] int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import KernelArgs
from jax_dilated.core import branch_plans

__all__ = ["document_starts", "stream_length", "packed_branch"]


def document_starts(segment_ids):
    """[B, T] int32: the position of the first token of each token's document (a
    maximal run of equal ids)."""
    t = segment_ids.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                             segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(first, pos[None, :], 0), axis=1)


def stream_length(seq_len: int, rate: int, max_documents: int | None) -> int:
    """Static length of a branch's streams: every selected token of one head.

    A head of offset ``o`` selects at most ``ceil((L - o) / r)`` tokens of a document of
    ``L``, so at most ``ceil(T / r) + D - 1`` of a row of ``D`` documents; without a bound
    on ``D``, ``T`` (every token).
    """
    if max_documents is None or rate == 1:
        return seq_len
    return min(seq_len, -(-seq_len // rate) + max_documents - 1)


def packed_branch(kernel, args: KernelArgs, plan: branch_plans.BranchPlan, query, key,
                  value, kv_mask, starts, dropout_rng, length: int):
    """One branch over packed rows: ``(o [B, T, Hq, D], lse, lse_lo [B, T, Hq])`` for the
    heads ``plan.query_heads`` (zero / ``-inf`` / 0 where a head selects nothing), and
    ``overflow`` [B] bool: a row whose streams needed more than ``length`` slots (its
    result is then incomplete; the caller refuses it).

    Args:
      starts: :func:`document_starts` of the segment ids.
      length: the static stream length (:func:`stream_length`).
    """
    b, t, h, d = query.shape
    w, r = plan.branch.segment_length, plan.branch.rate
    heads = np.asarray(plan.query_heads)
    hs = len(heads)
    kv_of = heads // (h // key.shape[2])  # the kv head each query head reads
    pos = jnp.arange(t, dtype=jnp.int32)
    rel = pos[None, :] - starts                                         # [B, T]
    offsets = jnp.asarray(plan.offsets, jnp.int32)
    selected = ((rel % w) % r)[..., None] == offsets                    # [B, T, Hs]
    slot = jnp.cumsum(selected, axis=1, dtype=jnp.int32) - 1            # stream index
    overflow = jnp.any(slot[:, -1] >= length, axis=-1)
    # source position of every stream slot; T marks an empty slot
    rows = jnp.arange(b)[:, None, None]
    cols = jnp.arange(hs)[None, None, :]
    where = jnp.where(selected, slot, length)                           # dropped if past
    source = jnp.full((b, length, hs), t, jnp.int32).at[rows, where, cols].set(
        jnp.broadcast_to(pos[None, :, None], selected.shape), mode="drop")
    filled = source < t
    src = jnp.minimum(source, t - 1)

    def stream(x):  # [B, T, Hs, ...] -> [B Hs, length, 1, ...] along ``src``
        y = jnp.take_along_axis(x, src.reshape(b, length, hs, *(1,) * (x.ndim - 3)), axis=1)
        y = jnp.moveaxis(y, 2, 1)
        return y.reshape(b * hs, length, 1, *y.shape[3:])

    q = stream(query[:, :, heads])
    k = stream(key[:, :, kv_of])
    v = stream(value[:, :, kv_of])
    # a group is one segment of one document: the absolute position where it starts
    group = jnp.take_along_axis(starts, src.reshape(b, -1), axis=1).reshape(src.shape)
    group = group + (jnp.take_along_axis(rel, src.reshape(b, -1), axis=1).reshape(src.shape)
                     // w) * w
    # Empty slots get different ids on the query side (-1) and the key side (-2): equal
    # ids would make the empty tail of every stream one "group" whose blocks the kernel
    # could not skip (dense work over T (1 - 1/r) slots for nothing).
    q_group = jnp.where(filled, group, -1)
    k_group = jnp.where(filled, group, -2)
    valid = filled if kv_mask is None else filled & jnp.take_along_axis(
        kv_mask, src.reshape(b, -1), axis=1).reshape(src.shape)
    flat = lambda x: jnp.moveaxis(x, 2, 1).reshape(b * hs, length)  # noqa: E731
    o, lse, lse_lo = kernel.attention(q, k, v, args, kv_valid=flat(valid),
                                      q_segment_ids=flat(q_group), k_segment_ids=flat(k_group),
                                      dropout_rng=dropout_rng)

    def back(y, fill):  # [B Hs, length, 1, ...] -> [B, T, Hs, ...] at ``source``
        y = jnp.moveaxis(y.reshape(b, hs, length, *y.shape[3:]), 1, 2)
        out = jnp.full((b, t, hs, *y.shape[3:]), fill, y.dtype)
        return out.at[rows, source, cols].set(y, mode="drop")

    return back(o, 0), back(lse, -jnp.inf), back(lse_lo, 0), overflow
