"""KV-cache decoding (``jax_dilated.ops.decode`` and the layers' ``decode=True``).

Decoding token by token must give, at every step, the output of the full causal
forward pass on the prefix - for prefixes far longer than the largest segment and
shorter than it (a segment longer than the prefix is one segment starting at 0),
in both modes, with GQA. Per-token work must not grow with the cache length, and
misuse (no cache, overflow, several tokens, masks, dropout) must raise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import assert_close
from _mesh import devices as mesh_devices
from flax import linen as nn
from flax import nnx

import jax_dilated as jd
from jax_dilated.ops import decode

CASES = {
    "longnet_modulo": dict(segment_lengths=(4, 8), dilation_rates=(1, 2)),
    "longnet_blocked_gqa": dict(segment_lengths=(4, 8), dilation_rates=(1, 2),
                                head_offsets="blocked", hkv=2),
    "head_groups_gqa": dict(segment_lengths=(4, 8), dilation_rates=(1, 2),
                            mode="head_groups", hkv=2),
    # segments of 16 and 64 exceed many prefixes; max_len 44 is no multiple of any w
    "long_segments": dict(segment_lengths=(4, 16, 64), dilation_rates=(1, 2, 4), h=5,
                          max_len=44),
}
T = 40


def qkv(seed, b, t, h, hkv, d=8):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((b, t, n, d))) for n in (h, hkv, hkv))


@functools.partial(jax.jit, static_argnames=("max_len", "config"))
def decode_all(q, k, v, *, max_len, config):
    """Feed the tokens one by one through decode_step (lax.scan): [B, T, H, D]."""
    b, _, hkv, d = k.shape
    cache = decode.init_kv_cache(b, max_len, hkv, d, q.dtype)

    def step(cache, x):
        q_t, k_t, v_t = (a[:, None] for a in x)
        out, cache = decode.decode_step(cache, q_t, k_t, v_t, **dict(config))
        return cache, out[:, 0]

    cache, outs = jax.lax.scan(step, cache, tuple(a.swapaxes(0, 1) for a in (q, k, v)))
    return outs.swapaxes(0, 1), cache


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_causal_forward(name):
    opts = dict(CASES[name])
    h, hkv, max_len = opts.pop("h", 4), opts.pop("hkv", None), opts.pop("max_len", T)
    q, k, v = qkv(0, 2, T, h, hkv or h)
    out, cache = decode_all(q, k, v, max_len=max_len, config=tuple(sorted(opts.items())))
    full = jax.jit(functools.partial(jd.dilated_attention, **opts, is_causal=True))(q, k, v)
    assert_close(out, full, 1e-12, name)
    assert int(cache.index) == T and cache.key.shape == (2, max_len, hkv or h, 8)
    np.testing.assert_array_equal(np.asarray(cache.key[:, :T]), np.asarray(k))


def test_decode_equals_forward_on_each_prefix():
    """The causal forward pass on the prefix alone (``T = n``: segments >= n are one
    short segment) agrees with the decoded token ``n - 1``; checked against the
    PyTorch reference (independent segment loops) for prefixes shorter than every
    segment, between them, and longer than all but one."""
    torch = pytest.importorskip("torch")
    import torch_reference as ref

    opts = dict(CASES["long_segments"])
    h, max_len = opts.pop("h"), opts.pop("max_len")
    q, k, v = qkv(1, 1, T, h, h)
    out, _ = decode_all(q, k, v, max_len=max_len, config=tuple(sorted(opts.items())))
    qt, kt, vt = (torch.tensor(np.asarray(a)) for a in (q, k, v))
    for n in (1, 3, 6, 17, 33, 40):
        prefix = ref.longnet_dilated_attention(qt[:, :n], kt[:, :n], vt[:, :n], **opts,
                                               is_causal=True)
        assert_close(out[:, n - 1], prefix[:, -1], 1e-12, f"prefix {n}")


def test_dilated_attention_decode_direct():
    """The attention alone, at a traced position, over a cache holding future junk."""
    opts = dict(segment_lengths=(4, 8), dilation_rates=(1, 2))
    q, k, v = qkv(2, 1, 24, 4, 4)
    full = jax.jit(functools.partial(jd.dilated_attention, **opts, is_causal=True))(q, k, v)
    junk = jnp.full_like(k, 1e6)
    for p in (0, 5, 13, 23):
        kc = jnp.where(jnp.arange(24)[None, :, None, None] <= p, k, junk)
        vc = jnp.where(jnp.arange(24)[None, :, None, None] <= p, v, junk)
        got = jax.jit(functools.partial(jd.dilated_attention_decode, **opts))(
            q[:, p:p + 1], kc, vc, p)
        assert_close(got[:, 0], full[:, p], 1e-12, f"position {p}")


def test_work_per_token_does_not_grow_with_cache():
    """Compiled FLOPs of one decode step are the same for caches of 64 and 4096 tokens,
    and no matmul in it has a dimension of the cache length."""
    opts = dict(segment_lengths=(8, 16), dilation_rates=(1, 2))

    def step_fn(max_len):
        cache = decode.init_kv_cache(1, max_len, 2, 8, jnp.float32)
        x = jnp.zeros((1, 1, 2, 8), jnp.float32)
        fn = jax.jit(functools.partial(decode.decode_step, **opts))
        return fn, (cache, x, x, x)

    flops = []
    for max_len in (64, 4096):
        fn, args = step_fn(max_len)
        cost = fn.lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops.append(cost["flops"])
        jaxpr = jax.make_jaxpr(fn)(*args)
        for eqn in _all_eqns(jaxpr.jaxpr):
            if eqn.primitive.name == "dot_general":
                for var in eqn.invars:
                    assert max_len not in var.aval.shape, (max_len, eqn)
    assert flops[0] == pytest.approx(flops[1], rel=0.01), flops


def _all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _all_eqns(sub)


# ------------------------------------------------------------------------- layers

E, H = 16, 4


def nnx_layer(**kw):
    kw = {"segment_lengths": (4, 8), "dilation_rates": (1, 2), **kw}
    return jd.nnx.MultiheadDilatedAttention(E, H, **kw, param_dtype=jnp.float64,
                                            rngs=nnx.Rngs(0))


@nnx.jit
def nnx_step(layer, x_t):
    return layer(x_t, decode=True)


@pytest.mark.parametrize("kw", [dict(num_kv_heads=2),
                                dict(mode="head_groups", layer_norm=False)],
                         ids=["longnet_gqa_subln", "head_groups"])
def test_nnx_layer_decode(kw):
    layer = nnx_layer(**kw)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, T, E)))
    full = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
    layer.init_cache((2, T, E), dtype=jnp.float64)
    assert layer.cached_key.shape == (2, T, kw.get("num_kv_heads", H), E // H)
    outs = [nnx_step(layer, x[:, t:t + 1]) for t in range(T)]
    assert_close(jnp.concatenate(outs, axis=1), full, 1e-12, "nnx decode")
    assert int(layer.cache_index[...]) == T


def test_linen_layer_decode():
    lin = jd.linen.MultiheadDilatedAttention(E, H, segment_lengths=(4, 8),
                                             dilation_rates=(1, 2), num_kv_heads=2,
                                             param_dtype=jnp.float64)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, T, E)))
    variables = lin.init(jax.random.key(0), x, decode=True)  # creates the cache
    params, cache = variables["params"], variables["cache"]
    assert cache["cached_key"].shape == (2, T, 2, E // H)
    full = lin.apply({"params": params}, x, is_causal=True)

    @jax.jit
    def step(cache, x_t):
        out, mutated = lin.apply({"params": params, "cache": cache}, x_t, decode=True,
                                 mutable=["cache"])
        return out, mutated["cache"]

    outs = []
    for t in range(T):
        out, cache = step(cache, x[:, t:t + 1])
        outs.append(out)
    assert_close(jnp.concatenate(outs, axis=1), full, 1e-12, "linen decode")
    # nnx with the same weights decodes the same
    layer = nnx_layer(num_kv_heads=2)
    state = nnx.state(layer, nnx.Param)
    nnx.replace_by_pure_dict(state, nn.unbox(params))
    nnx.update(layer, state)
    layer.init_cache((2, T, E), dtype=jnp.float64)
    assert_close(nnx_step(layer, x[:, :1]), full[:, :1], 1e-12, "nnx with linen weights")


# ------------------------------------------------------------------------- errors


def test_overflow_raises_eagerly_and_nans_under_jit():
    cache = decode.init_kv_cache(1, 2, 1, 4)
    x = jnp.ones((1, 1, 1, 4))
    opts = dict(segment_lengths=(2,), dilation_rates=(1,))
    for _ in range(2):
        _, cache = decode.decode_step(cache, x, x, x, **opts)
    with pytest.raises(ValueError, match="KV cache overflow.*max_len=2"):
        decode.decode_step(cache, x, x, x, **opts)
    out, after = jax.jit(functools.partial(decode.decode_step, **opts))(cache, 2 * x, 2 * x,
                                                                         2 * x)
    assert np.all(np.isnan(np.asarray(out)))
    np.testing.assert_array_equal(np.asarray(after.key), np.asarray(cache.key))
    assert int(after.index) == 2

    layer = nnx_layer()
    layer.init_cache((1, 1, E), dtype=jnp.float64)
    layer(jnp.ones((1, 1, E)), decode=True)
    with pytest.raises(ValueError, match="KV cache overflow"):
        layer(jnp.ones((1, 1, E)), decode=True)


def test_decode_errors():
    layer = nnx_layer(dropout_rate=0.2)
    x_t = jnp.ones((1, 1, E))
    with pytest.raises(ValueError, match="init_cache"):
        layer(x_t, decode=True, deterministic=True)
    layer.init_cache((1, 8, E))
    with pytest.raises(ValueError, match="KV cache overflow: 9 tokens"):
        layer(jnp.ones((1, 9, E)), decode=True, deterministic=True)
    with pytest.raises(ValueError, match="takes no kv_mask"):
        layer(x_t, decode=True, deterministic=True, kv_mask=jnp.ones((1, 1), bool))
    with pytest.raises(ValueError, match="without dropout"):
        layer(x_t, decode=True, deterministic=False, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="init_cache takes"):
        layer.init_cache((1, 8, E + 1))
    custom = nnx_layer(attention_fn=functools.partial(jd.dilated_attention, block_q=4))
    custom.init_cache((1, 8, E))
    with pytest.raises(ValueError, match="custom attention_fn"):
        custom(x_t, decode=True)
    with pytest.raises(ValueError, match="must be \\[batch, 1, num_kv_heads"):
        decode.decode_step(decode.init_kv_cache(1, 4, 2, 4), jnp.ones((1, 1, 2, 4)),
                           jnp.ones((1, 1, 1, 4)), jnp.ones((1, 1, 1, 4)),
                           segment_lengths=(2,), dilation_rates=(1,))
    with pytest.raises(ValueError, match="one token at a time"):
        jd.dilated_attention_decode(jnp.ones((1, 2, 2, 4)), jnp.ones((1, 4, 2, 4)),
                                    jnp.ones((1, 4, 2, 4)), 0, segment_lengths=(2,),
                                    dilation_rates=(1,))
    lin = jd.linen.MultiheadDilatedAttention(E, H, segment_lengths=(4,), dilation_rates=(1,))
    params = lin.init(jax.random.key(0), jnp.ones((1, 4, E)))["params"]
    with pytest.raises(ValueError, match="needs the KV cache"):
        lin.apply({"params": params}, x_t, decode=True, mutable=["cache"])
    # last: with fewer than 2 devices (one GPU) building the mesh skips the test
    mesh = jax.sharding.Mesh(mesh_devices(2), ("seq",))
    ring = jd.nnx.MultiheadRingAttention(E, H, mesh=mesh, seq_axis="seq", rngs=nnx.Rngs(0))
    ring.init_cache((1, 8, E))
    with pytest.raises(ValueError, match="available for dilated attention layers"):
        ring(x_t, decode=True)
