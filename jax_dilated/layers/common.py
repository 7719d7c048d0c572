"""What the NNX and Linen layers share: the attention core and decoding.

The layers in :mod:`jax_dilated.nnx` and :mod:`jax_dilated.linen` differ only in
how they hold parameters, caches and random keys. Everything else lives here, once:

* :class:`AttentionCore` - the static attention configuration of a layer (dilated or
  ring, on one device or sequence-parallel over a mesh) and the call that runs it;
* decoding through a layer (:func:`layer_decode_step`).

Parameters and projections: :mod:`jax_dilated.layers.projections`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import jax

from jax_dilated import block_patterns
from jax_dilated.backends import select_implementation
from jax_dilated.core import branch_plans, layouts, validation
from jax_dilated.core.types import Layout, StrategyLike
from jax_dilated.ops import decode as decoding
from jax_dilated.ops.block_sparse import block_sparse_attention
from jax_dilated.ops.dilated import dilated_attention
from jax_dilated.ops.ring import ring_attention
from jax_dilated.ops.sharded import sharded
from jax_dilated.ops.strategies import check_sharded_strategy

__all__ = [
    "AttentionCore",
    "dilated_core",
    "ring_core",
    "block_sparse_core",
    "check_inputs",
    "precision_context",
    "check_decode_segment_ids",
    "check_sinks_flag",
    "check_mesh_scores",
    "mesh_strategy",
    "layer_decode_step",
]


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


def mesh_strategy(seq_axis, strategy=None) -> StrategyLike:
    """The ``strategy`` of a mesh-built layer: as given, or, where the caller left it
    unset (None), ``"hybrid"`` for a pair ``seq_axis=(a, b)`` (heads exchanged over
    ``a``, a ring over ``b``; the only strategy, with ``"auto"``, that runs two axes,
    docs/semantics.md section 8, "Hybrid") and ``"ring"`` for one axis (the layers'
    default). Used by the layer factory and :class:`jax_dilated.models.LongNetLM`."""
    if strategy is not None:
        return strategy
    return "hybrid" if isinstance(seq_axis, (tuple, list)) else "ring"


# ----------------------------------------------------------------------- attention core


@dataclasses.dataclass(frozen=True)
class AttentionCore:
    """The static attention of a layer and how to run it.

    kind: ``"dilated"`` (:func:`jax_dilated.dilated_attention`), ``"ring"``
      (exact attention, :func:`jax_dilated.ring_attention`) or ``"block_sparse"``
      (:func:`jax_dilated.block_sparse_attention`).
    fn: the attention function (the default or a user's drop-in with its signature).
    options: its static keyword arguments (segment lengths, mode, scale, ...).
    mesh, seq_axis, batch_axis, head_axis, layout, strategy: with a mesh, ``fn`` runs
      sequence-parallel on global arrays through :func:`jax_dilated.sharded`
      (``strategy``: ``"ring"``, ``"allgather"``, ``"heads"`` or ``"auto"``; for
      dilated attention also a tuple with one of the first three per branch; with
      ``seq_axis=(a, b)``, two mesh axes, ``"hybrid"`` or ``"auto"``, which picks it:
      the sequence sharded ``b``-major over both, heads exchanged over ``a``, a ring
      over ``b``, docs/semantics.md section 8, "Hybrid").
    """

    kind: str
    fn: Callable
    options: tuple
    mesh: Any = None
    seq_axis: str | tuple[str, str] | None = None
    batch_axis: str | None = None
    head_axis: str | None = None
    layout: Layout = "contiguous"
    strategy: StrategyLike = "ring"

    @property
    def has_dropout(self) -> bool:
        return self.kind == "dilated"

    def __call__(self, query, key, value, *, is_causal=False, kv_mask=None,
                 segment_ids=None, dropout_rate=0.0, dropout_rng=None, sinks=None):
        """``[batch, seq, heads, head_dim]`` in, the same out (see the attention fn).

        ``segment_ids`` (int ``[batch, seq]``, packed documents) and ``sinks`` (float
        ``[heads]``, per-head sink logits) reach the attention function only when
        given, so a drop-in ``attention_fn`` without those keywords still serves the
        calls that do not use them. Over a mesh the sinks go to
        :func:`jax_dilated.sharded` as an argument (replicated, with their gradient)."""
        kw = dict(self.options, is_causal=is_causal)
        if self.has_dropout:
            kw.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
        segment_ids = validation.check_segment_ids(segment_ids, query.shape, key.shape)
        per_call = {} if segment_ids is None else {"segment_ids": segment_ids}
        if sinks is not None:
            per_call["sinks"] = sinks
        check_mesh_scores(self, sinks is not None)
        if self.mesh is None:
            return self.fn(query, key, value, kv_mask=kv_mask, **per_call, **kw)
        # sinks are an argument of the sharded call, not bound here: closed over inside
        # shard_map they would not differentiate on Explicit meshes
        run = sharded(functools.partial(self.fn, **kw), self.mesh, seq_axis=self.seq_axis,
                      batch_axis=self.batch_axis, head_axis=self.head_axis,
                      layout=self.layout, strategy=self.strategy)
        return run(query, key, value, kv_mask=kv_mask, **per_call)


def _block_options(block_q, block_k) -> tuple:
    """``block_q`` / ``block_k`` options, only those given (a user's drop-in
    ``attention_fn`` need not take them)."""
    block_q, block_k = validation.check_block_sizes(block_q, block_k)
    return tuple((name, b) for name, b in (("block_q", block_q), ("block_k", block_k))
                 if b is not None)


def _score_options(window=None, logit_soft_cap=None) -> tuple:
    """``window`` / ``logit_soft_cap`` options, validated, only those given (a user's
    drop-in ``attention_fn`` need not take them). Whether ``window`` fits the call's
    causality (``right == 0`` when causal) is checked by the call."""
    window = validation.check_window(window)
    logit_soft_cap = validation.check_logit_soft_cap(logit_soft_cap)
    return tuple((name, x) for name, x in (("window", window),
                                           ("logit_soft_cap", logit_soft_cap))
                 if x is not None)


def dilated_core(*, segment_lengths, dilation_rates, mode="longnet", head_offsets="modulo",
                 scale=None, implementation=None, attention_fn=None, mesh=None,
                 seq_axis=None, batch_axis=None, head_axis=None, block_q=None,
                 block_k=None, strategy="ring", logit_soft_cap=None) -> AttentionCore:
    """Validated :class:`AttentionCore` for dilated attention.

    ``attention_fn`` (default :func:`jax_dilated.dilated_attention`) is called as
    ``attention_fn(q, k, v, segment_lengths=, dilation_rates=, mode=, head_offsets=,
    scale=, implementation=, is_causal=, kv_mask=, dropout_rate=, dropout_rng=)``
    (plus ``block_q=`` / ``block_k=`` / ``logit_soft_cap=`` / ``sinks=`` when given)
    and, with a mesh, also receives ``seq_axis=`` inside ``shard_map``. A sliding
    window is a branch of ``segment_lengths`` (``jd.SlidingWindow``).
    """
    branches = branch_plans.validate_branches(segment_lengths, dilation_rates)
    branch_plans.check_mode(mode, head_offsets)
    validation.check_scale_option(scale)
    select_implementation(implementation)
    validation.check_mesh_axes(mesh, seq_axis, batch_axis, head_axis)
    attention_fn = dilated_attention if attention_fn is None else attention_fn
    options = (("segment_lengths", tuple(w for w, _ in branches)),
               ("dilation_rates", tuple(r for _, r in branches)), ("mode", mode),
               ("head_offsets", head_offsets), ("scale", scale),
               ("implementation", implementation)) + _block_options(
                   block_q, block_k) + _score_options(logit_soft_cap=logit_soft_cap)
    return AttentionCore("dilated", attention_fn, options, mesh, seq_axis, batch_axis,
                         head_axis, strategy=check_sharded_strategy(strategy))


def ring_core(*, mesh, seq_axis, layout="contiguous", batch_axis=None, head_axis=None,
              scale=None, implementation=None, attention_fn=None, block_q=None,
              block_k=None, strategy="ring", window=None,
              logit_soft_cap=None) -> AttentionCore:
    """Validated :class:`AttentionCore` for ring (exact, sequence-parallel) attention.

    ``attention_fn`` (default :func:`jax_dilated.ring_attention`) is called inside
    ``shard_map`` as ``attention_fn(q, k, v, seq_axis=, layout=, kv_mask=, is_causal=,
    scale=, implementation=)`` (plus ``block_q=`` / ``block_k=`` / ``window=`` /
    ``logit_soft_cap=`` / ``sinks=`` when given).
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
        block_q, block_k) + _score_options(window, logit_soft_cap)
    return AttentionCore("ring", attention_fn, options, mesh, seq_axis, batch_axis,
                         head_axis, layout, check_sharded_strategy(strategy))


