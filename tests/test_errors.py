"""Bad input to ``dilated_attention`` raises at trace time, naming the argument.

One test per error; every ``match=`` names the offending argument (and, where
useful, the value received), as docs/semantics.md, section 1 requires.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import make_mesh

from flax import nnx

import jax_dilated as jd

B, T, H, D = 2, 16, 4, 8
CFG = dict(segment_lengths=(8, 16), dilation_rates=(1, 2))


def _arr(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.fixture
def qkv():
    return _arr((B, T, H, D), seed=0), _arr((B, T, H, D), seed=1), _arr((B, T, H, D), seed=2)


def call(q, k, v, **overrides):
    return jd.dilated_attention(q, k, v, **{**CFG, **overrides})


def test_valid_call_works(qkv):
    """The baseline every error test perturbs is itself valid."""
    out = call(*qkv)
    assert out.shape == (B, T, H, D) and bool(jnp.all(jnp.isfinite(out)))


# --- shapes ---

def test_query_wrong_rank(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"query must have rank 4.*\(2, 16, 32\)"):
        call(q.reshape(B, T, H * D), k, v)


def test_key_wrong_rank(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"key must have rank 4"):
        call(q, k[None], v[None])


def test_batch_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"query and key must have the same batch size"):
        call(q, k[:1], v[:1])


def test_head_dim_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"query and key must have the same head_dim"):
        call(q, k[..., :4], v[..., :4])


def test_key_value_shape_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"key and value must have the same shape"):
        call(q, k, v[..., :4])


def test_kv_length_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"key/value length must equal query length"):
        call(q, k[:, :8], v[:, :8])


def test_num_heads_not_multiple_of_kv_heads(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"num_heads must be a multiple of num_kv_heads.*4 "
                                         r"heads.*3 heads"):
        call(q, k[:, :, :3], v[:, :, :3])


# --- branch configuration ---

def test_segment_and_rate_lengths_differ(qkv):
    with pytest.raises(ValueError, match=r"segment_lengths and dilation_rates must have the "
                                         r"same length"):
        call(*qkv, segment_lengths=(8, 16), dilation_rates=(1,))


def test_empty_segment_lengths(qkv):
    with pytest.raises(ValueError, match=r"segment_lengths must not be empty"):
        call(*qkv, segment_lengths=(), dilation_rates=())


def test_empty_dilation_rates(qkv):
    with pytest.raises(ValueError, match=r"dilation_rates must not be empty"):
        call(*qkv, segment_lengths=(8,), dilation_rates=[])


def test_non_positive_segment_length(qkv):
    with pytest.raises(ValueError, match=r"segment_lengths must hold positive ints.*0"):
        call(*qkv, segment_lengths=(8, 0), dilation_rates=(1, 1))


def test_non_positive_dilation_rate(qkv):
    with pytest.raises(ValueError, match=r"dilation_rates must hold positive ints.*-2"):
        call(*qkv, segment_lengths=(8, 16), dilation_rates=(1, -2))


def test_non_int_segment_length(qkv):
    with pytest.raises(TypeError, match=r"segment_lengths must hold ints"):
        call(*qkv, segment_lengths=(8.0, 16), dilation_rates=(1, 2))


def test_rate_not_positive(qkv):
    with pytest.raises(ValueError, match=r"dilation_rates must hold positive ints, got \(1, 0\)"):
        call(*qkv, segment_lengths=(8, 6), dilation_rates=(1, 0))


def test_head_groups_fewer_heads_than_branches(qkv):
    q, k, v = (x[:, :, :2] for x in qkv)
    with pytest.raises(ValueError, match=r'mode="head_groups".*num_heads=2 with 3 branches'):
        call(q, k, v, mode="head_groups", segment_lengths=(4, 8, 16),
             dilation_rates=(1, 2, 4))


# --- option names ---

def test_unknown_mode(qkv):
    with pytest.raises(ValueError, match=r"mode must be one of.*'dense'"):
        call(*qkv, mode="dense")


def test_unknown_head_offsets(qkv):
    with pytest.raises(ValueError, match=r"head_offsets must be one of.*'random'"):
        call(*qkv, head_offsets="random")


def test_unknown_implementation(qkv):
    with pytest.raises(ValueError, match=r"implementation must be.*'flash9'"):
        call(*qkv, implementation="flash9")


# --- dropout ---

def test_dropout_without_rng(qkv):
    with pytest.raises(ValueError, match=r"dropout_rate=0.1 needs a dropout_rng"):
        call(*qkv, dropout_rate=0.1)


@pytest.mark.parametrize("rate", [1.0, -0.1, 1.5])
def test_dropout_rate_out_of_range(qkv, rate):
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        call(*qkv, dropout_rate=rate, dropout_rng=jax.random.key(0))


# --- kv_mask ---

def test_kv_mask_wrong_shape(qkv):
    with pytest.raises(ValueError, match=r"kv_mask must have shape.*\(2, 16\).*\(2, 15\)"):
        call(*qkv, kv_mask=jnp.ones((B, T - 1), bool))


def test_kv_mask_per_head_shape_rejected(qkv):
    with pytest.raises(ValueError, match=r"kv_mask must have shape"):
        call(*qkv, kv_mask=jnp.ones((B, T, H), bool))


def test_kv_mask_not_bool(qkv):
    with pytest.raises(TypeError, match=r"kv_mask must be a bool array.*int32"):
        call(*qkv, kv_mask=jnp.ones((B, T), jnp.int32))


# --- dtypes and scalars ---

def test_mismatched_dtypes(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"query, key and value must share a dtype"):
        call(q, k.astype(jnp.bfloat16), v)


def test_integer_inputs(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"query must be a floating array"):
        call(q.astype(jnp.int32), k, v)


def test_non_positive_scale(qkv):
    with pytest.raises(ValueError, match=r"scale must be positive"):
        call(*qkv, scale=-1.0)


def test_non_bool_is_causal(qkv):
    with pytest.raises(TypeError, match=r"is_causal must be a Python bool"):
        call(*qkv, is_causal="yes")


def test_errors_raise_under_jit(qkv):
    """Checks run at trace time, also inside ``jax.jit``."""
    f = jax.jit(lambda q, k, v: call(q, k, v, segment_lengths=(8, 6), dilation_rates=(1, 0)))
    with pytest.raises(ValueError, match=r"dilation_rates must hold positive ints"):
        f(*qkv)


# ------------------------------------------------ one policy: functions and layers agree
#
# TypeError for a wrong type, ValueError for a wrong value, the same class from the
# function and from the layers for the same bad value (docs/semantics.md, section 1).


def _layer(**kw):
    return jd.nnx.MultiheadDilatedAttention(16, 2, **CFG, rngs=nnx.Rngs(0), **kw)


def _linen_layer(**kw):
    layer = jd.linen.MultiheadDilatedAttention(embed_dim=16, num_heads=2, **CFG, **kw)
    return layer.init(jax.random.key(0), jnp.ones((1, T, 16)))


@pytest.mark.parametrize("name, value, error", [
    ("scale", "big", TypeError), ("scale", True, TypeError), ("scale", -1.0, ValueError),
    ("scale", 0.0, ValueError),
    ("dropout_rate", "0.1", TypeError), ("dropout_rate", True, TypeError),
    ("dropout_rate", 1.5, ValueError), ("dropout_rate", -0.1, ValueError),
])
def test_function_and_layers_raise_the_same_class(qkv, name, value, error):
    extra = {"dropout_rng": jax.random.key(0)} if name == "dropout_rate" else {}
    with pytest.raises(error, match=name):
        call(*qkv, **{name: value}, **extra)
    with pytest.raises(error, match=name):
        _layer(**{name: value})
    with pytest.raises(error, match=name):
        _linen_layer(**{name: value})
    with pytest.raises(error, match=name):
        jd.nnx.DilatedAttention(**CFG, **{name: value})


@pytest.mark.parametrize("value, error", [(2.0, TypeError), ("4", TypeError),
                                          (True, TypeError), (0, ValueError),
                                          (-4, ValueError)])
def test_positive_ints_one_policy(qkv, value, error):
    """Every positive-int option goes through the one check: type -> TypeError,
    value -> ValueError, the message names the argument and the value."""
    with pytest.raises(error, match=rf"block_q must be a positive int, got {value!r}"):
        call(*qkv, block_q=value)
    with pytest.raises(error, match=rf"num_heads must be a positive int, got {value!r}"):
        jd.nnx.MultiheadDilatedAttention(16, value, **CFG, rngs=nnx.Rngs(0))
    with pytest.raises(error, match=rf"block_size must be a positive int, got {value!r}"):
        jd.block_sparse_attention(*qkv, block_size=value, pattern=np.ones((1, 1), bool))
    with pytest.raises(error, match=r"LongNetConfig.num_layers must be a positive int"):
        jd.models.LongNetConfig(vocab_size=8, embed_dim=16, num_heads=2, num_layers=value,
                                **CFG)


def test_mesh_checks_are_shared():
    """jd.sharded, the layers and the model check the mesh axes with one function."""
    mesh = jax.make_mesh((1,), ("seq",))
    for build in (lambda: jd.sharded(jd.dilated_attention, mesh, seq_axis="nope"),
                  lambda: jd.nnx.DilatedAttention(**CFG, mesh=mesh, seq_axis="nope"),
                  lambda: jd.attention_fn(**CFG, mesh=mesh, seq_axis="nope")):
        with pytest.raises(ValueError, match=r"seq_axis='nope' is not an axis of the mesh"):
            build()
    with pytest.raises(ValueError, match="must be different mesh axes"):
        jd.nnx.DilatedAttention(**CFG, mesh=mesh, seq_axis="seq", batch_axis="seq")


# ---------------------------------------------------------------------- return_lse


def test_return_lse_longnet_is_the_merged_log_sum_exp(qkv):
    q, k, v = (x.astype(jnp.float64) for x in qkv)
    out, lse = call(q, k, v, is_causal=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(call(q, k, v, is_causal=True)))
    assert lse.shape == (B, T, H) and lse.dtype == jnp.float64
    # the merged lse is log sum_i exp(lse_i) of the single-branch calls
    lses = [call(q, k, v, is_causal=True, segment_lengths=(w,), dilation_rates=(r,),
                 return_lse=True)[1] for w, r in zip(CFG["segment_lengths"],
                                                       CFG["dilation_rates"])]
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jnp.logaddexp(*lses)),
                               rtol=1e-12, atol=1e-12)


def test_return_lse_head_groups_is_each_heads_branch(qkv):
    q, k, v = (x.astype(jnp.float64) for x in qkv)
    _, lse = call(q, k, v, mode="head_groups", return_lse=True)
    assert lse.shape == (B, T, H)
    # head group i (heads 2i, 2i + 1) runs branch i alone, every head of it at offset
    # i mod r: the single-branch longnet lse of head copy number (i mod r) of r copies
    for i, (w, r) in enumerate(zip(CFG["segment_lengths"], CFG["dilation_rates"])):
        for head in (2 * i, 2 * i + 1):
            copies = [jnp.repeat(x[:, :, head:head + 1], r, axis=2) for x in (q, k, v)]
            _, lse_i = jd.dilated_attention(*copies, segment_lengths=(w,),
                                            dilation_rates=(r,), return_lse=True)
            np.testing.assert_allclose(np.asarray(lse[:, :, head]),
                                       np.asarray(lse_i[:, :, i % r]), rtol=1e-12,
                                       atol=1e-12)


# -------------------------------------------------------- deprecated spellings still work


def test_deprecated_axis_name_on_functions(qkv):
    import functools
    mesh = jax.make_mesh((1,), ("seq",))
    new = jd.sharded(functools.partial(jd.dilated_attention, **CFG), mesh, seq_axis="seq")
    expected = new(*qkv)
    for fn in (jd.dilated_attention, jd.ring_attention):
        opts = CFG if fn is jd.dilated_attention else {}

        def old_fn(q, k, v, *, axis_name, kv_mask=None, fn=fn, opts=opts):
            # written against the old keyword: jd.sharded passes axis_name= (warning),
            # and the function accepts it (warning)
            return fn(q, k, v, axis_name=axis_name, kv_mask=kv_mask, **opts)

        with pytest.warns(DeprecationWarning, match="seq_axis"):
            got = jd.sharded(old_fn, mesh, seq_axis="seq")(*qkv)
        ref = expected if fn is jd.dilated_attention else jd.sharded(
            jd.ring_attention, mesh, seq_axis="seq")(*qkv)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    pattern = np.ones((2, 2), bool)
    bs = functools.partial(jd.block_sparse_attention, block_size=8, pattern=pattern)
    with pytest.warns(DeprecationWarning, match="seq_axis"):
        got = jd.sharded(lambda q, k, v, *, axis_name, kv_mask=None: bs(
            q, k, v, axis_name=axis_name, kv_mask=kv_mask), mesh, seq_axis="seq")(*qkv)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(jd.sharded(bs, mesh, seq_axis="seq")(*qkv)))
    with pytest.raises(TypeError, match="pass seq_axis= only"):
        call(*qkv, seq_axis="seq", axis_name="seq")


def test_deprecated_dropout_on_layers():
    x = _arr((1, T, 16), jnp.float64)
    new = jd.nnx.MultiheadDilatedAttention(16, 2, **CFG, dropout_rate=0.3,
                                           param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    with pytest.warns(DeprecationWarning, match="dropout_rate"):
        old = jd.nnx.MultiheadDilatedAttention(16, 2, **CFG, dropout=0.3,
                                               param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    assert old.dropout_rate == 0.3
    np.testing.assert_array_equal(np.asarray(old(x, deterministic=False)),
                                  np.asarray(new(x, deterministic=False)))
    lin_new = jd.linen.MultiheadDilatedAttention(embed_dim=16, num_heads=2, **CFG,
                                                 dropout_rate=0.3)
    lin_old = jd.linen.MultiheadDilatedAttention(embed_dim=16, num_heads=2, **CFG,
                                                 dropout=0.3)
    params = lin_new.init(jax.random.key(0), x, deterministic=True)
    rngs = {"dropout": jax.random.key(1)}
    with pytest.warns(DeprecationWarning, match="dropout_rate"):
        got = lin_old.apply(params, x, deterministic=False, rngs=rngs)
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(lin_new.apply(params, x, deterministic=False, rngs=rngs)))


def test_deprecated_longnet_config_dropout():
    base = dict(vocab_size=8, embed_dim=16, num_heads=2, num_layers=1, **CFG)
    with pytest.warns(DeprecationWarning, match="dropout_rate"):
        old = jd.models.LongNetConfig(**base, dropout=0.1)
    with pytest.warns(DeprecationWarning, match="attention_dropout_rate"):
        old_attn = jd.models.LongNetConfig(**base, attention_dropout=0.2)
    assert old == jd.models.LongNetConfig(**base, dropout_rate=0.1)
    assert old_attn == jd.models.LongNetConfig(**base, attention_dropout_rate=0.2)
    assert old.replace(num_layers=2).dropout_rate == 0.1   # no second warning


def test_deprecated_factory_kind_ring_dilated():
    mesh = jax.make_mesh((1,), ("seq",))
    kw = dict(embed_dim=16, num_heads=2, **CFG, mesh=mesh, seq_axis="seq")
    with pytest.warns(DeprecationWarning, match="kind='distributed'"):
        layer, choice = jd.create_multihead_dilated_attention(
            "ring_dilated", explain=True, rngs=nnx.Rngs(0), **kw)
    assert choice.kind == "distributed"
    new = jd.create_multihead_attention("distributed", rngs=nnx.Rngs(0), **kw)
    x = _arr((1, T, 16))
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(new(x)))


def test_deprecated_backend_report_file_stdout(capsys):
    with pytest.warns(DeprecationWarning, match="file=None"):
        old = jd.backend_report(file="stdout")
    printed = capsys.readouterr().out
    assert jd.backend_report() == old and capsys.readouterr().out == printed
    assert jd.backend_report(quiet=True) == old and capsys.readouterr().out == ""


def test_position_encodings_type_vs_value():
    """Rotary / XPos follow the one validation policy: TypeError for a wrong type,
    ValueError for a wrong value, both naming the argument."""
    from jax_dilated.models import Rotary, XPos

    with pytest.raises(TypeError, match="Rotary base must be a positive float"):
        Rotary("1e4")
    with pytest.raises(ValueError, match=r"Rotary base must be a float > 1, got 0.5"):
        Rotary(0.5)
    with pytest.raises(TypeError, match="XPos gamma must be a positive float"):
        XPos(gamma=None)
    with pytest.raises(ValueError, match=r"XPos scale_base must be a positive float, got -3"):
        XPos(scale_base=-3.0)


def test_generate_sampling_options_type_vs_value():
    """generate's temperature / top_k: TypeError for a wrong type, ValueError for a
    wrong value (they raised ValueError for both)."""
    import jax.numpy as jnp
    from flax import nnx

    from jax_dilated.models import LongNetConfig, LongNetLM

    cfg = LongNetConfig(vocab_size=16, embed_dim=8, num_heads=2, num_layers=1, max_len=16,
                        segment_lengths=(4,), dilation_rates=(1,))
    model = LongNetLM(cfg, rngs=nnx.Rngs(0))
    prompt = jnp.asarray([[1, 2, 3]], jnp.int32)
    with pytest.raises(TypeError, match=r"temperature must be a float >= 0, got '1'"):
        model.generate(prompt, max_new_tokens=1, temperature="1")
    with pytest.raises(ValueError, match=r"temperature must be a float >= 0, got -0.5"):
        model.generate(prompt, max_new_tokens=1, temperature=-0.5)
    with pytest.raises(TypeError, match=r"top_k must be a positive int, got 2.0"):
        model.generate(prompt, max_new_tokens=1, temperature=1.0, top_k=2.0)
    with pytest.raises(ValueError, match=r"top_k must be a positive int, got 0"):
        model.generate(prompt, max_new_tokens=1, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match=r"top_k must be None or an int in \[1, vocab_size=16\], got 17"):
        model.generate(prompt, max_new_tokens=1, temperature=1.0, top_k=17)


# ------------------------------------------- issue 20: inputs that gave a silent wrong
# answer or an error from inside JAX / Python arithmetic (each failed before the fix)

from jax_dilated.ops import decode as decoding


def _decode_inputs():
    x = _arr((1, 8, 2, 4), jnp.float64, seed=3)
    return x[:, 3:4], x, x


@pytest.mark.parametrize("position, error, match", [
    (8, ValueError, r"position must be in \[0, 8\).*got 8"),       # past the cache
    (-1, ValueError, r"position must be in \[0, 8\).*got -1"),      # wrapped to slot 7
    (np.int32(9), ValueError, r"position must be in \[0, 8\)"),
    (jnp.array([1, 2]), ValueError, r"position must be a scalar.*\(2,\)"),
    (jnp.array([[3]]), ValueError, r"position must be a scalar.*\(1, 1\)"),
    (2.5, TypeError, r"position must be an int scalar"),
    (jnp.array(2.0), TypeError, r"position must have an integer dtype"),
    (True, TypeError, r"position must be an int scalar"),
])
def test_decode_position_checked_at_trace_time(position, error, match):
    q, k, v = _decode_inputs()
    with pytest.raises(error, match=match):
        jd.dilated_attention_decode(q, k, v, position, **CFG)


def test_decode_non_scalar_position_never_mixes_heads():
    """A [heads]-shaped position broadcast against the heads (it used to return a
    result mixing positions across heads) is refused, traced or not."""
    q, k, v = _decode_inputs()
    step = jax.jit(lambda p: jd.dilated_attention_decode(q, k, v, p, **CFG))
    with pytest.raises(ValueError, match=r"position must be a scalar.*\(2,\)"):
        step(jnp.array([3, 5]))


def test_decode_traced_position_out_of_range_is_nan():
    q, k, v = _decode_inputs()
    step = jax.jit(lambda p: jd.dilated_attention_decode(q, k, v, p, **CFG))
    for p in (8, 100, -1):
        assert np.all(np.isnan(np.asarray(step(jnp.int32(p))))), p
    full = jd.dilated_attention(k, k, k, is_causal=True, **CFG)
    np.testing.assert_allclose(np.asarray(step(jnp.int32(3))), np.asarray(full[:, 3:4]),
                               atol=1e-12)


def test_decode_step_negative_index():
    """A negative cache index: ValueError when concrete; traced, NaN and the cache
    left unchanged (as for a full cache)."""
    cache = decoding.init_kv_cache(1, 4, 2, 4, jnp.float64)
    x = _arr((1, 1, 2, 4), jnp.float64)
    bad = cache._replace(index=jnp.int32(-1))
    with pytest.raises(ValueError, match=r"cache.index must be >= 0 .*got -1"):
        decoding.decode_step(bad, x, x, x, **CFG)
    with pytest.raises(ValueError, match=r"cache.index must be >= 0"):
        decoding.decode_tokens(bad, jnp.tile(x, (1, 2, 1, 1)), jnp.tile(x, (1, 2, 1, 1)),
                               jnp.tile(x, (1, 2, 1, 1)), **CFG)
    out, after = jax.jit(lambda c: decoding.decode_step(c, x, x, x, **CFG))(bad)
    assert np.all(np.isnan(np.asarray(out)))
    np.testing.assert_array_equal(np.asarray(after.key), np.asarray(cache.key))
    assert int(after.index) == -1
    with pytest.raises(TypeError, match=r"cache.index must be an int array of shape \(\)"):
        decoding.decode_step(cache._replace(index=jnp.zeros((2,), jnp.int32)), x, x, x,
                             **CFG)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -float("inf")])
def test_non_finite_scale_rejected_everywhere(qkv, scale):
    """scale=inf made every output NaN; the Linen layer accepted NaN until its call."""
    with pytest.raises(ValueError, match=r"scale must be positive and finite"):
        call(*qkv, scale=scale)
    with pytest.raises(ValueError, match=r"scale must be positive and finite"):
        jd.dilated_attention_decode(*_decode_inputs(), 3, scale=scale, **CFG)
    with pytest.raises(ValueError, match=r"scale must be positive and finite"):
        _layer(scale=scale)
    with pytest.raises(ValueError, match=r"scale must be positive and finite"):
        # construction alone, before init or any call
        jd.linen.MultiheadDilatedAttention(embed_dim=16, num_heads=2, scale=scale, **CFG)
    with pytest.raises(ValueError, match=r"scale must be positive and finite"):
        jd.linen.DilatedAttention(**CFG, scale=scale)
    with pytest.raises(ValueError, match=r"scale must be positive and finite"):
        jd.attention_fn(**CFG, scale=scale)


def test_linen_layers_validate_on_construction():
    mesh = jax.make_mesh((1,), ("seq",))
    with pytest.raises(ValueError, match=r"block_q must be a positive int, got -4"):
        jd.linen.MultiheadDilatedAttention(embed_dim=16, num_heads=2, block_q=-4, **CFG)
    with pytest.raises(TypeError, match=r"block_k must be a positive int, got 7.5"):
        jd.linen.RingAttention(mesh=mesh, seq_axis="seq", block_k=7.5)
    with pytest.raises(ValueError, match=r'mode="head_groups" needs at least as many heads'):
        jd.linen.MultiheadDilatedAttention(embed_dim=16, num_heads=1, mode="head_groups",
                                           **CFG)
    with pytest.raises(ValueError, match=r"embed_dim"):
        jd.linen.MultiheadRingAttention(embed_dim=15, num_heads=2, mesh=mesh,
                                        seq_axis="seq")


@pytest.mark.parametrize("value, error", [(-4, ValueError), (7.5, TypeError),
                                          ("64", TypeError), (0, ValueError)])
@pytest.mark.parametrize("name", ["block_q", "block_k"])
def test_block_sizes_rejected_wherever_they_enter(qkv, name, value, error):
    """block_q / block_k of -4, 7.5, "64" and 0 (0 used to mean the default) are
    refused with a message naming the argument, in every entry point."""
    mesh = jax.make_mesh((1,), ("seq",))
    match = rf"{name} must be a positive int, got {value!r}"
    builds = [
        lambda: call(*qkv, **{name: value}),
        lambda: jd.sharded(functools.partial(jd.ring_attention, **{name: value}), mesh,
                           seq_axis="seq")(*qkv),
        lambda: jd.dilated_attention_decode(*_decode_inputs(), 3, **CFG, **{name: value}),
        lambda: jd.attention_fn(**CFG, **{name: value}),
        lambda: _layer(**{name: value}),
        lambda: jd.nnx.RingAttention(mesh=mesh, seq_axis="seq", **{name: value}),
        lambda: jd.linen.DilatedAttention(**CFG, **{name: value}),
    ]
    for build in builds:
        with pytest.raises(error, match=match):
            build()
    with pytest.raises(error, match=rf"LongNetConfig.{match}"):
        jd.models.LongNetConfig(vocab_size=8, embed_dim=16, num_heads=2, **CFG,
                                **{name: value})


@pytest.mark.parametrize("shape, dim", [((2, 16, 4, 0), "head_dim"), ((0, 16, 4, 8), "batch"),
                                        ((2, 0, 4, 8), "seq"), ((2, 16, 0, 8), "heads")])
def test_empty_dimensions_one_policy(shape, dim):
    """Zero-size dimensions ended in ZeroDivisionError (or JAX's scan/slice errors);
    every entry point now raises the same ValueError (docs/semantics.md, section 1)."""
    z = jnp.zeros(shape, jnp.float32)
    mesh = jax.make_mesh((1,), ("seq",))
    match = rf"query has an empty {dim} dimension: shape {re.escape(str(shape))}"
    builds = [
        lambda: call(z, z, z),
        lambda: jd.block_sparse_attention(z, z, z, block_size=4,
                                          pattern=np.ones((4, 4), bool)),
        lambda: jd.sharded(jd.ring_attention, mesh, seq_axis="seq")(z, z, z),
        lambda: jd.sharded(functools.partial(jd.dilated_attention, **CFG), mesh,
                           seq_axis="seq")(z, z, z),
        lambda: jd.attention_fn(**CFG)(z, z, z),
    ]
    for build in builds:
        with pytest.raises(ValueError, match=match):
            build()
    # decoding: a cache with an empty dimension (seq: max_len 0)
    with pytest.raises(ValueError, match=rf"key has an empty {dim} dimension"):
        jd.dilated_attention_decode(_arr((2, 1, 4, 8)), z, z, 0, **CFG)


def test_sharded_checks_global_shapes():
    mesh = make_mesh((2,), ("seq",))
    x = _arr((2, 16, 4, 8))
    attn = jd.sharded(jd.ring_attention, mesh, seq_axis="seq")
    with pytest.raises(ValueError, match=r"they must have the same length, got query "
                                         r"\(2, 16, 4, 8\) and key \(2, 8, 4, 8\)"):
        attn(x, x[:, :8], x[:, :8])
    mesh2 = make_mesh((2, 2), ("b", "seq"))
    x3 = _arr((3, 16, 4, 8))
    with pytest.raises(ValueError, match=r"batch_axis='b' has 2 devices: the batch size "
                                         r"must be divisible by it.*\(3, 16, 4, 8\)"):
        jd.sharded(jd.ring_attention, mesh2, seq_axis="seq", batch_axis="b")(x3, x3, x3)
    for not_a_mesh in ("mesh", {"seq": 2}, mesh.devices):
        with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
            jd.sharded(jd.ring_attention, not_a_mesh, seq_axis="seq")


@pytest.mark.parametrize("seq_len, error", [("big", TypeError), (0, ValueError),
                                            (-8, ValueError), (8.0, TypeError)])
def test_factory_seq_len_checked(seq_len, error):
    with pytest.raises(error, match=rf"seq_len must be a positive int, got {seq_len!r}"):
        jd.create_multihead_dilated_attention("auto", seq_len=seq_len, embed_dim=16,
                                              num_heads=2, rngs=nnx.Rngs(0), **CFG)
    with pytest.raises(error, match=r"seq_len must be a positive int"):
        jd.create_multihead_dilated_attention("dilated", seq_len=seq_len, embed_dim=16,
                                              num_heads=2, rngs=nnx.Rngs(0), **CFG)


@pytest.mark.parametrize("changes, error, match", [
    (dict(num_heads=1, mode="head_groups"), ValueError, r"needs at least as many heads"),
    (dict(implementation="foo"), ValueError, r"LongNetConfig.implementation must be one"),
    (dict(implementation=1), ValueError, r"LongNetConfig.implementation must be one"),
    (dict(param_dtype=jnp.int32), TypeError, r"LongNetConfig.param_dtype must be a float"),
    (dict(dtype="big"), TypeError, r"LongNetConfig.dtype must be a floating dtype"),
])
def test_longnet_config_refuses_what_the_model_would(changes, error, match):
    base = dict(vocab_size=8, embed_dim=16, num_heads=2, num_layers=1, **CFG)
    with pytest.raises(error, match=match):
        jd.models.LongNetConfig(**{**base, **changes})


@pytest.mark.parametrize("value", [1, 0, "yes", np.bool_(True)])
def test_attention_fn_is_causal_is_a_flag(value):
    with pytest.raises(TypeError, match=r"is_causal must be a Python bool, got"):
        jd.attention_fn(**CFG, is_causal=value)


def test_found_by_the_property_tests():
    """Inputs tests/test_properties.py found reaching the user as AttributeError or
    accepted until the first call."""
    q, k, v = _decode_inputs()
    with pytest.raises(TypeError, match=r"query must be an array, got list"):
        jd.dilated_attention_decode(np.asarray(q).tolist(), k, v, 3, **CFG)
    with pytest.raises(TypeError, match=r"key must be an array, got list"):
        jd.dilated_attention_decode(q, np.asarray(k).tolist(), v, 3, **CFG)
    with pytest.raises(TypeError, match=r"key_cache must be a floating array, got dtype int32"):
        jd.dilated_attention_decode(q, k.astype(jnp.int32), v, 3, **CFG)
    for rate in (1.0, "x"):
        with pytest.raises((TypeError, ValueError), match=r"dropout_rate"):
            jd.linen.MultiheadDilatedAttention(embed_dim=16, num_heads=2, dropout_rate=rate,
                                               **CFG)
        with pytest.raises((TypeError, ValueError), match=r"dropout_rate"):
            jd.linen.DilatedAttention(**CFG, dropout_rate=rate)
    cache = decoding.init_kv_cache(1, 4, 2, 4)
    x = jnp.ones((1, 1, 2, 4))
    with pytest.raises(ValueError, match=r"got key list and value list"):
        decoding.decode_step(cache, x, [1.0], [1.0], **CFG)
    with pytest.raises(ValueError, match=r"got query \(1, 1, 2, 4\), key list"):
        decoding.decode_tokens(cache, x, [1.0], x, **CFG)
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype"):
        decoding.init_kv_cache(1, 4, 2, 4, jnp.int32)
    with pytest.raises(TypeError, match=r"fn must be an attention function"):
        jd.sharded(3, jax.make_mesh((1,), ("seq",)), seq_axis="seq")


def test_longnet_lm_tokens_out_of_vocab():
    """Token ids outside [0, vocab_size): a concrete one raises naming the ids (a
    negative id used to wrap to the end of the table silently); under jit, where ids
    are traced, the logits they reach are NaN, never a plausible wrong number."""
    from flax import nnx

    from jax_dilated.models import LongNetConfig, LongNetLM

    cfg = LongNetConfig(vocab_size=16, embed_dim=8, num_heads=2, num_layers=1, max_len=16,
                        segment_lengths=(4,), dilation_rates=(1,))
    model = LongNetLM(cfg, rngs=nnx.Rngs(0))
    good = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
    run = nnx.jit(lambda m, t: m(t))
    assert bool(jnp.isfinite(run(model, good)).all())
    for bad_id in (-1, 16):
        tokens = good.at[0, 3].set(bad_id)
        with pytest.raises(ValueError, match=rf"tokens must be ids in \[0, vocab_size=16\), "
                                             rf"got \[{bad_id}\]"):
            model(tokens)
        assert bool(jnp.isnan(run(model, tokens)[0, 3]).all())
