"""Any positive segment length with any positive dilation rate (docs/semantics.md,
section 2): a segment of ``w`` tokens selects ``ceil((w - o) / r)`` of them at offset
``o``, however ``r`` and ``w`` relate.

Parity against the float64 PyTorch reference (``torch_reference.dilated``, which
selects positions by ``(p mod w) mod r == o`` with no divisibility assumed): output
and the gradients of q, k, v through a random cotangent, float64 at 1e-10 and
float32 at 1e-5 (the kernel the CPU selects: the native one where it builds),
both modes, both head-offset rules, causal or not, GQA, padding masks. Then the
paths that lean on the segment grid: packed rows, sliding windows beside such
branches, decoding, sharded sequences, the layers and ``LongNetConfig``; among the
configurations, Prov-GigaPath's (segment lengths ``2 ** linspace(10, 20, 5)``, rounded
down, at rates 1..16: 185363 is not a multiple of 8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import build_mesh
from jax.sharding import PartitionSpec as P

import jax_dilated as jd
from jax_dilated.ops import decode

from _helpers import TOL, assert_close, output_and_grads


# the PyTorch reference on one thread while this module runs (conftest.py says why)
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


GIGAPATH = dict(segment_lengths=(1024, 5792, 32768, 185363, 1048576),
                dilation_rates=(1, 2, 4, 8, 16))

# (segment lengths, rates, T): the non-dividing segments shorter than the sequence
# (several segments, a ragged last one), one that is exactly the sequence, rates
# larger than the segment
CONFIGS = {
    "12r5-20r3": ((12, 20), (5, 3), 40),
    "7r3-ragged": ((7, 30), (3, 4), 31),
    "6r4-10r3-25r7": ((6, 10, 25), (4, 3, 7), 57),
    "3r5-exact": ((3, 16), (5, 6), 16),
}


# The native CPU kernel serves head_dim a multiple of 16 only (backends/selection.py,
# native_call_reason); the float32 cases use it, so that the CPU's default call runs
# the native kernel where it builds (at head_dim 8 it would run the XLA kernel).
NATIVE_HEAD_DIM = 16


def _inputs(t, h, hkv, seed, dtype=np.float64, head_dim=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, t, h, head_dim))
    k, v = (rng.standard_normal((2, t, hkv, head_dim)) for _ in range(2))
    g = rng.standard_normal((2, t, h, head_dim))
    mask = rng.random((2, t)) < 0.85
    return [x.astype(dtype) for x in (q, k, v, g)] + [mask]


def _torch(q, k, v, g, mask, *, segment_lengths, dilation_rates, mode, head_offsets,
           is_causal):
    torch = pytest.importorskip("torch")
    from torch_reference import dilated as ref

    from _helpers import as_np, to_torch

    tq, tk, tv = (to_torch(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v))
    branches = [("window", *w.resolve(is_causal)) if isinstance(w, jd.SlidingWindow)
                else ("segment", w, r) for w, r in zip(segment_lengths, dilation_rates)]
    out = ref.dilated_attention_full(tq, tk, tv, branches=branches, mode=mode,
                                     head_offsets=head_offsets, is_causal=is_causal,
                                     kv_mask=torch.as_tensor(mask))
    (to_torch(g) * out).sum().backward()
    return [as_np(out)] + [as_np(x.grad) for x in (tq, tk, tv)]


# float32 (the native kernel: small programs) runs every configuration, mode and offset
# rule (causal with "modulo", not with "blocked"); float64 (the XLA kernel: ~10x the CPU
# time, 0.45 s a case) runs every configuration with both modes and both rules too,
# paired one way on two configurations and the other way on the other two: each mode
# with each rule on two configurations
PARITY = [(name, mode, offsets, causal, dtype)
          for i, name in enumerate(CONFIGS) for j, mode in enumerate(("longnet", "head_groups"))
          for k, (offsets, causal) in enumerate((("modulo", True), ("blocked", False)))
          for dtype in ("float64", "float32") if dtype == "float32" or (i + j + k) % 2 == 0]


def _parity_inputs(name):
    """The inputs of a configuration's parity cases, float32 values (exact in float64 too),
    so that its float64 and float32 cases share one reference."""
    ws, rs, t = CONFIGS[name]
    *qkvg, mask = _inputs(t, 6, 3, seed=len(name), dtype=np.float32, head_dim=NATIVE_HEAD_DIM)
    return qkvg + [mask], dict(segment_lengths=ws, dilation_rates=rs)


_REFERENCE = {}  # (name, mode, offsets, causal) -> the float64 reference, for both dtypes
_DEFAULT_F32 = {}  # the same key -> output and gradients of the default kernel in float32


def _default_float32(name, mode, offsets, causal):
    """``output_and_grads`` of a float32 parity case on the default kernel (computed once:
    test_xla_kernel_agrees_with_the_default compares the XLA kernel with it)."""
    key = (name, mode, offsets, causal)
    if key not in _DEFAULT_F32:
        (q, k, v, g, mask), kw = _parity_inputs(name)
        kw = dict(kw, mode=mode, head_offsets=offsets, is_causal=causal)
        _DEFAULT_F32[key] = output_and_grads(
            lambda q, k, v: jd.dilated_attention(q, k, v, kv_mask=mask, **kw), q, k, v, g)
    return _DEFAULT_F32[key]


@pytest.mark.parametrize("name,mode,offsets,causal,dtype", PARITY,
                         ids=["-".join(map(str, c)) for c in PARITY])
def test_parity_with_torch(name, mode, offsets, causal, dtype):
    (q, k, v, g, mask), kw = _parity_inputs(name)
    kw = dict(kw, mode=mode, head_offsets=offsets, is_causal=causal)
    if dtype == "float32":
        got = _default_float32(name, mode, offsets, causal)
    else:
        q, k, v, g = (x.astype(np.float64) for x in (q, k, v, g))
        got = output_and_grads(
            lambda q, k, v: jd.dilated_attention(q, k, v, kv_mask=mask, **kw), q, k, v, g)
    key = (name, mode, offsets, causal)
    if key not in _REFERENCE:
        _REFERENCE[key] = _torch(q, k, v, g, mask, **kw)
    for what, a, w in zip(("out", "dq", "dk", "dv"), got, _REFERENCE[key]):
        assert_close(a, w, TOL[dtype], what)


@pytest.mark.parametrize("t", [1100, 1500])
def test_gigapath_configuration(t):
    """Prov-GigaPath's branches on sequences shorter than all but its first segment:
    accepted, and equal to the reference (float32, the CPU's kernel)."""
    q, k, v, g, mask = (x[:1] for x in _inputs(t, 4, 4, seed=t, dtype=np.float32,
                                                head_dim=NATIVE_HEAD_DIM))
    kw = dict(GIGAPATH, mode="longnet", head_offsets="modulo", is_causal=True)
    got = output_and_grads(lambda q, k, v: jd.dilated_attention(q, k, v, kv_mask=mask, **kw),
                           q, k, v, g)
    want = _torch(q, k, v, g, mask, **kw)
    for what, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, w, TOL["float32"], what)


