"""Block-sparse Flax layers and the factory kinds "block_sparse" / "block_sparse_ring".

* With the diagonal pattern (each query block sees only its own key block) and
  ``block_size = w``, block-sparse attention is block-local attention, which is
  dilated attention with one branch ``(w, 1)``: the block-sparse layer must equal
  the (PyTorch-parity-tested) dilated layer with the same weights, forward and
  gradients, causal or not.
* A general pattern: the layer equals ``jd.block_sparse_attention`` on the layer's
  own projections (the attention is checked against torch in test_block_sparse.py).
* NNX and Linen layers with the same weights agree; the ring layer on 8 simulated
  devices equals the single-device layer; the factory builds both kinds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import devices as mesh_devices
from flax import nnx
from jax.sharding import AxisType, Mesh

import jax_dilated as jd
from jax_dilated import block_patterns as bp

E, H, T, BLOCK = 16, 4, 32, 8


def _x(seed=0, t=T):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((2, t, E)))


def _params(layer):
    return nnx.state(layer, nnx.Param)


def _randomize(layer, seed):
    rng = np.random.default_rng(seed)
    nnx.update(layer, jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 0.3,
                                                        p.dtype), _params(layer)))


def _loss(layer, x, is_causal):
    """``(loss, (d params, d x))`` of ``sum(sin(layer(x)))`` under jit."""
    graphdef, state = nnx.split(layer)

    @jax.jit
    def run(state, x):
        def f(state, x):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x, is_causal=is_causal)))
        loss, (dstate, dx) = jax.value_and_grad(f, argnums=(0, 1))(state, x)
        return loss, (nnx.state(nnx.merge(graphdef, dstate), nnx.Param), dx)

    return run(state, x)


def _block_sparse(pattern, **kw):
    return jd.nnx.MultiheadBlockSparseAttention(E, H, block_size=BLOCK, pattern=pattern,
                                                num_kv_heads=2, param_dtype=jnp.float64,
                                                rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("is_causal", [False, True])
def test_diagonal_pattern_equals_block_local_dilated_layer(is_causal):
    sparse = _block_sparse(bp.LocalWindow(0))
    _randomize(sparse, 1)
    dense = jd.nnx.MultiheadDilatedAttention(E, H, segment_lengths=(BLOCK,),
                                             dilation_rates=(1,), num_kv_heads=2,
                                             param_dtype=jnp.float64, rngs=nnx.Rngs(5))
    nnx.update(dense, _params(sparse))
    x = _x(2)
    (ls, (gs, gxs)), (ld, (gd, gxd)) = _loss(sparse, x, is_causal), _loss(dense, x, is_causal)
    np.testing.assert_allclose(ls, ld, rtol=1e-12)
    np.testing.assert_allclose(gxs, gxd, rtol=1e-10, atol=1e-12)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gd)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_general_pattern_equals_function_on_projections():
    pattern = (bp.LocalWindow(1) | bp.GlobalBlocks([0])) & bp.CausalBlocks()
    layer = jd.nnx.MultiheadBlockSparseAttention(E, H, block_size=BLOCK, pattern=pattern,
                                                 layer_norm=False, use_bias=False,
                                                 param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = _x(3)
    q, k, v = (jnp.einsum("bte,ehd->bthd", x, getattr(layer, name).kernel[...])
               for name in ("query", "key", "value"))
    attn = jd.block_sparse_attention(q, k, v, block_size=BLOCK, pattern=pattern,
                                     is_causal=True)
    want = jnp.einsum("bthd,hde->bte", attn, layer.out.kernel[...])
    np.testing.assert_allclose(layer(x, is_causal=True), want, rtol=1e-10, atol=1e-12)


def test_linen_equals_nnx():
    pattern = bp.LocalWindow(1) | bp.Strided(2)
    layer = _block_sparse(pattern)
    _randomize(layer, 4)
    module = jd.linen.MultiheadBlockSparseAttention(E, H, block_size=BLOCK, pattern=pattern,
                                                    num_kv_heads=2, param_dtype=jnp.float64)
    x = _x(5)
    params = nnx.to_pure_dict(_params(layer))
    out = module.apply({"params": params}, x, is_causal=True)
    np.testing.assert_allclose(out, layer(x, is_causal=True), rtol=1e-12, atol=1e-12)


def _mesh(n=8):
    return Mesh(mesh_devices(n), ("seq",), axis_types=(AxisType.Auto,))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_layer_equals_single_device(layout):
    pattern = bp.LocalWindow(2) | bp.GlobalBlocks([0])
    t = 128  # 8 devices x 16 tokens: 2 blocks (zigzag: one per chunk)
    one = _block_sparse(pattern)
    _randomize(one, 6)
    ring = _block_sparse(pattern, mesh=_mesh(), seq_axis="seq", layout=layout)
    nnx.update(ring, _params(one))
    x = _x(7, t)
    (l1, (g1, gx1)), (l8, (g8, gx8)) = _loss(one, x, True), _loss(ring, x, True)
    np.testing.assert_allclose(l8, l1, rtol=1e-12)
    np.testing.assert_allclose(gx8, gx1, rtol=1e-10, atol=1e-12)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_factory_block_sparse_kinds():
    make = jd.create_multihead_dilated_attention
    base = dict(embed_dim=E, num_heads=H, block_size=BLOCK, pattern=bp.LocalWindow(1),
                rngs=nnx.Rngs(0))
    layer = make("block_sparse", **base)
    assert type(layer) is jd.nnx.MultiheadBlockSparseAttention and layer.core.mesh is None
    _, choice = make("auto", **base, explain=True)
    assert choice.kind == "block_sparse" and "block pattern" in choice.reason
    linen_layer = make("block_sparse", api="linen", embed_dim=E, num_heads=H,
                       block_size=BLOCK, pattern=bp.LocalWindow(1))
    assert type(linen_layer) is jd.linen.MultiheadBlockSparseAttention
    # the meshes last: with fewer than 8 devices (one GPU) _mesh() skips the test
    layer = make("block_sparse_ring", **base, mesh=_mesh(), seq_axis="seq")
    assert layer.core.mesh is not None and layer.core.kind == "block_sparse"
    _, choice = make("auto", **base, mesh=_mesh(), seq_axis="seq", explain=True)
    assert choice.kind == "block_sparse_ring" and "8 devices" in choice.reason
    _, choice = make("auto", **base, mesh=_mesh(), seq_axis="seq", seq_len=256, explain=True)
    assert choice.kind == "block_sparse" and "tokens per device" in choice.reason


def test_errors():
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        _block_sparse(bp.LocalWindow(0)).__class__(E, H, block_size=0,
                                                   pattern=bp.LocalWindow(0),
                                                   rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="pattern must be a BlockPattern"):
        jd.nnx.MultiheadBlockSparseAttention(E, H, block_size=4, pattern=[[True]],
                                             rngs=nnx.Rngs(0))
