"""``jd.models.LongNetEncoder``: torchscale's LongNet encoder.

* Against ``torch_reference.torchscale.LongNetEncoder`` with the same random weights
  (its ``state_dict()`` loaded by ``from_torch_state_dict``), float64, an odd length
  (331) with non-dividing segments (75 at rate 2, 150 at rate 4: padded slots and
  shifted outputs): ``encoder_out`` and every one of the ``num_layers + 1`` states
  within 1e-10, gradients with respect to the input and every parameter (torch's
  ``.grad`` by name) within 1e-8.
* ``mode="longnet"`` (blocked head offsets) equals ``"torchscale"`` where nothing is
  padded or shifted; ``"head_groups"`` runs.
* Dropout, attention dropout, activation dropout and drop-path act only with
  ``deterministic=False``; drop-path drops whole samples, scaled by ``1 / (1 - p)``.
* ``to_state_dict`` / ``from_torch_state_dict`` round trip (numpy and torch values);
  missing, unexpected and mis-shaped entries refused by name; the config refuses bad
  settings naming the field.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import TOL, assert_close
from flax import nnx

import jax_dilated as jd
from jax_dilated.models import LongNetEncoder, LongNetEncoderConfig
from jax_dilated.models.encoder import _DropPath

D, H, F, LAYERS = 32, 4, 64, 2
SEGS = dict(segment_lengths=(32, 75, 150), dilation_rates=(1, 2, 4))


def config(**kw):
    base = dict(embed_dim=D, num_layers=LAYERS, num_heads=H, ffn_dim=F, **SEGS)
    base.update(kw)
    return LongNetEncoderConfig(**base)


def _reference():
    pytest.importorskip("torch")
    from torch_reference import torchscale
    return torchscale


def _value_and_grads(model, x, cotangents):
    """Output, states and the gradients (input; parameters under torch names) of
    ``sum(g_out * out) + sum_i sum(g_i * states_i)``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        out, states = nnx.merge(graphdef, params, rest)(x, return_states=True)
        total = sum(jnp.sum(g * s) for g, s in zip(cotangents, [out] + states))
        return total, (out, states)

    (_, (out, states)), (g_params, g_x) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, states, g_x, nnx.merge(graphdef, g_params, rest).to_state_dict()


def test_equals_torch_reference_float64_states_and_gradients():
    ref = _reference()
    import torch

    torch_model = ref.LongNetEncoder(D, LAYERS, H, F, SEGS["segment_lengths"],
                                     SEGS["dilation_rates"], seed=5, dtype=torch.float64)
    model = LongNetEncoder.from_torch_state_dict(torch_model.state_dict(),
                                                 config(param_dtype=jnp.float64))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 331, D))
    cotangents = [rng.standard_normal(x.shape) for _ in range(LAYERS + 2)]

    xt = torch.tensor(x, requires_grad=True)
    out_t, states_t = torch_model(xt, return_states=True)
    total = sum((torch.tensor(g) * s).sum() for g, s in zip(cotangents, [out_t] + states_t))
    total.backward()

    out, states, g_x, g_params = _value_and_grads(model, jnp.asarray(x),
                                                  [jnp.asarray(g) for g in cotangents])
    assert len(states) == LAYERS + 1
    assert_close(out, out_t, TOL["float64"], "encoder_out")
    for i, (s, s_t) in enumerate(zip(states, states_t)):
        assert_close(s, s_t, TOL["float64"], f"states[{i}]")
    assert_close(g_x, xt.grad, 1e-8, "d input")
    torch_grads = {name: p.grad for name, p in torch_model.named_parameters()}
    assert sorted(g_params) == sorted(torch_grads)
    for name, grad in torch_grads.items():
        assert_close(g_params[name], grad, 1e-8, f"d {name}")


@nnx.jit
def _forward(model, x):
    return model(x)


