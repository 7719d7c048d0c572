"""The ``"heads"`` strategy's local program (DeepSpeed-Ulysses): inside ``shard_map``,
an all-to-all to whole sequences of a slice of the heads, the single-device operation,
and an all-to-all back (:mod:`jax_dilated.ops.head_parallel` has the transforms)."""

from __future__ import annotations

import jax
import numpy as np

from jax_dilated.backends import get_kernel
from jax_dilated.backends.base import Masks
from jax_dilated.core import validation
from jax_dilated.core.documents import document_ids
from jax_dilated.ops import dilated as dilated_ops
from jax_dilated.ops import head_parallel
from jax_dilated.ops.block_sparse_plan import resolve_mask
from jax_dilated.ops.head_parallel import heads_to_seq
from jax_dilated.ops.strategies.operation import Operation

__all__ = ["heads_local"]


def heads_local(op: Operation, q, k, v, mask, segment_ids=None, *, axis_name: str,
                num_devices: int):
    """Inside ``shard_map`` on contiguous shards: the ``"heads"`` strategy.

    ``q`` [B, n, H, D], ``k``/``v`` [B, n, H_kv, D], ``mask`` and ``segment_ids`` None or
    [B, n]; returns [B, n, H, D]. ``H`` must divide by ``P`` (checked by
    :func:`~jax_dilated.ops.strategies.operation.require`). The ids are gathered whole,
    like the mask, and the single-device operation gets them (exact attention: the
    kernel's document mask). Dilated attention runs its strategies itself
    (``strategy=`` of :func:`jax_dilated.dilated_attention`), so it does not come here.
    """
    p, num_heads = num_devices, q.shape[2]
    q, k, v, mask, ids = head_parallel.to_heads(q, k, v, mask, segment_ids, axis_name, p)
    kw = {key: val for key, val in op.options.items()
          if key not in ("seq_axis", "axis_name", "layout", "kv_mask", "segment_ids")}
    extra = {} if ids is None else {"segment_ids": ids}
    if op.kind == "exact" and ids is not None:
        # packed rows: the kernel's document mask over the whole row's documents (the
        # ids are gathered in token order, so their runs are numbered here)
        ids = document_ids(ids)
        kernel = get_kernel(kw.get("implementation"))
        out = kernel.attention(q, k, v, head_parallel.kernel_args(kw, q.shape[-1]),
                               Masks(kv_valid=mask, q_segment_ids=ids, k_segment_ids=ids),
                               lse_grad=False)[0].astype(q.dtype)
    elif op.kind == "exact":
        # exact attention on one device: one segment of the whole sequence, rate 1
        out = dilated_ops.dilated_attention(
            q, k, v, segment_lengths=(q.shape[1],), dilation_rates=(1,), kv_mask=mask,
            **{key: kw[key] for key in ("is_causal", "scale", "implementation",
                                        "block_q", "block_k") if key in kw})
    elif op.kind == "block_sparse":
        out = _block_sparse_heads(op.fn, kw, q, k, v, mask, axis_name, p, num_heads, extra)
    else:
        out = op.fn(q, k, v, kv_mask=mask, **extra)
    return heads_to_seq(out, axis_name)


def _block_sparse_heads(fn, kw, q, k, v, mask, axis_name, num_devices, num_heads, extra):
    """Block-sparse attention of this device's heads: a per-head pattern is cut to them."""
    bs = validation.check_positive_int("block_size", kw["block_size"])
    nb = -(-q.shape[1] // bs)
    pattern = resolve_mask(kw["pattern"], nb, nb, num_heads)
    if pattern.shape[0] == 1:
        return fn(q, k, v, kv_mask=mask, **extra)
    h = q.shape[2]
    if not isinstance(pattern, np.ndarray):  # traced: this device's slice of it
        mine = jax.lax.dynamic_slice_in_dim(pattern, jax.lax.axis_index(axis_name) * h, h)
        return fn(q, k, v, kv_mask=mask, pattern=mine, **extra)
    variants = [(pattern[d * h:(d + 1) * h].tobytes(), pattern[d * h:(d + 1) * h])
                for d in range(num_devices)]
    return head_parallel.by_device(axis_name, variants,
                      lambda m: fn(q, k, v, kv_mask=mask, pattern=m, **extra))
