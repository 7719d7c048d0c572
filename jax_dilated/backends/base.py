"""The kernel interface every backend implements: :class:`Kernel`.

A kernel computes attention of a block of queries against a block of keys and
values and returns the output together with the log-sum-exp (as two floats,
``lse`` and its low part ``lse_lo``), so that partial results over different key
sets can be merged exactly
(:mod:`jax_dilated.core.softmax`). One class per backend implements the whole
protocol (:class:`~jax_dilated.backends.xla.XlaKernel`,
:class:`~jax_dilated.backends.cudnn.CudnnKernel`,
:class:`~jax_dilated.backends.registry.AutoKernel`); an entry point a backend has no
kernel for says so explicitly (``None`` from the ring-step factories, a
``ValueError`` from a call it cannot serve).

Shapes, for every method: ``q`` [N, Lq, H, D], ``k``/``v`` [N, Lk, H_kv, D],
``H % H_kv == 0``. The per-call masks travel as one value, :class:`Masks`. The
statistics
(``lse``, ``lse_lo``, ``delta``) are float32, float64 for float64 inputs (the
*stats dtype*).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

# the ring-step protocol and what a step sees, re-exported: kernels implement both
from jax_dilated.backends.steps import KeySide, QuerySide, RingSteps, RowGrads

__all__ = ["KernelArgs", "Masks", "NO_MASKS", "BlockLists", "any_pair_allowed", "segments_meet",
           "window_meets", "window_arg", "WINDOW_CAP", "Kernel", "KernelBase", "RingSteps",
           "QuerySide", "KeySide", "RowGrads"]


@dataclasses.dataclass(frozen=True)
class KernelArgs:
    """Static (hashable) arguments of one kernel call.

    scale: multiplier of ``q.k``.
    is_causal: key ``t`` is allowed for query ``p`` only if ``pos(t) <= pos(p)``.
    dropout_rate: attention-probability dropout rate in ``[0, 1)``.
    block_q, block_k: target block sizes (None: the backend's default).
    window: ``(left, right)`` non-negative ints or None: key ``t`` is allowed for
      query ``p`` only if ``pos(p) - left <= pos(t) <= pos(p) + right`` (on top of
      every other mask; docs/semantics.md, "Sliding windows, soft-capping and
      sinks"). Entries above :data:`WINDOW_CAP` are stored as it (no difference for
      positions below 2**30).
    logit_soft_cap: ``c > 0`` or None: the (scaled) logits ``s`` become
      ``c tanh(s / c)`` before masking and the softmax.
    """

    scale: float
    is_causal: bool = False
    dropout_rate: float = 0.0
    block_q: int | None = None
    block_k: int | None = None
    window: tuple[int, int] | None = None
    logit_soft_cap: float | None = None


class Masks(NamedTuple):
    """The per-call masks of one kernel call, as one value (a pytree; every field
    None unless given).

    q_positions: int [Lq], k_positions: int [Lk], the positions of the causal rule
      ``k_pos <= q_pos`` and of the window (default ``arange``).
    kv_valid: bool [N, Lk], or [N, Lk, H_kv] when heads see different keys.
    q_segment_ids: int [N, Lq], k_segment_ids: int [N, Lk], document ids (packed
      sequences: a query attends only to keys with its own id; both given or
      neither; docs/semantics.md, "Packed sequences").
    dropout_rng: the dropout key, needed when ``args.dropout_rate > 0``.
    """

    q_positions: Any = None
    k_positions: Any = None
    kv_valid: Any = None
    q_segment_ids: Any = None
    k_segment_ids: Any = None
    dropout_rng: Any = None


NO_MASKS = Masks()


# Window entries are capped here so that position +- window stays inside int32 (real
# positions are below 2**30; padded positions are -1 and 2**31 - 1).
WINDOW_CAP = 1 << 30


def window_arg(window) -> tuple[int, int] | None:
    """A checked window (``validation.check_window``) as :class:`KernelArgs` stores it."""
    if window is None:
        return None
    return (min(int(window[0]), WINDOW_CAP), min(int(window[1]), WINDOW_CAP))


class BlockLists(NamedTuple):
    """The blocks a block-sparse kernel call visits, as padded index lists.

    rows: int [num_q_blocks, L], key-block indices each query block visits.
    rows_ok: bool [num_q_blocks, L] marking real entries (False = padding, skipped),
      or None when every entry is real.
    cols: int [num_k_blocks, Lt], the transpose: query-block indices per key block
      (the backward's dk/dv loop).
    cols_ok: bool [num_k_blocks, Lt] or None, as ``rows_ok``.

    Arrays may be NumPy constants or traced (e.g. picked by device index inside a
    ring); only their shapes are static. Padding entries must still be valid indices.
    """

    rows: Any
    rows_ok: Any
    cols: Any
    cols_ok: Any


# Above this many (query, key) id pairs per batch item, segments_meet sorts the key
# ids instead of comparing every pair (a ring step compares whole shards).
_PAIRWISE_IDS = 1 << 16


def segments_meet(q_seg, k_seg):
    """Whether any query id of ``q_seg`` [N, Lq] equals a key id of ``k_seg`` [N, Lk]
    in the same batch item (a traced bool scalar). Exact for ids in any order:
    every pair is compared for small blocks; for large ones (whole ring shards) the
    key ids are sorted and each query id is looked up (O((Lq + Lk) log Lk))."""
    if q_seg.shape[-1] * k_seg.shape[-1] <= _PAIRWISE_IDS:
        return jnp.any(q_seg[..., :, None] == k_seg[..., None, :])

    def exact():
        ks = jnp.sort(k_seg, axis=-1)
        at = jnp.clip(jax.vmap(jnp.searchsorted)(ks, q_seg), 0, ks.shape[-1] - 1)
        return jnp.any(jnp.take_along_axis(ks, at, axis=-1) == q_seg)

    # Disjoint id ranges share no id: an O(L) test that settles most block pairs of
    # packed rows (documents in order) before the sort is paid for.
    ranges_meet = jnp.any((jnp.min(q_seg, axis=-1) <= jnp.max(k_seg, axis=-1))
                          & (jnp.min(k_seg, axis=-1) <= jnp.max(q_seg, axis=-1)))
    return jax.lax.cond(ranges_meet, exact, lambda: jnp.asarray(False))


# The window test of a block compares position ranges of this many equal pieces of
# the queries and of the keys (a zigzag shard is two distant chunks: one range over
# the whole shard would cover nearly the whole sequence).
_WINDOW_PIECES = 2
_PAD_POS_HI = np.iinfo(np.int32).max  # padded keys (kernel layouts); padded queries: < 0


def window_meets(window, q_pos, k_pos):
    """Whether some query position of ``q_pos`` [Lq] and key position of ``k_pos``
    [Lk] may lie within ``window = (left, right)`` of each other (a traced bool; a
    necessary condition: the position ranges of pieces of each side overlap, widened
    by the window). Padding positions (queries < 0, keys ``2**31 - 1``) are ignored."""
    def pieces(x, pad):
        x = jnp.asarray(x, jnp.int32)
        n = _WINDOW_PIECES if x.shape[0] % _WINDOW_PIECES == 0 else 1
        x = x.reshape(n, -1)
        lo = jnp.min(jnp.where(pad(x), _PAD_POS_HI, x), axis=1)
        hi = jnp.max(jnp.where(pad(x), -1, x), axis=1)
        return lo, hi

    left, right = window
    q_lo, q_hi = pieces(q_pos, lambda x: x < 0)
    k_lo, k_hi = pieces(k_pos, lambda x: x == _PAD_POS_HI)
    # key range [k_lo, k_hi] meets [q_lo - left, q_hi + right], for some pair of pieces
    meet = ((k_lo[None, :] <= q_hi[:, None] + right)
            & (k_hi[None, :] >= q_lo[:, None] - left))
    return jnp.any(meet)


def any_pair_allowed(is_causal: bool, q_pos, k_pos, kv_valid, q_seg=None, k_seg=None, *,
                     window=None):
    """Whether any (query, key) pair of a block is allowed; None when statically always.

    Used to skip whole blocks (kernel) and whole ring steps: causal blocks whose
    earliest key is after the latest query, blocks with no valid key, blocks
    where no query shares a document (segment id, [N, Lq] / [N, Lk]) with a key,
    and blocks whose keys all lie outside every query's ``window`` (``(left,
    right)``, see :func:`window_meets`; positions None: not tested).
    The tests are separate (a block may pass each on different pairs): a
    necessary condition, which is all that skipping needs.
    """
    need = None
    if is_causal:
        need = jnp.min(k_pos) <= jnp.max(q_pos)
    if window is not None and q_pos is not None and k_pos is not None:
        near = window_meets(window, q_pos, k_pos)
        need = near if need is None else need & near
    if kv_valid is not None:
        any_valid = jnp.any(kv_valid)
        need = any_valid if need is None else need & any_valid
    if q_seg is not None:
        meet = segments_meet(q_seg, k_seg)
        need = meet if need is None else need & meet
    return need


@runtime_checkable
class Kernel(Protocol):
    """An attention backend (shapes and dtypes: module docstring).

    ``name`` says which backend it is (``"xla"``, ``"cudnn"``, ``"native"``,
    ``"auto"``). Two capabilities say what the operations may ask of it:

    * ``blockwise``: its backward is the blockwise XLA kernel's (it reads ``delta``
      and needs no output; cheap per call, so the one-device programs stream chunks
      of segments through it);
    * ``fused_dilated``: it has :meth:`dilated_forward` and :meth:`dilated_backward`,
      every branch of one-device dilated attention in one call per pass
      (:mod:`jax_dilated.ops.dilated_fused`).

    :class:`KernelBase` gives a kernel without the optional parts their explicit
    defaults (no capability, every call served, the fused methods refused).
    """

    name: str
    blockwise: bool
    fused_dilated: bool

    def call_reason(self, q, k, args: KernelArgs, masks: Masks = NO_MASKS) -> str | None:
        """Why this kernel would not serve a :meth:`forward` of these shapes (``q``,
        ``k`` arrays or ``jax.ShapeDtypeStruct``) itself, or None when it would.
        A kernel that routes what it cannot serve to another (the native kernel to
        the XLA kernel) still answers the call; the reason is for the programs that
        need this kernel's own path (:mod:`jax_dilated.ops.dilated_fused`)."""

    def dilated_forward(self, q, k, v, args: KernelArgs, plans, *, kv_mask=None,
                        accumulate: bool = False, out_scale: float = 1.0,
                        shared_pairs: bool = False):
        """Every branch of ``plans`` in one call (``fused_dilated`` kernels):
        ``(o, lse, lse_lo)`` [B, T, H, D], [B, T, H] written in place; ``accumulate``
        continues each row's softmax over the branches (longnet), else each row is
        written by its one branch times ``out_scale`` (head_groups)."""

    def dilated_backward(self, q, k, v, do, c, lse, delta, args: KernelArgs, plans, *,
                         kv_mask=None, shared_pairs: bool = False):
        """The gradients ``(dq, dk, dv)`` of :meth:`dilated_forward` from the global
        statistics (``fused_dilated`` kernels)."""

    def forward(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS):
        """Attention of ``q`` against every allowed key of ``k``/``v``.

        Returns ``(o, lse, lse_lo)``: ``o`` [N, Lq, H, D] in the input dtype, the
        log-sum-exp ``lse + lse_lo`` [N, Lq, H] in the stats dtype as the two parts
        of :mod:`jax_dilated.core.softmax` (a backend that only has the rounded value
        returns ``lse_lo = 0``); ``o = 0``, ``lse = -inf``, ``lse_lo = 0`` for a row
        with no allowed key.
        """

    def backward(self, q, k, v, do, lse, delta, args: KernelArgs, masks: Masks = NO_MASKS,
                 *, out=None):
        """Gradients of the forward from saved statistics: ``(dq, dk, dv)``.

        With ``p = exp(scale q.k - lse)``: ``dv = p^T do``, ``ds = p (do.v - delta)``,
        ``dq = scale ds k``, ``dk = scale ds^T q``. ``lse`` and ``delta`` [N, Lq, H]
        may be *global* statistics (over more keys than this call sees), which is how
        a ring or a branch merge differentiates through a partial:
        ``delta = rowsum(do * o) - dlse`` with the global ``o``
        (:func:`~jax_dilated.core.softmax.backward_delta`). Only the rounded ``lse``
        is read: callers fold ``lse_lo`` into ``do`` and ``delta``
        (:func:`~jax_dilated.core.softmax.backward_rows`). The same
        ``masks.dropout_rng`` as the forward draws the same masks. Gradients in the
        input dtypes.

        ``out``: None, or an output [N, Lq, H, D] (q's dtype) with ``delta =
        rowsum(do * out)`` to its rounding - the global output where the global
        log-sum-exp has no cotangent. A kernel that forms ``delta`` itself from an
        output (cuDNN) then runs its own backward on ``out``; one that reads
        ``delta`` (XLA) ignores it.
        """

    def attention(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, *,
                  sinks=None, lse_grad=True):
        """:meth:`forward`, differentiable in ``q``, ``k``, ``v`` through every output
        ``(o, lse, lse_lo)``.

        ``lse_grad`` (static) False: the caller does not differentiate through the
        log-sum-exp, which then comes with its gradient stopped, so that the backward
        can run from ``o`` alone (cuDNN's own backward, :meth:`backward` ``out=``).

        ``sinks`` [H] or None: attention sinks folded into the result
        (:func:`~jax_dilated.core.softmax.fold_sinks`) and differentiable, the
        backward running on the sink-including statistics. (:meth:`forward` and the
        ring steps have none: a caller accumulating partials starts from the sinks'
        own, :func:`~jax_dilated.core.softmax.empty_partial`.)"""

    def batch_chunk(self, n: int, q, k, args: KernelArgs) -> int:
        """How many of ``n`` batched items (``q``/``k`` shaped as in :meth:`forward`,
        arrays or ``jax.ShapeDtypeStruct``) one call should take, for a caller that
        loops over a long batch itself (e.g. dilated segments, chunk by chunk)."""

    def block_sparse_forward(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, *,
                             blocks: BlockLists):
        """As :meth:`forward`, over the blocks listed in ``blocks`` only.

        Blocks are exactly ``args.block_q`` x ``args.block_k``; ``Lq``/``Lk`` are
        padded up to whole blocks (padded keys are never attended). Within a listed
        block the causal rule and ``kv_valid`` still apply; all listed blocks of a
        query block share one softmax.
        """

    def block_sparse_backward(self, q, k, v, do, lse, delta, args: KernelArgs,
                              masks: Masks = NO_MASKS, *, blocks: BlockLists):
        """As :meth:`backward`, over the blocks listed in ``blocks`` only:
        ``(dq, dk, dv)``."""

    def ring_steps(self, q, k, args: KernelArgs) -> RingSteps | None:
        """The backend's own :class:`RingSteps` for queries like ``q`` and keys like
        ``k``, or None (not for these shapes, or no such kernel in this backend).

        Fused ring steps let a ring (:mod:`jax_dilated.ops.ring`) keep keys and values
        in the kernel's own layout for the whole ring and accumulate in place,
        instead of converting every visiting block and allocating fresh outputs at
        every step. With None the ring runs :meth:`forward`/:meth:`backward` per
        step (the generic steps of :func:`jax_dilated.ops.ring_steps.kernel_steps`).
        A ring uses one of the two for both passes, so the steps must draw the
        dropout masks :meth:`forward` would.
        """

    def block_sparse_ring_steps(self, q, k, args: KernelArgs) -> RingSteps | None:
        """:class:`RingSteps` as :meth:`ring_steps` that fold in only the listed key
        blocks of each query block (``KeySide.blocks``, a :class:`BlockLists` in
        blocks of exactly ``args.block_q`` x ``args.block_k``; ``rows`` and
        ``rows_ok`` are read, ``cols`` may be None). None where the shapes do not
        allow them or the backend has no block-sparse kernel (the block-sparse ring
        then calls :meth:`block_sparse_forward`/:meth:`block_sparse_backward` per
        step).
        """


class KernelBase:
    """The explicit defaults of the optional parts of :class:`Kernel`: no capability,
    every call served, no fused dilated program (its methods raise), no ring steps of
    its own (None: a ring calls ``forward``/``backward`` per step)."""

    name = "kernel"
    blockwise = False
    fused_dilated = False

    def call_reason(self, q, k, args: KernelArgs, masks: Masks = NO_MASKS) -> str | None:
        return None

    def dilated_forward(self, q, k, v, args: KernelArgs, plans, **kw):
        raise ValueError(f"the {self.name} kernel has no fused dilated program "
                         "(fused_dilated is False)")

    def dilated_backward(self, q, k, v, do, c, lse, delta, args: KernelArgs, plans, **kw):
        raise ValueError(f"the {self.name} kernel has no fused dilated program "
                         "(fused_dilated is False)")

    def ring_steps(self, q, k, args: KernelArgs):
        return None

    def block_sparse_ring_steps(self, q, k, args: KernelArgs):
        return None
