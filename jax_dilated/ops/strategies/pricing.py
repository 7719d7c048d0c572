"""The cost model's shared pieces: the per-device figures of a strategy
(:class:`StrategyCost`), how a device kind prices them into an estimated time
(:class:`_Pricing`, its balance :data:`_BALANCE` and CPU factor
:data:`_CPU_SEQ_SHARDED_WORK`), and the figures more than one strategy's pricing
uses: the call's flops (:func:`_branch_flops`), the causal work share
(:func:`_causal_share`) and the bytes a ring sends (:func:`_ring_sent`,
:func:`_ring_keeps_block`).

Apart from :mod:`jax_dilated.ops.strategies.cost` (which prices whole calls and, for
dilated attention, each branch) so that it and the strategies' other modules import
them from a module that imports none of them back. The model is documented in
docs/semantics.md, section 8 ("The cost model of ``"auto"``")."""

from __future__ import annotations

import dataclasses

from jax_dilated.backends import selection
from jax_dilated.core.branches import is_window
from jax_dilated.ops.strategies.operation import Operation


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
      (:func:`~.cost._logits_blocks_held`).
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


# The GPU whose kernel limits the cost model assumes when it prices a GPU.
_PRICED_GPU = selection.DeviceInfo("gpu", "NVIDIA GPU (priced as Hopper)", (9, 0), "cuda")

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