def test_gigapath_in_the_layers_and_config():
    cfg = jd.models.LongNetConfig(vocab_size=11, embed_dim=20, num_layers=1, num_heads=5,
                                  **GIGAPATH)
    assert cfg.segment_lengths[3] % cfg.dilation_rates[3] == 3
    from flax import nnx

    model = jd.models.LongNetLM(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 11, (1, 1030))
    assert np.isfinite(np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))).all()


def _alone(q, k, v, g, mask, ids, **kw):
    """Output and gradients of every document run alone, by the float64 reference
    (in JAX each document length would trace and compile the operation once more)."""
    want = [np.zeros(x.shape) for x in (q, q, k, v)]  # out, dq, dk, dv
    for b in range(ids.shape[0]):
        cut = np.flatnonzero(np.diff(ids[b])) + 1
        for s, e in zip([0, *cut], [*cut, ids.shape[1]]):
            doc = [x[b:b + 1, s:e] for x in (q, k, v, g, mask)]
            for w, x in zip(want, _torch(*doc, mode="longnet", head_offsets="modulo", **kw)):
                w[b:b + 1, s:e] = x
    return want


_WINDOW_BESIDE_ALONE = []  # the documents alone: the same for both cases, computed once


@pytest.mark.parametrize("max_documents", [None, 4])
def test_packed_rows_with_a_window_beside(max_documents):
    """Packed rows (the bounded streams, the compact streams) with a sliding-window
    branch beside non-dividing ones equal the documents run alone (the reference's)."""
    kw = dict(segment_lengths=(jd.SlidingWindow(6), 12, 20), dilation_rates=(1, 5, 3),
              is_causal=True)
    q, k, v, g, mask = _inputs(40, 4, 2, seed=11)
    ids = np.array([[1] * 7 + [2] * 21 + [3] * 12, [4] * 25 + [1] * 15], np.int32)
    got = output_and_grads(lambda q, k, v: jd.dilated_attention(
        q, k, v, kv_mask=mask, segment_ids=ids, max_documents=max_documents, **kw), q, k, v, g)
    if not _WINDOW_BESIDE_ALONE:
        _WINDOW_BESIDE_ALONE.append(_alone(q, k, v, g, mask, ids, **kw))
    want = _WINDOW_BESIDE_ALONE[0]
    for what, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, w, TOL["float64"], what)


