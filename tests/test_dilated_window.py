"""Dilated attention with sliding-window branches, soft-capping and sinks (issue 18,
phase 2; docs/semantics.md, section 2, "Sliding-window branches, soft-capping and
sinks").

A ``jd.SlidingWindow(left, right)`` entry of ``segment_lengths`` (rate 1) makes a branch
whose heads attend to the keys ``p - left <= t <= p + right`` of the whole sequence;
``logit_soft_cap`` caps every branch's logits; ``sinks`` join the combined denominator
once (longnet) or each head's own branch softmax (head_groups).

Parity cases compare the output and the gradients of q, k, v and sinks through a
random cotangent with the float64 PyTorch reference
(``torch_reference.dilated.dilated_attention_full``, dense masks written from the
math) at the tolerances of ``_helpers.TOL``. Packed rows are compared with the
documents alone and the sharded sequence (2 devices) with one device's numbers (both
through the reference, which the one-device parity cases match), decoding with the
one-device forward. Shapes are tiny (T <= 32) so the whole module stays cheap.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import build_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dilated as jd
from jax_dilated.ops import decode as decode_ops

torch = pytest.importorskip("torch")  # the reference; without it the module skips

from _helpers import (  # noqa: E402
    TOL, XLA_CPU_MEMORY, as_np, assert_close, rounded, to_jax, to_torch)
from torch_reference.dilated import dilated_attention_full  # noqa: E402


# the PyTorch reference on one thread while this module runs (conftest.py says why)
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


B, H, D = 2, 4, 8
SCALE = 0.5
SEGMENTS = (jd.SlidingWindow(3), 8, 16)
RATES = (1, 2, 4)


def make_inputs(seed, t, hkv, big=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, H, D)) * big
    k = rng.standard_normal((B, t, hkv, D))
    v = rng.standard_normal((B, t, hkv, D))
    g = rng.standard_normal((B, t, H, D))
    sinks = rng.standard_normal(H)
    return q, k, v, g, sinks


def torch_branches(segments, rates, is_causal):
    out = []
    for w, r in zip(segments, rates):
        if isinstance(w, jd.SlidingWindow):
            out.append(("window", *w.resolve(is_causal)))
        else:
            out.append(("segment", w, r))
    return out


def reference(q, k, v, g, sinks, *, segments=SEGMENTS, rates=RATES, is_causal=False,
              kv_mask=None, **kw):
    """float64 output and d/d(q, k, v, sinks) of sum(g * out), PyTorch."""
    tq, tk, tv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    ts = None if sinks is None else to_torch(sinks, requires_grad=True)
    out = dilated_attention_full(
        tq, tk, tv, branches=torch_branches(segments, rates, is_causal), scale=SCALE,
        is_causal=is_causal, sinks=ts,
        kv_mask=None if kv_mask is None else torch.as_tensor(kv_mask), **kw)
    (to_torch(g) * out).sum().backward()
    leaves = (tq, tk, tv) if ts is None else (tq, tk, tv, ts)
    return as_np(out), tuple(as_np(x.grad) for x in leaves)


def ours(q, k, v, g, sinks, dtype="float64", segments=SEGMENTS, rates=RATES, **kw):
    """Our output and d/d(q, k, v, sinks) of sum(g * out), jitted."""
    def loss(q, k, v, s):
        out = jd.dilated_attention(q, k, v, segment_lengths=segments, dilation_rates=rates,
                                   scale=SCALE, sinks=s, **kw)
        return jnp.sum(out.astype(jnp.float64) * g), out

    args = [to_jax(x, dtype) for x in (q, k, v)] + [None if sinks is None
                                                    else jnp.asarray(sinks)]
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*args)
    return out, grads


CASES = [  # mode, is_causal, kv heads, kv_mask, soft-cap
    ("longnet", False, 2, True, None),
    ("longnet", True, 4, False, 1.5),
    ("head_groups", False, 2, True, 1.5),
    ("head_groups", True, 1, False, None),
]


@pytest.mark.parametrize("mode,is_causal,hkv,masked,cap", CASES)
def test_parity_float64(mode, is_causal, hkv, masked, cap):
    """A window branch mixed with dilated branches (T = 24: short last segments),
    sinks, GQA, kv_mask, soft-cap: output and every gradient, float64."""
    q, k, v, g, sinks = make_inputs(0, 24, hkv)
    mask = None
    if masked:
        mask = np.random.default_rng(1).random((B, 24)) > 0.3
    kw = dict(mode=mode, is_causal=is_causal, kv_mask=mask, logit_soft_cap=cap)
    out, grads = ours(q, k, v, g, sinks, **kw)
    want, want_grads = reference(q, k, v, g, sinks, **kw)
    assert_close(out, want, TOL["float64"], "out")
    for name, a, e in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert_close(a, e, TOL["float64"], name)


def test_windows_only_and_no_sinks():
    """Two window branches (asymmetric and symmetric) in head_groups, no sinks; and
    a longnet call whose only branch is a window equals the windowed kernel."""
    q, k, v, g, _ = make_inputs(2, 20, 2)
    segs, rates = (jd.SlidingWindow(2, 5), jd.SlidingWindow(4)), (1, 1)
    out, grads = ours(q, k, v, g, None, segments=segs, rates=rates, mode="head_groups")
    want, want_grads = reference(q, k, v, g, None, segments=segs, rates=rates,
                                 mode="head_groups")
    assert_close(out, want, TOL["float64"], "out")
    for name, a, e in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close(a, e, TOL["float64"], name)
    # both calls in one jitted program (op by op, each of their operations compiles alone)
    alone, want = jax.jit(lambda q, k, v: (
        jd.dilated_attention(q, k, v, segment_lengths=(jd.SlidingWindow(3, 1),),
                             dilation_rates=(1,), scale=SCALE),
        jd.block_sparse_attention(q, k, v, block_size=20, pattern=np.ones((1, 1), bool),
                                  window=(3, 1), scale=SCALE)))(q, k, v)
    assert_close(alone, want, TOL["float64"], "window only")


def test_soft_cap_large_logits():
    """Logits ~ +-100 capped at 4: finite, equal to the reference (no overflow)."""
    q, k, v, g, sinks = make_inputs(3, 24, 2, big=40.0)
    kw = dict(is_causal=True, logit_soft_cap=4.0)
    out, grads = ours(q, k, v, g, sinks, **kw)
    want, want_grads = reference(q, k, v, g, sinks, **kw)
    assert np.all(np.isfinite(as_np(out)))
    assert_close(out, want, TOL["float64"], "out")
    for name, a, e in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert_close(a, e, TOL["float64"], name)


@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_sinks_fully_masked_rows(mode):
    """Rows with no key (one batch row fully masked) output zeros with lse = sink, and
    every gradient (d sinks included) is finite and matches the reference."""
    q, k, v, g, sinks = make_inputs(4, 16, 2)
    mask = np.ones((B, 16), bool)
    mask[1] = False
    kw = dict(mode=mode, kv_mask=mask)
    out, grads = ours(q, k, v, g, sinks, **kw)
    want, want_grads = reference(q, k, v, g, sinks, **kw)
    assert np.all(as_np(out)[1] == 0)
    assert_close(out, want, TOL["float64"], "out")
    for name, a, e in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert np.all(np.isfinite(as_np(a))), name
        assert_close(a, e, TOL["float64"], name)
    _, lse = jax.jit(lambda q, k, v: jd.dilated_attention(
        q, k, v, segment_lengths=SEGMENTS, dilation_rates=RATES, scale=SCALE, sinks=sinks,
        return_lse=True, **kw))(q, k, v)
    np.testing.assert_allclose(as_np(lse)[1], np.broadcast_to(sinks, (16, H)))


@pytest.mark.parametrize("mode,is_causal", [("longnet", False), ("longnet", True),
                                             ("head_groups", True)])
def test_sinks_in_the_streamed_program(mode, is_causal):
    """Without a window branch the one-device program folds the sinks into its own
    statistics and backward (ops/dilated_local.py): output, log-sum-exp and every
    gradient (d sinks included) against the reference, float64, with GQA and a
    fully masked batch row (its output 0, its lse the sink)."""
    q, k, v, g, sinks = make_inputs(7, 24, 2)
    mask = np.random.default_rng(8).random((B, 24)) > 0.3
    mask[1] = False
    kw = dict(mode=mode, is_causal=is_causal, kv_mask=mask, segments=(8, 16), rates=(2, 4))
    out, grads = ours(q, k, v, g, sinks, **kw)
    want, want_grads = reference(q, k, v, g, sinks, **kw)
    assert_close(out, want, TOL["float64"], "out")
    for name, a, e in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert_close(a, e, TOL["float64"], name)
    _, lse = jax.jit(lambda q, k, v: jd.dilated_attention(
        q, k, v, segment_lengths=(8, 16), dilation_rates=(2, 4), scale=SCALE, sinks=sinks,
        mode=mode, is_causal=is_causal, kv_mask=mask, return_lse=True))(q, k, v)
    np.testing.assert_allclose(as_np(lse)[1], np.broadcast_to(sinks, (24, H)))


@XLA_CPU_MEMORY
@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_sinks_hold_no_output_sized_copy(mode):
    """Compiled forward+backward temp with sinks is that of plain dilated attention
    plus at most a quarter of one output-sized array (n=16384, 8 heads x 64,
    float32). Measured: +1.0 MiB (longnet) and +0.0 MiB (head_groups) of 32 MiB;
    with the sinks merged after the program, +115.5 and +64 MiB."""
    from benchmarks.harness import temp_bytes

    x = jax.ShapeDtypeStruct((1, 16384, 8, 64), jnp.float32)
    s = jax.ShapeDtypeStruct((8,), jnp.float32)
    cfg = dict(segment_lengths=(2048, 4096, 8192), dilation_rates=(1, 2, 4), mode=mode)

    def grad(with_sinks):
        def loss(q, k, v, c, sinks):
            out = jd.dilated_attention(q, k, v, sinks=sinks if with_sinks else None, **cfg)
            return jnp.sum(out * c)
        return jax.grad(loss, argnums=(0, 1, 2, 4))

    plain, sunk = temp_bytes(grad(False), x, x, x, x, s), temp_bytes(grad(True), x, x, x, x, s)
    assert sunk - plain <= 16384 * 8 * 64 * 4 / 4, (plain / 2**20, sunk / 2**20)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision(dtype):
    """float32 / bfloat16 inputs against the float64 reference on the rounded inputs."""
    q, k, v, g, sinks = make_inputs(5, 24, 2)
    q, k, v = (rounded(x, dtype) for x in (q, k, v))
    kw = dict(is_causal=True, logit_soft_cap=2.0)
    out, grads = ours(q, k, v, g, sinks, dtype=dtype, **kw)
    assert out.dtype == jnp.dtype(dtype)
    want, want_grads = reference(q, k, v, g, sinks, **kw)
    assert_close(out, want, TOL[dtype], "out")
    for name, a, e in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert_close(a, e, TOL[dtype] * 2, name)


def test_packed_rows_equal_documents_alone():
    """segment_ids: the window stays inside its document, so a packed row (documents
    of 7 and 17 tokens) gives what each document gives alone (and with GQA, causal,
    soft-cap and sinks); with ``max_documents`` and segments (4, 8) the segment-grid
    branches take the padded layout (ops/dilated_packed.py) beside the window. Each
    document alone is the float64 PyTorch reference's (a JAX call per document length
    would compile a program of its own; the reference compiles none)."""
    q, k, v, g, sinks = make_inputs(6, 24, 2)
    ids = np.array([[0] * 7 + [1] * 17] * B)
    layouts = ((SEGMENTS, None), ((jd.SlidingWindow(3), 4, 8), 2))
    for mode, (segments, bound) in itertools.product(("longnet", "head_groups"), layouts):
        kw = dict(mode=mode, is_causal=True, logit_soft_cap=3.0)
        packed = jax.jit(lambda q, k, v, s, kw=kw, segments=segments, bound=bound:
                         jd.dilated_attention(q, k, v, sinks=s, segment_ids=ids,
                                              max_documents=bound, scale=SCALE,
                                              segment_lengths=segments,
                                              dilation_rates=RATES, **kw))(q, k, v, sinks)
        alone = [reference(*(x[:, s] for x in (q, k, v, g)), sinks, segments=segments, **kw)[0]
                 for s in (slice(0, 7), slice(7, 24))]
        assert_close(packed, np.concatenate(alone, axis=1), TOL["float64"], (mode, bound))


def test_gpu_programs_float64(default_kernel):
    """With the default kernel as a GPU chooses it (``default_kernel``: cuDNN's
    wrapper, float64 calls on the XLA kernel one by one), float64 at 1e-10: a window
    beside non-dividing segments (T = 24) with kv_mask, GQA and sinks against the
    PyTorch reference (the batched program there; with this machine's default kernel
    that call is test_parity_float64[longnet-False-2-True-None]'s, so it runs in the
    GPU's case only), longnet with every segment dividing (the non-blockwise streamed
    program, its primal the batched one) against the XLA kernel, and packed rows of two
    rows (the streams gather per row; an H200 gave wrong numbers there) with the window
    beside, documents alone, output and gradients."""
    from jax_dilated.backends import registry
    from jax_dilated.ops import dilated_programs

    gpu = default_kernel == "cudnn-reference"
    assert (registry.get_kernel(None).name == "auto") == gpu
    q, k, v, g, sinks = make_inputs(3, 24, 2)
    if gpu:
        mask = np.random.default_rng(2).random((B, 24)) > 0.3
        kw = dict(mode="longnet", kv_mask=mask)
        out, grads = ours(q, k, v, g, sinks, **kw)
        want, want_grads = reference(q, k, v, g, sinks, **kw)
        assert_close(out, want, TOL["float64"], "out")
        for name, a, e in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
            assert_close(a, e, TOL["float64"], name)

    def program(segments, rates, t):  # the one-device program of such a call
        call = dilated_programs.DilatedCall.of(segments, rates, mode="longnet",
                                               head_offsets="modulo", head_dim=D,
                                               is_causal=True)
        x = jnp.zeros((B, t, H, D))
        return dilated_programs.choose_program(
            call.kernel, call.args, call.plans(seq_len=t, num_heads=H, num_kv_heads=2),
            "longnet", x, x[:, :, :2], None, None)[0]

    if gpu:
        assert program(SEGMENTS, RATES, 24) == "batched"
        assert program((8, 16), (1, 2), 16) == "streamed"
    whole = dict(segments=(8, 16), rates=(1, 2), is_causal=True)
    args = [x[:, :16] for x in (q, k, v, g)]
    want, want_grads = reference(*args, None, **whole)
    fn = jax.jit(lambda q, k, v: jd.dilated_attention(
        q, k, v, segment_lengths=(8, 16), dilation_rates=(1, 2), is_causal=True, scale=SCALE))
    assert_close(fn(*args[:3]), want, TOL["float64"], "not differentiated")
    out, grads = ours(*args, None, **whole)
    for what, a, e in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        assert_close(a, e, TOL["float64"], what)

    # packed rows, two of them: each document alone through the reference
    ids = np.array([[0] * 7 + [1] * 17, [0] * 13 + [1] * 11])
    kw = dict(mode="head_groups", is_causal=True)
    out, grads = ours(q, k, v, g, None, segment_ids=ids, **kw)
    want = [np.zeros_like(x) for x in (q, q, k, v)]  # out, dq, dk, dv
    for b, n in enumerate((7, 13)):
        for s in (slice(0, n), slice(n, 24)):
            o, dqkv = reference(*(x[b:b + 1, s] for x in (q, k, v, g)), None, **kw)
            for w, x in zip(want, (o, *dqkv)):
                w[b:b + 1, s] = x
    for what, a, e in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        assert_close(a, e, TOL["float64"], what)

def _sharded(p, **kw):
    """``dilated_attention(seq_axis=...)`` inside shard_map on ``p`` devices, global
    arrays; the sinks replicated."""
    mesh = build_mesh((p,), ("seq",), "explicit")
    spec = P(None, "seq")
    ids = kw.pop("segment_ids", None)

    def local(q, k, v, sinks, *ids_local):
        return jd.dilated_attention(q, k, v, seq_axis="seq", sinks=sinks,
                                    segment_ids=ids_local[0] if ids_local else None, **kw)

    extra = () if ids is None else (spec,)
    sm = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (P(),) + extra,
                       out_specs=spec, check_vma=True)

    def fn(q, k, v, sinks):
        put = [jax.sharding.reshard(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        more = () if ids is None else (jax.sharding.reshard(jnp.asarray(ids),
                                                            NamedSharding(mesh, spec)),)
        out = sm(*put, jax.sharding.reshard(sinks, NamedSharding(mesh, P())), *more)
        return jax.sharding.reshard(out, NamedSharding(mesh, P()))

    return fn


@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_seq_axis_equals_one_device(mode):
    """2 devices: the window branch runs as the windowed ring (a window wider than a
    step of the causal ring reaches the previous shard), mixed with a local and a
    spanning branch; output and gradients equal one device's, that is the float64
    reference (which one device matches at 1e-10, test_parity_float64; the reference
    compiles nothing)."""
    q, k, v, g, sinks = make_inputs(7, 32, 2)
    segments, rates = (jd.SlidingWindow(5), 8, 32), (1, 2, 4)
    kw = dict(mode=mode, is_causal=True, logit_soft_cap=2.0)
    fn = _sharded(2, segment_lengths=segments, dilation_rates=rates, scale=SCALE, **kw)

    def loss(*a):  # one program: the output and the gradients
        out = fn(*a)
        return jnp.sum(out * g), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
        q, k, v, jnp.asarray(sinks))
    want, want_grads = reference(q, k, v, g, sinks, segments=segments, rates=rates, **kw)
    assert_close(out, want, TOL["float64"], "out")
    for name, a, e in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert_close(a, e, TOL["float64"], name)


def test_packed_seq_axis_equals_one_device():
    """Packed rows with seq_axis (head_parallel.over_heads) and a window branch: each
    document as it is alone on one device, that is the float64 reference's."""
    q, k, v, g, sinks = make_inputs(8, 32, 2)
    ids = np.array([[0] * 11 + [1] * 21] * B)
    segments, rates = (jd.SlidingWindow(4), 8), (1, 2)
    got = jax.jit(_sharded(2, segment_ids=ids, segment_lengths=segments, dilation_rates=rates,
                           is_causal=True, scale=SCALE))(q, k, v, jnp.asarray(sinks))
    want = [reference(*(x[:, s] for x in (q, k, v, g)), sinks, segments=segments,
                      rates=rates, is_causal=True)[0] for s in (slice(0, 11), slice(11, 32))]
    assert_close(got, np.concatenate(want, axis=1), TOL["float64"], "packed seq_axis")


