"""The online softmax of ``jax_dilated.core.softmax`` against PyTorch.

* ``merge_partials`` of two kernel partials over *disjoint* key sets equals
  attention over their union (output, log-sum-exp and gradients);
* rows that are ``-inf`` on both sides merge to ``(0, -inf)`` with zero, finite
  gradients; a row that is ``-inf`` on one side returns the other side;
* the running state (``init_state`` / ``update_state`` / ``finalize_state``),
  fed logits block by block, equals a dense softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_reference as ref
from _helpers import assert_close, to_torch

from jax_dilated.backends import KernelArgs, xla
from jax_dilated.core import softmax


@pytest.mark.parametrize("causal", [False, True])
def test_merge_of_disjoint_partials_is_full_attention(causal):
    """Split the keys at random into two sets; kernel partials merged by
    ``merge_partials`` give full attention, forward and gradient (cotangents on
    both the merged output and the merged lse)."""
    rng = np.random.default_rng(11 + causal)
    n, lq, lk, h, hkv, d = 2, 15, 22, 4, 2, 8
    q = rng.standard_normal((n, lq, h, d))
    k = rng.standard_normal((n, lk, hkv, d))
    v = rng.standard_normal((n, lk, hkv, d))
    do = rng.standard_normal((n, lq, h, d))
    dlse = rng.standard_normal((n, lq, h))
    valid = rng.random((n, lk)) < 0.8
    valid[1, :] = False  # batch row 1: no key on either side
    pos = np.arange(lk)
    parts = [np.sort(i) for i in np.array_split(rng.permutation(lk), 2)]
    args = KernelArgs(scale=0.4, is_causal=causal, block_q=8, block_k=8)

    @jax.jit
    def merged(q, k, v):
        partials = [xla.attention(q, k[:, i], v[:, i], args, q_positions=jnp.arange(lq),
                                  k_positions=jnp.asarray(pos[i]),
                                  kv_valid=jnp.asarray(valid[:, i])) for i in parts]
        return softmax.merge_partials(*partials[0], *partials[1])

    (o, lse, lse_lo), vjp = jax.vjp(merged, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    # the cotangent of lse + lse_lo (lse_lo's own is ignored: a constant correction)
    grads = vjp((jnp.asarray(do), jnp.asarray(dlse), jnp.asarray(dlse)))
    lse = lse + lse_lo

    qt, kt, vt = (to_torch(x, requires_grad=True) for x in (q, k, v))
    o_t, lse_t = ref.dense_attention(qt, kt, vt, scale=0.4, is_causal=causal,
                                     kv_mask=torch.tensor(valid), return_lse=True)
    grads_t = torch.autograd.grad((o_t, lse_t), (qt, kt, vt),
                                  grad_outputs=(to_torch(do), to_torch(dlse)))
    assert_close(o, o_t, 1e-10, "o")
    assert_close(lse, lse_t, 1e-10, "lse")
    assert np.all(np.asarray(o)[1] == 0) and np.all(np.isneginf(np.asarray(lse)[1]))
    for g, g_t, name in zip(grads, grads_t, ("dq", "dk", "dv")):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert_close(g, g_t, 1e-10, name)


def _torch_merge(o1, lse1, lo1, o2, lse2, lo2):
    """The merge formula written directly (rows with a finite lse somewhere), on the
    log-sum-exps ``lse_i + lo_i``."""
    lse1, lse2 = lse1 + lo1, lse2 + lo2
    lse = torch.logaddexp(lse1, lse2)
    return (torch.exp(lse1 - lse)[..., None] * o1 + torch.exp(lse2 - lse)[..., None] * o2,
            lse)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_merge_partials_with_empty_rows(dtype):
    """Row kinds: both finite, only one side finite, both ``-inf``.

    Both ``-inf``: ``o = 0``, ``lse = -inf``, ``lse_lo = 0``, all gradients of that
    row exactly zero. One side ``-inf``: the other side comes back, its gradient
    passes through and the empty side's ``o`` gets zero gradient. Finite rows match
    PyTorch autograd of the merge formula on ``lse_i + lo_i``; both parts of an
    input's log-sum-exp get its gradient. No NaN anywhere.
    """
    rng = np.random.default_rng(5)
    rows, d = 12, 8
    o1, o2, do = (rng.standard_normal((rows, d)) for _ in range(3))
    # dlo: a cotangent on the merged lse_lo, which the merge ignores
    lse1, lse2, dlse, dlo = (3 * rng.standard_normal(rows) for _ in range(4))
    lo1, lo2 = (1e-4 * rng.standard_normal(rows) for _ in range(2))
    lse1[[0, 1, 2]] = -np.inf   # rows 0-2: side 1 empty
    lse2[[2, 3, 4]] = -np.inf   # rows 2-4: side 2 empty; row 2: both empty
    lo1[[0, 1, 2]] = lo2[[2, 3, 4]] = 0.0
    lse2[5] = lse1[5] + 800.0   # far apart: no overflow
    inputs = [jnp.asarray(x, dtype) for x in (o1, lse1, lo1, o2, lse2, lo2)]
    (o, lse, lse_lo), vjp = jax.vjp(softmax.merge_partials, *inputs)
    assert o.dtype == dtype and lse.dtype == dtype and lse_lo.dtype == dtype
    g_o1, g_l1, g_lo1, g_o2, g_l2, g_lo2 = (
        np.asarray(x, np.float64) for x in
        vjp(tuple(jnp.asarray(x, dtype) for x in (do, dlse, dlo))))
    np.testing.assert_array_equal(g_l1, g_lo1)
    np.testing.assert_array_equal(g_l2, g_lo2)
    o, lse_lo = np.asarray(o, np.float64), np.asarray(lse_lo, np.float64)
    lse = np.asarray(lse, np.float64) + lse_lo
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse_lo))
    for g in (g_o1, g_l1, g_o2, g_l2):
        assert np.all(np.isfinite(g))
    # both empty
    assert np.all(o[2] == 0) and np.isneginf(lse[2]) and lse_lo[2] == 0
    assert np.all(g_o1[2] == 0) and np.all(g_o2[2] == 0) and g_l1[2] == 0 and g_l2[2] == 0
    # one side empty: the other side, unchanged
    tol = 1e-12 if dtype == jnp.float64 else 1e-6
    np.testing.assert_allclose(o[[0, 1]], o2[[0, 1]], rtol=tol, atol=tol)
    np.testing.assert_allclose(o[[3, 4]], o1[[3, 4]], rtol=tol, atol=tol)
    assert np.all(g_o1[[0, 1]] == 0) and np.all(g_o2[[3, 4]] == 0)
    # everything but row 2 against torch autograd of the formula
    keep = [i for i in range(rows) if i != 2]
    t_in = [to_torch(x[keep], requires_grad=True) for x in (o1, lse1, lo1, o2, lse2, lo2)]
    o_t, lse_t = _torch_merge(*t_in)
    g_t = torch.autograd.grad((o_t, lse_t), t_in[:2] + t_in[3:5],
                              grad_outputs=(to_torch(do[keep]), to_torch(dlse[keep])))
    assert_close(o[keep], o_t, tol, "o")
    assert_close(lse[keep], lse_t, tol, "lse")
    for g, gt, name in zip((g_o1, g_l1, g_o2, g_l2), g_t, ("do1", "dlse1", "do2", "dlse2")):
        assert_close(g[keep], gt, tol * 10, name)


def test_running_state_matches_dense_softmax():
    """Folding logits into the running state in blocks (one block fully masked
    for some rows, one row masked everywhere) equals a dense softmax."""
    rng = np.random.default_rng(2)
    rows, keys, d = 6, 20, 4
    s = 4 * rng.standard_normal((rows, keys))
    v = rng.standard_normal((keys, d))
    s[0] = -np.inf               # a row without keys
    s[1:3, :8] = -np.inf         # the first block is empty for rows 1-2
    state = softmax.init_state((rows,), d, jnp.float64)
    for start in range(0, keys, 8):
        blk = slice(start, start + 8)
        state, _ = softmax.update_state(state, jnp.asarray(s[:, blk]),
                                        lambda p, blk=blk: p @ jnp.asarray(v[blk]))
    o, lse, lse_lo = softmax.finalize_state(state)
    assert lse_lo[0] == 0
    lse = lse + lse_lo
    st = torch.tensor(s)
    lse_t = torch.logsumexp(st, dim=-1)
    p_t = torch.nan_to_num(torch.softmax(st, dim=-1), nan=0.0)
    o_t = p_t @ torch.tensor(v)
    assert_close(o, o_t, 1e-12, "o")
    assert_close(lse, lse_t, 1e-12, "lse")
    assert np.all(np.asarray(o)[0] == 0) and np.isneginf(np.asarray(lse)[0])
