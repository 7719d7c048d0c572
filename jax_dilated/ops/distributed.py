"""Dilated attention with the sequence sharded over a mesh axis (docs/semantics.md, section 4).

Inside ``jax.shard_map`` each of the ``P`` devices of ``axis_name`` holds ``n = T / P``
consecutive tokens. Every branch ``(w, r)`` runs in one of two ways:

* **local** (a segment fits in a shard, ``n % w == 0``): the shard is cut into whole
  segments and the branch runs exactly as on one device. No communication.
* **spanning** (a segment covers ``g = w / n`` devices, or the whole sequence when
  ``w >= T``): as ``n % r == 0``, the tokens a head selects on each device are the
  local positions ``a`` with ``a mod r == o``, and the dilated segment is the
  concatenation, in device order, of the ``n / r`` tokens each of the ``g`` devices
  selects. So every device first dilates its own queries, keys and values (the
  sparsification happens before any communication), and then the ``g`` devices of a
  segment run exact ring attention (:func:`jax_dilated.ops.ring.ring_partials`) on the
  dilated blocks. A step sends ``n / r`` tokens of key and value per device, whatever
  ``P`` is. Causality is by position inside the dilated segment, which orders tokens
  the same way as their global positions: every device sees its own keys and those of
  the earlier devices of its segment.

Ring rather than all-gather: a ring step sends one ``n / r`` block and overlaps it with
compute, and memory stays one block; an all-gather would hold all ``g`` blocks
(``w / r`` tokens) at once and, for the backward, needs a reduce-scatter of the same
size. Both send ``(g - 1) n / r`` tokens per device in total. Measured
(``python -m benchmarks distributed --allgather``: global n=65536, 8 heads, head_dim
64, float32, causal, the branch (65536, 16) alone at P=8): compiled forward+backward
temp memory per device 40.1 MiB as a ring, 65.1 MiB as an all-gather.

The backward is the ring's ``custom_vjp`` (the key/value blocks and their gradient
accumulators travel together and return to their owners), so memory per device is
O(n) for local branches and O(n / r) for spanning ones. The branches are then merged by
:mod:`jax_dilated.core.softmax` exactly as on one device.

A sliding-window branch (:class:`~jax_dilated.core.branches.SlidingWindow`) has no
segment grid: it runs as the windowed ring over all ``P`` devices
(:func:`jax_dilated.ops.dilated_window.ring_partial`; the steps whose visiting shard
lies outside every local query's window are skipped), whatever the shard length.

Packed rows (``segment_ids``) do not run here: their segment grid restarts at every
document, so segments do not sit on the shards, and each device runs the one-device
packed program on the whole sequence of some heads instead
(:func:`jax_dilated.ops.head_parallel.packed_dilated`; docs/semantics.md, section 2).
"""

from __future__ import annotations

import dataclasses

import jax

from jax_dilated.backends import KernelArgs, get_kernel
from jax_dilated.core import branch_plans, dilation
from jax_dilated.core.branches import is_window
from jax_dilated.ops import dilated_window
from jax_dilated.ops.ring import RingConfig, ring_partials

__all__ = ["ShardedBranch", "shard_branches", "branch_partials"]


@dataclasses.dataclass(frozen=True)
class ShardedBranch:
    """How one branch runs with ``P`` devices of ``n`` tokens each.

    segment_length, rate: the branch ``(w, r)`` as given.
    ring_size: devices that share one segment (1: local, no communication).
    cut: how the local shard is dilated: the branch's own segments when local, the
      whole shard as one piece (``Branch(n, r, n)``) when the segment spans devices.
    """

    segment_length: int
    rate: int
    ring_size: int
    cut: branch_plans.Branch

    @property
    def is_local(self) -> bool:
        return self.ring_size == 1

    def tokens_sent_per_step(self) -> int:
        """Key/value tokens one device sends per ring step (0 when local): ``n / r``."""
        return 0 if self.is_local else self.cut.dilated_length


