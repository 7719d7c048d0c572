"""Ring attention: exact attention with the sequence sharded over a mesh axis.

Inside ``jax.shard_map`` every device holds ``n = T / P`` queries, keys and values
(in one of the layouts of :mod:`jax_dilated.core.layouts`). Key/value blocks (compact kv
heads, with their padding mask and document ids) travel around the ring with
``jax.lax.ppermute``; at every step the local queries attend to the visiting block,
and the step's result is folded into accumulators carried through the ring. The next
block is sent before the current one is computed on, so transfer and compute can
overlap.

What a step computes is a :class:`~jax_dilated.backends.base.RingSteps`: the
kernel's fused ring steps where it has them (keys and values travel in the
kernel's own layout, converted once per ring, and every step folds into
accumulators updated in place, so a device holds a handful of shard-sized buffers
instead of fresh copies and outputs at every step), else the generic adapter over
the kernel's plain forward/backward (:mod:`jax_dilated.ops.ring_steps`), or the
block-sparse steps of :mod:`jax_dilated.ops.block_sparse`. There is one ring loop
per pass for all of them.

The backward is a ring too (``jax.custom_vjp``): with the global output and
log-sum-exp saved, key/value blocks and their gradient accumulators travel; after
``P`` hops the accumulators are back with their owners. Nothing of global length is
ever materialised: memory per device is O(T / P).

Steps whose visiting block is entirely masked (causal, padding, no document shared
with the local queries, or outside every local query's sliding window) are skipped with ``lax.cond`` (:meth:`RingSteps.visit`);
inside a step the kernel skips masked blocks, and its blocks are aligned to the zigzag
chunks so that every device does the same work at every step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_dilated.backends import KernelArgs, get_kernel
from jax_dilated.backends.base import (Kernel, KeySide, Masks, QuerySide, RingSteps,
                                       RowGrads, window_arg)
from jax_dilated.core import layouts, softmax, validation
from jax_dilated.core.documents import document_ids
from jax_dilated.core.skip import maybe_skip
from jax_dilated.core.types import Array, ArrayLike, Implementation, Layout
from jax_dilated.core.vma import varying_like
from jax_dilated.ops.ring_steps import kernel_steps

__all__ = ["ring_attention"]


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static configuration of one ring.

    The ``axis_size`` devices of ``axis_name`` form ``axis_size / ring_size``
    independent rings of ``ring_size`` consecutive devices (one ring of all of them
    for ring attention; the devices sharing a segment for distributed dilated
    attention). ``layout`` is the layout of the sequence inside a ring.

    ``steps`` (None: the kernel's dense ring steps, see
    :func:`jax_dilated.ops.ring_steps.kernel_steps`) makes what one ring step
    computes, ``steps(kernel, q, k, aux) -> RingSteps``, with ``aux`` the extra
    operand of :func:`ring_partials` (block-sparse attention uses it). It is called
    once in the forward and once in the backward and must return steps of the same
    kind both times (the backward reads what the forward's ``keep_packed`` kept).
    """

    axis_name: str
    axis_size: int
    ring_size: int
    layout: str
    args: KernelArgs
    kernel: Kernel  # the call's, chosen once by its entry point (get_kernel)
    steps: Callable[..., RingSteps] | None = None
    # False: the caller does not differentiate through the log-sum-exp (ring_partials
    # then stops its gradient) and the backward hands every step the output
    lse_grad: bool = True

    def perm(self):
        """ppermute pairs: every device sends to the next device of its ring."""
        g = self.ring_size
        return [(j, j - j % g + (j % g + 1) % g) for j in range(self.axis_size)]

    def ring_index(self):
        """This device's index inside its ring (traced)."""
        me = jax.lax.axis_index(self.axis_name)
        return me if self.ring_size == self.axis_size else me % self.ring_size

    def step_rng(self, rng, src):
        """Dropout key of (this device, visiting block ``src``); None without dropout."""
        if rng is None:
            return None
        me = jax.lax.axis_index(self.axis_name)
        return jax.random.fold_in(jax.random.fold_in(rng, me), src)


