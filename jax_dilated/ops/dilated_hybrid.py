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
* in head_groups mode, where the slices run different branches (and so would run
  different rings), every device runs each branch that spans devices (or is a
  sliding window) in one ring over ``b``, on as many head *slots* as the slice with
  the most of its heads holds, filled with its own heads of the branch (traced
  indices) and padded, the padding's results dropped (:func:`_slotted`); the local
  branches run as a ``lax.switch``, as above.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.core import softmax, validation
from jax_dilated.ops import dilated_window, distributed, head_parallel
from jax_dilated.ops.dilated_programs import DilatedCall

__all__ = ["hybrid", "head_order", "Slices", "slice_order", "computed_heads",
           "heads_reason"]


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


class Slices(NamedTuple):
    """How hybrid deals a call's heads over the ``P_a`` devices of ``a``
    (:func:`slice_order`): ``units`` kv units (each kv head repeated ``units /
    num_kv_heads`` times; a unit is the query heads that read one copy), their
    ``order``, and each slice's ``plans`` (one entry per branch, None where none of
    its heads runs the branch)."""

    units: int
    order: np.ndarray
    plans: list

    @property
    def uniform(self) -> bool:
        """Whether every slice runs the same plan (one program for all)."""
        return len({_key(p) for p in self.plans}) == 1


def slice_order(call: DilatedCall, *, seq_len: int, num_heads: int, num_kv_heads: int,
                size_a: int) -> Slices:
    """The :class:`Slices` under which every one of the ``size_a`` slices runs one
    plan: the fewest units ``P_a`` allows
    (:func:`~jax_dilated.ops.head_parallel.kv_repeat`), in place where the contiguous
    slices already agree, else dealt out (:func:`head_order`); where no order of those
    serves, more units (kv heads repeated further, up to one unit per query head),
    whose classes of equal plans are finer. Where none serves: the fewest units in
    place, every slice then running its own plan (module docstring)."""
    def dealt(units, order):
        return Slices(units, order, _slice_plans(call, seq_len, num_heads, units, size_a,
                                                 order))

    base = num_kv_heads * head_parallel.kv_repeat(num_kv_heads, size_a)
    for units in range(base, num_heads + 1, base):
        if num_heads % units:
            continue
        found = dealt(units, np.arange(units))
        if found.uniform:
            return found
        order = head_order(call, seq_len=seq_len, num_heads=num_heads, units=units,
                           size_a=size_a)
        if order is not None:
            return dealt(units, order)
    return dealt(base, np.arange(base))


def computed_heads(call: DilatedCall, slices: Slices, *, seq_len: int,
                   size_b: int) -> list[tuple[int, int]]:
    """Per branch, ``(heads, computed)``: the query heads that run it, and the heads
    hybrid computes for it over the slices of ``slices``, more where head_groups slices
    pad a branch that spans the ``size_b`` devices of the ring (:func:`_slotted`)."""
    slotted = call.mode == "head_groups" and not slices.uniform
    sharded = distributed.shard_branches(call.branches, local_len=seq_len // size_b,
                                         num_devices=size_b)
    out = []
    for i, sb in enumerate(sharded):
        counts = [0 if p[i] is None else len(p[i].query_heads) for p in slices.plans]
        pads = slotted and not (sb.is_local and sb.cut.window is None)
        out.append((sum(counts), max(counts) * len(slices.plans) if pads else sum(counts)))
    return out


def heads_reason(num_heads: int, size_a: int, axis, heads_of: str = "") -> str | None:
    """Why ``num_heads`` query heads (``heads_of``: whose, in words) cannot be split over
    the ``size_a`` devices of the head-exchange axis ``axis`` (None when they can)."""
    if num_heads % size_a == 0:
        return None
    return (f"strategy='hybrid' needs num_heads ({num_heads}{heads_of}) divisible by the "
            f"{size_a} devices of its head-exchange axis {axis!r}")


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
    slices = slice_order(call, seq_len=seq_len, num_heads=h, num_kv_heads=hkv,
                         size_a=size_a)
    units, order, per_slice = slices
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
    sharded = distributed.shard_branches(call.branches, local_len=q.shape[1],
                                         num_devices=size_b)
    run = functools.partial(distributed.sharded_dilated, args=call.args, mode=call.mode,
                            axis_name=b, num_devices=size_b, kernel=call.kernel,
                            lse_grad=lse_grad)
    if slices.uniform:
        plans, kept = _present(per_slice[0], sharded)
        out, lse = run(plans, kept, q, k, v, mask, rng)
        out = _of_all_branches(out, len(plans), call)
    elif call.mode == "longnet":  # every slice its own offsets (module docstring)
        out, lse = run(_traced_plans(per_slice, jax.lax.axis_index(a)), sharded, q, k, v,
                       mask, rng, local_variants=(a, per_slice))
    else:  # head_groups: every slice its own branches (module docstring)
        out, lse = _slotted(call, run, per_slice, sharded, q, k, v, mask, rng, a)
    out, lse = head_parallel.heads_to_seq(out, a), head_parallel.heads_to_seq(lse, a)
    if permuted:
        back = np.argsort(order)
        out, lse = (_permute_units(x, back, units) for x in (out, lse))
    return out, lse


def _key(plans):
    """What makes two slices' plans (one entry per branch, None where absent) equal."""
    return tuple(None if p is None else head_parallel.plan_key([p]) for p in plans)


