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

from jax_dilated.backends.base import (
    KernelArgs,
    KeySide,
    QuerySide,
    RingSteps,
    RowGrads,
    any_pair_allowed,
)
from jax_dilated.core import softmax

__all__ = ["KernelSteps", "PartialSteps", "kernel_steps"]


class PartialSteps:
    """:class:`RingSteps` built from what one step computes on its own.

    Subclasses give ``partial(query, keys) -> (o, lse)`` (the step's normalised
    partial: o [N, Lq, H, D], lse [N, Lq, H], stats dtype) and ``grads(query, keys,
    rows) -> (dq, dk, dv)`` (stats dtype); ``forward`` merges the partial into the
    running one, ``backward`` adds the gradients to the accumulators. Keys and
    values travel unpacked (``kv = (k, v)``), so the backward packs them again for
    free rather than keeping the forward's copy.
    """

    keep_packed = False

    def pack_kv(self, k, v):
        return (k, v)

    def unpack_kv(self, dkv):
        return tuple(dkv)

    def forward(self, query: QuerySide, keys: KeySide, acc):
        return softmax.merge_partials(*acc, *self.partial(query, keys))

    def backward(self, query: QuerySide, keys: KeySide, rows: RowGrads, acc):
        dq, (dk, dv) = acc
        dq_s, dk_s, dv_s = self.grads(query, keys, rows)
        return dq + dq_s, (dk + dk_s, dv + dv_s)


class KernelSteps(PartialSteps):
    """The generic adapter: ring steps over a kernel's plain ``forward``/``backward``
    (or ``block_sparse_forward``/``block_sparse_backward`` where ``keys.blocks`` is
    given). A step is needed where any of its (query, key) pairs is allowed."""

    def __init__(self, kernel, args: KernelArgs):
        self.kernel, self.args = kernel, args

    def needed(self, query: QuerySide, keys: KeySide):
        return any_pair_allowed(self.args.is_causal, query.positions, keys.positions,
                                keys.valid)

    def _run(self, dense, sparse, query: QuerySide, keys: KeySide, *arrays):
        where = {"q_positions": query.positions, "k_positions": keys.positions,
                 "kv_valid": keys.valid}
        if keys.blocks is None:
            return dense(*arrays, self.args, dropout_rng=keys.dropout_rng, **where)
        return sparse(*arrays, self.args, blocks=keys.blocks, **where)

    def partial(self, query: QuerySide, keys: KeySide):
        stats = softmax.stats_dtype(query.q.dtype)
        k, v = keys.kv
        o, lse = self._run(self.kernel.forward, self.kernel.block_sparse_forward, query,
                           keys, query.q, k, v)
        return o.astype(stats), lse.astype(stats)

    def grads(self, query: QuerySide, keys: KeySide, rows: RowGrads):
        stats = softmax.stats_dtype(query.q.dtype)
        k, v = keys.kv
        grads = self._run(self.kernel.backward, self.kernel.block_sparse_backward, query,
                          keys, query.q, k, v, *rows)
        return tuple(g.astype(stats) for g in grads)


def kernel_steps(kernel, q, k, args: KernelArgs, *, sparse: bool = False) -> RingSteps:
    """The ring steps of ``kernel`` for queries like ``q`` and keys like ``k``: its
    fused ones (``ring_steps``, or ``block_sparse_ring_steps`` with ``sparse``) where
    it has them for these shapes, else the generic :class:`KernelSteps`."""
    make = getattr(kernel, "block_sparse_ring_steps" if sparse else "ring_steps", None)
    steps = None if make is None else make(q, k, args)
    return KernelSteps(kernel, args) if steps is None else steps