def _aligned_block(chunk: int, target: int = 512) -> int:
    """Largest divisor of ``chunk`` not above ``target`` (whole chunk if that is tiny)."""
    best = max(d for d in range(1, min(chunk, target) + 1) if chunk % d == 0)
    return best if best >= min(64, chunk) else chunk


def _setup(cfg: RingConfig, q, k, aux, segment_ids=None):
    """The ring's steps, this device's :class:`QuerySide` and the keys of a step.

    A travelling block is ``(kv, valid, segments)``: the packed keys/values with
    their padding mask and document ids (each None where not given)."""
    kernel = cfg.kernel
    steps = (kernel_steps(kernel, q, k, cfg.args) if cfg.steps is None
             else cfg.steps(kernel, q, k, aux))
    p, n = cfg.ring_size, q.shape[1]
    me = cfg.ring_index()
    query = QuerySide(q, layouts.local_positions(cfg.layout, me, p, n), me, segment_ids)

    def keys(block, src, rng):
        kv, valid, segments = block
        return KeySide(kv, layouts.local_positions(cfg.layout, src, p, n), valid, src,
                       cfg.step_rng(rng, src), segments=segments)

    return steps, query, keys


def _forward(q, k, v, kv_valid, rng, cfg: RingConfig, aux=None, keep_kv: bool = False,
             segment_ids=None, sinks=None):
    """Global (o, lse, lse_lo) of the local queries: o [B, n, H, D] (stats dtype), lse
    and lse_lo [B, n, H]; with ``sinks`` [H] including them (the accumulators start
    from the sinks' partial, so they cost no pass of their own).

    With ``keep_kv`` returns ``(o, lse, lse_lo, packed)``: ``packed`` this device's keys and
    values as the steps packed them (None where ``steps.keep_packed`` is False), for
    :func:`_backward`.

    Every step sends the visiting block on before folding it in (so that transfer
    overlaps compute), the last step too: after P hops every device's own block is
    home, and with ``keep_kv`` it is returned (packed) for the backward. Packing k
    and v again in the backward would not do for the kernel's fused steps: XLA
    merges the two identical conversions and keeps the forward's copy alive through
    the whole forward. Without ``keep_kv`` the last hop is not needed, but one loop
    over all P steps is what XLA:CPU schedules best: with the first and last step
    outside the loop it held six shard-sized key/value buffers instead of four
    (forward only, P=8, n=32768, 8 heads: 50.5 vs 34.5 MiB), and at P=2, where no
    loop was left, it issued every transfer at the start (forward+backward 259 vs
    133 MiB). Steps that keep nothing packed (``keep_packed`` False: the generic
    adapter) stop after P - 1 hops and fold the last block after the loop: for them
    the extra hop cost memory at P = 2 (XLA kernel without its ring steps, n=32768,
    8 heads: forward only 289 vs 225 MiB, forward+backward 289 vs 284 MiB) and
    nothing at P = 4, 8.
    """
    steps, query, keys = _setup(cfg, q, k, aux, segment_ids)
    p, me = cfg.ring_size, query.index

    def step(carry, s, send=True):
        """Fold the visiting block (from device ``me - s``) into the partial, the
        block sent on first (then compute) unless ``send`` is False."""
        acc, block = carry
        nxt = jax.lax.ppermute(block, cfg.axis_name, cfg.perm()) if send else block
        step_keys, needed = steps.visit(query, keys(block, (me - s) % p, rng))
        acc = maybe_skip(needed, functools.partial(steps.forward, query, step_keys), acc)
        return (acc, nxt), None

    acc = varying_like(softmax.empty_partial(q.shape, softmax.stats_dtype(q.dtype), sinks),
                       (q, k))
    carry = (acc, (steps.pack_kv(k, v), kv_valid, segment_ids))
    hops = 0 if p == 1 else p if steps.keep_packed else p - 1
    if hops:
        carry, _ = jax.lax.scan(step, carry, jnp.arange(hops))
    if hops < p:  # the last block, not sent on
        carry, _ = step(carry, hops, send=False)
    acc, block = carry
    if not keep_kv:
        return acc
    return (*acc, block[0] if steps.keep_packed else None)


