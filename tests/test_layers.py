"""Flax layers (``jd.nnx``, ``jd.linen``), ``jd.attention_fn`` and the factory.

* PyTorch parity of the multi-head layer (``torch_reference.MultiheadDilatedAttention``
  with the JAX weights copied in): output and gradients w.r.t. inputs and every
  parameter, float64 (1e-10) and float32 (1e-5), both modes, with and without the
  sub-LayerNorm, GQA, causal and padded; parameters are randomised first so that a
  wrong layout of any of them (biases, LayerNorm) would show.
* NNX and Linen layers agree with each other (same weights) and with the function
  composed by hand (projections, ``jd.dilated_attention``, LayerNorm, projection).
* Initialisation (Xavier-normal gains, zero biases) and logical sharding annotations;
  parameters sharded over a "model" mesh axis give the same output.
* ``jd.attention_fn`` inside ``nnx.MultiHeadAttention`` and
  ``nn.MultiHeadDotProductAttention``: causal / padding / combined masks, eager and jit.
* Dropout conventions; ring and distributed dilated layers on 8 simulated devices against
  the single-device layer; the factory; input errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jax_dilated as jd
from jax_dilated.backends import registry

torch = pytest.importorskip("torch")

import torch_reference as ref  # noqa: E402
from _helpers import TOL, assert_close, rounded, to_jax, to_torch  # noqa: E402
from _mesh import devices as mesh_devices  # noqa: E402

E, H = 16, 4
SEGS = dict(segment_lengths=(4, 8), dilation_rates=(1, 2))


def _rng(seed):
    return np.random.default_rng(seed)


def make_layer(*, seed=0, param_dtype=jnp.float64, **kw):
    kw = {"embed_dim": E, "num_heads": H, **SEGS, **kw}
    return jd.nnx.MultiheadDilatedAttention(**kw, param_dtype=param_dtype,
                                            rngs=nnx.Rngs(seed))


def params_of(layer):
    return nnx.to_pure_dict(nnx.state(layer, nnx.Param))


def randomize(layer, seed, dtype="float64"):
    """Replace every parameter by random numbers (so biases / LayerNorm matter)."""
    rng = _rng(seed)
    state = nnx.state(layer, nnx.Param)
    nnx.update(layer, jax.tree.map(
        lambda x: to_jax(0.5 * rng.standard_normal(x.shape), dtype), state))
    return params_of(layer)


def padding(b, t, lengths):
    return np.arange(t)[None, :] < np.asarray(lengths)[:, None]


@functools.partial(nnx.jit, static_argnames=("is_causal", "deterministic"))
def call(layer, x, kv_mask=None, is_causal=False, deterministic=None, rngs=None):
    """``layer(x, ...)`` under ``nnx.jit`` (one compilation per layer configuration)."""
    return layer(x, is_causal=is_causal, kv_mask=kv_mask, deterministic=deterministic,
                 rngs=rngs)


def jitted(fn, *args, **static):
    """``fn(*args, **static)`` under ``jax.jit`` (keywords closed over)."""
    return jax.jit(functools.partial(fn, **static))(*args)


# jd.dilated_attention under one shared jit cache (configuration static)
dilated = jax.jit(jd.dilated_attention, static_argnames=(
    "segment_lengths", "dilation_rates", "mode", "head_offsets", "is_causal", "scale",
    "dropout_rate", "implementation", "block_q", "block_k"))


# ----------------------------------------------------------------------- torch parity

PARITY = {
    "longnet_subln_gqa_causal_padded": dict(num_kv_heads=2, causal=True, mask=(20, 13)),
    "head_groups_no_ln_gqa_cross_padded": dict(mode="head_groups", layer_norm=False,
                                               num_kv_heads=2, cross=True, mask=(9, 20)),
    "longnet_blocked_mqa_nobias_causal": dict(num_kv_heads=1, head_offsets="blocked",
                                              use_bias=False, causal=True, cross=True),
}


def run_parity(name, dtype):
    opts = dict(PARITY[name])
    causal, cross, lengths = opts.pop("causal", False), opts.pop("cross", False), opts.pop(
        "mask", None)
    b, t = 2, 20
    layer = make_layer(param_dtype=jnp.dtype(dtype), **opts)
    params = randomize(layer, 1, dtype)
    rng = _rng(2)
    xs = [rounded(rng.standard_normal((b, t, E)), dtype) for _ in range(3 if cross else 1)]
    g = rounded(rng.standard_normal((b, t, E)), dtype)
    mask = None if lengths is None else padding(b, t, lengths)

    graphdef, state = nnx.split(layer)

    @jax.jit
    def fwd_bwd(state, xs, g, mask):
        def f(state, xs):
            return nnx.merge(graphdef, state)(*xs, is_causal=causal, kv_mask=mask)
        out, vjp = jax.vjp(f, state, xs)
        return out, vjp(g)

    out, (dstate, dxs) = fwd_bwd(state, [to_jax(x, dtype) for x in xs], to_jax(g, dtype),
                                 None if mask is None else jnp.asarray(mask))
    assert out.dtype == jnp.dtype(dtype)

    model = ref.MultiheadDilatedAttention(
        E, H, **SEGS, num_kv_heads=opts.get("num_kv_heads"), mode=opts.get("mode", "longnet"),
        head_offsets=opts.get("head_offsets", "modulo"), use_bias=opts.get("use_bias", True),
        layer_norm=opts.get("layer_norm", True)).load_jax_params(params)
    txs = [to_torch(x, requires_grad=True) for x in xs]
    tout = model(*txs, is_causal=causal, kv_mask=None if mask is None else torch.tensor(mask))
    tout.backward(to_torch(g))

    tol = TOL[dtype]
    assert_close(out, tout, tol, f"{name} out")
    for i, (dx, tx) in enumerate(zip(dxs, txs)):
        assert_close(dx, tx.grad, tol, f"{name} d input {i}")
    dparams = nnx.to_pure_dict(dstate)
    tgrads = model.jax_grads()
    assert jax.tree.structure(dparams) == jax.tree.structure(tgrads)
    for path, d in jax.tree_util.tree_leaves_with_path(dparams):
        expected = functools.reduce(lambda t, k: t[k.key], path, tgrads)
        assert_close(d, expected, tol, f"{name} d{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", list(PARITY))
def test_torch_parity_float64(name):
    run_parity(name, "float64")


def test_torch_parity_float32():
    run_parity("longnet_subln_gqa_causal_padded", "float32")


# ------------------------------------------------------------- nnx == linen == function


def compose_by_hand(params, x, *, mode, causal, mask, num_kv_heads):
    """Projections, jd.dilated_attention, sub-LayerNorm over (heads, head_dim), output."""
    def proj(p):
        return jnp.einsum("bte,ehd->bthd", x, p["kernel"]) + p["bias"]
    o = dilated(proj(params["query"]), proj(params["key"]), proj(params["value"]), **SEGS,
                mode=mode, is_causal=causal, kv_mask=mask)
    mean = o.mean(axis=(-2, -1), keepdims=True)
    var = ((o - mean) ** 2).mean(axis=(-2, -1), keepdims=True)
    o = (o - mean) / jnp.sqrt(var + 1e-5) * params["sub_ln"]["scale"] + params["sub_ln"]["bias"]
    return jnp.einsum("bthd,hde->bte", o, params["out"]["kernel"]) + params["out"]["bias"]


def test_nnx_linen_and_function_agree(mode="longnet"):
    layer = make_layer(mode=mode, num_kv_heads=2)
    params = randomize(layer, 3)
    x = to_jax(_rng(4).standard_normal((2, 20, E)), "float64")
    mask = jnp.asarray(padding(2, 20, (20, 11)))
    lin = jd.linen.MultiheadDilatedAttention(E, H, **SEGS, mode=mode, num_kv_heads=2,
                                             param_dtype=jnp.float64,
                                             precision=jax.lax.Precision.HIGHEST)
    shapes = jax.eval_shape(lin.init, jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, nn.unbox(shapes)["params"]) == \
        jax.tree.map(jnp.shape, params)

    y_nnx = call(layer, x, mask, is_causal=True)
    y_lin = jitted(lin.apply, {"params": params}, x, is_causal=True, kv_mask=mask)
    y_fn = compose_by_hand(params, x, mode=mode, causal=True, mask=mask, num_kv_heads=2)
    assert_close(y_lin, y_nnx, 1e-13, "linen vs nnx")
    assert_close(y_nnx, y_fn, 1e-12, "nnx vs by hand")


def test_attention_module_is_the_function():
    """jd.nnx.DilatedAttention / jd.linen.DilatedAttention == jd.dilated_attention."""
    rng = _rng(5)
    q = to_jax(rng.standard_normal((2, 20, 4, 8)), "float64")
    k, v = (to_jax(rng.standard_normal((2, 20, 2, 8)), "float64") for _ in range(2))
    kw = dict(**SEGS, mode="longnet", head_offsets="blocked", scale=0.3)
    expected = dilated(q, k, v, **kw, is_causal=True)
    got_nnx = nnx.jit(lambda m, q, k, v: m(q, k, v, is_causal=True))(
        jd.nnx.DilatedAttention(**kw), q, k, v)
    got_lin = jitted(jd.linen.DilatedAttention(**kw).apply, {}, q, k, v, is_causal=True)
    np.testing.assert_array_equal(np.asarray(got_nnx), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(got_lin), np.asarray(expected))


def test_dtype_and_param_dtype():
    """bfloat16 computation with float32 parameters: output bf16, close to float32."""
    layer = make_layer(param_dtype=jnp.float32, dtype=jnp.bfloat16)
    assert layer.query["kernel"][...].dtype == jnp.float32
    x = jnp.asarray(_rng(6).standard_normal((1, 16, E)), jnp.float32)
    y = call(layer, x, is_causal=True)
    assert y.dtype == jnp.bfloat16
    ref32 = nnx.merge(*nnx.split(layer))
    ref32.dtype = jnp.float32
    assert_close(y.astype(jnp.float32), call(ref32, x, is_causal=True), 5e-2, "bf16 vs f32")


# ------------------------------------------------------------------ init and sharding


def test_init_xavier_gains_and_annotations():
    e, h, hkv, gamma = 64, 8, 4, 0.5
    layer = jd.nnx.MultiheadDilatedAttention(e, h, **SEGS, num_kv_heads=hkv, gamma_init=gamma,
                                             rngs=nnx.Rngs(0))
    d = e // h
    p = params_of(layer)

    def std(fan_in, fan_out, gain):
        return gain * np.sqrt(2.0 / (fan_in + fan_out))

    for group, expected in (("query", std(e, h * d, 1.0)), ("key", std(e, hkv * d, 1.0)),
                            ("value", std(e, hkv * d, gamma)), ("out", std(h * d, e, gamma))):
        got = float(np.std(np.asarray(p[group]["kernel"])))
        assert abs(got / expected - 1) < 0.1, (group, got, expected)
        assert np.all(np.asarray(p[group]["bias"]) == 0)
    assert np.all(np.asarray(p["sub_ln"]["scale"]) == 1)
    assert np.all(np.asarray(p["sub_ln"]["bias"]) == 0)

    axes = {"query": ("embed", "heads", "head_dim"), "key": ("embed", "kv_heads", "head_dim"),
            "out": ("heads", "head_dim", "embed")}
    for group, names in axes.items():
        assert getattr(layer, group)["kernel"].out_sharding == names
    assert layer.sub_ln["scale"].out_sharding == ("heads", "head_dim")

    lin = jd.linen.MultiheadDilatedAttention(e, h, segment_lengths=(4,), dilation_rates=(1,),
                                             num_kv_heads=hkv, gamma_init=gamma)
    boxed = jax.jit(lin.init)(jax.random.key(0), jnp.zeros((1, 4, e)))
    specs = nn.get_partition_spec(boxed)["params"]
    assert specs["key"]["kernel"] == P("embed", "kv_heads", "head_dim")
    assert specs["out"]["bias"] == P("embed")
    value = np.asarray(nn.unbox(boxed)["params"]["value"]["kernel"])
    assert abs(value.std() / std(e, hkv * d, gamma) - 1) < 0.1


def test_params_sharded_over_model_axis():
    """Logical names -> mesh axes with nnx.logical_axis_rules; sharded weights, same output."""
    layer = make_layer(num_kv_heads=2)
    x = to_jax(_rng(7).standard_normal((2, 20, E)), "float64")
    mask = jnp.asarray(padding(2, 20, (20, 11)))
    expected = call(layer, x, mask, is_causal=True)
    mesh = Mesh(mesh_devices(2), ("model",), axis_types=(AxisType.Auto,))
    rules = [("heads", "model"), ("kv_heads", "model"), ("embed", None), ("head_dim", None)]
    with nnx.logical_axis_rules(rules):
        shardings = nnx.get_named_sharding(nnx.state(layer), mesh)
    nnx.update(layer, jax.device_put(nnx.state(layer), shardings))
    assert layer.query["kernel"][...].sharding.spec == P(None, "model", None)
    assert layer.out["kernel"][...].sharding.spec == P("model", None, None)
    assert_close(call(layer, x, mask, is_causal=True), expected, 1e-13, "sharded params")


# ---------------------------------------------------------------------- attention_fn


def causal_and_padding_masks(x, lengths):
    """Flax masks as numpy arrays (closed over by jit they stay concrete)."""
    valid = padding(x.shape[0], x.shape[1], lengths)
    causal = np.asarray(nnx.make_causal_mask(np.asarray(x[..., 0])))
    return causal, np.asarray(nnx.make_attention_mask(valid, valid)), valid


def expected_flax(project, out_proj, x, *, causal, valid):
    """jd.dilated_attention on the flax layer's projections; padded query rows zero."""
    q, k, v = project(x)
    o = dilated(q, k, v, **SEGS, is_causal=causal,
                kv_mask=None if valid is None else jnp.asarray(valid))
    if valid is not None:
        o = jnp.where(valid[:, :, None, None], o, 0.0)
    return out_proj(o)


