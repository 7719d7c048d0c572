"""The ``"hybrid"`` strategy (docs/semantics.md section 8, "Hybrid") through the Linen
layers, the layer factory and ``LongNetLM``: built with a two-axis mesh and
``seq_axis=("a", "b")``, each equals the same layer / model on one device with the
same parameters, forward and gradients, in float32 on 8 CPU devices as 2 x 4 and
4 x 2; a bad pair is a ValueError naming ``seq_axis``.

Tolerance: float32, relative to the reference's largest entry, with no floor:
``max |got - want| <= 1e-5 * max |want|`` per array (the suite's float32 tolerance,
``_helpers.TOL``; small parameter gradients are measured against their own scale).
Hybrid and one device sum the same terms in another order, so they agree to float32
rounding (observed up to ~2e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import TOL
from _mesh import build_mesh, make_mesh
from flax import nnx

import jax_dilated as jd

# head_dim 8; the 8 heads divide over P_a = 2 and 4 with every device of a running the
# same plan (4 heads over P_a = 4 would put offsets 0 and 1 of rate 2 on different
# devices, which hybrid refuses: docs/semantics.md section 8)
B, T, E, H, HKV = 2, 64, 64, 8, 2
DILATED = dict(segment_lengths=(16, 64), dilation_rates=(1, 2))
SHAPES = [(2, 4), (4, 2)]
PAIR = ("a", "b")
TOL32 = TOL["float32"]


def _mesh(shape):
    return make_mesh(shape, PAIR)


def _one_device_ring():
    """Exact attention on one device: the ring layer over a one-device mesh."""
    return dict(mesh=make_mesh((1,), ("s",)), seq_axis="s")


def _x(seed=1):
    kx, kg = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (B, T, E), jnp.float32),
            jax.random.normal(kg, (B, T, E), jnp.float32))


def _out_and_dx(f, x, g):
    """``f(x)`` and ``d sum(g * f(x)) / dx`` (jitted), as NumPy arrays."""
    def loss(x):
        out = f(x)
        return jnp.sum(out * g), out

    dx, out = jax.jit(jax.grad(loss, has_aux=True))(x)
    return np.asarray(out), np.asarray(dx)


def _close(got, want, what):
    """``max |got - want| <= TOL32 * max |want|``, both float32 and finite."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32, (
        what, got.shape, want.shape, got.dtype, want.dtype)
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(want)), what
    scale = np.max(np.abs(want))
    assert scale > 0, what
    err = np.max(np.abs(got.astype(np.float64) - want)) / scale
    assert err <= TOL32, f"{what}: relative error {err:.2e} > {TOL32:.0e}"


def _check(got, want, what):
    for name, a, w in zip(("out", "dx"), got, want):
        _close(a, w, f"{what} {name}")


def _linen_pair(cls, one_kw, shape, **kw):
    """(one device, hybrid) Linen layers of ``cls`` and the one-device parameters."""
    one = cls(embed_dim=E, num_heads=H, num_kv_heads=HKV, **one_kw, **kw)
    hybrid = cls(embed_dim=E, num_heads=H, num_kv_heads=HKV, mesh=_mesh(shape),
                 seq_axis=PAIR, strategy="hybrid", **kw)
    return one, hybrid


# ----------------------------------------------------------------------------- Linen


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["dilated", "ring"])
def test_linen_multihead_hybrid_equals_one_device(shape, kind):
    """jd.linen.MultiheadDilatedAttention / MultiheadRingAttention with
    seq_axis=("a", "b"), strategy="hybrid", the parameters of the one-device layer:
    causal output and input gradient equal one device's."""
    x, g = _x()
    if kind == "dilated":
        one, hybrid = _linen_pair(jd.linen.MultiheadDilatedAttention, {}, shape,
                                  **DILATED)
    else:
        one, hybrid = _linen_pair(jd.linen.MultiheadRingAttention, _one_device_ring(),
                                  shape, layout="zigzag")
    if kind not in _LINEN_ONE_DEVICE:  # the same for both shapes: computed once
        params = jax.jit(one.init)(jax.random.key(0), x)
        _LINEN_ONE_DEVICE[kind] = params, _out_and_dx(
            lambda x: one.apply(params, x, is_causal=True), x, g)
    params, want = _LINEN_ONE_DEVICE[kind]
    got = _out_and_dx(lambda x: hybrid.apply(params, x, is_causal=True), x, g)
    _check(got, want, f"linen {kind} {shape}")


_LINEN_ONE_DEVICE = {}


