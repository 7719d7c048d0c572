"""``mode="torchscale"`` of ``jd.dilated_attention`` (docs/semantics.md, section 2):
forward and gradients against the PyTorch reference written from that section
(``tests/torch_reference/torchscale.py``), on the XLA and native kernels; over a mesh
(heads, all-gather, ``"auto"``, a pair of axes, ``valid_length``) against one device's
numbers (the reference's, which one device matches); and the options the mode refuses."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dilated as jd
from _helpers import TOL, as_np, rel_err, rounded, to_jax
from _mesh import build_mesh, make_mesh
from jax_dilated.backends import native


# the PyTorch reference on one thread while this module runs (conftest.py says why)
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


# Prov-GigaPath's segment rule at max_wsi_size=11776: 1217 and 1722 are not multiples
# of their rates, so their outputs shift past one segment
GIGAPATH_SMALL = ((1024, 1217, 1448, 1722, 2048), (1, 2, 4, 8, 16))

CASES = [
    # (seq_len, heads, segment_lengths, dilation_rates)
    (23, 4, (4, 6, 7), (1, 2, 4)),       # short last segments, 7 % 4 != 0: shifts
    (23, 3, (4, 6, 7), (1, 2, 4)),       # heads not divisible by the rates
    (5, 4, (4, 6, 7), (1, 2, 4)),        # segments longer than the sequence
    (37, 5, (5, 7), (2, 3)),             # every rate misses its segment
]
# a slide of 1299 tiles with Prov-GigaPath's rule (non-causal, as its encoder)
SLIDE = (1300, 8, *GIGAPATH_SMALL)


def _inputs(seq_len, heads, head_dim=8, seed=0, batch=2):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, seq_len, heads, head_dim)) for _ in range(3)]


def _ours(q, k, v, segs, rates, dtype, **kw):
    return jd.dilated_attention(*(to_jax(x, dtype) for x in (q, k, v)), segment_lengths=segs,
                                dilation_rates=rates, mode="torchscale", **kw)


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torch")
    from torch_reference import torchscale
    return torchscale


def _out_and_grads_fn(fn):
    """``(*args, cotangent) -> (fn(*args), the gradients of sum(cotangent * fn(*args)))``
    as one jitted program (``jax.vjp`` of a jitted function compiles its forward and its
    backward apart)."""
    def both(*args):
        out, vjp = jax.vjp(fn, *args[:-1])
        return out, vjp(args[-1])

    return jax.jit(both)


def _out_and_grads(fn, args, cotangent):
    return _out_and_grads_fn(fn)(*args, cotangent)


def _torch_out(reference, q, k, v, segs, rates, causal, cotangent=None):
    import torch
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    out = reference.dilated_attention(tq, tk, tv, segs, rates, is_causal=causal)
    if cotangent is None:
        return as_np(out)
    (out * torch.tensor(cotangent)).sum().backward()
    return as_np(out), [as_np(x.grad) for x in (tq, tk, tv)]


@pytest.mark.parametrize("case,causal", [(c, causal) for c in CASES for causal in (False, True)]
                         + [(SLIDE, False)], ids=lambda c: str(c))
def test_float64_forward_and_gradients(reference, case, causal):
    t, h, segs, rates = case
    q, k, v = _inputs(t, h, batch=1 if t > 100 else 2)
    ct = np.random.default_rng(1).standard_normal(q.shape)
    want, want_grads = _torch_out(reference, q, k, v, segs, rates, causal, ct)
    fn = lambda q, k, v: _ours(q, k, v, segs, rates, "float64", is_causal=causal,  # noqa: E731
                               implementation="xla")
    out, grads = _out_and_grads(fn, [jnp.asarray(x) for x in (q, k, v)], jnp.asarray(ct))
    assert rel_err(out, want) < TOL["float64"]
    for got, exp in zip(grads, want_grads):
        assert rel_err(got, exp) < TOL["float64"]


def _kernels():
    names = ["xla"]
    if jax.default_backend() == "cpu" and native.unavailable_reason() is None:
        names.append("native")
    return names


@pytest.mark.parametrize("implementation", _kernels())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_on_each_kernel(reference, implementation, dtype):
    """float32 within 1e-5 and bf16 within 2e-2 of the float64 reference (computed on
    the rounded inputs), forward and the gradients of q, k, v."""
    t, h = 200, 4
    segs, rates = (64, 97, 200), (1, 2, 4)   # 97 % 2 != 0: shifted outputs
    q, k, v = (rounded(x, dtype) for x in _inputs(t, h, head_dim=16, seed=3))
    ct = rounded(np.random.default_rng(4).standard_normal(q.shape), dtype)
    want, want_grads = _torch_out(reference, q, k, v, segs, rates, False, ct)
    fn = functools.partial(jd.dilated_attention, segment_lengths=segs, dilation_rates=rates,
                           mode="torchscale", implementation=implementation)
    out, grads = _out_and_grads(fn, [to_jax(x, dtype) for x in (q, k, v)], to_jax(ct, dtype))
    assert out.dtype == jnp.dtype(to_jax(q, dtype).dtype)
    assert rel_err(out, want) < TOL[dtype]
    for got, exp in zip(grads, want_grads):
        assert rel_err(got, exp) < TOL[dtype]


# Prov-GigaPath's default segments (max_wsi_size 262144): at 1,068 tiles the second
# 1024-segment holds 45 real keys and 979 zero slots; nothing shifts below 185,363
GIGAPATH = ((1024, 5792, 32768, 185363, 1048576), (1, 2, 4, 8, 16))


@pytest.fixture(scope="module")
def gigapath_slide(reference):
    """1,068 tiles (1069 tokens, 8 heads of 16: the native kernel serves head_dim a
    multiple of 16 only) with Prov-GigaPath's default segments: q, k, v, a cotangent
    (float32 values, so that the float32 cases see exactly the reference's inputs), and
    the reference's output and gradients (the same for every kernel's case and for
    test_native_inference_runs_every_branch_in_one_call: computed once, 5 s)."""
    t, (segs, rates) = 1069, GIGAPATH
    q, k, v = (rounded(x, "float32") for x in _inputs(t, 8, head_dim=16, batch=1, seed=3))
    ct = rounded(np.random.default_rng(4).standard_normal(q.shape), "float32")
    return (q, k, v, ct), _torch_out(reference, q, k, v, segs, rates, False, ct)


@pytest.mark.parametrize("implementation", _kernels())
def test_unshifted_branches_add_their_zero_slots_in_place(gigapath_slide, monkeypatch,
                                                          implementation):
    """Where no branch shifts (Prov-GigaPath's slides below 185,363 tiles), each branch
    runs on the sequence itself and its zero slots are added to its softmax afterwards:
    float64 output and gradients equal the reference, and the padded program's."""
    from jax_dilated.ops import dilated_torchscale as ts
    t, (segs, rates) = 1069, GIGAPATH
    assert ts.unshifted(ts.padded_branches(zip(segs, rates), t))
    assert ts.zero_slots(ts.padded_branches(zip(segs, rates), t)[0], np.arange(8), 8)[
        1024:].max() == 979
    (q, k, v, ct), (want, want_grads) = gigapath_slide
    assert q.shape[1] == t
    dtype = "float64" if implementation == "xla" else "float32"  # native: no float64
    results = []
    for in_place in (True, False):
        if not in_place:
            monkeypatch.setattr(ts, "unshifted", lambda branches: False)
        fn = lambda q, k, v: _ours(q, k, v, segs, rates, dtype,  # noqa: E731
                                   implementation=implementation)
        out, grads = _out_and_grads(fn, [to_jax(x, dtype) for x in (q, k, v)],
                                    to_jax(ct, dtype))
        results.append((out, *grads))
    for got, exp in zip(results[0], (want, *want_grads)):
        assert rel_err(got, exp) < TOL[dtype]
    for got, exp in zip(*results):
        assert rel_err(got, exp) < TOL[dtype]


@pytest.mark.skipif("native" not in _kernels(), reason="the native CPU kernel is not available")
@pytest.mark.parametrize("case", ["gigapath-1069",  # gigapath_slide's inputs and reference
                                  (300, 4, (64, 128, 256), (1, 2, 4), False),  # nested
                                  (300, 4, (64, 128, 256), (1, 2, 4), True)],
                         ids=["gigapath-1069", "nested", "nested-causal"])
def test_native_inference_runs_every_branch_in_one_call(reference, request, case):
    """Not differentiated, the native kernel computes the unshifted branches' mix as one
    call of all of them (their zero slots added once); differentiated, branch by branch
    (the weights without gradient). Both equal the float64 reference in float32, and
    the two programs hold one dilated call and one per branch."""
    if case == "gigapath-1069":  # 1069 tokens, 8 heads: the reference computed once
        (segs, rates), causal = GIGAPATH, False
        (q, k, v, ct), (want, want_grads) = request.getfixturevalue("gigapath_slide")
    else:
        t, h, segs, rates, causal = case
        q, k, v = (rounded(x, "float32") for x in _inputs(t, h, head_dim=16, batch=1, seed=8))
        ct = rounded(np.random.default_rng(9).standard_normal(q.shape), "float32")
        want, want_grads = _torch_out(reference, q, k, v, segs, rates, causal, ct)
    fn = lambda q, k, v: _ours(q, k, v, segs, rates, "float32", is_causal=causal,  # noqa: E731
                               implementation="native")
    args = [to_jax(x, "float32") for x in (q, k, v)]
    call = f"@{native.build.target(native.build.TARGET_DILATED)}("
    inference = jax.jit(fn).lower(*args)  # each program lowered once, read, then compiled
    assert inference.as_text().count(call) == 1
    assert rel_err(inference.compile()(*args), want) < TOL["float32"]
    differentiated = _out_and_grads_fn(fn).lower(*args, to_jax(ct, "float32"))
    assert differentiated.as_text().count(call) == len(segs)
    out, grads = differentiated.compile()(*args, to_jax(ct, "float32"))
    assert rel_err(out, want) < TOL["float32"]
    for got, exp in zip(grads, want_grads):
        assert rel_err(got, exp) < TOL["float32"]


def test_grouped_kv_heads_read_their_query_heads_kv(reference):
    """GQA: 8 query heads on 2 kv heads equal the reference on repeated kv heads."""
    q, _, _ = _inputs(41, 8, seed=5)
    _, k, v = _inputs(41, 2, seed=6)
    rep = lambda x: np.repeat(x, 4, axis=2)
    want = _torch_out(reference, q, rep(k), rep(v), (8, 13), (1, 4), False)
    got = jax.jit(lambda q, k, v: _ours(q, k, v, (8, 13), (1, 4), "float64"))(q, k, v)
    assert rel_err(got, want) < TOL["float64"]


def test_weights_have_no_gradient_unlike_longnet():
    """With one segment per branch and rates dividing it, torchscale's forward is
    longnet's with blocked offsets; its gradient is not (the mixing weights are
    constants): the difference is the weights' own gradient."""
    q, k, v = (jnp.asarray(x) for x in _inputs(16, 4, seed=7))
    kw = dict(segment_lengths=(16, 16), dilation_rates=(1, 2), implementation="xla")
    ts = lambda q: jd.dilated_attention(q, k, v, mode="torchscale", **kw)  # noqa: E731
    ln = lambda q: jd.dilated_attention(q, k, v, mode="longnet",  # noqa: E731
                                        head_offsets="blocked", **kw)
    # the output and the gradient of its sum, one program per mode
    (out_ts, (g_ts,)), (out_ln, (g_ln,)) = (_out_and_grads(f, [q], jnp.ones_like(q))
                                            for f in (ts, ln))
    np.testing.assert_allclose(out_ts, out_ln, atol=1e-13)
    assert np.abs(g_ts - g_ln).max() > 1e-3


def test_dropout_is_deterministic_per_key_and_changes_the_output():
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _inputs(40, 4, seed=8))
    kw = dict(segment_lengths=(8, 20), dilation_rates=(1, 2), mode="torchscale",
              implementation="xla")
    dropped = jax.jit(lambda rng: jd.dilated_attention(q, k, v, dropout_rate=0.5,
                                                       dropout_rng=rng, **kw))
    a, b = dropped(jax.random.key(0)), dropped(jax.random.key(0))
    c = jax.jit(lambda q: jd.dilated_attention(q, k, v, **kw))(q)
    np.testing.assert_array_equal(a, b)
    assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-2


