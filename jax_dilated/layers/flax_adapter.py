"""Drop-in ``attention_fn`` for Flax attention layers.

:func:`attention_fn` returns dilated attention with the call signature of
``flax.nnx.dot_product_attention`` / ``flax.linen.dot_product_attention``, for
``nnx.MultiHeadAttention(attention_fn=...)`` and
``nn.MultiHeadDotProductAttention(attention_fn=...)``; Flax's mask is split into
causality and key/query padding (anything else is refused).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.layers import common

__all__ = ["attention_fn"]


class _MaskParts(NamedTuple):
    kv_mask: jax.Array   # [B, T] keys some query may attend to
    q_valid: jax.Array   # [B, T] queries with at least one key
    has_future: jax.Array  # scalar: some query may attend to a later key
    mask: jax.Array      # [B, T, T] the mask itself (bool)


def _mask_parts(mask, batch: int, seq_len: int, xp):
    """Split a bool flax mask into key padding, query padding and causality (``xp``: np
    for a mask known at trace time, jnp for a traced one)."""
    m = xp.broadcast_to(mask[:, 0], (batch, seq_len, seq_len))
    future = xp.triu(xp.ones((seq_len, seq_len), bool), 1)
    return _MaskParts(xp.any(m, axis=1), xp.any(m, axis=2), xp.any(m & future), m)


def _expected(parts: _MaskParts, causal, xp):
    """The mask that (kv_mask, q_valid, causal) represent: [B, T, T]."""
    m = parts.q_valid[:, :, None] & parts.kv_mask[:, None, :]
    if causal:
        m = m & xp.tril(xp.ones(m.shape[1:], bool))
    return m


def _check_mask_shape(mask, batch: int, seq_len: int):
    shape = tuple(getattr(mask, "shape", ()))
    ok = (len(shape) == 4 and shape[0] in (1, batch) and shape[1] == 1
          and shape[2] in (1, seq_len) and shape[3] == seq_len)
    if not ok:
        raise ValueError(
            f"jd.attention_fn takes a mask of shape [batch or 1, 1, q_len or 1, kv_len] = "
            f"[{batch}, 1, {seq_len}, {seq_len}] (e.g. from nnx.make_causal_mask, "
            f"nnx.make_attention_mask or their combine_masks), got {shape}: per-head "
            f"masks and other ranks are not supported.")


def attention_fn(*, segment_lengths, dilation_rates, mode: str = "longnet",
                 head_offsets: str = "modulo", scale: float | None = None,
                 is_causal: bool | None = None, implementation: str | None = None,
                 mesh=None, seq_axis: str | None = None, batch_axis: str | None = None,
                 head_axis: str | None = None, block_q: int | None = None,
                 block_k: int | None = None):
    """A drop-in ``attention_fn`` running dilated attention inside Flax attention layers.

    One line turns a Flax layer into dilated attention::

        nnx.MultiHeadAttention(..., attention_fn=jd.attention_fn(
            segment_lengths=(2048, 4096), dilation_rates=(1, 2)))
        nn.MultiHeadDotProductAttention(..., attention_fn=jd.attention_fn(...))

    The layer's projected ``query`` / ``key`` / ``value`` [batch, seq, heads,
    head_dim] go through :func:`jax_dilated.dilated_attention` (sequence-parallel
    with ``mesh`` / ``seq_axis``), so the layer's output equals dilated attention on
    its projections.

    Masks. Dilated attention takes causality and a key padding mask, not arbitrary
    masks, so the layer's ``mask`` must be one of, shaped [batch or 1, 1, q_len or 1,
    kv_len] (bool or 0/1 float):

    * a causal mask (``make_causal_mask``) -> ``is_causal=True``;
    * a padding mask (``make_attention_mask(q_valid, kv_valid)``) -> ``kv_mask``;
    * both combined (``combine_masks``).

    Key padding is read as "some query may attend to the key", query padding as
    "the query may attend to some key"; padded query rows output zeros. Causality is
    ``is_causal`` if given here, else inferred from the mask (no query may attend to
    a later key); the layer's ``is_causal=True`` overlays a causal mask, as in Flax.
    A mask of any other structure (sliding window, per-head, block masks) cannot be
    represented: eagerly that raises ``ValueError``; under ``jax.jit`` (mask traced)
    the output is NaN instead of a silently wrong number. With an inferred causality
    and a traced mask both variants are compiled and the mask picks one at run time
    (``lax.cond``); pass ``is_causal`` to compile one.

    Args:
      segment_lengths, dilation_rates, mode, head_offsets, scale, implementation,
        block_q, block_k: as in :func:`jax_dilated.dilated_attention`.
      is_causal: True / False to fix causality, None to infer it from the mask.
      mesh, seq_axis, batch_axis, head_axis: run sequence-parallel over ``mesh``.

    Returns:
      ``fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
      dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
      precision=None, module=None, is_causal=False, ...)`` returning [batch, seq,
      heads, head_dim]. Not supported, with a ``ValueError``: ``bias``, ``module``
      (``sow_weights``), custom einsums, broadcast dropout (build the Flax layer with
      ``broadcast_dropout=False`` to use dropout), and Flax's ``decode`` cache (use
      :class:`jax_dilated.nnx.MultiheadDilatedAttention` for decoding).

    Example:
      >>> import jax, jax.numpy as jnp, jax_dilated as jd
      >>> from flax import nnx
      >>> mha = nnx.MultiHeadAttention(
      ...     num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0),
      ...     attention_fn=jd.attention_fn(segment_lengths=(8, 32), dilation_rates=(1, 2)))
      >>> x = jnp.ones((1, 32, 16))
      >>> run = nnx.jit(lambda m, x: m(x, mask=nnx.make_causal_mask(jnp.ones((1, 32)))))
      >>> run(mha, x).shape
      (1, 32, 16)
    """
    core = common.dilated_core(
        segment_lengths=segment_lengths, dilation_rates=dilation_rates, mode=mode,
        head_offsets=head_offsets, scale=scale, implementation=implementation,
        mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, head_axis=head_axis,
        block_q=block_q, block_k=block_k)
    if is_causal not in (None, True, False):
        raise TypeError(f"is_causal must be None, True or False, got {is_causal!r}.")
    fixed_causal = is_causal

    def dilated_attention_fn(query, key, value, bias=None, mask=None,
                             broadcast_dropout: bool = True, dropout_rng=None,
                             dropout_rate: float = 0.0, deterministic: bool = False,
                             dtype=None, precision=None, module=None,
                             is_causal: bool = False, force_fp32_for_softmax: bool = False,
                             qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
        """Dilated attention with Flax's ``attention_fn`` signature.

        query, key, value: [batch, seq, heads, head_dim] (kv heads may be fewer);
        mask: None or [batch or 1, 1, seq or 1, seq] causal and/or padding mask (see
        :func:`jax_dilated.attention_fn`). Returns [batch, seq, heads, head_dim].
        """
        del force_fp32_for_softmax  # softmax statistics are always float32 or wider
        if bias is not None:
            raise ValueError("jd.attention_fn takes no additive bias (got bias of shape "
                             f"{tuple(bias.shape)}); express padding and causality as a mask.")
        if module is not None:
            raise ValueError("jd.attention_fn cannot sow attention weights (sow_weights=True): "
                             "dilated attention never materialises them.")
        if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
            raise ValueError("jd.attention_fn does not take custom attention einsums.")
        for name, x in (("query", query), ("key", key)):
            if getattr(x, "ndim", None) != 4:
                raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape "
                                 f"{getattr(x, 'shape', None)}.")
        b, t = query.shape[:2]
        if key.shape[1] != t:
            hint = (" (this looks like Flax's decode cache: decode with "
                    "jd.nnx.MultiheadDilatedAttention instead)" if t == 1 else "")
            raise ValueError(
                f"dilated attention is self-attention over one sequence: query length {t} "
                f"!= key length {key.shape[1]}{hint}.")
        dropout_on = dropout_rate > 0.0 and not deterministic
        if dropout_on and broadcast_dropout:
            raise ValueError(
                "jd.attention_fn draws dropout independently per batch row and head: build "
                "the Flax layer with broadcast_dropout=False to use attention dropout.")
        if dtype is not None:
            query, key, value = (x.astype(dtype) for x in (query, key, value))
        causal = True if (is_causal or fixed_causal) else fixed_causal  # None = infer

        def run(causal_flag, kv_mask):
            with common.precision_context(precision):
                return core(query, key, value, is_causal=causal_flag, kv_mask=kv_mask,
                            dropout_rate=dropout_rate if dropout_on else 0.0,
                            dropout_rng=dropout_rng if dropout_on else None)

        if mask is None:
            return run(bool(causal), None)
        _check_mask_shape(mask, b, t)
        concrete = not isinstance(mask, jax.core.Tracer)
        xp = np if concrete else jnp
        mask = xp.asarray(mask)
        mask = mask if mask.dtype == bool else mask != 0
        if causal:  # a causal overlay, as Flax applies is_causal on top of the mask
            mask = mask & xp.tril(xp.ones((t, t), bool))
        if concrete:
            return _with_concrete_mask(mask, causal, b, t, run)
        parts = _mask_parts(mask, b, t, jnp)
        if causal is None:
            out = jax.lax.cond(parts.has_future, lambda: run(False, parts.kv_mask),
                               lambda: run(True, parts.kv_mask))
            consistent = jnp.all(parts.mask == jnp.where(
                parts.has_future, _expected(parts, False, jnp), _expected(parts, True, jnp)))
        else:
            out = run(causal, parts.kv_mask)
            consistent = jnp.all(parts.mask == _expected(parts, causal, jnp))
        out = jnp.where(parts.q_valid[:, :, None, None], out, jnp.zeros((), out.dtype))
        return jnp.where(consistent, out, jnp.asarray(jnp.nan, out.dtype))

    return dilated_attention_fn


def _with_concrete_mask(mask: np.ndarray, causal, b: int, t: int, run):
    """A mask known at trace time: decide causality in Python and check it exactly."""
    parts = _mask_parts(mask, b, t, np)
    if causal is None:
        causal = not bool(parts.has_future)
    if not np.array_equal(parts.mask, _expected(parts, causal, np)):
        raise ValueError(
            "jd.attention_fn: the mask is not a causal and/or padding mask (it is not "
            "q_valid[p] & kv_valid[t]" + (" & (t <= p)" if causal else "") + " for any "
            "padding), so dilated attention cannot apply it. Use make_causal_mask / "
            "make_attention_mask / combine_masks, or pass is_causal= to jd.attention_fn.")
    out = run(causal, jnp.asarray(parts.kv_mask))
    return jnp.where(jnp.asarray(parts.q_valid)[:, :, None, None], out,
                     jnp.zeros((), out.dtype))
