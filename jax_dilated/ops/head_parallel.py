"""Head parallelism inside ``shard_map``: the all-to-all between sequence shards and
head shards, and dilated attention of this device's heads over the whole sequence.

The ``"heads"`` strategy (:mod:`jax_dilated.ops.strategies.heads`) builds on these, and so
does dilated attention with ``seq_axis`` (:func:`over_heads`: its ``"heads"``
strategy, and packed rows under every strategy), which
:func:`jax_dilated.dilated_attention` calls: this module sits below both (it imports
neither), so neither import goes in a circle.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends import KernelArgs
from jax_dilated.core import branch_plans, validation
from jax_dilated.ops import dilated_packed
from jax_dilated.ops.dilated_programs import DilatedCall, one_device

__all__ = ["seq_to_heads", "heads_to_seq", "gather_tokens", "heads_unservable",
           "kv_repeat", "kernel_args",
           "head_plans", "plan_key", "distinct_variants", "device_choice", "by_device",
           "to_heads", "over_heads"]


def seq_to_heads(x, axis_name: str):
    """Inside ``shard_map``: contiguous sequence shard ``[B, n, H, ...]`` -> head shard
    ``[B, T, H / P, ...]`` (device ``d`` gets heads ``[d H/P, (d+1) H/P)`` of the
    whole sequence, in token order). One ``all_to_all``; its transpose is
    :func:`heads_to_seq`."""
    return jax.lax.all_to_all(x, axis_name, 2, 1, tiled=True)


def heads_to_seq(x, axis_name: str):
    """Inverse of :func:`seq_to_heads`: ``[B, T, H / P, ...]`` -> ``[B, n, H, ...]``."""
    return jax.lax.all_to_all(x, axis_name, 1, 2, tiled=True)


def gather_tokens(x, axis_name: str):
    """All devices' shards ``[B, n, ...]`` of a per-token array -> ``[B, T, ...]`` in
    shard order (keys, values, the padding mask; any int per token alike)."""
    return None if x is None else jax.lax.all_gather(x, axis_name, axis=1, tiled=True)


def heads_unservable(num_heads: int, num_devices: int, heads_of: str = "") -> str | None:
    """Why the ``"heads"`` strategy cannot split ``num_heads`` over ``num_devices``
    (None when it can); ``heads_of`` says whose heads they are in the message."""
    if num_heads % num_devices == 0:
        return None
    return (f"strategy='heads' needs num_heads ({num_heads}{heads_of}) divisible by the "
            f"{num_devices} devices of the sequence axis")


def kv_repeat(num_kv_heads: int, num_devices: int) -> int:
    """How often each kv head is repeated so that the kv heads divide by ``P``."""
    return 1 if num_kv_heads % num_devices == 0 else (
        num_devices // math.gcd(num_kv_heads, num_devices))


def kernel_args(options, head_dim: int) -> KernelArgs:
    """The kernel arguments of an operation's bound ``options`` (scale, causality,
    blocks, soft-cap), validated: the strategies that call kernels directly on
    ``jd.sharded``'s operations (``"allgather"``, ``"heads"``) read them here, once
    per call."""
    block_q, block_k = validation.check_block_sizes(options.get("block_q"),
                                                    options.get("block_k"))
    return KernelArgs(scale=validation.check_scale(options.get("scale"), head_dim),
                      is_causal=validation.check_flag("is_causal",
                                                      options.get("is_causal", False)),
                      block_q=block_q, block_k=block_k,
                      logit_soft_cap=validation.check_logit_soft_cap(
                          options.get("logit_soft_cap")))


def head_plans(branches, seq_len: int, num_heads: int, heads, local_kv: int, mode: str,
                rule: str, keep_empty: bool = False):
    """The branch plans of the query heads ``heads`` (global indices, ascending; local
    head ``i`` is global head ``heads[i]``, repeats allowed), numbered locally but with
    their *global* offsets (and head groups); ``local_kv`` kv heads held locally, local
    query head ``i`` reading kv head ``i // (len(heads) / local_kv)``. A branch none
    of ``heads`` runs (head_groups) is left out, or with ``keep_empty`` given as None
    (one entry per branch)."""
    full = branch_plans.plan_branches(branches, seq_len=seq_len, num_heads=num_heads,
                                      num_kv_heads=num_heads, mode=mode,
                                      offsets_rule=rule)
    heads = np.asarray(heads)
    plans = []
    for p in full:
        offset_of = dict(zip(p.query_heads.tolist(), p.offsets.tolist()))
        mine = np.array([i for i, j in enumerate(heads.tolist()) if j in offset_of],
                        np.int64)
        if not mine.size:
            if keep_empty:
                plans.append(None)
            continue
        offsets = np.array([offset_of[j] for j in heads[mine].tolist()], np.int64)
        kv_offsets, kv_heads, group = branch_plans.kv_head_plan(mine, offsets, len(heads),
                                                                local_kv)
        plans.append(branch_plans.BranchPlan(p.branch, mine, offsets, kv_offsets,
                                             kv_heads, group))
    return plans


def plan_key(plans):
    return tuple((p.branch, p.query_heads.tobytes(), p.offsets.tobytes()) for p in plans)


def distinct_variants(variants: list) -> tuple[list, list[int]]:
    """``(distinct, index)``: the distinct values of ``variants = [(key, value)]`` (by
    key, in first-seen order) and the one each device ``d`` takes, ``distinct[index[d]]``."""
    keys, distinct, index = [], [], []
    for key, value in variants:
        if key not in keys:
            keys.append(key)
            distinct.append(value)
        index.append(keys.index(key))
    return distinct, index


def device_choice(axis_name: str, index: list[int]):
    """This device's entry of ``index`` (traced: ``lax.axis_index`` picks it)."""
    return jnp.asarray(np.asarray(index, np.int32))[jax.lax.axis_index(axis_name)]


