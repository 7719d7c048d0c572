"""Dilated attention with the sequence sharded over a mesh axis (docs/semantics.md, section 4).

Inside ``jax.shard_map`` each of the ``P`` devices of ``axis_name`` holds ``n = T / P``
consecutive tokens. Every branch ``(w, r)`` runs in one of two ways:

* **local** (a segment fits in a shard, ``n % w == 0``): the shard is cut into whole
  segments and the branch runs exactly as on one device. No communication. With the
  XLA kernel the local branches run together as the one-device streamed program
  (:func:`sharded_dilated`).
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

How a spanning branch brings its segment together is its *strategy* (``strategy=`` of
:func:`jax_dilated.dilated_attention`, one entry per branch or one for all;
docs/semantics.md, section 8):

* ``"ring"`` (the default): the ring above. A step sends one ``n / r`` block and
  overlaps it with compute, and memory stays one block.
* ``"allgather"``: the ``g`` devices gather the segment's dilated keys and values
  (all ``w / r`` tokens at once) and attend their own dilated queries to them in one
  kernel call; the backward reduce-scatters dk/dv. The same ``(g - 1) n / r`` tokens
  per device as the ring, more memory. Measured (``python -m benchmarks distributed
  --allgather``: global n=65536, 8 heads, head_dim 64, float32, causal, the branch
  (65536, 16) alone at P=8): compiled forward+backward temp memory per device
  40.1 MiB as a ring, 65.1 MiB as an all-gather.
* ``"heads"``: an all-to-all inside the group of ``g`` devices turns the dilated
  ``[B, n / r, Hq, D]`` into ``[B, w / r, Hq / g, D]`` (the whole dilated segment of
  a ``1 / g`` slice of the branch's heads; kv heads repeated first where ``g`` does
  not divide them, as the ``"heads"`` strategy does), one kernel call runs on it, and
  a second all-to-all brings ``(o, lse)`` back. Needs the branch's query heads
  divisible by ``g``; it moves ``(g - 1) / g`` of the dilated q, k, v and output.
  With the XLA kernel the branch runs inside the streamed program of the local
  branches (:class:`.branch_groups.HeadExchange`), whose backward exchanges q, k, v
  again instead of holding them from the forward: at P=8, 32768 tokens, 8 heads,
  forward+backward memory per device fell from 176.8 to 122.5 MiB (docs/benchmarks.md).

A local branch moves nothing, whatever its entry says. ``strategy="heads"`` for the
whole call runs branch by branch like this wherever it can (:func:`heads_by_branch`),
and otherwise as the all-to-all of the whole sequence
(:func:`jax_dilated.ops.head_parallel.over_heads`).

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
(:func:`jax_dilated.ops.head_parallel.over_heads`; docs/semantics.md, section 2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jax_dilated.backends import KernelArgs
from jax_dilated.core import branch_plans, dilation, softmax
from jax_dilated.core.branches import is_window
from jax_dilated.ops import branch_combine, dilated_local, dilated_window, head_parallel
from jax_dilated.ops.branch_groups import Group, HeadExchange, gathered, head_exchanged
from jax_dilated.ops.ring import RingConfig, ring_partials

__all__ = ["BRANCH_STRATEGIES", "ShardedBranch", "shard_branches", "check_branch_strategy",
           "branch_strategies", "heads_by_branch", "sharded_dilated", "branch_partials"]

BRANCH_STRATEGIES = ("ring", "allgather", "heads")


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


def heads_by_branch(branches, plans, *, local_len: int, num_devices: int):
    """The :func:`shard_branches` of a call whose ``strategy="heads"`` runs branch by
    branch, or None where it cannot (docs/semantics.md, section 4).

    Branch by branch, ``"heads"`` exchanges heads only for the branches that span
    devices, among the ``g`` devices of each segment, and runs the local ones where
    they are: it moves and holds less than the all-to-all of the whole call, and on
    the project's CPU it ran as fast or faster (docs/benchmarks.md). It serves when
    every segment sits on the shards (:func:`shard_branches`), no branch is a sliding
    window (which has no segment to exchange) and every spanning branch's query heads
    divide by its ``g``.
    """
    try:
        sharded = shard_branches(branches, local_len=local_len, num_devices=num_devices)
    except ValueError:
        return None
    for plan, sb in zip(plans, sharded):
        if plan.branch.window is not None or (
                not sb.is_local and len(plan.query_heads) % sb.ring_size):
            return None
    return sharded


def check_branch_strategy(strategy, num_branches: int):
    """Dilated attention's own ``strategy=`` over a mesh, as given: one of
    :data:`BRANCH_STRATEGIES` for every branch, or a tuple with exactly one entry per
    branch (``num_branches``); a ``ValueError`` for anything else."""
    if isinstance(strategy, str):
        if strategy not in BRANCH_STRATEGIES:
            raise ValueError(f"strategy must be one of {BRANCH_STRATEGIES} or a sequence "
                             f"of them, one per branch, got {strategy!r}.")
        return strategy
    entries = tuple(strategy) if isinstance(strategy, (tuple, list)) else None
    if (entries is None or len(entries) != num_branches
            or any(not isinstance(e, str) or e not in BRANCH_STRATEGIES for e in entries)):
        raise ValueError(f"a per-branch strategy needs one entry of {BRANCH_STRATEGIES} "
                         f"for each of the {num_branches} branches, got {strategy!r}.")
    return entries


def branch_strategies(strategy, plans, sharded_branches) -> tuple[str, ...]:
    """The strategy of every branch: ``strategy`` is one of :data:`BRANCH_STRATEGIES`
    for all branches or a sequence with one entry per branch (:func:`check_branch_strategy`).

    Raises:
      ValueError naming the branch and the entries that can serve it, when a
      sliding-window branch is given anything but ``"ring"`` (its windowed ring) or
      ``"heads"`` is given to a spanning branch whose query heads do not divide by the
      devices of its segment.
    """
    strategy = check_branch_strategy(strategy, len(sharded_branches))
    if isinstance(strategy, str):  # one word for all: window branches keep their ring
        entries = tuple("ring" if sb.cut.window is not None else strategy
                        for sb in sharded_branches)
    else:
        entries = strategy
    for i, (e, plan, sb) in enumerate(zip(entries, plans, sharded_branches)):
        name = f"branch {i} ({sb.segment_length!r}, rate {sb.rate})"
        if sb.cut.window is not None and e != "ring":
            raise ValueError(f"{name} is a sliding window: it runs as the windowed ring "
                             f"over every device, so its strategy must be 'ring', got {e!r}.")
        heads = len(plan.query_heads)
        if e == "heads" and not sb.is_local and heads % sb.ring_size:
            raise ValueError(
                f"{name} spans {sb.ring_size} devices and runs {heads} query heads: its "
                f"strategy 'heads' needs them divisible by {sb.ring_size}; use 'ring' or "
                f"'allgather' for it.")
    return entries


def sharded_dilated(plans, sharded_branches, query, key, value, kv_mask, dropout_rng, *,
                    args: KernelArgs, mode: str, axis_name, num_devices: int, kernel,
                    strategies=None, lse_grad=True, local_variants=None):
    """``(out, lse)`` of dilated attention for this device's queries (inside shard_map;
    arguments as in :func:`branch_partials`, ``mode`` the call's). ``lse_grad``
    False: the caller does not differentiate through ``lse``; in head_groups mode,
    where each head's lse is its branch's, the branches' calls then need no lse
    cotangent (cuDNN runs its own backward).

    ``local_variants``: None, or ``(axis, per_slice)`` where the devices of another
    mesh axis ``axis`` run heads with different offsets (hybrid dilated attention's
    head slices, :mod:`jax_dilated.ops.dilated_hybrid`): ``per_slice[j]`` is every
    branch's plan on device ``j`` of ``axis``. The local branches then run as a
    ``lax.switch`` over the slices' distinct streamed programs (they hold no
    collectives), and ``plans`` gives the spanning branches with their offsets traced
    (the ring over ``axis_name`` is the same program for every offset).

    With the blockwise XLA kernel, the local branches (not sliding windows) run
    together as the one-device streamed program on the shard
    (:func:`jax_dilated.ops.dilated_local.attend`): chunk-sized temporaries
    instead of a shard-sized gather, result and scatter per branch. The spanning
    branches whose strategy is ``"heads"`` join that program, each as one segment of
    the whole shard whose kernel calls exchange heads
    (:class:`.branch_groups.HeadExchange`): its backward then recomputes the exchanges
    from the call's own residuals (queries, keys, values, output and log-sum-exp)
    instead of holding the exchanged arrays and the branch's partial from the forward.
    The others run in :func:`branch_partials`; in longnet mode the spanning ones are
    merged into the streamed partial at the positions their heads select (``n / r``
    rows each), and :func:`jax_dilated.ops.dilated_window.mix` adds what is left
    (sliding windows; in head_groups mode every other branch, on its own heads).
    """
    how = ("ring",) * len(plans) if strategies is None else strategies
    streamed = [i for i, (plan, sb) in enumerate(zip(plans, sharded_branches))
                if kernel.blockwise and plan.branch.window is None
                and (sb.is_local or how[i] == "heads")]
    rest = [i for i in range(len(plans)) if i not in streamed]
    partial = None
    if streamed:
        # its own dropout stream: index len(plans) is no branch's, and each device draws
        # its own masks, as the per-branch local calls below do
        rng = None if dropout_rng is None else jax.random.fold_in(
            jax.random.fold_in(dropout_rng, len(plans)), jax.lax.axis_index(axis_name))
        kernels = tuple(kernel if sharded_branches[i].is_local else HeadExchange(
            Group(axis_name, num_devices, sharded_branches[i].ring_size, kernel, args))
            for i in streamed)

        def streamed_call(plans):
            # a spanning branch: the shard is one segment of it (its cut), dilated locally
            cut = tuple(dataclasses.replace(plans[i], branch=sharded_branches[i].cut)
                        for i in streamed)
            # chunked even on a kernel with a fused program: the strategies' cost model
            # (ops/strategies/cost.py) prices every strategy's local branches as this
            # program, and a head exchange cannot run inside a fused call
            return dilated_local.StreamedCall(kernel, args, cut, mode, len(plans),
                                              branch_kernels=kernels)

        if local_variants is None:
            partial = dilated_local.attend(streamed_call(plans), query, key, value, kv_mask,
                                           rng)
        else:  # a switch may hold no collectives: local branches only
            assert all(sharded_branches[i].is_local for i in streamed)
            axis, per_slice = local_variants
            partial = head_parallel.by_device(
                axis, [(head_parallel.plan_key([v[i] for i in streamed]), v)
                       for v in per_slice],
                lambda v: dilated_local.attend(streamed_call(v), query, key, value, kv_mask,
                                               rng))
    run = functools.partial(branch_partials, plans, sharded_branches, query, key, value,
                            kv_mask, args, axis_name=axis_name, num_devices=num_devices,
                            kernel=kernel, dropout_rng=dropout_rng,
                            strategies=strategies,
                            lse_grad=branch_combine.branch_lse_grad(lse_grad, mode))
    spanning = [i for i in rest if plans[i].branch.window is None]
    if mode == "longnet" and partial is not None and spanning:
        # merged into the streamed partial at the positions their heads select, not
        # scattered to shard-sized partials first
        stats = softmax.stats_dtype(query.dtype)
        partial = (partial[0].astype(stats), *partial[1:])
        for i, part in zip(spanning, run(only=spanning, scatter=False)):
            partial = dilation.merge_selected(partial, sharded_branches[i].cut,
                                              plans[i].offsets, plans[i].query_heads, part)
        rest = [i for i in rest if i not in spanning]
    results = run(only=rest)
    return dilated_window.mix(partial, [(plans[i], r) for i, r in zip(rest, results)], mode,
                              len(plans), query.dtype)


def branch_partials(plans, sharded_branches, query, key, value, kv_mask, args: KernelArgs,
                    *, axis_name, num_devices: int, kernel, dropout_rng,
                    strategies=None, only=None, scatter=True, lse_grad=True):
    """``[(o_i, lse_i, lse_lo_i)]`` of every branch (of the branches ``only`` lists,
    when given) for this device's queries (inside shard_map; the log-sum-exp in two
    parts, :mod:`jax_dilated.core.softmax`).

    Args:
      plans: the :class:`branch_plans.BranchPlan` of every branch (heads and offsets).
      sharded_branches: :func:`shard_branches` for the same branches.
      query: [B, n, H, D]; key, value: [B, n, Hkv, D]; kv_mask: None or [B, n].
      kernel: the call's kernel.
      dropout_rng: None, or the key of the whole call; every branch, device and
        ring step draws its own mask from it.
      strategies: :func:`branch_strategies` (None: every branch ``"ring"``).
      only: None, or the indices of the branches to run.
      scatter: False gives each (non-window) branch's dilated partial as its
        ``attend`` returns it, [B, n / r, Hq, ...] for a spanning branch.
      lse_grad: False when nothing differentiates through the branches' ``lse``
        (given with its gradient stopped).

    Returns:
      per branch, o [B, n, Hq, D] and lse, lse_lo [B, n, Hq] over the branch's global
      segments (Hq: the heads of the branch).
    """
    me = jax.lax.axis_index(axis_name)
    strategies = ("ring",) * len(plans) if strategies is None else strategies
    results = []
    for i, (plan, sb, how) in enumerate(zip(plans, sharded_branches, strategies)):
        if only is not None and i not in only:
            continue
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        if plan.branch.window is not None:
            results.append(dilated_window.ring_partial(
                args, plan, query, key, value, kv_mask, rng, axis_name=axis_name,
                num_devices=num_devices, kernel=kernel,
                lse_grad=lse_grad))
            continue
        # a ring folds in its device and step itself; the others draw per device here
        device_rng = None if rng is None else jax.random.fold_in(rng, me)
        if sb.is_local:
            attend = functools.partial(branch_combine.kernel_call, kernel, args, device_rng,
                                       lse_grad)
        elif how == "ring":
            cfg = RingConfig(axis_name, num_devices, sb.ring_size, "contiguous", args,
                             kernel, lse_grad=lse_grad)
            attend = functools.partial(_ring, cfg, rng)
        else:
            grp = Group(axis_name, num_devices, sb.ring_size, kernel, args, lse_grad)
            attend = functools.partial(
                gathered if how == "allgather" else head_exchanged, grp, device_rng)
        results.append(dilation.attend_dilated(attend, sb.cut, plan, query, key, value,
                                               kv_mask, scatter=scatter))
    return results


def _ring(cfg, rng, q, k, v, valid):
    return ring_partials(q, k, v, valid, rng, cfg)
