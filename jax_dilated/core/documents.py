"""What a document of a packed row is: a maximal run of equal ``segment_ids``.

docs/semantics.md, section 1 ("Packed sequences"), states the rule once; this module
is where the code applies it. Every public operation that takes ``segment_ids`` turns
them into *document indices* with :func:`document_ids` before anything else looks at
them: the index of each token's run, counted from 0 at the row's first token. Two
tokens then share an index exactly when they lie in one run, so every kernel's "same
id" mask, every ring step's skip test and dilated attention's per-document segment
grid agree on what a document is, also where a user reuses an id for a later
document (``[0, 0, 1, 1, 0, 0]`` is three documents).

Inside ``jax.shard_map`` the runs are those of the *global* sequence: a run that
crosses a shard boundary is one document. On contiguous shards each device sends the
others three small numbers per row (its shard's first and last id and its number of
run starts), never its ids. In another layout a shard's tokens are not consecutive
(a striped shard may even be shorter than the device count), so the int ids are
all-gathered, put in token order, numbered, and this device's are taken back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dilated.core import layouts

__all__ = ["document_ids", "document_starts"]


def _run_starts(ids):
    """[B, T] bool: whether each token starts a run (the first token always does)."""
    return jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]],
                           axis=1)


def _local_runs(ids):
    """[B, n] int32: each token's run index within the array, from 0."""
    return jnp.cumsum(_run_starts(ids), axis=1, dtype=jnp.int32) - 1


def document_ids(segment_ids, *, axis_name=None, num_devices: int | None = None,
                 layout: str = "contiguous"):
    """Each token's document index: the number of run starts before it in its row.

    Args:
      segment_ids: int32 [B, T] (or, inside ``shard_map`` with ``axis_name``, this
        device's shard [B, n], laid out as ``layout`` says), as
        :func:`~jax_dilated.core.validation.check_segment_ids` returns them.
      axis_name: the mesh axis the sequence is sharded over, or None (one device).
      num_devices: the size of that axis.
      layout: how the shards hold the tokens (:mod:`jax_dilated.core.layouts`).

    Returns:
      int32 of ``segment_ids``' shape: ``k`` for every token of the row's ``k``-th
      maximal run of equal ids (counted over the whole sequence).

    >>> import numpy as np
    >>> document_ids(np.array([[0, 0, 1, 1, 0, 0, 2]], np.int32)).tolist()
    [[0, 0, 1, 1, 2, 2, 3]]
    """
    if segment_ids is None:
        return None
    if axis_name is None or num_devices == 1:
        return _local_runs(jnp.asarray(segment_ids))
    if layout != "contiguous":
        n = segment_ids.shape[1]
        whole = jax.lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)  # [B, T]
        runs = layouts.to_layout(
            _local_runs(layouts.from_layout(whole, num_devices, layout)), num_devices, layout)
        return jax.lax.dynamic_slice_in_dim(runs, jax.lax.axis_index(axis_name) * n, n, 1)
    ids, local = segment_ids, _local_runs(segment_ids)
    # the shard boundaries: shard d's first run continues shard d - 1's last one when
    # their ids agree; shard d's index 0 is then the run index its predecessors reach
    firsts, lasts, counts = (jax.lax.all_gather(x, axis_name, axis=0)  # [P, B]
                             for x in (ids[:, 0], ids[:, -1], local[:, -1] + 1))
    new = jnp.concatenate([jnp.zeros_like(firsts[:1], jnp.int32),
                           (firsts[1:] != lasts[:-1]).astype(jnp.int32)], axis=0)
    # G[d] = G[d-1] + (counts[d-1] - 1) + new[d], G[0] = 0, summed up
    shard = jnp.arange(firsts.shape[0], dtype=jnp.int32)[:, None]
    base = jnp.cumsum(counts, axis=0) - counts - shard + jnp.cumsum(new, axis=0)
    return local + base[jax.lax.axis_index(axis_name)][:, None]


def document_starts(segment_ids):
    """[B, T] int32: the position of the first token of each token's document (a
    maximal run of equal ids), on one device."""
    t = segment_ids.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)
    return jax.lax.cummax(jnp.where(_run_starts(segment_ids), pos[None, :], 0), axis=1)
