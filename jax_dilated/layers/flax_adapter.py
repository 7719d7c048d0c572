"""Drop-in ``attention_fn`` for Flax attention layers.

:func:`attention_fn` returns dilated attention with the call signature of
``flax.nnx.dot_product_attention`` / ``flax.linen.dot_product_attention``, for
``nnx.MultiHeadAttention(attention_fn=...)`` and
``nn.MultiHeadDotProductAttention(attention_fn=...)``. It takes Flax's shapes
(``[batch..., length, heads, head_dim]``, any number of leading batch dimensions or
none: they are flattened into one and restored), and splits Flax's mask into
causality and key/query padding, and with ``packed=True`` packed documents too
(anything else is refused).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.core.arrays import take_rows
from jax_dilated.core.types import (Array, ArrayLike, HeadOffsets, Implementation, Mode,
                                    SegmentLengths)
from jax_dilated.core.validation import (check_dropout, check_dropout_rate, check_flag,
                                         check_sinks)
from jax_dilated.layers import common

__all__ = ["attention_fn"]


# ------------------------------------------------------------- Flax's shape convention


def _batch_shape(query, key, value) -> tuple:
    """The leading batch dimensions of Flax's ``[batch..., length, heads, head_dim]``
    query/key/value (possibly ``()``), after checking that the three agree."""
    shapes = tuple(tuple(getattr(x, "shape", ())) for x in (query, key, value))
    described = f"query {shapes[0]}, key {shapes[1]}, value {shapes[2]}"
    for name, x in zip(("query", "key", "value"), (query, key, value)):
        if not hasattr(x, "shape") or x.ndim < 3:
            raise ValueError(
                f"{name} must be [batch..., length, heads, head_dim] (rank 3 or more), "
                f"got {described}.")
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(f"query, key and value must have the same rank, got {described}.")
    if not shapes[0][:-3] == shapes[1][:-3] == shapes[2][:-3]:
        raise ValueError(f"query, key and value batch dims must match, got {described}.")
    if shapes[1][-3] != shapes[2][-3]:
        raise ValueError(f"key and value lengths must match, got {described}.")
    if shapes[0][-1] != shapes[1][-1]:
        raise ValueError(f"query and key depths must match, got {described}.")
    return shapes[0][:-3]


def _flatten(x, batch: int):
    """``[batch..., length, heads, d]`` -> ``[batch, length, heads, d]``."""
    return x.reshape((batch,) + tuple(x.shape[-3:]))


def _flatten_mask(mask, batch_shape: tuple, heads: int, seq_len: int):
    """Flax's mask, broadcastable to ``[batch..., heads, q_len, kv_len]``, as
    ``[batch or 1, heads or 1, q_len or 1, kv_len or 1]`` (numpy if it is concrete)."""
    shape = tuple(getattr(mask, "shape", ()))
    full = batch_shape + (heads, seq_len, seq_len)
    padded = (1,) * (len(full) - len(shape)) + shape
    if not (hasattr(mask, "shape") and len(shape) <= len(full)
            and all(m in (1, n) for m, n in zip(padded, full))):
        raise ValueError(
            f"mask must broadcast to [batch..., heads, q_len, kv_len] = {list(full)}, "
            f"got shape {shape}.")
    concrete = not isinstance(mask, jax.core.Tracer)
    xp = np if concrete else jnp
    mask = xp.reshape(xp.asarray(mask), padded)
    nb = len(batch_shape)
    if any(m != 1 for m in padded[:nb]):
        mask = xp.broadcast_to(mask, batch_shape + padded[nb:])
    return mask.reshape((math.prod(mask.shape[:nb]),) + padded[nb:])


# ---------------------------------------------------------------------- mask structure


class _MaskParts(NamedTuple):
    kv_mask: jax.Array   # [B, T] keys some query may attend to
    q_valid: jax.Array   # [B, T] queries with at least one key
    has_future: jax.Array  # scalar: some query may attend to a later key
    mask: jax.Array      # [B, T, T] the mask itself (bool)
    same_heads: jax.Array  # scalar: every head has the same mask
    documents: jax.Array | None  # int32 [B, T] document start of each token (packed)


def _take_rows(x, idx, xp):
    """``take_along_axis(x, idx, axis=1)`` of [B, T] arrays (traced: as flat indices,
    :func:`jax_dilated.core.arrays.take_rows`)."""
    return np.take_along_axis(x, idx, axis=1) if xp is np else take_rows(x, idx)


def _cummax(x, xp):
    """Running maximum along axis 1."""
    return np.maximum.accumulate(x, axis=1) if xp is np else jax.lax.cummax(x, axis=1)


def _documents(m, q_valid, kv_valid, xp):
    """The packed documents a [B, T, T] mask describes, as each token's document start
    (int32 [B, T]; a document is a run of consecutive tokens).

    Every query that attends to something attends to its document's first visible key
    (causal or not), which names the document; a key that only padded queries skip is
    named through the first query attending to it; a token that neither attends nor is
    attended to joins the document before it. Whether the mask really is this
    document mask is checked by the caller (:func:`_expected`)."""
    t = m.shape[-1]
    idx = xp.arange(t)[None, :]
    first_key = xp.argmax(m, axis=2)
    via_query = _take_rows(first_key, xp.argmax(m, axis=1), xp)
    label = xp.where(q_valid, first_key, xp.where(kv_valid, via_query, -1))
    last = _cummax(xp.where(label >= 0, idx, -1), xp)  # last named token at or before
    label = xp.where(last >= 0, _take_rows(label, xp.maximum(last, 0), xp), -1)
    starts = xp.concatenate([xp.ones_like(label[:, :1], bool), label[:, 1:] != label[:, :-1]],
                            axis=1)
    return _cummax(xp.where(starts, idx, 0), xp).astype(xp.int32)


def _mask_parts(mask, batch: int, seq_len: int, xp, packed: bool = False):
    """Split a bool [B or 1, heads or 1, T or 1, T or 1] mask into key padding, query
    padding, causality and (``packed``) documents (``xp``: np for a mask known at
    trace time, jnp for a traced one)."""
    m = xp.broadcast_to(mask[:, 0], (batch, seq_len, seq_len))
    future = xp.triu(xp.ones((seq_len, seq_len), bool), 1)
    same_heads = xp.all(mask == mask[:, :1])
    kv_mask, q_valid = xp.any(m, axis=1), xp.any(m, axis=2)
    documents = _documents(m, q_valid, kv_mask, xp) if packed else None
    return _MaskParts(kv_mask, q_valid, xp.any(m & future), m, same_heads, documents)


def _expected(parts: _MaskParts, causal, xp):
    """The mask that (kv_mask, q_valid, documents, causal) represent: [B, T, T]."""
    m = parts.q_valid[:, :, None] & parts.kv_mask[:, None, :]
    if parts.documents is not None:
        m = m & (parts.documents[:, :, None] == parts.documents[:, None, :])
    if causal:
        m = m & xp.tril(xp.ones(m.shape[1:], bool))
    return m


# -------------------------------------------------------------------------- the adapter


def attention_fn(*, segment_lengths: SegmentLengths, dilation_rates: Sequence[int],
                 mode: Mode = "longnet", head_offsets: HeadOffsets = "modulo",
                 scale: float | None = None, is_causal: bool | None = None,
                 implementation: Implementation | None = None,
                 mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None,
                 batch_axis: str | None = None, head_axis: str | None = None,
                 block_q: int | None = None, block_k: int | None = None,
                 packed: bool = False, logit_soft_cap: float | None = None,
                 sinks: ArrayLike | None = None) -> Callable[..., Array]:
    """A drop-in ``attention_fn`` running dilated attention inside Flax attention layers.

    One line turns a Flax layer into dilated attention::

        nnx.MultiHeadAttention(..., attention_fn=jd.attention_fn(
            segment_lengths=(2048, 4096), dilation_rates=(1, 2)))
        nn.MultiHeadDotProductAttention(..., attention_fn=jd.attention_fn(...))

    The layer's projected ``query`` / ``key`` / ``value`` go through
    :func:`jax_dilated.dilated_attention` (sequence-parallel with ``mesh`` /
    ``seq_axis``), so the layer's output equals dilated attention on its projections.

    Shapes follow Flax: ``[batch..., length, heads, head_dim]`` with any number of
    leading batch dimensions, or none (an unbatched ``[length, heads, head_dim]``).
    The batch dimensions are flattened into one for dilated attention (which attends
    along ``length`` only) and restored on the output; ``length`` is the sequence.

    Masks. Dilated attention takes causality, a key padding mask and packed
    documents, not arbitrary masks, so the layer's ``mask`` (broadcastable to
    ``[batch..., heads, q_len, kv_len]``, bool or 0/1 float) must be one of:

    * a causal mask (``make_causal_mask``) -> ``is_causal=True``;
    * a padding mask (``make_attention_mask(q_valid, kv_valid)``) -> ``kv_mask``;
    * with ``packed=True`` only, a document mask of packed rows
      (``make_attention_mask(seg, seg, jnp.equal)``, each document a run of
      consecutive tokens) -> ``segment_ids``: dilated attention then restarts its
      segment grid at each document (docs/semantics.md, "Packed sequences");
    * these combined (``combine_masks``), the same for every head.

    Key padding is read as "some query may attend to the key", query padding as
    "the query may attend to some key"; padded query rows output zeros. Documents
    are read from the mask (a token that neither attends nor is attended to joins the
    document before it) and the mask is then checked to be exactly what they, the
    padding and causality allow. Flax layers forward no extra arguments to
    ``attention_fn``, so the mask is the only way in; the layers of
    :mod:`jax_dilated.nnx` / :mod:`jax_dilated.linen` take ``segment_ids`` directly,
    without a [T, T] mask. Causality is
    ``is_causal`` if given here, else inferred from the mask (no query may attend to
    a later key); the layer's ``is_causal=True`` overlays a causal mask, as in Flax.
    A mask of any other structure (sliding window, masks that differ between heads,
    block masks, a document mask without ``packed=True``, documents that are not
    runs of consecutive tokens) cannot be represented: eagerly that raises
    ``ValueError``; under ``jax.jit`` (mask traced) the output is NaN instead of a
    silently wrong number. With an inferred causality and a traced mask both
    variants are compiled and the mask picks one at run time (``lax.cond``); pass
    ``is_causal`` to compile one.

    Sliding windows, soft-capping, sinks (docs/semantics.md, "Sliding windows,
    soft-capping and sinks"). A sliding window is a branch of ``segment_lengths``
    (``jd.SlidingWindow(left)``, rate 1), not a mask: Flax's sliding-window masks
    are refused like any other mask it cannot represent. ``logit_soft_cap`` applies
    to every branch. Flax's ``MultiHeadAttention`` / ``MultiHeadDotProductAttention``
    have no sink parameter and pass nothing extra to ``attention_fn``, so ``sinks``
    here is a fixed array ``[num_heads]`` (a constant of the layer, not trained); for
    learnable sinks use the layers of :mod:`jax_dilated.nnx` / :mod:`jax_dilated.linen`
    with ``sinks=True``.

    Args:
      segment_lengths, dilation_rates, mode, head_offsets, scale, implementation,
        block_q, block_k, logit_soft_cap: as in :func:`jax_dilated.dilated_attention`.
      sinks: None or a float array ``[num_heads]``: fixed per-head sink logits.
      is_causal: True / False to fix causality, None to infer it from the mask.
      packed: also read packed documents from masks (static). Every masked call then
        runs packed dilated attention (``segment_ids``; one document when the mask
        has none), which costs more than the plain kernel: leave it off for rows of
        one document.
      mesh, seq_axis, batch_axis, head_axis: run sequence-parallel over ``mesh``
        (``batch_axis`` shards the flattened batch).

    Returns:
      ``fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
      dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
      precision=None, module=None, is_causal=False, promote_dtype=None, ...)`` returning
      ``[batch..., length, heads, head_dim]``. Dtypes follow Flax's
      ``dot_product_attention``: ``query``, ``key`` and ``value`` are promoted to one
      dtype (``dtype``, else their common type, made floating; NNX's
      ``promote_dtype`` hook, when passed, decides instead) and attention runs in it
      (its softmax statistics float32 or wider whatever the dtype); the output is in
      that dtype, except that with Linen's ``force_fp32_for_softmax=True`` it is
      ``promote_types(dtype, float32)`` (float32 for bfloat16 or float16 inputs), as
      Flax's float32 attention weights times ``value`` give. Not
      supported, with a ``ValueError``: ``bias``, ``module`` (``sow_weights``), custom
      einsums, key length != query length (cross-attention, Flax's ``decode`` cache:
      decode with :class:`jax_dilated.nnx.MultiheadDilatedAttention`), a value depth
      other than the key's, and broadcast dropout (build the Flax layer with
      ``broadcast_dropout=False`` to use dropout).

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
      >>> mha(jnp.ones((3, 2, 32, 16))).shape   # two batch dims (or none) also work
      (3, 2, 32, 16)
    """
    core = common.dilated_core(
        segment_lengths=segment_lengths, dilation_rates=dilation_rates, mode=mode,
        head_offsets=head_offsets, scale=scale, implementation=implementation,
        mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, head_axis=head_axis,
        block_q=block_q, block_k=block_k, logit_soft_cap=logit_soft_cap)
    if sinks is not None:
        shape = tuple(getattr(sinks, "shape", ()))
        if len(shape) != 1:
            raise ValueError(f"sinks must be None or a float array [num_heads], got shape "
                             f"{shape}.")
        sinks = check_sinks(sinks, shape[0])
    common.check_mesh_scores(core, sinks is not None)
    fixed_causal = None if is_causal is None else check_flag("is_causal", is_causal)
    packed = check_flag("packed", packed)

    def dilated_attention_fn(query, key, value, bias=None, mask=None,
                             broadcast_dropout: bool = True, dropout_rng=None,
                             dropout_rate: float = 0.0, deterministic: bool = False,
                             dtype=None, precision=None, module=None,
                             is_causal: bool = False, force_fp32_for_softmax: bool = False,
                             einsum_dot_general=None, qk_attn_weights_einsum=None,
                             attn_weights_value_einsum=None, promote_dtype=None):
        """Dilated attention with Flax's ``attention_fn`` signature.

        query, key, value: [batch..., length, heads, head_dim] (kv heads may be
        fewer; no batch dimension also works); mask: None or a causal and/or padding
        mask broadcastable to [batch..., heads, length, length] (see
        :func:`jax_dilated.attention_fn`). Returns [batch..., length, heads, head_dim].
        """
        for name, flag in (("is_causal", is_causal), ("deterministic", deterministic),
                           ("broadcast_dropout", broadcast_dropout),
                           ("force_fp32_for_softmax", force_fp32_for_softmax)):
            check_flag(name, flag)
        if bias is not None:
            raise ValueError("jd.attention_fn takes no additive bias (got bias of shape "
                             f"{tuple(bias.shape)}); express padding and causality as a mask.")
        if module is not None:
            raise ValueError("jd.attention_fn cannot sow attention weights (sow_weights=True): "
                             "dilated attention never materialises them.")
        einsums = (einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum)
        if any(e is not None for e in einsums):
            raise ValueError("jd.attention_fn does not take custom attention einsums "
                             "(einsum_dot_general, qk_attn_weights_einsum, "
                             "attn_weights_value_einsum).")
        batch_shape = _batch_shape(query, key, value)
        t, heads = query.shape[-3:-1]
        if sinks is not None and sinks.shape[0] != heads:
            raise ValueError(f"jd.attention_fn(sinks=) has {sinks.shape[0]} sink logits but "
                             f"the layer has num_heads={heads} (query {tuple(query.shape)}).")
        if key.shape[-3] != t:
            hint = (" (this looks like Flax's decode cache: decode with "
                    "jd.nnx.MultiheadDilatedAttention or jd.linen.MultiheadDilatedAttention "
                    "instead)" if t == 1 else "")
            raise ValueError(
                f"dilated attention is self-attention over one sequence: query length {t} "
                f"!= key length {key.shape[-3]}{hint}.")
        dropout_on = check_dropout_rate(dropout_rate) > 0.0 and not deterministic
        if dropout_on:
            check_dropout(dropout_rate, dropout_rng)  # a key is required
        if dropout_on and broadcast_dropout:
            raise ValueError(
                "jd.attention_fn draws dropout independently per batch row and head: build "
                "the Flax layer with broadcast_dropout=False to use attention dropout.")
        # one dtype, as in Flax (NNX's `promote_dtype` hook, given, decides instead)
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
            dtype = query.dtype
        else:
            dtype = _flax_dtype(query, key, value, dtype)
        out_dtype = _flax_output_dtype(dtype, force_fp32_for_softmax)
        b = math.prod(batch_shape)
        query, key, value = (_flatten(x, b).astype(dtype) for x in (query, key, value))
        if mask is not None:
            mask = _flatten_mask(mask, batch_shape, heads, t)
        causal = True if (is_causal or fixed_causal) else fixed_causal  # None = infer

        def run(causal_flag, kv_mask, segment_ids=None):
            with common.precision_context(precision):
                return _run_core(query, key, value, kv_mask, segment_ids, sinks,
                                 dropout_rng if dropout_on else None,
                                 core=core, is_causal=causal_flag,
                                 dropout_rate=float(dropout_rate) if dropout_on else 0.0)

        out = (run(bool(causal), None) if mask is None
               else _masked(mask, causal, b, t, run, packed))
        return out.reshape(batch_shape + tuple(out.shape[1:])).astype(out_dtype)

    return dilated_attention_fn


def _flax_dtype(query, key, value, dtype):
    """The dtype Flax's ``dot_product_attention`` computes in (``flax.linen.dtypes`` /
    ``flax.nnx.nn.dtypes.promote_dtype``): ``dtype`` if given (it must be inexact),
    else the common type of query, key and value, promoted to an inexact type."""
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    elif not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(f"jd.attention_fn: dtype must be a floating (inexact) dtype, as "
                         f"in Flax, got dtype={dtype!r}.")
    return jnp.dtype(dtype)


def _flax_output_dtype(dtype, force_fp32_for_softmax: bool):
    """The dtype of Flax's attention output for the compute ``dtype``: Linen's
    ``force_fp32_for_softmax`` (NNX has none) leaves the attention weights float32,
    and their einsum with ``value`` promotes, so the output is
    ``promote_types(dtype, float32)`` (float32 for bfloat16/float16, float64 for
    float64); otherwise ``dtype``."""
    return jnp.promote_types(dtype, jnp.float32) if force_fp32_for_softmax else dtype


@functools.partial(jax.jit, static_argnames=("core", "is_causal", "dropout_rate"))
def _run_core(query, key, value, kv_mask, segment_ids, sinks, dropout_rng, *, core,
              is_causal, dropout_rate):
    """One compiled call of the attention core. Flax layers often run eagerly (NNX
    without ``nnx.jit``, Linen's ``init``/``apply``), where dispatching the core op by op
    costs far more than the attention; under an outer ``jit`` this nests and inlines."""
    return core(query, key, value, is_causal=is_causal, kv_mask=kv_mask,
                segment_ids=segment_ids, sinks=sinks, dropout_rate=dropout_rate,
                dropout_rng=dropout_rng)


def _masked(mask, causal, b: int, t: int, run, packed: bool = False):
    """``run`` under a flattened Flax mask [B or 1, heads or 1, T or 1, T or 1]: padded
    query rows zero; a mask that is not causal/padding(/documents with ``packed``)
    raises (concrete) or gives NaN (traced)."""
    xp = np if isinstance(mask, np.ndarray) else jnp
    mask = mask if mask.dtype == bool else mask != 0
    if causal:  # a causal overlay, as Flax applies is_causal on top of the mask
        mask = mask & xp.tril(xp.ones((t, t), bool))
    if xp is np:
        return _with_concrete_mask(mask, causal, b, t, run, packed)
    parts = _mask_parts(mask, b, t, jnp, packed)
    if causal is None:
        out = jax.lax.cond(parts.has_future,
                           lambda: run(False, parts.kv_mask, parts.documents),
                           lambda: run(True, parts.kv_mask, parts.documents))
        consistent = jnp.all(parts.mask == jnp.where(
            parts.has_future, _expected(parts, False, jnp), _expected(parts, True, jnp)))
    else:
        out = run(causal, parts.kv_mask, parts.documents)
        consistent = jnp.all(parts.mask == _expected(parts, causal, jnp))
    out = jnp.where(parts.q_valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    return jnp.where(consistent & parts.same_heads, out, jnp.asarray(jnp.nan, out.dtype))


def _with_concrete_mask(mask: np.ndarray, causal, b: int, t: int, run, packed: bool):
    """A mask known at trace time: decide causality in Python and check it exactly."""
    parts = _mask_parts(mask, b, t, np, packed)
    if not parts.same_heads:
        raise ValueError(
            f"jd.attention_fn: the mask (flattened shape {mask.shape}) differs between "
            "heads; dilated attention applies one causal and/or padding mask to every "
            "head (per-head masks are not supported).")
    if causal is None:
        causal = not bool(parts.has_future)
    if not np.array_equal(parts.mask, _expected(parts, causal, np)):
        what = ("a causal, padding and/or document mask (it is not q_valid[p] & "
                "kv_valid[t] & (doc[p] == doc[t])" if packed else
                "a causal and/or padding mask (it is not q_valid[p] & kv_valid[t]")
        hint = ("" if packed else " A document mask of packed rows needs "
                "jd.attention_fn(..., packed=True), or use the segment_ids argument of "
                "the jd.nnx / jd.linen layers.")
        raise ValueError(
            f"jd.attention_fn: the mask is not {what}" + (" & (t <= p)" if causal else "")
            + " for any padding" + (" and documents of consecutive tokens" if packed else "")
            + "), so dilated attention cannot apply it. Use make_causal_mask / "
            "make_attention_mask / combine_masks, or pass is_causal= to jd.attention_fn."
            + hint)
    documents = None if parts.documents is None else jnp.asarray(parts.documents)
    out = run(causal, jnp.asarray(parts.kv_mask), documents)
    return jnp.where(jnp.asarray(parts.q_valid)[:, :, None, None], out,
                     jnp.zeros((), out.dtype))
