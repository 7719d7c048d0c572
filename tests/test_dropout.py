"""Attention-probability dropout of ``dilated_attention``.

Contract: rate 0 is exactly no dropout; for a rate ``> 0`` the result is a
deterministic function of ``dropout_rng`` (same key, same numbers, including
gradients; another key, other numbers); probabilities are dropped with
probability ``rate`` and the kept ones scaled by ``1 / (1 - rate)`` while the
softmax denominators see no dropout, so the expectation over keys is the
undropped output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dilated as jd

CFG = dict(segment_lengths=(8, 16), dilation_rates=(1, 2))
RATE = 0.3


def _inputs(seed=0, b=1, t=16, h=2, d=8):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d))) for _ in range(3))
    return q, k, v


def test_rate_zero_is_exactly_no_dropout():
    q, k, v = _inputs()
    plain = jd.dilated_attention(q, k, v, **CFG, is_causal=True)
    with_key = jd.dilated_attention(q, k, v, **CFG, is_causal=True, dropout_rate=0.0,
                                    dropout_rng=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(with_key))


@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_same_key_same_result_other_key_other_result(mode):
    q, k, v = _inputs(1)
    f = jax.jit(lambda key: jd.dilated_attention(q, k, v, **CFG, mode=mode,
                                                 dropout_rate=RATE, dropout_rng=key))
    a, a2 = f(jax.random.key(0)), f(jax.random.key(0))
    b = f(jax.random.key(1))
    plain = jd.dilated_attention(q, k, v, **CFG, mode=mode)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    assert np.max(np.abs(np.asarray(a) - np.asarray(b))) > 1e-2
    assert np.max(np.abs(np.asarray(a) - np.asarray(plain))) > 1e-2
    assert np.all(np.isfinite(np.asarray(a)))


def test_drops_at_rate_and_rescales():
    """With one rate-1 branch covering the sequence and ``v`` the identity
    (value of key ``t`` is the unit vector ``e_t``), the output *is* the
    dropped probability row: each entry is either 0 or ``p / (1 - rate)``, and
    the fraction of dropped (positive-probability) entries is about ``rate``."""
    t = 16
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, t, 1, t)))
    k = jnp.asarray(rng.standard_normal((1, t, 1, t)))
    v = jnp.eye(t, dtype=jnp.float64)[None, :, None, :]
    cfg = dict(segment_lengths=(t,), dilation_rates=(1,))
    p = np.asarray(jd.dilated_attention(q, k, v, **cfg))
    f = jax.jit(jax.vmap(lambda key: jd.dilated_attention(q, k, v, **cfg, dropout_rate=RATE,
                                                          dropout_rng=key)))
    out = np.asarray(f(jax.random.split(jax.random.key(3), 20)))  # [20, 1, t, 1, t]
    # rtol 1e-6: the kernel forms the keep scale 1/(1-rate) in float32
    kept = np.isclose(out, p / (1 - RATE), rtol=1e-6, atol=0)
    dropped = out == 0
    assert np.all(kept | dropped)
    frac = dropped.mean()  # 20 * 256 Bernoulli(0.3) draws: sd 0.0064
    assert abs(frac - RATE) < 0.03, frac


@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_mean_over_keys_is_undropped_output(mode):
    """Mean of 200 dropout samples vs the undropped output, elementwise in
    units of the sample standard error: max |z| < 6 (512 elements) and the mean
    of z^2 near 1 (between 0.3 and 3)."""
    q, k, v = _inputs(2)
    kw = dict(CFG, mode=mode, is_causal=True)
    plain = np.asarray(jd.dilated_attention(q, k, v, **kw))
    n = 200
    f = jax.jit(jax.vmap(lambda key: jd.dilated_attention(q, k, v, **kw, dropout_rate=RATE,
                                                          dropout_rng=key)))
    samples = np.asarray(f(jax.random.split(jax.random.key(7), n)))
    mean, std = samples.mean(0), samples.std(0, ddof=1)
    random_part = std > 0
    # entries no dropout can touch (uncovered positions) are exactly the plain output
    np.testing.assert_array_equal(mean[~random_part], plain[~random_part])
    assert random_part.mean() > 0.5
    z = (mean - plain)[random_part] / (std[random_part] / np.sqrt(n))
    assert np.max(np.abs(z)) < 6.0, np.max(np.abs(z))
    assert 0.3 < np.mean(z ** 2) < 3.0, np.mean(z ** 2)


def test_gradients_finite_and_reproducible():
    """Gradients with dropout are finite, identical for the same key, different for
    another key; a batch row without any valid key stays exactly 0 with zero grads."""
    q, k, v = _inputs(3, b=2)
    g = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape))
    mask = jnp.asarray(np.random.default_rng(10).random((2, 16)) < 0.7).at[1].set(False)

    @jax.jit
    def out_and_grads(q, k, v, key):
        out, vjp = jax.vjp(lambda q, k, v: jd.dilated_attention(
            q, k, v, **CFG, is_causal=True, kv_mask=mask, dropout_rate=RATE,
            dropout_rng=key), q, k, v)
        return out, vjp(g)

    out_a, grads_a = out_and_grads(q, k, v, jax.random.key(0))
    out_a2, grads_a2 = out_and_grads(q, k, v, jax.random.key(0))
    _, grads_b = out_and_grads(q, k, v, jax.random.key(1))
    assert np.all(np.asarray(out_a)[1] == 0)
    for ga, ga2, gb in zip(grads_a, grads_a2, grads_b):
        ga, ga2, gb = np.asarray(ga), np.asarray(ga2), np.asarray(gb)
        assert np.all(np.isfinite(ga))
        np.testing.assert_array_equal(ga, ga2)
        assert np.max(np.abs(ga - gb)) > 1e-3
        assert np.all(ga[1] == 0)


def test_gradient_matches_finite_differences():
    """For a fixed key the dropped function is smooth in q, k, v and its custom
    VJP is its true derivative (central differences, float64)."""
    q, k, v = _inputs(5, t=8, h=2, d=4)
    g = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape))
    key = jax.random.key(2)

    def loss(q, k, v):
        out = jd.dilated_attention(q, k, v, segment_lengths=(4, 8), dilation_rates=(1, 2),
                                   is_causal=True, dropout_rate=RATE, dropout_rng=key)
        return jnp.sum(g * out)

    loss_j = jax.jit(loss)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    rng = np.random.default_rng(8)
    eps = 1e-6
    for i, x in enumerate((q, k, v)):
        direction = jnp.asarray(rng.standard_normal(x.shape))
        args_p = [q, k, v]
        args_m = [q, k, v]
        args_p[i] = x + eps * direction
        args_m[i] = x - eps * direction
        fd = (loss_j(*args_p) - loss_j(*args_m)) / (2 * eps)
        an = jnp.sum(grads[i] * direction)
        assert abs(float(fd) - float(an)) < 1e-6 * max(1.0, abs(float(an))), (i, fd, an)
