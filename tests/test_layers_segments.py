"""Packed sequences (``segment_ids``) through the layers and ``LongNetLM`` (issue 17).

* The NNX and Linen multi-head layers with ``segment_ids`` equal the functional op
  with ``segment_ids`` on the same projections (written out here with einsums), and
  differ from the unpacked call (float64).
* ``LongNetLM`` is packing-invariant: a packed row's logits equal each document run
  alone through the model, with rotary and with xPos positions (which restart at
  each document), and so do the gradients of every parameter (packed vs the sum over
  the documents alone), float64 ~1e-10.
* The positions a ``qk_transform`` sees restart at each document (the model test
  cannot see them: rotary and xPos scores are relative).
* Bad ``segment_ids`` and ``decode=True`` with ``segment_ids`` are errors naming
  ``segment_ids``.
* ``jd.attention_fn(packed=True)`` reads documents from Flax's document mask (eager
  and traced), and refuses what it cannot represent (ValueError eagerly, NaN traced).
* A mesh-built layer passes ``segment_ids`` through ``jd.sharded``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import devices as mesh_devices
from flax import nnx

import jax_dilated as jd
from jax_dilated.models import LongNetConfig, LongNetLM

E, H, T = 16, 4, 24
# small: compile time dominates these tests
SEGS = dict(segment_lengths=(4, 8), dilation_rates=(1, 2))
DOCS = (9, 15)                        # a packed row of two documents (short last segments)
IDS = np.repeat(np.arange(len(DOCS)), DOCS)[None]  # [1, T]


def _ids(batch=2):
    """Two rows of different packings: documents (9, 15) and (5, 3, 16)."""
    other = np.repeat(np.arange(3), (5, 3, 16))
    return jnp.asarray(np.stack([IDS[0], other])[:batch], jnp.int32)


def _by_hand(p, x, attend):
    """The multi-head layer without sub-LayerNorm, written out: projections, the
    functional op ``attend(q, k, v)``, output projection."""
    q, k, v = (jnp.einsum("bte,ehd->bthd", x, p[n]["kernel"]) + p[n]["bias"]
               for n in ("query", "key", "value"))
    return jnp.einsum("bthd,hde->bte", attend(q, k, v), p["out"]["kernel"]) + p["out"]["bias"]


LAYERS = {
    "dilated": (jd.nnx.MultiheadDilatedAttention, jd.linen.MultiheadDilatedAttention,
                dict(**SEGS, num_kv_heads=2),
                lambda q, k, v, ids: jd.dilated_attention(q, k, v, **SEGS, is_causal=True,
                                                          segment_ids=ids)),
    "block_sparse": (jd.nnx.MultiheadBlockSparseAttention,
                     jd.linen.MultiheadBlockSparseAttention,
                     dict(block_size=4, pattern=np.tril(np.ones((6, 6), bool))),
                     lambda q, k, v, ids: jd.block_sparse_attention(
                         q, k, v, block_size=4, pattern=np.tril(np.ones((6, 6), bool)),
                         is_causal=True, segment_ids=ids)),
}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_layers_equal_the_op_with_segment_ids(kind):
    nnx_cls, linen_cls, kw, op = LAYERS[kind]
    layer = nnx_cls(E, H, layer_norm=False, param_dtype=jnp.float64, rngs=nnx.Rngs(0), **kw)
    rng = np.random.default_rng(0)
    # random biases too, so that every parameter matters
    nnx.update(layer, jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape)),
                                   nnx.state(layer, nnx.Param)))
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    x = jnp.asarray(rng.standard_normal((2, T, E)))
    linen = linen_cls(embed_dim=E, num_heads=H, layer_norm=False, param_dtype=jnp.float64,
                      **kw)
    graphdef, state = nnx.split(layer)

    @jax.jit  # one program for the four (one compilation, not three)
    def run(state, p, x, s):
        return (_by_hand(p, x, lambda q, k, v: op(q, k, v, s)),
                _by_hand(p, x, lambda q, k, v: op(q, k, v, None)),
                nnx.merge(graphdef, state)(x, is_causal=True, segment_ids=s),
                linen.apply({"params": p}, x, is_causal=True, segment_ids=s))

    want, plain, got, got_linen = run(state, params, x, _ids())
    assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 1e-3  # packing matters
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.asarray(got_linen), np.asarray(want), rtol=1e-10,
                               atol=1e-10)


def test_parameterless_layers_pass_segment_ids():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, T, H, 4))) for _ in range(3))
    layer, linen = jd.nnx.DilatedAttention(**SEGS), jd.linen.DilatedAttention(**SEGS)
    # one program for the three (one compilation, not three)
    want, got, got_linen = jax.jit(lambda q, k, v, s: (
        jd.dilated_attention(q, k, v, **SEGS, segment_ids=s),
        layer(q, k, v, segment_ids=s),
        linen.apply({}, q, k, v, segment_ids=s)))(q, k, v, _ids())
    for out in (got, got_linen):
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-12, atol=1e-12)


def _model(positions):
    cfg = LongNetConfig(vocab_size=32, embed_dim=E, num_layers=1, num_heads=H,
                        num_kv_heads=2, **SEGS, max_len=T, positions=positions,
                        xpos_scale_base=8.0, param_dtype=jnp.float64)
    model = LongNetLM(cfg, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(2)  # every parameter random: LayerNorms and biases matter
    nnx.update(model, jax.tree.map(lambda p: jnp.asarray(0.3 * rng.standard_normal(p.shape)
                                                         + (p == 1) * 1.0),
                                   nnx.state(model, nnx.Param)))
    return model


# LongNetLM's packed row: two documents of DOC tokens (short last segments of 3 in both
# branches), so that the documents alone run as one batch of two rows
DOC = 11


@pytest.mark.parametrize("positions", ["rotary", "xpos"])
def test_longnet_packed_row_equals_documents_alone(positions):
    """Logits and parameter gradients (for a random cotangent) of a packed row equal
    those of its documents run alone (as a batch: its parameter gradients are the sum
    over the documents): attention and positions restart at each document."""
    model = _model(positions)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 32, (1, 2 * DOC)), jnp.int32)
    cot = jnp.asarray(rng.standard_normal((1, 2 * DOC, 32)))
    ids = jnp.asarray(np.repeat([0, 1], DOC)[None], jnp.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def fwd_bwd(p, tokens, cot, ids):
        def f(p):
            return nnx.merge(graphdef, p, rest)(tokens, segment_ids=ids,
                                                deterministic=True)
        out, vjp = jax.vjp(f, p)
        return out, vjp(cot)[0]

    # one program for both (one compilation, not one per shape)
    (packed, g_packed), (alone, g_alone) = jax.jit(lambda p, tokens, cot: (
        fwd_bwd(p, tokens, cot, ids),
        fwd_bwd(p, tokens.reshape(2, DOC), cot.reshape(2, DOC, 32), None)))(params, tokens, cot)
    np.testing.assert_allclose(np.asarray(packed), np.asarray(alone).reshape(packed.shape),
                               rtol=1e-10, atol=1e-10)
    for x, y in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_alone)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-9, atol=1e-10)


def test_bad_segment_ids_and_decode_are_errors():
    layer = jd.nnx.MultiheadDilatedAttention(E, H, **SEGS, rngs=nnx.Rngs(0))
    x = jnp.ones((2, T, E))
    with pytest.raises(ValueError, match="segment_ids"):
        layer(x, segment_ids=jnp.zeros((2, T - 1), jnp.int32))
    with pytest.raises(TypeError, match="segment_ids"):
        layer(x, segment_ids=jnp.zeros((2, T)))
    linen = jd.linen.MultiheadDilatedAttention(embed_dim=E, num_heads=H, **SEGS)
    params = jax.eval_shape(linen.init, jax.random.key(0), x)  # shapes only: cheap
    with pytest.raises(ValueError, match="segment_ids"):
        jax.eval_shape(lambda p: linen.apply(p, x, segment_ids=jnp.zeros((1, T), jnp.int32)),
                       params)
    layer.init_cache((2, T, E))
    with pytest.raises(ValueError, match="decode=True takes no segment_ids"):
        layer(x[:, :1], decode=True, segment_ids=jnp.zeros((2, 1), jnp.int32))
    model = LongNetLM(LongNetConfig(vocab_size=32, embed_dim=E, num_layers=1, num_heads=H,
                                    **SEGS, max_len=T), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, T), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        model(tokens, segment_ids=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="decode=True takes no segment_ids"):
        model(tokens, decode=True, segment_ids=jnp.zeros((2, T), jnp.int32))


def test_qk_transform_positions_restart_at_each_document():
    """Rotary and xPos scores depend on relative positions only, so the model test
    above cannot see where positions start: the layer's ``qk_transform`` receives the
    position within the document (a run of equal ids; a repeated id after another
    document starts a new run), and Rotary / XPos take such [B, T] positions row by
    row."""
    ids = np.array([[3, 3, 3, 1, 1, 3, 3, 7], [0, 0, 0, 0, 0, 0, 0, 0]])
    want = np.array([[0, 1, 2, 0, 1, 0, 1, 0], list(range(8))])  # by hand
    seen = []

    class Seen(Exception):
        pass

    def spy(q, k, positions):  # records the positions, then skips the attention
        seen.append(np.asarray(positions))
        raise Seen

    layer = jd.nnx.MultiheadDilatedAttention(8, 2, segment_lengths=(4,), dilation_rates=(1,),
                                             qk_transform=spy, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 8, 8)), jnp.float32)
    with pytest.raises(Seen):
        layer(x, segment_ids=jnp.asarray(ids, jnp.int32))
    np.testing.assert_array_equal(seen[-1], want)
    rng = np.random.default_rng(5)
    q, k = (jnp.asarray(rng.standard_normal((2, 8, 2, 4))) for _ in range(2))
    for fn in (jd.models.Rotary(), jd.models.XPos(scale_base=8.0, center=4)):
        fn = jax.jit(fn)  # two programs (two shapes), not each operation on its own
        rows = fn(q, k, jnp.asarray(want))
        for b in range(2):
            one = fn(q[b:b + 1], k[b:b + 1], jnp.asarray(want[b]))
            for got, ref in zip(rows, one):
                np.testing.assert_allclose(np.asarray(got[b:b + 1]), np.asarray(ref),
                                           rtol=1e-13, atol=1e-13)


def test_attention_fn_reads_documents_from_the_mask_only_when_packed():
    """``jd.attention_fn(packed=True)`` reads packed documents from Flax's document
    mask (here with padding and causality on top), eagerly and under ``jit``; a mask
    it cannot represent (documents that are not runs, or a document mask without
    ``packed=True``) is a ValueError eagerly and NaN under ``jit``."""
    # Segments of 4 and 6 (4 does not divide 6): the traced calls take the streams
    # (ops/dilated_packed.py) directly. With 4 and 8 they also traced the padded layout
    # under a lax.cond that these rows (4 documents, more than its 24 / 8 = 3 slots)
    # never take.
    segs = dict(segment_lengths=(4, 6), dilation_rates=(1, 2))
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((2, T, 2, 4))) for _ in range(3))
    ids = np.stack([np.repeat([1, 2, 3, 0], (5, 8, 7, 4)),   # 0: padding at the end
                    np.repeat([1, 2], (11, 13))])
    ids_j = jnp.asarray(ids, jnp.int32)

    def flax_mask(ids):
        return nnx.combine_masks(nnx.make_attention_mask(ids, ids, jnp.equal),
                                 nnx.make_attention_mask(ids > 0, ids > 0),
                                 nnx.make_causal_mask(ids))

    fn = jd.attention_fn(**segs, packed=True)
    # one program (one compilation, not two): fn on Flax's mask, and what it should give,
    # the op with the ids
    traced = jax.jit(lambda q, k, v, m, s: (fn(q, k, v, mask=m), jd.dilated_attention(
        q, k, v, **segs, is_causal=True, kv_mask=s > 0, segment_ids=s)))
    got_traced, want = traced(q, k, v, flax_mask(ids), ids_j)
    assert np.all(np.asarray(want)[0, 20:] == 0)  # padded rows: zeros
    for got in (fn(q, k, v, mask=np.asarray(flax_mask(ids))), got_traced):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-10)

    runs = np.repeat([1, 2, 1], (8, 8, 8))[None].repeat(2, 0)  # document 1 is not a run
    with pytest.raises(ValueError, match="document mask"):
        fn(q, k, v, mask=np.asarray(flax_mask(runs)))
    assert np.isnan(np.asarray(traced(q, k, v, flax_mask(runs), ids_j)[0])).all()
    with pytest.raises(ValueError, match="packed=True"):
        jd.attention_fn(**segs)(q, k, v, mask=np.asarray(flax_mask(ids)))


def test_mesh_layer_passes_segment_ids_through_sharded():
    """A layer built with a mesh (ring attention over 4 devices, via jd.sharded) with
    ``segment_ids`` equals the one-device layer of the same parameters."""
    mesh = jax.sharding.Mesh(mesh_devices(4), ("seq",))
    ring = jd.nnx.MultiheadRingAttention(E, H, mesh=mesh, seq_axis="seq",
                                         param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    one = jd.nnx.MultiheadBlockSparseAttention(E, H, block_size=T, pattern=np.ones((1, 1), bool),
                                               param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, T, E)))
    run = nnx.jit(lambda m, x, s: m(x, is_causal=True, segment_ids=s))
    np.testing.assert_allclose(np.asarray(run(ring, x, _ids())), np.asarray(run(one, x, _ids())),
                               rtol=1e-10, atol=1e-10)