def test_linen_attention_modules_hybrid_equal_one_device():
    """The parameterless jd.linen.DilatedAttention / RingAttention over the pair
    (2 x 4, query heads 8, kv heads 2, a padding mask) give one device's output and
    query gradient."""
    kq, kk, kg = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (B, T, H, E // H), jnp.float32)
    kv = jax.random.normal(kk, (B, T, HKV, E // H), jnp.float32)
    g = jax.random.normal(kg, (B, T, H, E // H), jnp.float32)
    mask = jnp.arange(T)[None] >= jnp.array([[0], [5]])
    mesh = _mesh((2, 4))
    pairs = [(jd.linen.DilatedAttention(**DILATED),
              jd.linen.DilatedAttention(**DILATED, mesh=mesh, seq_axis=PAIR,
                                        strategy="hybrid")),
             (jd.linen.RingAttention(**_one_device_ring()),
              jd.linen.RingAttention(mesh=mesh, seq_axis=PAIR, strategy="hybrid",
                                     layout="zigzag"))]
    for one, hybrid in pairs:
        def run(m):
            return lambda q: m.apply({}, q, kv, kv, is_causal=True, kv_mask=mask)
        _check(_out_and_dx(run(hybrid), q, g), _out_and_dx(run(one), q, g),
               type(one).__name__)


# --------------------------------------------------------------------------- factory


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_factory_auto_with_a_pair_builds_hybrid_equal_to_one_device(shape, api):
    """kind="auto" with seq_axis=("a", "b") and no strategy picks distributed dilated
    attention with strategy "hybrid" over the 8 devices of both axes (said in the
    reason), and the layer equals the one-device layer of the same parameters."""
    x, g = _x(2)
    kw = dict(embed_dim=E, num_heads=H, num_kv_heads=HKV, **DILATED)
    if api == "nnx":
        kw["rngs"] = nnx.Rngs(0)
    layer, choice = jd.create_multihead_attention(
        api=api, mesh=_mesh(shape), seq_axis=PAIR, explain=True, **kw)
    assert choice.kind == "distributed", choice
    assert "strategy 'hybrid'" in choice.reason and "8 devices" in choice.reason, choice
    if api == "nnx":
        kw["rngs"] = nnx.Rngs(0)
    one = jd.create_multihead_attention("dilated", api=api, **kw)
    if api == "nnx":
        assert layer.core.strategy == "hybrid"
        nnx.update(layer, nnx.state(one, nnx.Param))  # the same parameters
        run_one = lambda x: one(x, is_causal=True)  # noqa: E731
        run = lambda x: layer(x, is_causal=True)  # noqa: E731
    else:
        assert layer.strategy == "hybrid"
        params = jax.jit(one.init)(jax.random.key(0), x)
        run_one = lambda x: one.apply(params, x, is_causal=True)  # noqa: E731
        run = lambda x: layer.apply(params, x, is_causal=True)  # noqa: E731
    _check(_out_and_dx(run, x, g), _out_and_dx(run_one, x, g), f"factory {api} {shape}")


@pytest.mark.parametrize("shape", SHAPES)
def test_factory_ring_strategy_auto_with_a_pair_is_hybrid(shape):
    """kind="auto" without segment_lengths is exact attention over the pair;
    strategy="auto" there runs "hybrid" and equals one device."""
    x, g = _x(4)
    kw = dict(embed_dim=E, num_heads=H, num_kv_heads=HKV, layout="zigzag")
    layer, choice = jd.create_multihead_attention(
        mesh=_mesh(shape), seq_axis=PAIR, strategy="auto", explain=True,
        rngs=nnx.Rngs(0), **kw)
    assert choice.kind == "ring" and "strategy 'hybrid'" in choice.reason, choice
    assert layer.core.strategy == "auto"
    one = jd.create_multihead_attention("ring", rngs=nnx.Rngs(0), **_one_device_ring(),
                                        **kw)
    nnx.update(layer, nnx.state(one, nnx.Param))
    _check(_out_and_dx(lambda x: layer(x, is_causal=True), x, g),
           _out_and_dx(lambda x: one(x, is_causal=True), x, g), f"factory ring {shape}")


def test_factory_pair_too_short_stays_on_one_device():
    """kind="auto" counts the devices of both axes: a length not divisible by
    P_a P_b = 8 stays on one device (the mesh options dropped)."""
    layer, choice = jd.create_multihead_attention(
        embed_dim=E, num_heads=H, mesh=_mesh((2, 4)), seq_axis=PAIR, seq_len=68,
        explain=True, rngs=nnx.Rngs(0), **DILATED)
    assert choice.kind == "dilated" and "8 devices" in choice.reason, choice
    assert layer.core.mesh is None


# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("shape", SHAPES)
def test_longnet_with_a_pair_equals_one_device(shape):
    """LongNetLM(config, mesh=, seq_axis=("a", "b")) (strategy left out: "hybrid"), the
    one-device model's parameters: logits and the gradient of the cross-entropy loss
    with respect to every parameter (the token embedding, the model's input, among
    them) equal one device's."""
    cfg = jd.models.LongNetConfig(vocab_size=48, embed_dim=E, num_layers=2,
                                  num_heads=H, num_kv_heads=HKV, max_len=T, **DILATED)
    one = jd.models.LongNetLM(cfg, rngs=nnx.Rngs(0))
    # a mesh of Auto axes, as in test_models.py: on Explicit axes the parameter
    # gradients of the projections contract over the sharded sequence, which
    # needs an out_sharding the model does not give (one axis alike)
    mesh = build_mesh(shape, PAIR, "auto")
    model = jd.models.LongNetLM(cfg, mesh=mesh, seq_axis=PAIR, rngs=nnx.Rngs(1))
    assert all(block.attn.core.strategy == "hybrid" for block in model.blocks)
    nnx.update(model, nnx.state(one, nnx.Param))
    tokens = jax.random.randint(jax.random.key(5), (B, T + 1), 0, cfg.vocab_size)

    @nnx.jit
    def logits_and_grads(m):
        def loss(m):
            logits = m(tokens[:, :-1], deterministic=True)
            return jd.models.cross_entropy(logits, tokens[:, 1:]), logits
        return nnx.grad(loss, has_aux=True)(m)

    if "one" not in _LONGNET_ONE_DEVICE:  # the same for both shapes: computed once
        _LONGNET_ONE_DEVICE["one"] = logits_and_grads(one)
    (g_one, want), (g_hybrid, got) = _LONGNET_ONE_DEVICE["one"], logits_and_grads(model)
    _close(got, want, f"logits {shape}")
    leaves_one = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g_one))
    leaves = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g_hybrid)))
    assert len(leaves_one) == len(leaves) > 0
    for path, w in leaves_one:
        _close(leaves[path], w, f"d loss / d {jax.tree_util.keystr(path)} {shape}")


