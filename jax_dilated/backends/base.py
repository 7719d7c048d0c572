"""The kernel interface every backend implements.

A kernel computes attention of a block of queries against a block of keys and
values and returns the output together with the log-sum-exp, so that partial
results over different key sets can be merged exactly (:mod:`jax_dilated.core.softmax`):

    forward(q, k, v, args, *, q_positions, k_positions, kv_valid, dropout_rng)
        -> o [N, Lq, H, D] (input dtype), lse [N, Lq, H] (float32; float64 for float64)
    backward(q, k, v, do, lse, delta, args, *, ...same keywords)
        -> dq, dk, dv            (lse, delta may be global statistics)
    attention(q, k, v, args, *, ...same keywords)
        -> (o, lse), differentiable in q, k, v through both outputs

with ``q`` [N, Lq, H, D], ``k``/``v`` [N, Lk, H_kv, D], ``H % H_kv == 0``;
``q_positions`` [Lq] / ``k_positions`` [Lk] int positions used by the causal
rule ``k_pos <= q_pos`` (default ``arange``); ``kv_valid`` [N, Lk] or
[N, Lk, H_kv] bool (per kv head when heads see different keys).

Block-sparse kernels visit only listed blocks (``args.block_q`` x ``args.block_k``
exactly; ``Lq``/``Lk`` are padded up to whole blocks, padded keys never attended):

    block_sparse_forward(q, k, v, args, *, blocks, q_positions, k_positions, kv_valid)
        -> o, lse                          as forward, over the listed blocks only
    block_sparse_backward(q, k, v, do, lse, delta, args, *, blocks, ...same keywords)
        -> dq, dk, dv

with ``blocks`` a :class:`BlockLists`. Within a listed block the causal rule and
``kv_valid`` still apply; all listed blocks of a query block share one softmax.

Optional, for rings (:mod:`jax_dilated.ops.ring` falls back to ``forward``/``backward``
when a backend lacks it or it returns None). It lets a ring keep keys and values in
the kernel's own layout for the whole ring and accumulate in place, instead of
converting every visiting block and allocating fresh outputs at every step:

    ring_steps(q, k, args) -> steps, or None (not for these shapes)
    steps.pack_kv(k, v) -> kv
        keys and values [N, Lk, H_kv, D] in the kernel's layout: a pytree of arrays
        that travels around the ring (``ppermute``) as is
    steps.forward(q, kv, o, lse, *, q_positions, k_positions, kv_valid, dropout_rng)
        -> (o, lse)
        folds the block ``kv`` into the running normalised partial ``o`` [N, Lq, H, D],
        ``lse`` [N, Lq, H] (stats dtype; start from o = 0, lse = -inf): the result is
        the partial over the keys of both, as :func:`~jax_dilated.core.softmax.merge_partials`
        would give it
    steps.backward(q, kv, do, lse, delta, dq, dkv, *, ...same keywords) -> (dq, dkv)
        adds the block's gradients to the accumulators ``dq`` [N, Lq, H, D] (stats
        dtype) and ``dkv`` (stats dtype, shaped like ``kv``; start from zeros);
        ``lse``/``delta`` as for ``backward``
    steps.unpack_kv(dkv) -> (dk, dv)     [N, Lk, H_kv, D], stats dtype

``steps.forward`` and ``steps.backward`` must draw the same dropout masks from the
same ``dropout_rng``; a ring uses one of the two interfaces for both passes.

Optional, for block-sparse rings (the kernel must have the block-sparse kernels):

    block_sparse_ring_steps(q, k, args) -> steps, or None
        ring steps as above whose ``forward``/``backward`` also take ``blocks=``, a
        :class:`BlockLists` in blocks of exactly ``args.block_q`` x ``args.block_k``:
        only the listed key blocks of each query block are folded in (``rows`` and
        ``rows_ok`` are read; ``cols`` may be None)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

__all__ = ["KernelArgs", "BlockLists", "any_pair_allowed"]


@dataclasses.dataclass(frozen=True)
class KernelArgs:
    """Static (hashable) arguments of one kernel call.

    scale: multiplier of ``q.k``.
    is_causal: key ``t`` is allowed for query ``p`` only if ``pos(t) <= pos(p)``.
    dropout_rate: attention-probability dropout rate in ``[0, 1)``.
    block_q, block_k: target block sizes (None: the backend's default).
    """

    scale: float
    is_causal: bool = False
    dropout_rate: float = 0.0
    block_q: int | None = None
    block_k: int | None = None


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


def any_pair_allowed(is_causal: bool, q_pos, k_pos, kv_valid):
    """Whether any (query, key) pair of a block is allowed; None when statically always.

    Used to skip whole blocks (kernel) and whole ring steps: causal blocks whose
    earliest key is after the latest query, and blocks with no valid key.
    """
    need = None
    if is_causal:
        need = jnp.min(k_pos) <= jnp.max(q_pos)
    if kv_valid is not None:
        any_valid = jnp.any(kv_valid)
        need = any_valid if need is None else need & any_valid
    return need
