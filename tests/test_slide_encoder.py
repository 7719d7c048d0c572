"""``jd.models.SlideEncoder``: Prov-GigaPath's slide encoder (its ``LongNetViT``).

Against ``torch_reference.torchscale.SlideEncoder`` with the same random weights (its
``state_dict()`` loaded by ``from_torch_state_dict``), tiny widths (D=32, 4 heads,
2 layers, tile embeddings of 24) and Prov-GigaPath's segment rule at
``max_wsi_size=11776`` (segments 1024/1217/1448/1722/2048, rates 1..16):

* float64, 1999 tiles (2000 tokens: 1217 at rate 2 and 1722 at rate 8 shift their
  outputs), ``all_layer_embed=True``: every layer's embedding within 1e-10, gradients
  with respect to the tile embeddings and every parameter (torch's ``.grad`` by
  name) within 1e-8, the whole model under ``jax.jit`` with its parameters as
  arguments;
* float32, 700 tiles (701 tokens, odd: every branch one zero-padded segment):
  ``all_layer_embed`` with ``global_pool`` and the default call, within 1e-5 of the
  float64 reference (relative to its largest magnitude);
* ``dtype=bfloat16``, 1067 tiles (a second 1024-segment of 44 real tokens), global
  pooling: within 2e-2.

Without torch: the position rows equal Prov-GigaPath's full ``pos_embed`` table
(built here the way its ``get_2d_sincos_pos_embed`` builds it) at the tiles' rows,
off-grid coordinates are refused (concrete) or NaN (traced); checkpoints round-trip
through ``.npz`` (and ``.pth`` / ``convert_checkpoint`` with torch); missing,
unexpected and mis-shaped entries are refused by name; ``pos_embed`` is accepted only
when it is the formula's; the config's derived segments and validation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import TOL, assert_close
from _mesh import make_mesh
from flax import nnx

import jax_dilated as jd
from jax_dilated.models import SlideEncoder, SlideEncoderConfig, convert_checkpoint
from jax_dilated.models.slide import position_rows, sincos_table


# the PyTorch reference on one thread while this module runs (conftest.py says why)
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


IN, D, H, F, LAYERS = 24, 32, 4, 64, 2
SMALL = dict(in_features=IN, embed_dim=D, num_layers=LAYERS, num_heads=H, ffn_dim=F,
             max_wsi_size=11776)


def config(**kw):
    return SlideEncoderConfig(**{**SMALL, **kw})


def slide(seed, n, batch=1):
    """Tile embeddings [B, n, IN] and distinct level-0 pixel coordinates [B, n, 2]
    (tile corners plus an offset inside the tile) on the 1000 x 1000 grid."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, n, IN))
    cells = np.stack([rng.choice(1000 * 1000, n, replace=False) for _ in range(batch)])
    coords = np.stack([cells // 1000, cells % 1000], axis=-1) * 256.0
    return x, coords + rng.uniform(0, 255, coords.shape).round()


# ------------------------------------------------------------ against PyTorch


@pytest.fixture(scope="module")
def torch_model():
    pytest.importorskip("torch")
    import torch
    from torch_reference import torchscale

    cfg = config()
    return torchscale.SlideEncoder(IN, D, LAYERS, H, F, cfg.segment_lengths, cfg.dilation_rates,
                                   seed=7, dtype=torch.float64)


def _torch_outputs(torch_model, x, coords, **kw):
    import torch
    with torch.no_grad():
        outs = torch_model(torch.tensor(x), torch.tensor(coords), **kw)
    return [o.numpy() for o in outs]


def test_float64_every_layer_and_gradients(torch_model):
    import torch

    x, coords = slide(0, 1999)
    rng = np.random.default_rng(1)
    cotangents = [rng.standard_normal((1, D)) for _ in range(LAYERS + 1)]
    xt = torch.tensor(x, requires_grad=True)
    torch_model.zero_grad()
    outs_t = torch_model(xt, torch.tensor(coords), all_layer_embed=True)
    sum((torch.tensor(g) * o).sum() for g, o in zip(cotangents, outs_t)).backward()

    model = SlideEncoder.from_torch_state_dict(torch_model.state_dict(),
                                               config(param_dtype=jnp.float64))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x, coords):
        outs = nnx.merge(graphdef, params, rest)(x, coords, all_layer_embed=True)
        return sum(jnp.sum(jnp.asarray(g) * o) for g, o in zip(cotangents, outs)), outs

    (_, outs), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, jnp.asarray(x), jnp.asarray(coords))
    assert len(outs) == LAYERS + 1 and all(o.shape == (1, D) for o in outs)
    for i, (o, o_t) in enumerate(zip(outs, outs_t)):
        assert_close(o, o_t, TOL["float64"], f"layer {i}")
    assert_close(g_x, xt.grad, 1e-8, "d tile_embeds")
    g_params = nnx.merge(graphdef, g_params, rest).to_state_dict()
    torch_grads = {name: p.grad for name, p in torch_model.named_parameters()}
    assert sorted(g_params) == sorted(torch_grads)
    unused = sorted(name for name, grad in torch_grads.items() if grad is None)
    assert unused == ["encoder.layer_norm.bias", "encoder.layer_norm.weight"]  # no encoder_out
    for name, grad in torch_grads.items():
        if grad is None:
            assert not np.any(g_params[name]), name
        else:
            assert_close(g_params[name], grad, 1e-8, f"d {name}")


