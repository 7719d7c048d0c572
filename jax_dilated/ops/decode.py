"""KV-cache decoding of causal dilated attention, one token at a time.

Causal dilated attention is *prefix-consistent*: the output at position ``p`` depends
only on the tokens ``0..p`` (a segment of branch ``i`` is ``[floor(p/w) w, ...)`` and
``p`` is selected when ``(p mod w) mod r == o``, whatever the sequence length; a
segment longer than the sequence is the same single segment starting at 0). So
decoding token ``p`` against a cache of the keys and values ``0..p`` gives exactly
the output of the full causal forward pass at ``p``.

Work per token is bounded by the segment structure, not by the context: in branch
``i`` the token at ``p`` reads only the keys of its own segment that its head
selects, positions ``s + o + a r`` (``s = floor(p/w) w``, ``a < w / r``, and ``<= p``)
- at most ``w / r`` keys per head (``ceil(max_len / r)`` when the segment is longer
than the cache). The cache holds ``O(max_len)`` keys and values.

* :class:`KVCache`, :func:`init_kv_cache` - the cache ``(key, value, index)``.
* :func:`dilated_attention_decode` - attention of one token over a filled cache.
* :func:`decode_step` - write a token's key/value into the cache, then attend.
* :func:`decode_tokens` - the same for several tokens at once (prefill): from an
  empty cache one causal forward pass, otherwise token by token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends import KernelArgs
from jax_dilated.backends.base import Masks
from jax_dilated.core import branch_plans, softmax, validation
from jax_dilated.core.arrays import round_to
from jax_dilated.core.types import (Array, ArrayLike, DTypeLike, HeadOffsets, Implementation,
                                    Mode, SegmentLengths)
from jax_dilated.ops.branch_combine import combine_branches
from jax_dilated.ops.dilated import dilated_attention
from jax_dilated.ops.dilated_programs import DilatedCall

__all__ = ["KVCache", "init_kv_cache", "dilated_attention_decode", "decode_step",
           "decode_tokens"]


class KVCache(NamedTuple):
    """Keys and values of the tokens decoded so far.

    key, value: [batch, max_len, num_kv_heads, head_dim]; slot ``t`` holds token ``t``.
    index: int32 scalar, the number of tokens written (the position of the next one).
    """

    key: jax.Array
    value: jax.Array
    index: jax.Array


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype: DTypeLike = jnp.float32) -> KVCache:
    """An empty cache for ``max_len`` tokens."""
    for name, n in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        validation.check_positive_int(name, n)
    if not validation.is_floating_dtype(dtype):
        raise TypeError(f"dtype must be a floating dtype (the cache holds keys and values), "
                        f"got {dtype!r}.")
    shape = (batch, max_len, num_kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((), jnp.int32))


def _branch_decode(kernel, plan: branch_plans.BranchPlan, query, key_cache, value_cache, p,
                   args: KernelArgs, num_heads: int):
    """(o [B, 1, Hq, D], lse, lse_lo [B, 1, Hq]) of one branch for the heads
    ``plan.query_heads``."""
    b, cache_len, hkv = key_cache.shape[:3]
    if plan.branch.window is not None:
        return _window_decode(kernel, plan, query, key_cache, value_cache, p, args, num_heads)
    w, r = plan.branch.segment_length, plan.branch.rate
    # selected keys per head in p's segment: at most ceil(w / r); those past the
    # segment's end (r need not divide w) lie after p and are invalid below
    n = min(-(-w // r), -(-cache_len // r))
    start = (p // w) * w
    offsets = jnp.asarray(plan.offsets, jnp.int32)  # [Hq]
    positions = start + offsets[None, :] + r * jnp.arange(n, dtype=jnp.int32)[:, None]  # [n, Hq]
    selected = (p - start) % r == offsets  # is the query selected, per head: [Hq]
    valid = (positions <= p) & selected[None, :]
    kv_heads = np.asarray(plan.query_heads) // (num_heads // hkv)
    index = (jnp.minimum(positions, cache_len - 1), kv_heads[None, :])
    k = key_cache[:, index[0], index[1]].astype(query.dtype)  # [B, n, Hq, D]
    v = value_cache[:, index[0], index[1]].astype(query.dtype)
    q = query if len(plan.query_heads) == num_heads else query[:, :, plan.query_heads]
    kv_valid = jnp.broadcast_to(valid[None], (b, n, len(plan.query_heads)))
    return kernel.forward(q, k, v, args, Masks(kv_valid=kv_valid))


def _window_decode(kernel, plan: branch_plans.BranchPlan, query, key_cache, value_cache, p,
                   args: KernelArgs, num_heads: int):
    """A sliding-window branch: the token at ``p`` reads only the cache slots
    ``p - left .. p`` (``min(left + 1, max_len)`` keys, whatever the context)."""
    b, cache_len, hkv = key_cache.shape[:3]
    left, _ = plan.branch.window.resolve(is_causal=True)
    n = min(left + 1, cache_len)
    positions = p - (n - 1) + jnp.arange(n, dtype=jnp.int32)  # [n], the last one is p
    heads = np.asarray(plan.query_heads)
    kv_heads = np.asarray(plan.kv_heads)
    index = jnp.clip(positions, 0, cache_len - 1)
    k = key_cache[:, index][:, :, kv_heads].astype(query.dtype)  # [B, n, Hkv_g, D]
    v = value_cache[:, index][:, :, kv_heads].astype(query.dtype)
    q = query if len(heads) == num_heads else query[:, :, heads]
    kv_valid = jnp.broadcast_to((positions >= 0)[None], (b, n))
    return kernel.forward(q, k, v, args, Masks(kv_valid=kv_valid))


def dilated_attention_decode(query: ArrayLike, key_cache: ArrayLike, value_cache: ArrayLike,
                             position: ArrayLike, *, segment_lengths: SegmentLengths,
                             dilation_rates: Sequence[int], mode: Mode = "longnet",
                             head_offsets: HeadOffsets = "modulo",
                             scale: float | None = None,
                             implementation: Implementation | None = None,
                             block_q: int | None = None, block_k: int | None = None,
                             logit_soft_cap: float | None = None,
                             sinks: ArrayLike | None = None) -> Array:
    """Causal dilated attention of the token at ``position`` over a key/value cache.

    Args:
      query: [batch, 1, num_heads, head_dim], the query of token ``position``.
      key_cache, value_cache: [batch, max_len, num_kv_heads, head_dim]; slots
        ``0..position`` hold the keys/values of tokens ``0..position`` (the current
        token's included); later slots are never read.
      position: int scalar (may be traced), ``0 <= position < max_len``. A float or
        non-scalar position, or a concrete one out of range, raises at trace time;
        a traced one out of range gives a NaN output (never a wrong number).
      segment_lengths, dilation_rates, mode, head_offsets, scale, implementation: as
        in :func:`jax_dilated.dilated_attention`.
      block_q, block_k: kernel block sizes, as in :func:`jax_dilated.dilated_attention`
        (``block_k`` tiles the at most ``w / r`` keys a branch reads; with one query
        ``block_q`` has no effect and is accepted so that the same options serve both).
      logit_soft_cap, sinks: as in :func:`jax_dilated.dilated_attention` (soft-capped
        logits in every branch; the sinks join the combined denominator once).

    A :class:`jax_dilated.SlidingWindow` branch (causal: ``right`` must be 0 or None)
    reads only the cache slots ``position - left .. position``.

    Returns:
      [batch, 1, num_heads, head_dim] in the dtype of ``query``: equal to
      ``dilated_attention(..., is_causal=True)`` at ``position`` on the sequence
      ``0..position`` (and on any longer one).

    Only the cached keys of each branch's current segment that the head selects are
    read (at most ``w / r`` per branch), so the work per token does not grow with
    the context.

    Example:
      >>> import jax, jax.numpy as jnp, jax_dilated as jd
      >>> x = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
      >>> cfg = dict(segment_lengths=(8, 16), dilation_rates=(1, 2))
      >>> full = jax.jit(lambda x: jd.dilated_attention(x, x, x, is_causal=True, **cfg))(x)
      >>> decode = jax.jit(lambda q, k, v, t: jd.dilated_attention_decode(q, k, v, t, **cfg))
      >>> step = decode(x[:, 20:21], x, x, 20)         # position may be traced
      >>> bool(jnp.allclose(step, full[:, 20:21], atol=1e-5))
      True
    """
    # the cache may be stored in another (floating) dtype than the query: check shapes
    # only (check_qkv names whichever is not an array)
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if hasattr(x, "dtype") and not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got dtype {x.dtype}.")
    as_query = [jax.ShapeDtypeStruct(x.shape, query.dtype)
                if hasattr(x, "shape") and hasattr(query, "dtype") else x
                for x in (key_cache, value_cache)]
    _, one, h, hkv, _ = validation.check_qkv(query, *as_query)
    if one != 1:
        raise ValueError(
            f"decoding attends one token at a time: query must be [batch, 1, heads, "
            f"head_dim], got {tuple(query.shape)}.")
    # the call as the forward pass validates it; decoding is causal by construction (its
    # keys end at the position), so the kernel calls are not (args.is_causal False),
    # but a window's explicit right > 0 is an error as there
    if mode == "torchscale":
        # torchscale's own incremental path pads one query against whole-segment keys
        # and breaks past the first segment: there is no decoding to be equal to
        raise ValueError('mode="torchscale" has no KV-cache decoding (torchscale\'s LongNet '
                         'encoders are bidirectional, and its incremental path fails past '
                         'one segment); run the forward pass, or decode with mode="longnet".')
    call = DilatedCall.of(segment_lengths, dilation_rates, mode=mode,
                          head_offsets=head_offsets, head_dim=query.shape[-1], is_causal=True,
                          scale=scale, block_q=block_q, block_k=block_k,
                          logit_soft_cap=logit_soft_cap, implementation=implementation)
    plans = call.plans(seq_len=key_cache.shape[1], num_heads=h, num_kv_heads=hkv)
    args = dataclasses.replace(call.args, is_causal=False)
    sinks = validation.check_sinks(sinks, h)
    # a concrete position out of [0, max_len) raises here; a traced one gives NaN
    p, bad = validation.check_position(position, key_cache.shape[1])
    results = [_branch_decode(call.kernel, plan, query, key_cache, value_cache, p, args, h)
               for plan in plans]
    out, lse = combine_branches(results, mode, query.dtype)
    # once, on the combined denominator, as the forward pass
    out = softmax.sinks_on_output(out, lse, sinks)[0]
    return out if bad is None else jnp.where(bad, jnp.asarray(jnp.nan, out.dtype), out)


def _write(cache_array, x, slot, keep_old):
    """``cache_array`` with ``x`` [B, 1, ...] written at ``slot`` (or left as is)."""
    zero = jnp.zeros((), slot.dtype)
    start = (zero, slot) + (zero,) * (cache_array.ndim - 2)
    old = jax.lax.dynamic_slice(cache_array, start, x.shape)
    x = jnp.where(keep_old, old, x.astype(cache_array.dtype))
    return jax.lax.dynamic_update_slice(cache_array, x, start)


def _check_index(index):
    """``cache.index``: an int scalar, >= 0 when concrete (a traced negative index is an
    overflow: NaN output, cache unchanged)."""
    if getattr(index, "ndim", None) != 0 or not jnp.issubdtype(index.dtype, jnp.integer):
        raise TypeError(
            f"cache.index must be an int array of shape () (the number of tokens "
            f"written), got {index!r}.")
    if not isinstance(index, jax.core.Tracer) and int(index) < 0:
        raise ValueError(f"cache.index must be >= 0 (the number of tokens written), got "
                         f"{int(index)}.")
    return index


def decode_step(cache: KVCache, query: ArrayLike, key: ArrayLike, value: ArrayLike,
                **config) -> tuple[Array, KVCache]:
    """Append one token's key/value to ``cache`` and attend with its query.

    Args:
      cache: a :class:`KVCache` holding ``cache.index`` tokens.
      query: [batch, 1, num_heads, head_dim]; key, value: [batch, 1, num_kv_heads,
        head_dim], the new token's projections.
      **config: keyword arguments of :func:`dilated_attention_decode`.

    Returns:
      ``(out [batch, 1, num_heads, head_dim], new_cache)``.

    Raises:
      ValueError: on a shape mismatch with the cache, and - when ``cache.index`` is
        concrete (eager code) - when the cache is full or the index negative. Under
        ``jax.jit`` the index is traced and cannot raise: a step past the end (or at a
        negative index) leaves the cache unchanged and returns NaN, so an overflow is
        never a silently wrong number.
    """
    b, max_len, hkv, d = cache.key.shape
    want = (b, 1, hkv, d)
    shapes = [getattr(x, "shape", type(x).__name__) for x in (key, value)]
    if any(not isinstance(s, tuple) or s != want for s in shapes):
        raise ValueError(
            f"the new key/value must be [batch, 1, num_kv_heads, head_dim] = {want} to "
            f"match the cache {tuple(cache.key.shape)}, got key {shapes[0]} and "
            f"value {shapes[1]}.")
    index = _check_index(cache.index)
    if not isinstance(index, jax.core.Tracer) and int(index) >= max_len:
        raise ValueError(
            f"KV cache overflow: the cache holds max_len={max_len} tokens and all are "
            f"used (index {int(index)}); initialise a longer cache.")
    overflow = (index >= max_len) | (index < 0)
    slot = jnp.clip(index, 0, max_len - 1)
    new = KVCache(_write(cache.key, key, slot, overflow),
                  _write(cache.value, value, slot, overflow),
                  index + jnp.where(overflow, 0, 1).astype(index.dtype))
    out = dilated_attention_decode(query, new.key, new.value, slot, **config)
    return jnp.where(overflow, jnp.asarray(jnp.nan, out.dtype), out), new


def decode_tokens(cache: KVCache, query: ArrayLike, key: ArrayLike, value: ArrayLike,
                  **config) -> tuple[Array, KVCache]:
    """Append ``n`` tokens' keys/values to ``cache`` and attend with their queries.

    Equal to ``n`` calls of :func:`decode_step`, one token after another (every token
    attends to the cache and the chunk's tokens up to itself). From an empty cache
    (``cache.index == 0``: a prompt, *prefill*) it runs as one causal
    :func:`jax_dilated.dilated_attention` pass over the chunk (prefix consistency
    makes that the same numbers up to float rounding); otherwise the tokens are
    decoded one by one in a ``lax.scan``. Under ``jax.jit`` both ways are compiled
    and ``cache.index`` picks one at run time (``lax.cond``).

    Args:
      cache: a :class:`KVCache` holding ``cache.index`` tokens.
      query: [batch, n, num_heads, head_dim]; key, value: [batch, n, num_kv_heads,
        head_dim], the new tokens' projections.
      **config: keyword arguments of :func:`dilated_attention_decode`.

    Returns:
      ``(out [batch, n, num_heads, head_dim], new_cache)``.

    Raises:
      ValueError: on a shape mismatch, when ``n`` exceeds the cache, and - when
        ``cache.index`` is concrete - when the tokens do not fit. Under ``jax.jit`` the
        tokens past the end of the cache are not written and output NaN.
    """
    b, max_len, hkv, d = cache.key.shape
    n = query.shape[1] if getattr(query, "ndim", 0) == 4 else None
    want = (b, n, hkv, d)
    shapes = [getattr(x, "shape", type(x).__name__) for x in (query, key, value)]
    if n is None or any(not isinstance(s, tuple) or s != want for s in shapes[1:]):
        raise ValueError(
            f"decode_tokens takes query [batch, n, heads, head_dim] and key/value [batch, "
            f"n, num_kv_heads, head_dim] = {want} matching the cache "
            f"{tuple(cache.key.shape)}, got query {shapes[0]}, key {shapes[1]} and value "
            f"{shapes[2]}.")
    if n == 1:
        return decode_step(cache, query, key, value, **config)
    if n > max_len:
        raise ValueError(
            f"KV cache overflow: {n} tokens do not fit a cache of max_len={max_len}.")
    index = _check_index(cache.index)
    concrete = not isinstance(index, jax.core.Tracer)
    if concrete and int(index) + n > max_len:
        raise ValueError(
            f"KV cache overflow: the cache holds max_len={max_len} tokens, {int(index)} "
            f"are used and {n} more were given; initialise a longer cache.")

    def from_empty():
        # keys/values go through the cache dtype, as decode_step reads them
        k, v = (round_to(x.astype(query.dtype), cache.key.dtype) for x in (key, value))
        out = dilated_attention(query, k, v, is_causal=True, **config)
        zero = (0, 0, 0, 0)
        new = KVCache(jax.lax.dynamic_update_slice(cache.key, key.astype(cache.key.dtype),
                                                   zero),
                      jax.lax.dynamic_update_slice(cache.value,
                                                   value.astype(cache.value.dtype), zero),
                      index + jnp.asarray(n, index.dtype))
        return out, new

    def one_by_one():
        def step(c, x):
            q_t, k_t, v_t = (a[:, None] for a in x)
            out, c = decode_step(c, q_t, k_t, v_t, **config)
            return c, out[:, 0]

        new, outs = jax.lax.scan(step, cache, tuple(a.swapaxes(0, 1)
                                                    for a in (query, key, value)))
        return outs.swapaxes(0, 1), new

    if concrete:
        return from_empty() if int(index) == 0 else one_by_one()
    return jax.lax.cond(index == 0, from_empty, one_by_one)
