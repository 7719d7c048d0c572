"""Combining the branches of dilated attention: ``(out, lse)`` from every branch's
partial (docs/semantics.md, section 2), shared by every path of
:func:`jax_dilated.dilated_attention` and by decoding; and the batched one-device
program, one kernel call per branch combined afterwards (:func:`batched`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dilated.backends.base import Masks
from jax_dilated.core import dilation, softmax
from jax_dilated.ops import dilated_window

__all__ = ["batched", "branch_lse_grad", "combine_branches", "kernel_call"]


def batched(kernel, args, plans, mode: str, query, key, value, kv_mask, rng=None,
            lse_grad=True):
    """``(out, lse)`` from one batched kernel call per branch (``Kernel.attention``,
    differentiable), combined afterwards (:func:`combine_branches`); no sinks.
    ``lse_grad`` False: the caller does not differentiate through ``lse`` (returned
    with its gradient stopped); in head_groups mode, where each head's lse is its
    branch's, the calls then run their backward from their output alone."""
    lse_grad_i = branch_lse_grad(lse_grad, mode)
    results = []
    for i, plan in enumerate(plans):
        rng_i = None if rng is None else jax.random.fold_in(rng, i)
        if plan.branch.window is not None:
            results.append(dilated_window.local_partial(kernel, args, plan, query, key,
                                                        value, kv_mask, rng_i,
                                                        lse_grad=lse_grad_i))
            continue
        attend = functools.partial(kernel_call, kernel, args, rng_i, lse_grad_i)
        results.append(dilation.attend_dilated(attend, plan.branch, plan, query, key,
                                               value, kv_mask))
    o, lse = combine_branches(results, mode, query.dtype)
    return o, (lse if lse_grad else jax.lax.stop_gradient(lse))


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