def test_decode_window_branch():
    """Decoding with a window branch (and soft-cap, sinks, GQA) equals the causal
    forward's row at the position; decode_step writes and attends the same."""
    q, k, v, _, sinks = make_inputs(9, 20, 2)
    cfg = dict(segment_lengths=SEGMENTS, dilation_rates=RATES, scale=SCALE,
               logit_soft_cap=2.0, sinks=sinks)
    fulls = {}
    for mode in ("longnet", "head_groups"):
        full = fulls[mode] = jax.jit(lambda q, k, v, mode=mode: jd.dilated_attention(
            q, k, v, is_causal=True, mode=mode, **cfg))(q, k, v)
        step = jax.jit(lambda qq, kk, vv, p, mode=mode: jd.dilated_attention_decode(
            qq, kk, vv, p, mode=mode, **cfg))
        for pos in (0, 2, 13, 19):
            got = step(q[:, pos:pos + 1], k, v, pos)
            assert_close(got, full[:, pos:pos + 1], TOL["float64"], f"{mode} {pos}")
    cache = decode_ops.init_kv_cache(B, 20, 2, D, jnp.float64)
    outs = []
    step = jax.jit(lambda c, qq, kk, vv: decode_ops.decode_step(c, qq, kk, vv, **cfg))
    for pos in range(5):
        out, cache = step(cache, q[:, pos:pos + 1], k[:, pos:pos + 1], v[:, pos:pos + 1])
        outs.append(out)
    # causal, so the first 5 rows of the 20-token forward are those of the 5-token one
    assert_close(jnp.concatenate(outs, axis=1), fulls["longnet"][:, :5], TOL["float64"],
                 "decode_step")


def test_bad_input():
    x = np.zeros((1, 16, 4, 8))
    call = lambda **kw: jd.dilated_attention(x, x, x, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="dilation_rates"):
        call(segment_lengths=(jd.SlidingWindow(4), 8), dilation_rates=(2, 2))
    with pytest.raises(ValueError, match="left"):
        jd.SlidingWindow(-1)
    with pytest.raises(TypeError, match="right"):
        jd.SlidingWindow(2, 1.5)
    with pytest.raises(ValueError, match="right=2"):
        call(segment_lengths=(jd.SlidingWindow(4, 2),), dilation_rates=(1,), is_causal=True)
    with pytest.raises(ValueError, match="right=2"):
        jd.dilated_attention_decode(x[:, :1], x, x, 3,
                                    segment_lengths=(jd.SlidingWindow(4, 2),),
                                    dilation_rates=(1,))
    with pytest.raises(ValueError, match="sinks"):
        call(segment_lengths=(8,), dilation_rates=(1,), sinks=np.zeros(3))
    with pytest.raises(ValueError, match="logit_soft_cap"):
        call(segment_lengths=(8,), dilation_rates=(1,), logit_soft_cap=-1.0)
