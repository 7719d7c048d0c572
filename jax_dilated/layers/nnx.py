"""Flax NNX layers: dilated / ring attention and multi-head attention built on them.

* :class:`DilatedAttention` - :func:`jax_dilated.dilated_attention` as a module (no
  parameters); with ``mesh`` and ``seq_axis`` it runs sequence-parallel.
* :class:`RingAttention` - exact attention over a sequence sharded on a mesh axis.
* :class:`MultiheadDilatedAttention` - LongNet multi-head attention: q/k/v
  projections (grouped-query via ``num_kv_heads``), dilated attention, the MAGNETO
  sub-LayerNorm, the output projection; KV-cache decoding.
* :class:`MultiheadRingAttention` - the same layer around ring attention.

Conventions follow ``flax.nnx.MultiHeadAttention``: ``dtype`` / ``param_dtype`` /
``precision``, ``rngs`` (``params`` stream for initialisation, ``dropout`` stream for
attention dropout), ``deterministic`` in the constructor or the call (the call wins,
``nnx.view(model, deterministic=...)`` sets it), ``decode`` with ``init_cache``.
Parameters carry logical sharding names (``"embed"``, ``"heads"``, ``"kv_heads"``,
``"head_dim"``; see :mod:`jax_dilated.layers.common`) as ``out_sharding`` metadata;
they are annotated, not placed, so a layer builds without a mesh. To shard them
(here heads over a "model" mesh axis)::

    rules = [("heads", "model"), ("kv_heads", "model"), ("embed", None), ("head_dim", None)]
    with nnx.logical_axis_rules(rules):
        shardings = nnx.get_named_sharding(nnx.state(layer), mesh)
    nnx.update(layer, jax.device_put(nnx.state(layer), shardings))
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dilated.block_patterns import BlockPattern
from jax_dilated.core import validation
from jax_dilated.core.types import (Array, ArrayLike, DTypeLike, HeadOffsets, Implementation,
                                    Layout, Mode, SegmentLengths, Strategy, StrategyLike)
from jax_dilated.layers import common, nnx_rngs
from jax_dilated.layers.nnx_multihead import MultiheadBody

__all__ = ["DilatedAttention", "RingAttention", "MultiheadDilatedAttention",
           "MultiheadRingAttention", "MultiheadBlockSparseAttention"]


class DilatedAttention(nnx_rngs.DropoutMixin, nnx.Module):
    """:func:`jax_dilated.dilated_attention` as an NNX module (no parameters).

    Args:
      segment_lengths, dilation_rates, mode, head_offsets, scale, implementation,
        block_q, block_k, logit_soft_cap: as in :func:`jax_dilated.dilated_attention`
        (a sliding window is a ``jd.SlidingWindow`` entry of ``segment_lengths``).
      dropout_rate: attention-probability dropout.
      attention_fn: a drop-in with the signature of :func:`jax_dilated.dilated_attention`.
      mesh, seq_axis: run sequence-parallel over ``mesh`` (the sequence sharded on
        ``seq_axis``, or on two axes ``(a, b)`` with ``strategy="hybrid"``;
        ``batch_axis`` / ``head_axis`` optionally shard batch and heads); inputs and
        outputs stay global arrays.
      deterministic: default of the call's ``deterministic``.
      rngs: ``nnx.Rngs``; its ``dropout`` stream is kept for dropout.

    Call: ``(query [B, T, H, D], key, value [B, T, Hkv, D], *, is_causal=False,
    kv_mask=None [B, T] bool, segment_ids=None [B, T] int, sinks=None [H] float,
    deterministic=None, rngs=None) -> [B, T, H, D]``; ``segment_ids`` packs documents
    into a row, ``sinks`` are per-head sink logits (see
    :func:`jax_dilated.dilated_attention`).

    Example:
      >>> import jax, jax_dilated as jd
      >>> from flax import nnx
      >>> attn = jd.nnx.DilatedAttention(segment_lengths=(8, 32), dilation_rates=(1, 2))
      >>> x = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
      >>> nnx.jit(lambda attn, x: attn(x, x, x, is_causal=True))(attn, x).shape
      (1, 32, 2, 8)
    """

    def __init__(self, segment_lengths: SegmentLengths, dilation_rates: Sequence[int], *,
                 mode: Mode = "longnet", head_offsets: HeadOffsets = "modulo",
                 scale: float | None = None, dropout_rate: float = 0.0,
                 implementation: Implementation | None = None,
                 attention_fn: Callable | None = None, mesh: jax.sharding.Mesh | None = None,
                 seq_axis: str | tuple[str, str] | None = None, batch_axis: str | None = None,
                 head_axis: str | None = None, strategy: StrategyLike = "ring",
                 deterministic: bool | None = None, block_q: int | None = None,
                 block_k: int | None = None, logit_soft_cap: float | None = None,
                 rngs: nnx.Rngs | None = None):
        self.core = common.dilated_core(
            segment_lengths=segment_lengths, dilation_rates=dilation_rates, mode=mode,
            head_offsets=head_offsets, scale=scale, implementation=implementation,
            attention_fn=attention_fn, mesh=mesh, seq_axis=seq_axis,
            batch_axis=batch_axis, head_axis=head_axis, strategy=strategy, block_q=block_q,
            block_k=block_k, logit_soft_cap=logit_soft_cap)
        common.check_mesh_scores(self.core)
        self.dropout_rate = validation.check_dropout_rate(dropout_rate)
        self.deterministic = deterministic
        self.rngs = nnx_rngs.fork_dropout_rngs(rngs, self.dropout_rate)

    def __call__(self, query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                 is_causal: bool = False, kv_mask: ArrayLike | None = None,
                 segment_ids: ArrayLike | None = None, sinks: ArrayLike | None = None,
                 deterministic: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | Array | None = None) -> Array:
        dropout_rng = self._dropout_key(self.dropout_rate, deterministic, rngs,
                                        "DilatedAttention")
        return self.core(query, key, value, is_causal=is_causal, kv_mask=kv_mask,
                         segment_ids=segment_ids, sinks=sinks,
                         dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
                         dropout_rng=dropout_rng)


class RingAttention(nnx.Module):
    """Exact attention over a sequence sharded on ``seq_axis`` of ``mesh`` (no parameters).

    Runs :func:`jax_dilated.ring_attention` through :func:`jax_dilated.sharded`: global
    ``[B, T, H, D]`` arrays in and out, ``T`` divisible by the ring size (twice it
    for ``layout="zigzag"``).

    Args:
      mesh, seq_axis: the mesh and the axis of the ring, or two axes ``(a, b)`` with
        ``strategy="hybrid"`` (heads exchanged over ``a``, the ring over ``b``;
        docs/semantics.md section 8, "Hybrid").
      layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``.
      batch_axis, head_axis: optional mesh axes for batch and heads.
      scale, implementation, attention_fn, block_q, block_k, window, logit_soft_cap:
        as for :func:`jax_dilated.ring_attention` (``window=(left, right)``: a sliding
        window over global positions).

    Call: ``(query, key, value, *, is_causal=False, kv_mask=None, segment_ids=None,
    sinks=None) -> [B, T, H, D]`` (``segment_ids`` int [B, T]: packed documents;
    ``sinks`` float [H]: per-head sink logits).

    Example:
      >>> import jax, jax_dilated as jd
      >>> ring = jd.nnx.RingAttention(mesh=jax.make_mesh((1,), ("seq",)), seq_axis="seq")
      >>> x = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
      >>> jax.jit(lambda x: ring(x, x, x, is_causal=True))(x).shape
      (1, 32, 2, 8)
    """

    def __init__(self, *, mesh: jax.sharding.Mesh, seq_axis: str | tuple[str, str],
                 layout: Layout = "contiguous",
                 batch_axis: str | None = None, head_axis: str | None = None,
                 strategy: Strategy = "ring", scale: float | None = None,
                 implementation: Implementation | None = None,
                 attention_fn: Callable | None = None, block_q: int | None = None,
                 block_k: int | None = None, window: tuple[int, int] | None = None,
                 logit_soft_cap: float | None = None):
        self.core = common.ring_core(mesh=mesh, seq_axis=seq_axis, layout=layout,
                                     batch_axis=batch_axis, head_axis=head_axis, strategy=strategy,
                                     scale=scale, implementation=implementation,
                                     attention_fn=attention_fn, block_q=block_q,
                                     block_k=block_k, window=window,
                                     logit_soft_cap=logit_soft_cap)
        common.check_mesh_scores(self.core)

    def __call__(self, query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                 is_causal: bool = False, kv_mask: ArrayLike | None = None,
                 segment_ids: ArrayLike | None = None,
                 sinks: ArrayLike | None = None) -> Array:
        return self.core(query, key, value, is_causal=is_causal, kv_mask=kv_mask,
                         segment_ids=segment_ids, sinks=sinks)


class MultiheadDilatedAttention(MultiheadBody):
    """LongNet multi-head dilated attention (NNX).

    ``query`` / ``key`` / ``value`` [B, T, E] are projected to ``num_heads`` query heads
    and ``num_kv_heads`` key/value heads of ``E / num_heads`` features, attended with
    :func:`jax_dilated.dilated_attention`, normalised by the MAGNETO sub-LayerNorm
    over the joint (heads, head_dim) features, and projected back to ``E``.

    Args:
      embed_dim: ``E``, divisible by ``num_heads``.
      num_heads: query heads ``H``.
      segment_lengths, dilation_rates, mode, head_offsets, scale, implementation,
        block_q, block_k, logit_soft_cap: the dilated attention (see
        :func:`jax_dilated.dilated_attention`; a ``jd.SlidingWindow(left)`` entry of
        ``segment_lengths``, rate 1, is a sliding-window branch).
      sinks: learn a sink logit per query head (parameter ``sinks.logit`` [H], in
        ``param_dtype``, initialised to 0) joining every row's softmax denominator
        (docs/semantics.md, "Sliding windows, soft-capping and sinks"). With a
        ``mesh`` the sinks, ``logit_soft_cap`` and window branches go through every
        ``strategy`` (dilated attention runs them all itself).
      num_kv_heads: key/value heads (grouped-query attention), dividing ``H``;
        default ``H``.
      dropout_rate: attention-probability dropout rate (``dropout=`` is its deprecated
        spelling).
      use_bias: biases on the four projections.
      layer_norm: the sub-LayerNorm before the output projection (MAGNETO).
      layer_norm_eps: its epsilon.
      gamma_init: Xavier-normal gain of the value and output projections (query and
        key use gain 1); biases start at zero.
      dtype: computation dtype (default: inferred from inputs and parameters).
      param_dtype: parameter dtype.
      precision: matmul precision of the projections and the attention kernel.
      attention_fn: drop-in for :func:`jax_dilated.dilated_attention` (same keywords).
      mesh, seq_axis, batch_axis, head_axis: run the attention sequence-parallel over
        ``mesh`` (distributed dilated attention, equal to the single-device result;
        ``seq_axis=(a, b)`` with ``strategy="hybrid"``: heads over ``a``, a ring over
        ``b``); projections follow their inputs' sharding.
      qk_transform: ``(q, k, positions) -> (q, k)`` applied to the projected
        queries [B, T, H, D] and keys [B, T, Hkv, D] before attention (and before
        keys enter the KV cache), ``positions`` int32 [T] the tokens' absolute
        positions (``cache index + arange(T)`` when decoding), or int32 [B, T] the
        positions within their documents when the call has ``segment_ids``; e.g.
        :class:`jax_dilated.models.Rotary` or :class:`jax_dilated.models.XPos`.
      deterministic, decode: defaults of the call's flags.
      rngs: ``nnx.Rngs`` (``params`` stream for initialisation, ``dropout`` stream).

    Parameters (groups of ``nnx.Param``): ``query`` / ``key`` / ``value``:
    ``kernel`` [E, heads, D] (``("embed", "heads" | "kv_heads", "head_dim")``),
    ``bias`` [heads, D]; ``sub_ln``: ``scale``, ``bias`` [H, D]; ``out``: ``kernel``
    [H, D, E], ``bias`` [E]; with ``sinks=True``, ``sinks``: ``logit`` [H]
    (``("heads",)``). ``nnx.state(layer, nnx.Param)`` has the structure of the Linen
    layer's ``params``.

    Example:
      >>> import jax, jax_dilated as jd
      >>> from flax import nnx
      >>> layer = jd.nnx.MultiheadDilatedAttention(
      ...     16, 2, segment_lengths=(8, 32), dilation_rates=(1, 2), rngs=nnx.Rngs(0))
      >>> x = jax.random.normal(jax.random.key(0), (1, 32, 16))    # [batch, seq, embed]
      >>> nnx.jit(lambda layer, x: layer(x, is_causal=True))(layer, x).shape
      (1, 32, 16)
    """

    def __init__(self, embed_dim: int, num_heads: int, *, segment_lengths: SegmentLengths,
                 dilation_rates: Sequence[int], num_kv_heads: int | None = None,
                 mode: Mode = "longnet", head_offsets: HeadOffsets = "modulo",
                 scale: float | None = None, dropout_rate: float = 0.0, use_bias: bool = True,
                 layer_norm: bool = True, layer_norm_eps: float = 1e-5,
                 gamma_init: float = 1.0, dtype: DTypeLike | None = None,
                 param_dtype: DTypeLike = jnp.float32, precision: Any = None,
                 implementation: Implementation | None = None,
                 attention_fn: Callable | None = None, mesh: jax.sharding.Mesh | None = None,
                 seq_axis: str | tuple[str, str] | None = None, batch_axis: str | None = None,
                 head_axis: str | None = None, strategy: StrategyLike = "ring",
                 deterministic: bool | None = None,
                 decode: bool = False, qk_transform: Callable | None = None,
                 block_q: int | None = None, block_k: int | None = None,
                 logit_soft_cap: float | None = None, sinks: bool = False,
                 dropout: float | None = None, rngs: nnx.Rngs):
        dropout_rate = validation.renamed(
            dropout, None if dropout_rate == 0.0 else dropout_rate, old="dropout",
            new="dropout_rate", where=type(self).__name__)
        core = common.dilated_core(
            segment_lengths=segment_lengths, dilation_rates=dilation_rates, mode=mode,
            head_offsets=head_offsets, scale=scale, implementation=implementation,
            attention_fn=attention_fn, mesh=mesh, seq_axis=seq_axis,
            batch_axis=batch_axis, head_axis=head_axis, strategy=strategy, block_q=block_q,
            block_k=block_k, logit_soft_cap=logit_soft_cap)
        super().__init__(embed_dim, num_heads, core, num_kv_heads=num_kv_heads,
                         dropout_rate=0.0 if dropout_rate is None else dropout_rate,
                         use_bias=use_bias, layer_norm=layer_norm,
                         layer_norm_eps=layer_norm_eps, gamma_init=gamma_init, dtype=dtype,
                         param_dtype=param_dtype, precision=precision,
                         deterministic=deterministic, decode=decode, rngs=rngs,
                         qk_transform=qk_transform, sinks=sinks)


class MultiheadRingAttention(MultiheadBody):
    """Multi-head exact attention, sequence-parallel over a mesh axis (NNX).

    The layer of :class:`MultiheadDilatedAttention` (same parameters, sub-LayerNorm,
    options) with :func:`jax_dilated.ring_attention` as its attention: ``mesh`` and
    ``seq_axis`` are required, ``layout`` picks the ring layout, ``block_q`` /
    ``block_k`` the kernel blocks, ``window=(left, right)`` a sliding window (global
    positions), ``logit_soft_cap`` the soft-cap and ``sinks`` (all three with
    ``strategy="ring"`` or ``"auto"``). Ring attention has no dropout and
    no decoding.

    Example:
      >>> import jax, jax_dilated as jd
      >>> from flax import nnx
      >>> layer = jd.nnx.MultiheadRingAttention(
      ...     16, 2, mesh=jax.make_mesh((1,), ("seq",)), seq_axis="seq", rngs=nnx.Rngs(0))
      >>> x = jax.numpy.ones((1, 32, 16))
      >>> nnx.jit(lambda layer, x: layer(x, is_causal=True))(layer, x).shape
      (1, 32, 16)
    """

    def __init__(self, embed_dim: int, num_heads: int, *, mesh: jax.sharding.Mesh,
                 seq_axis: str | tuple[str, str], layout: Layout = "contiguous",
                 num_kv_heads: int | None = None,
                 scale: float | None = None, use_bias: bool = True, layer_norm: bool = True,
                 layer_norm_eps: float = 1e-5, gamma_init: float = 1.0,
                 dtype: DTypeLike | None = None, param_dtype: DTypeLike = jnp.float32,
                 precision: Any = None, implementation: Implementation | None = None,
                 attention_fn: Callable | None = None, batch_axis: str | None = None,
                 head_axis: str | None = None, strategy: Strategy = "ring",
                 qk_transform: Callable | None = None, block_q: int | None = None,
                 block_k: int | None = None, window: tuple[int, int] | None = None,
                 logit_soft_cap: float | None = None, sinks: bool = False,
                 rngs: nnx.Rngs):
        core = common.ring_core(mesh=mesh, seq_axis=seq_axis, layout=layout,
                                batch_axis=batch_axis, head_axis=head_axis, strategy=strategy, scale=scale,
                                implementation=implementation, attention_fn=attention_fn,
                                block_q=block_q, block_k=block_k, window=window,
                                logit_soft_cap=logit_soft_cap)
        super().__init__(embed_dim, num_heads, core, num_kv_heads=num_kv_heads,
                         use_bias=use_bias, layer_norm=layer_norm, layer_norm_eps=layer_norm_eps,
                         gamma_init=gamma_init, dtype=dtype, param_dtype=param_dtype,
                         precision=precision, rngs=rngs, qk_transform=qk_transform, sinks=sinks)


class MultiheadBlockSparseAttention(MultiheadBody):
    """Multi-head block-sparse attention (NNX), on one device or over a ring.

    The layer of :class:`MultiheadDilatedAttention` (same parameters, sub-LayerNorm,
    options) with :func:`jax_dilated.block_sparse_attention` as its attention:
    ``block_size`` and ``pattern`` (a :mod:`jax_dilated.block_patterns` pattern or a
    bool block mask) say which key blocks each query block attends to. With ``mesh``
    and ``seq_axis`` it runs over a ring in ``layout`` ("contiguous" or "zigzag").
    ``window=(left, right)`` and ``logit_soft_cap`` as in
    :class:`MultiheadRingAttention` (the window applies on top of the pattern),
    ``sinks=True`` as in :class:`MultiheadDilatedAttention` (one device only).
    Block-sparse attention has no dropout and no decoding.

    Example:
      >>> import jax, jax_dilated as jd
      >>> from flax import nnx
      >>> from jax_dilated import block_patterns as bp
      >>> layer = jd.nnx.MultiheadBlockSparseAttention(
      ...     16, 2, block_size=8, pattern=bp.LocalWindow(1), rngs=nnx.Rngs(0))
      >>> x = jax.numpy.ones((1, 32, 16))
      >>> nnx.jit(lambda layer, x: layer(x, is_causal=True))(layer, x).shape
      (1, 32, 16)
    """

    def __init__(self, embed_dim: int, num_heads: int, *, block_size: int,
                 pattern: BlockPattern | ArrayLike, num_kv_heads: int | None = None,
                 scale: float | None = None, use_bias: bool = True, layer_norm: bool = True,
                 layer_norm_eps: float = 1e-5, gamma_init: float = 1.0,
                 dtype: DTypeLike | None = None, param_dtype: DTypeLike = jnp.float32,
                 precision: Any = None, implementation: Implementation | None = None,
                 attention_fn: Callable | None = None, mesh: jax.sharding.Mesh | None = None,
                 seq_axis: str | tuple[str, str] | None = None, layout: Layout = "contiguous",
                 batch_axis: str | None = None, head_axis: str | None = None,
                 strategy: Strategy = "ring", qk_transform: Callable | None = None,
                 window: tuple[int, int] | None = None, logit_soft_cap: float | None = None,
                 sinks: bool = False, rngs: nnx.Rngs):
        core = common.block_sparse_core(
            block_size=block_size, pattern=pattern, scale=scale,
            implementation=implementation, attention_fn=attention_fn, mesh=mesh,
            seq_axis=seq_axis, layout=layout, batch_axis=batch_axis, head_axis=head_axis,
            strategy=strategy, window=window, logit_soft_cap=logit_soft_cap)
        super().__init__(embed_dim, num_heads, core, num_kv_heads=num_kv_heads,
                         use_bias=use_bias, layer_norm=layer_norm, layer_norm_eps=layer_norm_eps,
                         gamma_init=gamma_init, dtype=dtype, param_dtype=param_dtype,
                         precision=precision, rngs=rngs, qk_transform=qk_transform, sinks=sinks)
