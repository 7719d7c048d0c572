"""Dilating and undilating arrays: the gather/scatter between positions and dilated segments.

For a branch ``(w, r)`` the sequence is cut into segments of ``w`` tokens and every
segment into ``ceil(w / r)`` rows of ``r`` columns; a head with offset ``o`` selects
column ``o``, a dense *dilated segment* of ``ceil(w / r)`` slots in increasing position
order. Where ``r`` does not divide ``w`` the last row is completed by slots that hold
no position (``Branch.padded_length``): their keys are invalid (``key_validity``) and
their query rows are dropped on the way back, as for positions past ``T``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.core import branch_plans, softmax
from jax_dilated.core.arrays import pad_axis, take_static

__all__ = ["gather_dilated", "scatter_dilated", "key_validity", "attend_dilated"]


def gather_dilated(x, branch: branch_plans.Branch, offsets: np.ndarray, heads: np.ndarray):
    """Dilated segments of ``x`` for heads ``heads`` at offsets ``offsets``.

    Args:
      x: [B, T, Hx, ...] (per-head data, e.g. queries, or a [B, T, Hx] mask).
      branch: the resolved branch (``w`` effective, ``r``).
      offsets, heads: [Hs] offset and head index of each output head, static; the
        offsets may be traced where they differ between the devices that run one
        program (hybrid dilated attention's head slices, ops/dilated_hybrid.py).

    Returns:
      [B * S, ceil(w / r), Hs, ...] with ``S`` segments; token ``a`` of segment ``s``
      for output head ``i`` is position ``s*w + a*r + offsets[i]`` of head
      ``heads[i]`` (slots past the segment's end or past ``T`` read padding).
    """
    b, t, hx = x.shape[:3]
    w, r, wp = branch.effective_length, branch.rate, branch.padded_length
    s = branch.num_segments(t)
    x = _pad_segments(pad_axis(x, 1, s * w), s, w, wp)
    x = x.reshape(b, s, wp // r, r * hx, *x.shape[3:])
    if isinstance(offsets, jax.Array):  # traced: they differ between devices
        x = jnp.take(x, offsets * hx + jnp.asarray(heads), axis=3)
        return x.reshape(b * s, wp // r, len(heads), *x.shape[4:])
    flat = np.asarray(offsets) * hx + np.asarray(heads)
    if np.array_equal(flat, np.arange(flat[0], flat[0] + len(flat))):
        # one run of columns (a head group at one offset, or everything): a slice,
        # which XLA fuses into the copies around it, where a gather would not be
        if len(flat) != r * hx:
            x = jax.lax.slice_in_dim(x, int(flat[0]), int(flat[0]) + len(flat), axis=3)
    else:
        x = take_static(x, flat, axis=3)
    return x.reshape(b * s, wp // r, len(flat), *x.shape[4:])


def _pad_segments(x, s: int, w: int, wp: int, value=0):
    """[B, S w, ...] -> [B, S wp, ...]: every segment padded at its end to ``wp``."""
    if wp == w:
        return x
    x = x.reshape(x.shape[0], s, w, *x.shape[2:])
    x = pad_axis(x, 2, wp, value)
    return x.reshape(x.shape[0], s * wp, *x.shape[3:])


def scatter_dilated(y, branch: branch_plans.Branch, offsets: np.ndarray, batch: int,
                     seq_len: int, fill):
    """Inverse of :func:`gather_dilated` for one set of heads: [B*S, w/r, Hs, ...] -> [B, T, Hs, ...].

    Positions a head does not select get ``fill``: a scalar (0 for outputs, -inf for
    lse), or an array [B, S w, Hs, ...] whose entries there are kept (writing ``y``
    into an existing array).
    """
    w, r, wp = branch.effective_length, branch.rate, branch.padded_length
    s = y.shape[0] // batch
    head_and_rest = y.shape[2:]  # (Hs, ...)
    y = y.reshape(batch, s, wp // r, *head_and_rest)
    if r > 1:
        xp = jnp if isinstance(offsets, jax.Array) else np  # traced offsets, or static
        selected = xp.arange(r)[:, None] == xp.asarray(offsets)[None, :]  # [r, Hs]
        selected = selected.reshape((1, 1, 1) + selected.shape + (1,) * (len(head_and_rest) - 1))
        if np.ndim(fill):
            fill = _pad_segments(fill, s, w, wp)
            fill = fill.reshape(batch, s, wp // r, r, *head_and_rest).astype(y.dtype)
        else:
            fill = jnp.asarray(fill, y.dtype)
        y = jnp.where(selected, jnp.expand_dims(y, 3), fill)
    if wp != w:  # the slots that complete each segment's last row hold no position
        y = y.reshape(batch, s, wp, *head_and_rest)[:, :, :w]
    return y.reshape(batch, s * w, *head_and_rest)[:, :seq_len]


def key_validity(kv_mask, branch: branch_plans.Branch, batch: int, seq_len: int):
    """[B, T] validity of keys, or None when every key of every segment exists (and
    every slot of every dilated segment holds a position)."""
    if (kv_mask is None and seq_len % branch.effective_length == 0
            and branch.padded_length == branch.effective_length):
        return None
    return jnp.ones((batch, seq_len), bool) if kv_mask is None else kv_mask


def attend_dilated(attend, branch: branch_plans.Branch, plan: branch_plans.BranchPlan, query, key,
                   value, kv_mask, *, scatter: bool = True):
    """Dilate, attend inside every dilated segment, undilate: one branch's ``(o, lse,
    lse_lo)`` (the log-sum-exp in two parts, :mod:`jax_dilated.core.softmax`).

    Args:
      attend: ``attend(q, k, v, kv_valid) -> (o, lse, lse_lo)`` on dilated segments
        ``q`` [N, L, Hq, D], ``k``/``v`` [N, L, Hkv_g, D], ``kv_valid`` None or
        [N, L, Hkv_g], ``L = branch.dilated_length`` (a kernel call on one device; a
        ring across devices).
      branch: how to cut ``query``'s sequence axis (``plan.branch`` on one device;
        the local shard as one piece when a segment spans devices).
      plan: the heads, offsets and compact kv heads of the branch.
      query: [B, T, H, D]; key, value: [B, T, Hkv, D]; kv_mask: None or [B, T] bool.
      scatter: False returns the dilated results as ``attend`` gives them.

    Returns:
      o [B, T, Hq, D] (zero where a head does not select a position), lse [B, T, Hq]
      (-inf there) and lse_lo [B, T, Hq] (0 there), for the heads ``plan.query_heads``
      (with ``scatter=False``: ``attend``'s [N, w/r, Hq, ...] results).
    """
    if plan.branch.window is not None:
        # a sliding-window branch has no dilated segments: its callers run the windowed
        # kernel (ops/dilated_window.py); reaching here would be a silently wrong result
        raise ValueError(
            f"sliding-window branch {plan.branch.window!r} is not served by this code path "
            f"(dilated segments only); run it through jax_dilated.dilated_attention.")
    b, t = query.shape[:2]
    q = gather_dilated(query, branch, plan.offsets, plan.query_heads)
    k = gather_dilated(key, branch, plan.kv_offsets, plan.kv_heads)
    v = gather_dilated(value, branch, plan.kv_offsets, plan.kv_heads)
    valid = key_validity(kv_mask, branch, b, t)
    if valid is not None:
        # broadcast the [B, T] mask to the gathered kv heads: [B, T, Hkv_g]; positions
        # past T are padding and read False through pad_axis.
        per_head = jnp.broadcast_to(valid[:, :, None], (b, t, key.shape[2]))
        valid = gather_dilated(per_head, branch, plan.kv_offsets, plan.kv_heads)
    o, lse, lse_lo = attend(q, k, v, valid)
    if not scatter:
        return o, lse, lse_lo
    return (scatter_dilated(o, branch, plan.offsets, b, t, 0),
            scatter_dilated(lse, branch, plan.offsets, b, t, -jnp.inf),
            scatter_dilated(lse_lo, branch, plan.offsets, b, t, 0))


def merge_selected(acc, branch: branch_plans.Branch, offsets: np.ndarray,
                   heads: np.ndarray, part):
    """The partial ``acc = (o, lse, lse_lo)`` ([B, T, Hs, ...], stats dtype) with a
    branch's dilated partial ``part`` ([B S, w/r, Hs, ...], as :func:`gather_dilated`
    lays it out for ``branch``, ``offsets`` and ``heads``) merged in
    (:func:`~jax_dilated.core.softmax.merge_partials`) at the positions those heads
    select; every other entry of ``acc`` is kept. Only ``T / r`` rows per head are
    merged, not the whole of ``acc``."""
    b, t = acc[0].shape[:2]
    old = [gather_dilated(x, branch, offsets, heads) for x in acc]
    o, lse, lse_lo = part
    merged = softmax.merge_partials(*old, o.astype(acc[0].dtype), lse, lse_lo)
    return tuple(scatter_dilated(m, branch, offsets, b, t, x) for m, x in zip(merged, acc))
