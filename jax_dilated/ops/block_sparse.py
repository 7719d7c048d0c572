"""Block-sparse attention: exact softmax over the active blocks of a block mask.

The sequence is cut into blocks of ``block_size`` tokens; a block mask over
(query block, key block) (a :mod:`~jax_dilated.block_patterns` pattern or a bool
array) says which key blocks each query block attends to. Every query attends,
with ONE softmax, to the keys of all the active key blocks of its query block
(AND the causal rule and the key padding mask).

How the work follows the density (everything below is decided at trace time):

* The mask is turned into NumPy *block lists*: for every query block the indices
  of its active key blocks, padded to the longest row, and the transpose (for
  every key block, the query blocks that read it). The kernel
  (``block_sparse_forward``/``backward`` of :mod:`jax_dilated.backends.xla`)
  scans these lists, gathers the listed key blocks and folds them into the online
  softmax of :mod:`jax_dilated.core.softmax`; padding entries are skipped with
  ``lax.cond``. The backward (``jax.custom_vjp``, recomputing probabilities from
  the saved log-sum-exp) walks the transposed lists for dk/dv and scatters dq.
  Time is proportional to the number of active blocks, memory is linear in the
  sequence length.
* Heads: a shared mask is one list for all heads (GQA keys are never repeated).
  A per-head mask is split into classes of heads with identical masks, each with
  its own lists; a class that is a union of whole GQA groups keeps the compact
  kv heads, any other class reads the kv head of each of its query heads.
* A mask given as a *traced* array (computed inside ``jit``) cannot be listed at
  trace time: every key block is then listed and the traced mask decides, per
  entry, whether the ``lax.cond`` computes it. The result is the same; the time
  saved is only the skipped blocks' compute (the loop still visits every block),
  and per-head traced masks run head by head.
* Over a ring (``seq_axis=`` inside ``shard_map``, or ``jd.sharded``) the lists
  are tabulated for every (device, visiting shard) pair and picked by device
  index; a ring step in which no block of the visiting shard is active (for any
  head) is skipped with ``lax.cond``, forward and backward. The ring is the one
  of :func:`jax_dilated.ops.ring.ring_partials`; what a step computes is a
  :class:`~jax_dilated.backends.base.RingSteps` made by :class:`_Plan`. Where all
  heads share one set of lists and the kernel has block-sparse ring steps
  (``block_sparse_ring_steps``), those (:class:`_ListedSteps`): keys and values
  travel in the kernel's blocked layout and each step folds its listed blocks into
  accumulators carried in place (o/lse forward; dq and blocked dk/dv backward), so
  a device holds a few shard-sized buffers rather than per-step copies. Otherwise
  (several head classes, or no such steps) :class:`_ClassSteps`: every class calls
  the block-sparse kernel on its heads and the step's partial is merged in with
  :func:`jax_dilated.core.softmax.merge_partials`. The key/value transfer itself is
  not skipped: see :func:`block_sparse_attention`.

Planning (mask -> lists, head classes) is :mod:`jax_dilated.ops.block_sparse_plan`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends import KernelArgs, get_kernel
from jax_dilated.backends.base import KeySide, Masks, QuerySide, RingSteps, RowGrads, window_arg
from jax_dilated.block_patterns import BlockPattern
from jax_dilated.core import layouts, softmax, validation
from jax_dilated.core.arrays import take_static
from jax_dilated.core.documents import document_ids
from jax_dilated.core.skip import maybe_skip
from jax_dilated.core.types import Array, ArrayLike, Implementation, Layout
from jax_dilated.core.vma import varying_like
from jax_dilated.ops.block_sparse_plan import (
    HeadClass,
    block_lists,
    head_classes,
    resolve_mask,
    ring_blocks,
    window_mask,
)
from jax_dilated.ops.ring import RingConfig, ring_partials
from jax_dilated.ops.ring_steps import (
    KernelSteps,
    PartialSteps,
    zeros_unless,
)

__all__ = ["block_lists", "block_sparse_attention"]


# ------------------------------------------------------------------- ring steps


def _heads(x, idx):
    return x if idx is None else take_static(x, idx, axis=2)


class _Plan:
    """The head classes of one call and their lists; as ``RingConfig.steps`` it makes
    the ring steps of a trace (:meth:`__call__`). The identity is the hash: a fresh
    object per trace, never compared by value.

    kernel: the call's kernel (the single-device call uses it; a ring passes its own).
    gq, gk: global block index of every local query / key block, [P, n_blocks].
    """

    def __init__(self, kernel, args: KernelArgs, classes, num_heads: int, gq, gk):
        self.kernel, self.args, self.classes, self.gq, self.gk = kernel, args, classes, gq, gk
        order = np.concatenate([np.arange(num_heads) if c.q_heads is None else c.q_heads
                                for c in classes])
        self.inverse = None if np.array_equal(order, np.arange(num_heads)) else np.argsort(order)

    def assemble(self, parts):
        """The classes' per-head arrays [..., H_c, ...] (axis 2) -> the call's head order."""
        out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)
        return out if self.inverse is None else take_static(out, self.inverse, axis=2)

    def need(self, c: HeadClass, query: QuerySide, keys: KeySide, aux):
        """(lists, active) of class ``c`` for this step (see :meth:`HeadClass.need`)."""
        return c.need(query.index, keys.index, aux, self.gq, self.gk, keys.valid,
                      query.segments, keys.segments)

    def __call__(self, kernel, q, k, aux) -> RingSteps:
        """The kernel's block-sparse ring steps where all heads share one class (one
        set of lists) and the kernel has them for these shapes: keys and values then
        travel in the kernel's layout and every step folds its listed blocks into
        accumulators carried in place. Else the steps of :class:`_ClassSteps`."""
        if len(self.classes) == 1 and self.classes[0].q_heads is None:
            steps = kernel.block_sparse_ring_steps(q, k, self.args)
            if steps is not None:
                return _ListedSteps(steps, self, aux)
        return _ClassSteps(kernel, self, aux)


class _ListedSteps:
    """The kernel's block-sparse ring steps with the lists of the (one) head class
    of each step filled in (``keys.blocks``); a step is needed where any of its
    listed blocks is active and a key is valid."""

    def __init__(self, steps: RingSteps, plan: _Plan, aux):
        self.plan, self.aux = plan, aux
        # the kernel's own steps do the work, on the keys visit() lists
        self.keep_packed = steps.keep_packed
        self.pack_kv, self.unpack_kv = steps.pack_kv, steps.unpack_kv
        self.forward, self.backward = steps.forward, steps.backward

    def visit(self, query: QuerySide, keys: KeySide):
        lists, need = self.plan.need(self.plan.classes[0], query, keys, self.aux)
        return keys._replace(blocks=lists), need


class _ClassSteps(PartialSteps):
    """Block-sparse steps head class by head class, over the kernel's
    ``block_sparse_forward``/``backward`` (:class:`KernelSteps` per class): each
    class reads its own query heads and kv heads and skips on its own (``needed`` is
    None: the step as a whole always runs). Also the single-device call (one step,
    index 0)."""

    def __init__(self, kernel, plan: _Plan, aux):
        self.kernel_steps, self.plan, self.aux = KernelSteps(kernel, plan.args), plan, aux

    def _classes(self, query: QuerySide, keys: KeySide):
        """Per class: its queries, its keys (with its lists) and whether it is needed."""
        k, v = keys.kv
        for c in self.plan.classes:
            lists, need = self.plan.need(c, query, keys, self.aux)
            yield c, query._replace(q=_heads(query.q, c.q_heads)), keys._replace(
                kv=(_heads(k, c.kv_heads), _heads(v, c.kv_heads)), blocks=lists), need

    def partial(self, query: QuerySide, keys: KeySide):
        stats = softmax.stats_dtype(query.q.dtype)
        o, lse, lse_lo = _class_partials(self.kernel_steps.kernel, self.plan, self.aux,
                                         query, keys)
        return o.astype(stats), lse, lse_lo

    def grads(self, query: QuerySide, keys: KeySide, rows: RowGrads):
        stats = softmax.stats_dtype(query.q.dtype)
        compute, k = self.kernel_steps.compute_grads, keys.kv[0]
        dqs, dk, dv = [], None, None
        for c, qc, kc, need in self._classes(query, keys):
            rc = RowGrads(*(None if x is None else _heads(x, c.q_heads) for x in rows))
            dqc, dkc, dvc = zeros_unless(
                need, lambda qc=qc, kc=kc, rc=rc: compute(qc, kc, rc), qc, kc, rc)
            dqs.append(dqc)
            if c.kv_heads is None:
                dk = dkc if dk is None else dk + dkc
                dv = dvc if dv is None else dv + dvc
            else:
                zero = varying_like(jnp.zeros(k.shape, stats), (k, dkc))
                idx = jnp.asarray(c.kv_heads)
                dk = (zero if dk is None else dk).at[:, :, idx].add(dkc)
                dv = (zero if dv is None else dv).at[:, :, idx].add(dvc)
        return self.plan.assemble(dqs), dk, dv


def _class_partials(kernel, plan: _Plan, aux, query: QuerySide, keys: KeySide):
    """Every head class's block-sparse call on this step's keys, assembled over the
    heads: ``(o, lse, lse_lo)`` as :meth:`Kernel.block_sparse_forward` returns them
    (``o`` in the input dtype); a class with no active block gives the empty
    partial without a call (:func:`~jax_dilated.core.skip.maybe_skip`)."""
    k, v = keys.kv
    masks = Masks(q_positions=query.positions, k_positions=keys.positions,
                  kv_valid=keys.valid, q_segment_ids=query.segments,
                  k_segment_ids=keys.segments)
    parts = []
    for c in plan.classes:
        lists, need = plan.need(c, query, keys, aux)
        k_c, v_c = _heads(k, c.kv_heads), _heads(v, c.kv_heads)
        run = functools.partial(kernel.block_sparse_forward, k=k_c, v=v_c, args=plan.args,
                                masks=masks, blocks=lists)
        parts.append(maybe_skip(need, run, _heads(query.q, c.q_heads),
                                functools.partial(_no_keys, kv=(k_c, v_c))))
    return tuple(plan.assemble(list(x)) for x in zip(*parts))


def _no_keys(q, kv):
    """The partial of queries ``q`` that meet no key (kernel dtypes: ``o`` in q's)."""
    stats = softmax.stats_dtype(q.dtype)
    o, lse, lse_lo = softmax.empty_partial(q.shape, stats)
    return varying_like((o.astype(q.dtype), lse, lse_lo), (q, kv))


# ------------------------------------------------------------------ single device


def _local_steps(q, k, v, kv_valid, plan, aux, segment_ids):
    steps = _ClassSteps(plan.kernel, plan, aux)
    return (steps, QuerySide(q, segments=segment_ids),
            KeySide((k, v), valid=kv_valid, segments=segment_ids))


def _local_forward(q, k, v, kv_valid, plan, aux, segment_ids, sinks):
    """One device: ``(o, lse, lse_lo)`` of every head class's call (the kernel entered
    from here), the [H] ``sinks`` (or None) folded in."""
    o, lse, lse_lo = _class_partials(plan.kernel, plan, aux, QuerySide(q, segments=segment_ids),
                                     KeySide((k, v), valid=kv_valid, segments=segment_ids))
    return softmax.fold_sinks(o.astype(softmax.stats_dtype(q.dtype)), lse, lse_lo, sinks)


def _local_fwd(q, k, v, kv_valid, plan, aux, segment_ids, sinks):
    # the sinks folded in here, so that the backward reads the one output
    o, lse, lse_lo = _local_forward(q, k, v, kv_valid, plan, aux, segment_ids, sinks)
    return (o, lse, lse_lo), (q, k, v, kv_valid, aux, segment_ids, o, lse, lse_lo, sinks)


def _local_bwd(plan, res, cotangents):
    q, k, v, kv_valid, aux, segment_ids, o, lse, lse_lo, sinks = res
    do, dlse, _ = cotangents  # lse_lo is a constant correction (core/softmax.py)
    steps, query, keys = _local_steps(q, k, v, kv_valid, plan, aux, segment_ids)
    do, delta = softmax.backward_rows(do, o, lse_lo, dlse)
    rows = RowGrads(do, lse, delta)
    dq, dk, dv = steps.grads(query, keys, rows)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None,
            softmax.sink_gradient(lse, delta, sinks))


