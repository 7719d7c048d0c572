"""Dilated attention's ``"hybrid"`` strategy (docs/semantics.md, section 8, "Hybrid"):
with the sequence sharded over two mesh axes ``(a, b)``, ``b`` major, an all-to-all
over ``a`` to whole ring chunks of ``H / P_a`` heads, distributed dilated attention of
those heads over ``b`` (:func:`jax_dilated.ops.distributed.sharded_dilated`; a branch
whose segments span devices rings over the devices of ``b`` it spans), and back.

The ring over ``b`` must be one program on every device of ``a``: a per-device choice
(``lax.switch``) would hold collectives that the devices of the other head slices
never reach. So every head slice should run the same plan (the same offsets, and in
head_groups mode the same groups, at every local head). Where the contiguous slices
differ, the heads are first put in an order that deals each class of heads with equal
plans (in units of the heads that read one kv head) evenly over ``a``
(:func:`head_order`), and put back afterwards. Where no order can:

* in longnet mode, where every head runs every branch and the slices differ by their
  offsets alone, each device runs its own offsets (:func:`_traced_plans`): a
  spanning branch gathers and scatters its dilated rows at traced offsets around one
  ring (in dilated coordinates the causal rule does not depend on the offset), and
  the local branches, which hold no collectives, run as a ``lax.switch`` over the
  slices' plans;
* in head_groups mode, where the slices would run different branches (and so
  different rings), the call is refused with the reason.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.core import validation
from jax_dilated.ops import distributed, head_parallel
from jax_dilated.ops.dilated_programs import DilatedCall

__all__ = ["hybrid", "head_order", "slice_order", "heads_reason", "no_order_reason"]


def head_order(call: DilatedCall, *, seq_len: int, num_heads: int, units: int,
               size_a: int) -> np.ndarray | None:
    """An order of the ``units`` kv units (``num_heads / units`` consecutive query heads
    each, the heads of one (repeated) kv head) after which every one of the ``size_a``
    contiguous slices runs the same plan: each class of units with equal plans (their
    heads' branches and offsets) dealt out evenly, slices in class order. None where
    some class does not divide by ``size_a``."""
    plans = call.plans(seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_heads)
    runs = [[] for _ in range(num_heads)]  # head -> its (branch, offset) pairs
    for i, plan in enumerate(plans):
        for j, o in zip(plan.query_heads.tolist(), plan.offsets.tolist()):
            runs[j].append((i, o))
    per = num_heads // units
    classes: dict = {}
    for u in range(units):
        classes.setdefault(tuple(tuple(runs[u * per + t]) for t in range(per)), []).append(u)
    if any(len(c) % size_a for c in classes.values()):
        return None
    ordered = sorted(classes.values(), key=lambda c: c[0])  # head groups stay in order
    return np.array([u for d in range(size_a) for c in ordered
                     for u in c[d * len(c) // size_a:(d + 1) * len(c) // size_a]])


def slice_order(call: DilatedCall, *, seq_len: int, num_heads: int, num_kv_heads: int,
                size_a: int) -> tuple[int, np.ndarray] | None:
    """``(units, order)``: the kv units (each kv head repeated ``units / num_kv_heads``
    times; a unit is the query heads that read one copy) and their order under which
    every one of the ``size_a`` slices runs one plan: the fewest units ``P_a`` allows
    (:func:`~jax_dilated.ops.head_parallel.kv_repeat`), in place where the contiguous
    slices already agree, else dealt out (:func:`head_order`); where no order of those
    serves, more units (kv heads repeated further, up to one unit per query head),
    whose classes of equal plans are finer. Where none serves in longnet mode: the
    fewest units in place, the slices then running their own offsets (module
    docstring). None where nothing serves (head_groups mode)."""
    base = num_kv_heads * head_parallel.kv_repeat(num_kv_heads, size_a)
    for units in range(base, num_heads + 1, base):
        if num_heads % units:
            continue
        order = np.arange(units)
        if len({k for k, _ in _variants(call, seq_len, num_heads, units, size_a,
                                        order)}) == 1:
            return units, order
        order = head_order(call, seq_len=seq_len, num_heads=num_heads, units=units,
                           size_a=size_a)
        if order is not None:
            return units, order
    return (base, np.arange(base)) if call.mode == "longnet" else None


def heads_reason(num_heads: int, size_a: int, axis, heads_of: str = "") -> str | None:
    """Why ``num_heads`` query heads (``heads_of``: whose, in words) cannot be split over
    the ``size_a`` devices of the head-exchange axis ``axis`` (None when they can)."""
    if num_heads % size_a == 0:
        return None
    return (f"strategy='hybrid' needs num_heads ({num_heads}{heads_of}) divisible by the "
            f"{size_a} devices of its head-exchange axis {axis!r}")


def no_order_reason(axis, *, num_heads: int, size_a: int) -> str:
    """Why hybrid cannot run a call for which :func:`slice_order` is None."""
    return (f"strategy='hybrid' in head_groups mode needs every device of its "
            f"head-exchange axis {axis!r} to run the same groups at each of its "
            f"{num_heads // size_a} heads, and no order of the {num_heads} heads deals "
            f"them so over {size_a} devices (even with every kv head repeated per query "
            f"head): every set of heads with equal plans must divide by {size_a}. Use "
            f"fewer devices on {axis!r}, mode='longnet', or strategy='ring' / 'heads' "
            f"over one axis.")


def _permute_units(x, order, units: int):
    """``x`` [B, n, H, ...] with its heads in ``units`` blocks reordered by ``order``."""
    b, n, h = x.shape[:3]
    blocks = x.reshape(b, n, units, h // units, *x.shape[3:])
    return jnp.take(blocks, order, axis=2).reshape(x.shape)


def hybrid(call: DilatedCall, query, key, value, kv_mask, rng, axes, lse_grad: bool):
    """``(out [B, n, H, D], lse [B, n, H])`` of the ``"hybrid"`` strategy on this
    device's piece (module docstring); ``rng``: the dropout key or None."""
    a, b = axes
    size_a = validation.axis_size(a, "dilated_attention(seq_axis=(a, b))")
    size_b = validation.axis_size(b, "dilated_attention(seq_axis=(a, b))")
    h, hkv = query.shape[2], key.shape[2]
    why = heads_reason(h, size_a, a)
    if why:
        raise ValueError(f"{why}.")
    seq_len = query.shape[1] * size_a * size_b
    found = slice_order(call, seq_len=seq_len, num_heads=h, num_kv_heads=hkv, size_a=size_a)
    if found is None:
        raise ValueError(no_order_reason(a, num_heads=h, size_a=size_a))
    units, order = found
    per_slice = [plans for _, plans in _variants(call, seq_len, h, units, size_a, order)]
    permuted = not np.array_equal(order, np.arange(units))
    k, v = key, value
    if units != hkv:  # each kv head repeated, so that the units divide by P_a
        k, v = (jnp.repeat(x, units // hkv, axis=2) for x in (key, value))
    q = query
    if permuted:
        q, k, v = (_permute_units(x, order, units) for x in (q, k, v))
    q, k, v, mask, _ = head_parallel.to_heads(q, k, v, kv_mask, None, a, size_a)
    if rng is not None:  # every head slice draws its own masks
        rng = jax.random.fold_in(rng, jax.lax.axis_index(a))
    plans, local_variants = per_slice[0], None
    if any(head_parallel.plan_key(p) != head_parallel.plan_key(plans) for p in per_slice):
        # longnet: every slice its own offsets (module docstring)
        plans = _traced_plans(per_slice, jax.lax.axis_index(a))
        local_variants = (a, per_slice)
    sharded_branches = distributed.shard_branches(call.branches, local_len=q.shape[1],
                                                  num_devices=size_b)
    resolved = [p.branch for p in call.plans(seq_len=seq_len, num_heads=h,
                                             num_kv_heads=h)]
    kept, i = [], 0  # the branches these heads run (head_groups: their groups'), in order
    for plan in plans:
        while resolved[i] != plan.branch:
            i += 1
        kept.append(sharded_branches[i])
        i += 1
    out, lse = distributed.sharded_dilated(
        plans, kept, q, k, v, mask, rng, args=call.args, mode=call.mode, axis_name=b,
        num_devices=size_b, kernel=call.kernel, lse_grad=lse_grad,
        local_variants=local_variants)
    if call.mode == "head_groups" and len(plans) != len(call.branches):
        # divided by the branches of these heads' groups, not by all of them
        out = (out * (len(plans) / len(call.branches))).astype(q.dtype)
    out, lse = head_parallel.heads_to_seq(out, a), head_parallel.heads_to_seq(lse, a)
    if permuted:
        back = np.argsort(order)
        out, lse = (_permute_units(x, back, units) for x in (out, lse))
    return out, lse


def _variants(call, seq_len: int, num_heads: int, units: int, size_a: int, order):
    """``[(plan key, plans)]`` of each slice of ``a`` with the units in ``order``."""
    per, heads = num_heads // units, num_heads // size_a
    global_heads = (order[:, None] * per + np.arange(per)[None, :]).reshape(-1)
    local_kv = units // size_a
    out = []
    for d in range(size_a):
        plans = head_parallel.head_plans(call.branches, seq_len, num_heads,
                                         global_heads[d * heads:(d + 1) * heads], local_kv,
                                         call.mode, call.head_offsets)
        out.append((head_parallel.plan_key(plans), plans))
    return out


def _traced_plans(per_slice, mine):
    """Every branch's plan on this device's slice of heads, given each slice's plans
    (``per_slice[j]``, longnet mode: the same branches and heads, offsets that differ)
    and the index ``mine`` (traced) of this device's: static where the slices agree,
    else with the offsets (and the gathered kv heads' offsets) picked by ``mine``. The
    kv heads are grouped as every slice allows (the largest group dividing each
    slice's own, :func:`~jax_dilated.core.branch_plans.kv_head_plan`)."""
    out = []
    for plans in zip(*per_slice):  # one branch, every slice's plan
        first = plans[0]
        if all(np.array_equal(p.offsets, first.offsets) for p in plans):
            out.append(first)
            continue
        group = math.gcd(*(p.kv_group for p in plans))
        offsets = jnp.asarray(np.stack([p.offsets for p in plans]))[mine]
        heads = np.arange(0, len(first.query_heads), group)  # the first of each group
        out.append(dataclasses.replace(
            first, offsets=offsets, kv_offsets=offsets[::group],
            kv_heads=first.kv_heads[heads // first.kv_group], kv_group=group))
    return out
