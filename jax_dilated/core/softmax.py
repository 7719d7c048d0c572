"""Online softmax: the one place where partial attention results are combined.

Two representations of a partial softmax over a subset of keys are used:

* the *running state* ``(m, l, acc)`` inside a kernel's loop over key blocks:
  ``m`` the running row maximum of the logits, ``l = sum exp(s - m)`` and
  ``acc = sum exp(s - m) v``;
* the *normalised partial* ``(o, lse, lse_lo)`` that kernels return:
  ``o = acc / l`` and the log-sum-exp ``m + log l`` as an unevaluated sum of two
  floats, ``lse`` (the rounded value, ``-inf`` where the row saw no key) and
  ``lse_lo`` (what rounding left out: ``lse + lse_lo = m + log l`` exactly, 0 for
  rows without keys).

Why two floats: at large logits the rounding of ``lse`` alone is a large part of a
probability. With logits near 1e4, float32 spaces values 1e-3 apart, so
``exp(s - lse)`` would be up to 5e-4 off in relative terms however exactly ``s`` is
computed; merges of partials (``exp(lse_i - lse)``) and the backward's recomputed
probabilities inherit that error. Carrying ``lse_lo`` keeps both exact to float32
rounding of the small quantities (``s - lse`` is exact when the two are within a
factor of two, by Sterbenz's lemma). See docs/semantics.md, "Numerics".

For differentiation ``lse`` carries the whole log-sum-exp and ``lse_lo`` is a
constant correction (zero tangent): every ``custom_vjp`` here and in the kernels
reads the cotangent of ``lse`` and ignores that of ``lse_lo``, and a function of
both (a merge) gives both the same cotangent. Autodiff of any composition is then
that of the exact log-sum-exp.

Two normalised partials over disjoint key sets merge exactly:
``lse = logaddexp(lse_1, lse_2)``, ``o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2``.
The same formula mixes LongNet branches (Eq. 10), folds ring steps together and
joins block-sparse partials; every caller in the library goes through
:func:`merge_partials`.

Rows that have seen no key carry ``lse = -inf``, ``lse_lo = 0`` and ``o = 0``;
every function here keeps them at exactly that, with finite gradients, instead of
producing ``nan`` from ``-inf - -inf``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dilated.core.vma import varying_like

__all__ = [
    "stats_dtype",
    "split_sum",
    "RunningState",
    "init_state",
    "update_state",
    "finalize_state",
    "merge_partials",
    "row_dot",
    "empty_partial",
    "backward_delta",
    "backward_rows",
    "backward_scale",
    "add_sinks",
    "fold_sinks",
    "sinks_on_output",
    "sink_gradient",
]


def stats_dtype(dtype) -> jnp.dtype:
    """Dtype of softmax statistics for inputs of ``dtype``.

    float32 for every floating input narrower than or equal to float32 (bf16, fp16,
    fp32); float64 for float64 inputs so that float64 parity stays at ~1e-10.
    """
    return jnp.promote_types(dtype, jnp.float32)


def _safe_max(m):
    """``m`` with ``-inf`` replaced by 0, so that ``x - m`` is ``-inf`` (not nan)."""
    return jnp.where(jnp.isneginf(m), jnp.zeros_like(m), m)


def split_sum(a, b):
    """``a + b`` as an unevaluated pair ``(hi, lo)``: ``hi = fl(a + b)`` and
    ``hi + lo = a + b`` exactly (Knuth's TwoSum; ``a``, ``b`` finite)."""
    hi = a + b
    b_part = hi - a
    lo = (a - (hi - b_part)) + (b - b_part)
    return hi, lo


class RunningState(NamedTuple):
    """Running softmax state for ``[..., rows]`` query rows and ``head_dim`` values.

    m:   [..., rows]       running maximum of the (masked) logits, ``-inf`` if none yet
    l:   [..., rows]       running denominator ``sum exp(s - m)``
    acc: [..., rows, dim]  running numerator ``sum exp(s - m) v``
    """

    m: jax.Array
    l: jax.Array
    acc: jax.Array


def init_state(rows_shape, dim: int, dtype) -> RunningState:
    """Empty state: no key seen yet."""
    return RunningState(
        m=jnp.full(rows_shape, -jnp.inf, dtype),
        l=jnp.zeros(rows_shape, dtype),
        acc=jnp.zeros((*rows_shape, dim), dtype),
    )


def update_state(state: RunningState, s, pv_fn) -> tuple[RunningState, jax.Array]:
    """Fold one block of logits into the running state.

    Args:
      state: the running state.
      s: [..., rows, keys] logits of this block, ``-inf`` where masked.
      pv_fn: ``p -> p @ v`` for this block's values, given the unnormalised
        probabilities ``p = exp(s - m_new)`` ([..., rows, keys], stats dtype); it
        may apply dropout to ``p`` (the denominator must not see dropout).

    Returns:
      The new state and ``p`` (returned so callers can reuse it, e.g. for tests).
    """
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1))
    m_safe = _safe_max(m_new)
    p = jnp.exp(s - m_safe[..., None])
    # exp(-inf - finite) = 0: a state that saw nothing contributes nothing.
    alpha = jnp.exp(state.m - m_safe)
    l_new = alpha * state.l + jnp.sum(p, axis=-1)
    acc_new = alpha[..., None] * state.acc + pv_fn(p)
    return RunningState(m_new, l_new, acc_new), p


