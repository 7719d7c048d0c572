"""Parity of ``jax_dilated.dilated_attention`` with the PyTorch references.

Every case draws random q, k, v, a random output cotangent ``g`` (so the
gradients are those of ``loss = sum(g * out)``) and, optionally, a padding mask,
feeds the same numbers to JAX and to the PyTorch reference of
``torch_reference`` (float64, on the inputs rounded to the JAX dtype), and
compares the output and the gradients of q, k and v.

Tolerances are relative to the largest magnitude of the reference:
float64 1e-10, float32 1e-5, bfloat16 2e-2 (docs/semantics.md, section 7: stats in float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_reference as ref
from _helpers import TOL, as_np, assert_close, rounded, to_jax, to_torch

import jax_dilated as jd


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of dilated attention.

    mask: "none"; "random" (each key kept with probability 0.7); "ragged"
      (right padding of a different length per batch row, so whole segments
      can be padded); "empty_row" (batch row 1 has no valid key at all, row 0
      random).
    block: kernel block size (block_q = block_k), None for the kernel default.
    """

    name: str
    segs: tuple
    rates: tuple
    T: int
    H: int = 4
    Hkv: int | None = None
    B: int = 2
    D: int = 8
    causal: bool = False
    mask: str = "none"
    scale: float | None = None
    mode: str = "longnet"
    offsets: str = "modulo"
    block: int | None = None
    seed: int = 0

    def __str__(self):
        return self.name


CASES = [
    # --- mode="longnet" ---
    Case("3br_T32", (4, 8, 16), (1, 2, 4), T=32),
    Case("3br_T37_H5_causal_blocked", (4, 8, 16), (1, 2, 4), T=37, H=5, causal=True,
         offsets="blocked"),
    Case("3br_T37_H5_emptyrow_scale", (4, 8, 16), (1, 2, 4), T=37, H=5, causal=True,
         mask="empty_row", scale=0.3, D=16),
    Case("6_12_T36_H5_causal", (6, 12), (2, 3), T=36, H=5, causal=True),
    Case("6_12_T40_gqa3_ragged_blocked", (6, 12), (2, 3), T=40, H=6, Hkv=3, mask="ragged",
         offsets="blocked"),
    Case("6_12_T41_gqa2_causal_random", (6, 12), (2, 3), T=41, H=6, Hkv=2, causal=True,
         mask="random"),
    Case("8r4_T24_gqa2_causal", (8,), (4,), T=24, H=6, Hkv=2, causal=True),
    Case("8r4_T29_H2_blocked_random", (8,), (4,), T=29, H=2, offsets="blocked",
         mask="random"),
    Case("64r2_T40_causal_ragged", (64,), (2,), T=40, H=3, causal=True, mask="ragged"),
    Case("16_64_T41_gqa2", (16, 64), (1, 4), T=41, H=4, Hkv=2, scale=0.5),
    Case("16r2_T16_causal_blocked", (16,), (2,), T=16, H=3, causal=True, offsets="blocked",
         B=1),
    Case("16r1_T40_causal_ragged", (16,), (1,), T=40, H=2, causal=True, mask="ragged"),
    Case("8_16_T26_H2", (8, 16), (1, 2), T=26, H=2),
    Case("8_16_T20_gqa2_causal_emptyrow", (8, 16), (1, 2), T=20, H=4, Hkv=2, causal=True,
         mask="empty_row"),
    Case("blk8_32_64_T64_gqa2_causal_ragged", (32, 64), (1, 2), T=64, H=4, Hkv=2,
         causal=True, mask="ragged", block=8),
    Case("blk8_32_64_T60_emptyrow_blocked", (32, 64), (1, 2), T=60, H=3, mask="empty_row",
         block=8, offsets="blocked"),
    Case("blk4_3br_T70_H5_causal_random", (16, 32, 64), (1, 2, 4), T=70, H=5, causal=True,
         mask="random", block=4, B=1),
    # --- mode="head_groups" ---
    Case("hg_3br_T32_H5_causal", (4, 8, 16), (1, 2, 4), T=32, H=5, causal=True,
         mode="head_groups"),
    Case("hg_3br_T37_emptyrow_scale", (4, 8, 16), (1, 2, 4), T=37, H=4, mode="head_groups",
         mask="empty_row", scale=0.25),
    Case("hg_6_12_T40_gqa2_causal_ragged", (6, 12), (2, 3), T=40, H=6, Hkv=2,
         mode="head_groups", mask="ragged", causal=True),
    Case("hg_8_64_T30_causal", (8, 64), (2, 4), T=30, H=4, mode="head_groups", causal=True),
    Case("hg_blk8_32_64_T64_mqa_causal_random", (32, 64), (1, 2), T=64, H=3, Hkv=1,
         mode="head_groups", block=8, causal=True, mask="random"),
]
BY_NAME = {c.name: c for c in CASES}

