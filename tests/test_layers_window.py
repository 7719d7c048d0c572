"""Sliding windows, logit soft-capping and sinks in the layers, ``jd.attention_fn``,
``LongNetConfig`` and ``LongNetLM`` (issue 18; the operations themselves:
tests/test_window.py).

* The NNX and Linen multi-head layers with ``window=`` (ring, block-sparse) or a
  ``jd.SlidingWindow`` branch (dilated), ``logit_soft_cap=`` and ``sinks=True`` equal
  the functional op on the same projections (written out here with einsums, the
  learned sink logits passed as ``sinks=``), float64 ~1e-10, and so do the sink
  logits' gradients; the ring layer (a mesh of 2 devices, the sinks going through
  ``jd.sharded``) is compared with single-device exact attention (block-sparse with
  every block). The parameterless layers pass
  ``logit_soft_cap`` / ``window`` / ``sinks`` to their op.
* The sink parameter (``sinks.logit`` [H], zeros at initialisation) gets a finite,
  nonzero gradient and changes the output.
* Bad options are refused at construction naming the argument (NNX and Linen), and
  over a mesh where they cannot reach the op (the "allgather" and "heads"
  strategies).
* ``jd.attention_fn(logit_soft_cap=, sinks=)`` with a ``jd.SlidingWindow`` branch
  equals ``jd.dilated_attention`` with the same options.
* ``LongNetConfig`` validates ``logit_soft_cap``, ``attention_sinks`` and window
  branches; ``LongNetLM`` with a window branch, a soft-cap and sinks: forward,
  finite training gradients (the sinks' nonzero), and ``generate`` through the KV
  cache equals greedy decoding by full forward passes (float64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import make_mesh
from flax import linen as nn
from flax import nnx

import jax_dilated as jd
from jax_dilated.models import LongNetConfig, LongNetLM, cross_entropy

E, H, T = 16, 4, 16
CAP = 1.5
PATTERN = np.ones((4, 4), bool)  # every block: exact attention
TOL = dict(rtol=1e-10, atol=1e-10)


def _by_hand(p, x, attend):
    """The multi-head layer without sub-LayerNorm, written out: projections, the
    functional op ``attend(q, k, v, sinks)``, output projection."""
    q, k, v = (jnp.einsum("bte,ehd->bthd", x, p[n]["kernel"]) + p[n]["bias"]
               for n in ("query", "key", "value"))
    out = attend(q, k, v, p["sinks"]["logit"] if "sinks" in p else None)
    return jnp.einsum("bthd,hde->bte", out, p["out"]["kernel"]) + p["out"]["bias"]


def _exact(q, k, v, sinks, window):
    return jd.block_sparse_attention(q, k, v, block_size=4, pattern=PATTERN, is_causal=True,
                                     window=window, logit_soft_cap=CAP, sinks=sinks)


WINDOW_SEGS = dict(segment_lengths=(jd.SlidingWindow(3), 8), dilation_rates=(1, 2))


def _layers(kind):
    """kind -> (nnx class, linen class, options, the op on the projections). Over a
    mesh the sinks are an argument of ``jd.sharded``'s call (ring strategy)."""
    # (only "ring" needs the mesh: with fewer than 2 devices, one GPU, it skips the test)
    mesh = make_mesh((2,), ("seq",)) if kind == "ring" else None
    return {
        "dilated": (jd.nnx.MultiheadDilatedAttention, jd.linen.MultiheadDilatedAttention,
                    dict(**WINDOW_SEGS, num_kv_heads=2, logit_soft_cap=CAP, sinks=True),
                    lambda q, k, v, s: jd.dilated_attention(
                        q, k, v, **WINDOW_SEGS, is_causal=True, logit_soft_cap=CAP,
                        sinks=s)),
        "block_sparse": (jd.nnx.MultiheadBlockSparseAttention,
                         jd.linen.MultiheadBlockSparseAttention,
                         dict(block_size=4, pattern=PATTERN, window=(5, 0),
                              logit_soft_cap=CAP, sinks=True),
                         functools.partial(_exact, window=(5, 0))),
        "ring": (jd.nnx.MultiheadRingAttention, jd.linen.MultiheadRingAttention,
                 dict(mesh=mesh, seq_axis="seq", layout="zigzag", window=(6, 0),
                      logit_soft_cap=CAP, sinks=True),
                 functools.partial(_exact, window=(6, 0))),
    }[kind]