def finalize_state(state: RunningState) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalised partial ``(o, lse, lse_lo)`` from a running state.

    Returns ``o`` [..., rows, dim] and ``lse``, ``lse_lo`` [..., rows]
    (``lse + lse_lo = m + log l``); rows that saw no key give ``o = 0``,
    ``lse = -inf`` and ``lse_lo = 0``.
    """
    seen = state.l > 0
    l_safe = jnp.where(seen, state.l, jnp.ones_like(state.l))
    o = state.acc / l_safe[..., None]
    return (o, *lse_parts(state.m, state.l))


def lse_parts(m, l) -> tuple[jax.Array, jax.Array]:
    """The log-sum-exp ``m + log l`` of rows with running maximum ``m`` and sum ``l``
    (of ``exp(s - m)``) as its two parts ``(lse, lse_lo)``; rows with ``l = 0`` (no
    key) give ``-inf`` and 0."""
    seen = l > 0
    hi, lo = split_sum(_safe_max(m), jnp.log(jnp.where(seen, l, jnp.ones_like(l))))
    return jnp.where(seen, hi, -jnp.inf), jnp.where(seen, lo, jnp.zeros_like(lo))


def row_dot(a, b):
    """``sum(a * b, axis=-1)`` as a contraction.

    XLA:CPU runs a multiply-then-reduce over a short last axis some 40x slower
    than the same contraction written as a dot, so every row-wise dot product in
    the library goes through here.
    """
    return jnp.einsum("...d,...d->...", a, b)


def empty_partial(q_shape, dtype, sinks=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The normalised partial of rows that saw no key: ``o = 0`` [*q_shape],
    ``lse = -inf`` and ``lse_lo = 0`` [*q_shape[:-1]], in ``dtype`` (the stats
    dtype). It is the identity of :func:`merge_partials` and where every
    accumulation of partials starts.

    With ``sinks`` [H] (``q_shape[-2] == H``): the partial of the sinks alone
    (:func:`add_sinks`), ``lse = s_h``; an accumulation started there includes
    them with no pass of its own (a running state ``m = s_h``, ``l = 1``,
    ``acc = 0``). Not differentiable in ``sinks``: see :func:`sink_gradient`."""
    rows = q_shape[:-1]
    lse = (jnp.full(rows, -jnp.inf, dtype) if sinks is None
           else jnp.broadcast_to(jax.lax.stop_gradient(sinks).astype(dtype), rows))
    return jnp.zeros(q_shape, dtype), lse, jnp.zeros(rows, dtype)


def backward_delta(do, o, dlse) -> jax.Array:
    """The backward's per-row ``delta = rowsum(do * o) - dlse`` [..., rows], stats dtype.

    With ``p = exp(s - lse)`` the logits' gradient is ``ds = p (dp - delta)``: the
    ``rowsum(do * o)`` term is the softmax's own, and since ``d lse / d s = p`` an
    ``lse`` cotangent ``dlse`` enters exactly as ``-dlse``. ``o`` is the *global*
    output (over every key the row attends to), so a kernel call over part of the
    keys, a ring step or a merged branch differentiates exactly with it.
    """
    stats = stats_dtype(o.dtype)
    return row_dot(do.astype(stats), o.astype(stats)) - dlse.astype(stats)