def _backward(q, k, v, kv_valid, rng, rows: RowGrads, cfg: RingConfig, aux=None,
              packed_kv=None, segment_ids=None):
    """(dq, dk, dv) of the local shards from the global rows' ``RowGrads``
    (:func:`~jax_dilated.core.softmax.backward_rows`): dq and the packed dk/dv are
    accumulated in place; the blocks and their accumulators travel separately (so
    that only one of them is in flight at a time)."""
    steps, query, keys = _setup(cfg, q, k, aux, segment_ids)
    p, me = cfg.ring_size, query.index
    stats = softmax.stats_dtype(q.dtype)

    def grads(acc, block, src):
        step_keys, needed = steps.visit(query, keys(block, src, rng))
        return maybe_skip(needed, lambda acc: steps.backward(query, step_keys, rows, acc), acc)

    # the forward's packed block (see _forward), or packed again where that is free
    block = (steps.pack_kv(k, v) if packed_kv is None else packed_kv, kv_valid, segment_ids)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, stats), (q, block[0]))
    dq, dkv = grads(varying_like(zeros, (q, k, rows.do)), block, me)
    if p > 1:
        def step(carry, s):
            dq, block, dkv = carry
            block = jax.lax.ppermute(block, cfg.axis_name, cfg.perm())
            dkv = jax.lax.ppermute(dkv, cfg.axis_name, cfg.perm())
            dq, dkv = grads((dq, dkv), block, (me - s) % p)
            return (dq, block, dkv), None

        (dq, _, dkv), _ = jax.lax.scan(step, (dq, block, dkv), jnp.arange(1, p))
        # after P - 1 hops each accumulator sits one device short of its owner
        dkv = jax.lax.ppermute(dkv, cfg.axis_name, cfg.perm())
    dk, dv = steps.unpack_kv(dkv)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _ring_fwd(q, k, v, kv_valid, rng, cfg, aux=None, keep_kv=False, segment_ids=None,
              sinks=None):
    o, lse, lse_lo, packed_kv = _forward(q, k, v, kv_valid, rng, cfg, aux, keep_kv=True,
                                         segment_ids=segment_ids, sinks=sinks)
    return (o, lse, lse_lo), (q, k, v, kv_valid, rng, o, lse, lse_lo, aux, packed_kv,
                              segment_ids, sinks)


def _ring_bwd(cfg, keep_kv, res, cotangents):
    q, k, v, kv_valid, rng, o, lse, lse_lo, aux, packed_kv, segment_ids, sinks = res
    do, dlse, _ = cotangents  # lse_lo is a constant correction (core/softmax.py)
    # Without an lse cotangent (cfg.lse_grad False: ring_partials stopped its gradient,
    # so dlse is 0) delta = rowsum(do o): every step's kernel call also gets o
    # (RowGrads.out), so cuDNN runs its own backward instead of its widened one.
    out = None if cfg.lse_grad else o.astype(q.dtype)
    # with sinks, o and lse include them: the kernels' gradients are exact from the
    # sink-including statistics, and the sinks' own comes from the same rows
    do, delta = softmax.backward_rows(do, o, lse_lo, dlse)
    dq, dk, dv = _backward(q, k, v, kv_valid, rng, RowGrads(do, lse, delta, out), cfg, aux,
                           packed_kv, segment_ids)
    return dq, dk, dv, None, None, None, None, softmax.sink_gradient(lse, delta, sinks)


