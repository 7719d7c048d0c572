"""Batch chunking of the XLA kernel's calls, shared by the dense and block-sparse
entry points (and the ring steps' size budget)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dilated.backends.base import KernelArgs
from jax_dilated.backends.xla.layout import _blocking

# Elements of one logits block [n, H, block_q, block_k] processed at once. The
# batch (segments x batch) is cut into chunks that keep a block near this size:
# blocks that fit in cache run the matmuls 2-3x faster on CPU than one huge block
# batched over every segment, and temp memory stops growing with the batch.
_BLOCK_ELEMENTS = 1 << 21


def batch_chunk(n: int, q, k, args: KernelArgs) -> int:
    """Items of a batched call [n, L, H, D] processed at once (see ``_BLOCK_ELEMENTS``)."""
    geo = _blocking(q.shape[1], k.shape[1], args)
    per_item = q.shape[2] * geo.block_q * geo.block_k
    return max(1, min(n, _BLOCK_ELEMENTS // per_item))


def _chunked(core, batched, shared, args, dropout_rng, chunk: int):
    """Run ``core`` over the leading (batch) axis of ``batched`` in chunks of ``chunk``.

    ``batched``: arrays (or None) with a leading batch axis; ``shared``: keyword
    arrays passed whole. Each chunk gets its own dropout key (fold_in of the chunk
    index), so forward and backward draw the same masks.
    """
    n = next(x for x in batched if x is not None).shape[0]
    if chunk >= n:
        return core(*batched, args, dropout_rng=dropout_rng, **shared)
    num = -(-n // chunk)

    # Chunks of one item are mapped over the batch axis itself, not over [n, 1, ...]:
    # XLA:CPU lays that size-1 axis out differently from the loop's operands and
    # then copies every input whole before the loop (3 x 32 MiB of temporaries for
    # 8 segments of 2048 tokens x 8 heads, and 1.3x the time).
    def split(x):
        if x is None or chunk == 1:
            return x
        x = jnp.pad(x, [(0, num * chunk - n)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num, chunk, *x.shape[1:])

    def one(xs):
        i, parts = xs
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        if chunk == 1:
            parts = tuple(None if x is None else x[None] for x in parts)
        out = core(*parts, args, dropout_rng=rng, **shared)
        return jax.tree.map(lambda y: y[0], out) if chunk == 1 else out

    outs = jax.lax.map(one, (jnp.arange(num), tuple(split(x) for x in batched)))
    if chunk == 1:
        return outs
    return jax.tree.map(lambda y: y.reshape(num * chunk, *y.shape[2:])[:n], outs)


def _check_pair(q_segment_ids, k_segment_ids):
    """Segment ids come for both sides or for neither (the kernels compare the two)."""
    if (q_segment_ids is None) != (k_segment_ids is None):
        raise ValueError("q_segment_ids and k_segment_ids must be given together, got "
                         f"q_segment_ids={'None' if q_segment_ids is None else 'an array'} "
                         f"and k_segment_ids={'None' if k_segment_ids is None else 'an array'}.")