def _present(plans, sharded):
    """The plans (one entry per branch, None where these heads run none of it:
    head_groups) and :func:`~.distributed.shard_branches` of the branches run."""
    mine = [i for i, p in enumerate(plans) if p is not None]
    return [plans[i] for i in mine], [sharded[i] for i in mine]


def _of_all_branches(out, ran: int, call: DilatedCall):
    """head_groups: ``out`` of ``ran`` of the call's branches, divided by all of them."""
    if call.mode != "head_groups" or ran == len(call.branches):
        return out
    return (out * (ran / len(call.branches))).astype(out.dtype)


def _slotted(call: DilatedCall, run, per_slice, sharded, q, k, v, mask, rng, axis_a):
    """head_groups where the slices of ``axis_a`` hold different groups: ``(out,
    lse)`` of this device's heads (``run``: ``sharded_dilated`` over ``b``, its
    keywords given).

    The local branches (no collectives) run as a ``lax.switch`` over the slices' own
    plans. A branch whose segments span devices (or a sliding window) runs as one
    ring over ``b`` on every device, on as many head *slots* as the slice with the
    most of its heads holds: each device fills them with its heads of the branch
    (traced indices) and pads the rest, whose results are dropped. The padding is
    work thrown away, the price of one program for every slice."""
    num_branches = len(call.branches)
    ring = {key: run.keywords[key] for key in ("axis_name", "num_devices", "kernel",
                                                "lse_grad")}
    local = [i for i, sb in enumerate(sharded) if sb.is_local and sb.cut.window is None]

    def local_branches(plans):
        plans, kept = _present(plans, sharded)
        if not plans:  # none of these heads runs a local branch
            return (jnp.zeros_like(q),  # (like q: varying over the mesh as q is)
                    jnp.full_like(q[..., 0], -jnp.inf, softmax.stats_dtype(q.dtype)))
        out, lse = run(plans, kept, q, k, v, mask, rng)
        return _of_all_branches(out, len(plans), call), lse

    out, lse = head_parallel.by_device(
        axis_a, [(_key([p[i] for i in local]),
                  [p[i] if i in local else None for i in range(num_branches)])
                 for p in per_slice], local_branches)
    mine = jax.lax.axis_index(axis_a)
    stats = softmax.stats_dtype(q.dtype)
    out = out.astype(stats)
    for i in range(num_branches):
        slices = [p[i] for p in per_slice]
        slots = max(0 if p is None else len(p.query_heads) for p in slices)
        if i in local or not slots:
            continue
        heads, kv_heads, slot_of = (
            jnp.asarray(np.stack(t))[mine]
            for t in zip(*(_slot_tables(p, slots, q.shape[2]) for p in slices)))
        first = next(p for p in slices if p is not None)
        offset = np.full(slots, first.offsets[0])  # a group's heads share one offset
        plan = dataclasses.replace(first, query_heads=np.arange(slots), offsets=offset,
                                   kv_offsets=offset, kv_heads=np.arange(slots), kv_group=1)
        qs, ks, vs = (jnp.take(x, t, axis=2) for x, t in ((q, heads), (k, kv_heads),
                                                           (v, kv_heads)))
        branch_rng = None if rng is None else jax.random.fold_in(rng, i)
        if first.branch.window is not None:
            o_i, lse_i, _ = dilated_window.ring_partial(call.args, plan, qs, ks, vs, mask,
                                                        branch_rng, **ring)
        else:
            (o_i, lse_i, _), = distributed.branch_partials(
                [plan], [sharded[i]], qs, ks, vs, mask, call.args, dropout_rng=branch_rng,
                **ring)
        held, take = slot_of >= 0, jnp.maximum(slot_of, 0)  # the heads it writes
        o_i = jnp.take(o_i.astype(stats), take, axis=2) / num_branches
        out = jnp.where(held[:, None], o_i, out)
        lse = jnp.where(held, jnp.take(lse_i.astype(lse.dtype), take, axis=2), lse)
    return out.astype(q.dtype), lse


def _slot_tables(plan, slots: int, num_heads: int):
    """One slice's ``(heads [slots], kv heads [slots], slot of each head [H_local])`` of
    a branch (``plan``: its heads there, or None): padded slots read head 0 (their
    results are dropped), a head the branch does not run has slot -1."""
    heads = np.zeros(slots, np.int32)
    kv_heads = np.zeros(slots, np.int32)
    slot_of = np.full(num_heads, -1, np.int32)
    if plan is not None:
        n = len(plan.query_heads)
        heads[:n] = plan.query_heads
        kv_heads[:n] = plan.kv_heads[np.arange(n) // plan.kv_group]
        slot_of[plan.query_heads] = np.arange(n)
    return heads, kv_heads, slot_of


def _slice_plans(call, seq_len: int, num_heads: int, units: int, size_a: int, order):
    """Every slice of ``a``'s plans (one entry per branch, None where none of its heads
    runs the branch) with the units in ``order``."""
    per, heads = num_heads // units, num_heads // size_a
    global_heads = (order[:, None] * per + np.arange(per)[None, :]).reshape(-1)
    local_kv = units // size_a
    return [head_parallel.head_plans(call.branches, seq_len, num_heads,
                                     global_heads[d * heads:(d + 1) * heads], local_kv,
                                     call.mode, call.head_offsets, keep_empty=True)
            for d in range(size_a)]


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
