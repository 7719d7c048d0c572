"""torchscale's dilated attention, LongNet encoder and Prov-GigaPath's slide encoder in PyTorch.

Written from the mathematics of issue 49 (no code of torchscale or Prov-GigaPath),
with explicit zero padding and Python loops over branches and heads, so that every
rule can be read off the code. Works in float64 and float32, with autograd.

Dilated attention (:func:`dilated_attention`), one branch of segment length ``sl``
and rate ``r`` on a sequence of length ``L`` with ``H`` heads:

* ``w = min(sl, L)``, ``n = ceil(L / w)`` segments, ``c = ceil(w / r)`` *slots* per
  (segment, head), ``m = c * r``;
* head ``j`` has offset ``o = j // ceil(H / r)`` ("blocked" offsets);
* slot ``l`` of segment ``s`` holds position ``s*w + l*r + o`` when ``l*r + o < w``
  and that position is ``< L``, and a ZERO vector otherwise (q = k = v = 0);
* dense softmax attention among the ``c`` slots of a (segment, head), causal if
  asked; padded slots are keys with logit 0 and value 0, counted in the
  denominator;
* the result of slot ``l`` of segment ``s`` goes to OUTPUT position
  ``s*m + l*r + o`` (dropped if ``>= L``); output positions no slot lands on have
  output 0 and lse ``-1e8``; an lse exactly ``0.0`` becomes ``-1e8``;
* branches are merged with the weights ``softmax_i(lse_i)`` taken as constants
  (no gradient).

LongNet encoder (:class:`LongNetEncoder`): torchscale's ``Encoder`` with Sub-LN
(pre-LayerNorm blocks, a LayerNorm inside the attention before ``out_proj`` and
one inside the FFN before ``fc2``) and a final LayerNorm; the state-dict keys are
torchscale's.

Slide encoder (:class:`SlideEncoder`): Prov-GigaPath's ``LongNetViT``: a linear
tile embedding plus a 2-D sine-cosine position of the tile's grid cell, a CLS
token in front, the encoder, and a LayerNorm (eps 1e-6) of the CLS token (or of
the mean of the tile tokens).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "NOT_COVERED",
    "head_offset",
    "branch_attention",
    "merge_branches",
    "dilated_attention",
    "LongNetEncoder",
    "SlideEncoder",
    "position_rows",
    "segment_lengths_for",
]

NOT_COVERED = -1e8
"""The lse of a position a branch does not cover (and of an lse exactly 0)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def head_offset(head: int, num_heads: int, rate: int) -> int:
    """Offset of ``head`` in a branch of rate ``rate``: ``head // ceil(H / r)``."""
    return head // _ceil_div(num_heads, rate)


def _slot_values(x, head, index, zero_row):
    """[B, n, c, d]: the vectors of ``head`` in every slot; index ``L`` is a zero vector."""
    return torch.cat([x[:, :, head], zero_row], dim=1)[:, index]


def branch_attention(q, k, v, *, segment_length, rate, is_causal=False, scale=None,
                     dropout_p=0.0):
    """One branch: output [B, L, H, d] and lse [B, L, H].

    Loops over heads; the segments of a head are a batch of small dense attentions
    among ``c`` slots each. Uncovered positions: output 0, lse ``NOT_COVERED``.
    ``dropout_p`` drops attention probabilities (after the lse), training only.
    """
    b, seq_len, num_heads, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    w = min(segment_length, seq_len)
    n = _ceil_div(seq_len, w)
    c = _ceil_div(w, rate)
    m = c * rate
    seg = torch.arange(n)[:, None]   # [n, 1]
    slot = torch.arange(c)[None, :]  # [1, c]
    zero_row = q.new_zeros((b, 1, d))
    allowed = torch.ones((c, c), dtype=torch.bool)
    if is_causal:
        allowed = torch.tril(allowed)
    outs, lses = [], []
    for j in range(num_heads):
        o = head_offset(j, num_heads, rate)
        within = slot * rate + o  # position of the slot inside its segment
        source = seg * w + within  # [n, c]
        real = (within < w) & (source < seq_len)
        # Index seq_len picks an appended zero row: a padded slot is a zero vector.
        index = torch.where(real, source, torch.full_like(source, seq_len))

        qs, ks, vs = (_slot_values(x, j, index, zero_row) for x in (q, k, v))
        logits = scale * torch.einsum("bncd,bnkd->bnck", qs, ks)
        logits = logits.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)  # [B, n, c]
        probs = torch.exp(logits - lse[..., None])
        if dropout_p > 0.0:
            probs = F.dropout(probs, dropout_p)
        out = torch.einsum("bnck,bnkd->bncd", probs, vs)

        # Shifted placement: slot l of segment s lands on s*m + l*r + o.
        dest = seg * m + within
        keep = dest < seq_len
        dest_kept = dest[keep]
        out_j = q.new_zeros((b, seq_len, d)).index_copy(1, dest_kept, out[:, keep])
        lse_j = q.new_full((b, seq_len), NOT_COVERED).index_copy(1, dest_kept, lse[:, keep])
        lse_j = lse_j.masked_fill(lse_j == 0.0, NOT_COVERED)
        outs.append(out_j)
        lses.append(lse_j)
    return torch.stack(outs, dim=2), torch.stack(lses, dim=2)


