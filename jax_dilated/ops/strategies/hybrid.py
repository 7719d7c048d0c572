"""The ``"hybrid"`` strategy's local program for exact and block-sparse attention: head
exchange and ring together over two mesh axes (docs/semantics.md, section 8, "Hybrid"); dilated
attention runs it itself (:func:`jax_dilated.dilated_attention` with ``seq_axis=(a,
b)``).

``jd.sharded(fn, mesh, seq_axis=(a, b), strategy="hybrid")`` shards the sequence over
both axes, ``b`` major: device ``(i_b, i_a)`` holds the contiguous piece ``i_b P_a +
i_a`` of ``P_a P_b`` pieces. Inside ``shard_map``:

1. an all-to-all over ``a`` turns the ``P_a`` pieces of ring chunk ``i_b`` into the
   whole chunk (``P_a n`` tokens) of ``H / P_a`` heads; kv heads are repeated first
   only as far as ``P_a`` needs (:func:`~jax_dilated.ops.head_parallel.kv_repeat`), the
   padding mask and document ids are gathered over ``a``;
2. the chunks are re-laid out over ``b`` (zigzag, striped: O(chunk) moved per device)
   and the operation's own ring runs over ``b`` on those heads;
3. the output comes back to the layout, then to pieces by an all-to-all over ``a``.

Each device sends its q, k, v shards and the output once over ``a`` (about ``(P_a -
1) / P_a`` of them) and key/value blocks of ``H_kv' / P_a`` heads around the ring over
``b`` (``P_b`` of them in the forward with the XLA kernel's ring steps, which bring
the block home for the backward), against blocks of all kv heads around a ring over
all ``P = P_a P_b`` devices (``(6 P_b - 2) K'`` against ``(6 P - 2) K`` forward and
backward in float32, :func:`hybrid_cost`); it holds no array of the global sequence
length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.core import layouts, validation
from jax_dilated.ops import dilated_hybrid, head_parallel
from jax_dilated.ops.block_sparse_plan import resolve_mask
from jax_dilated.ops.strategies.cost import StrategyCost, estimate
from jax_dilated.ops.strategies.pricing import _branch_flops
from jax_dilated.ops.strategies.operation import (TORCHSCALE_RING, Operation, dilated_call,
                                                  torchscale)

__all__ = ["hybrid_unservable", "hybrid_local", "hybrid_cost"]


def hybrid_unservable(op: Operation, *, num_heads: int, size_a: int,
                      heads_of: str = "", axis="a") -> str | None:
    """Why ``"hybrid"`` cannot run ``op`` with ``num_heads`` query heads and ``size_a``
    devices on the head-exchange axis (None when it can)."""
    if op.kind not in ("exact", "dilated", "block_sparse"):
        return (f"strategy='hybrid' runs the library's operations (ring_attention, "
                f"dilated_attention, block_sparse_attention), got {op.name}")
    if torchscale(op):
        return f"strategy='hybrid' rings over its second axis, and {TORCHSCALE_RING}"
    return dilated_hybrid.heads_reason(num_heads, size_a, axis, heads_of)


def _padded_work(op: Operation, slices: dilated_hybrid.Slices, *, batch: int,
                 seq_len: int, num_heads: int, head_dim: int, size_b: int) -> float:
    """Hybrid dilated attention's work over its heads' own (1 unless head_groups slices
    pad a spanning branch's heads, :func:`.dilated_hybrid.computed_heads`), each
    branch weighted by its flops."""
    heads = dilated_hybrid.computed_heads(dilated_call(op), slices, seq_len=seq_len,
                                          size_b=size_b)
    flops = _branch_flops(op, batch, seq_len, num_heads, head_dim)  # all heads each
    own = sum(f * mine for f, (mine, _) in zip(flops, heads))
    return sum(f * computed for f, (_, computed) in zip(flops, heads)) / max(own, 1.0)


def hybrid_local(op: Operation, q, k, v, mask, segment_ids, sinks, *, axes: tuple[str, str],
                 sizes: tuple[int, int], layout: str):
    """Inside ``shard_map``, the pieces of the sequence sharded over ``axes = (a, b)``
    (``b`` major): the ``"hybrid"`` strategy (module docstring).

    ``q`` [B, n, H, D], ``k``/``v`` [B, n, H_kv, D], ``mask`` and ``segment_ids`` None or
    [B, n], ``sinks`` None or [H] (replicated); ``layout`` the ring's over ``b``.
    Returns the output [B, n, H, D], or ``(output, lse [B, n, H])`` when ``op`` returns
    the log-sum-exp.
    """
    a, b = axes
    size_a, size_b = sizes
    h = q.shape[2]
    q, k, v, mask, ids = head_parallel.to_heads(q, k, v, mask, segment_ids, a, size_a)
    if sinks is not None:  # this device's heads of them
        sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(a) * (h // size_a),
                                             h // size_a)
    # a chunk of the ring over b is contiguous now: re-laid out in place (zigzag; striped
    # where the chunk splits over the ring). A striped chunk that does not split runs
    # as a contiguous ring, exact all the same: the layout balances causal work only.
    in_shard = layout == "zigzag" or (layout == "striped" and q.shape[1] % size_b == 0)
    if in_shard:
        q, k, v, mask, ids = (None if x is None else
                              layouts.shard_to_layout(x, b, size_b, layout)
                              for x in (q, k, v, mask, ids))
    extra = {key: val for key, val in op.options.items()
             if key not in ("seq_axis", "axis_name", "layout", "kv_mask", "segment_ids",
                            "sinks")}
    if op.kind == "block_sparse":
        extra["pattern"] = _pattern_of_heads(extra, h, a, size_a, q.shape[1] * size_b)
    if ids is not None:
        extra["segment_ids"] = ids
    if sinks is not None:
        extra["sinks"] = sinks
    out = op.fn(q, k, v, kv_mask=mask, seq_axis=b,
                layout=layout if in_shard else "contiguous", **extra)
    outs = out if isinstance(out, tuple) else (out,)
    if in_shard:
        outs = tuple(layouts.shard_from_layout(x, b, size_b, layout) for x in outs)
    outs = tuple(head_parallel.heads_to_seq(x, a) for x in outs)
    return outs if isinstance(out, tuple) else outs[0]


def _pattern_of_heads(options, num_heads: int, axis_a, size_a: int, seq_len: int):
    """Block-sparse attention's pattern for this device's ``H / P_a`` heads: the shared
    mask as it is; a per-head mask cut to the heads, static where it is the same on
    every device of ``a``, else this device's slice as a traced mask (the lists cannot
    differ between devices: a static choice per device would put the ring over ``b``
    inside a per-device switch, whose collectives the other head slices never reach;
    a traced mask makes every block a ``lax.cond`` instead)."""
    bs = validation.check_positive_int("block_size", options["block_size"])
    nb = -(-seq_len // bs)
    mask = resolve_mask(options["pattern"], nb, nb, num_heads)
    if mask.shape[0] == 1:
        return mask[0]
    heads = num_heads // size_a
    slices = [np.asarray(mask[d * heads:(d + 1) * heads]) for d in range(size_a)]
    if isinstance(mask, np.ndarray) and all(np.array_equal(x, slices[0]) for x in slices):
        return slices[0]
    return jax.lax.dynamic_slice_in_dim(jnp.asarray(mask), jax.lax.axis_index(axis_a) * heads,
                                        heads)


def hybrid_cost(op: Operation, *, batch: int, seq_len: int, num_heads: int,
                num_kv_heads: int, head_dim: int, sizes: tuple[int, int], dtype="float32",
                layout: str = "contiguous", segment_ids: bool = False) -> StrategyCost:
    """The per-device :class:`~.pricing.StrategyCost` of ``"hybrid"`` over ``sizes = (P_a,
    P_b)`` (forward and backward; :func:`~.cost.estimate`'s conventions: ``e`` bytes per
    element, ``n = T / (P_a P_b)``, ``Q = B n H D e`` and ``K' = B n H_kv R D e`` one
    piece of queries and of kv heads repeated ``R`` times for ``P_a``).

    The all-to-alls over ``a`` move ``(P_a - 1) / P_a`` of q, k', v' in and the output
    back, forward and again backward, ``2 (P_a - 1) / P_a (2 Q + 2 K')``, not
    overlapped, and hold the exchanged copies, ``2 (2 Q + 2 K')``; the rest is the
    operation's ring over ``P_b`` devices on ``H / P_a`` heads of the whole sequence
    (:func:`~.cost.estimate`'s ``"ring"``: for exact attention ``(6 P_b - 2) K'`` in
    float32 with the XLA kernel's ring steps, whose forward sends the block ``P_b``
    times, overlapped), its work a ``1 / P_a`` slice of it (more where head_groups
    slices pad the heads of a spanning branch, :func:`_padded_work`). Forward only
    (``forward_bytes``): half the exchange and the ring's forward. ``segment_ids``: the
    call has packed rows (dilated attention then needs no plan shared by the slices).
    """
    size_a, size_b = sizes
    e = jnp.dtype(dtype).itemsize
    n = seq_len // (size_a * size_b)
    rep = head_parallel.kv_repeat(num_kv_heads, size_a)
    why = hybrid_unservable(op, num_heads=num_heads, size_a=size_a)
    # dilated head slices should share a plan, which may need kv heads repeated further
    # (packed rows run whole sequences of some heads: no plan to share)
    dealt = None
    if why is None and op.kind == "dilated" and not segment_ids:
        dealt = dilated_hybrid.slice_order(dilated_call(op), seq_len=seq_len,
                                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                                           size_a=size_a)
        rep = dealt.units // num_kv_heads
    q = batch * n * num_heads * head_dim * e
    k = batch * n * num_kv_heads * rep * head_dim * e
    # the ring over b of this device's H / P_a heads; in head_groups mode, whose slices
    # hold different groups (and may hold fewer heads than branches), a 1 / P_a share
    # of the ring of all heads
    groups = op.kind == "dilated" and op.options.get("mode") == "head_groups"
    covered = size_a if groups else 1  # slices of heads the ring's estimate covers
    if why is None:
        ring = estimate(op, batch=batch, seq_len=seq_len,
                        num_heads=num_heads * covered // size_a,
                        num_kv_heads=max(1, num_kv_heads * rep * covered // size_a),
                        head_dim=head_dim, num_devices=size_b, dtype=dtype,
                        layout=layout)["ring"]
        why = ring.reason
    else:
        ring = StrategyCost("ring", 0.0, 0.0, True, 1.0)
    share = 1.0 / size_a  # of the ring's work, times the padding of head_groups slices
    if why is None and dealt is not None:
        share *= _padded_work(op, dealt, batch=batch, seq_len=seq_len, num_heads=num_heads,
                              head_dim=head_dim, size_b=size_b)
    exchanged = 2 * (size_a - 1) / size_a * (2 * q + 2 * k)
    return StrategyCost(("hybrid", size_a, size_b), exchanged + ring.sent_bytes / covered,
                        ring.held_bytes / covered + 2 * (2 * q + 2 * k), False,
                        ring.work * share, why, small_work=ring.small_work * share,
                        overlapped_bytes=ring.overlappable / covered,
                        forward_bytes=exchanged / 2 + (ring.forward_bytes or 0.0) / covered)
