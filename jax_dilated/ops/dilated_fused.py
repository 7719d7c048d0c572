"""Dilated attention on one device as one fused kernel call per pass (docs/semantics.md,
section 2): a kernel that declares ``fused_dilated`` (the native CPU kernel) reads
every branch's dilated segments where they lie in the arrays and writes each
branch's rows of the result (or adds its gradients) in place, so no chunk is
gathered or scattered and, in longnet mode, no merge pass runs: each row's softmax
continues over the next branch's keys (Eq. 10 as one softmax over the union of the
keys; nested branches compute each shared pair once, section 7).

The backward differentiates through the global statistics as the streamed program
does (:mod:`jax_dilated.ops.dilated_local`): with ``P = exp(s - LSE)`` over a
branch's keys, the kernel's backward with ``lse = LSE`` and ``delta = rowsum(dO *
O) - dLSE`` is the exact gradient of the merged result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_dilated.backends.base import Kernel, KernelArgs, Masks
from jax_dilated.core import branch_plans, softmax

__all__ = ["FusedCall", "attend", "fused_call", "fused_unservable"]


@dataclasses.dataclass(frozen=True, eq=False)
class FusedCall:
    """Static description of one fused call (identity-hashed: it holds NumPy plans)."""

    kernel: Kernel
    args: KernelArgs
    plans: tuple[branch_plans.BranchPlan, ...]  # in the order the kernel runs them
    shared_pairs: bool  # longnet's nested branches: each shared pair computed once
    mode: str
    groups: int  # head_groups: the output is divided by this


def fused_unservable(kernel: Kernel, args: KernelArgs, plans, query, key, kv_mask,
                     rng) -> str | None:
    """Why the fused program cannot run this call (None: it can): the kernel must
    declare ``fused_dilated``, serve every branch's calls (``Kernel.call_reason``),
    and there must be no dropout (``rng``). Sliding-window branches are not its: they
    run as their own windowed calls beside it."""
    if not kernel.fused_dilated:
        return f"the {kernel.name} kernel has no fused dilated program"
    if rng is not None:
        return "dropout runs chunk by chunk"
    if all(p.branch.window is not None for p in plans):
        return "every branch is a sliding window"
    b, t, _, d = query.shape
    spec = jax.ShapeDtypeStruct
    for plan in plans:
        if plan.branch.window is not None:
            continue
        rows = plan.branch.dilated_length
        items = b * plan.branch.num_segments(t)
        reason = kernel.call_reason(
            spec((items, rows, len(plan.query_heads), d), query.dtype),
            spec((items, rows, len(plan.kv_heads), d), key.dtype), args,
            Masks(kv_valid=None if kv_mask is None else spec((items, rows), bool)))
        if reason is not None:
            return reason
    return None


def fused_call(kernel: Kernel, args: KernelArgs, plans, mode: str, seq_len: int, *,
               num_branches: int | None = None) -> FusedCall:
    """The fused call of the branches ``plans`` (none a sliding window;
    :func:`fused_unservable` must be None) on sequences of ``seq_len``, for
    :func:`attend`. ``num_branches``: the call's branches (head_groups divides by
    it; default ``len(plans)``)."""
    order = branch_plans.nested_order(plans, seq_len) if mode == "longnet" else None
    ordered = (tuple(plans[::-1]) if order is None else tuple(plans[i] for i in order))
    return FusedCall(kernel, args, ordered, order is not None, mode,
                     num_branches or len(plans))


def _forward(call: FusedCall, query, key, value, kv_mask):
    longnet = call.mode == "longnet"
    o, lse, lse_lo = call.kernel.dilated_forward(
        query, key, value, call.args, list(call.plans), kv_mask=kv_mask, accumulate=longnet,
        out_scale=1.0 if longnet else 1.0 / call.groups, shared_pairs=call.shared_pairs)
    return o.astype(query.dtype), lse, lse_lo


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(call: FusedCall, query, key, value, kv_mask, sinks=None):
    """The fused program: ``(o [B, T, H, D], lse, lse_lo [B, T, H])`` of the branches
    ``call.plans`` in one kernel call per pass, with the [H] attention ``sinks`` (or
    None) folded in; differentiable in query, key, value and sinks through ``o`` and
    ``lse`` (``lse_lo``'s cotangent is ignored, core/softmax.py)."""
    return softmax.fold_sinks(*_forward(call, query, key, value, kv_mask), sinks)


def _attend_fwd(call, query, key, value, kv_mask, sinks=None):
    # the sinks are folded in here: the backward runs on the sink-including
    # statistics (the sink is one more key the kernel never reads)
    o, lse, lse_lo = softmax.fold_sinks(*_forward(call, query, key, value, kv_mask), sinks)
    return (o, lse, lse_lo), (query, key, value, kv_mask, o, lse, lse_lo, sinks)


def _attend_bwd(call, res, cotangents):
    query, key, value, kv_mask, o, lse, lse_lo, sinks = res
    do, dlse, _ = cotangents
    c_do, delta = softmax.backward_scale(do, o, lse_lo, dlse)
    if call.mode == "head_groups":
        # O_j = O_branch / nb: the branch's output cotangent is dO / nb, and
        # rowsum(dO_branch * O_branch) = rowsum(dO * O_j), so delta is unchanged
        c_do = c_do / call.groups
    lse_k = jnp.where(jnp.isneginf(lse), 0.0, lse)  # rows without keys: see dense.backward
    dq, dk, dv = call.kernel.dilated_backward(
        query, key, value, do, c_do, lse_k, delta, call.args, list(call.plans),
        kv_mask=kv_mask, shared_pairs=call.shared_pairs)
    return (dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), None,
            softmax.sink_gradient(lse, delta, sinks))


attend.defvjp(_attend_fwd, _attend_bwd)
