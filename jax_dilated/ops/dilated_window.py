"""Sliding-window branches of dilated attention (docs/semantics.md, section 2,
"Sliding-window branches, soft-capping and sinks").

A :class:`~jax_dilated.core.branches.SlidingWindow` branch has no segment grid: its
heads attend, on the whole sequence, to the keys ``p - left <= t <= p + right``. It runs
as one windowed kernel call (the kernel's trace-time band: O(window) work per query)
on one device, or as the windowed ring across devices (steps outside every local
query's window skipped), and its partial ``(o, lse, lse_lo)`` is mixed with the other
branches' like any branch's: by the softmax denominators in longnet mode, side by side
(divided by the number of branches) in head_groups mode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import KernelArgs, Masks, window_arg
from jax_dilated.core import branch_plans, softmax
from jax_dilated.core.arrays import take_static
from jax_dilated.ops.ring import RingConfig, ring_partials

__all__ = ["window_args", "local_partial", "ring_partial", "mix"]


def window_args(args: KernelArgs, plan: branch_plans.BranchPlan) -> KernelArgs:
    """``args`` with the branch's window, resolved for ``args.is_causal``."""
    return dataclasses.replace(
        args, window=window_arg(plan.branch.window.resolve(args.is_causal)))


def _heads(plan: branch_plans.BranchPlan, query, key, value):
    """The branch's query heads and its compact kv heads (query head ``i`` of the
    branch reads kv head ``i // plan.kv_group``, as the kernel's GQA does)."""
    heads = np.asarray(plan.query_heads)
    if len(heads) != query.shape[2]:
        query = jax.lax.slice_in_dim(query, int(heads[0]), int(heads[0]) + len(heads), axis=2)
    kv = np.asarray(plan.kv_heads)
    if not np.array_equal(kv, np.arange(key.shape[2])):
        key, value = take_static(key, kv, axis=2), take_static(value, kv, axis=2)
    return query, key, value


def local_partial(kernel, args: KernelArgs, plan: branch_plans.BranchPlan, query, key,
                  value, kv_mask, dropout_rng, segment_ids=None, lse_grad=True):
    """One device: ``(o [B, T, Hq, D], lse, lse_lo [B, T, Hq])`` of the branch's heads
    (``plan.query_heads``), differentiable (through ``lse`` too unless ``lse_grad``
    is False, ``Kernel.attention``); ``segment_ids`` [B, T] keeps every window
    inside its document (packed rows: the same keys as the document alone)."""
    q, k, v = _heads(plan, query, key, value)
    masks = Masks(kv_valid=kv_mask, q_segment_ids=segment_ids, k_segment_ids=segment_ids,
                  dropout_rng=dropout_rng)
    return kernel.attention(q, k, v, window_args(args, plan), masks, lse_grad=lse_grad)


def ring_partial(args: KernelArgs, plan: branch_plans.BranchPlan, query, key, value,
                 kv_mask, dropout_rng, *, axis_name, num_devices: int, kernel,
                 lse_grad=True):
    """Inside ``shard_map`` (contiguous shards of ``axis_name``): the windowed ring's
    ``(o, lse, lse_lo)`` of the local queries for the branch's heads (global
    positions; ring steps outside every local query's window are skipped)."""
    q, k, v = _heads(plan, query, key, value)
    cfg = RingConfig(axis_name, num_devices, num_devices, "contiguous",
                     window_args(args, plan), kernel, lse_grad=lse_grad)
    return ring_partials(q, k, v, kv_mask, dropout_rng, cfg)


def mix(partial, windowed, mode: str, num_branches: int, dtype):
    """Mix the streamed branches' ``partial = (o, lse, lse_lo)`` (all heads, as
    :func:`jax_dilated.ops.dilated_local.attend` gives it; None when there
    are none) with the other branches' ``windowed = [(plan, (o, lse, lse_lo))]`` (the
    sliding windows; on a mesh, also the branches that span devices).

    longnet: merged by the softmax denominators (every branch holds every head).
    head_groups: each window branch's heads take its ``o / num_branches`` and its
    ``lse`` (the groups are disjoint, contiguous heads).
    Returns ``(o in dtype, lse)``.
    """
    stats = softmax.stats_dtype(dtype)
    if mode == "longnet":
        if partial is None:
            o, lse, lo = windowed[0][1]
            o, rest = o.astype(stats), windowed[1:]
        else:
            o, lse, lo = partial
            o, rest = o.astype(stats), windowed
        for _, (o_i, lse_i, lo_i) in rest:
            o, lse, lo = softmax.merge_partials(o, lse, lo, o_i.astype(stats), lse_i, lo_i)
        return o.astype(dtype), lse
    o, lse = partial[:2] if partial is not None else (None, None)
    for plan, (o_i, lse_i, _) in windowed:
        a, b = int(plan.query_heads[0]), int(plan.query_heads[-1]) + 1
        o_i = (o_i.astype(stats) / num_branches).astype(dtype)
        if o is None:  # every branch is a window: the groups tile the heads in order
            o, lse = o_i, lse_i
            continue
        o = jnp.concatenate([o[:, :, :a], o_i, o[:, :, b:]], axis=2)
        lse = jnp.concatenate([lse[:, :, :a], lse_i.astype(lse.dtype), lse[:, :, b:]], axis=2)
    return o.astype(dtype), lse


def add_windows(partial, kernel, args: KernelArgs, plans, mode: str, query, key, value,
                kv_mask, dropout_rng, segment_ids=None, sinks=None):
    """One-device dilated attention's ``(out, lse)``: ``partial = (o, lse, lse_lo)`` of
    the call's other branches (None when every branch is a window) mixed
    (:func:`mix`) with each sliding-window branch of ``plans``, run as one windowed
    kernel call (:func:`local_partial`; branch ``i`` draws dropout from
    ``fold_in(dropout_rng, len(plans) + i)``), and the [H] ``sinks`` (or None)."""
    windowed = [(p, local_partial(
        kernel, args, p, query, key, value, kv_mask,
        None if dropout_rng is None else jax.random.fold_in(dropout_rng, len(plans) + i),
        segment_ids)) for i, p in enumerate(plans) if p.branch.window is not None]
    o, lse = mix(partial, windowed, mode, len(plans), query.dtype)
    return softmax.sinks_on_output(o, lse, sinks)
