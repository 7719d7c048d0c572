"""``jd.attention_fn`` takes Flax's shapes, and passes Flax's own attention tests.

* Flax's convention ``[batch..., length, heads, head_dim]`` with 0, 1, 2 or 3 leading
  batch dimensions, masks broadcastable to ``[batch..., heads, q_len, kv_len]`` (with
  broadcast batch dimensions, a heads dimension, or lower rank), eager and traced:
  outputs and gradients equal stock Flax attention (float32, 1e-6 relative) when the
  configuration is dense, and equal ``jd.dilated_attention`` run on every batch
  element alone (float64, 1e-12) when it is dilated.
* Output dtypes follow Flax's ``dot_product_attention`` (Linen's and NNX's):
  ``force_fp32_for_softmax``, ``dtype=``, mixed and integer inputs, NNX's
  ``promote_dtype`` hook; dtype and values against stock Flax.
* Bad shapes, masks that differ between heads and non-bool flags raise clear errors.
* Flax's own attention test modules (``tests/nnx/nn/attention_test.py`` and
  ``tests/linen/linen_attention_test.py`` of the installed Flax version, fetched from
  PyPI once, never copied here) run with ``jd.attention_fn`` patched in as the
  attention function (``tests/_flax_suite.py``): every test either passes or is
  refused with one of the documented errors (cross-attention and Flax's decode
  cache, sown attention weights, broadcast dropout, complex dtypes), and every call
  of ours that returns gives stock Flax's output dtype, shape and values.
"""

from __future__ import annotations

import functools
import re

import _flax_suite
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import assert_close
from flax import linen as nn
from flax import nnx

import jax_dilated as jd

T, H, D = 12, 4, 8
DENSE = dict(segment_lengths=(16,), dilation_rates=(1,))    # one segment >= T: dense
DILATED = dict(segment_lengths=(4, 8), dilation_rates=(1, 2))
BATCH_SHAPES = [(), (3,), (2, 3), (2, 1, 2)]


def _qkv(batch_shape, dtype, seed, kv_heads=H):
    rng = np.random.default_rng(seed)
    shapes = (batch_shape + (T, H, D),) + (batch_shape + (T, kv_heads, D),) * 2
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _kv_valid(batch_shape, seed):
    """[batch..., T] key padding, 1..T valid keys per batch element (at least one)."""
    lengths = np.random.default_rng(seed).integers(1, T + 1, size=batch_shape)
    return np.arange(T) < np.asarray(lengths)[..., None]


def _mask(kind, batch_shape, seed=0):
    """A Flax mask of the given kind for inputs with ``batch_shape``."""
    causal = np.tril(np.ones((T, T), bool))
    if kind == "none":
        return None
    if kind == "causal":      # make_causal_mask: [batch..., 1, T, T]
        return np.asarray(nnx.make_causal_mask(np.ones(batch_shape + (T,)))).astype(bool)
    if kind == "rank2_causal":  # broadcasts against every batch dimension and the heads
        return causal
    if kind == "padding_heads":  # causal & key padding, broadcast over the heads
        valid = _kv_valid(batch_shape, seed)
        pad = np.asarray(nnx.make_attention_mask(np.ones(batch_shape + (T,)), valid))
        both = pad.astype(bool) & causal
        return np.broadcast_to(both, batch_shape + (H, T, T))
    raise AssertionError(kind)


def _loss(attend, q, k, v, mask, cotangent):
    return jnp.sum(attend(q, k, v, mask=mask) * cotangent)


def _value_and_grads(attend, q, k, v, mask, cotangent, *, traced_mask=False):
    """Output and d(sum(out * cotangent))/d(q, k, v); the mask closed over (known at
    trace time) or an argument of the jitted function (traced)."""
    if traced_mask:
        fn = jax.jit(lambda q, k, v, m: (attend(q, k, v, mask=m),
                                         jax.grad(_loss, (1, 2, 3))(attend, q, k, v, m,
                                                                    cotangent)))
        return fn(q, k, v, mask)
    fn = jax.jit(lambda q, k, v: (attend(q, k, v, mask=mask),
                                  jax.grad(_loss, (1, 2, 3))(attend, q, k, v, mask,
                                                             cotangent)))
    return fn(q, k, v)


# ---------------------------------------------------- Flax's shapes against stock Flax


STOCK_CASES = [((), "padding_heads"), ((3,), "causal"), ((3,), "none"),
               ((2, 3), "rank2_causal"), ((2, 3), "padding_heads"), ((2, 1, 2), "causal"),
               ((2, 1, 2), "padding_heads")]


