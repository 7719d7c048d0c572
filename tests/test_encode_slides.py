"""``scripts/encode_slides.py``: a directory of tile embeddings in, one slide embedding per
file out, equal to ``jd.models.SlideEncoder`` on each slide; malformed files reported by
name and skipped; an interrupted run resumed without recomputing, and no partial output."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import require_devices
from flax import nnx

from jax_dilated.models import SlideEncoder, SlideEncoderConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(in_features=12, embed_dim=16, num_layers=2, num_heads=4, ffn_dim=32,
             max_wsi_size=11776)
CONFIG_ARGS = ["--config"] + [f"{k}={v}" for k, v in SMALL.items()]


def _script():
    spec = importlib.util.spec_from_file_location("encode_slides",
                                                  ROOT / "scripts" / "encode_slides.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["encode_slides"] = module
    spec.loader.exec_module(module)
    return module


encode_slides = _script()


def _slide(rng, n, width=12):
    cells = rng.choice(40 * 40, n, replace=False)
    coords = np.stack([cells // 40, cells % 40], -1) * 256.0 + 17.0
    return rng.standard_normal((n, width)).astype(np.float32), coords.astype(np.float32)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    config = SlideEncoderConfig.gigapath(**SMALL)
    model = SlideEncoder(config, rngs=nnx.Rngs(0))
    path = tmp_path_factory.mktemp("weights") / "slide_encoder.npz"
    model.save_npz(path)
    return model, path


@pytest.fixture()
def slides(tmp_path):
    rng = np.random.default_rng(0)
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    good = {}
    for name, n in (("a", 30), ("b", 30), ("c", 30)):  # one tile count: one compilation
        x, coords = _slide(rng, n)
        key = "features" if name == "b" else "tile_embeds"
        np.savez(tiles / f"{name}.npz", **{key: x, "coords": coords})
        good[name] = (x, coords)
    x, coords = _slide(rng, 20)
    np.savez(tiles / "wide.npz", tile_embeds=np.ones((20, 13), np.float32), coords=coords)
    np.savez(tiles / "nocoords.npz", tile_embeds=x)
    np.savez(tiles / "short.npz", tile_embeds=x, coords=coords[:19])
    np.savez(tiles / "nan.npz", tile_embeds=np.where(x > 2, np.nan, x), coords=coords)
    (tiles / "broken.npz").write_bytes(b"not a zip file")
    (tiles / "notes.txt").write_text("not a slide")
    return tiles, good


def _expected(model, x, coords, **kw):
    """The model's outputs on one slide (under nnx.jit: one compilation per options)."""
    return [np.asarray(o[0]) for o in _run(tuple(sorted(kw.items())))(
        model, jnp.asarray(x[None]), jnp.asarray(coords[None]))]


@functools.cache
def _run(options):
    return nnx.jit(lambda model, x, coords: model(x, coords, **dict(options)))


def test_encodes_each_slide_and_reports_the_malformed_by_name(model_file, slides, tmp_path,
                                                               capsys):
    model, weights = model_file
    tiles, good = slides
    out = tmp_path / "out"
    code = encode_slides.main([str(tiles), str(out), "--checkpoint", str(weights),
                               "--quiet", *CONFIG_ARGS])
    assert code == 1  # some were skipped
    assert sorted(p.name for p in out.iterdir()) == ["a.npy", "b.npy", "c.npy"]
    for name, (x, coords) in good.items():
        np.testing.assert_allclose(np.load(out / f"{name}.npy"),
                                   _expected(model, x, coords)[0], rtol=1e-5, atol=1e-5)
    err = capsys.readouterr().err
    for name, why in (("wide.npz", "width 13"), ("nocoords.npz", "no coords"),
                      ("short.npz", "[tiles, 2]"), ("nan.npz", "NaN"),
                      ("broken.npz", "cannot be read")):
        assert f"skipped {name}: " in err and why in err.split(f"skipped {name}: ")[1], err


def test_every_layer_mean_pooled(model_file, slides, tmp_path):
    model, weights = model_file
    tiles, good = slides
    x, coords = good["a"]
    every = _expected(model, x, coords, all_layer_embed=True, global_pool=True)
    out = tmp_path / "out"
    encode_slides.main([str(tiles), str(out), "--checkpoint", str(weights), "--quiet",
                        "--pool", "mean", "--layer", "all", *CONFIG_ARGS])
    np.testing.assert_allclose(np.load(out / "a.npy"), np.stack(every), rtol=1e-5, atol=1e-5)


def test_an_interrupted_run_resumes_and_leaves_no_partial_file(model_file, slides, tmp_path,
                                                               monkeypatch):
    _, weights = model_file
    tiles, _ = slides
    out = tmp_path / "out"
    argv = [str(tiles), str(out), "--checkpoint", str(weights), "--quiet", *CONFIG_ARGS]
    real_save, calls = np.save, []

    def dies_on_the_second(f, array):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"half")  # a partial write, then the process is killed
            raise KeyboardInterrupt
        real_save(f, array)

    monkeypatch.setattr(np, "save", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        encode_slides.main(argv)
    assert [p.name for p in out.iterdir()] == ["a.npy"]  # no temporary file left
    done = (out / "a.npy").stat().st_mtime_ns
    monkeypatch.setattr(np, "save", real_save)
    encode_slides.main(argv)
    assert sorted(p.name for p in out.iterdir()) == ["a.npy", "b.npy", "c.npy"]
    assert (out / "a.npy").stat().st_mtime_ns == done  # not recomputed


def test_mesh_option_equals_one_device(model_file, slides, tmp_path):
    # --mesh P shards over P devices of the default backend (8 simulated CPU devices
    # here, conftest.py); on one GPU the script refuses it, rightly, so the test skips
    require_devices(2)
    model, weights = model_file
    tiles, good = slides
    out = tmp_path / "out"
    encode_slides.main([str(tiles), str(out), "--checkpoint", str(weights), "--quiet",
                        "--mesh", "2", *CONFIG_ARGS])
    x, coords = good["b"]
    np.testing.assert_allclose(np.load(out / "b.npy"), _expected(model, x, coords)[0],
                               rtol=1e-5, atol=1e-5)
