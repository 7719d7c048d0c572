"""Dilated attention the naive JAX way: a dense attention function per dilated segment.

This is what a JAX user without jax-dilated would write (docs/semantics.md, section 2):
for every branch ``(w, r)``, reshape ``[B, n, H, D]`` into segments
``[B, n/w, w, H, D]``, take every ``r``-th position from the offset with a strided
slice (and the heads that use that offset), fold the segments into the batch,
call a dense attention function on ``[segments, w/r, heads, D]``, and scatter the
result back with ``.at[...].add/.set``. :func:`per_segment_attention` does this for
any attention function; :func:`dilated_attention` uses
``jax.nn.dot_product_attention(implementation="xla")`` and
``benchmarks/baselines/tokamax_per_segment.py`` ``tokamax.dot_product_attention``.

Modes:

* ``head_groups``: head group ``i`` (``branch_plans.head_groups``) runs branch ``i``
  at offset ``i mod r``; the sum over groups is divided by the number of groups.
* ``longnet``: head ``j`` runs every branch at offset ``j mod r`` (heads ``o::r``
  share offset ``o``); the branches are mixed by their softmax denominators,
  ``O = sum_i exp(LSE_i - LSE) O_i``, so the attention function must return the
  log-sum-exp. ``jax.nn.dot_product_attention(..., return_residual=True)`` does, but
  in the XLA implementation the residual carries no gradient (its cotangent is
  dropped): :func:`lse_has_gradient` checks that at run time, and without it the
  longnet forward is right but its gradient is not LongNet's (the benchmark then
  times the longnet forward only).

Limits, as the torch baseline's: equal query and key/value heads, no padding mask,
``n`` a multiple of every segment length shorter than it and ``w`` a multiple of
``r`` (a segment at least as long as the sequence is the whole sequence).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jax_dilated.core import branch_plans

__all__ = [
    "branches",
    "check_config",
    "dilated_attention",
    "jax_nn_attention",
    "lse_has_gradient",
    "per_segment_attention",
]

# attention(q, k, v, *, is_causal, scale, return_lse) on [N, L, h, D] -> (out, lse or None)
Attention = Callable[..., tuple]


def branches(seq_len: int, segment_lengths: Sequence[int],
             dilation_rates: Sequence[int]) -> list[tuple[int, int]]:
    """The effective ``(w, r)`` of every branch (``w`` capped at ``seq_len``)."""
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError(f"segment_lengths {tuple(segment_lengths)} and dilation_rates "
                         f"{tuple(dilation_rates)} differ in length")
    out = []
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(int(w), seq_len)
        if seq_len % w or w % r:
            raise ValueError(
                f"the per-segment baseline needs seq_len % segment == 0 and segment % rate "
                f"== 0, got seq_len={seq_len}, segment={w}, rate={r}")
        out.append((w, int(r)))
    return out


def check_config(seq_len: int, segment_lengths: Sequence[int],
                 dilation_rates: Sequence[int]) -> None:
    """Raise ``ValueError`` if this baseline cannot run the configuration."""
    branches(seq_len, segment_lengths, dilation_rates)


def _gather(x, w: int, r: int, offset: int, heads: slice):
    """[B, n, H, ...] -> [B * n/w, w/r, h, ...]: positions ``offset::r`` of every segment."""
    b, n, h = x.shape[:3]
    seg = x.reshape(b, n // w, w, h, *x.shape[3:])[:, :, offset::r, heads]
    return seg.reshape(b * (n // w), w // r, *seg.shape[3:])


def _segments(x, w: int):
    """[B, n, H, ...] -> [B, n/w, w, H, ...] (the array scatters write into)."""
    b, n, h = x.shape[:3]
    return x.reshape(b, n // w, w, h, *x.shape[3:])


def per_segment_attention(query, key, value, *, segment_lengths, dilation_rates,
                          mode: str = "longnet", is_causal: bool = False,
                          scale: float | None = None, attention: Attention):
    """Dilated attention built from ``attention`` called once per branch and offset.

    Args:
      query, key, value: [B, n, H, D], the same number of heads.
      segment_lengths, dilation_rates, mode, is_causal, scale: as
        ``jd.dilated_attention`` (``head_offsets="modulo"``).
      attention: ``attention(q, k, v, *, is_causal, scale, return_lse)`` on
        [N, L, h, D] returning ``(out [N, L, h, D], lse [N, L, h] or None)``.

    Returns:
      [B, n, H, D] in the dtype of ``query``.
    """
    if key.shape != query.shape or value.shape != query.shape:
        raise ValueError(f"the per-segment baseline needs query, key and value of one shape, "
                         f"got {query.shape}, {key.shape}, {value.shape}")
    b, n, h, d = query.shape
    brs = branches(n, segment_lengths, dilation_rates)
    scale = d ** -0.5 if scale is None else scale
    call = functools.partial(attention, is_causal=is_causal, scale=scale)

    if mode == "head_groups":
        out = jnp.zeros(query.shape, jnp.float32)
        for i, ((w, r), (h0, h1)) in enumerate(zip(brs, branch_plans.head_groups(h, len(brs)))):
            o, heads = i % r, slice(h0, h1)
            x, _ = call(*(_gather(t, w, r, o, heads) for t in (query, key, value)),
                        return_lse=False)
            x = x.reshape(b, n // w, w // r, h1 - h0, d).astype(jnp.float32)
            out = _segments(out, w).at[:, :, o::r, heads].add(x).reshape(b, n, h, d)
        return (out / len(brs)).astype(query.dtype)

    if mode != "longnet":
        raise ValueError(f"mode must be 'longnet' or 'head_groups', got {mode!r}")
    outs, lses = [], []
    for w, r in brs:
        out_i = _segments(jnp.zeros(query.shape, jnp.float32), w)
        lse_i = _segments(jnp.full((b, n, h), -jnp.inf, jnp.float32), w)
        for o in range(min(r, h)):
            heads = slice(o, None, r)    # heads j with j mod r == o use offset o
            x, lse = call(*(_gather(t, w, r, o, heads) for t in (query, key, value)),
                          return_lse=True)
            hs = len(range(o, h, r))
            out_i = out_i.at[:, :, o::r, heads].set(
                x.reshape(b, n // w, w // r, hs, d).astype(jnp.float32))
            lse_i = lse_i.at[:, :, o::r, heads].set(
                lse.reshape(b, n // w, w // r, hs).astype(jnp.float32))
        outs.append(out_i.reshape(b, n, h, d))
        lses.append(lse_i.reshape(b, n, h))
    lse = jnp.stack(lses)                             # [G, B, n, H]; -inf: not covered
    top = jax.lax.stop_gradient(jnp.max(lse, axis=0))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.exp(lse - top)
    total = jnp.sum(e, axis=0)
    weights = e / jnp.where(total > 0, total, 1.0)    # 0 where no branch covers p
    out = sum(wt[..., None] * o_i for wt, o_i in zip(weights, outs))
    return out.astype(query.dtype)


def jax_nn_attention(q, k, v, *, is_causal: bool, scale: float, return_lse: bool):
    """``jax.nn.dot_product_attention(implementation="xla")`` as an :data:`Attention`."""
    if return_lse:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal,
                                            implementation="xla", return_residual=True)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal,
                                        implementation="xla"), None


def dilated_attention(query, key, value, *, segment_lengths, dilation_rates,
                      mode: str = "longnet", is_causal: bool = False,
                      scale: float | None = None):
    """:func:`per_segment_attention` with ``jax.nn.dot_product_attention`` (XLA)."""
    return per_segment_attention(query, key, value, segment_lengths=segment_lengths,
                                 dilation_rates=dilation_rates, mode=mode,
                                 is_causal=is_causal, scale=scale, attention=jax_nn_attention)


@functools.cache
def lse_has_gradient() -> bool:
    """Whether ``jax.nn.dot_product_attention``'s returned log-sum-exp is differentiable.

    ``d sum(lse) / dq`` of a small random problem is nonzero in exact arithmetic;
    the XLA implementation returns zero there when it drops the residual's cotangent.
    """
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 8, 1, 4), jnp.float32)
               for i in range(3))

    def total_lse(q_):
        return jnp.sum(jax_nn_attention(q_, k, v, is_causal=False, scale=0.5,
                                        return_lse=True)[1])

    return bool(jnp.any(jax.grad(total_lse)(q) != 0))
