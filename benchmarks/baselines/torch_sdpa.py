"""torch SDPA per dilated segment: the PyTorch baseline of ``python -m benchmarks dilated``.

Self-contained: it imports nothing from ``jax_dilated`` (it is an independent
implementation of docs/semantics.md, section 2, checked against the library). Arrays are
``[batch, seq, heads, head_dim]`` like the JAX library; the attention kernel is
torch's own CPU flash attention (what ``torch.nn.functional.scaled_dot_product_attention``
dispatches to on CPU), run once per dilated segment batch.

Two modes, matching docs/semantics.md, section 2:

* :func:`head_groups_attention` is written the way the PyTorch dilated-attention
  library (``dilated_attention_pytorch.DilatedAttention``) writes it: for head
  group ``i`` reshape into segments, take every ``r``-th position from offset
  ``i mod r`` (``x[:, :, offset::r]``), fold segments into the batch, run SDPA,
  add the result back at the same positions, and divide the output by the
  number of groups. Gradients come from torch autograd. (Group bounds are the
  cumulative group sizes; the original's ``i * g`` start is only right when
  every group has the same size.)

* :func:`longnet_attention` runs every branch on every head (head ``j`` at
  offset ``j mod r``) and mixes branches by their softmax denominators,
  ``O = sum_i exp(lse_i) O_i / sum_i exp(lse_i)``. torch's SDPA does not
  return the log-sum-exp, so it calls
  ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (which returns
  ``(output, logsumexp)``) and its backward op directly inside a
  ``torch.autograd.Function``. The gradient is exact (mixing weights are not
  detached) using the identity: with ``w_i = exp(lse_i - LSE)``, branch ``i``'s
  backward is the ordinary flash backward with output cotangent ``w_i dO`` and
  the *merged* output ``O`` in place of ``O_i`` (the kernel's
  ``rowsum(dO_i * out)`` then equals ``rowsum(dO_i * O_i) - dLSE_i``).

Limits (enough for benchmarking): equal query and kv heads, no padding mask, no
dropout, ``seq_len`` a multiple of every segment length shorter than it (a
segment at least as long as the sequence is one segment of the whole sequence,
which must then be a multiple of its rate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["check_config", "dilated_attention", "head_groups_attention", "longnet_attention"]

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _branches(seq_len: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int]):
    """Effective ``(w, r)`` per branch; checks the divisibility this module relies on."""
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError("segment_lengths and dilation_rates differ in length")
    out = []
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(int(w), seq_len)
        if seq_len % w or w % r:
            raise ValueError(
                f"torch reference needs seq_len % segment == 0 and segment % rate == 0, "
                f"got seq_len={seq_len}, segment={w}, rate={r}")
        out.append((w, int(r)))
    return out


def check_config(seq_len: int, segment_lengths: Sequence[int],
                 dilation_rates: Sequence[int]) -> None:
    """Raise ``ValueError`` if this module cannot run the configuration (see module limits)."""
    _branches(seq_len, segment_lengths, dilation_rates)


def _group_bounds(num_heads: int, num_groups: int) -> list[tuple[int, int]]:
    """Contiguous head groups: sizes ``H // G``, the first ``H % G`` one larger."""
    if num_heads < num_groups:
        raise ValueError(f"head_groups needs num_heads >= branches, got {num_heads} < {num_groups}")
    base, extra = divmod(num_heads, num_groups)
    bounds, start = [], 0
    for g in range(num_groups):
        size = base + (g < extra)
        bounds.append((start, start + size))
        start += size
    return bounds


