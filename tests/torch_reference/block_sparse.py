"""Block-sparse attention in PyTorch, computed densely (the reference of block_sparse).

The block mask is expanded to a token mask (query ``p`` may see key ``t`` when
block ``(p // block_size, t // block_size)`` is active, per head or shared), AND-ed
with causality and the key padding mask, and handed to :func:`dense_attention`:
one softmax over all allowed keys. Shares no code with ``jax_dilated``.
"""

from __future__ import annotations

import torch

from torch_reference.dense import dense_attention

__all__ = ["block_sparse_attention", "expand_block_mask"]


def expand_block_mask(block_mask, block_size: int, q_len: int, k_len: int) -> torch.Tensor:
    """Token mask [H or 1, q_len, k_len] of a block mask [qb, kb] or [H, qb, kb]."""
    m = torch.as_tensor(block_mask, dtype=torch.bool)
    if m.ndim == 2:
        m = m[None]
    qb = torch.arange(q_len) // block_size
    kb = torch.arange(k_len) // block_size
    return m[:, qb][:, :, kb]


def block_sparse_attention(q, k, v, block_mask, block_size: int, *, scale=None,
                           is_causal=False, kv_mask=None, allowed=None, return_lse=False):
    """Dense masked attention over the active blocks.

    Args:
      q: [B, Lq, H, D]; k, v: [B, Lk, Hkv, D] (GQA: query head j reads kv head
        ``j // (H // Hkv)``).
      block_mask: bool [ceil(Lq/bs), ceil(Lk/bs)] (all heads) or [H, ...] (per head).
      block_size: tokens per block.
      scale, is_causal, kv_mask, return_lse: as :func:`dense_attention`.
      allowed: optional bool mask broadcastable to [B, H, Lq, Lk], AND-ed with the
        expanded block mask (e.g. a document mask of packed sequences).
    """
    blocks = expand_block_mask(block_mask, block_size, q.shape[1], k.shape[1])[None]
    if allowed is not None:
        blocks = blocks & torch.as_tensor(allowed, dtype=torch.bool)
    return dense_attention(q, k, v, scale=scale, is_causal=is_causal, kv_mask=kv_mask,
                           allowed=blocks, return_lse=return_lse)