@pytest.mark.parametrize("batch_shape,kind", STOCK_CASES,
                         ids=[f"batch{b}-{k}" for b, k in STOCK_CASES])
def test_flax_shapes_match_stock_flax(batch_shape, kind):
    """Dense configuration, float32: ours == nnx.dot_product_attention (outputs and
    gradients, 1e-6 relative), with 0-3 leading batch dims and Flax's masks."""
    q, k, v = _qkv(batch_shape, jnp.float32, seed=len(batch_shape))
    mask = _mask(kind, batch_shape, seed=1)
    cot = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), jnp.float32)
    ours = jd.attention_fn(**DENSE)
    expected = _value_and_grads(nnx.dot_product_attention, q, k, v, mask, cot)
    for traced in ([False, True] if mask is not None else [False]):
        got = _value_and_grads(ours, q, k, v, mask, cot, traced_mask=traced)
        assert got[0].shape == q.shape
        for name, a, e in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]),
                              (expected[0], *expected[1])):
            assert_close(a, e, 1e-6, f"{name}, batch {batch_shape}, {kind}, traced={traced}")


@pytest.mark.parametrize("batch_shape", BATCH_SHAPES, ids=lambda s: f"batch{s}")
def test_flax_shapes_equal_each_batch_element_alone(batch_shape):
    """Dilated configuration, GQA, causal with key padding, float64: every batch element
    of the flattened call equals jd.dilated_attention on that element alone (so no
    batch element leaks into another and the output comes back in the right place)."""
    q, k, v = _qkv(batch_shape, jnp.float64, seed=7, kv_heads=2)
    valid = _kv_valid(batch_shape, seed=8)
    mask = np.asarray(nnx.combine_masks(
        nnx.make_causal_mask(np.ones(batch_shape + (T,))),
        nnx.make_attention_mask(np.ones(batch_shape + (T,)), valid))).astype(bool)
    got = jax.jit(lambda q, k, v, m: jd.attention_fn(**DILATED)(q, k, v, mask=m))(
        q, k, v, mask)
    assert got.shape == q.shape and got.dtype == jnp.float64
    alone = jax.jit(lambda q, k, v, valid: jd.dilated_attention(
        q[None], k[None], v[None], **DILATED, is_causal=True, kv_mask=valid[None])[0])
    for index in np.ndindex(*batch_shape):
        expected = alone(q[index], k[index], v[index], jnp.asarray(valid[index]))
        assert_close(got[index], expected, 1e-12, f"batch element {index}")


@pytest.mark.parametrize("batch_shape", [(), (2, 3)], ids=lambda s: f"batch{s}")
def test_flax_layers_with_flax_shapes(batch_shape):
    """nnx.MultiHeadAttention and nn.MultiHeadDotProductAttention with ours on inputs
    [batch..., T, E] (none or two batch dims) equal the same layers with stock
    attention, the layer's is_causal included."""
    E = 16
    x = jnp.asarray(np.random.default_rng(9).standard_normal(batch_shape + (T, E)),
                    jnp.float32)
    kw = dict(num_heads=H, in_features=E, decode=False, rngs=nnx.Rngs(0))
    stock = nnx.MultiHeadAttention(**kw)
    ours = nnx.MultiHeadAttention(**kw, attention_fn=jd.attention_fn(**DENSE))
    nnx.update(ours, nnx.state(stock, nnx.Param))
    assert_close(ours(x, is_causal=True), stock(x, is_causal=True), 1e-6, "nnx, causal")

    linen_kw = dict(num_heads=H, qkv_features=E)
    params = nn.MultiHeadDotProductAttention(**linen_kw).init(jax.random.key(0), x)
    mask = nn.make_causal_mask(np.ones(batch_shape + (T,)))
    got, expected = (
        nn.MultiHeadDotProductAttention(**linen_kw, **fn).apply(params, x, mask=mask)
        for fn in ({"attention_fn": jd.attention_fn(**DENSE)}, {}))
    assert got.shape == batch_shape + (T, E)
    assert_close(got, expected, 1e-6, "linen, causal mask")


# ------------------------------------------------------------ Flax's output-dtype rules

BF16, F16, F32, F64 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64
#: relative tolerance of a value comparison, by the narrowest dtype Flax computes in;
#: float64 as float32: stock Flax is float32-accurate there (NNX's
#: jax.nn.dot_product_attention is 1.6e-7 off exact in float64 on jax 0.10, Linen's
#: force_fp32_for_softmax takes the softmax in float32)
VALUE_TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-5, "float64": 1e-5}

