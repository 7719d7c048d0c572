"""Exact gradients at extreme logits (docs/semantics.md, "Numerics").

With logits near 1e4, float32 spaces values 1e-3 apart, so a log-sum-exp stored
as one float32 is up to ~5e-4 off, and probabilities recomputed from it in the
backward (or mixing weights of a merge) are off by as much in relative terms. The
library carries the log-sum-exp as two floats (``lse`` and ``lse_lo``); these tests
check that every operation's float32 gradients at logits ~8e3 are as accurate as
a plain float32 softmax's, in the kernel, the streamed dilated path (both modes),
block-sparse attention, the ring (the XLA kernel's fused steps and the generic
steps) and distributed dilated attention.

The inputs are random small integers and the scale a power of two, so that every
logit is exactly representable in float32: the float64 PyTorch reference then sees
the very logits the float32 computation does, and what is measured is the
softmax's own rounding (a plain float32 ``jax.nn.softmax`` is ~1e-7 off here;
before the split the library's gradients were ~1e-4 off).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_reference as ref
from _helpers import assert_close, to_torch
from _mesh import build_mesh

import jax_dilated as jd

B, T, H, D = 1, 128, 4, 16
SCALE = 64.0  # |q.k| <= 16 * 16 = 256: logits up to 16384, integers, exact in float32
SEGS, RATES = (32, 64, 128), (1, 2, 4)
TOL = 1e-5  # the bound; the errors measured are ~1e-6


def _inputs(seed):
    rng = np.random.default_rng(seed)
    q, k = (rng.integers(-4, 5, (B, T, H, D)).astype(np.float64) for _ in range(2))
    v, g = (rng.standard_normal((B, T, H, D)) for _ in range(2))
    return q, k, v, g


def _jax_grads(fn, q, k, v, g):
    """Output and gradients of ``sum(g * fn(q, k, v))`` in float32."""
    q, k, v, g = (jnp.asarray(x, jnp.float32) for x in (q, k, v, g))
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(g))


def _torch_grads(fn, q, k, v, g):
    qt, kt, vt = (to_torch(x, requires_grad=True) for x in (q, k, v))
    o = fn(qt, kt, vt)
    return (o, *torch.autograd.grad(o, (qt, kt, vt), grad_outputs=to_torch(g)))


def _check(got, want):
    for a, b, name in zip(got, want, ("o", "dq", "dk", "dv")):
        assert_close(a, b, TOL, name)


def test_logits_are_extreme_and_exact():
    """The premise: logits reach ~1e4 and are integers (exact in float32)."""
    q, k, _, _ = _inputs(0)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
    assert np.abs(s).max() > 4000 and np.array_equal(s, np.round(s))


def _dense_ref(causal=False):
    return lambda q, k, v: ref.dense_attention(q, k, v, scale=SCALE, is_causal=causal)


SINGLE = {
    "kernel": (lambda q, k, v: jd.dilated_attention(
        q, k, v, segment_lengths=(T,), dilation_rates=(1,), scale=SCALE), _dense_ref()),
    "head_groups": (lambda q, k, v: jd.dilated_attention(
        q, k, v, segment_lengths=SEGS, dilation_rates=RATES, scale=SCALE, mode="head_groups",
        is_causal=True),
        lambda q, k, v: ref.head_groups_dilated_attention(
            q, k, v, segment_lengths=SEGS, dilation_rates=RATES, scale=SCALE, is_causal=True)),
    "longnet": (lambda q, k, v: jd.dilated_attention(
        q, k, v, segment_lengths=SEGS, dilation_rates=RATES, scale=SCALE, mode="longnet"),
        lambda q, k, v: ref.longnet_dilated_attention(
            q, k, v, segment_lengths=SEGS, dilation_rates=RATES, scale=SCALE)),
    "block_sparse": (lambda q, k, v: jd.block_sparse_attention(
        q, k, v, block_size=16, pattern=jd.block_patterns.LocalWindow(2), scale=SCALE),
        lambda q, k, v: ref.block_sparse_attention(
            q, k, v, jd.block_patterns.LocalWindow(2).to_mask(T // 16, T // 16), 16,
            scale=SCALE)),
}


@pytest.mark.parametrize("name", list(SINGLE))
def test_single_device_gradients_at_extreme_logits(name):
    fn, ref_fn = SINGLE[name]
    args = _inputs(1)
    _check(_jax_grads(fn, *args), _torch_grads(ref_fn, *args))


def test_plain_float32_softmax_is_the_bar():
    """What the tolerance is measured against: a plain float32 softmax, autodiffed,
    is well inside it on the same inputs."""
    def dense(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    args = _inputs(1)
    got = _jax_grads(dense, *args)
    want = _torch_grads(_dense_ref(), *args)
    for a, b, name in zip(got, want, ("o", "dq", "dk", "dv")):
        assert_close(a, b, TOL / 10, name)


MESH_CASES = {
    # n = 32 per device: whole default blocks, the XLA kernel's fused ring steps
    "ring_fused_causal": (dict(is_causal=True), _dense_ref(True)),
    # blocks of 24 do not tile 32: the generic steps (kernel forward/backward + merge)
    "ring_generic": (dict(block_q=24, block_k=24), _dense_ref()),
}


@pytest.mark.parametrize("name", list(MESH_CASES))
def test_ring_gradients_at_extreme_logits(name):
    kw, ref_fn = MESH_CASES[name]
    mesh = build_mesh((4,), ("seq",), "auto")
    fn = jd.sharded(functools.partial(jd.ring_attention, scale=SCALE, **kw), mesh,
                    seq_axis="seq")
    args = _inputs(2)
    _check(_jax_grads(fn, *args), _torch_grads(ref_fn, *args))


def test_distributed_dilated_gradients_at_extreme_logits():
    """Segments of 32 local to a device, 64 and 128 spanning 2 and 4 devices (rings)."""
    mesh = build_mesh((4,), ("seq",), "auto")
    fn = jd.sharded(functools.partial(jd.dilated_attention, segment_lengths=SEGS,
                                      dilation_rates=RATES, scale=SCALE), mesh, seq_axis="seq")
    args = _inputs(3)
    _check(_jax_grads(fn, *args), _torch_grads(
        lambda q, k, v: ref.longnet_dilated_attention(
            q, k, v, segment_lengths=SEGS, dilation_rates=RATES, scale=SCALE), *args))
