"""Flax Linen layers: the Linen twins of :mod:`jax_dilated.nnx`.

* :class:`DilatedAttention`, :class:`RingAttention` - the attention functions as
  modules (no parameters).
* :class:`MultiheadDilatedAttention`, :class:`MultiheadRingAttention` - the multi-head
  layers, with the same options, parameters (same names, shapes, initialisation and
  logical sharding axes, boxed with ``nn.with_logical_partitioning``) and math as the
  NNX layers: ``variables["params"]`` of a Linen layer and
  ``nnx.state(nnx_layer, nnx.Param)`` are interchangeable.

Linen conventions: ``dtype``, ``param_dtype``, ``precision``; ``deterministic`` as a
field or call argument (the call wins), dropout keys from the ``"dropout"`` rng
collection (or ``dropout_rng=``); decoding through the ``"cache"`` collection, as in
``flax.linen.MultiHeadDotProductAttention``: ``init`` with ``decode=True`` on a full
``[batch, max_len, embed_dim]`` input creates the cache, then
``apply(variables, x_t, decode=True, mutable=["cache"])`` decodes the next tokens
``x_t`` [batch, n, embed_dim] (one at a time, or a whole prompt).

Over a mesh (``mesh``, ``seq_axis``) the layers take global arrays and give what the
same layer gives on one device. ``seq_axis=(a, b)`` with ``strategy="hybrid"`` (or
``"auto"``, which picks it) shards the sequence over two mesh axes, ``b`` major (the
length divisible by ``P_a P_b``): heads are exchanged over ``a`` (``num_heads``
divisible by ``P_a``) and the attention's ring runs over ``b`` (docs/semantics.md
section 8, "Hybrid"); a pair naming one axis twice or an axis not in the mesh is a
``ValueError`` naming ``seq_axis`` at construction.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_dilated.backends.native import gemm
from jax_dilated.block_patterns import BlockPattern
from jax_dilated.core import validation
from jax_dilated.core.types import (Array, ArrayLike, DTypeLike, HeadOffsets, Implementation,
                                    Layout, Mode, SegmentLengths, Strategy, StrategyLike)
from jax_dilated.layers import common, projections
from jax_dilated.ops import decode as decoding

__all__ = ["DilatedAttention", "RingAttention", "MultiheadDilatedAttention",
           "MultiheadRingAttention", "MultiheadBlockSparseAttention"]


def _dropout_key(module: nn.Module, rate: float, deterministic, dropout_rng):
    """The dropout key of a call, or None (rate 0 or deterministic)."""
    if rate == 0.0:
        return None
    deterministic = nn.merge_param("deterministic", module.deterministic, deterministic)
    if deterministic:
        return None
    return module.make_rng("dropout") if dropout_rng is None else dropout_rng


class DilatedAttention(nn.Module):
    """:func:`jax_dilated.dilated_attention` as a Linen module (no parameters).

    Fields as :class:`jax_dilated.nnx.DilatedAttention` (``seq_axis`` one mesh axis,
    or two ``(a, b)`` with ``strategy="hybrid"``); call ``(query, key, value, *,
    is_causal=False, kv_mask=None, segment_ids=None, sinks=None, deterministic=None,
    dropout_rng=None)`` with ``[B, T, H, D]`` arrays (``segment_ids`` int [B, T]:
    packed documents; ``sinks`` float [H]: per-head sink logits).

    Example:
      >>> import jax, jax_dilated as jd
      >>> attn = jd.linen.DilatedAttention(segment_lengths=(8, 32), dilation_rates=(1, 2))
      >>> x = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
      >>> jax.jit(lambda x: attn.apply({}, x, x, x, is_causal=True))(x).shape
      (1, 32, 2, 8)
    """

    segment_lengths: SegmentLengths
    dilation_rates: Sequence[int]
    mode: Mode = "longnet"
    head_offsets: HeadOffsets = "modulo"
    scale: float | None = None
    dropout_rate: float = 0.0
    implementation: Implementation | None = None
    attention_fn: Callable | None = None
    mesh: jax.sharding.Mesh | None = None
    seq_axis: str | tuple[str, str] | None = None
    batch_axis: str | None = None
    head_axis: str | None = None
    strategy: StrategyLike = "ring"
    deterministic: bool | None = None
    block_q: int | None = None
    block_k: int | None = None
    logit_soft_cap: float | None = None

    def __post_init__(self):
        super().__post_init__()
        # validate the fields on construction, as the NNX layers do
        common.check_mesh_scores(self._core())
        validation.check_dropout_rate(self.dropout_rate)

    def _core(self):
        return common.dilated_core(
            segment_lengths=self.segment_lengths, dilation_rates=self.dilation_rates,
            mode=self.mode, head_offsets=self.head_offsets, scale=self.scale,
            implementation=self.implementation, attention_fn=self.attention_fn,
            mesh=self.mesh, seq_axis=self.seq_axis, batch_axis=self.batch_axis,
            head_axis=self.head_axis, strategy=self.strategy, block_q=self.block_q,
            block_k=self.block_k, logit_soft_cap=self.logit_soft_cap)

    @nn.compact
    def __call__(self, query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                 is_causal: bool = False, kv_mask: ArrayLike | None = None,
                 segment_ids: ArrayLike | None = None, sinks: ArrayLike | None = None,
                 deterministic: bool | None = None,
                 dropout_rng: Array | None = None) -> Array:
        core = self._core()
        rate = validation.check_dropout_rate(self.dropout_rate)
        key_ = _dropout_key(self, rate, deterministic, dropout_rng)
        return core(query, key, value, is_causal=is_causal, kv_mask=kv_mask,
                    segment_ids=segment_ids, sinks=sinks,
                    dropout_rate=rate if key_ is not None else 0.0, dropout_rng=key_)


class RingAttention(nn.Module):
    """Exact attention over a sequence sharded on ``seq_axis`` of ``mesh`` (Linen).

    Fields as :class:`jax_dilated.nnx.RingAttention` (``seq_axis`` one mesh axis, or
    two ``(a, b)`` with ``strategy="hybrid"``); call ``(query, key, value, *,
    is_causal=False, kv_mask=None, segment_ids=None, sinks=None)`` with ``[B, T, H,
    D]`` arrays -> ``[B, T, H, D]``.

    Example:
      >>> import jax, jax_dilated as jd
      >>> ring = jd.linen.RingAttention(mesh=jax.make_mesh((1,), ("seq",)), seq_axis="seq")
      >>> x = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
      >>> jax.jit(lambda x: ring.apply({}, x, x, x, is_causal=True))(x).shape
      (1, 32, 2, 8)
    """

    mesh: jax.sharding.Mesh
    seq_axis: str | tuple[str, str]
    layout: Layout = "contiguous"
    batch_axis: str | None = None
    head_axis: str | None = None
    strategy: Strategy = "ring"
    scale: float | None = None
    implementation: Implementation | None = None
    attention_fn: Callable | None = None
    block_q: int | None = None
    block_k: int | None = None
    window: tuple[int, int] | None = None
    logit_soft_cap: float | None = None

    def __post_init__(self):
        super().__post_init__()
        # validate the fields on construction, as the NNX layers do
        common.check_mesh_scores(self._core())

    def _core(self):
        return common.ring_core(mesh=self.mesh, seq_axis=self.seq_axis, layout=self.layout,
                                batch_axis=self.batch_axis, head_axis=self.head_axis, strategy=self.strategy,
                                scale=self.scale, implementation=self.implementation,
                                attention_fn=self.attention_fn, block_q=self.block_q,
                                block_k=self.block_k, window=self.window,
                                logit_soft_cap=self.logit_soft_cap)

    @nn.compact
    def __call__(self, query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                 is_causal: bool = False, kv_mask: ArrayLike | None = None,
                 segment_ids: ArrayLike | None = None,
                 sinks: ArrayLike | None = None) -> Array:
        return self._core()(query, key, value, is_causal=is_causal, kv_mask=kv_mask,
                            segment_ids=segment_ids, sinks=sinks)


class _ParamGroup(nn.Module):
    """Creates one group of parameters (e.g. ``query``: ``kernel``, ``bias``)."""

    specs: tuple
    param_dtype: Any

    @nn.compact
    def __call__(self):
        return {s.name: self.param(s.name, nn.with_logical_partitioning(s.init, s.axes),
                                   s.shape, self.param_dtype)
                for s in self.specs}


class _Multihead(nn.Module):
    """Fields and body shared by the multi-head layers; subclasses build the core."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int | None = None
    scale: float | None = None
    dropout_rate: float = 0.0
    use_bias: bool = True
    layer_norm: bool = True
    layer_norm_eps: float = 1e-5
    gamma_init: float = 1.0
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    precision: Any = None
    implementation: Implementation | None = None
    attention_fn: Callable | None = None
    mesh: jax.sharding.Mesh | None = None
    seq_axis: str | tuple[str, str] | None = None
    batch_axis: str | None = None
    head_axis: str | None = None
    strategy: StrategyLike = "ring"
    deterministic: bool | None = None
    decode: bool = False
    qk_transform: Callable | None = None
    block_q: int | None = None
    block_k: int | None = None
    logit_soft_cap: float | None = None
    sinks: bool = False  # a learnable [num_heads] sink logit per head (params "sinks")
    dropout: float | None = None  # deprecated spelling of dropout_rate

    def _rate(self) -> float:
        """``dropout_rate``, or the deprecated ``dropout`` field (with a warning)."""
        rate = validation.renamed(
            self.dropout, None if self.dropout_rate == 0.0 else self.dropout_rate,
            old="dropout", new="dropout_rate", where=type(self).__name__)
        return validation.check_dropout_rate(0.0 if rate is None else rate)

    def _core(self) -> common.AttentionCore:
        raise NotImplementedError  # defined by every public subclass

    def __post_init__(self):
        super().__post_init__()
        # validate the fields on construction, as the NNX layers do (scale, branches,
        # block sizes, mesh, heads); the call checks them again
        validation.check_dropout_rate(self.dropout_rate)
        if self.dropout is not None:  # the deprecated spelling (warns at the call)
            validation.check_dropout_rate(self.dropout, "dropout")
        if type(self) is not _Multihead:
            core = self._core()
            projections.HeadsConfig.create(
                self.embed_dim, self.num_heads, self.num_kv_heads, use_bias=self.use_bias,
                layer_norm=self.layer_norm, layer_norm_eps=self.layer_norm_eps,
                gamma_init=self.gamma_init, sinks=self.sinks).check_core(core)
            common.check_sinks_flag(self.sinks, core)

    def _decode(self, core, q, k, v, kv_mask, dropout_rng, sinks):
        """Decoding through the ``cache`` collection (created by the first call)."""
        initialized = self.has_variable("cache", "cached_key")
        if not initialized and not self.is_initializing():
            raise ValueError(
                "decode=True needs the KV cache: create it with "
                "layer.init(rngs, jnp.zeros((batch, max_len, embed_dim)), decode=True) and "
                "pass variables['cache'] with mutable=['cache'].")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        cache_index = self.variable("cache", "cache_index",
                                    lambda: jnp.zeros((), jnp.int32))
        q, k = projections.apply_qk_transform(self.qk_transform, q, k,
                                         cache_index.value if initialized else 0)
        if not initialized:  # the initialising call: an ordinary causal forward pass
            with common.precision_context(self.precision):
                return core(q, k, v, is_causal=True, kv_mask=kv_mask, sinks=sinks,
                            dropout_rate=self._rate() if dropout_rng is not None else 0.0,
                            dropout_rng=dropout_rng)
        cache = decoding.KVCache(cached_key.value, cached_value.value, cache_index.value)
        attn, cache = common.layer_decode_step(core, cache, q, k, v, kv_mask=kv_mask,
                                               dropout_rng=dropout_rng,
                                               precision=self.precision, sinks=sinks)
        cached_key.value, cached_value.value, cache_index.value = cache
        return attn

    @nn.compact
    def __call__(self, query: ArrayLike, key: ArrayLike | None = None,
                 value: ArrayLike | None = None, *, is_causal: bool = False,
                 kv_mask: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
                 deterministic: bool | None = None, decode: bool | None = None,
                 dropout_rng: Array | None = None) -> Array:
        """Multi-head attention: ``query`` [batch, seq, embed_dim] (``key`` / ``value``
        default to it) -> [batch, seq, embed_dim]. Arguments as in
        :meth:`jax_dilated.nnx.MultiheadDilatedAttention.__call__`; ``dropout_rng``
        overrides the ``"dropout"`` rng collection."""
        heads = projections.HeadsConfig.create(
            self.embed_dim, self.num_heads, self.num_kv_heads, use_bias=self.use_bias,
            layer_norm=self.layer_norm, layer_norm_eps=self.layer_norm_eps,
            gamma_init=self.gamma_init, sinks=self.sinks)
        core = self._core()
        heads.check_core(core)
        common.check_sinks_flag(self.sinks, core)
        projections.check_qk_transform(self.qk_transform)
        rate = self._rate()
        if rate and not core.has_dropout:
            raise ValueError(
                f"dropout_rate={rate}: {core.kind} attention has no attention dropout; use "
                f"dropout_rate=0.0 (or dilated attention).")
        query, key, value = common.check_inputs(heads.embed_dim, query, key, value)
        segment_ids = validation.check_segment_ids(segment_ids, query.shape, key.shape)
        params = {group: _ParamGroup(specs, self.param_dtype, name=group)()
                  for group, specs in projections.param_specs(heads).items()}
        dropout_rng = _dropout_key(self, rate, deterministic, dropout_rng)
        dot_general = gemm.for_mesh(core.mesh)
        q, k, v = projections.project_qkv(params, query, key, value, dtype=self.dtype,
                                          precision=self.precision, dot_general=dot_general)
        if self.decode if decode is None else decode:
            common.check_decode_segment_ids(segment_ids)
            attn = self._decode(core, q, k, v, kv_mask, dropout_rng,
                                projections.sink_logits(params))
        else:
            q, k = projections.apply_qk_transform(self.qk_transform, q, k,
                                                  segment_ids=segment_ids)
            with common.precision_context(self.precision):
                attn = core(q, k, v, is_causal=is_causal, kv_mask=kv_mask,
                            segment_ids=segment_ids, sinks=projections.sink_logits(params),
                            dropout_rate=rate if dropout_rng is not None else 0.0,
                            dropout_rng=dropout_rng)
        return projections.project_out(params, heads, attn, dtype=self.dtype,
                                       precision=self.precision, dot_general=dot_general)