DTYPE_CASES = [
    # (name, query/key/value dtypes, keyword arguments of the call)
    ("bf16", (BF16,) * 3, {}),
    ("bf16-force_fp32", (BF16,) * 3, dict(force_fp32_for_softmax=True)),
    ("f16-force_fp32", (F16,) * 3, dict(force_fp32_for_softmax=True)),
    ("f32-force_fp32", (F32,) * 3, dict(force_fp32_for_softmax=True)),
    ("f64-force_fp32", (F64,) * 3, dict(force_fp32_for_softmax=True)),
    ("mixed-f32-bf16-bf16", (F32, BF16, BF16), {}),
    ("mixed-bf16-f16-bf16", (BF16, F16, BF16), {}),
    ("mixed-bf16-bf16-f16-force_fp32", (BF16, BF16, F16), dict(force_fp32_for_softmax=True)),
    ("f32-dtype_bf16", (F32,) * 3, dict(dtype=BF16)),
    ("bf16-dtype_f32", (BF16,) * 3, dict(dtype=F32)),
    ("f32-dtype_bf16-force_fp32", (F32,) * 3, dict(dtype=BF16, force_fp32_for_softmax=True)),
    ("mixed-dtype_f16-force_fp32", (F16, F32, F16),
     dict(dtype=F16, force_fp32_for_softmax=True)),
    ("int32", (jnp.int32,) * 3, {}),
]


def _dtype_inputs(dtypes, seed=11):
    rng = np.random.default_rng(seed)
    shape = (2, T, H, D)
    return tuple(jnp.asarray(rng.integers(-2, 3, shape) if jnp.issubdtype(dt, jnp.integer)
                             else rng.standard_normal(shape), dt) for dt in dtypes)


def _assert_like_stock(got, expected, computed, what):
    """Flax's output dtype and shape, and its values at the tolerance of the narrower of
    the output dtype and the dtype Flax computes in (``computed``)."""
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape), (
        f"{what}: output {got.dtype}{list(got.shape)}, stock Flax "
        f"{expected.dtype}{list(expected.shape)}")
    tol = max(VALUE_TOL[jnp.dtype(expected.dtype).name], VALUE_TOL[jnp.dtype(computed).name])
    assert_close(np.asarray(got, np.float64), np.asarray(expected, np.float64), tol, what)


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
@pytest.mark.parametrize("name,dtypes,kw", DTYPE_CASES, ids=[c[0] for c in DTYPE_CASES])
def test_output_dtype_follows_flax(flavour, name, dtypes, kw):
    """Ours returns what Flax's dot_product_attention returns, in its dtype: inputs
    promoted to ``dtype`` (else to their common floating type), and with Linen's
    ``force_fp32_for_softmax`` the float32 weights' einsum with the value promoting the
    output to ``promote_types(dtype, float32)``. NNX's function has no
    ``force_fp32_for_softmax`` (its layer never passes one): there the flag is left out."""
    if flavour == "nnx":
        kw = {k: v for k, v in kw.items() if k != "force_fp32_for_softmax"}
    stock = {"linen": nn.dot_product_attention, "nnx": nnx.dot_product_attention}[flavour]
    q, k, v = _dtype_inputs(dtypes)
    mask = nn.make_causal_mask(np.ones((2, T)))
    got = jd.attention_fn(**DENSE)(q, k, v, mask=mask, **kw)
    expected = stock(q, k, v, mask=mask, **kw)
    computed = kw["dtype"] if "dtype" in kw else jnp.result_type(q, k, v)
    computed = computed if jnp.issubdtype(computed, jnp.inexact) else F32
    _assert_like_stock(got, expected, computed, f"{flavour} {name}")
    # traced (the dtype is decided at trace time, the same)
    traced = jax.jit(lambda q, k, v: jd.attention_fn(**DENSE)(q, k, v, mask=mask, **kw))
    assert traced(q, k, v).dtype == expected.dtype


def test_nnx_promote_dtype_hook_decides_the_dtype():
    """NNX's ``promote_dtype`` hook, passed, decides the dtype as in
    nnx.dot_product_attention (which then computes in ``query.dtype``), even against
    ``dtype``."""
    def to_float32(arrays, dtype=None):
        del dtype  # a hook that ignores it
        return tuple(x.astype(F32) for x in arrays)

    q, k, v = _dtype_inputs((BF16,) * 3)
    got = jd.attention_fn(**DENSE)(q, k, v, dtype=BF16, promote_dtype=to_float32)
    expected = nnx.dot_product_attention(q, k, v, dtype=BF16, promote_dtype=to_float32)
    _assert_like_stock(got, expected, F32, "nnx promote_dtype hook")