def backward_rows(do, o, lse_lo, dlse) -> tuple[jax.Array, jax.Array]:
    """The backward's per-row inputs ``(do', delta')`` for a kernel that recomputes
    probabilities from the rounded ``lse`` alone.

    The exact probabilities are ``p = exp(s - lse - lse_lo) = c exp(s - lse)`` with
    ``c = exp(-lse_lo)`` per row, and every gradient is linear in ``p`` through
    ``do`` and ``delta`` (``dv = p^T do``, ``ds = p (do.v - delta)``). So a kernel
    given ``do' = c do`` and ``delta' = c delta`` (:func:`backward_delta`) computes
    the exact gradients from ``exp(s - lse)``, and no kernel needs ``lse_lo``.

    Args:
      do: [..., rows, dim] output cotangent; o: [..., rows, dim] the (global) output.
      lse_lo: [..., rows] the low part of the (global) log-sum-exp.
      dlse: [..., rows] the cotangent of the log-sum-exp (that of ``lse``).

    Returns:
      ``do'`` in ``do``'s dtype and ``delta'`` in the stats dtype.
    """
    c, delta = backward_scale(do, o, lse_lo, dlse)
    return (do.astype(c.dtype) * c[..., None]).astype(do.dtype), delta


def backward_scale(do, o, lse_lo, dlse) -> tuple[jax.Array, jax.Array]:
    """:func:`backward_rows` without ``do'``: the per-row factor ``c = exp(-lse_lo)``
    and ``delta' = c delta`` (stats dtype), for a caller that scales ``do`` where it
    reads it (a chunk at a time) instead of holding a scaled copy of the whole ``do``."""
    stats = stats_dtype(o.dtype)
    c = jnp.exp(-lse_lo.astype(stats))
    return c, backward_delta(do, o, dlse) * c


def _merge_weights(lse1, lo1, lse2, lo2):
    """Mixing weights ``a_i = exp(lse_i - lse)`` and the merged ``(lse, lse_lo)``."""
    # The result does not depend on the shift m; it only keeps exp() in range.
    # lse_i - m is exact (or the weight underflows anyway), so the low parts can be
    # added after the subtraction without losing them.
    m = _safe_max(jnp.maximum(lse1, lse2))
    w1 = jnp.exp((lse1 - m) + lo1)
    w2 = jnp.exp((lse2 - m) + lo2)
    total = w1 + w2
    seen = total > 0
    total_safe = jnp.where(seen, total, jnp.ones_like(total))
    hi, lo = split_sum(m, jnp.log(total_safe))
    lse = jnp.where(seen, hi, -jnp.inf)
    lse_lo = jnp.where(seen, lo, jnp.zeros_like(lo))
    return w1 / total_safe, w2 / total_safe, lse, lse_lo


@jax.custom_vjp
def merge_partials(o1, lse1, lo1, o2, lse2, lo2):
    """Exact merge of two normalised partials over disjoint key sets.

    Args:
      o1, o2: [..., dim] partial outputs (same dtype, normally the stats dtype).
      lse1, lse2: [...] their log-sum-exps, ``-inf`` for rows without keys.
      lo1, lo2: [...] the low parts of the log-sum-exps (module docstring).

    Returns:
      ``(o, lse, lse_lo)`` of the union: ``lse + lse_lo = logaddexp(lse1 + lo1,
      lse2 + lo2)``, ``o = a1 o1 + a2 o2`` with ``a_i = exp(lse_i + lo_i - lse -
      lse_lo)``. Differentiable in all six inputs, through the mixing weights too
      (LongNet's Eq. 10 weights are not detached). Rows where both are ``-inf``
      stay ``(0, -inf, 0)`` with zero gradients.
    """
    a1, a2, lse, lse_lo = _merge_weights(lse1, lo1, lse2, lo2)
    return a1[..., None] * o1 + a2[..., None] * o2, lse, lse_lo


def _merge_fwd(o1, lse1, lo1, o2, lse2, lo2):
    a1, a2, lse, lse_lo = _merge_weights(lse1, lo1, lse2, lo2)
    o = a1[..., None] * o1 + a2[..., None] * o2
    # the merged o is not kept: do.o = a1 do.o1 + a2 do.o2 comes from the inputs,
    # which the callers hold anyway, where keeping o holds one more output-sized array
    return (o, lse, lse_lo), (o1, o2, a1, a2)


