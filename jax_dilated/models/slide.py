"""Prov-GigaPath's slide encoder (its ``LongNetViT``) in Flax NNX, loadable from its
published ``slide_encoder.pth``.

``SlideEncoder(config, rngs=...)`` maps the tile embeddings of a whole-slide image
[B, N, in_features] and the tiles' level-0 pixel coordinates [B, N, 2] to slide
embeddings, as Prov-GigaPath's ``forward(x, coords, all_layer_embed)``:

    t = patch_embed.proj(tile_embeds) + position(coords)          # [B, N, D]
    z = concat([cls_token, t], axis=1)                            # [B, N + 1, D]
    zs = encoder states (all_layer_embed) or [encoder_out]        # LongNetEncoder
    outcome = norm(mean(z[:, 1:])) (global_pool) or norm(z)[:, 0], for z in zs

The position of a tile at ``(x, y)`` is row ``i = floor(x / tile_size) * G +
floor(y / tile_size)`` (``G = grid_size``) of Prov-GigaPath's fixed 2-D sin-cos
table, ``concat(E(i mod G), E(i div G))`` with the 1-D table ``E(t) =
concat(sin(t omega), cos(t omega))`` of width ``D / 2``, ``omega_k = 10000^(-k / (D/4))``
(so the first half of the channels encodes the y cell, the second the x cell); the CLS
token's row is zeros. ``E`` is computed once in float64 by NumPy and rounded to
float32 as Prov-GigaPath's table is ([grid_size, D / 2], 1.5 MB for the public
model); only the rows of the tiles given are gathered, never the ``G^2 x D`` table
(3 GB at ``G = 1000``, ``D = 768``).

Segment lengths follow Prov-GigaPath's ``get_optimal_segment_length``:
``2 ** linspace(log2(1024), int(log2(S)), 5)`` truncated to ints, ``S =
(max_wsi_size // tile_size) ** 2``, with rates ``(1, 2, 4, 8, 16)``.

Checkpoints: :meth:`SlideEncoder.load` reads Prov-GigaPath's ``slide_encoder.pth``
where torch is installed, and ``.npz`` (or ``.safetensors``, with the ``safetensors``
package) without it; :func:`convert_checkpoint` makes that torch-free file once::

    jd.models.convert_checkpoint("slide_encoder.pth", "slide_encoder.npz")  # needs torch
    model = jd.models.SlideEncoder.load("slide_encoder.npz",
                                        jd.models.SlideEncoderConfig.gigapath())
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dilated.backends.native import gemm
from jax_dilated.core import validation
from jax_dilated.core.types import Array, ArrayLike, DTypeLike, Implementation, Mode
from jax_dilated.models import encoder as encoder_lib
from jax_dilated.models.encoder import LongNetEncoder, LongNetEncoderConfig

__all__ = ["SlideEncoderConfig", "SlideEncoder", "convert_checkpoint", "sincos_table",
           "position_rows"]

# Prov-GigaPath's dilation rates (make_longnet_from_name's default dilated_ratio)
GIGAPATH_RATES = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class SlideEncoderConfig:
    """Hyper-parameters of :class:`SlideEncoder` (validated on creation).

    Attributes:
      in_features: width of the tile embeddings (Prov-GigaPath's ``in_chans``, 1536).
      embed_dim: model width ``D`` (divisible by 4 and by ``num_heads``).
      num_layers, num_heads, ffn_dim: the LongNet encoder's (Prov-GigaPath: 12, 16,
        ``4 D``).
      tile_size: tile side in level-0 pixels (256).
      grid_size: ``G``, the side of the position grid in tiles (Prov-GigaPath's
        ``slide_ngrids``, 1000): a tile's cell index ``floor(x / tile_size) G +
        floor(y / tile_size)`` must be in ``[0, G^2)``.
      max_wsi_size: the slide side the segment lengths are sized for (262144).
      dropout_rate, drop_path_rate, attention_dropout_rate, activation_dropout_rate:
        the encoder's dropouts (active only with ``deterministic=False``).
      mode: the encoder's attention mode (``"torchscale"``: what the weights were
        trained with).
      layer_norm_eps: epsilon of the encoder's LayerNorms (1e-5).
      norm_eps: epsilon of the outer ``norm`` (1e-6).
      dtype, param_dtype, implementation: as in :class:`LongNetEncoderConfig`.

    Derived (read-only): ``segment_lengths`` and ``dilation_rates`` (module
    docstring).

    Example:
      >>> import jax_dilated as jd
      >>> cfg = jd.models.SlideEncoderConfig.gigapath()
      >>> cfg.segment_lengths
      (1024, 5792, 32768, 185363, 1048576)
      >>> jd.models.SlideEncoderConfig(max_wsi_size=11776).segment_lengths
      (1024, 1217, 1448, 1722, 2048)
    """

    in_features: int = 1536
    embed_dim: int = 768
    num_layers: int = 12
    num_heads: int = 16
    ffn_dim: int = 3072
    tile_size: int = 256
    grid_size: int = 1000
    max_wsi_size: int = 262144
    dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    activation_dropout_rate: float = 0.0
    mode: Mode = "torchscale"
    layer_norm_eps: float = 1e-5
    norm_eps: float = 1e-6
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    implementation: Implementation | None = None

    def __post_init__(self):
        where = type(self).__name__
        for name in ("in_features", "embed_dim", "tile_size", "grid_size", "max_wsi_size"):
            validation.check_positive_int(f"{where}.{name}", getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.embed_dim % 4:
            raise ValueError(f"{where}.embed_dim must be divisible by 4 (the 2-D sin-cos "
                             f"position: a sine and a cosine half per axis), got "
                             f"{self.embed_dim}.")
        if self.max_wsi_size < self.tile_size:
            raise ValueError(f"{where}.max_wsi_size ({self.max_wsi_size}) must be at least "
                             f"tile_size ({self.tile_size}): the segment lengths come from "
                             f"(max_wsi_size // tile_size) ** 2 tiles.")
        if self.grid_size ** 2 >= 2 ** 31:
            raise ValueError(f"{where}.grid_size must be below 46341 (cell indices are "
                             f"int32), got {self.grid_size}.")
        validation.check_positive_float(f"{where}.norm_eps", self.norm_eps)
        try:
            self.encoder_config()
        except (TypeError, ValueError) as err:
            raise type(err)(str(err).replace("LongNetEncoderConfig.", f"{where}.")) from None

    @property
    def segment_lengths(self) -> tuple[int, ...]:
        """Prov-GigaPath's ``get_optimal_segment_length(max_wsi_size, tile_size)``."""
        tiles = (self.max_wsi_size // self.tile_size) ** 2
        exponents = np.linspace(np.log2(1024), int(np.log2(tiles)), 5)
        return tuple(int(s) for s in np.power(2, exponents).astype(int))

    @property
    def dilation_rates(self) -> tuple[int, ...]:
        return GIGAPATH_RATES

    @classmethod
    def gigapath(cls, **changes) -> "SlideEncoderConfig":
        """Prov-GigaPath's public ``gigapath_slide_enc12l768d``: 12 layers, width 768,
        16 heads, FFN 3072, tile embeddings of 1536, tiles of 256 px on a 1000 grid,
        ``max_wsi_size`` 262144, dropout 0.25 and drop-path 0.1 (as its ``LongNetViT``
        builds it; they act only with ``deterministic=False``). ``changes`` override
        fields (e.g. ``dtype=jnp.bfloat16``)."""
        base = dict(in_features=1536, embed_dim=768, num_layers=12, num_heads=16,
                    ffn_dim=3072, tile_size=256, grid_size=1000, max_wsi_size=262144,
                    dropout_rate=0.25, drop_path_rate=0.1)
        return cls(**{**base, **changes})

    def encoder_config(self) -> LongNetEncoderConfig:
        """The :class:`LongNetEncoderConfig` of the slide encoder's ``encoder``."""
        return LongNetEncoderConfig(
            embed_dim=self.embed_dim, num_layers=self.num_layers, num_heads=self.num_heads,
            ffn_dim=self.ffn_dim, segment_lengths=self.segment_lengths,
            dilation_rates=self.dilation_rates, mode=self.mode,
            dropout_rate=self.dropout_rate, drop_path_rate=self.drop_path_rate,
            attention_dropout_rate=self.attention_dropout_rate,
            activation_dropout_rate=self.activation_dropout_rate,
            layer_norm_eps=self.layer_norm_eps, is_causal=False, dtype=self.dtype,
            param_dtype=self.param_dtype, implementation=self.implementation)

    def replace(self, **changes) -> "SlideEncoderConfig":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------- positions


@functools.lru_cache(maxsize=8)
def _table(grid_size: int, half_width: int) -> np.ndarray:
    t = np.arange(grid_size, dtype=np.float64)
    omega = 1.0 / 10000.0 ** (np.arange(half_width // 2, dtype=np.float64) / (half_width / 2.0))
    angle = t[:, None] * omega[None, :]
    table = np.concatenate([np.sin(angle), np.cos(angle)], axis=1).astype(np.float32)
    table.setflags(write=False)
    return table


def sincos_table(grid_size: int, embed_dim: int) -> np.ndarray:
    """Prov-GigaPath's 1-D sin-cos table ``E`` [grid_size, embed_dim / 2] (float32,
    computed in float64): row ``t`` is ``concat(sin(t omega), cos(t omega))``,
    ``omega_k = 10000^(-k / (embed_dim / 4))``. Cached; read-only."""
    return _table(int(grid_size), int(embed_dim) // 2)


def position_rows(coords: ArrayLike, *, embed_dim: int, tile_size: int, grid_size: int,
                  dtype: DTypeLike = jnp.float32) -> Array:
    """The position row of every tile [..., embed_dim] from its level-0 pixel
    ``coords`` [..., 2] (ints or floats; may be traced).

    ``i = floor(x / tile_size) * grid_size + floor(y / tile_size)``, the row
    ``concat(E[i mod G], E[i div G])`` of :func:`sincos_table`: equal to row ``i + 1``
    of Prov-GigaPath's ``pos_embed`` (row 0 being the CLS token's). Concrete
    coordinates whose ``i`` falls outside ``[0, G^2)`` (or are not finite) raise a
    ``ValueError``; traced ones give NaN rows (never a plausible wrong row).
    """
    coords = jnp.asarray(coords)
    if not jnp.issubdtype(coords.dtype, jnp.floating):
        coords = coords.astype(jnp.float32)  # as torch divides an int tensor
    cell = jnp.floor(coords / jnp.asarray(tile_size, coords.dtype))
    limit = grid_size * grid_size
    finite = jnp.all(jnp.isfinite(cell), axis=-1)
    cell = jnp.where(finite[..., None], cell, 0)
    # the cell index in float64 / float32 as Prov-GigaPath computes it, exact as long
    # as it is in range (G^2 < 2^31 is checked; float32 is exact below 2^24, and an
    # index that large is out of range anyway)
    index = cell[..., 0] * grid_size + cell[..., 1]
    valid = finite & (index >= 0) & (index < limit)
    i = jnp.where(valid, index, 0).astype(jnp.int32)
    table = jnp.asarray(sincos_table(grid_size, embed_dim), dtype)
    rows = jnp.concatenate([jnp.take(table, i % grid_size, axis=0),
                            jnp.take(table, i // grid_size, axis=0)], axis=-1)
    return jnp.where(valid[..., None], rows, jnp.asarray(jnp.nan, dtype))


def _check_coords_concrete(coords, tile_size: int, grid_size: int) -> None:
    """A ``ValueError`` naming ``coords`` when concrete coordinates fall off the grid."""
    if isinstance(coords, jax.core.Tracer):
        return
    c = np.asarray(coords, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        cell = np.floor(c / tile_size)
        index = cell[..., 0] * grid_size + cell[..., 1]
    bad = ~np.isfinite(index) | (index < 0) | (index >= grid_size * grid_size)
    if bad.any():
        where = np.argwhere(bad)[0]
        raise ValueError(
            f"coords {tuple(c.shape)} must put every tile on the {grid_size} x {grid_size} "
            f"grid (cell index floor(x / {tile_size}) * {grid_size} + floor(y / "
            f"{tile_size}) in [0, {grid_size ** 2}), finite): {int(bad.sum())} tiles do "
            f"not, e.g. coords[{', '.join(str(int(w)) for w in where)}] = "
            f"{c[tuple(where)].tolist()}.")


# -------------------------------------------------------------------------- model


class _PatchEmbed(nnx.Module):
    """Prov-GigaPath's ``PatchEmbed``: ``proj`` (Linear in_features -> D)."""

    def __init__(self, cfg: SlideEncoderConfig, rngs: nnx.Rngs, dot_general):
        # Prov-GigaPath's initialize_vit_weights: xavier-uniform weights, zero biases
        self.proj = nnx.Linear(cfg.in_features, cfg.embed_dim, use_bias=True, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype,
                               kernel_init=jax.nn.initializers.xavier_uniform(),
                               kernel_metadata={"out_sharding": (None, "embed"),
                                                "eager_sharding": False},
                               bias_metadata={"out_sharding": ("embed",),
                                              "eager_sharding": False},
                               dot_general=dot_general, rngs=rngs)

    def __call__(self, x):
        return self.proj(x)


class SlideEncoder(nnx.Module):
    """Prov-GigaPath's slide encoder (``LongNetViT``), Flax NNX.

    Args:
      config: a :class:`SlideEncoderConfig`.
      rngs: ``nnx.Rngs`` (``params``; ``dropout`` for fine-tuning).
      mesh, seq_axis: sequence parallelism of the encoder (see
        :class:`LongNetEncoder`).

    Call: ``model(tile_embeds [B, N, in_features], coords [B, N, 2], *,
    all_layer_embed=False, global_pool=False, deterministic=True)`` -> a list of [B, D]
    slide embeddings: one (from ``encoder_out``, the encoder's final LayerNorm
    included), or with ``all_layer_embed`` the ``num_layers + 1`` encoder states
    (input state first, no final LayerNorm), each pooled by ``norm`` of the CLS token
    (default) or of the mean of the tile tokens (``global_pool``), as Prov-GigaPath's
    ``forward``. Traceable under ``jax.jit`` / ``nnx.jit`` in the inputs and the
    parameters. Outputs are float32 for float32 parameters whatever ``config.dtype``
    (see :class:`LongNetEncoder`).

    Parameters (Prov-GigaPath's names): ``cls_token`` [1, 1, D], ``patch_embed.proj``
    (kernel [in_features, D]: its ``weight`` transposed), ``encoder`` (a
    :class:`LongNetEncoder`), ``norm`` (LayerNorm, eps ``config.norm_eps``).
    Initialised as Prov-GigaPath's ``initialize_vit_weights``: every Linear
    xavier-uniform with zero bias, ``cls_token`` normal(0.02), LayerNorms 1 / 0.

    Example:
      >>> import jax, jax.numpy as jnp, jax_dilated as jd
      >>> from flax import nnx
      >>> cfg = jd.models.SlideEncoderConfig(in_features=24, embed_dim=32, num_layers=2,
      ...     num_heads=4, ffn_dim=64, max_wsi_size=11776)
      >>> model = jd.models.SlideEncoder(cfg, rngs=nnx.Rngs(0))
      >>> tiles = jax.random.normal(jax.random.key(0), (1, 50, 24), jnp.float32)
      >>> coords = jnp.stack(jnp.meshgrid(jnp.arange(10), jnp.arange(5)), -1).reshape(1, 50, 2) * 256
      >>> run = nnx.jit(lambda m, x, c: m(x, c, all_layer_embed=True, global_pool=True))
      >>> [e.shape for e in run(model, tiles, coords)]    # one per encoder state
      [(1, 32), (1, 32), (1, 32)]
    """

    def __init__(self, config: SlideEncoderConfig, *, rngs: nnx.Rngs,
                 mesh: jax.sharding.Mesh | None = None,
                 seq_axis: str | tuple[str, str] | None = None):
        if not isinstance(config, SlideEncoderConfig):
            raise TypeError(f"config must be a SlideEncoderConfig, got {type(config).__name__}.")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}.")
        self.config = config
        self.patch_embed = _PatchEmbed(config, rngs, gemm.for_mesh(mesh))
        self.cls_token = nnx.Param(
            jax.nn.initializers.normal(0.02)(rngs.params(), (1, 1, config.embed_dim),
                                             config.param_dtype),
            out_sharding=(None, None, "embed"), eager_sharding=False)
        self.encoder = LongNetEncoder(config.encoder_config(), rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis, _init="vit")
        self.norm = encoder_lib._layer_norm(self.encoder.config, config.embed_dim, "embed",
                                            rngs, eps=config.norm_eps)

    @property
    def mesh(self):
        return self.encoder.mesh

    @property
    def seq_axis(self):
        return self.encoder.seq_axis

    # ------------------------------------------------------------------ forward

    def __call__(self, tile_embeds: ArrayLike, coords: ArrayLike, *,
                 all_layer_embed: bool = False, global_pool: bool = False,
                 deterministic: bool = True) -> list[Array]:
        """Slide embeddings: a list of [B, D] (see the class docstring)."""
        for name, flag in (("all_layer_embed", all_layer_embed), ("global_pool", global_pool),
                           ("deterministic", deterministic)):
            validation.check_flag(name, flag)
        cfg = self.config
        if (getattr(tile_embeds, "ndim", None) != 3
                or not jnp.issubdtype(tile_embeds.dtype, jnp.floating)
                or tile_embeds.shape[-1] != cfg.in_features or 0 in tile_embeds.shape):
            raise ValueError(
                f"tile_embeds must be a floating array [batch, tiles, in_features="
                f"{cfg.in_features}] with at least one tile, got "
                f"{getattr(tile_embeds, 'dtype', type(tile_embeds).__name__)} "
                f"{tuple(getattr(tile_embeds, 'shape', ()))}.")
        b, n, _ = tile_embeds.shape
        if (getattr(coords, "ndim", None) != 3 or tuple(coords.shape) != (b, n, 2)
                or not (jnp.issubdtype(coords.dtype, jnp.floating)
                        or jnp.issubdtype(coords.dtype, jnp.integer))):
            raise ValueError(
                f"coords must be a numeric array [batch, tiles, 2] = {(b, n, 2)} (level-0 "
                f"pixel x, y of each tile of tile_embeds {tuple(tile_embeds.shape)}), got "
                f"{getattr(coords, 'dtype', type(coords).__name__)} "
                f"{tuple(getattr(coords, 'shape', ()))}.")
        _check_coords_concrete(coords, cfg.tile_size, cfg.grid_size)
        stream = jnp.promote_types(jnp.promote_types(tile_embeds.dtype, cfg.param_dtype),
                                   jnp.float32)
        tiles = self.patch_embed(tile_embeds)
        rows = position_rows(coords, embed_dim=cfg.embed_dim, tile_size=cfg.tile_size,
                             grid_size=cfg.grid_size, dtype=stream)
        tiles = tiles.astype(stream) + rows
        cls = jnp.broadcast_to(self.cls_token[...].astype(stream), (b, 1, cfg.embed_dim))
        z = jnp.concatenate([cls, tiles], axis=1)  # [B, N + 1, D]
        if all_layer_embed:
            zs = self.encoder(z, return_states=True, deterministic=deterministic)[1]
        else:
            zs = [self.encoder(z, deterministic=deterministic)]
        if global_pool:
            return [self.norm(s[:, 1:].mean(axis=1)) for s in zs]
        return [self.norm(s[:, 0]) for s in zs]  # the CLS token (LayerNorm is per token)

    # -------------------------------------------------------------- checkpoints

    @classmethod
    def from_torch_state_dict(cls, state_dict, config: SlideEncoderConfig, *,
                              rngs: nnx.Rngs | None = None,
                              mesh: jax.sharding.Mesh | None = None,
                              seq_axis: str | tuple[str, str] | None = None,
                              dtype: DTypeLike | None = None) -> "SlideEncoder":
        """A slide encoder holding the weights of Prov-GigaPath's state dict.

        Args:
          state_dict: ``{name: array}`` with Prov-GigaPath's names and shapes
            (``cls_token``, ``patch_embed.proj.weight`` [D, in_features],
            ``patch_embed.proj.bias``, ``encoder.layers.{i}...`` (torchscale's),
            ``encoder.layer_norm.*``, ``norm.weight``, ``norm.bias``); NumPy arrays,
            torch tensors (torch imported only to read them) or anything
            ``np.asarray`` takes. ``pos_embed`` (a non-persistent buffer, normally
            absent) is accepted when present: it is checked against the sin-cos
            formula (shape [1, G^2 + 1, D]; row 0 and a sample of other rows) and
            not stored, since the model computes its rows. Nothing else is ignored.
          config: the matching :class:`SlideEncoderConfig` (e.g.
            ``SlideEncoderConfig.gigapath()``).
          rngs: the model's random streams (dropout); default ``nnx.Rngs(0)``.
          mesh, seq_axis: as in the constructor.
          dtype: the computation dtype (overrides ``config.dtype``).

        Raises:
          ValueError: naming every missing, unexpected or mis-shaped entry (and a
            ``pos_embed`` that is not the sin-cos table).
          TypeError: an entry is not a floating array.
        """
        if not isinstance(config, SlideEncoderConfig):
            raise TypeError(f"config must be a SlideEncoderConfig, got {type(config).__name__}.")
        if dtype is not None:
            config = config.replace(dtype=dtype)
        model = cls(config, rngs=nnx.Rngs(0) if rngs is None else rngs, mesh=mesh,
                    seq_axis=seq_axis)
        expected = encoder_lib.expected_shapes(model)
        pos_shape = (1, config.grid_size ** 2 + 1, config.embed_dim)
        has_pos = hasattr(state_dict, "keys") and "pos_embed" in state_dict
        if has_pos:
            expected["pos_embed"] = pos_shape
        arrays = encoder_lib.check_state_dict(
            state_dict, expected,
            what=f"a SlideEncoder with in_features {config.in_features}, embed_dim "
                 f"{config.embed_dim}, {config.num_layers} layers, ffn_dim {config.ffn_dim}")
        if has_pos:
            _check_pos_embed(arrays.pop("pos_embed"), config)
        encoder_lib.load_arrays(model, arrays)
        return model

    def to_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters as ``{Prov-GigaPath name: np.ndarray}`` (torch shapes, the
        parameter dtype; no ``pos_embed``, which Prov-GigaPath does not save either)."""
        return encoder_lib.state_dict_of(self)

    def save_npz(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_state_dict` to ``path`` (``.npz``; bfloat16 / float16
        parameters widened to float32, which holds them exactly), atomically (a
        temporary file renamed)."""
        arrays = {k: (v.astype(np.float32) if v.dtype.itemsize < 4 else v)
                  for k, v in self.to_state_dict().items()}
        _write_atomic(path, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, config: SlideEncoderConfig, *,
             rngs: nnx.Rngs | None = None, mesh: jax.sharding.Mesh | None = None,
             seq_axis: str | tuple[str, str] | None = None,
             dtype: DTypeLike | None = None) -> "SlideEncoder":
        """A slide encoder from a checkpoint file, by its suffix:

        * ``.npz``: NumPy arrays under Prov-GigaPath's names (:meth:`save_npz`,
          :func:`convert_checkpoint`); no torch needed;
        * ``.safetensors``: the same, read by the ``safetensors`` package (a clear
          ``ImportError`` without it);
        * anything else (``slide_encoder.pth``): a torch checkpoint, read with
          ``torch.load(path, map_location="cpu", weights_only=True)``; the dict under
          ``"model"`` when there is one (Prov-GigaPath's file), else the whole dict.
          Needs torch (an ``ImportError`` saying how to convert the file otherwise).

        The entries are checked as :meth:`from_torch_state_dict` checks them.
        """
        state_dict = read_checkpoint(path)
        return cls.from_torch_state_dict(state_dict, config, rngs=rngs, mesh=mesh,
                                         seq_axis=seq_axis, dtype=dtype)


def _check_pos_embed(pos_embed: np.ndarray, config: SlideEncoderConfig) -> None:
    """``pos_embed`` [1, G^2 + 1, D] equals the sin-cos formula: row 0 (the CLS
    token's) zeros, and rows ``i + 1`` for a spread of ``i`` (about 1000, both axes'
    ends included) equal :func:`position_rows` (to float32 rounding)."""
    g, d = config.grid_size, config.embed_dim
    table = pos_embed[0]
    idx = np.unique(np.concatenate([np.linspace(0, g * g - 1, 997).astype(np.int64),
                                    [0, g - 1, g, g * g - g, g * g - 1]]))
    e = sincos_table(g, d).astype(np.float64)
    want = np.concatenate([e[idx % g], e[idx // g]], axis=1)
    got = table[idx + 1].astype(np.float64)
    err = max(np.max(np.abs(table[0].astype(np.float64))), np.max(np.abs(got - want)))
    if not err <= 1e-6:
        raise ValueError(
            f"state_dict['pos_embed'] is not Prov-GigaPath's 2-D sin-cos table for grid_size="
            f"{g}, embed_dim={d} (max difference {err:.3g} over row 0 and {idx.size} sampled "
            f"rows): the model computes its position rows from that formula, so this "
            f"checkpoint's positions would be ignored. Check grid_size and embed_dim.")


# ---------------------------------------------------------------- checkpoint files


def _is_suffix(path, suffix: str) -> bool:
    return os.fspath(path).lower().endswith(suffix)


def _import_safetensors():
    try:
        import safetensors.numpy as st_numpy
    except ImportError:
        raise ImportError("reading or writing .safetensors needs the safetensors package "
                          "(pip install safetensors); .npz needs nothing more.") from None
    return st_numpy


def _import_torch(path):
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{os.fspath(path)!r} is a torch checkpoint: reading it needs torch. Convert it "
            f"once where torch is installed (jax_dilated.models.convert_checkpoint(src, "
            f"'slide_encoder.npz')) and load the .npz here.") from None
    return torch


def _torch_state_dict(path) -> dict:
    """The state dict of a torch checkpoint (under ``"model"`` if present)."""
    torch = _import_torch(path)
    obj = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise ValueError(f"{os.fspath(path)!r} holds a {type(obj).__name__}, not a state dict "
                         f"(nor a dict with one under 'model').")
    return obj


def read_checkpoint(path: str | os.PathLike) -> dict:
    """``{name: array}`` from a ``.npz``, ``.safetensors`` or torch checkpoint (see
    :meth:`SlideEncoder.load`)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r}.")
    if _is_suffix(path, ".npz"):
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    if _is_suffix(path, ".safetensors"):
        return dict(_import_safetensors().load_file(os.fspath(path)))
    return _torch_state_dict(path)


def _write_atomic(path, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` to ``path`` (``.safetensors`` by its suffix, else ``.npz``) through a
    temporary file in the same directory, renamed over ``path`` once complete."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    safetensors = _is_suffix(path, ".safetensors")
    st_numpy = _import_safetensors() if safetensors else None
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors" if safetensors
                               else ".npz")
    os.close(fd)
    try:
        if safetensors:
            st_numpy.save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, tmp)
        else:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def convert_checkpoint(src_pth: str | os.PathLike, dst_npz: str | os.PathLike) -> list[str]:
    """Convert a torch checkpoint (Prov-GigaPath's ``slide_encoder.pth``) once into a
    torch-free file that :meth:`SlideEncoder.load` reads without torch.

    Reads ``src_pth`` with ``torch.load(map_location="cpu", weights_only=True)``, takes
    the state dict under ``"model"`` when there is one (other top-level entries, such
    as optimizer state, are not written), and writes every tensor as a NumPy array
    under its name to ``dst_npz`` (``.npz``; ``.safetensors`` by that suffix, with the
    safetensors package), bfloat16 / float16 widened to float32 (exactly). The file
    is written to a temporary name and renamed, so it is never left partial. Needs
    torch; the names are checked when the file is loaded.

    Returns:
      the names written, sorted.

    Example (where torch is installed, with Prov-GigaPath's file at hand):
      >>> import jax_dilated as jd                                     # doctest: +SKIP
      >>> names = jd.models.convert_checkpoint("slide_encoder.pth",
      ...                                      "slide_encoder.npz")    # doctest: +SKIP
      >>> model = jd.models.SlideEncoder.load(                         # doctest: +SKIP
      ...     "slide_encoder.npz", jd.models.SlideEncoderConfig.gigapath())
    """
    state_dict = _torch_state_dict(src_pth)
    arrays = {}
    for name, value in state_dict.items():
        array = encoder_lib.to_numpy(value, str(name))
        arrays[str(name)] = array.astype(np.float32) if array.dtype.itemsize < 4 else array
    _write_atomic(dst_npz, arrays)
    return sorted(arrays)