def test_linen_layer_with_force_fp32_for_softmax():
    """nn.MultiHeadDotProductAttention(dtype=bfloat16, force_fp32_for_softmax=True):
    the attention function's output is float32 with ours as with stock Flax (the
    out-projection then computes in bfloat16), and the layer's outputs agree."""
    x = jnp.asarray(np.random.default_rng(13).standard_normal((2, T, 16)), F32)
    seen = {}

    def recording(name, fn):
        @functools.wraps(fn)  # Linen passes the keyword arguments fn's signature names
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen[name] = out
            return out
        return wrapped

    kw = dict(num_heads=H, qkv_features=16, dtype=BF16, force_fp32_for_softmax=True,
              deterministic=True)
    params = nn.MultiHeadDotProductAttention(**kw).init(jax.random.key(0), x)
    outs = {name: nn.MultiHeadDotProductAttention(
                **kw, attention_fn=recording(name, fn)).apply(params, x)
            for name, fn in (("ours", jd.attention_fn(**DENSE)),
                             ("stock", nn.dot_product_attention))}
    _assert_like_stock(seen["ours"], seen["stock"], BF16, "attention_fn's output")
    _assert_like_stock(outs["ours"], outs["stock"], BF16, "layer output")


def test_non_floating_dtype_is_refused():
    q, k, v = _dtype_inputs((F32,) * 3)
    with pytest.raises(ValueError, match=r"dtype must be a floating .*int32"):
        jd.attention_fn(**DENSE)(q, k, v, dtype=jnp.int32)


# ------------------------------------------------------------------------------ errors