def test_valid_length_computes_the_shorter_sequence():
    q, k, v = (jnp.asarray(x) for x in _inputs(30, 4, seed=9))
    kw = dict(segment_lengths=(8, 11), dilation_rates=(1, 2), mode="torchscale")
    attn = jax.jit(lambda q, k, v, **extra: jd.dilated_attention(q, k, v, **kw, **extra),
                   static_argnames="valid_length")
    got = attn(q, k, v, valid_length=26)
    want = attn(q[:, :26], k[:, :26], v[:, :26])
    np.testing.assert_allclose(got[:, :26], want, atol=1e-14)
    assert not np.any(np.asarray(got[:, 26:]))


# ------------------------------------------------------------------------------ mesh


@pytest.mark.parametrize("strategy,devices,heads", [("heads", 8, 8), ("auto", 4, 6)])
def test_over_a_mesh_equals_one_device(reference, strategy, devices, heads):
    """Forward (and gradients through the head exchange); ``"auto"`` with 6 heads on 4
    devices all-gathers. One device's numbers are the float64 reference's (which one
    device matches at 1e-10, test_float64_forward_and_gradients; the reference compiles
    nothing)."""
    mesh = build_mesh((devices,), ("s",), "auto")
    q, k, v = _inputs(48, heads, seed=10)
    segs, rates = (5, 7, 13), (1, 2, 4)
    fn = functools.partial(jd.dilated_attention, segment_lengths=segs, dilation_rates=rates,
                           mode="torchscale", is_causal=False)
    ct = np.random.default_rng(11).standard_normal(q.shape)
    one, one_grads = _torch_out(reference, q, k, v, segs, rates, False, ct)
    run = jd.sharded(fn, mesh, seq_axis="s", strategy=strategy)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if strategy != "heads":  # (the all-gather's backward is its all-gather's transpose)
        assert rel_err(run(q, k, v), one) < TOL["float64"]
        return
    out, grads = _out_and_grads(run, [q, k, v], jnp.asarray(ct))  # one program
    assert rel_err(out, one) < TOL["float64"]
    for got, exp in zip(grads, one_grads):
        assert rel_err(got, exp) < TOL["float64"]