def shard_branches(branches, *, local_len: int, num_devices: int) -> list[ShardedBranch]:
    """Classify every branch ``(w, r)`` as local or spanning; reject what cannot shard.

    Raises:
      ValueError saying which segment lengths would work when a segment would straddle
      a device boundary, a spanning segment does not tile the devices, or a spanning
      branch's rate does not divide the local length.
    """
    n, p = local_len, num_devices
    total = n * p
    out = []
    for w, r in branches:
        if is_window(w):  # the windowed ring over every device (one shard per step)
            out.append(ShardedBranch(w, 1, p, branch_plans.Branch(n, 1, n, window=w)))
            continue
        br = branch_plans.resolve_branch(w, r, total)
        if p == 1:
            out.append(ShardedBranch(w, r, 1, br))
            continue
        span = min(br.effective_length, total)  # tokens of one segment that exist
        where = (f"segment length {w} (dilation rate {r}) with the sequence of {total} "
                 f"tokens sharded over {p} devices ({n} per device)")
        if span <= n:
            if n % span:
                raise ValueError(
                    f"{where}: segments would straddle device boundaries. A segment "
                    f"shorter than a shard must divide the local length {n}; use a "
                    f"divisor of {n}, or a multiple of {n} that divides {total}."
                )
            out.append(ShardedBranch(w, r, 1, br))
            continue
        if span % n or p % (span // n):
            raise ValueError(
                f"{where}: a segment spanning devices must cover whole shards and tile "
                f"the devices, i.e. be {n} x g tokens with g dividing {p} (or be at least "
                f"the whole sequence, {total}); use a divisor of {n} or one of "
                f"{[n * g for g in range(2, p + 1) if p % g == 0]}."
            )
        if n % r:
            raise ValueError(
                f"{where}: a segment spanning devices needs the local length {n} to be "
                f"a multiple of the dilation rate {r}, so that every device holds "
                f"{n}/{r} tokens of each dilated segment; choose a rate dividing {n} or "
                f"a local length that is a multiple of {r}."
            )
        out.append(ShardedBranch(w, r, span // n, branch_plans.Branch(n, r, n)))
    return out


def branch_partials(plans, sharded_branches, query, key, value, kv_mask, args: KernelArgs,
                    *, axis_name, num_devices: int, implementation, dropout_rng):
    """``[(o_i, lse_i, lse_lo_i)]`` of every branch for this device's queries (inside
    shard_map; the log-sum-exp in two parts, :mod:`jax_dilated.core.softmax`).

    Args:
      plans: the :class:`branch_plans.BranchPlan` of every branch (heads and offsets).
      sharded_branches: :func:`shard_branches` for the same branches.
      query: [B, n, H, D]; key, value: [B, n, Hkv, D]; kv_mask: None or [B, n].
      dropout_rng: None, or the key of the whole call; every branch, device and
        ring step draws its own mask from it.

    Returns:
      per branch, o [B, n, Hq, D] and lse, lse_lo [B, n, Hq] over the branch's global
      segments (Hq: the heads of the branch).
    """
    kernel = get_kernel(implementation)
    me = jax.lax.axis_index(axis_name)
    results = []
    for i, (plan, sb) in enumerate(zip(plans, sharded_branches)):
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        if plan.branch.window is not None:
            results.append(dilated_window.ring_partial(
                args, plan, query, key, value, kv_mask, rng, axis_name=axis_name,
                num_devices=num_devices, implementation=implementation))
            continue
        if sb.is_local:
            local_rng = None if rng is None else jax.random.fold_in(rng, me)

            def attend(q, k, v, valid, local_rng=local_rng):
                return kernel.attention(q, k, v, args, kv_valid=valid,
                                        dropout_rng=local_rng)
        else:
            cfg = RingConfig(axis_name, num_devices, sb.ring_size, "contiguous", args,
                             implementation)

            def attend(q, k, v, valid, cfg=cfg, rng=rng):
                return ring_partials(q, k, v, valid, rng, cfg)

        results.append(dilation.attend_dilated(attend, sb.cut, plan, query, key, value,
                                             kv_mask))
    return results
