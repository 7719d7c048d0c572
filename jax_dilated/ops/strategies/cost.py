"""The strategies' cost model: bytes sent, memory held and work per device for each
strategy on one call's shapes (:func:`estimate`), and how a device kind prices them
into an estimated time (:class:`_Pricing`), which ``"auto"`` minimizes
(:mod:`jax_dilated.ops.strategies.choice`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_dilated.backends import selection
from jax_dilated.backends.xla.layout import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from jax_dilated.core.branches import is_window
from jax_dilated.ops import distributed, head_parallel
from jax_dilated.ops.strategies.operation import Operation, describe, plans_of, servable

__all__ = ["StrategyCost", "estimate", "pricing_for"]


@dataclasses.dataclass(frozen=True)
class StrategyCost:
    """Per-device figures of one strategy for one call (forward + backward).

    strategy: the strategy (a tuple with one entry per branch for the per-branch
      mix of dilated attention).
    sent_bytes: bytes each device sends (forward and backward together).
    held_bytes: the largest inputs/outputs/transfer buffers a device holds at once
      for the attention (its shards, what it gathered or received, the output and
      gradient accumulators). Kernel temporaries, the same for every strategy up to
      the block sizes, are not counted, except where the block sizes differ by
      strategy: the XLA kernel's logits blocks of a dilated branch spanning devices
      (:func:`_logits_blocks_held`).
    overlap: whether all transfers can overlap compute (a ring sends the next block
      while computing on this one).
    work: the largest share of the attention's arithmetic one device does (1 / P when
      balanced; causal contiguous shards put up to 2 / (P + 1) on the last device).
    reason: None when the strategy can serve, else why not.
    small_work: the part of ``work`` done in kernel calls over a shard's tokens (a
      ring's steps, the all-gather's blocks, dilated branches run on the shards), which
      costs more than one call over a whole sequence on CPU (:data:`_CPU_SEQ_SHARDED_WORK`).
    overlapped_bytes: the part of ``sent_bytes`` that overlaps compute (None: all of
      it when ``overlap``, else none).
    note: None, or how the strategy runs this call where that is not its usual way
      (dilated attention's ``"heads"`` branch by branch), printed by
      :func:`~.choice.explain_strategy`.
    forward_bytes: the part of ``sent_bytes`` the forward pass sends (what a compiled
      forward alone moves; ``tests/test_strategy_bytes.py`` checks both against the
      collectives of the compiled programs). None where not split.
    """

    strategy: str | tuple
    sent_bytes: float
    held_bytes: float
    overlap: bool
    work: float
    reason: str | None = None
    small_work: float = 0.0
    overlapped_bytes: float | None = None
    note: str | None = None
    forward_bytes: float | None = None

    @property
    def overlappable(self) -> float:
        """Bytes whose transfer may overlap compute (``overlapped_bytes``, or by
        ``overlap``)."""
        if self.overlapped_bytes is not None:
            return self.overlapped_bytes
        return self.sent_bytes if self.overlap else 0.0


def _causal_share(p: int, layout: str, causal: bool) -> float:
    if not causal or p == 1 or layout != "contiguous":
        return 1.0 / p
    return 2.0 / (p + 1)  # the last device's P blocks of the P (P + 1) / 2


@dataclasses.dataclass(frozen=True)
class _Pricing:
    """How :func:`~.choice.choose` turns a :class:`StrategyCost` into an estimated time."""

    kind: str  # device kind: "cpu", "gpu", "tpu"
    flops: float  # of the whole call, forward and backward

    @property
    def cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def balance(self) -> float:
        return _BALANCE.get(self.kind, _BALANCE["gpu"])

    def time(self, work: float, small_work: float, sent: float,
             overlapped: float) -> float:
        """``compute + exposed transfer``, in flops (:meth:`exposed`)."""
        return (self._compute(work, small_work)
                + self.exposed(work, small_work, sent, overlapped) * self.balance)

    def exposed(self, work: float, small_work: float, sent: float,
                overlapped: float) -> float:
        """Bytes whose transfer compute does not hide: an overlapped transfer hides
        behind the compute only up to the compute's own time (a ring step waits for
        its next block), and on CPU nothing overlaps."""
        if self.cpu:
            return sent
        return sent - min(overlapped, self._compute(work, small_work) / self.balance)

    def _compute(self, work: float, small_work: float) -> float:
        factor = _CPU_SEQ_SHARDED_WORK if self.cpu else 1.0
        return (work + (factor - 1.0) * small_work) * self.flops

    def of(self, c: StrategyCost) -> float:
        return self.time(*self._parts(c))

    def exposed_of(self, c: StrategyCost) -> float:
        return self.exposed(*self._parts(c))

    @staticmethod
    def _parts(c: StrategyCost):
        return c.work, c.small_work, c.sent_bytes, c.overlappable


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
    under every strategy (:func:`.dilated_over_heads`): ``"ring"`` is then the heads
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

    packed = segment_ids and op.kind == "dilated"
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


def _ring_sent(size: int, kb: float, itemsize: int, keeps_block: bool):
    """``(forward, forward + backward)`` bytes one device sends around a ring of
    ``size`` devices whose visiting blocks are ``kb`` bytes of keys and as many of
    values (ops/ring.py), as the compiled programs move them
    (tests/test_strategy_bytes.py), rather than ``P - 1`` hops of each:

    * the forward sends the block ``P`` times where the ring keeps the block it packed
      (``keep_packed``: the XLA kernel's ring steps, one loop over all ``P`` steps
      brings it home for the backward), ``P - 1`` times with the generic steps
      (cuDNN's);
    * the backward sends k, v ``P - 1`` times and the dk, dv accumulators ``P`` times
      (the last hop brings them to their owner), accumulated in the statistics dtype
      (float32 for half-precision inputs: twice their bytes)."""
    if size <= 1:
        return 0.0, 0.0
    fwd = 2 * (size if keeps_block else size - 1) * kb
    acc = kb * max(itemsize, 4) / itemsize
    return fwd, fwd + 2 * (size - 1) * kb + 2 * size * acc


def _ring_keeps_block(op, kind: str, itemsize: int, head_dim: int) -> bool:
    """Whether the ring runs the XLA kernel's fused steps, which keep the packed block
    (a forward of ``P`` hops, :func:`_ring_sent`): block-sparse attention always; the
    XLA and native kernels (the native one inherits the XLA ring steps); with
    ``implementation=None`` every call off GPU, and on a GPU the calls cuDNN cannot
    take as a ring step (causal, a window, or dtype / head_dim it has no kernel for,
    priced as on Hopper: ``backends/registry.py``, ``ring_steps``)."""
    if op.kind == "block_sparse":
        return True
    impl = op.options.get("implementation")
    if impl is not None:
        return impl != "cudnn"
    if kind != "gpu" or op.options.get("is_causal") or op.options.get("window") is not None:
        return True
    dtype = {2: "bfloat16", 4: "float32", 8: "float64"}.get(itemsize, "float32")
    spec = selection.CallSpec(dtype, head_dim, is_causal=False)
    return selection.cudnn_call_reason(_PRICED_GPU, spec) is not None


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


# The GPU whose kernel limits the cost model assumes when it prices a GPU.
_PRICED_GPU = selection.DeviceInfo("gpu", "NVIDIA GPU (priced as Hopper)", (9, 0), "cuda")


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


# Relative price of one exposed byte against the work of the whole attention: the
# attention of one query row over T keys costs about 4 T H D flops (x 2.5 with the
# backward) while a byte moves at ``bandwidth``; with flops/bandwidth the device's
# balance point. Rough figures, per device kind (documented in docs/semantics.md).
_BALANCE = {"cpu": 2.0, "gpu": 100.0, "tpu": 200.0}  # flop per byte moved

# On CPU the devices of one process share the same cores: a transfer is a copy made
# by the cores that compute, so nothing overlaps; and the sequence-sharded strategies
# compute a shard's T / P queries in many small kernel calls (a ring's P steps, the
# all-gather's blocks of a causal layout), slower than the heads strategy's one call
# over the whole sequence. The model prices their work by this factor there, about
# the median ratio of the ring's and the all-gather's times to the heads strategy's
# for exact and block-sparse attention on the project's CPU (docs/benchmarks.md,
# "Time (fwd+bwd), and what "auto" picks").
_CPU_SEQ_SHARDED_WORK = 1.45


def _device_kind() -> str:
    try:
        platform = jax.devices()[0].platform
    except RuntimeError:  # pragma: no cover
        return "cpu"
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)




def _branch_flops(op: Operation, b, t, h, d) -> list[float]:
    """Forward + backward flops of the call (``10 B Lq Lk H D`` per dense block): one
    entry per branch for dilated attention, else one entry."""
    causal = 0.5 if op.options.get("is_causal", False) else 1.0
    dense = [10.0 * b * t * t * h * d * causal]
    if op.kind != "dilated":
        return dense
    try:
        pairs = op.branches
    except (ValueError, TypeError, KeyError):
        return dense
    flops = []
    for w, r in pairs:
        if is_window(w):  # every query, its window of keys
            flops.append(10.0 * b * t * min(w.left + (w.right or 0) + 1, t) * h * d)
            continue
        seg = min(w, t)
        flops.append(10.0 * b * (t / r) * (seg / r) * h * d * causal)
    return flops
