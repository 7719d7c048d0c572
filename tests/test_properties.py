"""Property-based tests: every public operation, on drawn configurations, either
matches a float64 dense reference or raises a ``ValueError`` / ``TypeError`` whose
message names an argument - never a wrong number, never another exception.

The references are written here in NumPy from docs/semantics.md (independently of the
library): dilated attention is dense attention with logits ``scale q.k + log m(p, t)``,
``m`` the number of branches that allow the pair (``mode="longnet"``), or each head's
one branch divided by the number of branches (``mode="head_groups"``); ring attention
is dense attention; block-sparse attention is dense attention under the token mask
the block mask expands to; decoding at position ``p`` is row ``p`` of causal dilated
attention. The gradients with respect to query, key and value (through a random
output cotangent) are compared with ``jax.grad`` of the same dense formula in float64
(``test_gradients_match_dense``, and where a draw of the other tests asks for it).
Tolerances are relative to the reference's largest magnitude (at least 1), per dtype
(``_helpers.TOL``: 1e-10 float64, 1e-5 float32, 2e-2 bfloat16), with the inputs
rounded to the tested dtype before the reference sees them.

The draws are bounded (``max_examples`` per test, ``derandomize=True`` so that CI
draws the same examples every run) to keep the module within about a minute and a
half on two cores; ``_EXAMPLES`` says how many each test draws, and the environment
variable ``JD_PROPERTY_EXAMPLES`` multiplies them for a deeper local run.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import jax_dilated as jd
from _helpers import TOL, assert_close, np_dtype
from _mesh import make_mesh, require_devices

# examples drawn per test (the module draws their sum)
_EXAMPLES = {"dilated": 24, "distributed": 8, "ring": 10, "block_sparse": 12, "decode": 10,
             "gradients": 8, "bad_input": 400}


# JD_PROPERTY_EXAMPLES=10 draws ten times as many (a deeper local run, not for CI)
_MORE = float(os.environ.get("JD_PROPERTY_EXAMPLES", "1"))


def _settings(name):
    # no "explain" phase: it reruns a failing example hundreds of times (minutes here)
    return settings(max_examples=max(1, round(_EXAMPLES[name] * _MORE)), deadline=None,
                    derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink),
                    suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------ the references


def dense(q, k, v, m, scale):
    """softmax over t of ``scale q_p.k_t + log m``, times v; rows with no allowed key
    are zero. q [B, Tq, H, D], k/v [B, Tk, Hkv, D] (GQA: kv head ``j // (H / Hkv)``),
    m [B, H, Tq, Tk] counts (0: masked)."""
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bphd,bthd->bhpt", q, k) * scale
    s = np.where(m > 0, s, -np.inf)
    top = s.max(-1, keepdims=True)
    e = m * np.exp(s - np.where(np.isfinite(top), top, 0.0))
    total = e.sum(-1, keepdims=True)
    return np.einsum("bhpt,bthd->bphd", e / np.where(total > 0, total, 1.0), v)


def dense_grads(q, k, v, m, scale, cotangent):
    """Gradients of ``sum(dense(q, k, v, m) * cotangent)`` with respect to q, k, v
    (float64; ``jax.grad`` of the same formula written in jax.numpy)."""
    def loss(q, k, v):
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bphd,bthd->bhpt", q, k) * scale
        s = jnp.where(m > 0, s, -jnp.inf)
        top = jax.lax.stop_gradient(s.max(-1, keepdims=True))
        e = m * jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
        total = e.sum(-1, keepdims=True)
        out = jnp.einsum("bhpt,bthd->bphd", e / jnp.where(total > 0, total, 1.0), v)
        return jnp.sum(out * cotangent)

    # jitted: one compilation per draw, not one per operation and shape
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x, jnp.float64)
                                                        for x in (q, k, v)))


def check_grads(fn, inputs, rounded, m, scale, dtype, what, divisor=1.0):
    """Gradients of ``fn`` (through a random cotangent) match the dense form's."""
    rng = np.random.default_rng(len(what))
    cot = rng.standard_normal(rounded[0].shape)
    # jitted, the cotangent an argument: outside jit, arithmetic on an output sharded
    # over an Explicit mesh would need the user's jax.set_mesh
    grads = jax.jit(jax.grad(lambda q, k, v, c: jnp.sum(fn(q, k, v).astype(jnp.float64) * c),
                             argnums=(0, 1, 2)))(*inputs, jnp.asarray(cot))
    refs = dense_grads(*rounded, m, scale, cot / divisor)
    for name, g, r in zip("qkv", grads, refs):
        assert_close(np.asarray(g, np.float64), np.asarray(r), TOL[dtype],
                     f"{what}: d{name}")
    event("gradients match")


def allowed(T, w, r, o, causal):
    """[query, key]: may query p attend to key t in branch (w, r) at offset o?"""
    p = np.arange(T)
    sel = (p % w) % r == o
    ok = sel[:, None] & sel[None, :] & (p[:, None] // w == p[None, :] // w)
    return ok & (p[None, :] <= p[:, None]) if causal else ok


def dilated_counts(T, H, branches, mode, offsets_rule, causal):
    """(m [H, T, T], divisor) of dilated attention (docs/semantics.md, section 2)."""
    if mode == "longnet":
        def offset(j, r):
            return j % r if offsets_rule == "modulo" else j // -(-H // r)
        m = np.stack([sum(allowed(T, w, r, offset(j, r), causal).astype(float)
                          for w, r in branches) for j in range(H)])
        return m, 1.0
    g = len(branches)
    base, extra = divmod(H, g)
    sizes = [base + (i < extra) for i in range(g)]
    group = np.repeat(np.arange(g), sizes)
    m = np.stack([allowed(T, *branches[i], i % branches[i][1], causal).astype(float)
                  for i in group])
    return m, float(g)


def dilated_reference(q, k, v, branches, mode, offsets_rule, causal, kv_mask, scale):
    b, t, h, _ = q.shape
    m, divisor = dilated_counts(t, h, branches, mode, offsets_rule, causal)
    m = np.broadcast_to(m[None], (b, h, t, t))
    if kv_mask is not None:
        m = m * kv_mask[:, None, None, :]
    return dense(q, k, v, m, scale) / divisor


# ------------------------------------------------------------------------ drawing

DTYPES = ("float32", "float64", "bfloat16")


def _inputs(data, shapes, dtype):
    """Random normal arrays of ``shapes`` in ``dtype`` (JAX) and rounded (float64)."""
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(s).astype(np_dtype(dtype)) for s in shapes]
    return [jnp.asarray(x) for x in xs], [np.asarray(x, np.float64) for x in xs]


def _heads(data):
    hkv = data.draw(st.integers(1, 3), label="num_kv_heads")
    group = data.draw(st.integers(1, 3), label="heads per kv head")
    return hkv * group, hkv


def _branches(data, max_w=16):
    n = data.draw(st.integers(1, 3), label="num branches")
    out = []
    for _ in range(n):
        r = data.draw(st.integers(1, 4), label="rate")
        out.append((r * data.draw(st.integers(1, max(1, max_w // r)), label="w / r"), r))
    return out


def _kv_mask(data, b, t):
    if not data.draw(st.booleans(), label="kv_mask?"):
        return None
    density = data.draw(st.sampled_from([0.3, 0.7, 1.0]), label="kv_mask density")
    seed = data.draw(st.integers(0, 2**31 - 1), label="mask seed")
    return np.random.default_rng(seed).random((b, t)) < density


def _scale(data):
    # mostly ordinary scales, sometimes large logits (tens)
    return data.draw(st.one_of(st.none(), st.floats(0.05, 2.0), st.sampled_from([8.0, 20.0])),
                     label="scale")


def _ref_scale(scale, d):
    return d ** -0.5 if scale is None else scale


# argument names a message may name (spaces read as underscores, plurals as singular)
ARGUMENTS = ("query", "key", "value", "kv_mask", "segment_length", "dilation_rate",
             "scale", "block_q", "block_k", "block_size", "pattern", "block_mask",
             "position", "layout", "seq_axis", "batch_axis", "head_axis", "mode",
             "head_offsets", "num_heads", "num_kv_heads", "is_causal", "sequence_length",
             "seq_len", "mesh", "dropout_rate", "dropout_rng", "implementation",
             "return_lse", "cache")


def names_an_argument(message: str, name: str | None = None) -> bool:
    text = message.replace(" ", "_").lower()
    names = ARGUMENTS if name is None else (name,)
    return any(n.rstrip("s") in text for n in names)


def outcome(run, reference, dtype, what):
    """``run()`` matches ``reference()`` at the dtype's tolerance, or raises a
    ValueError / TypeError naming an argument. Returns "match" or the error."""
    try:
        out = run()
    except (ValueError, TypeError) as err:
        assert names_an_argument(str(err)), f"{what}: message names no argument: {err}"
        event(f"{type(err).__name__}: {str(err)[:40]}")
        return err
    event("match")
    out = np.asarray(jnp.asarray(out, jnp.float64))
    ref = reference()
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    assert_close(out, ref, TOL[dtype], what)
    return "match"


# --------------------------------------------------------------- dilated attention


@_settings("dilated")
@given(st.data())
def test_dilated_attention_matches_dense(data):
    """Both modes and offset rules, GQA, causal, kv_mask, lengths that are and are not
    multiples of the segments (segments longer than the sequence too), all dtypes."""
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    b = data.draw(st.integers(1, 2), label="batch")
    t = data.draw(st.integers(1, 20), label="seq")
    h, hkv = _heads(data)
    d = data.draw(st.sampled_from([1, 4, 8]), label="head_dim")
    branches = _branches(data)
    mode = data.draw(st.sampled_from(["longnet", "head_groups"]), label="mode")
    rule = data.draw(st.sampled_from(["modulo", "blocked"]), label="head_offsets")
    causal = data.draw(st.booleans(), label="is_causal")
    scale = _scale(data)
    mask = _kv_mask(data, b, t)
    (q, k, v), (qr, kr, vr) = _inputs(data, [(b, t, h, d), (b, t, hkv, d), (b, t, hkv, d)],
                                      dtype)
    config = dict(segment_lengths=tuple(w for w, _ in branches),
                  dilation_rates=tuple(r for _, r in branches), mode=mode,
                  head_offsets=rule, is_causal=causal, scale=scale, implementation="xla")
    fn = jax.jit(functools.partial(jd.dilated_attention, **config))
    result = outcome(
        lambda: fn(q, k, v, kv_mask=None if mask is None else jnp.asarray(mask)),
        lambda: dilated_reference(qr, kr, vr, branches, mode, rule, causal, mask,
                                  _ref_scale(scale, d)),
        dtype, f"dilated {config} {q.shape} kv {k.shape} mask={mask is not None}")
    # every drawn configuration is valid except head_groups with fewer heads than branches
    if mode == "head_groups" and h < len(branches):
        assert isinstance(result, ValueError) and "head" in str(result), result
        return
    assert result == "match", result
    if dtype != "bfloat16" and data.draw(st.booleans(), label="check gradients"):
        m, divisor = dilated_counts(t, h, branches, mode, rule, causal)
        m = np.broadcast_to(m[None], (b, h, t, t))
        if mask is not None:
            m = m * mask[:, None, None, :]
        check_grads(lambda q, k, v: fn(q, k, v, kv_mask=None if mask is None else
                                       jnp.asarray(mask)),
                    (q, k, v), (qr, kr, vr), m, _ref_scale(scale, d), dtype,
                    f"dilated {config} {q.shape} kv {k.shape}", divisor)


@_settings("distributed")
@given(st.data())
def test_distributed_dilated_attention_matches_dense(data):
    """dilated_attention with the sequence sharded over 1, 2 or 4 devices (jd.sharded):
    the single-device result, or a ValueError for a branch that straddles devices."""
    require_devices(4)  # (before any example: it draws meshes of up to 4 devices)
    devices = data.draw(st.sampled_from([1, 2, 4]), label="devices")
    dtype = data.draw(st.sampled_from(["float32", "float64"]), label="dtype")
    t = devices * data.draw(st.integers(1, 4), label="tokens per device")
    h, hkv = _heads(data)
    branches = _branches(data, max_w=12)
    causal = data.draw(st.booleans(), label="is_causal")
    mask = _kv_mask(data, 1, t)
    (q, k, v), (qr, kr, vr) = _inputs(data, [(1, t, h, 4), (1, t, hkv, 4), (1, t, hkv, 4)],
                                      dtype)
    config = dict(segment_lengths=tuple(w for w, _ in branches),
                  dilation_rates=tuple(r for _, r in branches), is_causal=causal,
                  implementation="xla")
    mesh = make_mesh((devices,), ("seq",))
    fn = jax.jit(jd.sharded(functools.partial(jd.dilated_attention, **config), mesh,
                            seq_axis="seq"))
    result = outcome(
        lambda: fn(q, k, v, kv_mask=None if mask is None else jnp.asarray(mask)),
        lambda: dilated_reference(qr, kr, vr, branches, "longnet", "modulo", causal, mask,
                                  0.5),
        dtype, f"distributed {config} {devices} devices {q.shape}")
    if devices == 1:
        assert result == "match", result
    elif result != "match":
        assert "segment" in str(result), result


# ------------------------------------------------------------------ ring attention


@_settings("ring")
@given(st.data())
def test_ring_and_block_sparse_ring_match_dense(data):
    """ring_attention (and block_sparse_attention over a ring) through jd.sharded on 1,
    2 or 4 devices, every layout: dense (block-masked) attention, or a ValueError for
    a length that does not split over the devices."""
    require_devices(4)  # (before any example: it draws meshes of up to 4 devices)
    devices = data.draw(st.sampled_from([1, 2, 4]), label="devices")
    sparse = data.draw(st.booleans(), label="block-sparse?")
    # (block-sparse refuses striped, a shard that is not made of global blocks; the
    # bad-input test below checks that refusal)
    layout = data.draw(st.sampled_from(["contiguous", "zigzag"] + ["striped"] * (not sparse)),
                       label="layout")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    parts = 2 * devices if layout == "zigzag" else devices
    # mostly lengths that split over the devices, sometimes any length
    aligned = st.builds(lambda n: parts * n, st.integers(1, 16 // parts))
    t = data.draw(st.one_of(aligned, aligned, aligned, st.integers(1, 16)), label="seq")
    h, hkv = _heads(data)
    causal = data.draw(st.booleans(), label="is_causal")
    scale = _scale(data)
    mask = _kv_mask(data, 2, t)
    (q, k, v), (qr, kr, vr) = _inputs(data, [(2, t, h, 4), (2, t, hkv, 4), (2, t, hkv, 4)],
                                      dtype)
    m = np.ones((2, h, t, t))
    options = dict(is_causal=causal, scale=scale, implementation="xla")
    if sparse:
        chunk = t // parts if t % parts == 0 else t  # block_size must divide it
        bs = data.draw(st.sampled_from([b for b in (1, 2, 4) if chunk % b == 0] or [1]),
                       label="block_size")
        nb = -(-t // bs)
        seed = data.draw(st.integers(0, 2**31 - 1), label="pattern seed")
        pattern = np.random.default_rng(seed).random((nb, nb)) < 0.6
        m = m * np.kron(pattern, np.ones((bs, bs)))[:t, :t]
        op = functools.partial(jd.block_sparse_attention, block_size=bs, pattern=pattern,
                               **options)
    else:
        op = functools.partial(jd.ring_attention, **options)
    if causal:
        m = m * np.tri(t)
    if mask is not None:
        m = m * mask[:, None, None, :]
    mesh = make_mesh((devices,), ("seq",))
    fn = jax.jit(jd.sharded(op, mesh, seq_axis="seq", layout=layout))
    result = outcome(
        lambda: fn(q, k, v, kv_mask=None if mask is None else jnp.asarray(mask)),
        lambda: dense(qr, kr, vr, m, _ref_scale(scale, 4)),
        dtype, f"{'block-sparse ' if sparse else ''}ring {layout} {devices} devices "
               f"{q.shape} kv {k.shape} causal={causal}")
    if t % parts:
        assert isinstance(result, ValueError), result
        return
    assert result == "match", result
    if dtype != "bfloat16" and data.draw(st.booleans(), label="check gradients"):
        check_grads(lambda q, k, v: fn(q, k, v, kv_mask=None if mask is None else
                                       jnp.asarray(mask)),
                    (q, k, v), (qr, kr, vr), m, _ref_scale(scale, 4), dtype,
                    f"{'block-sparse ' if sparse else ''}ring {layout} {devices} devices")


# ---------------------------------------------------------- block-sparse attention


@_settings("block_sparse")
@given(st.data())
def test_block_sparse_attention_matches_dense(data):
    """One device: query and key lengths may differ, short last blocks, masks shared
    or per head, causal, kv_mask, GQA, every dtype."""
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    b = data.draw(st.integers(1, 2), label="batch")
    tq = data.draw(st.integers(1, 20), label="q_len")
    tk = data.draw(st.one_of(st.just(tq), st.integers(1, 20)), label="kv_len")
    h, hkv = _heads(data)
    bs = data.draw(st.sampled_from([1, 3, 4, 8]), label="block_size")
    per_head = data.draw(st.booleans(), label="per-head mask")
    causal = data.draw(st.booleans(), label="is_causal")
    scale = _scale(data)
    mask = _kv_mask(data, b, tk)
    nq, nk = -(-tq // bs), -(-tk // bs)
    seed = data.draw(st.integers(0, 2**31 - 1), label="pattern seed")
    pattern = np.random.default_rng(seed).random((h, nq, nk) if per_head else (nq, nk)) < 0.5
    (q, k, v), (qr, kr, vr) = _inputs(data, [(b, tq, h, 8), (b, tk, hkv, 8),
                                             (b, tk, hkv, 8)], dtype)
    token = np.kron(pattern, np.ones((bs, bs)))[..., :tq, :tk]
    m = np.broadcast_to(token if per_head else token[None], (h, tq, tk))[None] * np.ones(
        (b, 1, 1, 1))
    if causal:
        m = m * np.tri(tq, tk)
    if mask is not None:
        m = m * mask[:, None, None, :]
    fn = jax.jit(functools.partial(jd.block_sparse_attention, block_size=bs,
                                   pattern=pattern, is_causal=causal, scale=scale,
                                   implementation="xla"))
    result = outcome(lambda: fn(q, k, v, kv_mask=None if mask is None else jnp.asarray(mask)),
                     lambda: dense(qr, kr, vr, m, _ref_scale(scale, 8)), dtype,
                     f"block-sparse bs={bs} {q.shape} kv {k.shape} per_head={per_head} "
                     f"causal={causal}")
    assert result == "match", result
    # (drawn the other way round from the other tests, so that the derandomized draws,
    # which favour False, check the block-sparse gradients in most examples)
    if dtype != "bfloat16" and not data.draw(st.booleans(), label="skip gradients"):
        check_grads(lambda q, k, v: fn(q, k, v, kv_mask=None if mask is None else
                                       jnp.asarray(mask)),
                    (q, k, v), (qr, kr, vr), m, _ref_scale(scale, 8), dtype,
                    f"block-sparse bs={bs} {q.shape} kv {k.shape}")


# ------------------------------------------------------------------------ decoding


@_settings("decode")
@given(st.data())
def test_decode_matches_causal_row(data):
    """dilated_attention_decode at a drawn position over a cache holding junk past it:
    row ``position`` of causal dilated attention, or a ValueError naming ``position``
    when it is out of the cache; under jit an out-of-range position gives NaN."""
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    t = data.draw(st.integers(1, 20), label="max_len")
    position = data.draw(st.integers(-2, t + 1), label="position")
    h, hkv = _heads(data)
    branches = _branches(data)
    mode = data.draw(st.sampled_from(["longnet", "head_groups"]), label="mode")
    rule = data.draw(st.sampled_from(["modulo", "blocked"]), label="head_offsets")
    traced = data.draw(st.booleans(), label="traced position")
    (q, k, v), (qr, kr, vr) = _inputs(data, [(1, t, h, 4), (1, t, hkv, 4), (1, t, hkv, 4)],
                                      dtype)
    config = dict(segment_lengths=tuple(w for w, _ in branches),
                  dilation_rates=tuple(r for _, r in branches), mode=mode,
                  head_offsets=rule, implementation="xla")
    if mode == "head_groups" and h < len(branches):
        with pytest.raises(ValueError, match="heads"):
            jd.dilated_attention_decode(q[:, :1], k, v, 0, **config)
        return
    p = min(max(position, 0), t - 1)
    query = q[:, p:p + 1]
    step = functools.partial(jd.dilated_attention_decode, **config)
    if traced:
        out = np.asarray(jax.jit(step)(query, k, v, jnp.int32(position)), np.float64)
        if not 0 <= position < t:
            event("traced position out of range: NaN")
            assert np.all(np.isnan(out)), position
            return
        event("traced position: match")
    else:
        result = outcome(
            # one compiled call (a concrete position is still checked while tracing)
            lambda: jax.jit(lambda q, k, v: step(q, k, v, position))(query, k, v),
            lambda: dilated_reference(qr, kr, vr, branches, mode, rule, True, None,
                                      0.5)[:, p:p + 1],
            dtype, f"decode {config} position {position} of {t}")
        if 0 <= position < t:
            assert result == "match", result
        else:
            assert isinstance(result, ValueError) and "position" in str(result), result
        return
    ref = dilated_reference(qr, kr, vr, branches, mode, rule, True, None, 0.5)[:, p:p + 1]
    assert_close(out, ref, TOL[dtype], f"decode (traced) {config} position {position}")


# ----------------------------------------------------------------------- gradients


@_settings("gradients")
@given(st.data())
def test_gradients_match_dense(data):
    """Gradients of dilated (both modes), block-sparse and ring attention (2 devices)
    with respect to query, key and value, against jax.grad of the dense form in
    float64, at the dtype's tolerance (causal, kv_mask, GQA, short segments)."""
    op = data.draw(st.sampled_from(["dilated", "block_sparse", "ring"]), label="op")
    event(op)
    dtype = data.draw(st.sampled_from(["float32", "float64"]), label="dtype")
    t = data.draw(st.integers(1, 8), label="tokens per device") * (2 if op == "ring" else 1)
    h, hkv = _heads(data)
    causal = data.draw(st.booleans(), label="is_causal")
    scale = _scale(data)
    mask = _kv_mask(data, 2, t)
    (q, k, v), rounded = _inputs(data, [(2, t, h, 4), (2, t, hkv, 4), (2, t, hkv, 4)], dtype)
    options = dict(is_causal=causal, scale=scale, implementation="xla")
    divisor = 1.0
    if op == "dilated":
        branches = _branches(data)
        mode = "head_groups" if h >= len(branches) and data.draw(
            st.booleans(), label="head_groups") else "longnet"
        fn = functools.partial(jd.dilated_attention,
                               segment_lengths=tuple(w for w, _ in branches),
                               dilation_rates=tuple(r for _, r in branches), mode=mode,
                               **options)
        m, divisor = dilated_counts(t, h, branches, mode, "modulo", causal)
        m = np.broadcast_to(m[None], (2, h, t, t))
    elif op == "block_sparse":
        bs = data.draw(st.sampled_from([1, 2, 3]), label="block_size")
        nb = -(-t // bs)
        seed = data.draw(st.integers(0, 2**31 - 1), label="pattern seed")
        pattern = np.random.default_rng(seed).random((nb, nb)) < 0.6
        fn = functools.partial(jd.block_sparse_attention, block_size=bs, pattern=pattern,
                               **options)
        m = np.broadcast_to(np.kron(pattern, np.ones((bs, bs)))[:t, :t], (2, h, t, t))
        m = m * (np.tri(t) if causal else 1.0)
    else:
        layout = data.draw(st.sampled_from(["contiguous", "striped"]), label="layout")
        fn = jd.sharded(functools.partial(jd.ring_attention, **options),
                        make_mesh((2,), ("seq",)), seq_axis="seq", layout=layout)
        m = np.broadcast_to(np.tri(t) if causal else np.ones((t, t)), (2, h, t, t))
    if mask is not None:
        m = m * mask[:, None, None, :]
    kv_mask = None if mask is None else jnp.asarray(mask)
    check_grads(lambda q, k, v: fn(q, k, v, kv_mask=kv_mask), (q, k, v), rounded, m,
                _ref_scale(scale, 4), dtype, f"{op} {q.shape} kv {k.shape} causal={causal}",
                divisor)


# ----------------------------------------------------------------------- bad input
#
# A valid call with one argument replaced by a bad value: the entry point raises a
# ValueError or TypeError whose message names that argument (or, for array shapes,
# one of the arrays involved). Nothing here compiles, so the draws are cheap.

_X = np.random.default_rng(0).standard_normal((2, 8, 4, 4)).astype(np.float32)
_BAD_COMMON = {
    "scale": [-1.0, 0.0, float("inf"), float("nan"), "big", True, 1j],
    "segment_lengths": [(), (0,), (-4,), (4.0,), "8", 8, (8,), (8, -5), None],
    "dilation_rates": [(), (0,), (3,), (1.5,), "1", (1,), (1, 0), None],
    "mode": ["bogus", None, 1],
    "head_offsets": ["bogus", None],
    "implementation": ["bogus", 3],
    "block_q": [-4, 7.5, "64", 0, True],
    "block_k": [-4, 7.5, "64", 0, True],
    "query": [_X[0], _X.astype(np.int32), _X[:0], _X[..., :0], _X[:, :, :0], _X.tolist(),
              _X[:, :, :3]],
    "key": [_X[:1], _X[..., :2], _X.astype(np.float64), _X[:, :, :3], _X[None]],
}
_BAD = {
    "dilated_attention": {
        **_BAD_COMMON,
        "is_causal": [1, "yes", np.bool_(True), jnp.array(True), None],
        "kv_mask": [np.ones((2, 7), bool), np.ones((2, 8), np.int32),
                    np.ones((2, 4, 8), bool), np.ones((8,), bool), "all"],
        "dropout_rate": [1.5, -0.1, "0.1", float("nan")],
        "dropout_rng": [None],  # with dropout_rate > 0
        "return_lse": [1, "no"],
    },
    "dilated_attention_decode": {  # (the cache may be stored in another dtype)
        **_BAD_COMMON, "key": [_X[:1], _X[..., :2], _X[:, :, :3], _X[None]],
        "position": [-1, 8, 100, 2.5, True, np.array([1, 2]), jnp.array(2.0), "3", None],
    },
    "block_sparse_attention": {
        "scale": _BAD_COMMON["scale"], "query": _BAD_COMMON["query"],
        "key": _BAD_COMMON["key"], "implementation": _BAD_COMMON["implementation"],
        "is_causal": [1, "yes", None],
        "block_size": [0, -2, 2.5, "4", True, None],
        "pattern": [np.ones((3, 3), bool), np.ones((2, 2), np.int32), "local", None,
                    np.ones((5, 2, 2), bool), np.ones((2,), bool)],
        "kv_mask": [np.ones((2, 7), bool), np.ones((2, 8), np.float32)],
    },
    "attention_fn": {
        key: _BAD_COMMON[key] for key in ("scale", "segment_lengths", "dilation_rates",
                                          "mode", "head_offsets", "implementation",
                                          "block_q", "block_k")
    } | {"is_causal": [1, 0, "yes", np.bool_(False)]},
    "nnx.MultiheadDilatedAttention": {
        key: _BAD_COMMON[key] for key in ("scale", "segment_lengths", "dilation_rates",
                                          "mode", "head_offsets", "implementation",
                                          "block_q", "block_k")
    } | {"num_heads": [0, 3, 2.0, "2"], "num_kv_heads": [0, 3, 1.5],
         "dropout_rate": [1.0, "x"]},
}
_BAD["linen.MultiheadDilatedAttention"] = _BAD["nnx.MultiheadDilatedAttention"]
_BAD["sharded"] = {  # jd.sharded(ring_attention) on 2 devices; "striped": block-sparse
    "layout": ["bogus", 3, "striped"], "seq_axis": ["nope", None, 0],
    "batch_axis": ["nope", "seq"], "mesh": ["mesh", None, np.zeros(2)],
    "query": [_X[0], _X[:0], _X[:, :7], _X[:, :, :3], _X.astype(np.int32)],
    "key": [_X[:, :4], _X[:1], _X[..., :2], _X[:, :, :3]],
    "kv_mask": [np.ones((2, 4), bool), np.ones((2, 8), np.int32)],
}


def _call(entry, **bad):
    """Call ``entry`` with valid arguments except ``bad`` (one name -> value)."""
    from flax import nnx

    cfg = dict(segment_lengths=(4, 8), dilation_rates=(1, 2))
    x = jnp.asarray(_X)
    if entry == "dilated_attention":
        kw = dict(cfg, query=x, key=x, value=x, kv_mask=None)
        if "dropout_rng" in bad:
            kw["dropout_rate"] = 0.1
        kw.update(bad)
        if "key" in bad:
            kw["value"] = kw["key"]
        return jd.dilated_attention(kw.pop("query"), kw.pop("key"), kw.pop("value"), **kw)
    if entry == "dilated_attention_decode":
        kw = dict(cfg, query=x[:, :1], key=x, value=x, position=3)
        kw.update(bad)
        q = kw["query"]
        if getattr(q, "ndim", 0) == 4 and q.shape[1] > 1:  # decoding takes one query
            kw["query"] = q[:, :1]
        if "key" in bad:
            kw["value"] = kw["key"]
        return jd.dilated_attention_decode(kw.pop("query"), kw.pop("key"), kw.pop("value"),
                                           kw.pop("position"), **kw)
    if entry == "block_sparse_attention":
        kw = dict(query=x, key=x, value=x, block_size=4, pattern=np.ones((2, 2), bool))
        kw.update(bad)
        if "key" in bad:
            kw["value"] = kw["key"]
        return jd.block_sparse_attention(kw.pop("query"), kw.pop("key"), kw.pop("value"),
                                         **kw)
    if entry == "sharded":
        kw = dict(mesh=make_mesh((2,), ("seq",)), seq_axis="seq", query=x, key=x,
                  kv_mask=None)
        kw.update(bad)
        if "batch_axis" in bad:
            kw["mesh"] = make_mesh((2, 2), ("seq", "b"))
        op = jd.ring_attention
        if bad.get("layout") == "striped":
            op = functools.partial(jd.block_sparse_attention, block_size=2,
                                   pattern=np.ones((4, 4), bool))
        attn = jd.sharded(op, kw.pop("mesh"), **{n: kw.pop(n) for n in
                                                 ("seq_axis", "batch_axis", "layout")
                                                 if n in kw})
        return attn(kw["query"], kw["key"], kw["key"], kv_mask=kw["kv_mask"])
    if entry == "attention_fn":
        return jd.attention_fn(**{**cfg, **bad})
    layer_kw = dict(cfg, embed_dim=8, num_heads=2, **bad)
    if entry == "nnx.MultiheadDilatedAttention":
        return jd.nnx.MultiheadDilatedAttention(**layer_kw, rngs=nnx.Rngs(0))
    return jd.linen.MultiheadDilatedAttention(**layer_kw)


_CASES = [(entry, name, i) for entry, table in _BAD.items() for name, values in table.items()
          for i in range(len(values))]


@_settings("bad_input")
@given(st.sampled_from(_CASES))
def test_bad_input_raises_naming_the_argument(case):
    entry, name, i = case
    value = _BAD[entry][name][i]
    with pytest.raises((ValueError, TypeError)) as info:
        _call(entry, **{name: value})
    message = str(info.value)
    # an array argument may be named by its partner in a shape mismatch
    expected = {"key": ("key", "value", "query"), "query": ("query",),
                "dilation_rates": ("dilation_rate", "segment_length"),
                "segment_lengths": ("segment_length", "dilation_rate"),
                "num_kv_heads": ("num_kv_heads", "num_heads"),
                "num_heads": ("num_heads", "embed_dim"),
                "batch_axis": ("batch_axis", "seq_axis"),
                "dropout_rng": ("dropout_rng",)}.get(name, (name,))
    assert any(names_an_argument(message, n) for n in expected), (
        f"{entry}({name}={value!r}) raised {type(info.value).__name__} naming none of "
        f"{expected}: {message}")