def test_longnet_mode_equals_torchscale_without_padding_and_head_groups_runs():
    segs = dict(segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4))
    base = LongNetEncoder(config(**segs, num_layers=1, param_dtype=jnp.float64),
                          rngs=nnx.Rngs(0))
    weights = base.to_state_dict()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 128, D)))
    out = {}
    for mode in ("torchscale", "longnet", "head_groups"):
        model = LongNetEncoder.from_torch_state_dict(
            weights, config(**segs, num_layers=1, param_dtype=jnp.float64, mode=mode))
        out[mode] = np.asarray(_forward(model, x))
    # 128 tokens: whole segments, rates dividing them: no zero slot, no shift
    assert_close(out["longnet"], out["torchscale"], TOL["float64"], "longnet vs torchscale")
    assert np.all(np.isfinite(out["head_groups"]))
    assert np.abs(out["head_groups"] - out["torchscale"]).max() > 1e-3


def test_dropouts_act_only_when_not_deterministic():
    segs = dict(segment_lengths=(16, 32), dilation_rates=(1, 2))
    plain = LongNetEncoder(config(**segs), rngs=nnx.Rngs(0))
    noisy = LongNetEncoder.from_torch_state_dict(
        plain.to_state_dict(),
        config(**segs, dropout_rate=0.2, drop_path_rate=0.3, attention_dropout_rate=0.2,
               activation_dropout_rate=0.2), rngs=nnx.Rngs(params=0, dropout=1))
    x = jax.random.normal(jax.random.key(0), (2, 40, D), jnp.float32)

    @functools.partial(nnx.jit, static_argnames="deterministic")
    def run(model, x, deterministic):
        return model(x, deterministic=deterministic)

    want = run(plain, x, True)
    np.testing.assert_array_equal(run(noisy, x, True), want)
    first, second = run(noisy, x, False), run(noisy, x, False)
    assert np.all(np.isfinite(first)) and np.all(np.isfinite(second))
    assert np.abs(first - want).max() > 1e-3
    assert np.abs(first - second).max() > 1e-3  # the stream moves on
    assert noisy.config.drop_path_rates == (0.0, 0.3)


def test_drop_path_drops_whole_samples():
    layer = _DropPath(0.5, nnx.Rngs(dropout=3))
    x = jnp.ones((64, 5, 3), jnp.float32)
    np.testing.assert_array_equal(layer(x, deterministic=True), x)
    y = np.asarray(layer(x, deterministic=False))
    per_row = y.reshape(64, -1)
    assert np.all(per_row == per_row[:, :1])  # one draw per sample
    assert set(np.unique(per_row)) == {0.0, 2.0}  # dropped, or kept and scaled by 1/(1-p)
    assert not np.array_equal(layer(x, deterministic=False), y)


def test_state_dict_round_trip_and_torch_values():
    model = LongNetEncoder(config(), rngs=nnx.Rngs(0))
    weights = model.to_state_dict()
    assert weights["layers.1.self_attn.q_proj.weight"].shape == (D, D)
    assert weights["layers.0.ffn.fc1.weight"].shape == (F, D)
    assert weights["layers.0.ffn.fc2.weight"].shape == (D, F)
    assert weights["layers.0.ffn.ffn_layernorm.weight"].shape == (F,)
    assert weights["layer_norm.bias"].shape == (D,)
    names = {f"layers.{i}.{part}.{p}" for i in range(LAYERS) for p in ("weight", "bias")
             for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.out_proj", "self_attn.inner_attn_ln",
                          "self_attn_layer_norm", "ffn.fc1", "ffn.ffn_layernorm", "ffn.fc2",
                          "final_layer_norm")} | {"layer_norm.weight", "layer_norm.bias"}
    assert set(weights) == names
    again = LongNetEncoder.from_torch_state_dict(weights, config()).to_state_dict()
    for name in names:
        np.testing.assert_array_equal(again[name], weights[name], err_msg=name)
    torch = pytest.importorskip("torch")
    as_torch = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
    as_torch["layer_norm.weight"] = as_torch["layer_norm.weight"].to(torch.bfloat16)
    loaded = LongNetEncoder.from_torch_state_dict(as_torch, config()).to_state_dict()
    np.testing.assert_array_equal(loaded["layers.0.ffn.fc1.weight"],
                                  weights["layers.0.ffn.fc1.weight"])
    assert loaded["layer_norm.weight"].dtype == np.float32


