"""``jd.models.LongNetLM`` and the pieces added for it to the layers.

* Forward shapes and dtypes; causality (a future token never changes earlier logits).
* ``generate()`` through the KV cache equals greedy decoding by repeated full forward
  passes (same tokens, logits within 1e-5) with prompts and generations longer than
  the largest segment; sampling is reproducible and top_k=1 is greedy.
* Tied embeddings are one table (input and output); remat on/off gives the same loss
  and gradients; the model over 8 simulated devices (sequence-parallel) equals the
  single-device model, loss and gradients.
* Rotary / xPos: scores depend on relative positions only, rotation keeps norms,
  the xPos centre cancels, xPos = rotary times its decay.
* The layers' ``qk_transform`` hook (NNX and Linen) and multi-token ``decode=True``
  (prefill from an empty cache, then chunks at any index, eager and under jit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import devices as mesh_devices
from flax import nnx

import jax_dilated as jd
from jax_dilated.models import LongNetConfig, LongNetLM, Rotary, XPos, cross_entropy
from jax_dilated.ops import decode as decoding

V = 32
SEGS = dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4))


def config(**kw):
    # one layer unless a test needs more: compile time dominates these tests
    base = dict(vocab_size=V, embed_dim=32, num_layers=1, num_heads=4, **SEGS, max_len=64)
    base.update(kw)
    return LongNetConfig(**base)


def tokens(seed, b, t):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (b, t)), jnp.int32)


@nnx.jit
def forward(model, x):
    return model(x)


@nnx.jit
def loss_and_grads(model, x):
    def loss_fn(m):
        return cross_entropy(m(x[:, :-1]), x[:, 1:])

    return nnx.value_and_grad(loss_fn)(model)


def test_forward_shapes_dtypes_and_causality():
    model = LongNetLM(config(num_kv_heads=2, ffn="swiglu"), rngs=nnx.Rngs(0))
    x = tokens(0, 2, 24)
    logits = forward(model, x)
    assert logits.shape == (2, 24, V) and logits.dtype == jnp.float32
    # a later token never changes earlier logits (t=13 is inside a 16-segment)
    y = x.at[:, 13].set((x[:, 13] + 1) % V)
    changed = forward(model, y)
    np.testing.assert_allclose(changed[:, :13], logits[:, :13], rtol=0, atol=1e-6)
    assert not np.allclose(changed[:, 13:], logits[:, 13:])
    # bfloat16 compute: float32 parameters, float32 logits
    bf = LongNetLM(config(dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
    assert forward(bf, x).dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(bf, nnx.Param)))
    with pytest.raises(ValueError, match="tokens must be an int array"):
        model(jnp.zeros((2, 4)))


@pytest.mark.parametrize("kw", [
    dict(positions="xpos", norm="sub", ffn="gelu", num_kv_heads=2),
    dict(positions="rotary", norm="pre", ffn="swiglu", tie_embeddings=False),
], ids=["xpos_subln_gqa", "rotary_preln_untied"])
def test_generate_equals_greedy_full_forward(kw):
    """Prompt 10 + 14 new tokens = 24 > 16, the largest segment (and not a multiple
    of it): the cache path (prefill + one token per step) must pick the same tokens
    as argmax over repeated full forward passes, with logits within 1e-5.

    The full passes run on a 24-token buffer whose not-yet-generated tail is zeros
    (one compilation): by causality (tested above) the logits at the last real
    token are those of the pass over the prefix alone."""
    model = LongNetLM(config(**kw), rngs=nnx.Rngs(1))
    prompt = tokens(1, 2, 10)
    out, logits = model.generate(prompt, 14, return_logits=True)
    assert out.shape == (2, 24) and logits.shape == (2, 14, V)
    np.testing.assert_array_equal(np.asarray(out[:, :10]), np.asarray(prompt))
    seq = jnp.zeros((2, 24), jnp.int32).at[:, :10].set(prompt)
    for i in range(14):
        full = forward(model, seq)[:, 9 + i]
        np.testing.assert_allclose(np.asarray(logits[:, i]), np.asarray(full), rtol=0,
                                   atol=1e-5, err_msg=f"step {i}")
        seq = seq.at[:, 10 + i].set(jnp.argmax(full, -1).astype(seq.dtype))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(seq))
    # the model is unchanged (no cache left behind) and decodes a prompt at once too
    assert all(b.attn.cache_index is None for b in model.blocks)
    model.init_cache(2, 24)
    prefill = nnx.jit(lambda m, x: m(x, decode=True))(model, out[:, :17])
    # (the full pass over all 24 tokens, compiled above: by causality its first 17
    # positions are the pass over those 17 tokens)
    np.testing.assert_allclose(np.asarray(prefill), np.asarray(forward(model, out)[:, :17]),
                               rtol=0, atol=1e-5)
    assert int(model.blocks[0].attn.cache_index[...]) == 17


def test_sampling():
    model = LongNetLM(config(), rngs=nnx.Rngs(2))
    prompt = tokens(2, 3, 5)
    a = model.generate(prompt, 6, temperature=1.0, rng=jax.random.key(7))
    b = model.generate(prompt, 6, temperature=1.0, rng=jax.random.key(7))
    c = model.generate(prompt, 6, temperature=1.0, rng=jax.random.key(8))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    assert a.dtype == jnp.int32 and int(a.min()) >= 0 and int(a.max()) < V
    # top_k=1 sampling is greedy: every token is the argmax of its logits
    top1, logits = model.generate(prompt, 6, temperature=0.7, top_k=1,
                                  rng=jax.random.key(3), return_logits=True)
    np.testing.assert_array_equal(np.asarray(top1[:, 5:]),
                                  np.asarray(jnp.argmax(logits, -1)))
    with pytest.raises(ValueError, match="needs rng"):
        model.generate(prompt, 2, temperature=1.0)
    with pytest.raises(ValueError, match="top_k is for sampling"):
        model.generate(prompt, 2, top_k=3)
    with pytest.raises(ValueError, match="max_len=6 is shorter"):
        model.generate(prompt, 2, max_len=6)


def test_tied_embeddings_are_one_table():
    tied = LongNetLM(config(), rngs=nnx.Rngs(3))
    untied = LongNetLM(config(tie_embeddings=False), rngs=nnx.Rngs(3))
    n = lambda m: sum(p.size for p in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert tied.head is None and n(untied) - n(tied) == V * 32
    x = jnp.asarray([[0, 1, 2, 3, 4, 5]], jnp.int32)  # tokens >= 6 are only outputs
    before = forward(tied, x)
    for model, should_change in ((tied, True), (untied, False)):
        before = forward(model, x)
        table = model.embed.embedding[...]
        model.embed.embedding[...] = table.at[6:].multiply(2.0)
        after = forward(model, x)
        # inputs unchanged; the output rows of tokens >= 6 doubled iff the head is the table
        np.testing.assert_allclose(after[..., :6], before[..., :6], rtol=1e-6)
        if should_change:
            np.testing.assert_allclose(after[..., 6:], 2 * before[..., 6:], rtol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    # the embedding gradient holds both uses: input rows and output-only rows
    _, grads = loss_and_grads(tied, tokens(3, 2, 12) % 6)
    g = np.asarray(grads["embed"]["embedding"][...])
    assert np.abs(g[6:]).max() > 0 and np.abs(g[:6]).max() > 0


def test_remat_same_loss_and_grads():
    kw = dict(param_dtype=jnp.float64, ffn="swiglu")
    plain = LongNetLM(config(**kw), rngs=nnx.Rngs(4))
    remat = LongNetLM(config(remat=True, **kw), rngs=nnx.Rngs(4))
    x = tokens(4, 2, 33)
    (l1, g1), (l2, g2) = loss_and_grads(plain, x), loss_and_grads(remat, x)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-12)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12)
    # remat really rematerialises: the backward pass holds a checkpoint
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.grad(
        lambda m: cross_entropy(m(x), x))(nnx.merge(nnx.graphdef(remat), s)))(
            nnx.state(remat)))
    assert "remat" in jaxpr or "checkpoint" in jaxpr


def test_sequence_parallel_equals_single_device():
    """Attention as distributed dilated attention over 8 simulated devices (segments
    of 16 and 32 span 2 and 4 devices' shards): same loss and gradients."""
    mesh = jax.sharding.Mesh(mesh_devices(8), ("seq",))
    kw = dict(param_dtype=jnp.float64, num_kv_heads=2, segment_lengths=(8, 16, 32),
              dilation_rates=(1, 2, 4))
    single = LongNetLM(config(**kw), rngs=nnx.Rngs(5))
    parallel = LongNetLM(config(**kw), mesh=mesh, seq_axis="seq", rngs=nnx.Rngs(5))
    x = tokens(5, 2, 65)  # 64 tokens in, 8 per device
    (l1, g1), (l2, g2) = loss_and_grads(single, x), loss_and_grads(parallel, x)
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-12)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-8, atol=1e-12)
    with pytest.raises(ValueError, match="without a mesh"):
        LongNetLM(config(), seq_axis="seq", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'model' is not an axis of the mesh"):
        LongNetLM(config(), mesh=mesh, seq_axis="model", rngs=nnx.Rngs(0))


# ------------------------------------------------------------------ torch parity

TORCH_PARITY = {
    "xpos_subln_gelu_gqa_tied_padded": dict(positions="xpos", norm="sub", ffn="gelu",
                                            num_kv_heads=2, xpos_scale_base=16.0),
    "rotary_preln_swiglu_untied_headgroups": dict(positions="rotary", norm="pre",
                                                  ffn="swiglu", tie_embeddings=False,
                                                  mode="head_groups", rotary_base=100.0),
    "none_blocked_nobias": dict(positions="none", head_offsets="blocked", use_bias=False),
}


@pytest.mark.parametrize("name", list(TORCH_PARITY))
def test_torch_parity(name):
    """LongNetLM against the PyTorch model of ``tests/torch_reference/longnet.py``
    (written from the mathematics; the same weights copied in, every parameter
    randomised so that biases and LayerNorms matter): logits and the gradients of
    every parameter for a random cotangent, float64, 24 tokens (longer than the
    largest segment, not a multiple of it), padding on one sequence."""
    torch = pytest.importorskip("torch")
    from torch_reference.longnet import LongNetLM as TorchLongNetLM

    kw = dict(TORCH_PARITY[name])
    cfg = config(param_dtype=jnp.float64, num_layers=2, **kw)
    model = LongNetLM(cfg, rngs=nnx.Rngs(9))
    rng = np.random.default_rng(9)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: jnp.asarray(0.3 * rng.standard_normal(p.shape)
                                                         + (p == 1) * 1.0), state))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    x = tokens(9, 2, 24)
    mask = np.arange(24)[None, :] < np.asarray([24, 17])[:, None]
    g = rng.standard_normal((2, 24, V))

    graphdef, rest = nnx.graphdef(model), nnx.state(model, nnx.Not(nnx.Param))

    @jax.jit
    def fwd_bwd(p):
        def f(p):
            return nnx.merge(graphdef, p, rest)(x, kv_mask=jnp.asarray(mask))
        out, vjp = jax.vjp(f, p)
        return out, vjp(jnp.asarray(g))[0]

    out, grads = fwd_bwd(nnx.state(model, nnx.Param))

    ref = TorchLongNetLM(
        vocab_size=V, embed_dim=cfg.embed_dim, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, hidden_dim=cfg.hidden_dim,
        segment_lengths=cfg.segment_lengths, dilation_rates=cfg.dilation_rates,
        mode=cfg.mode, head_offsets=cfg.head_offsets, positions=cfg.positions,
        rotary_base=cfg.rotary_base, xpos_scale_base=cfg.xpos_scale_base,
        max_len=cfg.max_len, norm=cfg.norm, ffn=cfg.ffn, tie_embeddings=cfg.tie_embeddings,
        use_bias=cfg.use_bias, layer_norm_eps=cfg.layer_norm_eps).load_jax_params(params)
    tout = ref(torch.tensor(np.asarray(x), dtype=torch.long), kv_mask=torch.tensor(mask))
    tout.backward(torch.tensor(g))
    scale = max(1.0, float(tout.detach().abs().max()))
    np.testing.assert_allclose(np.asarray(out), tout.detach().numpy(), rtol=0,
                               atol=1e-10 * scale, err_msg=f"{name} logits")
    tgrads = ref.jax_grads()
    jgrads = nnx.to_pure_dict(grads)
    assert jax.tree.structure(jgrads) == jax.tree.structure(tgrads)
    for path, a in jax.tree_util.tree_leaves_with_path(jgrads):
        b = functools.reduce(lambda t, k: t[k.key], path, tgrads)
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-9 * scale,
                                   err_msg=f"{name} d{jax.tree_util.keystr(path)}")


