"""Multi-head dilated attention (LongNet + MAGNETO sub-LayerNorm) in PyTorch.

Written from the mathematics, with plain ``torch.nn`` pieces and the dilated
attention references of :mod:`torch_reference.dilated`:

    q = x_q W_q + b_q,  k = x_k W_k + b_k,  v = x_v W_v + b_v     (heads split)
    o = DilatedAttention(q, k, v)                                  [B, T, H, D]
    y = LayerNorm(concat_heads(o)) W_o + b_o                       (LayerNorm optional)

The weights are copied in from a JAX layer (:meth:`load_jax_params`), and the
gradients of the torch parameters can be returned in the JAX layout
(:meth:`jax_grads`), so parity tests compare the two parameter by parameter.
"""

from __future__ import annotations

import numpy as np
import torch

from torch_reference.dilated import head_groups_dilated_attention, longnet_dilated_attention

__all__ = ["MultiheadDilatedAttention"]


class MultiheadDilatedAttention(torch.nn.Module):
    """``nn.Linear`` projections, dilated attention, sub-LayerNorm, output ``nn.Linear``.

    Query heads ``H``, key/value heads ``Hkv`` (grouped-query attention when fewer),
    head dim ``D = E / H``.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, segment_lengths, dilation_rates,
                 num_kv_heads: int | None = None, mode: str = "longnet",
                 head_offsets: str = "modulo", use_bias: bool = True,
                 layer_norm: bool = True, layer_norm_eps: float = 1e-5,
                 dtype=torch.float64):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = embed_dim // num_heads
        self.segment_lengths, self.dilation_rates = segment_lengths, dilation_rates
        self.mode, self.head_offsets = mode, head_offsets
        kv_dim = self.num_kv_heads * self.head_dim
        kw = dict(bias=use_bias, dtype=dtype)
        self.q_proj = torch.nn.Linear(embed_dim, embed_dim, **kw)
        self.k_proj = torch.nn.Linear(embed_dim, kv_dim, **kw)
        self.v_proj = torch.nn.Linear(embed_dim, kv_dim, **kw)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, **kw)
        self.norm = (torch.nn.LayerNorm(embed_dim, eps=layer_norm_eps, dtype=dtype)
                     if layer_norm else None)

    def forward(self, query, key=None, value=None, *, is_causal=False, kv_mask=None):
        """query/key/value [B, T, E] (key, value default to query) -> [B, T, E]."""
        key = query if key is None else key
        value = key if value is None else value
        q = self.q_proj(query).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(key).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(value).unflatten(-1, (self.num_kv_heads, self.head_dim))
        position_fn = getattr(self, "position_fn", None)  # set by the LongNetLM reference
        if position_fn is not None:
            q, k = position_fn(q, k, torch.arange(q.shape[1]))
        common = dict(segment_lengths=self.segment_lengths,
                      dilation_rates=self.dilation_rates, is_causal=is_causal,
                      kv_mask=kv_mask)
        if self.mode == "longnet":
            o = longnet_dilated_attention(q, k, v, head_offsets=self.head_offsets, **common)
        else:
            o = head_groups_dilated_attention(q, k, v, **common)
        o = o.flatten(-2)
        if self.norm is not None:
            o = self.norm(o)
        return self.out_proj(o)

    # -- weights in the JAX layout: kernels [E, heads, D] / [H, D, E], biases [heads, D]

    def _pairs(self):
        """(jax group, jax name, torch parameter, to_torch, to_jax) for every parameter."""
        e = self.embed_dim

        def in_kernel(shape):
            return (lambda a: a.reshape(e, -1).T,
                    lambda t: t.T.reshape(e, *shape))

        def flat(shape):
            return (lambda a: a.reshape(-1), lambda t: t.reshape(shape))

        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        out = []
        for group, lin, heads in (("query", self.q_proj, h), ("key", self.k_proj, hkv),
                                  ("value", self.v_proj, hkv)):
            out.append((group, "kernel", lin.weight, *in_kernel((heads, d))))
            if lin.bias is not None:
                out.append((group, "bias", lin.bias, *flat((heads, d))))
        out.append(("out", "kernel", self.out_proj.weight,
                    lambda a: a.reshape(-1, e).T, lambda t: t.T.reshape(h, d, e)))
        if self.out_proj.bias is not None:
            out.append(("out", "bias", self.out_proj.bias, *flat((e,))))
        if self.norm is not None:
            out.append(("sub_ln", "scale", self.norm.weight, *flat((h, d))))
            out.append(("sub_ln", "bias", self.norm.bias, *flat((h, d))))
        return out

    @torch.no_grad()
    def load_jax_params(self, params):
        """Copy a JAX layer's ``params`` (nested dict of arrays) into this module."""
        for group, name, p, to_torch, _ in self._pairs():
            value = np.asarray(params[group][name], dtype=np.float64)
            p.copy_(torch.tensor(to_torch(value), dtype=p.dtype))
        return self

    def jax_grads(self):
        """The ``.grad`` of every parameter, as a nested dict in the JAX layout (numpy)."""
        grads = {}
        for group, name, p, _, to_jax in self._pairs():
            grads.setdefault(group, {})[name] = to_jax(p.grad.detach()).numpy()
        return grads
