"""Combining the branches of dilated attention: ``(out, lse)`` from every branch's
partial (docs/semantics.md, section 2), shared by every path of
:func:`jax_dilated.dilated_attention` and by decoding; and the batched one-device
program, one kernel call per branch combined afterwards (:func:`batched`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import Masks
from jax_dilated.core import dilation, softmax
from jax_dilated.ops import dilated_window

__all__ = ["batched", "branch_lse_grad", "combine_branches", "kernel_call",
           "split_head_groups"]


def batched(kernel, args, plans, mode: str, query, key, value, kv_mask, rng=None,
            lse_grad=True):
    """``(out, lse)`` from one batched kernel call per branch (``Kernel.attention``,
    differentiable), combined afterwards (:func:`combine_branches`); no sinks.
    ``lse_grad`` False: the caller does not differentiate through ``lse`` (returned
    with its gradient stopped); in head_groups mode, where each head's lse is its
    branch's, the calls then run their backward from their output alone."""
    lse_grad_i = branch_lse_grad(lse_grad, mode)
    parts = (split_head_groups(plans, query, key, value) if mode == "head_groups"
             else None) or [(plan, query, key, value) for plan in plans]
    results = []
    for i, (plan, q, k, v) in enumerate(parts):
        rng_i = None if rng is None else jax.random.fold_in(rng, i)
        if plan.branch.window is not None:
            results.append(dilated_window.local_partial(kernel, args, plan, q, k, v,
                                                        kv_mask, rng_i,
                                                        lse_grad=lse_grad_i))
            continue
        attend = functools.partial(kernel_call, kernel, args, rng_i, lse_grad_i)
        results.append(dilation.attend_dilated(attend, plan.branch, plan, q, k, v, kv_mask))
    o, lse = combine_branches(results, mode, query.dtype)
    return o, (lse if lse_grad else jax.lax.stop_gradient(lse))


def split_head_groups(plans, query, key, value):
    """head_groups mode: ``[(plan, q, k, v)]``, each branch's heads cut out of the
    arrays by one split per array and its plan's head indices made local to them, or
    None where the plans' query heads are not contiguous runs that tile the heads in
    order. The backward then concatenates the groups' gradients, where slicing every
    branch from the whole arrays adds zero-padded full-size gradients (on a GPU at 256K
    tokens, 13% of a forward+backward). Keys and values are split the same way where
    the groups' kv heads tile them too (not where grouped queries of one kv head fall
    in two groups); else every branch reads them whole."""
    q_cuts = _tiling([p.query_heads for p in plans], query.shape[2])
    if q_cuts is None:
        return None
    kv_cuts = _tiling([np.unique(p.kv_heads) for p in plans], key.shape[2])
    qs = jnp.split(query, q_cuts[1:-1], axis=2)
    if kv_cuts is None:
        ks, vs, kv_cuts = [key] * len(plans), [value] * len(plans), [0] * len(plans)
    else:
        ks, vs = (jnp.split(x, kv_cuts[1:-1], axis=2) for x in (key, value))
    return [(dataclasses.replace(p, query_heads=p.query_heads - q_cuts[i],
                                 kv_heads=p.kv_heads - kv_cuts[i]), qs[i], ks[i], vs[i])
            for i, p in enumerate(plans)]


def _tiling(head_sets, num_heads: int) -> list[int] | None:
    """``[a_0 = 0, a_1, ..., num_heads]`` when set ``i`` is exactly ``a_i .. a_{i+1} - 1``
    for every ``i`` (contiguous runs tiling the heads in order), else None."""
    cuts = [0]
    for heads in head_sets:
        heads = np.asarray(heads)
        if len(heads) == 0 or not np.array_equal(heads, np.arange(cuts[-1],
                                                                  cuts[-1] + len(heads))):
            return None
        cuts.append(cuts[-1] + len(heads))
    return cuts if cuts[-1] == num_heads else None


def kernel_call(kernel, args, rng, lse_grad, q, k, v, valid):
    """``kernel.attention`` on a branch's dilated segments (the ``attend`` of
    :func:`jax_dilated.core.dilation.attend_dilated`): their ``valid`` keys and the
    dropout key ``rng``."""
    return kernel.attention(q, k, v, args, Masks(kv_valid=valid, dropout_rng=rng),
                            lse_grad=lse_grad)


def branch_lse_grad(lse_grad: bool, mode: str) -> bool:
    """Whether every branch's lse is differentiated, given whether the combined one
    is (``lse_grad``): always in longnet mode, whose merge differentiates through the
    mixing weights; in head_groups mode, where each head's lse is its branch's, only
    when the combined one is."""
    return lse_grad or mode == "longnet"


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
