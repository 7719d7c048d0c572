"""The hyper-parameters of :class:`~jax_dilated.models.LongNetLM`, validated on
creation (a setting that building the model would refuse is refused here)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

import jax.numpy as jnp

from jax_dilated.backends.registry import IMPLEMENTATIONS
from jax_dilated.core import branch_plans, validation
from jax_dilated.core.branches import SlidingWindow
from jax_dilated.core.types import DTypeLike, HeadOffsets, Implementation, Mode
from jax_dilated.layers import projections
from jax_dilated.models.positions import Rotary, XPos

__all__ = ["LongNetConfig"]

Positions = Literal["rotary", "xpos", "none"]
Norm = Literal["pre", "sub"]
Ffn = Literal["gelu", "swiglu"]
POSITIONS, NORMS, FFNS = get_args(Positions), get_args(Norm), get_args(Ffn)


def _choice(name, x, allowed):
    if x not in allowed:
        raise ValueError(f"LongNetConfig.{name} must be one of {allowed}, got {x!r}.")


@dataclasses.dataclass(frozen=True)
class LongNetConfig:
    """Hyper-parameters of :class:`LongNetLM` (validated on creation).

    Attributes:
      vocab_size: number of tokens ``V``.
      embed_dim: model width ``E`` (divisible by ``num_heads``).
      num_layers: number of blocks.
      num_heads, num_kv_heads: query heads and key/value heads (grouped-query
        attention when fewer; default ``num_heads``).
      ffn_dim: hidden width of the feed-forward; default ``4 E`` (GELU) or
        ``8/3 E`` rounded up to a multiple of 8 (SwiGLU, same parameter count).
      segment_lengths, dilation_rates, mode, head_offsets: the dilated attention
        (:func:`jax_dilated.dilated_attention`); a ``jd.SlidingWindow(left)`` entry
        of ``segment_lengths`` (rate 1) is a sliding-window branch (each token
        attends to the ``left`` tokens before it).
      logit_soft_cap: None or ``c > 0``: every attention logit ``s`` becomes
        ``c tanh(s / c)``.
      attention_sinks: a learnable sink logit per head in every attention layer
        (``attn.sinks.logit`` [num_heads], initialised to 0) joining every row's
        softmax denominator (docs/semantics.md, "Sliding windows, soft-capping and
        sinks").
      positions: ``"xpos"`` (LongNet), ``"rotary"`` or ``"none"``.
      rotary_base: rotary wavelength base.
      xpos_scale_base: xPos decay length ``B``.
      max_len: the longest sequence the model is meant for: the default cache
        length of :meth:`LongNetLM.generate` and the xPos centre (``max_len // 2``).
      norm: ``"sub"`` (MAGNETO Sub-LN, LongNet) or ``"pre"`` (pre-LayerNorm).
      ffn: ``"gelu"`` or ``"swiglu"``.
      tie_embeddings: output head = transposed token embedding.
      use_bias: biases in the attention projections and the feed-forward.
      dropout_rate: dropout on the embeddings and the residual branches.
      attention_dropout_rate: dropout on the attention probabilities.
      layer_norm_eps: epsilon of every LayerNorm.
      remat: rematerialise every block in the backward pass.
      dtype: computation dtype (None: that of the parameters); logits are at
        least float32 whatever it is.
      param_dtype: parameter dtype.
      implementation: attention kernel (None: chosen by device kind).
      block_q, block_k: the attention kernel's block sizes (None: its defaults).
      dropout, attention_dropout: deprecated spellings of ``dropout_rate`` and
        ``attention_dropout_rate`` (accepted on creation with a DeprecationWarning,
        then stored under the new names; these fields read None).

    Example:
      >>> import jax_dilated as jd
      >>> cfg = jd.models.LongNetConfig(vocab_size=32, embed_dim=16, num_layers=1,
      ...                               num_heads=2, segment_lengths=(8, 32),
      ...                               dilation_rates=(1, 2))
      >>> cfg.replace(num_layers=2).num_layers
      2
    """

    vocab_size: int
    embed_dim: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    ffn_dim: int | None = None
    segment_lengths: tuple[int | SlidingWindow, ...] = (2048, 4096, 8192, 16384, 32768)
    dilation_rates: tuple[int, ...] = (1, 2, 4, 8, 16)
    mode: Mode = "longnet"
    head_offsets: HeadOffsets = "modulo"
    positions: Positions = "xpos"
    rotary_base: float = 10000.0
    xpos_scale_base: float = 512.0
    max_len: int = 32768
    norm: Norm = "sub"
    ffn: Ffn = "gelu"
    tie_embeddings: bool = True
    use_bias: bool = True
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    layer_norm_eps: float = 1e-5
    remat: bool = False
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    implementation: Implementation | None = None
    block_q: int | None = None
    block_k: int | None = None
    logit_soft_cap: float | None = None
    attention_sinks: bool = False
    dropout: float | None = dataclasses.field(default=None, repr=False, compare=False)
    attention_dropout: float | None = dataclasses.field(default=None, repr=False,
                                                        compare=False)

    def __post_init__(self):
        for old in ("dropout", "attention_dropout"):  # deprecated spellings
            new = old + "_rate"
            value = validation.renamed(
                getattr(self, old), None if getattr(self, new) == 0.0 else getattr(self, new),
                old=old, new=new, where="LongNetConfig", stacklevel=6)
            object.__setattr__(self, new, 0.0 if value is None else value)
            object.__setattr__(self, old, None)
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "max_len"):
            validation.check_positive_int(f"LongNetConfig.{name}", getattr(self, name))
        for name in ("num_kv_heads", "ffn_dim", "block_q", "block_k"):
            if getattr(self, name) is not None:
                validation.check_positive_int(f"LongNetConfig.{name}", getattr(self, name))
        object.__setattr__(self, "segment_lengths", tuple(self.segment_lengths))
        object.__setattr__(self, "dilation_rates", tuple(self.dilation_rates))
        branch_plans.validate_branches(self.segment_lengths, self.dilation_rates)
        _choice("positions", self.positions, POSITIONS)
        _choice("norm", self.norm, NORMS)
        _choice("ffn", self.ffn, FFNS)
        _choice("mode", self.mode, branch_plans.MODES)
        _choice("head_offsets", self.head_offsets, branch_plans.HEAD_OFFSETS)
        if self.mode == "head_groups":  # each branch needs a head group of its own
            branch_plans.head_groups(self.num_heads, len(self.segment_lengths))
        # the kernel's name (whether it can run is a property of the device, checked
        # when the model is built there)
        _choice("implementation", self.implementation, (None,) + IMPLEMENTATIONS)
        for name in ("dtype", "param_dtype"):
            dtype = getattr(self, name)
            if dtype is None and name == "dtype":
                continue
            if not validation.is_floating_dtype(dtype):
                raise TypeError(f"LongNetConfig.{name} must be a floating dtype"
                                f"{' or None' if name == 'dtype' else ''}, got {dtype!r}.")
        projections.HeadsConfig.create(self.embed_dim, self.num_heads, self.num_kv_heads,
                                  layer_norm_eps=self.layer_norm_eps)
        if self.positions != "none" and self.head_dim % 2:
            raise ValueError(
                f"positions={self.positions!r} rotates pairs of features: head_dim = "
                f"embed_dim / num_heads must be even, got {self.head_dim}.")
        for name in ("dropout_rate", "attention_dropout_rate"):
            validation.check_dropout_rate(getattr(self, name), f"LongNetConfig.{name}")
        try:
            validation.check_logit_soft_cap(self.logit_soft_cap)
        except (TypeError, ValueError) as err:
            raise type(err)(f"LongNetConfig.{err}") from None
        for name in ("tie_embeddings", "use_bias", "remat", "attention_sinks"):
            validation.check_flag(f"LongNetConfig.{name}", getattr(self, name))
        if self.positions == "xpos":
            XPos(self.rotary_base, self.xpos_scale_base)
        elif self.positions == "rotary":
            Rotary(self.rotary_base)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        """The feed-forward width actually used."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        if self.ffn == "swiglu":
            return -(-(8 * self.embed_dim // 3) // 8) * 8
        return 4 * self.embed_dim

    @property
    def gamma(self) -> float:
        """Initialisation gain of the value / output / feed-forward weights."""
        return math.sqrt(math.log(2 * self.num_layers)) if self.norm == "sub" else 1.0

    def qk_transform(self) -> Rotary | XPos | None:
        """The position encoding of queries and keys (None for ``"none"``)."""
        if self.positions == "rotary":
            return Rotary(self.rotary_base)
        if self.positions == "xpos":
            return XPos(self.rotary_base, self.xpos_scale_base, center=self.max_len // 2)
        return None

    def replace(self, **changes) -> "LongNetConfig":
        return dataclasses.replace(self, **changes)
