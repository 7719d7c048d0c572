"""Bad input to ``dilated_attention`` raises at trace time, naming the argument.

One test per error; every ``match=`` names the offending argument (and, where
useful, the value received), as docs/semantics.md, section 1 requires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_segment_not_multiple_of_rate(qkv):
    with pytest.raises(ValueError, match=r"segment length 6 with dilation rate 4"):
        call(*qkv, segment_lengths=(8, 6), dilation_rates=(1, 4))


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
    f = jax.jit(lambda q, k, v: call(q, k, v, segment_lengths=(8, 6), dilation_rates=(1, 4)))
    with pytest.raises(ValueError, match=r"segment length 6 with dilation rate 4"):
        f(*qkv)