def ring_partials(q, k, v, kv_valid, rng, cfg: RingConfig, aux=None, segment_ids=None,
                  sinks=None):
    """Global ``(o, lse, lse_lo)`` of the local queries (stats dtype; the log-sum-exp
    in two parts, :mod:`jax_dilated.core.softmax`), differentiable.

    The ring core shared by :func:`ring_attention`, distributed dilated attention
    and block-sparse attention; ``rng`` is the dropout key (None without dropout),
    ``aux`` an extra (non-differentiable) operand handed to ``cfg.steps``,
    ``segment_ids`` int [B, n] the local shard's document ids (laid out like the
    queries; they serve the queries here and travel with their keys), or None;
    ``sinks`` [H] (replicated) or None: included in the result, differentiable.
    With ``cfg.lse_grad`` False the log-sum-exp comes with its gradient stopped.
    """
    if sinks is not None:
        # varying like the rows whose sum is their cotangent inside the custom_vjp;
        # the cast's transpose then sums that over the devices
        sinks = varying_like(sinks, (q, k))
    o, lse, lse_lo = _ring(q, k, v, kv_valid, rng, cfg, aux, False, segment_ids, sinks)
    if not cfg.lse_grad:  # what makes the backward's use of o exact (_ring_bwd)
        lse = jax.lax.stop_gradient(lse)
    return o, lse, lse_lo


