"""Combining the branches of dilated attention: ``(out, lse)`` from every branch's
partial (docs/semantics.md, section 2), shared by every path of
:func:`jax_dilated.dilated_attention` and by decoding."""

from __future__ import annotations

import jax.numpy as jnp

from jax_dilated.core import softmax

__all__ = ["combine_branches"]


def combine_branches(results, mode: str, dtype):
    """``(out, lse)`` from every branch's ``(o_i, lse_i, lse_lo_i)`` (docs/semantics.md,
    section 2; the log-sum-exp in two parts, :mod:`jax_dilated.core.softmax`).

    longnet: merged by the softmax denominators (``softmax.merge_partials``, exact
    gradients through the mixing weights), ``lse = log sum_i exp(lse_i)``;
    head_groups: the groups' heads side by side (contiguous and in order), the
    output divided by the number of branches, each head's ``lse`` that of its branch.
    ``out`` is in ``dtype``, ``lse`` [batch, seq, heads] in the statistics dtype.
    """
    if mode == "longnet":
        stats = softmax.stats_dtype(dtype)
        o, lse, lse_lo = results[0][0].astype(stats), *results[0][1:]
        for o_i, lse_i, lo_i in results[1:]:
            o, lse, lse_lo = softmax.merge_partials(o, lse, lse_lo, o_i.astype(stats),
                                                    lse_i, lo_i)
        return o.astype(dtype), lse
    o = jnp.concatenate([o_i for o_i, *_ in results], axis=2)
    lse = jnp.concatenate([lse_i for _, lse_i, _ in results], axis=2)
    return (o / len(results)).astype(dtype), lse