def _random_params(layer, seed):
    """Every parameter random (biases and sinks too, so that each one matters)."""
    rng = np.random.default_rng(seed)
    nnx.update(layer, jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape)),
                                   nnx.state(layer, nnx.Param)))
    return nnx.to_pure_dict(nnx.state(layer, nnx.Param))


@pytest.mark.parametrize("kind", ["dilated", "block_sparse", "ring"])
def test_multihead_layers_equal_the_op(kind):
    nnx_cls, linen_cls, kw, op = _layers(kind)
    layer = nnx_cls(E, H, layer_norm=False, param_dtype=jnp.float64, rngs=nnx.Rngs(0), **kw)
    params = _random_params(layer, 0)
    assert ("sinks" in params) == kw.get("sinks", False)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, T, E)))
    want = jax.jit(lambda p, x: _by_hand(p, x, op))(params, x)
    got = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    linen = linen_cls(embed_dim=E, num_heads=H, layer_norm=False, param_dtype=jnp.float64,
                      **kw)
    got_linen = jax.jit(lambda p, x: linen.apply({"params": p}, x, is_causal=True))(params, x)
    np.testing.assert_allclose(np.asarray(got_linen), np.asarray(want), **TOL)
    if "sinks" in params:  # the sink logits' gradient (over a mesh: through jd.sharded)
        g = jnp.asarray(np.random.default_rng(2).standard_normal((2, T, E)))
        want_g = jax.jit(jax.grad(lambda p: jnp.sum(_by_hand(p, x, op) * g)))(params)
        got_g = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) * g)))(layer)
        np.testing.assert_allclose(np.asarray(got_g["sinks"]["logit"][...]),
                                   np.asarray(want_g["sinks"]["logit"]), **TOL)


def test_parameterless_layers_pass_the_options():
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((2, T, H, 4))) for _ in range(3))
    sinks = jnp.asarray(rng.standard_normal(H))
    layer = jd.nnx.DilatedAttention(**WINDOW_SEGS, logit_soft_cap=CAP)
    linen = jd.linen.DilatedAttention(**WINDOW_SEGS, logit_soft_cap=CAP)
    # one compilation (eager calls dispatch op by op, slowly)
    want, *got = jax.jit(lambda q, k, v, s: (
        jd.dilated_attention(q, k, v, **WINDOW_SEGS, logit_soft_cap=CAP, sinks=s),
        layer(q, k, v, sinks=s), linen.apply({}, q, k, v, sinks=s)))(q, k, v, sinks)
    for out in got:
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)
    # the ring last: with fewer than 2 devices (one GPU) make_mesh skips the test
    mesh = make_mesh((2,), ("seq",))
    ring = jd.nnx.RingAttention(mesh=mesh, seq_axis="seq", window=(4, 0), logit_soft_cap=CAP)
    linen = jd.linen.RingAttention(mesh=mesh, seq_axis="seq", window=(4, 0),
                                   logit_soft_cap=CAP)
    want, *got = jax.jit(lambda q, k, v: (
        _exact(q, k, v, None, (4, 0)), ring(q, k, v, is_causal=True),
        linen.apply({}, q, k, v, is_causal=True)))(q, k, v)
    for out in got:
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)
    want, *got = jax.jit(lambda q, k, v, s: (
        _exact(q, k, v, s, (4, 0)), ring(q, k, v, is_causal=True, sinks=s),
        linen.apply({}, q, k, v, is_causal=True, sinks=s)))(q, k, v, sinks)
    for out in got:
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)