class MultiheadDilatedAttention(_Multihead):
    """LongNet multi-head dilated attention (Linen); options, parameters and math as
    :class:`jax_dilated.nnx.MultiheadDilatedAttention` (``segment_lengths`` and
    ``dilation_rates`` are required; ``mesh`` with ``seq_axis=(a, b)`` and
    ``strategy="hybrid"``: distributed dilated attention over two mesh axes, see the
    module docstring). ``[batch, seq, embed_dim]`` in and out.

    Example:
      >>> import jax, jax_dilated as jd
      >>> layer = jd.linen.MultiheadDilatedAttention(
      ...     embed_dim=16, num_heads=2, segment_lengths=(8, 32), dilation_rates=(1, 2))
      >>> x = jax.random.normal(jax.random.key(0), (1, 32, 16))    # [batch, seq, embed]
      >>> params = jax.jit(layer.init)(jax.random.key(1), x)
      >>> jax.jit(lambda p, x: layer.apply(p, x, is_causal=True))(params, x).shape
      (1, 32, 16)
    """

    segment_lengths: SegmentLengths | None = None
    dilation_rates: Sequence[int] | None = None
    mode: Mode = "longnet"
    head_offsets: HeadOffsets = "modulo"

    def _core(self):
        return common.dilated_core(
            segment_lengths=self.segment_lengths, dilation_rates=self.dilation_rates,
            mode=self.mode, head_offsets=self.head_offsets, scale=self.scale,
            implementation=self.implementation, attention_fn=self.attention_fn,
            mesh=self.mesh, seq_axis=self.seq_axis, batch_axis=self.batch_axis,
            head_axis=self.head_axis, strategy=self.strategy, block_q=self.block_q,
            block_k=self.block_k, logit_soft_cap=self.logit_soft_cap)


