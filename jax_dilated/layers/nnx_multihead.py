"""The NNX multi-head layers' shared body (:class:`MultiheadBody`): the parameters, the
q/k/v projections, the attention core, the sub-LayerNorm and output projection, and
KV-cache decoding. The layers of :mod:`jax_dilated.layers.nnx` give it their core."""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from jax_dilated.backends.native import gemm
from jax_dilated.core import validation
from jax_dilated.core.types import Array, ArrayLike, DTypeLike
from jax_dilated.layers import common, nnx_rngs, projections
from jax_dilated.ops import decode as decoding

__all__ = ["MultiheadBody"]


class MultiheadBody(nnx_rngs.DropoutMixin, nnx.Module):
    """Projections + attention core + sub-LayerNorm + output projection (shared body)."""

    def __init__(self, embed_dim, num_heads, core: common.AttentionCore, *, num_kv_heads,
                 use_bias, layer_norm, layer_norm_eps, gamma_init, dtype, param_dtype,
                 precision, rngs: nnx.Rngs, qk_transform=None, sinks=False,
                 dropout_rate=0.0, deterministic=None, decode=False):
        # (the defaults: a core without dropout or decoding, the ring and block-sparse ones)
        self.heads = projections.HeadsConfig.create(
            embed_dim, num_heads, num_kv_heads, use_bias=use_bias, layer_norm=layer_norm,
            layer_norm_eps=layer_norm_eps, gamma_init=gamma_init, sinks=sinks)
        self.heads.check_core(core)
        common.check_sinks_flag(sinks, core)
        self.core = core
        self.dropout_rate = validation.check_dropout_rate(dropout_rate)
        if self.dropout_rate and not core.has_dropout:
            raise ValueError(
                f"dropout_rate={dropout_rate}: {core.kind} attention has no attention "
                f"dropout; use dropout_rate=0.0 (or dilated attention).")
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.deterministic, self.decode = deterministic, decode
        self.qk_transform = projections.check_qk_transform(qk_transform)
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}.")
        groups = projections.param_specs(self.heads)
        self.param_groups = tuple(groups)
        for group, specs in groups.items():
            setattr(self, group, nnx.Dict({
                s.name: nnx.Param(s.init(rngs.params(), s.shape, param_dtype),
                                  out_sharding=s.axes, eager_sharding=False)
                for s in specs}))
        self.rngs = nnx_rngs.fork_dropout_rngs(rngs, self.dropout_rate)
        self.cached_key = nnx.data(None)
        self.cached_value = nnx.data(None)
        self.cache_index = nnx.data(None)

    def _params(self):
        return {g: {name: p[...] for name, p in getattr(self, g).items()}
                for g in self.param_groups}

    def init_cache(self, input_shape: Sequence[int], dtype: DTypeLike = jnp.float32) -> None:
        """Allocate the KV cache for decoding: ``input_shape = (batch, max_len, embed_dim)``."""
        if len(input_shape) != 3 or input_shape[-1] != self.heads.embed_dim:
            raise ValueError(
                f"init_cache takes (batch, max_len, embed_dim) with embed_dim="
                f"{self.heads.embed_dim}, got {tuple(input_shape)}.")
        cache = decoding.init_kv_cache(input_shape[0], input_shape[1],
                                       self.heads.num_kv_heads, self.heads.head_dim, dtype)
        self.cached_key = nnx.Cache(cache.key)
        self.cached_value = nnx.Cache(cache.value)
        self.cache_index = nnx.Cache(cache.index)

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None) -> None:
        """Used by ``nnx.view(model, deterministic=..., decode=...)``."""
        super().set_view(deterministic)
        if decode is not None:
            self.decode = decode

    def __call__(self, query: ArrayLike, key: ArrayLike | None = None,
                 value: ArrayLike | None = None, *, is_causal: bool = False,
                 kv_mask: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
                 deterministic: bool | None = None, decode: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | Array | None = None) -> Array:
        """Multi-head attention of ``query`` over ``key`` / ``value``.

        Args:
          query: [batch, seq, embed_dim]; key, value: [batch, seq, embed_dim], default
            ``query`` (self-attention; ``value`` defaults to ``key``).
          is_causal: causal attention.
          kv_mask: bool [batch, seq], True where a key may be attended to.
          segment_ids: int [batch, seq], packed documents (a document is a maximal
            run of equal ids): a query attends to keys of its own document only, and
            ``qk_transform`` positions count from the document's first token, so a
            packed row gives what its documents give alone (with dilated attention,
            whose segment grid restarts at each document). Not with ``decode``.
          deterministic: no dropout when True (default: the constructor's).
          decode: decode against the KV cache of :meth:`init_cache`: ``query``
            [batch, n, embed_dim] are the next ``n`` tokens (one at a time, or a
            whole prompt: from an empty cache one causal forward pass fills it);
            always causal.
          rngs: overrides the constructor's dropout stream.

        Returns:
          [batch, seq, embed_dim].
        """
        query, key, value = common.check_inputs(self.heads.embed_dim, query, key, value)
        segment_ids = validation.check_segment_ids(segment_ids, query.shape, key.shape)
        params = self._params()
        dropout_rng = self._dropout_key(self.dropout_rate, deterministic, rngs,
                                        type(self).__name__)
        dot_general = gemm.for_mesh(self.core.mesh)
        q, k, v = projections.project_qkv(params, query, key, value, dtype=self.dtype,
                                          precision=self.precision, dot_general=dot_general)
        if self.decode if decode is None else decode:
            common.check_decode_segment_ids(segment_ids)
            if self.cache_index is None:
                raise ValueError(
                    "decode=True needs the KV cache: call layer.init_cache((batch, "
                    "max_len, embed_dim)) first.")
            cache = decoding.KVCache(self.cached_key[...], self.cached_value[...],
                                     self.cache_index[...])
            q, k = projections.apply_qk_transform(self.qk_transform, q, k, cache.index)
            attn, cache = common.layer_decode_step(self.core, cache, q, k, v,
                                                   kv_mask=kv_mask, dropout_rng=dropout_rng,
                                                   precision=self.precision,
                                                   sinks=projections.sink_logits(params))
            self.cached_key[...], self.cached_value[...] = cache.key, cache.value
            self.cache_index[...] = cache.index
        else:
            q, k = projections.apply_qk_transform(self.qk_transform, q, k,
                                                  segment_ids=segment_ids)
            with common.precision_context(self.precision):
                attn = self.core(q, k, v, is_causal=is_causal, kv_mask=kv_mask,
                                 segment_ids=segment_ids,
                                 sinks=projections.sink_logits(params),
                                 dropout_rate=(self.dropout_rate if dropout_rng is not None
                                               else 0.0),
                                 dropout_rng=dropout_rng)
        return projections.project_out(params, self.heads, attn, dtype=self.dtype,
                                       precision=self.precision, dot_general=dot_general)