def test_sinks_parameter_is_learned():
    """Zeros at initialisation; d loss / d sinks finite and nonzero; other sinks give
    another output (NNX and Linen alike)."""
    layer = jd.nnx.MultiheadBlockSparseAttention(
        E, H, block_size=4, pattern=PATTERN, window=(3, 0), sinks=True,
        param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(layer.sinks["logit"][...]), np.zeros(H))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, T, E)))
    g = jnp.asarray(np.random.default_rng(4).standard_normal((1, T, E)))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) * g)))(layer)
    d = np.asarray(grads["sinks"]["logit"][...])
    assert d.shape == (H,) and np.all(np.isfinite(d)) and np.all(np.abs(d) > 1e-8), d
    run = nnx.jit(lambda m, x: m(x, is_causal=True))
    before = run(layer, x)
    layer.sinks["logit"][...] = jnp.full((H,), 2.0)
    assert np.abs(np.asarray(run(layer, x) - before)).max() > 1e-3
    linen = jd.linen.MultiheadBlockSparseAttention(
        embed_dim=E, num_heads=H, block_size=4, pattern=PATTERN, sinks=True,
        param_dtype=jnp.float64)
    params = jax.jit(linen.init)(jax.random.key(0), x)["params"]
    np.testing.assert_array_equal(np.asarray(nn.unbox(params)["sinks"]["logit"]),
                                  np.zeros(H))


