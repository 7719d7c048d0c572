"""Decoder-only LongNet language model in PyTorch, written from the mathematics.

The reference of ``jax_dilated.models.LongNetLM`` for the parity tests. Built from
plain ``torch`` operations and :class:`torch_reference.multihead.MultiheadDilatedAttention`
(whose attention is the per-segment reference of :mod:`torch_reference.dilated`):

    x = Embedding(tokens) * sqrt(E)
    per block:  x = x + Attention(LN(x))      causal; rotary / xPos on q and k
                x = x + FFN(LN(x))            fc2(gelu_tanh(fc1 h)) or fc2(silu(fc1 h) * gate h),
                                              with a LayerNorm before fc2 under Sub-LN
    logits = LN(x) @ Embedding^T              (tied) or LN(x) @ W_head (untied)

Rotary (RoFormer, "rotate half" pairing): features ``i`` and ``i + D/2`` of a head
form a pair rotated by ``pos * base^(-2i/D)``. xPos (Sun et al.): rotary, then pair
``i`` of q scaled by ``zeta_i^((pos - c)/B)`` and of k by its inverse,
``zeta_i = (2i/D + gamma) / (1 + gamma)``.

Weights are copied in from the JAX model's parameter dict (:meth:`load_jax_params`),
and :meth:`jax_grads` returns the torch gradients in the JAX layout.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from torch_reference.multihead import MultiheadDilatedAttention

__all__ = ["LongNetLM", "rotary", "xpos"]


def rotary(x, positions, base):
    """``x`` [B, T, H, D] rotated at ``positions`` [T] (pairs ``i``, ``i + D/2``)."""
    d = x.shape[-1]
    half = d // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / d)
    angle = positions.to(torch.float64)[:, None] * theta[None, :]  # [T, D/2]
    cos, sin = torch.cos(angle)[:, None, :].to(x.dtype), torch.sin(angle)[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def xpos(q, k, positions, base, scale_base, gamma, center):
    """xPos of ``q`` [B, T, H, D] and ``k`` [B, T, Hkv, D]."""
    d = q.shape[-1]
    half = d // 2
    zeta = (torch.arange(half, dtype=torch.float64) * 2.0 / d + gamma) / (1.0 + gamma)
    power = (positions.to(torch.float64) - center) / scale_base
    s = zeta[None, :] ** power[:, None]  # [T, D/2]
    s = torch.cat([s, s], dim=-1)[:, None, :].to(q.dtype)  # [T, 1, D]
    return rotary(q, positions, base) * s, rotary(k, positions, base) / s


class _Attention(MultiheadDilatedAttention):
    """The multi-head reference with a position encoding of the projected q and k."""

    def __init__(self, *args, position_fn=None, **kw):
        super().__init__(*args, **kw)
        self.position_fn = position_fn

    def forward(self, x, *, kv_mask=None):
        return super().forward(x, is_causal=True, kv_mask=kv_mask)


class LongNetLM(torch.nn.Module):
    """``tokens`` [B, T] long -> logits [B, T, V]; options as ``LongNetConfig``."""

    def __init__(self, *, vocab_size, embed_dim, num_layers, num_heads, num_kv_heads=None,
                 hidden_dim, segment_lengths, dilation_rates, mode="longnet",
                 head_offsets="modulo", positions="xpos", rotary_base=10000.0,
                 xpos_scale_base=512.0, xpos_gamma=0.4, max_len=32768, norm="sub",
                 ffn="gelu", tie_embeddings=True, use_bias=True, layer_norm_eps=1e-5,
                 dtype=torch.float64):
        super().__init__()
        self.embed_dim, self.ffn_kind, self.tied = embed_dim, ffn, tie_embeddings
        if positions == "rotary":
            def position_fn(q, k, pos):
                return rotary(q, pos, rotary_base), rotary(k, pos, rotary_base)
        elif positions == "xpos":
            def position_fn(q, k, pos):
                return xpos(q, k, pos, rotary_base, xpos_scale_base, xpos_gamma,
                            max_len // 2)
        else:
            position_fn = None
        ln = lambda n: torch.nn.LayerNorm(n, eps=layer_norm_eps, dtype=dtype)  # noqa: E731
        lin = lambda i, o: torch.nn.Linear(i, o, bias=use_bias, dtype=dtype)  # noqa: E731
        self.embedding = torch.nn.Parameter(torch.zeros(vocab_size, embed_dim, dtype=dtype))
        self.blocks = torch.nn.ModuleList()
        for _ in range(num_layers):
            block = torch.nn.Module()
            block.ln_attn, block.ln_ffn = ln(embed_dim), ln(embed_dim)
            block.attn = _Attention(
                embed_dim, num_heads, segment_lengths=segment_lengths,
                dilation_rates=dilation_rates, num_kv_heads=num_kv_heads, mode=mode,
                head_offsets=head_offsets, use_bias=use_bias, layer_norm=norm == "sub",
                layer_norm_eps=layer_norm_eps, dtype=dtype, position_fn=position_fn)
            block.fc1 = lin(embed_dim, hidden_dim)
            block.gate = lin(embed_dim, hidden_dim) if ffn == "swiglu" else None
            block.ffn_ln = ln(hidden_dim) if norm == "sub" else None
            block.fc2 = lin(hidden_dim, embed_dim)
            self.blocks.append(block)
        self.final_ln = ln(embed_dim)
        self.head = (None if tie_embeddings else
                     torch.nn.Parameter(torch.zeros(embed_dim, vocab_size, dtype=dtype)))

    def forward(self, tokens, *, kv_mask=None):
        x = self.embedding[tokens] * math.sqrt(self.embed_dim)
        for blk in self.blocks:
            x = x + blk.attn(blk.ln_attn(x), kv_mask=kv_mask)
            h = blk.ln_ffn(x)
            if blk.gate is None:
                u = torch.nn.functional.gelu(blk.fc1(h), approximate="tanh")
            else:
                u = torch.nn.functional.silu(blk.fc1(h)) * blk.gate(h)
            if blk.ffn_ln is not None:
                u = blk.ffn_ln(u)
            x = x + blk.fc2(u)
        x = self.final_ln(x)
        return x @ (self.embedding.T if self.head is None else self.head)

    # -- parameters in the JAX layout (nnx.to_pure_dict of the model's Params)

    def _pairs(self):
        """(path in the JAX dict, torch parameter, to_torch, to_jax) for all but attention."""
        same = (lambda a: a, lambda t: t)
        transposed = (lambda a: a.T, lambda t: t.T)
        out = [(("embed", "embedding"), self.embedding, *same)]
        if self.head is not None:
            out.append((("head", "kernel"), self.head, *same))
        out += [(("final_ln", "scale"), self.final_ln.weight, *same),
                (("final_ln", "bias"), self.final_ln.bias, *same)]
        for i, blk in enumerate(self.blocks):
            for name, mod in (("ln_attn", blk.ln_attn), ("ln_ffn", blk.ln_ffn)):
                out += [(("blocks", i, name, "scale"), mod.weight, *same),
                        (("blocks", i, name, "bias"), mod.bias, *same)]
            for name, mod in (("fc1", blk.fc1), ("gate", blk.gate), ("fc2", blk.fc2)):
                if mod is None:
                    continue
                out.append((("blocks", i, "ffn", name, "kernel"), mod.weight, *transposed))
                if mod.bias is not None:
                    out.append((("blocks", i, "ffn", name, "bias"), mod.bias, *same))
            if blk.ffn_ln is not None:
                out += [(("blocks", i, "ffn", "ln", "scale"), blk.ffn_ln.weight, *same),
                        (("blocks", i, "ffn", "ln", "bias"), blk.ffn_ln.bias, *same)]
        return out

    @torch.no_grad()
    def load_jax_params(self, params):
        """Copy ``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` into this module."""
        for path, p, to_torch, _ in self._pairs():
            value = params
            for k in path:
                value = value[k]
            p.copy_(torch.tensor(to_torch(np.asarray(value, np.float64)), dtype=p.dtype))
        for i, blk in enumerate(self.blocks):
            blk.attn.load_jax_params(params["blocks"][i]["attn"])
        return self

    def jax_grads(self):
        """Every parameter's ``.grad`` as a nested dict in the JAX layout (numpy)."""
        grads = {}
        for path, p, _, to_jax in self._pairs():
            node = grads
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = to_jax(p.grad.detach()).numpy()
        for i, blk in enumerate(self.blocks):
            grads["blocks"][i]["attn"] = blk.attn.jax_grads()
        return grads