def test_a_pair_of_axes_runs_heads_over_both_with_valid_length(reference):
    """``seq_axis=(a, b)`` with ``strategy="heads"``: the pair as one axis; a sequence
    padded to divide the devices (``valid_length``) equals the unpadded one (on one
    device: the float64 reference's numbers)."""
    mesh = make_mesh((2, 4), ("a", "b"))
    q, k, v = _inputs(43, 8, seed=12)
    pad = lambda x: jnp.pad(jnp.asarray(x), [(0, 0), (0, 5), (0, 0), (0, 0)])  # noqa: E731
    segs, rates = (6, 9), (1, 4)
    run = jd.sharded(functools.partial(jd.dilated_attention, valid_length=43,
                                       segment_lengths=segs, dilation_rates=rates,
                                       mode="torchscale", is_causal=True), mesh,
                     seq_axis=("a", "b"), strategy="heads")
    got = np.asarray(run(pad(q), pad(k), pad(v)))
    want = _torch_out(reference, q, k, v, segs, rates, True)
    assert rel_err(got[:, :43], want) < TOL["float64"]
    assert not np.any(got[:, 43:])


def test_ring_hybrid_and_per_branch_strategies_are_refused_with_the_reason():
    mesh = make_mesh((2, 4), ("a", "b"))
    q = jnp.ones((1, 16, 8, 8))
    fn = functools.partial(jd.dilated_attention, segment_lengths=(4, 8),
                           dilation_rates=(1, 2), mode="torchscale")
    for kw in (dict(seq_axis="b"), dict(seq_axis=("a", "b"), strategy="hybrid"),
               dict(seq_axis="b", strategy=("heads", "ring"))):
        with pytest.raises(ValueError, match="whole sequence of some heads"):
            jd.sharded(fn, mesh, **kw)(q, q, q)
    with pytest.raises(ValueError, match="divisible"):
        jd.sharded(fn, make_mesh((8,), ("s",)), seq_axis="s",
                   strategy="heads")(q[:, :, :6], q[:, :, :6], q[:, :, :6])


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("option,match", [
    (dict(kv_mask=np.ones((1, 16), bool)), "kv_mask"),
    (dict(segment_ids=np.zeros((1, 16), np.int32)), "segment_ids"),
    (dict(sinks=np.zeros(4)), "sinks"),
    (dict(return_lse=True), "return_lse"),
    (dict(logit_soft_cap=5.0), "logit_soft_cap"),
    (dict(max_documents=2, segment_ids=np.zeros((1, 16), np.int32)), "max_documents"),
    (dict(segment_lengths=(jd.SlidingWindow(3), 8)), "sliding-window"),
    (dict(valid_length=17), "valid_length"),
    (dict(valid_length=0), "valid_length"),
])
def test_options_torchscale_has_not_are_refused(option, match):
    x = jnp.ones((1, 16, 4, 8))
    kw = dict(segment_lengths=(4, 8), dilation_rates=(1, 2), mode="torchscale") | option
    with pytest.raises(ValueError, match=match):
        jd.dilated_attention(x, x, x, **kw)


