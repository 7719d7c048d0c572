"""The torchscale / Prov-GigaPath PyTorch reference (tests/torch_reference/torchscale.py).

Checked without the upstream code (CI has none): the per-slot reference of
torchscale's dilated attention against an independent dense statement of the same
function, written from the output position's side:

* output position ``P`` of head ``j`` in a branch ``(w, r)`` (``w = min(sl, L)``,
  ``c = ceil(w / r)``, ``m = c * r``, offset ``o = j // ceil(H / r)``) is covered
  iff ``(P mod m) mod r == o``; it then carries slot ``l = (P mod m) // r`` of
  segment ``s = P // m``;
* that slot's query is position ``s*w + l*r + o`` if that is a real position of the
  segment, else a zero vector; its keys are the real positions ``t`` of segment
  ``s`` with ``(t - s*w) mod r == o`` (causal: up to that slot), plus ``Z`` zero
  keys (logit 0, value 0) for the padded slots it sees;
* so ``lse = log(sum_t exp(scale q.k_t) + Z)`` and ``out = sum_t exp(.) v_t / exp(lse)``
  over a [L, L] logit matrix, with the zero keys as one extra column of logit
  ``log Z``.

Plus two small cases worked by hand and Prov-GigaPath's segment lengths. The
reference itself was checked against upstream torchscale / Prov-GigaPath (on CPU,
with a float64 dense stand-in for flash attention) to ~1e-14 outside the suite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_reference import torchscale as ts  # noqa: E402

NOT_COVERED = -1e8


# ------------------------------------------------------------ independent dense form


def _branch_maps(seq_len, num_heads, segment_length, rate, is_causal):
    """Per head: query source [L] (-1 uncovered, L zero query), allowed keys [L, L], Z [L]."""
    w = min(segment_length, seq_len)
    c = -(-w // rate)
    m = c * rate
    block = -(-num_heads // rate)
    sources = np.full((num_heads, seq_len), -1)
    allowed = np.zeros((num_heads, seq_len, seq_len), dtype=bool)
    zero_keys = np.zeros((num_heads, seq_len))
    for j in range(num_heads):
        o = j // block
        for p in range(seq_len):
            s, u = divmod(p, m)
            if u % rate != o:
                continue  # not covered by this head in this branch
            slot = u // rate
            start, stop = s * w, min(s * w + w, seq_len)
            keys = [t for t in range(start, stop) if (t - start) % rate == o]
            query = start + slot * rate + o
            sources[j, p] = query if query in keys else seq_len
            seen = slot + 1 if is_causal else c  # slots this query sees
            visible = [t for t in keys if not is_causal or t <= start + slot * rate + o]
            allowed[j, p, visible] = True
            zero_keys[j, p] = seen - len(visible)
    return sources, allowed, zero_keys


def dense_dilated_attention(q, k, v, segment_lengths, dilation_rates, is_causal=False):
    b, seq_len, num_heads, d = q.shape
    scale = d ** -0.5
    q_ext = torch.cat([q, q.new_zeros((b, 1, num_heads, d))], dim=1)  # row L: zero query
    heads = torch.arange(num_heads)[:, None]
    outs, lses = [], []
    for sl, r in zip(segment_lengths, dilation_rates):
        sources, allowed, zero_keys = _branch_maps(seq_len, num_heads, sl, r, is_causal)
        covered = torch.as_tensor(sources >= 0)[None]  # [1, H, L]
        src = torch.as_tensor(np.where(sources >= 0, sources, seq_len))  # [H, L]
        queries = q_ext[:, src, heads]  # [B, H, L, d]: the query each output position carries
        logits = scale * queries @ k.permute(0, 2, 3, 1)  # [B, H, L, L]
        logits = logits.masked_fill(~torch.as_tensor(allowed), -math.inf)
        with np.errstate(divide="ignore"):
            zero_col = torch.as_tensor(np.log(zero_keys), dtype=q.dtype)  # log Z, [H, L]
        scores = torch.cat([logits, zero_col.expand(b, -1, -1)[..., None]], dim=-1)
        # An uncovered row has no key at all: zeros there keep its (unused) gradient finite.
        scores = torch.where(covered[..., None], scores, torch.zeros_like(scores))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, L]
        probs = torch.exp(scores[..., :seq_len] - lse[..., None])
        out = probs @ v.permute(0, 2, 1, 3)  # [B, H, L, d]; the zero keys add nothing
        out = torch.where(covered[..., None], out, torch.zeros_like(out))
        lse = torch.where(covered & (lse != 0), lse, torch.full_like(lse, NOT_COVERED))
        outs.append(out.transpose(1, 2))
        lses.append(lse.transpose(1, 2))
    with torch.no_grad():
        lse = torch.stack(lses)
        weights = torch.exp(lse - lse.amax(dim=0))
        weights = weights / weights.sum(dim=0)
    return sum(wt[..., None] * o for wt, o in zip(weights, outs))


CASES = [
    # (B, L, H, d, segment_lengths, dilation_rates): shifts where n >= 2 and w % r != 0
    (2, 23, 3, 4, (4, 6, 7), (1, 2, 4)),
    (1, 37, 4, 3, (5, 8, 16, 64), (2, 3, 4, 8)),
    (2, 9, 4, 3, (2, 4), (4, 1)),         # zero queries with one key: lse exactly 0
    (1, 11, 2, 2, (3, 16), (5, 4)),       # H < r and r > w
    (1, 30, 16, 2, (7, 12, 30), (1, 16, 4)),
]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[1]}-H{c[2]}-{c[4]}-{c[5]}")
def test_reference_matches_dense_form(case, is_causal):
    b, seq_len, num_heads, d, segs, rates = case
    gen = torch.Generator().manual_seed(seq_len * 31 + num_heads)
    q, k, v, cot = (torch.randn(b, seq_len, num_heads, d, generator=gen, dtype=torch.float64)
                    for _ in range(4))
    ins_ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ins_dense = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = ts.dilated_attention(*ins_ref, segs, rates, is_causal=is_causal)
    out_dense = dense_dilated_attention(*ins_dense, segs, rates, is_causal=is_causal)
    torch.testing.assert_close(out_ref, out_dense, rtol=0, atol=1e-12)
    grads_ref = torch.autograd.grad((out_ref * cot).sum(), ins_ref)
    grads_dense = torch.autograd.grad((out_dense * cot).sum(), ins_dense)
    for g_ref, g_dense in zip(grads_ref, grads_dense):
        torch.testing.assert_close(g_ref, g_dense, rtol=0, atol=1e-12)


def test_float32_close_to_float64():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    args = ((4, 6, 7), (1, 2, 4))
    out64 = ts.dilated_attention(q, k, v, *args)
    out32 = ts.dilated_attention(q.float(), k.float(), v.float(), *args)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out64, rtol=0, atol=1e-5)


# --------------------------------------------------------------------- worked by hand


def _attend(qv, keys, values, zero_keys=0):
    logits = torch.stack([qv @ kv for kv in keys]) / math.sqrt(qv.shape[-1])
    weights = torch.exp(logits)
    total = weights.sum() + zero_keys
    return sum(wt * vv for wt, vv in zip(weights, values)) / total, torch.log(total)


def test_shifted_outputs_by_hand():
    """L=7, one branch w=3, r=2, one head: c=2 slots, m=4.

    Segment 0 holds positions (0, 2) -> outputs at 0, 2; segment 1 holds (3, 5) ->
    outputs at 4, 6; segment 2 holds (6, zero) -> outputs at 8, 10: dropped. So
    position 6 carries query 5's result, and 1, 3, 5 are not covered (0).
    """
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 7, 1, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    out = ts.dilated_attention(q, k, v, [3], [2])[0, :, 0]
    q, k, v = q[0, :, 0], k[0, :, 0], v[0, :, 0]
    torch.testing.assert_close(out[0], _attend(q[0], k[[0, 2]], v[[0, 2]])[0])
    torch.testing.assert_close(out[2], _attend(q[2], k[[0, 2]], v[[0, 2]])[0])
    torch.testing.assert_close(out[4], _attend(q[3], k[[3, 5]], v[[3, 5]])[0])
    torch.testing.assert_close(out[6], _attend(q[5], k[[3, 5]], v[[3, 5]])[0])
    assert torch.all(out[[1, 3, 5]] == 0)


def test_padded_key_in_denominator_by_hand():
    """L=4, one branch w=4, r=3, two heads (offsets 0 and 1): c=2 slots.

    Head 1's slots are position 1 and a zero slot (1 + 3 >= 4): query 1 sees key 1
    and one zero key. Head 0 holds positions (0, 3). Two branches (the same one
    twice) weigh 1/2 each, which leaves each branch's output unchanged.
    """
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 2, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    out = ts.dilated_attention(q, k, v, [4, 4], [3, 3])[0]
    q, k, v = q[0], k[0], v[0]
    torch.testing.assert_close(out[1, 1], _attend(q[1, 1], k[[1], 1], v[[1], 1], 1)[0])
    torch.testing.assert_close(out[3, 0], _attend(q[3, 0], k[[0, 3], 0], v[[0, 3], 0])[0])
    # head 1, position 4 would be the zero query: dropped; positions 0, 2, 3 uncovered
    assert torch.all(out[[0, 2, 3], 1] == 0) and torch.all(out[[1, 2], 0] == 0)
    _, lse = ts.branch_attention(q[None], k[None], v[None], segment_length=4, rate=3)
    torch.testing.assert_close(lse[0, 1, 1], _attend(q[1, 1], k[[1], 1], v[[1], 1], 1)[1])
    assert lse[0, 0, 1] == NOT_COVERED


# ------------------------------------------------------------------ Prov-GigaPath bits


@pytest.mark.parametrize("size, tile, expected", [
    (262144, 256, [1024, 5792, 32768, 185363, 1048576]),
    (11776, 256, [1024, 1217, 1448, 1722, 2048]),
])
def test_segment_lengths_for(size, tile, expected):
    assert ts.segment_lengths_for(size, tile) == expected


def test_position_rows_match_sincos_table():
    """Rows equal those of the G*G table ``concat(E(col), E(row))`` of a small grid."""
    embed_dim, grid, tile = 8, 5, 16
    quarter = embed_dim // 4
    omega = 1.0 / 10000 ** (np.arange(quarter, dtype=np.float64) / quarter)

    def e(t):
        return np.concatenate([np.sin(t * omega), np.cos(t * omega)])

    table = np.stack([np.concatenate([e(i % grid), e(i // grid)]) for i in range(grid * grid)])
    coords = torch.tensor([[0.0, 0.0], [15.9, 16.0], [33.0, 70.5], [79.0, 2.0]],
                          dtype=torch.float64)
    cells = [(0, 0), (0, 1), (2, 4), (4, 0)]
    rows = ts.position_rows(coords, embed_dim, tile, grid, dtype=torch.float32)
    expected = np.stack([table[x * grid + y] for x, y in cells]).astype(np.float32)
    np.testing.assert_array_equal(rows.numpy(), expected)


def test_state_dict_keys_and_shapes():
    enc = ts.LongNetEncoder(8, 2, 2, 12, [4, 8], [1, 2])
    per_layer = ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj",
                 "self_attn.out_proj", "self_attn.inner_attn_ln", "self_attn_layer_norm",
                 "ffn.fc1", "ffn.fc2", "ffn.ffn_layernorm", "final_layer_norm"]
    keys = {f"layers.{i}.{name}.{p}" for i in range(2) for name in per_layer
            for p in ("weight", "bias")} | {"layer_norm.weight", "layer_norm.bias"}
    assert set(enc.state_dict()) == keys
    slide = ts.SlideEncoder(6, 8, 2, 2, 12, [4, 8], [1, 2], tile_size=16, grid_size=5)
    sd = slide.state_dict()
    assert set(sd) == ({f"encoder.{key}" for key in keys}
                       | {"cls_token", "patch_embed.proj.weight", "patch_embed.proj.bias",
                          "norm.weight", "norm.bias"})
    assert sd["cls_token"].shape == (1, 1, 8) and sd["patch_embed.proj.weight"].shape == (8, 6)
    assert sd["encoder.layers.0.ffn.fc1.weight"].shape == (12, 8)
    # random LayerNorms: a swapped name would show
    assert not torch.allclose(sd["norm.weight"], torch.ones_like(sd["norm.weight"]))
    assert sd["encoder.layer_norm.bias"].abs().min() > 0


def test_slide_encoder_outputs():
    slide = ts.SlideEncoder(6, 8, 2, 2, 12, [4, 8], [1, 2], tile_size=16, grid_size=5).eval()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 6, generator=gen, dtype=torch.float64)
    coords = torch.rand(2, 9, 2, generator=gen, dtype=torch.float64) * 79
    (cls,) = slide(x, coords)
    layers = slide(x, coords, all_layer_embed=True)
    pooled = slide(x, coords, global_pool=True)
    assert cls.shape == (2, 8) and len(layers) == 3 and len(pooled) == 1
    z = torch.cat([slide.cls_token.expand(2, 1, 8),
                   slide.patch_embed.proj(x) + ts.position_rows(coords, 8, 16, 5).double()], 1)
    out, states = slide.encoder(z, return_states=True)
    torch.testing.assert_close(cls, slide.norm(out)[:, 0])
    torch.testing.assert_close(layers[0], slide.norm(z)[:, 0])
    torch.testing.assert_close(layers[2], slide.norm(states[2])[:, 0])
    torch.testing.assert_close(pooled[0], slide.norm(out[:, 1:].mean(dim=1)))