def merge_branches(outs, lses):
    """``sum_i softmax_i(lse_i) * out_i`` with the weights held constant.

    The weights are computed in float32 at least (float64 for float64 inputs).
    """
    dtype = outs[0].dtype
    with torch.no_grad():
        lse = torch.stack(lses).to(torch.promote_types(dtype, torch.float32))
        weights = torch.softmax(lse, dim=0).to(dtype)  # [n_branches, B, L, H]
    total = 0
    for weight, out in zip(weights, outs):
        total = total + weight[..., None] * out
    return total


def dilated_attention(q, k, v, segment_lengths, dilation_rates, is_causal=False, scale=None,
                      dropout_p=0.0):
    """torchscale's dilated attention: q, k, v [B, L, H, d] -> [B, L, H, d]."""
    assert len(segment_lengths) == len(dilation_rates)
    outs, lses = [], []
    for sl, r in zip(segment_lengths, dilation_rates):
        out, lse = branch_attention(q, k, v, segment_length=int(sl), rate=int(r),
                                    is_causal=is_causal, scale=scale, dropout_p=dropout_p)
        outs.append(out)
        lses.append(lse)
    return merge_branches(outs, lses)


# --------------------------------------------------------------------------- encoder


def _drop_path(x, p: float, training: bool):
    """Stochastic depth per sample: keep with probability ``1 - p``, scaled by ``1/(1-p)``."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask / keep


def _randomize(module: torch.nn.Module, seed: int):
    """Random values for every parameter (LayerNorms too, so swapped names show).

    Linear weights ~ N(0, 1/in), biases ~ N(0, 0.1^2), LayerNorm weights ~ 1 + N(0, 0.1^2),
    LayerNorm biases ~ N(0, 0.1^2), other parameters ~ N(0, 0.02^2).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("weight") and p.dim() == 2:
                value = z / math.sqrt(p.shape[1])
            elif name.endswith("weight"):  # LayerNorm gain
                value = 1.0 + 0.1 * z
            elif name.endswith("bias"):
                value = 0.1 * z
            else:
                value = 0.02 * z
            p.copy_(value.to(p.dtype))


