"""Dilated attention (LongNet) in PyTorch, written from docs/semantics.md, section 2.

Notation: sequence length ``T``, branch ``i`` with segment length ``w`` and
dilation rate ``r``. With offset ``o`` a position ``p`` is *selected* when
``(p mod w) mod r == o``; selected queries attend to selected keys of the same
segment (``floor(p/w) == floor(t/w)``), causally if asked and only to keys the
``kv_mask`` allows. The last segment may be shorter than ``w``, and a segment
longer than ``T`` is a single short segment: keys past ``T`` do not exist.
"""

from __future__ import annotations

import math

import torch

from torch_reference.dense import dense_attention

__all__ = [
    "head_offsets",
    "segments",
    "branch_attention",
    "merge_branches",
    "longnet_dilated_attention",
    "longnet_dense_form",
    "head_groups_dilated_attention",
    "branch_mask",
    "dilated_attention_full",
]


def head_offsets(num_heads: int, rate: int, rule: str) -> list[int]:
    """Offset of every head in mode="longnet".

    ``"modulo"``: ``j mod r`` (LongNet Eq. 13); ``"blocked"``: ``floor(j / ceil(H / r))``.
    """
    if rule == "modulo":
        return [j % rate for j in range(num_heads)]
    if rule == "blocked":
        block = math.ceil(num_heads / rate)
        return [j // block for j in range(num_heads)]
    raise ValueError(rule)


_head_offsets = head_offsets  # the public functions below take an argument of this name


def segments(seq_len: int, segment_length: int, rate: int, offset: int) -> list[list[int]]:
    """The selected positions of every segment, in increasing order.

    ``range(0, T, w)`` yields one segment start when ``w >= T``, and the last
    segment stops at ``T``, which is exactly the short-segment rule.
    """
    out = []
    for start in range(0, seq_len, segment_length):
        stop = min(start + segment_length, seq_len)
        out.append([p for p in range(start, stop)
                    if (p % segment_length) % rate == offset])
    return out


def branch_attention(q, k, v, *, segment_length, rate, heads, offsets, is_causal, scale,
                     kv_mask):
    """One branch for the query heads ``heads`` (each with its own offset).

    Loops over heads and segments; each (head, segment) is a small exact dense
    attention among the selected positions of that segment.

    Returns:
      ``O`` [B, T, len(heads), D] and ``LSE`` [B, T, len(heads)]; positions the
      branch does not cover (not selected, or no allowed key) have ``O = 0`` and
      ``LSE = -inf``.
    """
    b, t, h, d = q.shape
    rep = h // k.shape[2]
    outs, lses = [], []
    for j, offset in zip(heads, offsets):
        kv_head = j // rep
        o_head = q.new_zeros((b, t, d))
        lse_head = q.new_full((b, t), float("-inf"))
        for positions in segments(t, segment_length, rate, offset):
            if not positions:
                continue
            idx = torch.tensor(positions)
            o_seg, lse_seg = dense_attention(
                q[:, idx, j:j + 1], k[:, idx, kv_head:kv_head + 1],
                v[:, idx, kv_head:kv_head + 1], scale=scale, is_causal=is_causal,
                kv_mask=None if kv_mask is None else kv_mask[:, idx],
                q_positions=idx, k_positions=idx, return_lse=True)
            o_head = o_head.index_copy(1, idx, o_seg[:, :, 0])
            lse_head = lse_head.index_copy(1, idx, lse_seg[:, :, 0])
        outs.append(o_head)
        lses.append(lse_head)
    return torch.stack(outs, dim=2), torch.stack(lses, dim=2)


def merge_branches(outs, lses):
    """``O = sum_i exp(LSE_i) O_i / sum_i exp(LSE_i)`` over covering branches, else 0.

    ``outs``: list of [B, T, H, D]; ``lses``: list of [B, T, H] (``-inf`` = not covered).
    A common (detached) shift keeps ``exp`` in range; the ratio does not depend on it.
    """
    lse = torch.stack(lses)  # [n, B, T, H]
    out = torch.stack(outs)  # [n, B, T, H, D]
    shift = lse.amax(dim=0).detach()
    shift = torch.where(torch.isneginf(shift), torch.zeros_like(shift), shift)
    weight = torch.exp(lse - shift)  # 0 where a branch does not cover
    total = weight.sum(dim=0)
    covered = total > 0
    total_safe = torch.where(covered, total, torch.ones_like(total))
    return (weight[..., None] * out).sum(dim=0) / total_safe[..., None]


def _scale(scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def longnet_dilated_attention(q, k, v, *, segment_lengths, dilation_rates,
                              head_offsets: str = "modulo", is_causal=False, scale=None,
                              kv_mask=None):
    """mode="longnet": every head runs every branch; branches merged by Eq. 10.

    q [B, T, H, D], k/v [B, T, Hkv, D], kv_mask bool [B, T] or None.
    """
    h = q.shape[2]
    scale = _scale(scale, q.shape[-1])
    outs, lses = [], []
    for w, r in zip(segment_lengths, dilation_rates):
        o_i, lse_i = branch_attention(
            q, k, v, segment_length=w, rate=r, heads=range(h),
            offsets=_head_offsets(h, r, head_offsets), is_causal=is_causal, scale=scale,
            kv_mask=kv_mask)
        outs.append(o_i)
        lses.append(lse_i)
    return merge_branches(outs, lses)



def longnet_dense_form(q, k, v, *, segment_lengths, dilation_rates,
                       head_offsets: str = "modulo", is_causal=False, scale=None,
                       kv_mask=None):
    """mode="longnet" as one dense attention with logits ``scale*q.k + log m(p, t)``.

    ``m(p, t)`` (per head) counts the branches in which ``p`` and ``t`` are both
    selected and in the same segment; pairs with ``m = 0`` are masked. Causality
    and ``kv_mask`` are applied on top, as for any attention.
    """
    t, h = q.shape[1], q.shape[2]
    pos = torch.arange(t)
    mult = torch.zeros((h, t, t), dtype=q.dtype)
    for w, r in zip(segment_lengths, dilation_rates):
        same_segment = (pos // w)[:, None] == (pos // w)[None, :]
        for j, offset in enumerate(_head_offsets(h, r, head_offsets)):
            sel = (pos % w) % r == offset
            mult[j] += (sel[:, None] & sel[None, :] & same_segment).to(q.dtype)
    return dense_attention(q, k, v, scale=_scale(scale, q.shape[-1]), is_causal=is_causal,
                           kv_mask=kv_mask, allowed=(mult > 0)[None],
                           logit_bias=torch.log(mult.clamp(min=1))[None])


def head_groups_dilated_attention(q, k, v, *, segment_lengths, dilation_rates,
                                  is_causal=False, scale=None, kv_mask=None):
    """mode="head_groups": head group ``i`` runs branch ``i`` only, output / G.

    ``G = len(segment_lengths)`` contiguous groups of sizes ``H // G``, the first
    ``H % G`` one larger; group ``i`` uses offset ``i mod r_i``; uncovered
    positions output 0.
    """
    h = q.shape[2]
    g = len(segment_lengths)
    assert h >= g
    scale = _scale(scale, q.shape[-1])
    base, extra = divmod(h, g)
    start, outs = 0, []
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        size = base + (1 if i < extra else 0)
        o_i, _ = branch_attention(
            q, k, v, segment_length=w, rate=r, heads=range(start, start + size),
            offsets=[i % r] * size, is_causal=is_causal, scale=scale, kv_mask=kv_mask)
        outs.append(o_i)
        start += size
    return torch.cat(outs, dim=2) / g


# ------------------------------------------- sliding-window branches, soft-cap, sinks


def branch_mask(seq_len: int, branch, offset: int) -> torch.Tensor:
    """bool [T, T]: may query ``p`` attend to key ``t`` in this branch (before the
    causal rule and ``kv_mask``)?

    ``branch`` is ``("segment", w, r)``: both selected at ``offset`` (``(p mod w) mod r
    == offset``) and in the same segment ``floor(p / w)``; or ``("window", left,
    right)``: ``p - left <= t <= p + right`` on the whole sequence.
    """
    pos = torch.arange(seq_len)
    p, t = pos[:, None], pos[None, :]
    if branch[0] == "window":
        _, left, right = branch
        return (t >= p - left) & (t <= p + right)
    _, w, r = branch
    sel = (pos % w) % r == offset
    return sel[:, None] & sel[None, :] & ((p // w) == (t // w))


def dilated_attention_full(q, k, v, *, branches, mode="longnet", head_offsets="modulo",
                           is_causal=False, scale=None, kv_mask=None, logit_soft_cap=None,
                           sinks=None):
    """Dilated attention with window branches, soft-capping and sinks, densely.

    Written from docs/semantics.md, section 2 ("Sliding-window branches,
    soft-capping and sinks"). ``branches``: a list of ``("segment", w, r)`` and
    ``("window", left, right)`` (right already resolved).

    Logits ``l(p, t) = c tanh(scale q.k / c)`` (or ``scale q.k`` without a cap).
    longnet: head ``j`` is one softmax over keys with logits ``l + log m(p, t)``,
    ``m`` the number of branches (at head ``j``'s offsets) letting ``p`` see ``t``,
    and the sink ``s_j`` joins that denominator once.
    head_groups: head ``j`` of group ``i`` is the softmax of branch ``i`` alone with
    the sink ``s_j`` in its denominator, divided by ``G``.
    A row with nothing to attend to gives 0.
    """
    b, t_len, h, d = q.shape
    rep = h // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scale = _scale(scale, d)
    logits = scale * torch.einsum("bqhd,bkhd->bhqk", q, k)
    if logit_soft_cap is not None:
        logits = logit_soft_cap * torch.tanh(logits / logit_soft_cap)
    g = len(branches)
    mult = torch.zeros((h, t_len, t_len), dtype=q.dtype)
    if mode == "longnet":
        for branch in branches:
            rate = 1 if branch[0] == "window" else branch[2]
            for j, offset in enumerate(_head_offsets(h, rate, head_offsets)):
                mult[j] += branch_mask(t_len, branch, offset).to(q.dtype)
    else:
        base, extra = divmod(h, g)
        start = 0
        for i, branch in enumerate(branches):
            size = base + (1 if i < extra else 0)
            offset = 0 if branch[0] == "window" else i % branch[2]
            for j in range(start, start + size):
                mult[j] = branch_mask(t_len, branch, offset).to(q.dtype)
            start += size
    ok = (mult > 0)[None].expand(b, h, t_len, t_len)
    pos = torch.arange(t_len)
    if is_causal:
        ok = ok & (pos[None, :] <= pos[:, None])
    if kv_mask is not None:
        ok = ok & kv_mask[:, None, None, :]
    scores = torch.where(ok, logits + torch.log(mult.clamp(min=1))[None],
                         torch.full_like(logits, float("-inf")))
    if sinks is not None:
        sink_col = sinks.to(q.dtype)[None, :, None, None].expand(b, h, t_len, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    top = scores.amax(dim=-1, keepdim=True).detach()
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(scores - top)
    denom = weights.sum(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", weights[..., :t_len], v)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = out / denom.permute(0, 2, 1)[..., None]
    return out / g if mode == "head_groups" else out