def by_device(axis_name: str, variants: list, call):
    """``call(variant)`` for this device's variant (``variants[d]``): static when all
    devices share one, else a ``lax.switch`` over the distinct ones."""
    distinct, index = distinct_variants(variants)
    if len(distinct) == 1:
        return call(distinct[0])
    return jax.lax.switch(device_choice(axis_name, index),
                          [functools.partial(call, v) for v in distinct])


def to_heads(q, k, v, mask, segment_ids, axis_name: str, num_devices: int):
    """Contiguous shards -> this device's ``H / P`` heads of the whole sequence (kv heads
    repeated first where ``P`` does not divide them); mask and ids gathered whole."""
    rep = kv_repeat(k.shape[2], num_devices)
    if rep > 1:
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    q, k, v = (seq_to_heads(x, axis_name) for x in (q, k, v))
    return (q, k, v, gather_tokens(mask, axis_name),
            gather_tokens(segment_ids, axis_name))


def over_heads(call: DilatedCall, q, k, v, mask, rng, *, segment_ids=None,
                       axis_name: str, num_devices: int, gather: bool = False,
                       lse_grad: bool = True, program=None):
    """Dilated attention, the sequence sharded contiguously over ``axis_name`` (inside
    ``shard_map``), run as single-device programs on the whole sequence of some heads:
    ``(program, operands, back)``, whose ``back(*program(*operands))`` is ``(out [B,
    n, H, D], lse [B, n, H])``. (The caller enters the program itself, so that it
    calls its kernels few frames below the operation's entry point.)

    Every device runs the single-device program (the packed one with ``segment_ids``
    [B, n], this shard's ids) on the *whole* sequence of some heads (global head
    numbering: each head keeps its offsets and group), then an all-to-all brings its
    rows back. It serves the ``"heads"`` strategy, and packed rows under every
    strategy: a document may start anywhere, so the segment grid no longer sits on
    the shards.

    * ``H % P == 0`` (and not ``gather``): the heads strategy's all-to-all
      (:func:`seq_to_heads`), ``H / P`` heads per device; each device sends about
      ``(P - 1) / P`` of its q, k, v shards and the output back.
    * otherwise: q, k, v, mask and ids are all-gathered (``P - 1`` shards received
      per array), device ``d`` runs heads ``d c .. d c + c - 1`` of ``c = ceil(H / P)``
      (the last devices repeat head ``H - 1`` where ``P c > H``, work that is thrown
      away), and the output comes back with an all-to-all. It holds the whole q, k, v
      (``O(T H D)`` per device) and does ``c / H`` of the work instead of ``1 / P``.

    Devices whose heads run different plans choose theirs by a ``lax.switch``.
    ``call``: the validated call (:class:`~jax_dilated.ops.dilated_programs.DilatedCall`);
    ``rng``: the call's dropout key or None (each device folds in its index);
    ``lse_grad``: False when the caller does not differentiate through ``lse``
    (:func:`jax_dilated.ops.dilated_programs.one_device`); ``program``: None (the
    call's one-device or packed program), or ``program(heads) -> (key, fn)``, the
    program ``fn(q, k, v, mask, rng) -> (out, lse)`` of a device that runs the
    global ``heads`` (devices with equal keys share one), for a mode with a program
    of its own (torchscale's, :func:`jax_dilated.ops.dilated_torchscale.device_program`).
    """
    p, h = num_devices, q.shape[2]
    whole = not gather and h % p == 0
    if whole:
        q, k, v, mask, ids = to_heads(q, k, v, mask, segment_ids, axis_name, p)
        c = h // p
        table = np.arange(h).reshape(p, c)
        hkv = k.shape[2]
    else:
        c = -(-h // p)
        table = np.minimum(np.arange(p * c).reshape(p, c), h - 1)
        q, k, v, mask, ids = (gather_tokens(x, axis_name)
                              for x in (q, k, v, mask, segment_ids))
        # one kv head per query head: the kv head each of this device's heads reads
        mine = device_choice(axis_name, table.tolist())
        k, v = (jnp.take(x, mine // (h // x.shape[2]), axis=2) for x in (k, v))
        q, hkv = jnp.take(q, mine, axis=2), c
    if rng is not None:  # every device's heads draw their own masks
        rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
    t = q.shape[1]
    variants = []
    for heads in table:
        if program is not None:
            variants.append(program(heads))
            continue
        plans = head_plans(call.branches, t, h, heads, hkv, call.mode, call.head_offsets)
        variants.append((plan_key(plans), plans))
    distinct, index = distinct_variants(variants)
    if program is not None:
        programs = distinct
    elif ids is None:
        programs = [functools.partial(one_device, call.kernel, call.args, plans, call.mode,
                                      lse_grad=lse_grad) for plans in distinct]
    else:
        programs = [functools.partial(dilated_packed.packed_attention, call.kernel,
                                      call.args, plans, call.mode, segment_ids=ids,
                                      max_documents=call.max_documents)
                    for plans in distinct]
    which = None if len(distinct) == 1 else device_choice(axis_name, index)
    entered = (programs[0] if which is None
               else functools.partial(jax.lax.switch, which, programs))
    # head_groups: a device's heads in fewer groups than there are branches: its
    # output is divided by the number of all branches, not of its own
    scale = None
    ratio = [len(plans) / len(call.branches) for plans in distinct] if (
        call.mode == "head_groups") else None
    if call.mode == "head_groups" and ratio != [1.0] * len(ratio):
        scale = ratio[0] if which is None else jnp.asarray(ratio)[which]

    def back(out, lse):
        if scale is not None:
            out = (out * scale).astype(q.dtype)
        out, lse = heads_to_seq(out, axis_name), heads_to_seq(lse, axis_name)
        # gathered: [B, T, c] per device -> [B, n, P c]: the first H are the heads
        return (out, lse) if whole else (out[:, :, :h], lse[:, :, :h])

    return entered, (q, k, v, mask, rng), back