F32_CASES = ["3br_T37_H5_emptyrow_scale", "6_12_T40_gqa3_ragged_blocked",
             "64r2_T40_causal_ragged", "blk8_32_64_T64_gqa2_causal_ragged",
             "hg_3br_T37_emptyrow_scale"]
BF16_CASES = ["3br_T32", "6_12_T41_gqa2_causal_random", "blk8_32_64_T60_emptyrow_blocked",
              "hg_6_12_T40_gqa2_causal_ragged", "8_16_T26_H2",
              "8_16_T20_gqa2_causal_emptyrow"]


def make_inputs(case: Case):
    """Random float64 q, k, v, cotangent g and bool kv_mask (or None) for ``case``."""
    rng = np.random.default_rng(case.seed)
    hkv = case.Hkv or case.H
    q = rng.standard_normal((case.B, case.T, case.H, case.D))
    k = rng.standard_normal((case.B, case.T, hkv, case.D))
    v = rng.standard_normal((case.B, case.T, hkv, case.D))
    g = rng.standard_normal((case.B, case.T, case.H, case.D))
    if case.mask == "none":
        mask = None
    elif case.mask == "random":
        mask = rng.random((case.B, case.T)) < 0.7
    elif case.mask == "ragged":
        lengths = [case.T - 7, case.T // 2 + 1][:case.B]
        mask = np.arange(case.T)[None, :] < np.array(lengths)[:, None]
    elif case.mask == "empty_row":
        assert case.B == 2
        mask = rng.random((case.B, case.T)) < 0.7
        mask[1] = False
    else:
        raise ValueError(case.mask)
    return q, k, v, g, mask


def reference(case: Case, q, k, v, kv_mask):
    """The PyTorch reference output for ``case`` (torch tensors in, tensor out)."""
    common = dict(segment_lengths=case.segs, dilation_rates=case.rates,
                  is_causal=case.causal, scale=case.scale, kv_mask=kv_mask)
    if case.mode == "longnet":
        return ref.longnet_dilated_attention(q, k, v, head_offsets=case.offsets, **common)
    return ref.head_groups_dilated_attention(q, k, v, **common)


def reference_out_and_grads(case: Case, q, k, v, g, mask):
    """Reference output and (dq, dk, dv) of ``sum(g * out)``, all float64 numpy."""
    qt, kt, vt = (to_torch(x, requires_grad=True) for x in (q, k, v))
    out = reference(case, qt, kt, vt, None if mask is None else torch.tensor(mask))
    grads = torch.autograd.grad(out, (qt, kt, vt), grad_outputs=to_torch(g))
    return as_np(out), tuple(as_np(x) for x in grads)


def jax_kwargs(case: Case):
    return dict(segment_lengths=case.segs, dilation_rates=case.rates, mode=case.mode,
                head_offsets=case.offsets, is_causal=case.causal, scale=case.scale,
                block_q=case.block, block_k=case.block)


def jax_out_and_grads(case: Case, q, k, v, g, mask, *, jit=True, grads=True):
    """JAX output and the VJP of the cotangent ``g`` w.r.t. (q, k, v) (or ``()``)."""
    kw = jax_kwargs(case)

    def f(q, k, v, g, mask):
        if not grads:
            return jd.dilated_attention(q, k, v, kv_mask=mask, **kw), ()
        out, vjp = jax.vjp(lambda q, k, v: jd.dilated_attention(q, k, v, kv_mask=mask, **kw),
                           q, k, v)
        return out, vjp(g)

    if jit:
        f = jax.jit(f)
    return f(q, k, v, g, mask)


def check_parity(case: Case, dtype: str, *, jit=True, grads=True):
    """Compare output (and, with ``grads``, dq, dk, dv) of JAX and the reference."""
    q, k, v, g, mask = make_inputs(case)
    q, k, v, g = (rounded(x, dtype) for x in (q, k, v, g))
    ref_out, ref_grads = reference_out_and_grads(case, q, k, v, g, mask)
    jq, jk, jv, jg = (to_jax(x, dtype) for x in (q, k, v, g))
    out, grads = jax_out_and_grads(case, jq, jk, jv, jg,
                                   None if mask is None else jnp.asarray(mask), jit=jit,
                                   grads=grads)
    assert out.dtype == jq.dtype
    for x, name in zip((out, *grads), ("out", "dq", "dk", "dv")):
        assert np.all(np.isfinite(as_np(x))), f"{name} has non-finite entries"
    tol = TOL[dtype]
    assert_close(out, ref_out, tol, "out")
    for x, r, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert x.dtype == jq.dtype, name
        assert_close(x, r, tol, name)
    # positions no branch covers are exactly zero (not just small)
    uncovered = np.all(ref_out == 0, axis=-1)
    assert np.all(as_np(out)[uncovered] == 0)
    if case.mask == "empty_row":  # batch row 1 has no key: zero output, zero gradients
        assert np.all(as_np(out)[1] == 0)
        for x in grads:
            assert np.all(as_np(x)[1] == 0)
    return ref_out


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parity_float64(case):
    """Output and gradients match the float64 PyTorch reference to ~1e-10."""
    check_parity(case, "float64")


@pytest.mark.parametrize("name", F32_CASES)
def test_parity_float32(name):
    """float32 inputs: within 1e-5 (relative to max |ref|) of the float64 reference."""
    check_parity(BY_NAME[name], "float32")


@pytest.mark.parametrize("name", BF16_CASES)
def test_parity_bfloat16_forward(name):
    """bfloat16 output alone (no backward pass compiled)."""
    check_parity(BY_NAME[name], "bfloat16", grads=False)


@pytest.mark.parametrize("name", BF16_CASES)
def test_parity_bfloat16(name):
    """bfloat16 inputs: output and gradients within 2e-2 of the float64 reference on
    the rounded inputs."""
    check_parity(BY_NAME[name], "bfloat16")


def test_parity_eager():
    """The same numbers without ``jax.jit`` (op-by-op dispatch)."""
    check_parity(BY_NAME["8r4_T29_H2_blocked_random"], "float64", jit=False)


def test_cases_are_not_trivial():
    """Guard against a vacuous suite: references differ across modes/offsets/causality."""
    case = BY_NAME["6_12_T40_gqa3_ragged_blocked"]
    q, k, v, _, mask = make_inputs(case)
    qt, kt, vt = (to_torch(x) for x in (q, k, v))
    m = torch.tensor(mask)
    outs = [reference(dataclasses.replace(case, **kw), qt, kt, vt, m) for kw in
            ({}, {"offsets": "modulo"}, {"mode": "head_groups"}, {"causal": True})]
    for i in range(len(outs)):
        for j in range(i):
            assert (outs[i] - outs[j]).abs().max() > 1e-3


# --------------------------------------------------------------------------
# the references against each other
# --------------------------------------------------------------------------

REF_CHECK_CASES = ["3br_T37_H5_causal_blocked", "3br_T37_H5_emptyrow_scale",
                   "6_12_T40_gqa3_ragged_blocked", "6_12_T41_gqa2_causal_random",
                   "8r4_T29_H2_blocked_random", "64r2_T40_causal_ragged",
                   "16_64_T41_gqa2"]


@pytest.mark.parametrize("name", REF_CHECK_CASES)
def test_reference_segment_loops_match_dense_form(name):
    """longnet per-segment loops + Eq. 10 merge == dense attention with log m(p, t) bias."""
    case = BY_NAME[name]
    q, k, v, g, mask = make_inputs(case)
    kw = dict(segment_lengths=case.segs, dilation_rates=case.rates,
              head_offsets=case.offsets, is_causal=case.causal, scale=case.scale,
              kv_mask=None if mask is None else torch.tensor(mask))
    results = []
    for fn in (ref.longnet_dilated_attention, ref.longnet_dense_form):
        qt, kt, vt = (to_torch(x, requires_grad=True) for x in (q, k, v))
        out = fn(qt, kt, vt, **kw)
        grads = torch.autograd.grad(out, (qt, kt, vt), grad_outputs=to_torch(g))
        results.append((out, *grads))
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        assert_close(a, b, 1e-12, name)


def test_reference_head_groups_single_branch_is_longnet():
    """One branch of rate 1: head_groups (G = 1) and longnet are the same attention."""
    q, k, v, _, mask = make_inputs(BY_NAME["16r1_T40_causal_ragged"])
    qt, kt, vt = (to_torch(x) for x in (q, k, v))
    kw = dict(segment_lengths=(16,), dilation_rates=(1,), is_causal=True,
              kv_mask=torch.tensor(mask))
    assert_close(ref.head_groups_dilated_attention(qt, kt, vt, **kw),
                 ref.longnet_dilated_attention(qt, kt, vt, **kw), 1e-14)


def test_reference_dense_matches_torch_sdpa():
    """The dense reference agrees with torch's own scaled_dot_product_attention."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 12, 4, 8)) for _ in range(3))
    mask = rng.random((2, 12)) < 0.6
    mask[:, 0] = True  # every row keeps a key, so SDPA has no all-masked row
    qt, kt, vt = (to_torch(x) for x in (q, k, v))
    for causal in (False, True):
        allowed = torch.tensor(mask)[:, None, None, :]
        if causal:
            allowed = allowed & torch.ones(12, 12, dtype=torch.bool).tril()
        expected = torch.nn.functional.scaled_dot_product_attention(
            qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2),
            attn_mask=allowed, scale=0.4).transpose(1, 2)
        got = ref.dense_attention(qt, kt, vt, scale=0.4, is_causal=causal,
                                  kv_mask=torch.tensor(mask))
        assert_close(got, expected, 1e-12)