@functools.partial(nnx.jit, static_argnames=("calls",))
def _calls(model, x, coords, calls):
    return [model(x, coords, all_layer_embed=a, global_pool=g) for a, g in calls]


def test_float32_both_poolings_odd_length(torch_model):
    x, coords = slide(2, 700, batch=2)
    calls = ((True, True), (False, False))
    want = [_torch_outputs(torch_model, x, coords, all_layer_embed=a, global_pool=g)
            for a, g in calls]
    model = SlideEncoder.from_torch_state_dict(torch_model.state_dict(), config())
    got = _calls(model, jnp.asarray(x, jnp.float32), jnp.asarray(coords, jnp.float32), calls)
    assert [len(g) for g in got] == [LAYERS + 1, 1]
    for (a, g), outs, outs_t in zip(calls, got, want):
        for i, (o, o_t) in enumerate(zip(outs, outs_t)):
            assert o.dtype == jnp.float32 and o.shape == (2, D)
            assert_close(o, o_t, TOL["float32"], f"all_layer_embed={a}, global_pool={g}, [{i}]")


def test_bfloat16_within_2e2(torch_model):
    x, coords = slide(3, 1067)
    want = _torch_outputs(torch_model, x, coords, global_pool=True)
    model = SlideEncoder.from_torch_state_dict(torch_model.state_dict(), config(),
                                               dtype=jnp.bfloat16)
    (got,), = _calls(model, jnp.asarray(x, jnp.float32), jnp.asarray(coords, jnp.float32),
                     ((False, True),))
    assert got.dtype == jnp.float32  # float32 parameters: float32 out (documented)
    assert_close(got, want[0], TOL["bfloat16"], "bfloat16")


# ------------------------------------------------------------- positions


def _gigapath_pos_embed(embed_dim, grid_size):
    """Prov-GigaPath's table [G^2 + 1, D], built as its get_2d_sincos_pos_embed does:
    a meshgrid with w first, half the channels from each grid, CLS row zeros."""
    def one_d(width, pos):
        omega = 1.0 / 10000 ** (np.arange(width // 2, dtype=np.float64) / (width / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.stack(np.meshgrid(np.arange(grid_size, dtype=np.float32),
                                np.arange(grid_size, dtype=np.float32)), axis=0)
    emb = np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], 1)
    return np.concatenate([np.zeros((1, embed_dim)), emb], axis=0).astype(np.float32)