def test_decode_matches_causal_forward():
    kw = dict(segment_lengths=(12, 20), dilation_rates=(5, 3))
    q, k, v, *_ = _inputs(40, 4, 2, seed=12)
    cache = decode.init_kv_cache(2, 48, 2, 8, q.dtype)

    def step(cache, x):
        out, cache = decode.decode_step(cache, *(a[:, None] for a in x), **kw)
        return cache, out[:, 0]

    _, out = jax.jit(lambda cache, xs: jax.lax.scan(step, cache, xs))(
        cache, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v)))
    full = jax.jit(lambda q, k, v: jd.dilated_attention(q, k, v, is_causal=True, **kw))(
        q, k, v)
    assert_close(jnp.moveaxis(out, 0, 1), full, 1e-12, "decode")


def test_sharded_sequence_equals_one_device():
    """A non-dividing branch whose segments sit on the shards (12 | 24), one spanning
    the two devices, over ``seq_axis``: output and gradients equal one device's, that
    is the float64 reference (which one device matches at 1e-10, test_parity_with_torch;
    the reference compiles nothing)."""
    kw = dict(segment_lengths=(12, 48), dilation_rates=(5, 2), is_causal=True)
    q, k, v, g, mask = _inputs(48, 4, 2, seed=13)
    mesh = build_mesh((2,), ("seq",), "auto")
    spec = P(None, "seq")
    dist = jax.shard_map(lambda q, k, v, m: jd.dilated_attention(q, k, v, kv_mask=m,
                                                                  seq_axis="seq", **kw),
                         mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    got = output_and_grads(lambda q, k, v: dist(q, k, v, mask), q, k, v, g)
    want = _torch(q, k, v, g, mask, mode="longnet", head_offsets="modulo", **kw)
    for what, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, w, TOL["float64"], what)


def test_xla_kernel_agrees_with_the_default():
    """float32 on the XLA kernel (the native kernel serves the default call on CPU
    where it builds, checked here): the same numbers at 1e-5, on the inputs of a float32
    parity case whose default-kernel result is reused (computed here when that case did
    not run)."""
    from jax_dilated.backends import native

    name, mode, offsets, causal = "6r4-10r3-25r7", "longnet", "modulo", True
    (q, k, v, g, mask), kw = _parity_inputs(name)
    kw = dict(kw, mode=mode, head_offsets=offsets, is_causal=causal)
    if jax.default_backend() == "cpu" and native.unavailable_reason() is None:
        call = f"@{native.build.target(native.build.TARGET_DILATED)}("
        default = jax.jit(lambda q, k, v: jd.dilated_attention(q, k, v, kv_mask=mask, **kw))
        assert call in default.lower(q, k, v).as_text()
    a = _default_float32(name, mode, offsets, causal)
    b = output_and_grads(lambda q, k, v: jd.dilated_attention(q, k, v, kv_mask=mask,
                                                              implementation="xla", **kw),
                         q, k, v, g)
    for what, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        assert_close(x, y, TOL["float32"], what)
