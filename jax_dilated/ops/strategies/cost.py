"""The strategies' cost model: bytes sent, memory held and work per device for each
strategy on one call's shapes (:func:`estimate`), for dilated attention branch by
branch (:func:`_dilated_costs`, with what only it uses: each branch's held results
and the XLA kernel's logits blocks), and the pricing of one call on a device kind
(:func:`pricing_for`), which ``"auto"`` minimizes
(:mod:`jax_dilated.ops.strategies.choice`). The figures' record, how a device kind
prices them and the ring's bytes are in :mod:`jax_dilated.ops.strategies.pricing`
(:class:`StrategyCost` is re-exported here); ``_device_kind`` and
``_logits_blocks_held`` stay beside what reads them, since the tests patch them on
this module. The model is documented in docs/semantics.md, section 8 ("The cost model
of ``"auto"``")."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_dilated.backends import selection
from jax_dilated.backends.xla.layout import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from jax_dilated.ops import distributed, head_parallel
from jax_dilated.ops.strategies.operation import (Operation, describe, plans_of, servable,
                                                  torchscale)
from jax_dilated.ops.strategies.pricing import (_PRICED_GPU, StrategyCost,
                                                _branch_flops, _causal_share, _Pricing,
                                                _ring_keeps_block, _ring_sent)

__all__ = ["StrategyCost", "estimate", "pricing_for"]


def pricing_for(op: Operation, platform, b, t, h, d) -> _Pricing:
    return _Pricing(platform or _device_kind(), sum(_branch_flops(op, b, t, h, d)))


def estimate(op, *, batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
             head_dim: int, num_devices: int, dtype="float32",
             layout: str = "contiguous", segment_ids: bool = False,
             platform: str | None = None) -> dict:
    """``{strategy: StrategyCost}`` for the three concrete strategies, and for dilated
    attention ``"per_branch"``: the best strategy for each branch on its own, where
    that mix differs from all three (its ``strategy`` is the tuple).

    ``op``: an :class:`Operation` or the function given to ``jd.sharded``. The
    figures are per device, for a forward and backward pass, from the shapes alone
    (``e`` bytes per element, ``n = T / P``, ``K = B n H_kv D e`` one shard of keys):

    * ring: sends the k and v shards ``P`` times forward (the XLA kernel's ring steps
      bring the block home for the backward; ``P - 1`` with cuDNN's generic steps),
      k, v ``P - 1`` times and the dk, dv accumulators ``P`` times backward:
      ``(6 P - 2) K`` in float32 (:func:`_ring_sent`; exact and block-sparse);
      dilated attention sends only for branches spanning ``g`` devices, the same with
      ``g`` and ``K_b``, the ``n / r`` tokens of the kv heads the branch gathers.
      Holds its shards plus two blocks in flight (dilated: also ``3 Q`` per branch,
      each branch's output, cotangent and dq before the merge); transfers overlap
      compute.
    * allgather: all-gathers k and v forward and reduce-scatters dk, dv backward (the
      backward reuses the gathered keys), ``4 (P - 1) K``, and holds all keys and
      values, and their gradients in the backward, ``4 P K`` (dilated: ``4 (g - 1)
      K_b`` sent, ``4 g K_b`` held of the largest spanning branch, plus ``3 Q`` per
      branch as the ring); no overlap.
    * heads: two all-to-alls forward (q, k, v in; out back) and two backward, each
      moving ``(P - 1) / P`` of the arrays: ``2 (P - 1) / P (2 Q + 2 K')`` with ``Q``
      one shard of queries and ``K'`` of kv heads after the GQA repeat; holds a head
      slice of the whole sequence (as much as the shards); no overlap; the work is
      always balanced (``1 / P``) but needs ``H % P == 0``.
    * a dilated branch spanning ``g`` devices as ``"heads"`` (per branch): the same
      all-to-alls inside its group on its dilated ``n / r`` tokens,
      ``2 (g - 1) / g (2 Q_b + 2 K_b')``, holding ``2 (2 Q_b + 2 K_b')``; needs its
      query heads divisible by ``g``.
    * forward only (``forward_bytes``): half of the all-gather's (the gathers; the
      reduce-scatters are the backward's) and of the all-to-alls', ``2 P K`` of the
      ring's (``2 (P - 1) K`` with cuDNN's steps).
    * with the XLA kernel, a dilated branch spanning devices also holds its logits
      blocks, which differ by strategy (:func:`_logits_blocks_held`): ``H_b`` heads
      over ``n / r`` tokens on the ring (``n / r`` queries against ``g n / r`` keys
      for the all-gather), ``H_b / g`` heads over ``g n / r`` for the head exchange.

    Packed dilated attention (``segment_ids=True``) runs whole sequences of some heads
    under every strategy (:func:`.over_heads`): ``"ring"`` is then the heads
    figures when ``H % P == 0``, and otherwise, like ``"allgather"``, the gathered
    program: q, k, v gathered forward and reduce-scattered backward,
    ``2 (P - 1) (Q + 2 K)``, plus the output's all-to-alls; it holds the whole q, k, v
    and their gradients and does ``ceil(H / P) / H`` of the work.

    ``platform`` (default: this machine's device kind) prices the per-branch choice
    as :func:`~.choice.choose` prices the strategies.
    """
    op = op if isinstance(op, Operation) else describe(op)
    e = jnp.dtype(dtype).itemsize
    p, b, t, h, hkv, d = num_devices, batch, seq_len, num_heads, num_kv_heads, head_dim
    kind = platform or _device_kind()
    n = t // p
    kshard = b * n * hkv * d * e
    qshard = b * n * h * d * e
    causal = bool(op.options.get("is_causal", False))
    why = servable(op, num_heads=h, num_devices=p, layout=layout, seq_len=t,
                   segment_ids=segment_ids)
    base_held = 2 * qshard + 2 * kshard  # q, out, k, v shards
    grads_held = 2 * qshard + 2 * kshard  # dq, do, dk, dv
    out = {}

    # packed rows and torchscale run whole sequences of some heads (over_heads)
    packed = (segment_ids and op.kind == "dilated") or torchscale(op)
    if packed:
        c = -(-h // p)
        out_shard = qshard * p * c / h  # one device's rows of the P c heads computed
        gathered = StrategyCost(
            "allgather", 2 * (p - 1) * (qshard + 2 * kshard)
            + 2 * (p - 1) / p * out_shard,
            base_held + grads_held + 2 * p * (qshard + 2 * kshard) + 2 * p * out_shard,
            False, c / h, why["allgather"],
            forward_bytes=(p - 1) * (qshard + 2 * kshard) + (p - 1) / p * out_shard)
        out["allgather"] = gathered
        out["ring"] = dataclasses.replace(gathered, strategy="ring", reason=why["ring"])
    elif op.kind == "dilated" and why["ring"] is None:
        out.update(_dilated_costs(op, why, b, t, h, hkv, d, p, e,
                                  base_held + grads_held, qshard,
                                  pricing_for(op, platform, b, t, h, d)))
    else:
        share = _causal_share(p, layout, causal)
        if op.kind == "block_sparse":
            share = 1.0 / p if layout != "contiguous" or not causal else share
        fwd, sent = _ring_sent(p, kshard, e, _ring_keeps_block(op, kind, e, d))
        out["ring"] = StrategyCost("ring", sent,
                                   base_held + grads_held + 4 * kshard, True, share,
                                   why["ring"], small_work=share, forward_bytes=fwd)
        # all-gather k, v forward, reduce-scatter dk, dv backward: the backward reuses
        # the keys gathered in the forward (held anyway) rather than gathering again;
        # the compiled forward+backward has two all-gathers, not four
        # (tests/test_strategy_bytes.py)
        out["allgather"] = StrategyCost("allgather", 4 * (p - 1) * kshard,
                                        base_held + grads_held + 4 * p * kshard, False,
                                        share, why["allgather"], small_work=share,
                                        forward_bytes=2 * (p - 1) * kshard)
    rep = head_parallel.kv_repeat(hkv, p)
    kprime = kshard * rep
    sent_heads = 2 * (p - 1) / p * (2 * qshard + 2 * kprime)
    # the shards and, as large, their head-sharded copies (q, out, k', v' and grads)
    held_heads = base_held + grads_held + 2 * (2 * qshard + 2 * kprime)
    if "heads" not in out:  # (dilated attention's "heads" by branch is priced above)
        out["heads"] = StrategyCost("heads", sent_heads, held_heads, False, 1.0 / p,
                                    why["heads"], forward_bytes=sent_heads / 2)
    if packed and h % p == 0:  # the packed ring path is the heads all-to-all
        out["ring"] = dataclasses.replace(out["heads"], strategy="ring",
                                          reason=why["ring"])
    return out


def _dilated_costs(op, why, b, t, h, hkv, d, p, e, shards_held, qshard,
                   pricing: _Pricing) -> dict:
    """``ring``, ``allgather`` and, where it differs from both, ``per_branch`` costs of
    unpacked distributed dilated attention (:func:`estimate`)."""
    n = t // p
    try:
        branches, plans = plans_of(op, seq_len=t, num_heads=h, num_kv_heads=hkv)
        sbs = distributed.shard_branches(branches, local_len=n, num_devices=p)
    except (ValueError, TypeError) as err:
        return {s: StrategyCost(s, 0.0, 0.0, s == "ring", 1.0 / p, str(err))
                for s in ("ring", "allgather")}
    flops = _branch_flops(op, b, t, h, d)
    total = max(sum(flops), 1.0)
    streamed = _streams_branches(op, pricing.kind, e, d)
    keeps = _ring_keeps_block(op, pricing.kind, e, d)
    longnet = op.options.get("mode", "longnet") == "longnet"
    # per branch: {entry: (sent, held while it runs, overlapped, small work share,
    # held until the merge, sent in the forward)}, and its work share
    options, shares = [], [f / total / p for f in flops]
    for plan, sb, share in zip(plans, sbs, shares):
        kept = _branch_result_held(plan, sb, h, qshard, streamed, longnet)
        if sb.is_local:
            options.append({"ring": (0.0, 0.0, 0.0, share, kept, 0.0)})
            continue
        g, hb, lb = sb.ring_size, len(plan.query_heads), n // sb.rate
        kb = b * lb * len(plan.kv_heads) * d * e
        fwd, sent = _ring_sent(g, kb, e, keeps or plan.branch.window is not None)
        # the XLA kernel's logits blocks differ by strategy (_logits_blocks_held)
        blocks = functools.partial(_logits_blocks_held, b, e) if streamed else (
            lambda *_: 0.0)
        # the all-gather: k, v gathered forward, dk, dv reduce-scattered backward (the
        # backward reuses the gathered keys, as for exact attention in estimate)
        mine = {"ring": (sent, 4 * kb + blocks(hb, lb, lb), sent, share, kept, fwd),
                "allgather": (4 * (g - 1) * kb, 4 * g * kb + blocks(hb, lb, g * lb), 0.0,
                              share, kept, 2 * (g - 1) * kb)}
        if plan.branch.window is not None:
            del mine["allgather"]  # a window branch runs its windowed ring only
        elif hb % g == 0:
            qb = b * lb * hb * d * e
            kprime = kb * head_parallel.kv_repeat(len(plan.kv_heads), g)
            # q, k', v' in and the output back, forward; do in, dq, dk', dv' back,
            # backward. Inside the streamed program (ops/distributed.py) the backward
            # exchanges q, k', v' again rather than holding them, but XLA merges those
            # all-to-alls with the forward's (the same operands, common subexpression
            # elimination), so a forward+backward compiled as one program moves each
            # once (tests/test_strategy_bytes.py); nothing of the branch is held until
            # the merge there
            moved = 2 * (2 * qb + 2 * kprime)
            if streamed:
                kept = 0.0
            # priced on CPU as the ring's calls (small work ``share``): the exchanged
            # branch still runs a kernel call over only its group's dilated rows, not
            # one call over the whole sequence as the whole-call "heads" does, so it
            # earns none of that strategy's discount (docs/benchmarks.md, "One
            # strategy per dilated branch": the mix runs about as fast as the rings)
            mine["heads"] = ((g - 1) / g * moved, 2 * (2 * qb + 2 * kprime)
                             + blocks(hb // g, g * lb, g * lb), 0.0, share, kept,
                             (g - 1) / g * moved / 2)
        options.append(mine)
    streamed_held = 3 * qshard if streamed else 0.0

    def total_cost(name, entries):
        parts = [opts[e] for opts, e in zip(options, entries)]
        sent = sum(x[0] for x in parts)
        # a branch's ring hides its transfers behind its own compute only
        overlapped = sum(min(x[2], share * pricing.flops / pricing.balance)
                         for x, share in zip(parts, shares))
        return StrategyCost(
            name, sent, shards_held + max((x[1] for x in parts), default=0.0)
            + streamed_held + sum(x[4] for x in parts), overlapped == sent, 1.0 / p,
            why[name] if isinstance(name, str) else None,
            small_work=sum(x[3] for x in parts), overlapped_bytes=overlapped,
            forward_bytes=sum(x[5] for x in parts))

    uniform = {}
    for name in ("ring", "allgather"):
        uniform[name] = total_cost(name, [name if name in opts else "ring"
                                          for opts in options])
    by_branch = distributed.heads_by_branch(branches, plans, local_len=n,
                                            num_devices=p) is not None
    if by_branch:  # "heads" runs branch by branch (distributed.heads_by_branch)
        uniform["heads"] = dataclasses.replace(
            total_cost("heads", ["heads" if "heads" in opts else "ring"
                                 for opts in options]),
            note="branch by branch: the spanning branches exchange heads among their "
                 "segments' devices, the local ones move nothing")
    order = ("ring", "heads", "allgather")
    best = []
    for opts, share in zip(options, shares):  # each alone: least time, then memory
        times = {s: pricing.time(share, x[3], x[0], x[2]) for s, x in opts.items()}
        low = min(times.values())
        near = [s for s in order if s in times and times[s] <= 1.1 * low]
        best.append(min(near, key=lambda s: (opts[s][1] + opts[s][4], order.index(s))))
    mix = tuple(best)
    spanning = {x for x, o in zip(mix, options) if len(o) > 1}
    if spanning == {"heads"} and by_branch or (
            "heads" not in mix and len(spanning) <= 1):
        return uniform  # the same as one of the uniform strategies
    uniform["per_branch"] = total_cost(mix, mix)
    return uniform


def _logits_blocks_held(batch: int, itemsize: int, heads: int, len_q: int,
                        len_k: int) -> float:
    """Bytes of the XLA kernel's logits blocks in one call of ``heads`` heads over
    ``len_q`` queries and ``len_k`` keys: four ``[B, heads, block_q, block_k]`` arrays
    in float32 or wider (the forward's logits and probabilities, the backward's and
    their cotangent), blocks of at most 512 (``backends/xla/layout.py``).

    The only kernel temporaries the cost model counts, because a spanning dilated
    branch's differ by strategy: its ring and all-gather run its ``H_b`` heads over a
    shard's ``n / r`` queries (blocks as small as ``n / r``), its head exchange ``H_b /
    g`` heads over ``g n / r`` (full blocks). So the ring holds less while a shard's
    ``n / r`` is below the block size and the exchange holds less once it fills a
    block, the order the compiled programs show (docs/semantics.md, section 8;
    ``tests/test_strategies.py`` checks it). With the native CPU kernel's forward only
    the backward's blocks remain: the compiled differences shrink but keep their signs,
    so the term is kept as an order, not a size."""
    bq, bk = min(len_q, DEFAULT_BLOCK_Q), min(len_k, DEFAULT_BLOCK_K)
    return 4.0 * batch * heads * bq * bk * max(itemsize, 4)


def _streams_branches(op, kind: str, itemsize: int, head_dim: int) -> bool:
    """Whether the one-device program streams the local branches into one partial:
    with the XLA kernel (``ops/dilated_local.py``), not with cuDNN. With
    ``implementation=None`` that is every call on CPU and TPU, and on a GPU the calls
    cuDNN cannot take: float32 and wider (``itemsize`` >= 4), or a head_dim it has no
    kernel for (priced as on Hopper, the widest: :func:`selection.cudnn_call_reason`)."""
    impl = op.options.get("implementation")
    if impl is not None:
        return impl in ("xla", "native")  # native: the XLA kernel's backward
    if kind != "gpu":
        return True
    dtype = {2: "bfloat16", 4: "float32", 8: "float64"}.get(itemsize, "float32")
    spec = selection.CallSpec(dtype, head_dim, is_causal=True)
    return selection.cudnn_call_reason(_PRICED_GPU, spec) is not None


def _branch_result_held(plan, sb, h: int, qshard: float, streamed: bool,
                        longnet: bool) -> float:
    """Bytes of one branch's result held until the merge, per device: its output and,
    in the backward, its cotangent and dq. With the XLA kernel (``streamed``,
    :func:`_streams_branches`) the local branches stream into one partial (``3 Q``
    for all of them, counted once by the caller) and, in longnet mode, a spanning
    branch merges into it at its ``n / r`` selected rows (ops/distributed.py);
    otherwise (cuDNN) every branch holds its own, for its heads. (The heads
    strategy's one-device program streams them all: it has no such term.)"""
    if streamed and sb.is_local and plan.branch.window is None:
        return 0.0
    share = len(plan.query_heads) / h
    if streamed and longnet and plan.branch.window is None:
        share = 1.0 / sb.rate  # its dilated rows only
    return 3 * qshard * share


def _device_kind() -> str:
    try:
        platform = jax.devices()[0].platform
    except RuntimeError:  # pragma: no cover
        return "cpu"
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