def flax_mask(kind, x):
    causal_mask, pad_mask, valid = causal_and_padding_masks(x, (16, 9))
    masks = {"none": None, "none_is_causal": None, "causal": causal_mask,
             "padding": pad_mask, "causal_padding": causal_mask * pad_mask}
    causal = kind in ("none_is_causal", "causal", "causal_padding")
    return masks[kind], causal, (valid if "padding" in kind else None)


@pytest.mark.parametrize("kind", ["none_is_causal", "padding", "causal_padding"])
def test_attention_fn_nnx_multihead(kind):
    """The one-line swap: nnx.MultiHeadAttention(attention_fn=jd.attention_fn(...)) equals
    dilated attention on its projections, for a mask known at trace time (decided in
    Python) and a traced one (decided at run time)."""
    layer = nnx.MultiHeadAttention(H, E, attention_fn=jd.attention_fn(**SEGS), decode=False,
                                   param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = to_jax(_rng(8).standard_normal((2, 16, E)), "float64")
    mask, causal, valid = flax_mask(kind, x)
    kw = dict(is_causal=True) if kind == "none_is_causal" else {}
    expected = expected_flax(lambda x: (layer.query(x), layer.key(x), layer.value(x)),
                             layer.out, x, causal=causal, valid=valid)
    if kind in ("none_is_causal", "causal_padding"):
        concrete = nnx.jit(lambda m, x: m(x, mask=mask, **kw))(layer, x)
        assert_close(concrete, expected, 1e-12, f"{kind}, mask known at trace time")
    if kind in ("padding", "causal_padding"):
        traced = nnx.jit(lambda m, x, mask: m(x, mask=mask))(layer, x, mask)
        assert_close(traced, expected, 1e-12, f"{kind}, traced mask")


@pytest.mark.parametrize("kind", ["causal", "causal_padding"])
def test_attention_fn_linen_multihead(kind):
    mha = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=E, param_dtype=jnp.float64,
                                          attention_fn=jd.attention_fn(**SEGS))
    x = to_jax(_rng(9).standard_normal((2, 16, E)), "float64")
    mask, causal, valid = flax_mask(kind, x)
    params = jax.jit(mha.init)(jax.random.key(0), x)["params"]

    def dense(p, x):
        return jnp.einsum("bte,ehd->bthd", x, p["kernel"]) + p["bias"]

    expected = expected_flax(
        lambda x: (dense(params["query"], x), dense(params["key"], x), dense(params["value"], x)),
        lambda o: jnp.einsum("bthd,hde->bte", o, params["out"]["kernel"]) + params["out"]["bias"],
        x, causal=causal, valid=valid)
    got = jax.jit(lambda p, x, m: mha.apply({"params": p}, x, mask=m))(params, x, mask)
    assert_close(got, expected, 1e-12, kind)


