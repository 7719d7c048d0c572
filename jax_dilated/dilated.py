"""Dilated attention on one device (LongNet, DESIGN.md section 3).

For each branch ``(w, r)`` the sequence is cut into segments of ``w`` tokens,
each head's selected positions (offset ``o``: ``(p mod w) mod r == o``) are
gathered into dense *dilated segments* of ``w / r`` tokens, a kernel runs dense
attention inside every dilated segment (all segments and heads batched in one
call), and the result is scattered back to the positions it came from.

``mode="longnet"`` merges the branches of every head by their softmax
denominators (Eq. 10) with :func:`jax_dilated.softmax.merge_partials`;
``mode="head_groups"`` runs branch ``i`` on head group ``i`` only and divides the
whole output by the number of branches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated import patterns, softmax, validation
from jax_dilated.backends import KernelArgs, get_kernel

__all__ = ["dilated_attention"]


def _pad_seq(x, padded_len: int, value=0):
    pad = padded_len - x.shape[1]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _gather_dilated(x, branch: patterns.Branch, offsets: np.ndarray, heads: np.ndarray):
    """Dilated segments of ``x`` for heads ``heads`` at offsets ``offsets``.

    Args:
      x: [B, T, Hx, ...] (per-head data, e.g. queries, or a [B, T, Hx] mask).
      branch: the resolved branch (``w`` effective, ``r``).
      offsets, heads: [Hs] static offset and head index of each output head.

    Returns:
      [B * S, w / r, Hs, ...] with ``S`` segments; token ``a`` of segment ``s``
      for output head ``i`` is position ``s*w + a*r + offsets[i]`` of head
      ``heads[i]`` (positions past ``T`` read padding).
    """
    b, t, hx = x.shape[:3]
    w, r = branch.effective_length, branch.rate
    s = branch.num_segments(t)
    x = _pad_seq(x, s * w).reshape(b, s, w // r, r * hx, *x.shape[3:])
    flat = np.asarray(offsets) * hx + np.asarray(heads)
    if not np.array_equal(flat, np.arange(r * hx)):
        x = jnp.take(x, flat, axis=3)
    return x.reshape(b * s, w // r, len(flat), *x.shape[4:])


def _scatter_dilated(y, branch: patterns.Branch, offsets: np.ndarray, batch: int,
                     seq_len: int, fill):
    """Inverse of :func:`_gather_dilated` for one set of heads: [B*S, w/r, Hs, ...] -> [B, T, Hs, ...].

    Positions a head does not select get ``fill`` (0 for outputs, -inf for lse).
    """
    w, r = branch.effective_length, branch.rate
    s = y.shape[0] // batch
    head_and_rest = y.shape[2:]  # (Hs, ...)
    y = y.reshape(batch, s, w // r, *head_and_rest)
    if r > 1:
        selected = np.arange(r)[:, None] == np.asarray(offsets)[None, :]  # [r, Hs]
        selected = selected.reshape((1, 1, 1) + selected.shape + (1,) * (len(head_and_rest) - 1))
        y = jnp.where(selected, jnp.expand_dims(y, 3), jnp.asarray(fill, y.dtype))
    y = y.reshape(batch, s * w, *head_and_rest)
    return y[:, :seq_len]


def _key_validity(kv_mask, branch: patterns.Branch, batch: int, seq_len: int):
    """[B, T] validity of keys, or None when every key of every segment exists."""
    if kv_mask is None and seq_len % branch.effective_length == 0:
        return None
    return jnp.ones((batch, seq_len), bool) if kv_mask is None else kv_mask


def _run_branch(kernel, plan: patterns.BranchPlan, query, key, value, kv_mask, args,
                dropout_rng):
    """(o, lse) of one branch for the heads ``plan.query_heads``: [B, T, Hq, D], [B, T, Hq]."""
    b, t = query.shape[:2]
    br = plan.branch
    q = _gather_dilated(query, br, plan.offsets, plan.query_heads)
    k = _gather_dilated(key, br, plan.kv_offsets, plan.kv_heads)
    v = _gather_dilated(value, br, plan.kv_offsets, plan.kv_heads)
    valid = _key_validity(kv_mask, br, b, t)
    if valid is not None:
        # broadcast the [B, T] mask to the gathered kv heads: [B, T, Hkv_g]
        per_head = jnp.broadcast_to(valid[:, :, None], (b, t, key.shape[2]))
        valid = _gather_dilated(per_head, br, plan.kv_offsets, plan.kv_heads)
        # positions past T are padding: they read False through _pad_seq.
    o, lse = kernel.attention(q, k, v, args, kv_valid=valid, dropout_rng=dropout_rng)
    o = _scatter_dilated(o, br, plan.offsets, b, t, 0)
    lse = _scatter_dilated(lse, br, plan.offsets, b, t, -jnp.inf)
    return o, lse


def dilated_attention(query, key, value, *, segment_lengths, dilation_rates,
                      mode: str = "longnet", head_offsets: str = "modulo",
                      is_causal: bool = False, scale: float | None = None, kv_mask=None,
                      dropout_rate: float = 0.0, dropout_rng=None,
                      implementation: str | None = None, block_q: int | None = None,
                      block_k: int | None = None):
    """LongNet dilated attention on one device.

    Args:
      query: [batch, seq, num_heads, head_dim].
      key, value: [batch, seq, num_kv_heads, head_dim]; ``num_heads % num_kv_heads == 0``
        (query head ``j`` reads kv head ``j // (num_heads // num_kv_heads)``).
      segment_lengths: segment length ``w_i`` of every branch (static ints).
      dilation_rates: dilation rate ``r_i`` of every branch; ``w_i % r_i == 0``.
      mode: ``"longnet"`` (every head runs every branch; branches mixed by their
        softmax denominators) or ``"head_groups"`` (branch ``i`` on head group
        ``i``, output divided by the number of branches).
      head_offsets: longnet offset rule, ``"modulo"`` (``j mod r``) or ``"blocked"``
        (``floor(j / ceil(H / r))``).
      is_causal: key ``t`` is visible to query ``p`` only if ``t <= p``.
      scale: logit scale; default ``1 / sqrt(head_dim)``.
      kv_mask: bool [batch, seq], True where a key may be attended to.
      dropout_rate: attention-probability dropout rate (the denominators see no
        dropout); needs ``dropout_rng``. Deterministic for a given key.
      dropout_rng: a ``jax.random`` key.
      implementation: kernel; None chooses by device kind (``"xla"`` on CPU).
      block_q, block_k: kernel block sizes (None: the kernel's defaults).

    Returns:
      [batch, seq, num_heads, head_dim] in the dtype of ``query``. Positions with
      no key to attend to in any branch are zero.

    The math: for branch ``i`` a selected query attends to the selected keys of
    its segment; ``O_i`` and ``LSE_i`` are that softmax's output and log-sum-exp.
    longnet: ``O = sum_i exp(LSE_i) O_i / sum_i exp(LSE_i)``, which equals dense
    attention with logits ``scale q.k + log m(p, t)``, ``m`` the number of
    branches linking ``p`` and ``t``.

    Example:
      >>> import jax, jax.numpy as jnp, jax_dilated as jd
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 4, 8))
      >>> jd.dilated_attention(q, k, v, segment_lengths=(16, 32),
      ...                      dilation_rates=(1, 2)).shape
      (1, 64, 4, 8)
    """
    b, t, h, hkv, tk = validation.check_qkv(query, key, value)
    if tk != t:
        raise ValueError(
            f"dilated attention is self-attention over one sequence: key/value length "
            f"must equal query length, got query {tuple(query.shape)} and key "
            f"{tuple(key.shape)}."
        )
    branches = patterns.validate_branches(segment_lengths, dilation_rates)
    is_causal = validation.check_flag("is_causal", is_causal)
    kv_mask = validation.check_kv_mask(kv_mask, b, t)
    dropout_rate = validation.check_dropout(dropout_rate, dropout_rng)
    args = KernelArgs(scale=validation.check_scale(scale, query.shape[-1]),
                      is_causal=is_causal, dropout_rate=dropout_rate,
                      block_q=block_q, block_k=block_k)
    plans = patterns.plan_branches(branches, seq_len=t, num_heads=h, num_kv_heads=hkv,
                                   mode=mode, offsets_rule=head_offsets)
    kernel = get_kernel(implementation)

    def rng_for(i):
        return None if dropout_rate == 0.0 else jax.random.fold_in(dropout_rng, i)

    results = [_run_branch(kernel, plan, query, key, value, kv_mask, args, rng_for(i))
               for i, plan in enumerate(plans)]
    if mode == "longnet":
        stats = softmax.stats_dtype(query.dtype)
        o, lse = results[0][0].astype(stats), results[0][1]
        for o_i, lse_i in results[1:]:
            o, lse = softmax.merge_partials(o, lse, o_i.astype(stats), lse_i)
        return o.astype(query.dtype)
    # head_groups: groups are contiguous and in order, so concatenation restores heads.
    o = jnp.concatenate([o_i for o_i, _ in results], axis=2)
    return (o / len(plans)).astype(query.dtype)
