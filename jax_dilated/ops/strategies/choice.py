"""What ``strategy="auto"`` picks: the least estimated time among the strategies that can
serve (:func:`choose`, from :mod:`jax_dilated.ops.strategies.cost`), and
:func:`explain_strategy`, which prints the choice and the numbers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import jax.numpy as jnp

from jax_dilated.core.types import DTypeLike, Layout
from jax_dilated.ops.strategies.cost import StrategyCost, estimate, pricing_for
from jax_dilated.ops.strategies.hybrid import hybrid_cost
from jax_dilated.ops.strategies.operation import Operation, describe

__all__ = ["choose", "explain_strategy"]


def choose(op, *, batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
           head_dim: int, num_devices: int, dtype="float32", layout: str = "contiguous",
           platform: str | None = None, segment_ids: bool = False,
           axis_sizes: tuple[int, int] | None = None):
    """``(strategy, costs, why)``: the strategy ``"auto"`` picks for this call.

    Among the strategies that can serve, the one with the least estimated time,
    ``time ~ work x F + exposed bytes / bandwidth`` per device, where ``F`` is the
    flops of the whole attention (forward and backward, ``10 B T^2 H D`` dense;
    dilated: the branches' segments; block-sparse as dense, a bound) and
    ``flops / bandwidth`` the device kind's balance (``pricing._BALANCE``: flops one
    byte moved costs). On CPU no transfer overlaps and the work done in calls over a
    shard's tokens costs ``pricing._CPU_SEQ_SHARDED_WORK`` times as much (measured;
    see the constant). Ties (within 10%) go to the one holding less memory, then to the
    order ring, heads, per-branch mix, allgather. For dilated attention the
    per-branch mix of :func:`estimate` competes too; ``strategy`` is then its tuple.
    ``segment_ids``: the call has packed rows (only strategies that can serve them
    are considered; :func:`estimate`). ``axis_sizes = (P_a, P_b)``, ``P_a P_b =
    num_devices``: ``"hybrid"`` over the two axes competes too, both ways: heads over
    the first and the ring over the second (``"hybrid"``), and the other way round
    (``"hybrid_swapped"``, where ``P_a != P_b``); their ``strategy`` is ``("hybrid",
    heads axis size, ring axis size)`` (:func:`~.hybrid.hybrid_cost`).
    """
    op = op if isinstance(op, Operation) else describe(op)
    costs = estimate(op, batch=batch, seq_len=seq_len, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim,
                     num_devices=num_devices, dtype=dtype, layout=layout,
                     segment_ids=segment_ids, platform=platform)
    if axis_sizes is not None:
        if axis_sizes[0] * axis_sizes[1] != num_devices:
            raise ValueError(f"axis_sizes={tuple(axis_sizes)} must multiply to "
                             f"num_devices={num_devices}.")
        # heads over the first axis and the ring over the second, and the other way
        # round where that differs
        sizes = tuple(axis_sizes)
        splits = {"hybrid": sizes, "hybrid_swapped": sizes[::-1]}
        if sizes[0] == sizes[1]:
            del splits["hybrid_swapped"]
        for name, split in splits.items():
            costs[name] = hybrid_cost(op, batch=batch, seq_len=seq_len, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim,
                                      sizes=split, dtype=dtype, layout=layout,
                                      segment_ids=segment_ids)
    pricing = pricing_for(op, platform, batch, seq_len, num_heads, head_dim)
    times = {s: pricing.of(c) for s, c in costs.items() if c.reason is None}
    if not times:
        raise ValueError("no strategy can serve this call: " + "; ".join(
            f"{s}: {c.reason}" for s, c in costs.items()))
    best = min(times.values())
    order = ("ring", "heads", "per_branch", "hybrid", "hybrid_swapped", "allgather")
    near = [s for s in order if s in times and times[s] <= 1.1 * best]
    key = min(near, key=lambda s: (costs[s].held_bytes, order.index(s)))
    c = costs[key]
    exposed = pricing.exposed_of(c)
    why = (f"least estimated time (work {c.work:.3f} of {pricing.flops:.3g} flops, "
           f"{c.sent_bytes / 2**20:.2f} MiB sent, {exposed / 2**20:.2f} MiB of it "
           f"exposed at {pricing.balance:g} flop/byte)")
    if len(near) > 1:
        why += f"; within 10% of {[s for s in near if s != key]}, and holds least memory"
    return c.strategy, costs, why


def explain_strategy(fn: Callable[..., Any], query_shape: Sequence[int],
                     key_shape: Sequence[int] | None = None, *, num_devices: int,
                     dtype: DTypeLike = "float32", layout: Layout = "contiguous",
                     platform: str | None = None, file: TextIO | None = None,
                     quiet: bool = False, segment_ids: bool = False,
                     axis_sizes: tuple[int, int] | None = None,
                     ) -> tuple[str | tuple, dict[str, StrategyCost], str]:
    """Which strategy ``strategy="auto"`` picks for ``fn`` on these shapes, and why.

    Args:
      fn: the operation as given to ``jd.sharded`` (e.g.
        ``functools.partial(jd.dilated_attention, segment_lengths=..., ...)``).
      query_shape, key_shape: global ``[batch, seq, heads, head_dim]`` shapes
        (``key_shape`` defaults to ``query_shape``).
      num_devices: devices of the sequence axis.
      dtype, layout: of the call; platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (default:
        this machine's).
      file, quiet: where to print (default stdout); ``quiet`` only returns.
      segment_ids: whether the call has packed rows (``segment_ids=``).
      axis_sizes: ``(P_a, P_b)`` of a two-axis mesh (``jd.sharded(seq_axis=(a, b))``):
        ``"hybrid"`` over it is priced beside the one-axis strategies on the same
        ``num_devices``.

    Returns:
      ``(strategy, {strategy: StrategyCost}, why)``.

    Example:
      >>> import functools, jax_dilated as jd
      >>> pick, costs, why = jd.explain_strategy(
      ...     functools.partial(jd.ring_attention, is_causal=True), (1, 4096, 8, 64),
      ...     (1, 4096, 2, 64), num_devices=4, layout="zigzag", quiet=True)
      >>> pick in ("ring", "heads", "allgather"), costs["heads"].reason is None
      (True, True)
    """
    key_shape = tuple(query_shape) if key_shape is None else tuple(key_shape)
    b, t, h, d = query_shape
    hkv = key_shape[2]
    pick, costs, why = choose(fn, batch=b, seq_len=t, num_heads=h, num_kv_heads=hkv,
                              head_dim=d, num_devices=num_devices, dtype=dtype,
                              layout=layout, platform=platform,
                              segment_ids=segment_ids, axis_sizes=axis_sizes)
    if not quiet:
        out = sys.stdout if file is None else file
        op = describe(fn)
        print(f"strategy for {op.name} on query {tuple(query_shape)}, key {key_shape}, "
              f"{jnp.dtype(dtype).name}, {num_devices} devices, layout={layout!r}: "
              f"{pick} - {why}", file=out)
        for s, c in costs.items():
            state = "can serve" if c.reason is None else f"cannot serve: {c.reason}"
            if c.note:
                state += f" ({c.note})"
            if s.startswith("hybrid"):
                s = f"hybrid {c.strategy[1]} x {c.strategy[2]}"
            elif not isinstance(c.strategy, str):
                s = f"per-branch {c.strategy}"
            print(f"  {s:<9} sent {c.sent_bytes / 2**20:9.2f} MiB/device, held "
                  f"{c.held_bytes / 2**20:9.2f} MiB/device, "
                  f"{'overlapped' if c.overlap else 'not overlapped'}, work share "
                  f"{c.work:.3f}; {state}", file=out)
    return pick, costs, why