_LONGNET_ONE_DEVICE = {}


# ---------------------------------------------------------------------------- errors


BAD_PAIRS = [(("a", "a"), "same mesh axis twice"), (("a", "c"), "not an axis of the mesh")]


@pytest.mark.parametrize("pair,why", BAD_PAIRS, ids=["same-axis", "not-in-mesh"])
def test_bad_pair_is_a_value_error_naming_seq_axis(pair, why):
    """A pair naming one axis twice, or an axis the mesh lacks: ValueError naming
    seq_axis, from the Linen layers (at construction), the factory and LongNetLM."""
    mesh = _mesh((2, 4))
    match = f"seq_axis.*{why}|{why}.*seq_axis"
    hybrid = dict(mesh=mesh, seq_axis=pair, strategy="hybrid")
    builders = {
        "linen dilated": lambda: jd.linen.MultiheadDilatedAttention(
            embed_dim=E, num_heads=H, **DILATED, **hybrid),
        "linen ring": lambda: jd.linen.MultiheadRingAttention(
            embed_dim=E, num_heads=H, **hybrid),
        "linen DilatedAttention": lambda: jd.linen.DilatedAttention(**DILATED, **hybrid),
        "linen RingAttention": lambda: jd.linen.RingAttention(**hybrid),
        "factory auto": lambda: jd.create_multihead_attention(
            embed_dim=E, num_heads=H, mesh=mesh, seq_axis=pair, rngs=nnx.Rngs(0),
            **DILATED),
        "factory ring": lambda: jd.create_multihead_attention(
            "ring", api="linen", embed_dim=E, num_heads=H, mesh=mesh, seq_axis=pair),
        "choose_kind": lambda: jd.layers.factory.choose_kind(
            segment_lengths=(16,), mesh=mesh, seq_axis=pair),
        "LongNetLM": lambda: jd.models.LongNetLM(
            jd.models.LongNetConfig(vocab_size=8, embed_dim=E, num_layers=1,
                                    num_heads=H, **DILATED),
            mesh=mesh, seq_axis=pair, rngs=nnx.Rngs(0)),
    }
    for name, build in builders.items():
        with pytest.raises(ValueError, match=match):
            build()
            pytest.fail(f"{name} accepted seq_axis={pair!r}")