def test_flax_shape_errors():
    fn = jd.attention_fn(**DENSE)
    q, k, v = _qkv((2,), jnp.float32, seed=0)
    cases = [
        ((q[0, 0], k[0, 0], v[0, 0]), {}, "rank 3 or more"),
        ((q, k[0], v[0]), {}, "same rank"),
        ((q, k[:1], v[:1]), {}, "batch dims must match"),
        ((q, k, v[:, :5]), {}, "lengths must match"),
        ((q, k[..., :4], v), {}, "depths must match"),
        ((q, k, v), {"mask": np.ones((3, 1, T, T), bool)},
         r"mask must broadcast .*\(3, 1, 12, 12\)"),
        ((q, k, v), {"mask": np.ones((2, 2, T, T), bool)}, r"mask must broadcast"),
        ((q, k, v), {"mask": np.ones((1, 2, 1, T, T), bool)}, r"mask must broadcast"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(*args, **kw)


def test_per_head_masks_are_refused():
    """A mask broadcast over the heads is fine (above); one that differs between heads
    raises eagerly and gives NaN under jit, never a silently wrong number."""
    fn = jd.attention_fn(**DENSE)
    q, k, v = _qkv((2,), jnp.float32, seed=1)
    per_head = np.broadcast_to(np.tril(np.ones((T, T), bool)), (2, H, T, T)).copy()
    per_head[:, 1, :, -1] = True   # head 1 also sees the last key
    with pytest.raises(ValueError, match="differs between heads"):
        fn(q, k, v, mask=per_head)
    out = jax.jit(lambda m: fn(q, k, v, mask=m))(per_head)
    assert np.all(np.isnan(np.asarray(out)))


@pytest.mark.parametrize("name,value", [("is_causal", 1), ("is_causal", "yes"),
                                        ("is_causal", np.bool_(True))])
def test_attention_fn_is_causal_must_be_a_bool(name, value):
    match = f"{name} must be a Python bool, got {re.escape(repr(value))}"
    with pytest.raises(TypeError, match=match):
        jd.attention_fn(**DENSE, **{name: value})


@pytest.mark.parametrize("name,value", [("is_causal", 1), ("deterministic", "no"),
                                        ("broadcast_dropout", 0)])
def test_call_flags_must_be_bools(name, value):
    q, k, v = _qkv((1,), jnp.float32, seed=2)
    with pytest.raises(TypeError, match=f"{name} must be a Python bool, got {value!r}"):
        jd.attention_fn(**DENSE)(q, k, v, **{name: value})


@pytest.mark.parametrize("rate,rng,error,match", [
    (float("nan"), 0, ValueError, r"dropout_rate must be in \[0, 1\), got nan"),
    (1.0, 0, ValueError, r"dropout_rate must be in \[0, 1\), got 1.0"),
    (-0.5, 0, ValueError, r"dropout_rate must be in \[0, 1\), got -0.5"),
    ("0.5", 0, TypeError, "dropout_rate must be a Python float"),
    (0.5, None, ValueError, "needs a dropout_rng")])
def test_dropout_arguments_are_checked(rate, rng, error, match):
    """A NaN rate used to switch dropout off silently (NaN > 0 is False)."""
    q, k, v = _qkv((2,), jnp.float32, seed=4)
    key = None if rng is None else jax.random.key(rng)
    with pytest.raises(error, match=match):
        jd.attention_fn(**DENSE)(q, k, v, dropout_rate=rate, dropout_rng=key,
                                 deterministic=False, broadcast_dropout=False)


def test_custom_einsums_are_refused():
    q, k, v = _qkv((1,), jnp.float32, seed=3)
    for name in ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"):
        with pytest.raises(ValueError, match="custom attention einsums"):
            jd.attention_fn(**DENSE)(q, k, v, **{name: jax.lax.dot_general})


# -------------------------------------------------------------- Flax's own test modules

#: The documented refusals (jd.attention_fn's docstring): a Flax test that fails with
#: one of these errors uses a feature dilated attention does not have.
REFUSALS = {
    "cross-attention (key length != query length)":
        r"^ValueError: dilated attention is self-attention over one sequence: query "
        r"length \d+ != key length \d+\.$",
    "Flax's decode cache": r"^ValueError: .*\(this looks like Flax's decode cache",
    "sown attention weights": r"^ValueError: jd.attention_fn cannot sow attention weights",
    "broadcast dropout": r"^ValueError: .*build the Flax layer with broadcast_dropout=False",
    "complex dtype": r"^TypeError: query must be a floating array, got dtype complex",
}

#: Flax tests that assert Flax's own wording of a check that ours makes too (same
#: exception class, naming the same argument): counted apart, not as passes.
OUR_WORDING = {
    "dropout_rate out of [0, 1)":
        r'^AssertionError: "dropout_rate must be in the range .*" does not match '
        r'"dropout_rate must be in \[0, 1\), got',
    "dropout_rng missing":
        r'^AssertionError: "dropout_rng is required" does not match "dropout_rate=.* '
        r'needs a dropout_rng',
}

#: Flax 0.12.x: the cases of each module that pass having called jd.attention_fn
MIN_PASSED_WITH_OURS = {"nnx": 100, "linen": 10}


@pytest.fixture(scope="module")
def flax_sources():
    try:
        return _flax_suite.flax_test_sources()
    except _flax_suite.Unavailable as why:
        pytest.skip(f"Flax's test modules are not available: {why}")


@pytest.mark.parametrize("which", ["nnx", "linen"])
def test_flax_own_attention_tests(which, flax_sources, record_property):
    """Flax's own attention tests with jd.attention_fn as the attention function: each
    case passes, or fails with one of the documented refusals; nothing else. And every
    call of ours that returns gives stock Flax's output dtype and shape (and values,
    where concrete and without dropout): ``_flax_suite.compare_with_stock``."""
    outcomes = _flax_suite.run_module(which)
    refused, unexplained = {}, []
    for o in outcomes:
        if o.passed:
            continue
        reasons = [r for r, pattern in {**REFUSALS, **OUR_WORDING}.items()
                   if re.search(pattern, o.error)]
        if reasons:
            refused.setdefault(reasons[0], []).append(o.name)
        else:
            unexplained.append(f"{o.name}: {o.error}")
    with_ours = sum(o.passed and o.calls > 0 for o in outcomes)
    differing = [f"{o.name}: {d}" for o in outcomes for d in o.differences]
    summary = (f"Flax {which} attention tests: {len(outcomes)} cases, "
               f"{sum(o.passed for o in outcomes)} pass ({with_ours} of them calling "
               f"jd.attention_fn), refused or worded differently: "
               + ", ".join(f"{len(v)} {r}" for r, v in refused.items())
               + f"; {sum(o.compared for o in outcomes)} calls compared with stock Flax "
               f"({sum(o.valued for o in outcomes)} by value), {len(differing)} differ")
    record_property("flax_suite", summary)
    print(summary)
    assert not unexplained, "Flax tests failing for another reason:\n" + "\n".join(unexplained)
    assert not differing, "Calls differing from stock Flax:\n" + "\n".join(differing)
    assert sum(o.compared for o in outcomes) >= MIN_PASSED_WITH_OURS[which], summary
    assert with_ours >= MIN_PASSED_WITH_OURS[which], summary