def test_state_dict_errors_name_the_entries():
    weights = LongNetEncoder(config(), rngs=nnx.Rngs(0)).to_state_dict()
    bad = dict(weights)
    del bad["layers.1.ffn.fc2.bias"]
    bad["layers.2.self_attn.q_proj.weight"] = np.zeros((D, D), np.float32)
    bad["layers.0.self_attn.k_proj.weight"] = np.zeros((D, D + 1), np.float32)
    with pytest.raises(ValueError) as err:
        LongNetEncoder.from_torch_state_dict(bad, config())
    msg = str(err.value)
    assert "missing: layers.1.ffn.fc2.bias" in msg
    assert "unexpected: layers.2.self_attn.q_proj.weight" in msg
    assert f"mis-shaped: layers.0.self_attn.k_proj.weight (expected ({D}, {D}), got " \
           f"({D}, {D + 1}))" in msg
    bad = dict(weights, **{"layer_norm.bias": np.zeros(D, np.int32)})
    with pytest.raises(TypeError, match=r"state_dict\['layer_norm.bias'\] must be a floating"):
        LongNetEncoder.from_torch_state_dict(bad, config())
    with pytest.raises(TypeError, match="config must be a LongNetEncoderConfig"):
        LongNetEncoder.from_torch_state_dict(weights, object())


@pytest.mark.parametrize("changes, error, match", [
    (dict(embed_dim=30), ValueError, r"embed_dim \(30\) must be divisible by num_heads"),
    (dict(num_layers=0), ValueError, "LongNetEncoderConfig.num_layers must be a positive"),
    (dict(ffn_dim=1.5), TypeError, "LongNetEncoderConfig.ffn_dim"),
    (dict(mode="exact"), ValueError, "LongNetEncoderConfig.mode must be one of"),
    (dict(dilation_rates=(1, 2)), ValueError, "LongNetEncoderConfig.segment_lengths and "
                                              "dilation_rates must have the same length"),
    (dict(segment_lengths=(32, 0, 150)), ValueError, "LongNetEncoderConfig.segment_lengths"),
    (dict(segment_lengths=(jd.SlidingWindow(4), 75, 150)), ValueError, "must hold ints"),
    (dict(drop_path_rate=1.0), ValueError, "LongNetEncoderConfig.drop_path_rate must be in"),
    (dict(dropout_rate=-0.1), ValueError, "LongNetEncoderConfig.dropout_rate"),
    (dict(layer_norm_eps=0.0), ValueError, "LongNetEncoderConfig.layer_norm_eps"),
    (dict(is_causal=1), TypeError, "LongNetEncoderConfig.is_causal must be a Python bool"),
    (dict(dtype=jnp.int32), TypeError, "LongNetEncoderConfig.dtype must be a floating"),
    (dict(implementation="flash"), ValueError, "LongNetEncoderConfig.implementation"),
    (dict(mode="head_groups", num_heads=2, embed_dim=32), ValueError, "num_heads"),
])
def test_config_refuses_bad_settings(changes, error, match):
    with pytest.raises(error, match=match):
        config(**changes)


def test_input_and_arguments_checked():
    model = LongNetEncoder(config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must be a floating array \[batch, seq, "
                                         r"embed_dim=32\]"):
        model(jnp.zeros((2, 10, D + 1)))
    with pytest.raises(ValueError, match="x must be"):
        model(jnp.zeros((10, D)))
    with pytest.raises(TypeError, match="deterministic must be a Python bool"):
        model(jnp.zeros((1, 10, D)), deterministic=None)
    with pytest.raises(TypeError, match="config must be a LongNetEncoderConfig"):
        LongNetEncoder(jd.models.LongNetConfig(vocab_size=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="seq_axis='seq' was given without a mesh"):
        LongNetEncoder(config(), rngs=nnx.Rngs(0), seq_axis="seq")