def block_sparse_core(*, block_size, pattern, scale=None, implementation=None,
                      attention_fn=None, mesh=None, seq_axis=None, layout="contiguous",
                      batch_axis=None, head_axis=None, strategy="ring", window=None,
                      logit_soft_cap=None) -> AttentionCore:
    """Validated :class:`AttentionCore` for block-sparse attention.

    ``attention_fn`` (default :func:`jax_dilated.block_sparse_attention`) is called as
    ``attention_fn(q, k, v, block_size=, pattern=, scale=, implementation=,
    is_causal=, kv_mask=)`` (plus ``window=`` / ``logit_soft_cap=`` / ``sinks=`` when
    given) and, with a mesh (a ring over ``seq_axis`` in
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
               ("implementation", implementation)) + _score_options(window, logit_soft_cap)
    return AttentionCore("block_sparse", attention_fn, options, mesh, seq_axis, batch_axis,
                         head_axis, layout, check_sharded_strategy(strategy))


def check_sinks_flag(sinks, core: AttentionCore) -> bool:
    """A multi-head layer's ``sinks`` option, a Python bool (True: a learnable
    ``[num_heads]`` sink logit per head), checked against the core's mesh options
    (:func:`check_mesh_scores`)."""
    if not isinstance(sinks, bool):
        raise TypeError(
            f"sinks must be a Python bool (True: a learnable [num_heads] sink logit per "
            f"head), got {type(sinks).__name__} {getattr(sinks, 'shape', sinks)!r}; for "
            f"fixed sink logits call the attention function with sinks=.")
    check_mesh_scores(core, sinks)
    return sinks


def check_mesh_scores(core: AttentionCore, sinks: bool = False):
    """Over a mesh, ``window`` / ``logit_soft_cap`` / sinks of exact and block-sparse
    attention reach the attention function only through the operation's own ring:
    ``strategy="allgather"`` and ``"heads"`` rebuild the operation from its plain
    options and refuse them (:func:`jax_dilated.ops.strategies.servable`; ``"auto"``
    then picks the ring). ValueError at construction for those two strategies (and at
    the call for the call's ``sinks``). The library's dilated attention runs every
    strategy itself and carries them all."""
    if (core.mesh is None or core.strategy not in ("allgather", "heads")
            or (core.kind == "dilated" and core.fn is dilated_attention)):
        return
    given = [name for name, _ in core.options if name in ("window", "logit_soft_cap")]
    given += ["sinks"] if sinks else []
    if given:
        raise ValueError(
            f"{' / '.join(given)} over a mesh run with strategy='ring' (or 'auto', which "
            f"picks it) only, got strategy={core.strategy!r} (the other strategies do "
            f"not carry them yet).")


# ---------------------------------------------------------------------------- decoding


def check_decode_segment_ids(segment_ids):
    """Decoding continues one document per batch row: ``segment_ids`` must be None."""
    if segment_ids is not None:
        raise ValueError(
            f"decode=True takes no segment_ids (got shape "
            f"{tuple(getattr(segment_ids, 'shape', ()))}): decoding continues one document "
            f"per batch row (the KV cache holds one sequence); run packed rows with "
            f"decode=False.")


def layer_decode_step(core: AttentionCore, cache: decoding.KVCache, q, k, v, *, kv_mask,
                      dropout_rng, precision, sinks=None):
    """A decoding step of a layer: ``(attn [B, n, H, D], new cache)`` for ``n`` new
    tokens (one, or a prompt; see :func:`jax_dilated.ops.decode.decode_tokens`). Decoding
    is causal, on one device, without dropout, padding mask or packed documents."""
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
    extra = {} if sinks is None else {"sinks": sinks}
    with precision_context(precision):
        return decoding.decode_tokens(cache, q, k, v, **dict(core.options), **extra)