class _SelfAttention(torch.nn.Module):
    """q/k/v projections, dilated attention, ``inner_attn_ln``, ``out_proj``."""

    def __init__(self, embed_dim, num_heads, segment_lengths, dilation_rates, dropout, dtype):
        super().__init__()
        self.num_heads = num_heads
        self.segment_lengths = list(segment_lengths)
        self.dilation_rates = list(dilation_rates)
        self.dropout = dropout
        self.q_proj = torch.nn.Linear(embed_dim, embed_dim, dtype=dtype)
        self.k_proj = torch.nn.Linear(embed_dim, embed_dim, dtype=dtype)
        self.v_proj = torch.nn.Linear(embed_dim, embed_dim, dtype=dtype)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, dtype=dtype)
        self.inner_attn_ln = torch.nn.LayerNorm(embed_dim, eps=1e-5, dtype=dtype)

    def forward(self, x):
        heads = (self.num_heads, x.shape[-1] // self.num_heads)
        q = self.q_proj(x).unflatten(-1, heads)
        k = self.k_proj(x).unflatten(-1, heads)
        v = self.v_proj(x).unflatten(-1, heads)
        o = dilated_attention(q, k, v, self.segment_lengths, self.dilation_rates,
                              dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(self.inner_attn_ln(o.flatten(-2)))


class _FeedForward(torch.nn.Module):
    """``fc2(ffn_layernorm(activation_dropout(gelu(fc1 x))))``, GELU with erf."""

    def __init__(self, embed_dim, ffn_dim, activation_dropout, activation_dtype, dtype):
        super().__init__()
        self.fc1 = torch.nn.Linear(embed_dim, ffn_dim, dtype=dtype)
        self.ffn_layernorm = torch.nn.LayerNorm(ffn_dim, eps=1e-5, dtype=dtype)
        self.fc2 = torch.nn.Linear(ffn_dim, embed_dim, dtype=dtype)
        self.activation_dropout = activation_dropout
        self.activation_dtype = activation_dtype

    def forward(self, x):
        u = self.fc1(x)
        # GELU in float32 at least (torchscale casts to float32 whatever the dtype;
        # activation_dtype=torch.float32 reproduces that for float64 too).
        act = self.activation_dtype or torch.promote_types(u.dtype, torch.float32)
        u = F.gelu(u.to(act)).to(u.dtype)
        u = F.dropout(u, self.activation_dropout, self.training)
        return self.fc2(self.ffn_layernorm(u))


class _EncoderLayer(torch.nn.Module):
    def __init__(self, embed_dim, num_heads, ffn_dim, segment_lengths, dilation_rates,
                 dropout, drop_path, attention_dropout, activation_dropout, activation_dtype,
                 dtype):
        super().__init__()
        self.self_attn = _SelfAttention(embed_dim, num_heads, segment_lengths, dilation_rates,
                                        attention_dropout, dtype)
        self.self_attn_layer_norm = torch.nn.LayerNorm(embed_dim, eps=1e-5, dtype=dtype)
        self.ffn = _FeedForward(embed_dim, ffn_dim, activation_dropout, activation_dtype, dtype)
        self.final_layer_norm = torch.nn.LayerNorm(embed_dim, eps=1e-5, dtype=dtype)
        self.dropout = dropout
        self.drop_path = drop_path

    def forward(self, x):
        a = self.self_attn(self.self_attn_layer_norm(x))
        h = x + _drop_path(F.dropout(a, self.dropout, self.training), self.drop_path,
                           self.training)
        f = self.ffn(self.final_layer_norm(h))
        return h + _drop_path(F.dropout(f, self.dropout, self.training), self.drop_path,
                              self.training)


class LongNetEncoder(torch.nn.Module):
    """torchscale's LongNet ``Encoder`` (Sub-LN, pre-LN, final LayerNorm), x [B, L, D].

    ``forward(x, return_states=False)`` -> ``encoder_out`` [B, L, D], or
    ``(encoder_out, states)`` with ``states`` the input (after the embedding dropout)
    and every layer's output, ``num_layers + 1`` tensors, before the final LayerNorm.

    Every parameter is random (``seed``). ``activation_dtype``: the dtype of the
    GELU; ``None`` means float32 or wider (``torch.float32`` is torchscale's exact
    cast, which also rounds float64 activations).
    """

    def __init__(self, embed_dim, num_layers, num_heads, ffn_dim, segment_lengths,
                 dilation_rates, dropout=0.0, drop_path_rate=0.0, attention_dropout=0.0,
                 activation_dropout=0.0, *, seed=0, dtype=torch.float64,
                 activation_dtype=None):
        super().__init__()
        assert embed_dim % num_heads == 0
        self.dropout = dropout
        drop_paths = np.linspace(0, drop_path_rate, num_layers) if num_layers else []
        self.layers = torch.nn.ModuleList([
            _EncoderLayer(embed_dim, num_heads, ffn_dim, segment_lengths, dilation_rates,
                          dropout, float(drop_paths[i]), attention_dropout,
                          activation_dropout, activation_dtype, dtype)
            for i in range(num_layers)])
        self.layer_norm = torch.nn.LayerNorm(embed_dim, eps=1e-5, dtype=dtype)
        _randomize(self, seed)

    def forward(self, x, return_states=False):
        x = F.dropout(x, self.dropout, self.training)
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        out = self.layer_norm(x)
        return (out, states) if return_states else out


# --------------------------------------------------------------------- slide encoder


def segment_lengths_for(max_wsi_size: int, tile_size: int) -> list[int]:
    """Prov-GigaPath's segment lengths: ``2 ** linspace(10, int(log2(S)), 5)`` truncated,
    ``S = (max_wsi_size // tile_size) ** 2`` tiles."""
    seq_len = (max_wsi_size // tile_size) ** 2
    exponents = np.linspace(np.log2(1024), int(np.log2(seq_len)), 5)
    return [int(x) for x in np.power(2, exponents).astype(int)]


def _sincos(t, width):
    """``concat(sin(t * omega), cos(t * omega))``, width ``width``, in float64."""
    quarter = width // 2
    omega = 1.0 / 10000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    angle = t.to(torch.float64)[..., None] * omega
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)


def position_rows(coords, embed_dim, tile_size=256, grid_size=1000, dtype=torch.float32):
    """The position row of every tile, [..., D], from its level-0 pixel ``coords`` [..., 2].

    Cell index ``i = floor(x / tile) * G + floor(y / tile)``; row
    ``concat(E(i mod G), E(i div G))``, each ``E`` of width ``D / 2``. Computed in
    float64 and rounded to ``dtype`` (Prov-GigaPath's table is float32).
    """
    assert embed_dim % 4 == 0
    cell = torch.floor(coords / tile_size)
    index = (cell[..., 0] * grid_size + cell[..., 1]).long()
    half = embed_dim // 2
    rows = torch.cat([_sincos(index % grid_size, half), _sincos(index // grid_size, half)],
                     dim=-1)
    return rows.to(dtype)


class SlideEncoder(torch.nn.Module):
    """Prov-GigaPath's ``LongNetViT``: tile embeddings [B, N, F] and coords [B, N, 2]
    -> list of [B, D] (one per encoder state with ``all_layer_embed``).

    ``pos_dtype``: the rounding of the position rows before they are added
    (float32, as Prov-GigaPath's table); ``None`` keeps float64 / the model dtype.
    """

    def __init__(self, in_features, embed_dim, num_layers, num_heads, ffn_dim,
                 segment_lengths, dilation_rates, tile_size=256, grid_size=1000, *,
                 dropout=0.0, drop_path_rate=0.0, seed=0, dtype=torch.float64,
                 activation_dtype=None, pos_dtype=torch.float32):
        super().__init__()
        self.tile_size, self.grid_size, self.pos_dtype = tile_size, grid_size, pos_dtype
        self.cls_token = torch.nn.Parameter(torch.zeros((1, 1, embed_dim), dtype=dtype))
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = torch.nn.Linear(in_features, embed_dim, dtype=dtype)
        self.encoder = LongNetEncoder(embed_dim, num_layers, num_heads, ffn_dim,
                                      segment_lengths, dilation_rates, dropout=dropout,
                                      drop_path_rate=drop_path_rate, seed=seed,
                                      dtype=dtype, activation_dtype=activation_dtype)
        self.norm = torch.nn.LayerNorm(embed_dim, eps=1e-6, dtype=dtype)
        _randomize(self, seed)  # cls_token ~ N(0, 0.02^2), as the rules of _randomize say

    def forward(self, x, coords, all_layer_embed=False, global_pool=False):
        dtype = self.patch_embed.proj.weight.dtype
        rows = position_rows(coords, self.cls_token.shape[-1], self.tile_size, self.grid_size,
                             self.pos_dtype or torch.float64)
        tiles = self.patch_embed.proj(x) + rows.to(dtype)
        cls = self.cls_token.expand(x.shape[0], 1, -1)  # its position row is zeros
        z = torch.cat([cls, tiles], dim=1)
        if all_layer_embed:
            zs = self.encoder(z, return_states=True)[1]
        else:
            zs = [self.encoder(z)]
        if global_pool:
            return [self.norm(s[:, 1:].mean(dim=1)) for s in zs]
        return [self.norm(s)[:, 0] for s in zs]