def head_groups_attention(query, key, value, *, segment_lengths, dilation_rates,
                          is_causal: bool = False, scale: float | None = None):
    """``mode="head_groups"`` dilated attention (PyTorch dilated-attention library style).

    Args:
      query, key, value: [batch, seq, heads, head_dim] tensors.
      segment_lengths, dilation_rates: one entry per branch / head group.
      is_causal: causal inside every dilated segment.
      scale: logit scale, default ``1 / sqrt(head_dim)``.

    Returns:
      [batch, seq, heads, head_dim]; differentiable with torch autograd.
    """
    b, n, h, d = query.shape
    branches = _branches(n, segment_lengths, dilation_rates)
    out = torch.zeros_like(query)
    for i, ((w, r), (h0, h1)) in enumerate(zip(branches, _group_bounds(h, len(branches)))):
        offset = i % r
        # b (n s) h d -> b n s h d, then every r-th position of this group's heads
        q = query.view(b, n // w, w, h, d)[:, :, offset::r, h0:h1]
        k = key.view(b, n // w, w, h, d)[:, :, offset::r, h0:h1]
        v = value.view(b, n // w, w, h, d)[:, :, offset::r, h0:h1]
        # fold segments into the batch: (b n) heads s d, the layout SDPA takes
        q, k, v = (x.reshape(b * (n // w), w // r, h1 - h0, d).transpose(1, 2) for x in (q, k, v))
        x = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
        x = x.transpose(1, 2).reshape(b, n // w, w // r, h1 - h0, d)
        out_seg = out.view(b, n // w, w, h, d)
        out_seg[:, :, offset::r, h0:h1] += x
    return out / len(branches)


def _gather(x, w: int, r: int, o: int):
    """Positions ``o::r`` of every segment for heads ``o::r``: [b*S, hs, w/r, d]."""
    b, n, h, d = x.shape
    xs = x.view(b, n // w, w, h, d)[:, :, o::r, o::r]
    hs = xs.shape[3]
    return xs.reshape(b * (n // w), w // r, hs, d).transpose(1, 2).contiguous()


def _scatter_view(x, w: int, r: int, o: int):
    """The strided view of ``x`` [b, n, h, ...] that :func:`_gather` reads from."""
    b, n, h = x.shape[:3]
    return x.view(b, n // w, w, h, *x.shape[3:])[:, :, o::r, o::r]


def _ungather(y, b: int, w: int, r: int, n: int):
    """[b*S, hs, w/r, ...] -> [b, S, w/r, hs, ...] (the shape of :func:`_scatter_view`)."""
    y = y.transpose(1, 2)
    return y.reshape(b, n // w, w // r, *y.shape[2:])


class _LongNet(torch.autograd.Function):
    """LongNet dilated attention with branches mixed by their softmax denominators."""

    @staticmethod
    def forward(ctx, query, key, value, branches, is_causal, scale):
        b, n, h, _d = query.shape
        parts = []  # (branch index, w, r, o, out [bS, hs, L, d], lse [bS, hs, L])
        stats = torch.promote_types(query.dtype, torch.float32)  # softmax statistics dtype
        lse_all = query.new_full((len(branches), b, n, h), -math.inf, dtype=stats)
        for i, (w, r) in enumerate(branches):
            for o in range(min(r, h)):
                out_o, lse_o = _flash_fwd(_gather(query, w, r, o), _gather(key, w, r, o),
                                          _gather(value, w, r, o), 0.0, is_causal,
                                          scale=scale)
                _scatter_view(lse_all[i], w, r, o).copy_(_ungather(lse_o, b, w, r, n))
                parts.append((i, w, r, o, out_o))
        lse = torch.logsumexp(lse_all, dim=0)  # [b, n, h]
        weights = torch.exp(lse_all - lse)     # [G, b, n, h]; 0 where a branch skips p
        merged = torch.zeros_like(query, dtype=stats)
        for i, w, r, o, out_o in parts:
            wt = _scatter_view(weights[i], w, r, o)[..., None]
            _scatter_view(merged, w, r, o).add_(wt * _ungather(out_o, b, w, r, n))
        merged = merged.to(query.dtype)
        ctx.save_for_backward(query, key, value, merged, lse_all, weights)
        ctx.config = (branches, is_causal, scale)
        return merged

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, merged, lse_all, weights = ctx.saved_tensors
        branches, is_causal, scale = ctx.config
        b, n, h, _d = query.shape
        stats = lse_all.dtype
        dq, dk, dv = (torch.zeros_like(x, dtype=stats) for x in (query, key, value))
        for i, (w, r) in enumerate(branches):
            do_i = grad_out * weights[i][..., None].to(grad_out.dtype)  # w_i dO
            for o in range(min(r, h)):
                do_o = _gather(do_i, w, r, o)
                lse_o = _gather(lse_all[i][..., None], w, r, o)[..., 0].contiguous()
                gq, gk, gv = _flash_bwd(do_o, _gather(query, w, r, o), _gather(key, w, r, o),
                                        _gather(value, w, r, o), _gather(merged, w, r, o),
                                        lse_o, 0.0, is_causal, scale=scale)
                for acc, g in ((dq, gq), (dk, gk), (dv, gv)):
                    _scatter_view(acc, w, r, o).add_(_ungather(g, b, w, r, n))
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None


def longnet_attention(query, key, value, *, segment_lengths, dilation_rates,
                      is_causal: bool = False, scale: float | None = None):
    """``mode="longnet"`` dilated attention (``head_offsets="modulo"``).

    Every head ``j`` runs every branch ``(w, r)`` at offset ``j mod r``; branch
    outputs are mixed by their log-sum-exps. Differentiable (custom autograd
    function around torch's CPU flash-attention forward and backward ops).

    Args / Returns: as :func:`head_groups_attention`.
    """
    branches = tuple(_branches(query.shape[1], segment_lengths, dilation_rates))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    return _LongNet.apply(query, key, value, branches, bool(is_causal), float(scale))


def dilated_attention(query, key, value, *, mode: str = "longnet", **kwargs):
    """Dispatch to :func:`longnet_attention` or :func:`head_groups_attention` by ``mode``."""
    if mode == "longnet":
        return longnet_attention(query, key, value, **kwargs)
    if mode == "head_groups":
        return head_groups_attention(query, key, value, **kwargs)
    raise ValueError(f"mode must be 'longnet' or 'head_groups', got {mode!r}")
