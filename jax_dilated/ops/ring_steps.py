"""Ring steps (:class:`~jax_dilated.backends.base.RingSteps`) for any kernel.

A backend's fused ring steps (:meth:`~jax_dilated.backends.base.Kernel.ring_steps`)
keep keys and values in the kernel's layout and fold every step into accumulators
in place. Where a backend has none (cuDNN), or declines the shapes (the XLA kernel
when the lengths are not whole blocks or the batch is cut into chunks), the ring
runs the generic adapter :class:`KernelSteps` instead: keys and values travel as
they are, every step calls the kernel's plain ``forward``/``backward`` and folds
the result in (``merge_partials`` for the output, a sum for the gradients).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_dilated.backends.base import (
    KernelArgs,
    KeySide,
    Masks,
    QuerySide,
    RingSteps,
    RowGrads,
    any_pair_allowed,
)
from jax_dilated.core import softmax
from jax_dilated.core.skip import maybe_skip
from jax_dilated.core.vma import varying_like

__all__ = ["KernelSteps", "PartialSteps", "empty_unless", "kernel_steps", "zeros_unless"]


def empty_unless(pred, compute, query: QuerySide, keys: KeySide):
    """A step's partial ``compute() -> (o, lse, lse_lo)`` (stats dtype) where ``pred`` holds
    (see :func:`~jax_dilated.core.skip.maybe_skip`), else the empty partial."""
    stats = softmax.stats_dtype(query.q.dtype)

    def empty(_):
        return varying_like(softmax.empty_partial(query.q.shape, stats), (query.q, keys.kv))

    return maybe_skip(pred, lambda _: compute(), None, empty)


def zeros_unless(pred, compute, query: QuerySide, keys: KeySide, rows: RowGrads):
    """A step's gradients ``compute() -> (dq, dk, dv)`` (stats dtype) where ``pred``
    holds, else zeros shaped like ``query.q`` and ``keys.kv = (k, v)``."""
    stats = softmax.stats_dtype(query.q.dtype)

    def zeros(_):
        shapes = (query.q.shape, *(x.shape for x in keys.kv))
        return varying_like(tuple(jnp.zeros(z, stats) for z in shapes),
                            (query.q, keys.kv, rows.do))

    return maybe_skip(pred, lambda _: compute(), None, zeros)


class PartialSteps:
    """:class:`RingSteps` built from what one step computes on its own.

    Subclasses give ``partial(query, keys) -> (o, lse, lse_lo)`` (the step's
    normalised partial: o [N, Lq, H, D], lse and lse_lo [N, Lq, H], stats dtype) and ``grads(query, keys,
    rows) -> (dq, dk, dv)`` (stats dtype), each skipping itself
    (:func:`empty_unless`, :func:`zeros_unless`); ``forward`` merges the partial
    into the running one, ``backward`` adds the gradients to the accumulators.

    The conditional wraps the step's own result, not the fold (``needed`` is None):
    the merge and the sums then run outside it and update the accumulators in place.
    With the fold inside, XLA kept the accumulators, their update and the kernel's
    fresh outputs alive together: two shard-sized buffers more (XLA kernel without
    its ring steps, P=2, n=32768, 8 heads, forward+backward: 348 vs 284 MiB).

    Keys and values travel unpacked (``kv = (k, v)``), so the backward packs them
    again for free rather than keeping the forward's copy (``keep_packed``).
    """

    keep_packed = False

    def pack_kv(self, k, v):
        return (k, v)

    def unpack_kv(self, dkv):
        return tuple(dkv)

    def visit(self, query: QuerySide, keys: KeySide):
        return keys, None  # partial/grads skip themselves

    def forward(self, query: QuerySide, keys: KeySide, acc):
        return softmax.merge_partials(*acc, *self.partial(query, keys))

    def backward(self, query: QuerySide, keys: KeySide, rows: RowGrads, acc):
        dq, (dk, dv) = acc
        dq_s, dk_s, dv_s = self.grads(query, keys, rows)
        return dq + dq_s, (dk + dk_s, dv + dv_s)


class KernelSteps(PartialSteps):
    """The generic adapter: ring steps over a kernel's plain ``forward``/``backward``
    (or ``block_sparse_forward``/``block_sparse_backward`` where ``keys.blocks`` is
    given). A step is computed where any of its (query, key) pairs is allowed;
    :meth:`compute_partial`/:meth:`compute_grads` are the unconditional calls."""

    def __init__(self, kernel, args: KernelArgs):
        self.kernel, self.args = kernel, args

    def _run(self, dense, sparse, query: QuerySide, keys: KeySide, *arrays, **dense_only):
        masks = Masks(q_positions=query.positions, k_positions=keys.positions,
                      kv_valid=keys.valid, q_segment_ids=query.segments,
                      k_segment_ids=keys.segments)
        if keys.blocks is None:
            return dense(*arrays, self.args, masks._replace(dropout_rng=keys.dropout_rng),
                         **dense_only)
        return sparse(*arrays, self.args, masks, blocks=keys.blocks)

    def _allowed(self, query: QuerySide, keys: KeySide):
        return any_pair_allowed(self.args.is_causal, query.positions, keys.positions,
                                keys.valid, query.segments, keys.segments,
                                window=self.args.window)

    def compute_partial(self, query: QuerySide, keys: KeySide):
        stats = softmax.stats_dtype(query.q.dtype)
        k, v = keys.kv
        o, *lse = self._run(self.kernel.forward, self.kernel.block_sparse_forward, query,
                            keys, query.q, k, v)
        return (o.astype(stats), *(x.astype(stats) for x in lse))

    def compute_grads(self, query: QuerySide, keys: KeySide, rows: RowGrads):
        stats = softmax.stats_dtype(query.q.dtype)
        k, v = keys.kv
        # the global output where there is one (RowGrads.out): cuDNN's own backward
        extra = {} if rows.out is None else {"out": rows.out}
        grads = self._run(self.kernel.backward, self.kernel.block_sparse_backward, query,
                          keys, query.q, k, v, rows.do, rows.lse, rows.delta, **extra)
        return tuple(g.astype(stats) for g in grads)

    def partial(self, query: QuerySide, keys: KeySide):
        return empty_unless(self._allowed(query, keys),
                            lambda: self.compute_partial(query, keys), query, keys)

    def grads(self, query: QuerySide, keys: KeySide, rows: RowGrads):
        return zeros_unless(self._allowed(query, keys),
                            lambda: self.compute_grads(query, keys, rows), query, keys, rows)


def kernel_steps(kernel, q, k, args: KernelArgs) -> RingSteps:
    """The ring steps of ``kernel`` for queries like ``q`` and keys like ``k``: its
    fused ones (``ring_steps``) where it has them for these shapes, else the generic
    :class:`KernelSteps`."""
    steps = kernel.ring_steps(q, k, args)
    return KernelSteps(kernel, args) if steps is None else steps