# ------------------------------------------------------------------ positions


def _scores(q, k):
    """[B, Tq, Tk, H] dot products."""
    return jnp.einsum("bqhd,bkhd->bqkh", q, k)


def test_rotary_and_xpos_are_relative():
    rng = np.random.default_rng(6)
    q, k = (jnp.asarray(rng.standard_normal((1, 12, 2, 8))) for _ in range(2))
    pos = jnp.arange(12)
    for transform in (Rotary(), Rotary(base=500.0), XPos(scale_base=16.0),
                      XPos(scale_base=16.0, center=5)):
        s0 = _scores(*transform(q, k, pos))
        s1 = _scores(*transform(q, k, pos + 1000))
        np.testing.assert_allclose(np.asarray(s1), np.asarray(s0), rtol=1e-9, atol=1e-9)
    # rotation keeps norms and is the identity at position 0
    rq = jd.models.rotate(q, pos)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(rq), axis=-1),
                               np.linalg.norm(np.asarray(q), axis=-1), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(rq[:, 0]), np.asarray(q[:, 0]), rtol=1e-12)
    # two tokens at the same relative distance, different absolute positions:
    # the score of (n, m) depends on n - m only (the same q, k at every position)
    same_q = jnp.broadcast_to(q[:, :1], q.shape)
    same_k = jnp.broadcast_to(k[:, :1], k.shape)
    s = np.asarray(_scores(*Rotary()(same_q, same_k, pos)))
    np.testing.assert_allclose(s[0, 7, 3], s[0, 10, 6], rtol=1e-9)
    assert not np.allclose(s[0, 7, 3], s[0, 7, 4])
    # xPos = rotary with pair i scaled by zeta_i^((n - m) / B)
    xp = XPos(scale_base=16.0, center=3)
    d, n, m = 8, 9, 2
    zeta = (np.arange(d // 2) * 2 / d + 0.4) / 1.4
    decay = np.concatenate([zeta, zeta]) ** ((n - m) / 16.0)
    rq, rk = Rotary()(q, k, pos)
    want = np.sum(np.asarray(rq[0, n]) * np.asarray(rk[0, m]) * decay, axis=-1)
    got = np.asarray(_scores(*xp(q, k, pos)))[0, n, m]
    np.testing.assert_allclose(got, want, rtol=1e-9)
    # low-precision inputs come back in their dtype
    qb = q.astype(jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in xp(qb, qb, pos))
    with pytest.raises(ValueError, match="head_dim must be even"):
        Rotary()(q[..., :7], k[..., :7], pos)
    with pytest.raises(ValueError, match="scale_base"):
        XPos(scale_base=0.0)
    with pytest.raises(ValueError, match="head_dim = embed_dim / num_heads must be even"):
        config(embed_dim=12, num_heads=4)


# --------------------------------------------------------- layer hooks (nnx, linen)

E, H = 16, 4


def _layer(**kw):
    return jd.nnx.MultiheadDilatedAttention(E, H, segment_lengths=(4, 8),
                                            dilation_rates=(1, 2), num_kv_heads=2,
                                            param_dtype=jnp.float64, rngs=nnx.Rngs(8), **kw)


def test_qk_transform_hook():
    """The layer with qk_transform = projections, the transform at positions 0..T-1,
    dilated attention, sub-LN and output projection composed by hand; NNX == Linen."""
    from jax_dilated.layers import projections

    xp = XPos(scale_base=8.0)
    layer = _layer(qk_transform=xp)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 20, E)))
    got = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))

    @jax.jit  # (op by op, this took most of the test's time)
    def by_hand(params, x):
        q, k, v = projections.project_qkv(params, x, x, x)
        q, k = xp(q, k, jnp.arange(20))
        attn = jd.dilated_attention(q, k, v, segment_lengths=(4, 8), dilation_rates=(1, 2),
                                    is_causal=True)
        return projections.project_out(params, layer.heads, attn)

    want = by_hand(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)
    plain = nnx.jit(lambda m, x: m(x, is_causal=True))(_layer(), x)
    assert not np.allclose(np.asarray(plain), np.asarray(got))
    lin = jd.linen.MultiheadDilatedAttention(E, H, segment_lengths=(4, 8),
                                             dilation_rates=(1, 2), num_kv_heads=2,
                                             qk_transform=xp, param_dtype=jnp.float64)
    out = jax.jit(functools.partial(lin.apply, is_causal=True))({"params": params}, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(got), rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError, match="qk_transform must be None or a callable"):
        _layer(qk_transform=3)
    with pytest.raises(ValueError, match="must return \\(q, k\\) with the shapes"):
        _layer(qk_transform=lambda q, k, p: (q[..., :2], k))(x, is_causal=True)