class MultiheadRingAttention(_Multihead):
    """Multi-head exact ring attention over ``mesh`` / ``seq_axis`` (Linen); see
    :class:`jax_dilated.nnx.MultiheadRingAttention`. ``seq_axis=(a, b)`` with
    ``strategy="hybrid"``: heads exchanged over ``a``, the ring over ``b`` (see the
    module docstring). ``[batch, seq, embed_dim]`` in and out.

    Example:
      >>> import jax, jax_dilated as jd
      >>> layer = jd.linen.MultiheadRingAttention(
      ...     embed_dim=16, num_heads=2, mesh=jax.make_mesh((1,), ("seq",)), seq_axis="seq")
      >>> x = jax.numpy.ones((1, 32, 16))
      >>> params = jax.jit(layer.init)(jax.random.key(1), x)
      >>> jax.jit(lambda p, x: layer.apply(p, x, is_causal=True))(params, x).shape
      (1, 32, 16)
    """

    layout: Layout = "contiguous"
    window: tuple[int, int] | None = None

    def _core(self):
        return common.ring_core(mesh=self.mesh, seq_axis=self.seq_axis, layout=self.layout,
                                batch_axis=self.batch_axis, head_axis=self.head_axis, strategy=self.strategy,
                                scale=self.scale, implementation=self.implementation,
                                attention_fn=self.attention_fn, block_q=self.block_q,
                                block_k=self.block_k, window=self.window,
                                logit_soft_cap=self.logit_soft_cap)