_local = jax.custom_vjp(_local_forward, nondiff_argnums=(4,))
_local.defvjp(_local_fwd, _local_bwd)


# --------------------------------------------------------------------------- API


def block_sparse_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                           block_size: int, pattern: BlockPattern | ArrayLike,
                           is_causal: bool = False, scale: float | None = None,
                           kv_mask: ArrayLike | None = None, seq_axis: str | None = None,
                           layout: Layout = "contiguous",
                           implementation: Implementation | None = None,
                           return_lse: bool = False, axis_name: str | None = None,
                           segment_ids: ArrayLike | None = None,
                           window: tuple[int, int] | None = None,
                           logit_soft_cap: float | None = None,
                           sinks: ArrayLike | None = None,
                           ) -> Array | tuple[Array, Array]:
    """Attention over the active blocks of a block mask, exact over their union.

    Args:
      query: [batch, q_len, num_heads, head_dim].
      key, value: [batch, kv_len, num_kv_heads, head_dim] (``num_heads %
        num_kv_heads == 0``: grouped-query attention).
      block_size: tokens per block (queries and keys): the block of the pattern, which
        is also the kernel's block (``block_q = block_k = block_size``; there are no
        separate kernel block sizes here). On one device the lengths
        need not be multiples of it (the last block is short); over a ring it must
        divide the shard length (the zigzag chunk length for ``layout="zigzag"``).
      pattern: a :class:`~jax_dilated.block_patterns.BlockPattern`, or a bool array
        ``[q_blocks, k_blocks]`` (shared) or ``[num_heads, q_blocks, k_blocks]``
        (per head), True = query block attends to key block. Blocks count the
        *global* sequence (``ceil(len / block_size)``). NumPy / concrete masks are
        listed at trace time (work proportional to the active blocks); a traced
        mask makes every block a ``lax.cond`` (see the module docstring).
        Per-head patterns address the heads of this call: with heads sharded
        (``jd.sharded(..., head_axis=...)``) a shard's heads are numbered from 0,
        so give a shared pattern there, or per-shard arrays.
      is_causal: additionally key position <= query position (AND-ed with the
        pattern; blocks above the diagonal are dropped from the lists).
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      kv_mask: bool [batch, kv_len] (this shard's, inside ``shard_map``), True = may
        be attended to.
      seq_axis: inside ``jax.shard_map``, the mesh axis the sequence is sharded
        over: the computation becomes a ring (key/value shards travel with
        ``ppermute``) equal to the single-device result. Prefer ``jd.sharded``.
      layout: ring layout, ``"contiguous"`` or ``"zigzag"`` (``"striped"`` shards
        are not made of global blocks and are refused).
      implementation: kernel; None chooses by device kind.
      return_lse: also return the log-sum-exp [batch, q_len, num_heads] (float32;
        float64 for float64 inputs), ``-inf`` for rows without keys.
      axis_name: deprecated spelling of ``seq_axis`` (DeprecationWarning).
      segment_ids: int [batch, seq] document ids (packed sequences; this shard's,
        laid out like the queries, inside ``shard_map``): a query attends only to
        keys with its own id, within the active blocks. Needs ``q_len == kv_len``.
        Blocks and ring steps where no query meets a key of its document are
        skipped at run time (docs/semantics.md, "Packed sequences").
      window: ``(left, right)`` or None: additionally ``p - left <= t <= p + right``
        (global positions; ``right = 0`` with ``is_causal``). Blocks (and ring steps)
        with no pair inside the window are dropped from the lists at trace time.
      logit_soft_cap: ``c > 0`` or None: logits become ``c tanh(logits / c)``.
      sinks: float [num_heads] or None: per-head logits joining every row's softmax
        denominator (docs/semantics.md, "Sliding windows, soft-capping and sinks");
        the returned lse then includes them.

    Returns:
      [batch, q_len, num_heads, head_dim] in the input dtype. A query whose block
      has no active, allowed key outputs zeros (finite gradients).

    Over a ring a step whose visiting shard has no active block is skipped, but
    the key/value shard is still passed on: the ring is one ``ppermute`` per hop
    with a fixed permutation, every device forwarding what it holds, and the shard
    a device skips is in general needed further down the ring (it can only get
    there through this device). A transfer could be dropped only where no later
    device needs the shard; with a static mask that schedule is known at trace
    time (e.g. causal: shard ``d`` is needed by devices ``>= d`` only; a local
    window: by its neighbours only), so an unrolled ring with a partial
    permutation per hop, or one cut short after the last needed hop (with dk/dv
    sent back to their owners), could skip it. That is not implemented; with a
    traced mask nothing can be skipped statically.

    Example:
      >>> import jax, jax_dilated as jd
      >>> from jax_dilated import block_patterns as bp
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
      >>> pattern = bp.LocalWindow(1) | bp.GlobalBlocks([0])   # 4 blocks of 16 tokens
      >>> jd.block_sparse_attention(q, k, v, block_size=16, pattern=pattern,
      ...                           is_causal=True).shape
      (1, 64, 2, 8)
    """
    seq_axis = validation.renamed(axis_name, seq_axis, old="axis_name", new="seq_axis",
                                  where="block_sparse_attention")
    b, tq, h, hkv, tk = validation.check_qkv(query, key, value)
    block_size = validation.check_positive_int("block_size", block_size)
    is_causal = validation.check_flag("is_causal", is_causal)
    kv_mask = validation.check_kv_mask(kv_mask, b, tk)
    layouts.check_layout(layout)
    num_devices = (None if seq_axis is None
                   else validation.axis_size(seq_axis, "block_sparse_attention"))
    segment_ids = document_ids(validation.check_segment_ids(segment_ids, query.shape, key.shape),
                               axis_name=seq_axis, num_devices=num_devices, layout=layout)
    scale = validation.check_scale(scale, query.shape[-1])
    window = validation.check_window(window, is_causal)
    logit_soft_cap = validation.check_logit_soft_cap(logit_soft_cap)
    sinks = validation.check_sinks(sinks, h)
    if sinks is not None:  # as in ring_attention (see ring_partials)
        sinks = varying_like(sinks, (query, key))
    kernel = get_kernel(implementation)  # (cuDNN's block-sparse calls say it has none)
    args = KernelArgs(scale=scale, is_causal=is_causal, block_q=block_size,
                      block_k=block_size, window=window_arg(window),
                      logit_soft_cap=logit_soft_cap)

    if seq_axis is None:
        if layout != "contiguous":
            raise ValueError(
                f"layout={layout!r} only applies over a ring (seq_axis=...); got "
                f"seq_axis=None.")
        nq, nk = -(-tq // block_size), -(-tk // block_size)
        gq, gk = np.arange(nq, dtype=np.int32)[None], np.arange(nk, dtype=np.int32)[None]
        mask = window_mask(resolve_mask(pattern, nq, nk, h), tq, tk, block_size, window)
        classes, aux = head_classes(mask, h, hkv, gq, gk, is_causal)
        plan = _Plan(kernel, args, classes, h, gq, gk)
        o, lse, _ = _local(query, key, value, kv_mask, plan, aux, segment_ids, sinks)
    else:
        if tk != tq:
            raise ValueError(
                f"over a ring, query and key/value shards must have the same length, got "
                f"query {tuple(query.shape)} and key {tuple(key.shape)}.")
        gq = ring_blocks(tq, num_devices, layout, block_size)
        nb = gq.size
        mask = window_mask(resolve_mask(pattern, nb, nb, h), tq * num_devices,
                           tk * num_devices, block_size, window)
        classes, aux = head_classes(mask, h, hkv, gq, gq, is_causal)
        # one ring over every device of the axis, its steps the head classes'
        steps = _Plan(kernel, args, classes, h, gq, gq)
        o, lse, _ = ring_partials(
            query, key, value, kv_mask, None,
            RingConfig(seq_axis, num_devices, num_devices, layout, args, kernel, steps=steps),
            aux, segment_ids, sinks)
    o = o.astype(query.dtype)
    return (o, lse) if return_lse else o