def test_multi_token_decode():
    """decode=True with several tokens: a prompt into an empty cache (one causal pass),
    then chunks and single tokens at later indices (token by token) - eager and under
    jit (lax.cond on the index) - equal to the full causal forward; Linen too.

    The chunks repeat their lengths (9, 1, 5, 5, 1) so that jit compiles each length
    once and eager mode reuses its per-op compilations: compile time is most of this
    test's time."""
    # a prompt longer than a segment, then single tokens and chunks
    chunks = ((0, 9), (9, 10), (10, 15), (15, 20), (20, 21))
    layer = _layer(qk_transform=Rotary())
    x = jnp.asarray(np.random.default_rng(10).standard_normal((2, 21, E)))
    full = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    for run in (lambda m, x: m(x, decode=True), step):
        layer.init_cache((2, 24, E), dtype=jnp.float64)
        outs = [run(layer, x[:, a:b]) for a, b in chunks]
        np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full),
                                   rtol=1e-10, atol=1e-12)
        assert int(layer.cache_index[...]) == 21
    with pytest.raises(ValueError, match="KV cache overflow: the cache holds max_len=24"):
        layer(x[:, :4], decode=True)
    # under jit a chunk past the end outputs NaN for the tokens that do not fit
    # (9 + 9 tokens, then 6 of 9 fit)
    layer.init_cache((2, 24, E), dtype=jnp.float64)
    step(layer, x[:, :9])
    step(layer, x[:, 9:18])
    over = step(layer, x[:, 12:21])
    assert np.isfinite(np.asarray(over[:, :6])).all() and np.isnan(np.asarray(over[:, 6:])).all()
    # the functions directly: a bfloat16 cache is read back as the step path reads it.
    # `fast`: the concrete-index path (the cache is a constant of the jitted function,
    # so its index is concrete: the Python branch picks the prefill, as eagerly);
    # `slow`: the traced index (lax.cond)
    q = jnp.asarray(np.random.default_rng(11).standard_normal((1, 6, 4, 8)), jnp.float32)
    cache = decoding.init_kv_cache(1, 8, 4, 8, jnp.bfloat16)
    cfg = dict(segment_lengths=(2, 4), dilation_rates=(1, 2))
    fast, c1 = jax.jit(lambda q: decoding.decode_tokens(cache, q, q, q, **cfg))(q)
    slow, c2 = jax.jit(functools.partial(decoding.decode_tokens, **cfg))(
        cache._replace(index=jnp.asarray(0)), q, q, q)
    one = jax.jit(functools.partial(decoding.decode_step, **cfg))
    for i in range(6):  # one decode_step at a time (jitted: eager op-by-op is slow)
        o, cache = one(cache, q[:, i:i + 1], q[:, i:i + 1], q[:, i:i + 1])
        np.testing.assert_allclose(np.asarray(fast[:, i]), np.asarray(o[:, 0]), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(c1.key), np.asarray(cache.key))
    np.testing.assert_allclose(np.asarray(slow), np.asarray(fast), atol=1e-6)
    # Linen: init creates the cache (under jit: it runs a full causal pass), then a
    # prompt, chunks and single tokens, eagerly (the same shapes as the NNX layer's:
    # the per-op compilations are reused)
    lin = jd.linen.MultiheadDilatedAttention(E, H, segment_lengths=(4, 8),
                                             dilation_rates=(1, 2), num_kv_heads=2,
                                             qk_transform=Rotary(), param_dtype=jnp.float64)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    cache = jax.jit(functools.partial(lin.init, decode=True))(
        jax.random.key(0), jnp.zeros((2, 24, E)))["cache"]
    assert int(cache["cache_index"]) == 0
    outs = []
    for a, b in chunks:
        out, mut = lin.apply({"params": params, "cache": cache}, x[:, a:b], decode=True,
                             mutable=["cache"])
        outs.append(out)
        cache = mut["cache"]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full),
                               rtol=1e-10, atol=1e-12)
    assert int(cache["cache_index"]) == 21