def test_bad_options_are_refused_at_construction():
    bs = dict(block_size=4, pattern=PATTERN)
    cases = [
        (ValueError, r"window\[0\]", dict(window=(-1, 0))),
        (TypeError, "window must be None or a pair", dict(window=3)),
        (ValueError, "logit_soft_cap must be a finite float > 0", dict(logit_soft_cap=0.0)),
        (TypeError, "sinks must be a Python bool", dict(sinks=np.zeros(H))),
    ]
    for err, match, kw in cases:
        with pytest.raises(err, match=match):
            jd.nnx.MultiheadBlockSparseAttention(E, H, **bs, **kw, rngs=nnx.Rngs(0))
        with pytest.raises(err, match=match):
            jd.linen.MultiheadBlockSparseAttention(embed_dim=E, num_heads=H, **bs, **kw)
    with pytest.raises(ValueError, match="logit_soft_cap must be a finite float"):
        jd.nnx.MultiheadDilatedAttention(E, H, **WINDOW_SEGS, logit_soft_cap=float("inf"),
                                         rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dilation_rates"):  # a window branch has rate 1
        jd.linen.MultiheadDilatedAttention(embed_dim=E, num_heads=H,
                                           segment_lengths=(jd.SlidingWindow(3), 8),
                                           dilation_rates=(2, 2))
    # causality is the call's: a right extent is refused there
    layer = jd.nnx.MultiheadBlockSparseAttention(E, H, **bs, window=(2, 2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="is_causal=True"):
        layer(jnp.ones((1, T, E)), is_causal=True)

    # last: with fewer than 2 devices (one GPU) make_mesh skips the test
    mesh = make_mesh((2,), ("seq",))
    # over a mesh: only exact attention's own ring carries them ("auto" picks it);
    # dilated attention runs every strategy itself and takes them (test_strategies.py)
    with pytest.raises(ValueError, match="strategy='ring' .* only"):
        jd.nnx.MultiheadRingAttention(E, H, mesh=mesh, seq_axis="seq", window=(4, 0),
                                      strategy="heads", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="strategy='ring' .* only"):
        jd.linen.MultiheadRingAttention(embed_dim=E, num_heads=H, mesh=mesh,
                                        seq_axis="seq", logit_soft_cap=CAP,
                                        strategy="allgather")
    jd.linen.MultiheadDilatedAttention(embed_dim=E, num_heads=H, **WINDOW_SEGS,
                                       logit_soft_cap=CAP, mesh=mesh, seq_axis="seq",
                                       strategy="allgather")
    with pytest.raises(ValueError, match="sinks over a mesh run with strategy='ring'"):
        jd.nnx.MultiheadRingAttention(E, H, mesh=mesh, seq_axis="seq", sinks=True,
                                      strategy="heads", rngs=nnx.Rngs(0))


def test_attention_fn_options():
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((2, T, H, 4))) for _ in range(3))
    sinks = rng.standard_normal(H)
    fn = jd.attention_fn(**WINDOW_SEGS, logit_soft_cap=CAP, sinks=sinks)
    causal = nnx.make_causal_mask(jnp.ones((2, T)))
    want = jd.dilated_attention(q, k, v, **WINDOW_SEGS, is_causal=True, logit_soft_cap=CAP,
                                sinks=jnp.asarray(sinks))
    for got in (fn(q, k, v, mask=causal), jax.jit(lambda q, k, v, m: fn(q, k, v, mask=m))(
            q, k, v, causal)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    with pytest.raises(ValueError, match="num_heads=4"):
        jd.attention_fn(**WINDOW_SEGS, sinks=np.zeros(3))(q, k, v)
    with pytest.raises(ValueError, match="sinks must be None or a float array"):
        jd.attention_fn(**WINDOW_SEGS, sinks=np.zeros((1, H)))


# ----------------------------------------------------------------------------- model

V = 32
MODEL = dict(vocab_size=V, embed_dim=E, num_layers=1, num_heads=H, num_kv_heads=2,
             segment_lengths=(jd.SlidingWindow(5), 8, 16), dilation_rates=(1, 2, 4),
             max_len=24, logit_soft_cap=4.0, attention_sinks=True,
             param_dtype=jnp.float64)


def test_longnet_config_validation():
    with pytest.raises(ValueError, match="LongNetConfig.logit_soft_cap must be a finite"):
        LongNetConfig(**{**MODEL, "logit_soft_cap": -1.0})
    with pytest.raises(TypeError, match="LongNetConfig.logit_soft_cap must be None"):
        LongNetConfig(**{**MODEL, "logit_soft_cap": "big"})
    with pytest.raises(TypeError, match="LongNetConfig.attention_sinks must be a Python bool"):
        LongNetConfig(**{**MODEL, "attention_sinks": 1})
    with pytest.raises(ValueError, match="dilation_rates"):
        LongNetConfig(**{**MODEL, "dilation_rates": (2, 2, 4)})
    cfg = LongNetConfig(**MODEL)
    assert cfg.segment_lengths[0] == jd.SlidingWindow(5) and cfg.attention_sinks


def test_longnet_window_softcap_sinks_train_and_generate():
    """Forward, a finite training gradient (sinks' nonzero), and generate() through
    the KV cache (prefill 6, then 10 tokens one by one: past the window and the 16
    segment) equal to greedy decoding by full forward passes, float64."""
    model = LongNetLM(LongNetConfig(**MODEL), rngs=nnx.Rngs(0))
    assert model.blocks[0].attn.sinks["logit"][...].shape == (H,)
    rng = np.random.default_rng(6)
    model.blocks[0].attn.sinks["logit"][...] = jnp.asarray(rng.standard_normal(H))
    tokens = jnp.asarray(rng.integers(0, V, (2, 17)), jnp.int32)

    @nnx.jit
    def loss_and_grads(m, x):
        return nnx.value_and_grad(lambda m: cross_entropy(m(x[:, :-1]), x[:, 1:]))(m)

    loss, grads = loss_and_grads(model, tokens)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    assert np.all(np.abs(np.asarray(grads.blocks[0].attn.sinks["logit"][...])) > 1e-10)

    prompt = tokens[:, :6]
    out, logits = model.generate(prompt, 10, return_logits=True)
    forward = nnx.jit(lambda m, x: m(x))
    seq = jnp.zeros((2, 16), jnp.int32).at[:, :6].set(prompt)
    for i in range(10):  # causal: the zeros after position 5 + i do not matter
        full = forward(model, seq)[:, 5 + i]
        np.testing.assert_allclose(np.asarray(logits[:, i]), np.asarray(full), **TOL,
                                   err_msg=f"step {i}")
        seq = seq.at[:, 6 + i].set(jnp.argmax(full, -1).astype(seq.dtype))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(seq))
