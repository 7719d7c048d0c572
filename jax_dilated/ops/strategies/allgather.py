"""The ``"allgather"`` strategy's local program (Llama-3 style): inside ``shard_map``,
every device gathers all keys and values over the axis and attends its local queries
to them in one kernel call (block-sparse attention: over the listed blocks)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_dilated.backends import get_kernel
from jax_dilated.backends.base import KeySide, Masks, QuerySide, RowGrads
from jax_dilated.core import layouts, softmax, validation
from jax_dilated.core.documents import document_ids
from jax_dilated.ops import block_sparse as block_sparse_ops
from jax_dilated.ops import head_parallel
from jax_dilated.ops.block_sparse_plan import head_classes, resolve_mask, ring_blocks
from jax_dilated.ops.head_parallel import gather_tokens
from jax_dilated.ops.strategies.operation import Operation

__all__ = ["allgather_local"]


def _chunk_block(layout: str, n: int, given):
    """Kernel block aligned to the layout's chunks (zigzag: ``n / 2``), as the ring does."""
    if given is not None or layout != "zigzag":
        return given
    chunk = n // 2
    best = max(d for d in range(1, min(chunk, 512) + 1) if chunk % d == 0)
    return best if best >= min(64, chunk) else chunk


def allgather_local(op: Operation, q, k, v, mask, segment_ids=None, *, axis_name: str,
                    num_devices: int, layout: str):
    """Inside ``shard_map`` on ``layout`` shards: the ``"allgather"`` strategy.

    ``q`` [B, n, H, D], ``k``/``v`` [B, n, H_kv, D], ``mask`` and ``segment_ids`` None
    or [B, n]; returns [B, n, H, D] (this device's queries against every key). The ids
    are gathered with the keys: the kernel compares the local queries' ids [B, n] with
    the gathered keys' [B, T]. Exact and block-sparse attention only: dilated
    attention runs its strategies itself (``strategy=`` of
    :func:`jax_dilated.dilated_attention`).
    """
    o = op.options
    p, n = num_devices, q.shape[1]
    # the kernels compare ids: number the documents of the whole row first
    segment_ids = document_ids(segment_ids, axis_name=axis_name, num_devices=p, layout=layout)
    kall, vall, mall, idsall = (gather_tokens(x, axis_name)
                                for x in (k, v, mask, segment_ids))
    if op.kind == "block_sparse":
        return _block_sparse_allgather(o, q, kall, vall, mall, axis_name, p, layout,
                                       segment_ids, idsall)
    # positions of this device's queries and of the gathered keys (in layout order)
    q_pos = layouts.local_positions(layout, jax.lax.axis_index(axis_name), p, n)
    k_pos = jnp.asarray(layouts.global_order(n * p, p, layout), jnp.int32)
    args = head_parallel.kernel_args(o, q.shape[-1])
    args = dataclasses.replace(args, block_q=_chunk_block(layout, n, args.block_q),
                               block_k=_chunk_block(layout, n, args.block_k))
    kernel = get_kernel(o.get("implementation"))
    masks = Masks(q_positions=q_pos, k_positions=k_pos, kv_valid=mall,
                  q_segment_ids=None if segment_ids is None else segment_ids,
                  k_segment_ids=None if segment_ids is None else idsall)
    out = kernel.attention(q, kall, vall, args, masks, lse_grad=False)[0]
    return out.astype(q.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class _SparseGather:
    """Static part of a block-sparse call against gathered keys (identity-hashed)."""

    kernel: object
    plan: object
    axis_name: str
    layout: str
    num_devices: int


def _sparse_sides(spec: _SparseGather, q, k, v, valid, ids):
    p, n = spec.num_devices, q.shape[1]
    me = jax.lax.axis_index(spec.axis_name)
    q_ids, k_ids = (None, None) if ids is None else ids
    query = QuerySide(q, layouts.local_positions(spec.layout, me, p, n), me, q_ids)
    keys = KeySide((k, v), jnp.asarray(layouts.global_order(n * p, p, spec.layout),
                                       jnp.int32), valid, 0, segments=k_ids)
    return query, keys


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse_gathered(spec, q, k, v, valid, aux, ids):
    return _sparse_fwd(spec, q, k, v, valid, aux, ids)[0]


def _sparse_fwd(spec, q, k, v, valid, aux, ids):
    steps = block_sparse_ops._ClassSteps(spec.kernel, spec.plan, aux)
    query, keys = _sparse_sides(spec, q, k, v, valid, ids)
    o, lse, *lse_lo = steps.partial(query, keys)  # lse_lo where the kernel splits lse
    return o, (q, k, v, valid, aux, ids, o, lse, lse_lo)


def _sparse_bwd(spec, res, do):
    q, k, v, valid, aux, ids, o, lse, lse_lo = res
    steps = block_sparse_ops._ClassSteps(spec.kernel, spec.plan, aux)
    query, keys = _sparse_sides(spec, q, k, v, valid, ids)
    zero = jnp.zeros_like(lse)
    if lse_lo:  # the log-sum-exp's low part is folded into do and delta
        do, delta = softmax.backward_rows(do, o, lse_lo[0], zero)
    else:
        delta = softmax.backward_delta(do, o, zero)
    dq, dk, dv = steps.grads(query, keys, RowGrads(do, lse, delta))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_sparse_gathered.defvjp(_sparse_fwd, _sparse_bwd)


def _block_sparse_allgather(o, q, kall, vall, mall, axis_name, p, layout, ids=None,
                            idsall=None):
    """This device's query blocks against the gathered keys, over the listed blocks
    (with ``ids`` [B, n] / ``idsall`` [B, T]: the document ids of both)."""
    bs = validation.check_positive_int("block_size", o["block_size"])
    n, h, hkv = q.shape[1], q.shape[2], kall.shape[2]
    gq = ring_blocks(n, p, layout, bs)           # [P, n / bs] global query blocks
    gk = gq.reshape(1, -1)                       # the gathered keys, in layout order
    nb = gq.size
    mask = resolve_mask(o["pattern"], nb, nb, h)
    args = dataclasses.replace(head_parallel.kernel_args(o, q.shape[-1]), block_q=bs,
                               block_k=bs)
    kernel = get_kernel(o.get("implementation"))
    classes, aux = head_classes(mask, h, hkv, gq, gk, args.is_causal)
    plan = block_sparse_ops._Plan(kernel, args, classes, h, gq, gk)
    spec = _SparseGather(kernel, plan, axis_name, layout, p)
    out = _sparse_gathered(spec, q, kall, vall, mall, aux,
                           None if ids is None else (ids, idsall))
    return out.astype(q.dtype)