def test_config_errors():
    with pytest.raises(ValueError, match="positions must be one of"):
        config(positions="alibi")
    with pytest.raises(ValueError, match="norm must be one of"):
        config(norm="post")
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        config(vocab_size=0)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        config(embed_dim=30)
    with pytest.raises(ValueError, match="num_heads must be divisible by num_kv_heads"):
        config(num_kv_heads=3)
    with pytest.raises(TypeError, match="config must be a LongNetConfig"):
        LongNetLM(dict(vocab_size=3), rngs=nnx.Rngs(0))
    assert config(ffn="swiglu").hidden_dim == 88 and config().hidden_dim == 128
    assert config(norm="sub", num_layers=4).gamma == pytest.approx(np.sqrt(np.log(8)))


def test_decode_errors():
    """Decoding without a cache fails at trace time naming the fix; past the end of the
    cache the tokens that do not fit give NaN logits under jit, never a silent number
    (eagerly the layers raise: tests/test_decode.py)."""
    model = LongNetLM(config(), rngs=nnx.Rngs(0))
    x = tokens(0, 1, 3)
    step = nnx.jit(lambda m, x: m(x, decode=True, deterministic=True))
    with pytest.raises(ValueError, match="init_cache"):
        step(model, x)
    model.init_cache(1, 4)
    assert np.isfinite(np.asarray(step(model, x))).all()
    over = np.asarray(step(model, x[:, :2]))  # slot 3 fits, the next token does not
    assert np.isfinite(over[:, 0]).all() and np.isnan(over[:, 1]).all()