def test_attention_fn_fixed_causality_and_float_masks():
    """is_causal=True/False in the config; 0/1 float masks (flax's default dtype)."""
    rng = _rng(10)
    q, k, v = (to_jax(rng.standard_normal((2, 16, 2, 8)), "float64") for _ in range(3))
    causal_mask, pad_mask, valid = causal_and_padding_masks(q[..., 0, 0:1], (16, 10))
    both = causal_mask * pad_mask  # float32 0/1
    expected = dilated(q, k, v, **SEGS, is_causal=True, kv_mask=jnp.asarray(valid))
    expected = jnp.where(valid[:, :, None, None], expected, 0.0)
    fixed_true = jd.attention_fn(**SEGS, is_causal=True)
    assert_close(jax.jit(lambda m: fixed_true(q, k, v, mask=m))(both), expected, 1e-14,
                 "is_causal=True, traced float mask")
    fixed_false = jd.attention_fn(**SEGS, is_causal=False)
    with pytest.raises(ValueError, match="not a causal and/or padding mask"):
        fixed_false(q, k, v, mask=both)  # a causal mask while causality is fixed False


def test_attention_fn_errors():
    rng = _rng(11)
    q, k, v = (to_jax(rng.standard_normal((1, 8, 2, 4)), "float64") for _ in range(3))
    fn = jd.attention_fn(**SEGS)
    band = (np.abs(np.arange(8)[:, None] - np.arange(8)[None, :]) <= 2)[None, None]
    with pytest.raises(ValueError, match="not a causal and/or padding mask"):
        fn(q, k, v, mask=band)
    # traced, it cannot raise: NaN rather than a silently wrong result
    out = jax.jit(lambda m: fn(q, k, v, mask=m))(jnp.asarray(band))
    assert np.all(np.isnan(np.asarray(out)))
    with pytest.raises(ValueError, match="per-head masks"):  # heads differ
        fn(q, k, v, mask=jnp.asarray(np.stack([np.tril(np.ones((8, 8), bool)),
                                               np.ones((8, 8), bool)])[None]))
    with pytest.raises(ValueError, match="no additive bias"):
        fn(q, k, v, bias=jnp.zeros((1, 1, 8, 8)))
    with pytest.raises(ValueError, match="broadcast_dropout=False"):
        fn(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0), deterministic=False)
    with pytest.raises(ValueError, match="decode cache"):
        fn(q[:, :1], k, v)
    with pytest.raises(ValueError, match="sow attention weights"):
        fn(q, k, v, module=object())
    with pytest.raises(TypeError, match="is_causal"):
        jd.attention_fn(**SEGS, is_causal="yes")
    layer = nnx.MultiHeadAttention(2, 8, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sow attention weights"):
        layer(jnp.ones((1, 8, 8)), sow_weights=True)


def test_attention_fn_dropout():
    """With broadcast_dropout=False, flax's dropout arguments reach dilated attention."""
    rng = _rng(12)
    q, k, v = (to_jax(rng.standard_normal((1, 16, 2, 8)), "float64") for _ in range(3))
    fn = jd.attention_fn(**SEGS)
    key = jax.random.key(3)
    got = jitted(fn, q, k, v, dropout_rng=key, dropout_rate=0.3, deterministic=False,
                 broadcast_dropout=False)
    expected = dilated(q, k, v, **SEGS, dropout_rate=0.3, dropout_rng=key)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


# --------------------------------------------------------------------------- dropout


def test_layer_dropout_conventions():
    x = to_jax(_rng(13).standard_normal((1, 16, E)), "float64")
    layer = make_layer(dropout_rate=0.3)
    with pytest.raises(ValueError, match="deterministic"):
        layer(x)
    with pytest.raises(ValueError, match="needs random keys"):  # no rngs anywhere
        jd.nnx.DilatedAttention(**SEGS, dropout_rate=0.3)(*(x.reshape(1, 16, 4, 4),) * 3,
                                                           deterministic=False)
    plain = call(make_layer(), x)
    np.testing.assert_array_equal(np.asarray(call(layer, x, deterministic=True)),
                                  np.asarray(plain))
    a = call(make_layer(dropout_rate=0.3, seed=0), x, deterministic=False)
    b = call(make_layer(dropout_rate=0.3, seed=0), x, deterministic=False)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same stream, same mask
    assert np.max(np.abs(np.asarray(a - plain))) > 1e-3
    eval_view = nnx.view(make_layer(dropout_rate=0.3, deterministic=False), deterministic=True)
    assert eval_view.deterministic is True

    lin = jd.linen.MultiheadDilatedAttention(E, H, **SEGS, dropout_rate=0.3,
                                             param_dtype=jnp.float64)
    params = params_of(layer)
    apply = jax.jit(lambda key: lin.apply({"params": params}, x, deterministic=False,
                                          rngs={"dropout": key}))
    d1, d2 = apply(jax.random.key(1)), apply(jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(d1), np.asarray(d2))
    assert np.max(np.abs(np.asarray(d1 - plain))) > 1e-3


# ------------------------------------------------------------------- ring, 8 devices


def seq_mesh(n=8):
    return Mesh(mesh_devices(n), ("seq",), axis_types=(AxisType.Auto,))


def loss_and_grads(layer, x, mask):
    graphdef, state = nnx.split(layer)

    @jax.jit
    def run(state, x, mask):
        def loss(state, x):
            out = nnx.merge(graphdef, state)(x, is_causal=True, kv_mask=mask)
            return jnp.sum(jnp.sin(out)), out
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(state, x)

    (dstate, dx), out = run(state, x, mask)
    return out, nnx.to_pure_dict(dstate), dx


def check_same_layer(layer, reference, x, mask):
    """Output and gradients (parameters and input) of two layers with the same weights."""
    out, dparams, dx = loss_and_grads(layer, x, mask)
    out_ref, dparams_ref, dx_ref = loss_and_grads(reference, x, mask)
    assert_close(out, out_ref, 1e-12, "out")
    assert_close(dx, dx_ref, 1e-12, "dx")
    assert jax.tree.structure(dparams) == jax.tree.structure(dparams_ref)
    for a, b in zip(jax.tree.leaves(dparams), jax.tree.leaves(dparams_ref)):
        assert_close(a, b, 1e-12, "dparams")
    return out_ref


def test_multihead_ring_matches_single_device():
    """Ring (exact attention, 8 devices, zigzag) == dilated with one segment >= T, rate 1
    (the ring's gradients are tested in test_ring.py)."""
    mesh = seq_mesh()
    common = dict(num_kv_heads=2, param_dtype=jnp.float64)
    ring = jd.nnx.MultiheadRingAttention(E, H, mesh=mesh, seq_axis="seq", layout="zigzag",
                                         **common, rngs=nnx.Rngs(0))
    dense = jd.nnx.MultiheadDilatedAttention(E, H, segment_lengths=(32,), dilation_rates=(1,),
                                             **common, rngs=nnx.Rngs(0))
    params = randomize(dense, 14)
    nnx.update(ring, nnx.state(dense, nnx.Param))
    x = to_jax(_rng(15).standard_normal((2, 32, E)), "float64")
    mask = jnp.asarray(padding(2, 32, (32, 21)))
    expected = call(dense, x, mask, is_causal=True)
    assert_close(call(ring, x, mask, is_causal=True), expected, 1e-12, "nnx ring")
    lin = jd.linen.MultiheadRingAttention(E, H, mesh=mesh, seq_axis="seq", **common)
    assert_close(jitted(lin.apply, {"params": params}, x, is_causal=True, kv_mask=mask),
                 expected, 1e-12, "linen ring")


def test_ring_attention_modules():
    mesh = seq_mesh()
    rng = _rng(16)
    q = to_jax(rng.standard_normal((1, 32, 4, 8)), "float64")
    k, v = (to_jax(rng.standard_normal((1, 32, 2, 8)), "float64") for _ in range(2))
    expected = dilated(q, k, v, segment_lengths=(32,), dilation_rates=(1,), is_causal=True)
    ring = jd.nnx.RingAttention(mesh=mesh, seq_axis="seq", layout="striped")
    got = nnx.jit(lambda m, q, k, v: m(q, k, v, is_causal=True))(ring, q, k, v)
    assert_close(got, expected, 1e-12, "nnx RingAttention")
    got = jitted(jd.linen.RingAttention(mesh, "seq").apply, {}, q, k, v, is_causal=True)
    assert_close(got, expected, 1e-12, "linen RingAttention")


def test_distributed_layer_matches_single_device():
    """MultiheadDilatedAttention(mesh=..., seq_axis=...) == the single-device layer
    (distributed dilated attention; segments span several devices' shards), and
    jd.attention_fn over the mesh == jd.dilated_attention."""
    mesh = seq_mesh()
    common = dict(num_kv_heads=2, param_dtype=jnp.float64)
    local = make_layer(**common)
    randomize(local, 17)
    dist = make_layer(**common, mesh=mesh, seq_axis="seq")
    nnx.update(dist, nnx.state(local, nnx.Param))
    x = to_jax(_rng(18).standard_normal((2, 32, E)), "float64")
    mask = jnp.asarray(padding(2, 32, (32, 19)))
    check_same_layer(dist, local, x, mask)
    fn = jd.attention_fn(**SEGS, mesh=mesh, seq_axis="seq")
    q = to_jax(_rng(19).standard_normal((2, 32, 4, 8)), "float64")
    assert_close(jitted(fn, q, q, q, is_causal=True),
                 dilated(q, q, q, **SEGS, is_causal=True), 1e-12,
                 "attention_fn over the mesh")


# --------------------------------------------------------------------------- factory


def test_factory_explicit_kinds():
    mesh = seq_mesh()
    base = dict(embed_dim=E, num_heads=H, rngs=nnx.Rngs(0))
    layer = jd.create_multihead_dilated_attention("dilated", **base, **SEGS)
    assert type(layer) is jd.nnx.MultiheadDilatedAttention and layer.core.mesh is None
    layer = jd.create_multihead_dilated_attention("distributed", **base, **SEGS, mesh=mesh,
                                                  seq_axis="seq")
    assert type(layer) is jd.nnx.MultiheadDilatedAttention and layer.core.mesh is mesh
    layer = jd.create_multihead_dilated_attention("ring", **base, mesh=mesh, seq_axis="seq",
                                                  layout="zigzag")
    assert type(layer) is jd.nnx.MultiheadRingAttention
    layer = jd.create_multihead_dilated_attention("dilated", api="linen", embed_dim=E,
                                                  num_heads=H, **SEGS)
    assert type(layer) is jd.linen.MultiheadDilatedAttention


def test_factory_auto_choices_and_reasons():
    base = dict(embed_dim=E, num_heads=H, rngs=nnx.Rngs(0))

    def auto(**kw):
        return jd.create_multihead_dilated_attention(explain=True, **base, **kw)

    layer, choice = auto(**SEGS)
    assert choice.kind == "dilated" and "no mesh" in choice.reason
    # the kernel this machine's device kind selects: 'native' (or 'xla') on a CPU,
    # 'cudnn' on an H100
    device = jax.devices()[0]
    kernel = registry.select_implementation(None, device=device)
    assert kernel in ("xla", "native") or jax.default_backend() == "gpu", (kernel, device)
    assert f"kernel {kernel!r}" in choice.reason, choice.reason
    assert device.device_kind.lower() in choice.reason.lower(), choice.reason
    _, choice = auto(**SEGS, mesh=seq_mesh(1), seq_axis="seq")
    assert choice.kind == "dilated" and "one device" in choice.reason
    assert jd.layers.factory.choose_kind(segment_lengths=(4,)).kind == "dilated"
    # the meshes of 8 last: with fewer devices (one GPU) seq_mesh() skips the test
    mesh = seq_mesh()
    on_mesh = dict(mesh=mesh, seq_axis="seq")
    layer, choice = auto(**SEGS, **on_mesh)
    assert choice.kind == "distributed" and layer.core.mesh is mesh and "8 devices" in str(choice)
    layer, choice = auto(**SEGS, **on_mesh, seq_len=64 * 1024)
    assert choice.kind == "distributed"
    layer, choice = auto(**SEGS, **on_mesh, seq_len=1024)  # 128 tokens per device
    assert choice.kind == "dilated" and layer.core.mesh is None
    assert "tokens per device" in choice.reason
    layer, choice = auto(**SEGS, **on_mesh, seq_len=8 * 4096 + 4)
    assert choice.kind == "dilated" and "not divisible" in choice.reason
    layer, choice = auto(**on_mesh)
    assert choice.kind == "ring" and type(layer) is jd.nnx.MultiheadRingAttention


def test_factory_errors():
    base = dict(embed_dim=E, num_heads=H, rngs=nnx.Rngs(0))
    make = jd.create_multihead_dilated_attention
    with pytest.raises(ValueError, match="kind must be one of"):
        make("sparse", **base, **SEGS)
    with pytest.raises(ValueError, match="mesh= and seq_axis="):
        make("block_sparse_ring", **base, block_size=4, pattern=np.eye(2, dtype=bool))
    with pytest.raises(ValueError, match="mesh= and seq_axis="):
        make("ring", **base)
    with pytest.raises(ValueError, match="mesh= and seq_axis="):
        make("distributed", **base, **SEGS)
    with pytest.raises(ValueError, match="needs segment_lengths"):
        make("auto", **base)
    with pytest.raises(ValueError, match="api must be"):
        make("dilated", api="haiku", **base, **SEGS)
    # the mesh of 8 last: with fewer devices (one GPU) seq_mesh() skips the test
    mesh = seq_mesh()
    with pytest.raises(ValueError, match="kind='block_sparse' runs on one device"):
        make("block_sparse", **base, block_size=4, pattern=np.eye(2, dtype=bool), mesh=mesh,
             seq_axis="seq")
    with pytest.raises(ValueError, match="'nope' is not an axis of the mesh"):
        make("auto", **base, **SEGS, mesh=mesh, seq_axis="nope")
    with pytest.raises(ValueError, match="without seq_axis"):
        make("distributed", **base, **SEGS, mesh=mesh)
    with pytest.raises(ValueError, match="runs on one device"):
        make("dilated", **base, **SEGS, mesh=mesh, seq_axis="seq")
    with pytest.raises(ValueError, match="exact attention"):
        make("ring", **base, **SEGS, mesh=mesh, seq_axis="seq")


# ---------------------------------------------------------------------------- errors


def test_layer_errors():
    with pytest.raises(ValueError, match="embed_dim must be divisible by num_heads.*18.*4"):
        make_layer(embed_dim=18)
    with pytest.raises(ValueError, match="num_heads must be divisible by num_kv_heads"):
        make_layer(num_kv_heads=3)
    with pytest.raises(ValueError, match="without a mesh"):
        make_layer(seq_axis="seq")
    with pytest.raises(ValueError, match="ring attention runs the sequence over a device mesh"):
        jd.nnx.MultiheadRingAttention(E, H, mesh=None, seq_axis=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="at least as many heads as branches"):
        make_layer(num_heads=1, embed_dim=4, mode="head_groups")
    with pytest.raises(ValueError, match="dilation_rates must hold positive ints"):
        make_layer(segment_lengths=(6,), dilation_rates=(0,))
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        make_layer(dropout_rate=1.5)
    with pytest.raises(ValueError, match="mode must be one of"):
        make_layer(mode="sparse")
    layer = make_layer()
    with pytest.raises(ValueError, match="12 features but the layer has embed_dim=16"):
        layer(jnp.zeros((1, 8, 12)))
    with pytest.raises(ValueError, match=r"\[batch, seq, embed_dim\]"):
        layer(jnp.zeros((8, E)))
    with pytest.raises(ValueError, match="key cannot be None"):
        layer(jnp.zeros((1, 8, E)), value=jnp.zeros((1, 8, E)))
    with pytest.raises(ValueError, match="embed_dim must be divisible by num_heads"):
        jd.linen.MultiheadDilatedAttention(E, 3, **SEGS)  # refused on construction
    # the mesh of 8 last: with fewer devices (one GPU) seq_mesh() skips the test
    mesh = seq_mesh()
    with pytest.raises(ValueError, match="without seq_axis"):
        make_layer(mesh=mesh)
    with pytest.raises(ValueError, match="'model' is not an axis of the mesh"):
        make_layer(mesh=mesh, seq_axis="model")


# ------------------------------------------------------------ kernel block sizes


def test_block_sizes_pass_through_layers_and_attention_fn():
    """block_q / block_k reach the kernel from every dilated and ring entry point and
    change no result (they only tile the computation)."""
    x = to_jax(_rng(31).standard_normal((2, 16, E)), "float64")
    plain, tiled = make_layer(), make_layer(block_q=2, block_k=4)
    assert dict(tiled.core.options)["block_q"] == 2 and "block_q" not in dict(plain.core.options)
    assert_close(call(tiled, x, is_causal=True), call(plain, x, is_causal=True), 1e-12,
                 "nnx layer with block sizes")
    lin = jd.linen.MultiheadDilatedAttention(E, H, **SEGS, block_q=2, block_k=4,
                                             param_dtype=jnp.float64)
    got = lin.apply({"params": params_of(plain)}, x, is_causal=True)
    assert_close(got, call(plain, x, is_causal=True), 1e-12, "linen layer with block sizes")
    q = to_jax(_rng(32).standard_normal((2, 16, 4, 8)), "float64")
    fn = jd.attention_fn(**SEGS, block_q=2, block_k=4)
    assert_close(jitted(fn, q, q, q, is_causal=True),
                 jd.dilated_attention(q, q, q, **SEGS, is_causal=True), 1e-12,
                 "attention_fn with block sizes")
    # decoding takes the same options
    tiled.init_cache((2, 16, E))
    plain.init_cache((2, 16, E))
    step = nnx.jit(lambda layer, x: layer(x, decode=True))
    for t in range(3):
        assert_close(step(tiled, x[:, t:t + 1]), step(plain, x[:, t:t + 1]), 1e-12,
                     f"decode step {t} with block sizes")
    # the ring last: with fewer than 4 devices (one GPU) seq_mesh(4) skips the test
    mesh = seq_mesh(4)
    ring = jd.nnx.RingAttention(mesh=mesh, seq_axis="seq", layout="zigzag", block_q=1,
                                block_k=2)
    exact = jd.nnx.RingAttention(mesh=mesh, seq_axis="seq", layout="zigzag")
    assert_close(ring(q, q, q, is_causal=True), exact(q, q, q, is_causal=True), 1e-12,
                 "ring layer with block sizes")
    with pytest.raises(ValueError, match="block_q=3 must divide the zigzag chunk length 2"):
        jd.nnx.RingAttention(mesh=mesh, seq_axis="seq", layout="zigzag", block_q=3)(q, q, q)