# The ring's forward is the primal itself (keep_kv False; the forward rule keeps the
# packed block for the backward), so a step calls the kernel's steps few frames below
# the entry point
_ring = jax.custom_vjp(_forward, nondiff_argnums=(5, 7))
_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                   seq_axis: str | None = None, is_causal: bool = False,
                   scale: float | None = None, layout: Layout = "contiguous",
                   kv_mask: ArrayLike | None = None,
                   implementation: Implementation | None = None, return_lse: bool = False,
                   block_q: int | None = None, block_k: int | None = None,
                   axis_name: str | None = None, segment_ids: ArrayLike | None = None,
                   window: tuple[int, int] | None = None,
                   logit_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                   ) -> Array | tuple[Array, Array]:
    """Exact attention over a sequence sharded on ``seq_axis`` (inside ``shard_map``).

    Args:
      query: [batch, n, num_heads, head_dim], this device's shard of the sequence.
      key, value: [batch, n, num_kv_heads, head_dim], the matching shards
        (``num_heads % num_kv_heads == 0``; the compact kv heads travel).
      seq_axis: the mesh axis the sequence is sharded over (``P`` devices); required.
      is_causal: global causal mask (by global position, whatever the layout).
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``: which global tokens
        this shard holds (see :mod:`jax_dilated.core.layouts`; ``jd.sharded`` permutes
        for you).
      kv_mask: bool [batch, n], this shard's key padding mask (True = may be attended
        to); it travels with its keys.
      implementation: kernel; None chooses by device kind.
      return_lse: also return the global log-sum-exp [batch, n, num_heads] (float32;
        float64 for float64 inputs); with ``sinks`` it includes the sink,
        ``log(e^{s_h} + sum_t e^{l_t})``.
      block_q, block_k: kernel block sizes (None: the kernel's defaults; with
        ``layout="zigzag"`` the largest divisor of the chunk length ``n / 2`` up to
        512). With ``"zigzag"`` each must divide ``n / 2``, so that no block
        straddles the two chunks of a shard.
      axis_name: deprecated spelling of ``seq_axis`` (DeprecationWarning).
      segment_ids: int [batch, n], this shard's document ids (packed sequences), laid
        out like the queries: a query attends only to keys with its own id. They
        travel with their keys; a ring step whose visiting shard shares no id with
        the local queries is skipped (docs/semantics.md, "Packed sequences").
      window: ``(left, right)`` non-negative ints or None: query at global position
        ``p`` attends key ``t`` only if ``p - left <= t <= p + right`` (``right = 0``
        with ``is_causal``). Ring steps whose visiting shard lies outside every local
        query's window are skipped (``lax.cond`` on the step), so the compute per
        device is O(window), whatever the layout; the key/value shards still travel
        the whole ring.
      logit_soft_cap: ``c > 0`` or None: logits become ``c tanh(logits / c)`` (after
        scaling, before the softmax).
      sinks: float [num_heads] or None: a per-head logit joining every row's softmax
        denominator as a key with no value (replicated: the same on every device).
        See docs/semantics.md, "Sliding windows, soft-capping and sinks".

    Returns:
      [batch, n, num_heads, head_dim] in the input dtype: softmax attention of the
      local queries over all keys of the global sequence. Rows with no key to
      attend to are zero.

    The math: every device keeps its queries; the ``P`` key/value shards visit it in
    turn (``jax.lax.ppermute``), and the partial results ``(O_s, LSE_s)`` of the
    steps are merged by the online softmax, ``O = sum_s exp(LSE_s - LSE) O_s`` with
    ``LSE = log sum_s exp(LSE_s)``: exactly ``softmax(scale q k^T) v`` over the
    global sequence.

    Example (on global arrays :func:`jax_dilated.sharded` does the ``shard_map``):
      >>> import jax, jax_dilated as jd
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("seq",))
      >>> ring = jax.shard_map(
      ...     lambda q, k, v: jd.ring_attention(q, k, v, seq_axis="seq", is_causal=True),
      ...     mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
      >>> x = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
      >>> ring(x, x, x).shape
      (1, 64, 2, 8)
    """
    seq_axis = validation.renamed(axis_name, seq_axis, old="axis_name", new="seq_axis",
                                  where="ring_attention")
    if seq_axis is None:
        raise TypeError("ring_attention needs seq_axis=: the mesh axis the sequence is "
                        "sharded over (call it inside jax.shard_map, or use jd.sharded).")
    b, n, h, hkv, nk = validation.check_qkv(query, key, value)
    if nk != n:
        raise ValueError(
            f"ring attention needs query and key/value shards of the same length, got "
            f"query {tuple(query.shape)} and key {tuple(key.shape)}."
        )
    num_devices = validation.axis_size(seq_axis, "ring_attention")
    layouts.check_layout(layout)
    if layout == "zigzag" and n % 2:
        raise ValueError(
            f'layout="zigzag" needs an even shard length (two chunks per device), got '
            f"{n} (query {tuple(query.shape)}): the global length must be divisible by "
            f"2 x {num_devices}."
        )
    is_causal = validation.check_flag("is_causal", is_causal)
    kv_mask = validation.check_kv_mask(kv_mask, b, n)
    segment_ids = document_ids(validation.check_segment_ids(segment_ids, query.shape, key.shape),
                               axis_name=seq_axis, num_devices=num_devices, layout=layout)
    window = validation.check_window(window, is_causal)
    logit_soft_cap = validation.check_logit_soft_cap(logit_soft_cap)
    sinks = validation.check_sinks(sinks, h)
    if sinks is not None:  # for the one-device kernel call too (see ring_partials)
        sinks = varying_like(sinks, (query, key))
    block_q, block_k = validation.check_block_sizes(block_q, block_k)
    if layout == "zigzag":
        for name, size in (("block_q", block_q), ("block_k", block_k)):
            if size is not None and (n // 2) % size:
                raise ValueError(
                    f'{name}={size} must divide the zigzag chunk length {n // 2} (half the '
                    f'shard length {n}) with layout="zigzag".')
        block = _aligned_block(n // 2)
        block_q, block_k = block_q or block, block_k or block
    args = KernelArgs(scale=validation.check_scale(scale, query.shape[-1]),
                      is_causal=is_causal, block_q=block_q, block_k=block_k,
                      window=window_arg(window), logit_soft_cap=logit_soft_cap)
    kernel = get_kernel(implementation)  # the name checked now, at trace time
    if num_devices == 1:
        # One device holds every key, in token order in every layout: the kernel's own
        # call, whose default positions let it plan causal and window blocks at trace
        # time (a ring passes traced positions) and which needs no ring loop.
        o, lse, _ = kernel.attention(
            query, key, value, args,
            Masks(kv_valid=kv_mask, q_segment_ids=segment_ids, k_segment_ids=segment_ids),
            sinks=sinks, lse_grad=return_lse)
    else:
        cfg = RingConfig(seq_axis, num_devices, num_devices, layout, args, kernel,
                         lse_grad=return_lse)
        o, lse, _ = ring_partials(query, key, value, kv_mask, None, cfg, None, segment_ids,
                                  sinks)
    o = o.astype(query.dtype)
    return (o, lse) if return_lse else o
