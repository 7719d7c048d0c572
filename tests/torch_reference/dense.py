"""Exact dense softmax attention in PyTorch (the reference for every kernel)."""

from __future__ import annotations

import math

import torch

__all__ = ["dense_attention"]


def _as_positions(positions, length: int) -> torch.Tensor:
    if positions is None:
        return torch.arange(length)
    return torch.as_tensor(positions).to(torch.int64).reshape(length)


def dense_attention(q, k, v, *, scale=None, is_causal=False, kv_mask=None, allowed=None,
                    logit_bias=None, q_positions=None, k_positions=None, return_lse=False,
                    window=None, logit_soft_cap=None, sinks=None):
    """Masked softmax attention, computed densely.

    Args:
      q: [B, Lq, H, D]; k, v: [B, Lk, Hkv, D] with ``H % Hkv == 0``; query head
        ``j`` reads kv head ``j // (H // Hkv)``.
      scale: logit multiplier, default ``1 / sqrt(D)``.
      is_causal: key ``t`` is allowed for query ``p`` only if ``pos(t) <= pos(p)``.
      kv_mask: bool [B, Lk] or [B, Lk, Hkv]; False = the key may not be attended to.
      allowed: optional bool mask broadcastable to [B, H, Lq, Lk] (AND-ed in).
      logit_bias: optional finite float tensor broadcastable to [B, H, Lq, Lk]
        added to the logits.
      q_positions, k_positions: int positions used by the causal rule and the
        window (default arange).
      return_lse: also return the log-sum-exp.
      window: ``(left, right)``: key ``t`` is allowed for query ``p`` only if
        ``pos(p) - left <= pos(t) <= pos(p) + right``.
      logit_soft_cap: ``c``: the scaled logits ``s`` become ``c * tanh(s / c)``.
      sinks: float [H]: head ``h``'s logit ``s_h`` joins every row's softmax
        denominator, ``out = sum_t e^{l_t} v_t / (e^{s_h} + sum_t e^{l_t})``.

    Returns:
      ``out`` [B, Lq, H, D] and, with ``return_lse``, ``lse`` [B, Lq, H] (with
      ``sinks``: ``log(e^{s_h} + sum_t e^{l_t})``).
      A query row with no allowed key gives ``out = 0`` and ``lse = -inf`` (``s_h``
      with sinks), and no NaN in the gradients.
    """
    b, lq, h, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    assert h % hkv == 0, (h, hkv)
    rep = h // hkv
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if logit_soft_cap is not None:
        logits = logit_soft_cap * torch.tanh(logits / logit_soft_cap)
    if logit_bias is not None:
        logits = logits + logit_bias
    mask = torch.ones((b, h, lq, lk), dtype=torch.bool)
    if window is not None:
        qp = _as_positions(q_positions, lq)
        kp = _as_positions(k_positions, lk)
        left, right = window
        mask = mask & (kp[None, :] >= qp[:, None] - left) & (kp[None, :] <= qp[:, None] + right)
    if is_causal:
        qp = _as_positions(q_positions, lq)
        kp = _as_positions(k_positions, lk)
        mask = mask & (kp[None, :] <= qp[:, None])
    if kv_mask is not None:
        kv_mask = torch.as_tensor(kv_mask, dtype=torch.bool)
        if kv_mask.ndim == 2:  # [B, Lk]
            mask = mask & kv_mask[:, None, None, :]
        else:  # [B, Lk, Hkv] -> per query head [B, H, 1, Lk]
            per_head = kv_mask.repeat_interleave(rep, dim=2).permute(0, 2, 1)
            mask = mask & per_head[:, :, None, :]
    if allowed is not None:
        mask = mask & torch.as_tensor(allowed, dtype=torch.bool)
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        # the sink: one more "key" per head, logit s_h, value zero, never masked
        sink = torch.as_tensor(sinks).reshape(1, h, 1, 1).expand(b, h, lq, 1)
        logits = torch.cat([logits, sink.to(logits.dtype)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[:, :1])], dim=1)
    # shift by the (detached: the result does not depend on it) row maximum,
    # using 0 for rows without any allowed key so that exp(-inf - 0) = 0.
    row_max = logits.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(logits - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    has_key = denom > 0
    denom_safe = torch.where(has_key, denom, torch.ones_like(denom))
    probs = e / denom_safe
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    if not return_lse:
        return out
    lse = torch.where(has_key, row_max + torch.log(denom_safe),
                      torch.full_like(denom, float("-inf")))
    return out, lse.squeeze(-1).permute(0, 2, 1)  # [B, H, Lq] -> [B, Lq, H]