class MultiheadBlockSparseAttention(_Multihead):
    """Multi-head block-sparse attention (Linen); see
    :class:`jax_dilated.nnx.MultiheadBlockSparseAttention` (``block_size`` and
    ``pattern`` are required; with ``mesh`` / ``seq_axis`` it runs over a ring).

    Example:
      >>> import jax, jax_dilated as jd
      >>> from jax_dilated import block_patterns as bp
      >>> layer = jd.linen.MultiheadBlockSparseAttention(
      ...     embed_dim=16, num_heads=2, block_size=8, pattern=bp.LocalWindow(1))
      >>> x = jax.numpy.ones((1, 32, 16))
      >>> params = jax.jit(layer.init)(jax.random.key(1), x)
      >>> jax.jit(lambda p, x: layer.apply(p, x, is_causal=True))(params, x).shape
      (1, 32, 16)
    """

    block_size: int | None = None
    pattern: BlockPattern | ArrayLike | None = None
    layout: Layout = "contiguous"
    window: tuple[int, int] | None = None

    def _core(self):
        if self.block_q is not None or self.block_k is not None:
            raise ValueError(
                f"block-sparse attention runs the kernel in blocks of block_size="
                f"{self.block_size}: block_q / block_k do not apply, got block_q="
                f"{self.block_q}, block_k={self.block_k}.")
        return common.block_sparse_core(
            block_size=self.block_size, pattern=self.pattern, scale=self.scale,
            implementation=self.implementation, attention_fn=self.attention_fn,
            mesh=self.mesh, seq_axis=self.seq_axis, layout=self.layout,
            batch_axis=self.batch_axis, head_axis=self.head_axis, strategy=self.strategy,
            window=self.window, logit_soft_cap=self.logit_soft_cap)