def test_valid_length_needs_torchscale_and_decoding_is_refused():
    x = jnp.ones((1, 16, 4, 8))
    with pytest.raises(ValueError, match="valid_length applies to mode=\"torchscale\""):
        jd.dilated_attention(x, x, x, segment_lengths=(4,), dilation_rates=(1,),
                             valid_length=8)
    with pytest.raises(ValueError, match="no KV-cache decoding"):
        jd.dilated_attention_decode(x[:, :1], x, x, 3, segment_lengths=(4,),
                                    dilation_rates=(1,), mode="torchscale")


def test_layers_take_the_mode():
    """A multi-head layer passes the mode on: where torchscale pads nothing (every
    segment divides the sequence, every rate its segment) it equals the longnet layer
    with blocked offsets; where the last segment is short it does not."""
    from flax import nnx

    def layer(mode, **kw):
        return jd.nnx.MultiheadDilatedAttention(16, 4, segment_lengths=(4, 8),
                                                dilation_rates=(1, 2), mode=mode,
                                                rngs=nnx.Rngs(0), **kw)

    ts, ln = layer("torchscale"), layer("longnet", head_offsets="blocked")
    run = nnx.jit(lambda ts, ln, x: (ts(x, deterministic=True), ln(x, deterministic=True)))
    x = jnp.asarray(np.random.default_rng(13).standard_normal((1, 24, 16)))
    np.testing.assert_allclose(*run(ts, ln, x), atol=1e-12)
    x = x[:, :19]  # the last segments short: zero slots in torchscale's softmax
    assert np.abs(np.subtract(*map(np.asarray, run(ts, ln, x)))).max() > 1e-3
