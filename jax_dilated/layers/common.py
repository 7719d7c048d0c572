"""What the NNX and Linen layers share: configuration, validation, parameters, math.

The layers in :mod:`jax_dilated.nnx` and :mod:`jax_dilated.linen` differ only in
how they hold parameters, caches and random keys. Everything else lives here, once:

* :class:`AttentionCore` - the static attention configuration of a layer (dilated or
  ring, on one device or sequence-parallel over a mesh) and the call that runs it;
* :class:`HeadsConfig` - the multi-head options, their validation and the table of
  parameters (:func:`param_specs`: shapes, initialisers, logical sharding axes);
* the functional forward pass: :func:`project_qkv`, :func:`project_out`.

Logical axis names of the parameters (map them to mesh axes with
``nnx.logical_axis_rules`` / ``flax.linen.logical_axis_rules``):

=============  ===============================================================
``"embed"``     the model (embedding) dimension ``embed_dim``
``"heads"``     query heads (shard over a tensor-parallel axis, e.g. ``"model"``)
``"kv_heads"``  key/value heads (``num_kv_heads``; must divide by that axis too)
``"head_dim"``  features per head
=============  ===============================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax_dilated import block_patterns
from jax_dilated.backends import select_implementation
from jax_dilated.core import branch_plans, layouts, softmax, validation
from jax_dilated.ops import decode as decoding
from jax_dilated.ops.block_sparse import block_sparse_attention
from jax_dilated.ops.dilated import dilated_attention
from jax_dilated.ops.ring import ring_attention
from jax_dilated.ops.sharded import sharded

__all__ = [
    "AttentionCore",
    "HeadsConfig",
    "ParamSpec",
    "dilated_core",
    "ring_core",
    "param_specs",
    "project_qkv",
    "project_out",
    "check_inputs",
    "precision_context",
    "check_qk_transform",
    "apply_qk_transform",
    "layer_decode_step",
]

EMBED, HEADS, KV_HEADS, HEAD_DIM = "embed", "heads", "kv_heads", "head_dim"


# ----------------------------------------------------------------------------- checks


def check_inputs(embed_dim: int, query, key, value):
    """``[batch, seq, embed_dim]`` inputs; returns ``(query, key, value)`` with the
    self-attention defaults (``key = query``, ``value = key``) filled in."""
    if key is None:
        if value is not None:
            raise ValueError("key cannot be None when value is given (value defaults to key).")
        key = query
    if value is None:
        value = key
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(
                f"{name} must have shape [batch, seq, embed_dim], got "
                f"{getattr(x, 'shape', type(x).__name__)}."
            )
        if x.shape[-1] != embed_dim:
            raise ValueError(
                f"{name} has {x.shape[-1]} features but the layer has embed_dim="
                f"{embed_dim} (shape {tuple(x.shape)})."
            )
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got {tuple(key.shape)} and "
            f"{tuple(value.shape)}."
        )
    return query, key, value


def precision_context(precision):
    """A context applying ``precision`` (as for ``jnp.einsum``) to every matmul of the
    attention kernel, or a null context for ``None``."""
    if precision is None:
        return contextlib.nullcontext()
    if isinstance(precision, (tuple, list)):
        if len(set(precision)) != 1:
            raise ValueError(
                f"the attention kernel takes one precision for all its matmuls, got "
                f"{precision!r}."
            )
        precision = precision[0]
    name = precision.name if isinstance(precision, jax.lax.Precision) else str(precision)
    return jax.default_matmul_precision(name.lower())


# ----------------------------------------------------------------------- attention core


@dataclasses.dataclass(frozen=True)
class AttentionCore:
    """The static attention of a layer and how to run it.

    kind: ``"dilated"`` (:func:`jax_dilated.dilated_attention`), ``"ring"``
      (exact attention, :func:`jax_dilated.ring_attention`) or ``"block_sparse"``
      (:func:`jax_dilated.block_sparse_attention`).
    fn: the attention function (the default or a user's drop-in with its signature).
    options: its static keyword arguments (segment lengths, mode, scale, ...).
    mesh, seq_axis, batch_axis, head_axis, layout: with a mesh, ``fn`` runs
      sequence-parallel on global arrays through :func:`jax_dilated.sharded`.
    """

    kind: str
    fn: Callable
    options: tuple
    mesh: Any = None
    seq_axis: str | None = None
    batch_axis: str | None = None
    head_axis: str | None = None
    layout: str = "contiguous"

    @property
    def has_dropout(self) -> bool:
        return self.kind == "dilated"

    def __call__(self, query, key, value, *, is_causal=False, kv_mask=None,
                 dropout_rate=0.0, dropout_rng=None):
        """``[batch, seq, heads, head_dim]`` in, the same out (see the attention fn)."""
        kw = dict(self.options, is_causal=is_causal)
        if self.has_dropout:
            kw.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
        if self.mesh is None:
            return self.fn(query, key, value, kv_mask=kv_mask, **kw)
        run = sharded(functools.partial(self.fn, **kw), self.mesh, seq_axis=self.seq_axis,
                      batch_axis=self.batch_axis, head_axis=self.head_axis,
                      layout=self.layout)
        return run(query, key, value, kv_mask=kv_mask)


def _block_options(block_q, block_k) -> tuple:
    """``block_q`` / ``block_k`` options, only those given (a user's drop-in
    ``attention_fn`` need not take them)."""
    block_q, block_k = validation.check_block_sizes(block_q, block_k)
    return tuple((name, b) for name, b in (("block_q", block_q), ("block_k", block_k))
                 if b is not None)


def dilated_core(*, segment_lengths, dilation_rates, mode="longnet", head_offsets="modulo",
                 scale=None, implementation=None, attention_fn=None, mesh=None,
                 seq_axis=None, batch_axis=None, head_axis=None, block_q=None,
                 block_k=None) -> AttentionCore:
    """Validated :class:`AttentionCore` for dilated attention.

    ``attention_fn`` (default :func:`jax_dilated.dilated_attention`) is called as
    ``attention_fn(q, k, v, segment_lengths=, dilation_rates=, mode=, head_offsets=,
    scale=, implementation=, is_causal=, kv_mask=, dropout_rate=, dropout_rng=)``
    (plus ``block_q=`` / ``block_k=`` when given) and, with a mesh, also receives
    ``seq_axis=`` inside ``shard_map``.
    """
    branches = branch_plans.validate_branches(segment_lengths, dilation_rates)
    if mode not in branch_plans.MODES:
        raise ValueError(f"mode must be one of {branch_plans.MODES}, got {mode!r}.")
    if head_offsets not in branch_plans.HEAD_OFFSETS:
        raise ValueError(
            f"head_offsets must be one of {branch_plans.HEAD_OFFSETS}, got {head_offsets!r}.")
    validation.check_scale_option(scale)
    select_implementation(implementation)
    validation.check_mesh_axes(mesh, seq_axis, batch_axis, head_axis)
    attention_fn = dilated_attention if attention_fn is None else attention_fn
    options = (("segment_lengths", tuple(w for w, _ in branches)),
               ("dilation_rates", tuple(r for _, r in branches)), ("mode", mode),
               ("head_offsets", head_offsets), ("scale", scale),
               ("implementation", implementation)) + _block_options(block_q, block_k)
    return AttentionCore("dilated", attention_fn, options, mesh, seq_axis, batch_axis,
                         head_axis)


def ring_core(*, mesh, seq_axis, layout="contiguous", batch_axis=None, head_axis=None,
              scale=None, implementation=None, attention_fn=None, block_q=None,
              block_k=None) -> AttentionCore:
    """Validated :class:`AttentionCore` for ring (exact, sequence-parallel) attention.

    ``attention_fn`` (default :func:`jax_dilated.ring_attention`) is called inside
    ``shard_map`` as ``attention_fn(q, k, v, seq_axis=, layout=, kv_mask=, is_causal=,
    scale=, implementation=)`` (plus ``block_q=`` / ``block_k=`` when given).
    """
    if mesh is None:
        raise ValueError(
            "ring attention runs the sequence over a device mesh: pass mesh= and "
            "seq_axis= (e.g. mesh=jax.make_mesh((8,), ('seq',)), seq_axis='seq')."
        )
    validation.check_mesh_axes(mesh, seq_axis, batch_axis, head_axis)
    layouts.check_layout(layout)
    validation.check_scale_option(scale)
    select_implementation(implementation)
    attention_fn = ring_attention if attention_fn is None else attention_fn
    options = (("scale", scale), ("implementation", implementation)) + _block_options(
        block_q, block_k)
    return AttentionCore("ring", attention_fn, options, mesh, seq_axis, batch_axis,
                         head_axis, layout)


def block_sparse_core(*, block_size, pattern, scale=None, implementation=None,
                      attention_fn=None, mesh=None, seq_axis=None, layout="contiguous",
                      batch_axis=None, head_axis=None) -> AttentionCore:
    """Validated :class:`AttentionCore` for block-sparse attention.

    ``attention_fn`` (default :func:`jax_dilated.block_sparse_attention`) is called as
    ``attention_fn(q, k, v, block_size=, pattern=, scale=, implementation=,
    is_causal=, kv_mask=)`` and, with a mesh (a ring over ``seq_axis`` in
    ``layout``), also receives ``seq_axis=`` and ``layout=`` inside ``shard_map``.
    ``block_size`` is the pattern's block and the kernel's block alike.
    """
    block_size = validation.check_positive_int("block_size", block_size)
    pattern = block_patterns.as_pattern(pattern)
    validation.check_scale_option(scale)
    select_implementation(implementation)
    validation.check_mesh_axes(mesh, seq_axis, batch_axis, head_axis)
    layouts.check_layout(layout)
    attention_fn = block_sparse_attention if attention_fn is None else attention_fn
    options = (("block_size", block_size), ("pattern", pattern), ("scale", scale),
               ("implementation", implementation))
    return AttentionCore("block_sparse", attention_fn, options, mesh, seq_axis, batch_axis,
                         head_axis, layout)


# ----------------------------------------------------------------------- heads, params


def xavier_normal(gain: float, in_axis, out_axis):
    """Xavier (Glorot) normal with ``gain``: std ``gain * sqrt(2 / (fan_in + fan_out))``."""
    return jax.nn.initializers.variance_scaling(gain ** 2, "fan_avg", "normal",
                                                in_axis=in_axis, out_axis=out_axis)


class ParamSpec(NamedTuple):
    """One parameter: ``name`` inside its group, ``shape``, ``init(key, shape, dtype)``,
    logical sharding ``axes`` (one name per dimension)."""

    name: str
    shape: tuple
    init: Callable
    axes: tuple


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    """Validated multi-head options (see the layers' docstrings)."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    use_bias: bool = True
    layer_norm: bool = True
    layer_norm_eps: float = 1e-5
    gamma_init: float = 1.0

    @classmethod
    def create(cls, embed_dim, num_heads, num_kv_heads=None, *, use_bias=True,
               layer_norm=True, layer_norm_eps=1e-5, gamma_init=1.0):
        embed_dim = validation.check_positive_int("embed_dim", embed_dim)
        num_heads = validation.check_positive_int("num_heads", num_heads)
        num_kv_heads = validation.check_positive_int(
            "num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} "
                f"and num_heads={num_heads}.")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads must be divisible by num_kv_heads (grouped-query attention), "
                f"got num_heads={num_heads} and num_kv_heads={num_kv_heads}.")
        layer_norm_eps = validation.check_positive_float("layer_norm_eps", layer_norm_eps)
        gamma_init = validation.check_positive_float("gamma_init", gamma_init)
        use_bias = validation.check_flag("use_bias", use_bias)
        layer_norm = validation.check_flag("layer_norm", layer_norm)
        return cls(embed_dim, num_heads, num_kv_heads, use_bias, layer_norm,
                   float(layer_norm_eps), float(gamma_init))

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def check_core(self, core: AttentionCore):
        """Combinations of heads and attention that cannot work, caught at construction."""
        opts = dict(core.options)
        if opts.get("mode") == "head_groups":
            branch_plans.head_groups(self.num_heads, len(opts["segment_lengths"]))
        if core.head_axis is not None:
            size = core.mesh.shape[core.head_axis]
            if self.num_heads % size or self.num_kv_heads % size:
                raise ValueError(
                    f"head_axis={core.head_axis!r} has {size} devices: num_heads "
                    f"({self.num_heads}) and num_kv_heads ({self.num_kv_heads}) must both "
                    f"be divisible by it.")


def param_specs(cfg: HeadsConfig) -> dict[str, tuple[ParamSpec, ...]]:
    """The parameters of a multi-head layer, by group (``query``, ``key``, ``value``,
    ``out``, ``sub_ln``), in creation order.

    Projections are Xavier-normal with gain 1 (query, key) or ``gamma_init`` (value,
    out), as LongNet / MAGNETO prescribe; biases are zero; the sub-LayerNorm starts at
    scale 1, bias 0. Kernel shapes: ``query`` [embed, heads, head_dim], ``key`` /
    ``value`` [embed, kv_heads, head_dim], ``out`` [heads, head_dim, embed].
    """
    e, h, hkv, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    zeros, ones = jax.nn.initializers.zeros, jax.nn.initializers.ones

    def proj(heads, heads_axis, gain):
        specs = [ParamSpec("kernel", (e, heads, d), xavier_normal(gain, 0, (1, 2)),
                           (EMBED, heads_axis, HEAD_DIM))]
        if cfg.use_bias:
            specs.append(ParamSpec("bias", (heads, d), zeros, (heads_axis, HEAD_DIM)))
        return tuple(specs)

    out = [ParamSpec("kernel", (h, d, e), xavier_normal(cfg.gamma_init, (0, 1), 2),
                     (HEADS, HEAD_DIM, EMBED))]
    if cfg.use_bias:
        out.append(ParamSpec("bias", (e,), zeros, (EMBED,)))
    groups = {"query": proj(h, HEADS, 1.0), "key": proj(hkv, KV_HEADS, 1.0),
              "value": proj(hkv, KV_HEADS, cfg.gamma_init)}
    if cfg.layer_norm:
        groups["sub_ln"] = (ParamSpec("scale", (h, d), ones, (HEADS, HEAD_DIM)),
                            ParamSpec("bias", (h, d), zeros, (HEADS, HEAD_DIM)))
    groups["out"] = tuple(out)
    return groups


# ---------------------------------------------------------------------- forward pass


def _promote(dtype, *xs):
    """Cast arrays to ``dtype`` (default: their common result type), as flax does."""
    dtype = jnp.result_type(*xs) if dtype is None else dtype
    return [jnp.asarray(x, dtype) for x in xs]


def _dense(group, x, subscripts, dtype, precision):
    kernel = group["kernel"]
    bias = group.get("bias")
    if bias is None:
        x, kernel = _promote(dtype, x, kernel)
    else:
        x, kernel, bias = _promote(dtype, x, kernel, bias)
    y = jnp.einsum(subscripts, x, kernel, precision=precision)
    return y if bias is None else y + bias


def project_qkv(params, query, key, value, *, dtype=None, precision=None):
    """``[B, T, E]`` inputs -> q ``[B, T, H, D]``, k / v ``[B, T, Hkv, D]``."""
    sub = "bte,ehd->bthd"
    return (_dense(params["query"], query, sub, dtype, precision),
            _dense(params["key"], key, sub, dtype, precision),
            _dense(params["value"], value, sub, dtype, precision))


def _sub_layer_norm(group, x, eps, dtype):
    """LayerNorm over the joint (heads, head_dim) features of ``x`` [B, T, H, D]."""
    x, scale, bias = _promote(dtype, x, group["scale"], group["bias"])
    stats = softmax.stats_dtype(x.dtype)
    xs = x.astype(stats)
    mean = jnp.mean(xs, axis=(-2, -1), keepdims=True)
    var = jnp.mean(jnp.square(xs - mean), axis=(-2, -1), keepdims=True)
    y = ((xs - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return y * scale + bias


def project_out(params, cfg: HeadsConfig, attn, *, dtype=None, precision=None):
    """Attention output ``[B, T, H, D]`` -> (sub-LayerNorm) -> ``[B, T, E]``."""
    if cfg.layer_norm:
        attn = _sub_layer_norm(params["sub_ln"], attn, cfg.layer_norm_eps, dtype)
    return _dense(params["out"], attn, "bthd,hde->bte", dtype, precision)


# ------------------------------------------------------------------ q/k transform


def check_qk_transform(fn):
    """``qk_transform`` is None or a callable ``(q, k, positions) -> (q, k)``."""
    if fn is not None and not callable(fn):
        raise TypeError(
            f"qk_transform must be None or a callable (q, k, positions) -> (q, k), got "
            f"{type(fn).__name__}.")
    return fn


def apply_qk_transform(fn, q, k, start=0):
    """``fn(q, k, positions)`` for the projected ``q`` [B, T, H, D] and ``k``
    [B, T, Hkv, D] of tokens at absolute positions ``start + arange(T)`` (int32
    [T]; ``start`` is the cache index when decoding), e.g. rotary embeddings.
    Returns ``(q, k)`` unchanged when ``fn`` is None."""
    if fn is None:
        return q, k
    positions = jnp.asarray(start, jnp.int32) + jnp.arange(q.shape[1], dtype=jnp.int32)
    out = fn(q, k, positions)
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and tuple(out[0].shape) == tuple(q.shape)
            and tuple(out[1].shape) == tuple(k.shape)):
        got = ([tuple(getattr(x, "shape", ())) for x in out]
               if isinstance(out, (tuple, list)) else type(out).__name__)
        raise ValueError(
            f"qk_transform must return (q, k) with the shapes it received, "
            f"{tuple(q.shape)} and {tuple(k.shape)}, got {got}.")
    return tuple(out)


# ---------------------------------------------------------------------------- decoding


def layer_decode_step(core: AttentionCore, cache: decoding.KVCache, q, k, v, *, kv_mask,
                      dropout_rng, precision):
    """A decoding step of a layer: ``(attn [B, n, H, D], new cache)`` for ``n`` new
    tokens (one, or a prompt; see :func:`jax_dilated.ops.decode.decode_tokens`). Decoding
    is causal, on one device, without dropout or padding mask."""
    if core.kind != "dilated":
        raise ValueError(
            "decode=True is available for dilated attention layers; ring attention is "
            "for training and prefill over a mesh.")
    if core.fn is not dilated_attention:
        raise ValueError(
            "decode=True computes the layer's dilated attention with "
            "jd.dilated_attention_decode and cannot use a custom attention_fn.")
    if kv_mask is not None:
        raise ValueError("decode=True takes no kv_mask: every cached token is attended to.")
    if dropout_rng is not None:
        raise ValueError("decoding runs without dropout: pass deterministic=True.")
    with precision_context(precision):
        return decoding.decode_tokens(cache, q, k, v, **dict(core.options))
