"""Encode whole-slide images: a directory of tile embeddings in, one slide embedding per
slide out, with Prov-GigaPath's slide encoder (``jd.models.SlideEncoder``).

    python scripts/encode_slides.py TILES_DIR OUT_DIR --checkpoint slide_encoder.npz
    python scripts/encode_slides.py TILES_DIR OUT_DIR --checkpoint slide_encoder.pth \\
        --pool mean --layer 11 --dtype bfloat16 --mesh 8

Input: one file per slide in ``TILES_DIR`` (``*.npz``; ``*.pt`` / ``*.pth`` with torch
installed; ``*.h5`` with h5py installed) holding the tile embeddings ``[N, F]`` (under
``tile_embeds``, ``features`` or ``embeds``) and the level-0 pixel coordinates of
their tiles ``[N, 2]`` (``coords``), as Prov-GigaPath's tile encoder writes them.

Output: ``OUT_DIR/<slide>.npy`` per slide: the embedding ``[D]`` of the layer
``--layer`` names (``final``: the encoder's output, Prov-GigaPath's default; ``i`` in
``0 .. num_layers``: entry ``i`` of its ``all_layer_embed`` list, 0 the input
embeddings; ``all``: every entry, ``[num_layers + 1, D]``), pooled by ``--pool`` (``cls``,
the CLS token, Prov-GigaPath's default, or ``mean`` over the tiles: its
``global_pool``).

A run resumes where an interrupted one stopped: a slide whose output exists is not
encoded again, and every output is written under a temporary name and renamed, so
none is ever partial. A malformed input (unreadable, a width other than the model's,
coordinates missing, of another length or off the grid, a NaN or infinity) is
reported by name and skipped; the others are encoded, and the run exits with status 1
when any was skipped.

``--checkpoint``: Prov-GigaPath's ``slide_encoder.pth`` (needs torch) or its torch-free
conversion (``--convert`` writes one and exits: ``python scripts/encode_slides.py
--convert slide_encoder.pth slide_encoder.npz``). ``--config`` sets fields of the model's
:class:`jax_dilated.models.SlideEncoderConfig` over Prov-GigaPath's public one
(``--config embed_dim=64 num_layers=2 ...``), for another model of its family.
``--mesh P`` shards every slide's tiles over the first ``P`` devices (on CPU:
``XLA_FLAGS=--xla_force_host_platform_device_count=P``, set here when it is unset).
Each distinct tile count compiles the model once (torchscale's segments depend on it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

SUFFIXES = (".npz", ".pt", ".pth", ".h5")
EMBED_KEYS = ("tile_embeds", "features", "embeds")


class Malformed(ValueError):
    """An input file that cannot be encoded (its reason says why)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("tiles_dir", type=Path, help="directory of tile-embedding files")
    p.add_argument("out_dir", type=Path, help="directory of the slide embeddings (.npy)")
    p.add_argument("--checkpoint", type=Path,
                   help="slide encoder weights: .pth (torch), .npz or .safetensors")
    p.add_argument("--config", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="SlideEncoderConfig fields over Prov-GigaPath's public model")
    p.add_argument("--pool", choices=("cls", "mean"), default="cls")
    p.add_argument("--layer", default="final",
                   help="final (default), an index 0..num_layers, or all")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--mesh", type=int, default=0, metavar="P",
                   help="shard the tiles over P devices (default: one device)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    if argv is not None and argv[:1] == ["--convert"]:
        return argparse.Namespace(convert=argv[1:])
    args = p.parse_args(argv)
    args.convert = None
    if args.checkpoint is None:
        p.error("--checkpoint is required (the slide encoder's weights)")
    if args.layer not in ("final", "all") and not args.layer.isdigit():
        p.error(f"--layer must be final, all or a layer index, got {args.layer!r}")
    return args


def _config_changes(items: list[str]) -> dict:
    """``["embed_dim=64", "dtype=..."]`` -> typed fields (ints, floats, strings)."""
    changes = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--config takes FIELD=VALUE, got {item!r}")
        for kind in (int, float):
            try:
                changes[name] = kind(text)
                break
            except ValueError:
                continue
        else:
            changes[name] = text
    return changes