def _merge_bwd(res, cotangents):
    # With da_j/dlse_i = a_j (delta_ij - a_i) and dlse/dlse_i = a_i:
    #   d o_i   = a_i do
    #   d lse_i = a_i (dlse + do.o_i - do.o)
    # A log-sum-exp enters only as the sum of its two parts, so both parts of an
    # input get the same cotangent; the output's lse_lo is a constant correction
    # (module docstring), so its cotangent is not read.
    o1, o2, a1, a2 = res
    do, dlse, _ = cotangents
    do_o1, do_o2 = row_dot(do, o1), row_dot(do, o2)
    do_o = a1 * do_o1 + a2 * do_o2  # = do.o
    dlse1 = a1 * (dlse + do_o1 - do_o)
    dlse2 = a2 * (dlse + do_o2 - do_o)
    return ((a1[..., None] * do).astype(o1.dtype), dlse1, dlse1,
            (a2[..., None] * do).astype(o2.dtype), dlse2, dlse2)


merge_partials.defvjp(_merge_fwd, _merge_bwd)


def add_sinks(o, lse, lse_lo, sinks):
    """Attention sinks: one extra "key" per head with logit ``sinks[h]`` and no value.

    The sink joins every row's softmax denominator, ``O = sum_t e^{l_t} v_t /
    (e^{s_h} + sum_t e^{l_t})``: exactly a merge (:func:`merge_partials`) with the
    partial ``(0, s_h, 0)``, applied once to the partial over all keys (after a
    kernel, a ring, a branch merge). Rows that saw no key give ``o = 0`` and ``lse =
    s_h``, with finite gradients.

    Args:
      o: [..., H, D] the normalised partial over the keys; lse, lse_lo: [..., H].
      sinks: [H] float, differentiable (cast to ``lse``'s dtype).

    Returns:
      ``(o, lse, lse_lo)`` including the sink: ``lse + lse_lo = log(e^{s_h} + sum_t
      e^{l_t})`` (so ``o = sum_t e^{l_t - lse - lse_lo} v_t`` still holds).
    """
    s = varying_like(jnp.broadcast_to(sinks.astype(lse.dtype), lse.shape), (lse, o))
    zeros = varying_like((jnp.zeros(o.shape, o.dtype), jnp.zeros(lse.shape, lse.dtype)),
                         (lse, o))
    return merge_partials(o, lse, lse_lo, zeros[0], s, zeros[1])


def fold_sinks(o, lse, lse_lo, sinks):
    """:func:`add_sinks` with ``o`` in any dtype, which it keeps (the merge runs in
    ``lse``'s). ``sinks`` None: unchanged.

    Meant for a ``custom_vjp``'s forward whose backward then runs on the
    sink-including statistics and adds :func:`sink_gradient`: folded there rather
    than after the ``custom_vjp``, the merge keeps no copy of the call's own output
    beside the one returned (the backward reads that one)."""
    if sinks is None:
        return o, lse, lse_lo
    out, lse, lse_lo = add_sinks(o.astype(lse.dtype), lse, lse_lo, sinks)
    return out.astype(o.dtype), lse, lse_lo


def sinks_on_output(o, lse, sinks):
    """``(o, lse)`` of a finished call (``o`` in any dtype, ``lse`` in the stats
    dtype, no low part) with the sinks added by :func:`add_sinks`; ``o`` keeps its
    dtype. ``sinks`` None: unchanged."""
    o, lse, _ = fold_sinks(o, lse, jnp.zeros_like(lse), sinks)
    return o, lse


def sink_gradient(lse, delta, sinks):
    """Cotangent of ``sinks`` [H] for a partial that already includes them
    (:func:`add_sinks`), from its ``lse`` [..., H] and the backward's ``delta`` [..., H]
    as :func:`backward_scale` gives it (``exp(-lse_lo) (do . o - dlse)``).

    The sink is a key with logit ``s_h`` and no value, so its probability is ``p =
    exp(s_h - lse - lse_lo)`` and, as for any key, ``d s_h = sum p (dp - delta)`` over
    the rows with ``dp = do . v_sink = 0``: ``d s_h = -sum exp(s_h - lse) delta'``
    with the scaled ``delta' = exp(-lse_lo) delta``. A kernel that folds the sink into
    its statistics needs only this next to its usual backward (which reads the
    sink-including ``lse``). ``sinks`` None: None.
    """
    if sinks is None:
        return None
    ds = -jnp.exp(sinks.astype(lse.dtype) - lse) * delta
    return jnp.sum(ds.reshape(-1, ds.shape[-1]), axis=0).astype(sinks.dtype)