def test_position_rows_equal_gigapath_table():
    g, d, ts = 7, 16, 256
    table = _gigapath_pos_embed(d, g)
    rng = np.random.default_rng(0)
    cells = rng.integers(0, g, (3, 40, 2))
    coords = cells * ts + rng.integers(0, ts, cells.shape)  # anywhere inside the tile
    rows = position_rows(jnp.asarray(coords), embed_dim=d, tile_size=ts, grid_size=g)
    index = cells[..., 0] * g + cells[..., 1]
    np.testing.assert_array_equal(np.asarray(rows), table[index + 1])
    np.testing.assert_array_equal(sincos_table(g, d), table[1:g + 1, :d // 2])
    # floats too, and traced: off-grid tiles give NaN rows, never another row
    bad = np.array([[[-1.0, 0.0], [0.0, g * g * ts], [np.nan, 0.0], [5.0, 300.0]]])
    traced = jax.jit(functools.partial(position_rows, embed_dim=d, tile_size=ts, grid_size=g))(
        jnp.asarray(bad))
    assert np.isnan(np.asarray(traced[0, :3])).all()
    np.testing.assert_array_equal(np.asarray(traced[0, 3]), table[1 + 1])


def test_off_grid_coords_and_bad_inputs_refused():
    model = SlideEncoder(config(), rngs=nnx.Rngs(0))
    x = jnp.zeros((1, 3, IN), jnp.float32)
    coords = jnp.asarray([[[0, 0], [256, 512], [1000 * 256, 0]]])
    with pytest.raises(ValueError, match=r"coords \(1, 3, 2\) must put every tile on the "
                                         r"1000 x 1000 grid .* coords\[0, 2\] = \[256000"):
        model(x, coords)
    with pytest.raises(ValueError, match=r"tile_embeds must be a floating array \[batch, "
                                         r"tiles, in_features=24\]"):
        model(jnp.zeros((1, 3, IN + 1)), coords)
    with pytest.raises(ValueError, match=r"coords must be a numeric array \[batch, tiles, 2\] "
                                         r"= \(1, 3, 2\)"):
        model(x, coords[:, :2])
    with pytest.raises(TypeError, match="global_pool must be a Python bool"):
        model(x, coords, global_pool="yes")


# ------------------------------------------------------------ checkpoints


def test_checkpoint_round_trips(tmp_path):
    model = SlideEncoder(config(), rngs=nnx.Rngs(0))
    weights = model.to_state_dict()
    assert weights["cls_token"].shape == (1, 1, D)
    assert weights["patch_embed.proj.weight"].shape == (D, IN)
    assert weights["norm.weight"].shape == (D,)
    assert weights["encoder.layers.1.self_attn.out_proj.weight"].shape == (D, D)
    assert len(weights) == 1 + 2 + 2 + LAYERS * 20 + 2  # cls, patch_embed, norm, encoder

    def same(loaded):
        again = loaded.to_state_dict()
        assert sorted(again) == sorted(weights)
        for name, value in weights.items():
            np.testing.assert_array_equal(again[name], value, err_msg=name)

    model.save_npz(tmp_path / "w.npz")
    same(SlideEncoder.load(tmp_path / "w.npz", config()))
    assert [p.name for p in tmp_path.iterdir()] == ["w.npz"]  # no temporary left behind
    try:
        import safetensors.numpy as st_numpy
    except ImportError:
        (tmp_path / "w.safetensors").write_bytes(b"")
        with pytest.raises(ImportError, match="needs the safetensors package"):
            SlideEncoder.load(tmp_path / "w.safetensors", config())
    else:
        st_numpy.save_file(weights, str(tmp_path / "w.safetensors"))
        same(SlideEncoder.load(tmp_path / "w.safetensors", config()))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        SlideEncoder.load(tmp_path / "none.npz", config())

    torch = pytest.importorskip("torch")
    tensors = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
    torch.save({"model": tensors, "epoch": 3}, tmp_path / "slide_encoder.pth")
    same(SlideEncoder.load(tmp_path / "slide_encoder.pth", config()))
    names = convert_checkpoint(tmp_path / "slide_encoder.pth", tmp_path / "converted.npz")
    assert names == sorted(weights)
    same(SlideEncoder.load(tmp_path / "converted.npz", config()))
    torch.save(tensors, tmp_path / "bare.pth")  # a bare state dict loads too
    same(SlideEncoder.load(tmp_path / "bare.pth", config()))


def test_state_dict_errors_name_the_entries():
    cfg = config(grid_size=6)
    weights = SlideEncoder(cfg, rngs=nnx.Rngs(0)).to_state_dict()
    bad = dict(weights, **{"head.weight": np.zeros((2, D), np.float32),
                           "patch_embed.proj.weight": np.zeros((D, IN + 1), np.float32)})
    del bad["encoder.layers.0.ffn.fc1.weight"], bad["cls_token"]
    with pytest.raises(ValueError) as err:
        SlideEncoder.from_torch_state_dict(bad, cfg)
    msg = str(err.value)
    assert "missing: cls_token, encoder.layers.0.ffn.fc1.weight;" in msg
    assert "unexpected: head.weight;" in msg
    assert f"mis-shaped: patch_embed.proj.weight (expected ({D}, {IN}), got ({D}, {IN + 1}))" \
        in msg
    # pos_embed (a non-persistent buffer): accepted when it is the formula's table
    table = _gigapath_pos_embed(D, 6)[None]
    loaded = SlideEncoder.from_torch_state_dict(dict(weights, pos_embed=table), cfg)
    assert "pos_embed" not in loaded.to_state_dict()
    with pytest.raises(ValueError, match="is not Prov-GigaPath's 2-D sin-cos table"):
        SlideEncoder.from_torch_state_dict(dict(weights, pos_embed=table[:, ::-1]), cfg)
    with pytest.raises(ValueError, match=r"mis-shaped: pos_embed \(expected \(1, 37, 32\)"):
        SlideEncoder.from_torch_state_dict(dict(weights, pos_embed=table[:, :5]), cfg)


# ----------------------------------------------------------------- config


def test_config_derives_gigapath_segments():
    public = SlideEncoderConfig.gigapath()
    assert public.segment_lengths == (1024, 5792, 32768, 185363, 1048576)
    assert public.dilation_rates == (1, 2, 4, 8, 16)
    assert (public.in_features, public.embed_dim, public.num_layers, public.num_heads,
            public.ffn_dim, public.dropout_rate, public.drop_path_rate) == (
        1536, 768, 12, 16, 3072, 0.25, 0.1)
    assert config().segment_lengths == (1024, 1217, 1448, 1722, 2048)
    # PANDA fine-tuning's max_wsi_size: 23170 at rate 4 shifts outputs past 23,170 tokens
    assert SlideEncoderConfig.gigapath(max_wsi_size=250000).segment_lengths == (
        1024, 4870, 23170, 110217, 524288)
    enc = public.encoder_config()
    assert (enc.segment_lengths, enc.mode, enc.layer_norm_eps, enc.is_causal) == (
        public.segment_lengths, "torchscale", 1e-5, False)
    assert enc.drop_path_rates[-1] == pytest.approx(0.1)
    with pytest.raises(AttributeError):
        public.segment_lengths = (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        public.tile_size = 128
    assert SlideEncoderConfig.gigapath(dtype=jnp.bfloat16).encoder_config().dtype == jnp.bfloat16


@pytest.mark.parametrize("changes, error, match", [
    (dict(embed_dim=30, num_heads=3), ValueError, "SlideEncoderConfig.embed_dim must be "
                                                  "divisible by 4"),
    (dict(embed_dim=36, num_heads=8), ValueError, r"SlideEncoderConfig.embed_dim \(36\) must "
                                                  "be divisible by num_heads"),
    (dict(max_wsi_size=100), ValueError, "SlideEncoderConfig.max_wsi_size"),
    (dict(tile_size=0), ValueError, "SlideEncoderConfig.tile_size must be a positive"),
    (dict(grid_size=50000), ValueError, "SlideEncoderConfig.grid_size"),
    (dict(mode="exact"), ValueError, "SlideEncoderConfig.mode must be one of"),
    (dict(drop_path_rate=1.5), ValueError, "SlideEncoderConfig.drop_path_rate"),
    (dict(norm_eps=-1.0), ValueError, "SlideEncoderConfig.norm_eps"),
    (dict(dtype="int8"), TypeError, "SlideEncoderConfig.dtype must be a floating"),
])
def test_config_refuses_bad_settings(changes, error, match):
    with pytest.raises(error, match=match):
        config(**changes)


# ------------------------------------------------------------------------------ mesh


_ONE_DEVICE = {}  # the model and its outputs on one device: the same for both meshes


def _embeddings(model, x, coords, states=True):
    """The embeddings of both layers (states, ``all_layer_embed``) if ``states``, and
    the pooled one (``global_pool``): a list, under ``nnx.jit``."""
    return nnx.jit(lambda m, x, c: (m(x, c, all_layer_embed=True) if states else [])
                   + m(x, c, global_pool=True))(model, x, coords)


@pytest.mark.parametrize("shape,axis", [((8,), "s"), ((2, 4), ("a", "b"))],
                         ids=["8", "2x4"])
def test_on_a_mesh_equals_one_device(shape, axis):
    """Sharded over 8 devices (one axis, or a pair as one), a slide whose tokens the
    devices do not divide (1299 tiles: padded, ``valid_length``; 1300 tokens shift two
    branches' outputs, and the three longest branches hold one short segment): the
    embeddings of both layers (states) and the pooled one equal one device's (float64,
    computed once for both meshes), the model under ``nnx.jit``. On the pair, the pooled
    one alone (the mean of every tile's output, the padding left out: each sharded pass
    of the encoder compiles a switch over the devices' head programs, 4-5 s, and the
    states are those of the same sharded encoder, compared on one axis)."""
    mesh = make_mesh(shape, ("s",) if len(shape) == 1 else ("a", "b"))
    cfg = config(num_heads=8, num_layers=1)
    x, coords = slide(5, 1299)
    if not _ONE_DEVICE:
        one = SlideEncoder(cfg, rngs=nnx.Rngs(3))
        _ONE_DEVICE.update(weights=one.to_state_dict(), want=_embeddings(one, x, coords))
    many = SlideEncoder.from_torch_state_dict(_ONE_DEVICE["weights"], cfg, mesh=mesh,
                                              seq_axis=axis)
    got = _embeddings(many, x, coords, states=len(shape) == 1)
    want = _ONE_DEVICE["want"][-len(got):]
    assert len(got) == (3 if len(shape) == 1 else 1)  # 1 layer: 2 states; the pooled one
    for got, want in zip(got, want):
        assert_close(np.asarray(got), np.asarray(want), TOL["float64"])


def test_encoder_modes_other_than_torchscale_mask_the_padding_on_a_mesh():
    """In ``"longnet"`` mode a mesh's padding is masked out (exact LongNet on the
    slide's own tokens): equal to one device."""
    mesh = make_mesh((8,), ("s",))
    cfg = jd.models.LongNetEncoderConfig(embed_dim=D, num_layers=1, num_heads=8, ffn_dim=F,
                                         segment_lengths=(64, 256), dilation_rates=(1, 4),
                                         mode="longnet")
    one = jd.models.LongNetEncoder(cfg, rngs=nnx.Rngs(4))
    many = jd.models.LongNetEncoder.from_torch_state_dict(one.to_state_dict(), cfg,
                                                          mesh=mesh, seq_axis="s")
    x = np.random.default_rng(6).standard_normal((2, 301, D))
    run = nnx.jit(lambda m, x: m(x, return_states=True))
    (o1, s1), (o8, s8) = run(one, x), run(many, x)
    for got, want in zip([o8, *s8], [o1, *s1]):
        assert_close(np.asarray(got), np.asarray(want), TOL["float64"])