def read_slide(path: Path):
    """``(tile_embeds [N, F], coords [N, 2])`` of one input file (NumPy), or
    :class:`Malformed` saying why not."""
    import numpy as np
    try:
        if path.suffix == ".npz":
            with np.load(path) as f:
                data = {k: f[k] for k in f.files}
        elif path.suffix == ".h5":
            import h5py
            with h5py.File(path, "r") as f:
                data = {k: np.asarray(f[k]) for k in f.keys()}
        else:
            import torch
            data = torch.load(path, map_location="cpu", weights_only=True)
            data = {k: v.float().numpy() if hasattr(v, "numpy") else np.asarray(v)
                    for k, v in data.items()}
    except Malformed:
        raise
    except Exception as err:  # noqa: BLE001 - any unreadable file is reported, not fatal
        raise Malformed(f"cannot be read ({type(err).__name__}: {err})") from err
    key = next((k for k in EMBED_KEYS if k in data), None)
    if key is None:
        raise Malformed(f"holds no tile embeddings (one of {EMBED_KEYS}); it has "
                        f"{sorted(data)}")
    if "coords" not in data:
        raise Malformed(f"holds no coords (the tiles' level-0 pixel x, y); it has "
                        f"{sorted(data)}")
    x, coords = np.asarray(data[key]), np.asarray(data["coords"])
    x = x[0] if x.ndim == 3 and x.shape[0] == 1 else x
    coords = coords[0] if coords.ndim == 3 and coords.shape[0] == 1 else coords
    if x.ndim != 2 or x.shape[0] == 0:
        raise Malformed(f"{key} must be [tiles, features], got shape {x.shape}")
    if coords.shape != (x.shape[0], 2):
        raise Malformed(f"coords must be [tiles, 2] = {(x.shape[0], 2)} for its {key} of "
                        f"shape {x.shape}, got {coords.shape}")
    for name, a in ((key, x), ("coords", coords)):
        if not np.all(np.isfinite(a)):
            raise Malformed(f"{name} holds NaN or infinite values")
    return x.astype(np.float32), coords.astype(np.float32)


def _check_fits(x, coords, config) -> None:
    if x.shape[1] != config.in_features:
        raise Malformed(f"tile embeddings of width {x.shape[1]}, the model takes "
                        f"{config.in_features}")
    cells = (coords // config.tile_size).astype("int64")
    index = cells[:, 0] * config.grid_size + cells[:, 1]
    if (coords < 0).any() or (index >= config.grid_size ** 2).any():
        raise Malformed(f"coordinates off the model's grid ({config.grid_size} x "
                        f"{config.grid_size} tiles of {config.tile_size} px)")


def _write_atomic(path: Path, array) -> None:
    """``np.save`` to a temporary name in the same directory, then rename: an
    interrupted run never leaves a partial output."""
    import numpy as np
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class _Progress:
    """tqdm where it is installed, else one line per slide on stderr."""

    def __init__(self, total: int, quiet: bool):
        self.bar = None
        self.total, self.done, self.quiet = total, 0, quiet
        if not quiet:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="slide")
            except ImportError:
                pass

    def step(self, name: str, status: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{name}: {status}")
            self.bar.update()
        elif not self.quiet:
            print(f"[{self.done}/{self.total}] {name}: {status}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.convert is not None:
        if len(args.convert) != 2:
            raise SystemExit("--convert SRC.pth DST.npz")
        from jax_dilated.models import convert_checkpoint
        names = convert_checkpoint(*args.convert)
        print(f"wrote {len(names)} arrays to {args.convert[1]}")
        return 0
    if args.mesh > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
            "XLA_FLAGS", ""):
        # simulated CPU devices (set before JAX starts; a GPU host ignores the flag)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.mesh}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jax_dilated.models import SlideEncoder, SlideEncoderConfig

    config = SlideEncoderConfig.gigapath(**_config_changes(args.config),
                                         dtype=getattr(jnp, args.dtype))
    layer = args.layer
    if layer.isdigit() and not 0 <= int(layer) <= config.num_layers:
        raise SystemExit(f"--layer {layer}: the model has layers 0..{config.num_layers}")
    mesh = None
    if args.mesh > 1:
        if jax.device_count() < args.mesh:
            raise SystemExit(f"--mesh {args.mesh}: only {jax.device_count()} devices")
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:args.mesh]), ("seq",))
    model = SlideEncoder.load(args.checkpoint, config, mesh=mesh,
                              seq_axis=None if mesh is None else "seq")
    every = layer != "final"
    encode = nnx.jit(lambda m, x, c: m(x, c, all_layer_embed=every,
                                       global_pool=args.pool == "mean"))

    files = sorted(p for p in args.tiles_dir.iterdir() if p.suffix in SUFFIXES)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    progress = _Progress(len(files), args.quiet)
    skipped, encoded, start = [], 0, time.perf_counter()
    for path in files:
        out = args.out_dir / f"{path.stem}.npy"
        if out.exists():  # finished by an earlier run
            progress.step(path.name, "done before")
            continue
        try:
            x, coords = read_slide(path)
            _check_fits(x, coords, config)
        except Malformed as err:
            skipped.append((path.name, str(err)))
            progress.step(path.name, "skipped")
            continue
        outcomes = encode(model, x[None], coords[None])
        stack = np.stack([np.asarray(o[0], np.float32) for o in outcomes])
        embedding = (stack if layer == "all" else
                     stack[0] if layer == "final" else stack[int(layer)])
        _write_atomic(out, embedding)
        encoded += 1
        progress.step(path.name, f"{x.shape[0]} tiles")
    progress.close()
    print(f"encoded {encoded} slides in {time.perf_counter() - start:.1f} s, "
          f"{len(files) - encoded - len(skipped)} done before, {len(skipped)} skipped",
          file=sys.stderr)
    for name, why in skipped:
        print(f"skipped {name}: {why}", file=sys.stderr)
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
