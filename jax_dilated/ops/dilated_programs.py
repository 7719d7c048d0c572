"""A dilated call's plan, checked once (:class:`DilatedCall`, :meth:`DilatedCall.of`), and
which program runs it on one device: the one dispatcher of every unpacked one-device
path (calls without a mesh, and each device's heads under the ``"heads"`` strategy);
packed rows have their own (:func:`jax_dilated.ops.dilated_packed.packed_attention`).

Three programs compute the same ``(out, lse)`` (docs/semantics.md, section 2):

* ``"fused"`` (:mod:`jax_dilated.ops.dilated_fused`): every branch in one kernel call
  per pass, segments read where they lie; for a kernel that declares
  ``fused_dilated`` (the native CPU kernel) where it serves every branch (sliding
  windows run beside it as their own windowed calls).
* ``"streamed"`` (:mod:`jax_dilated.ops.dilated_local`): branch by branch, a few
  segments at a time, into the output in place; chunk-sized temporaries. The
  blockwise kernels' program (cheap calls), and a non-blockwise kernel's (cuDNN) in
  longnet mode when every segment length divides the sequence: its backward then runs
  each branch from the merged output's statistics, which is cuDNN's own backward,
  where a merge after the branches would send a log-sum-exp cotangent to every branch
  (cuDNN's widened backward). Not differentiated (and without dropout or a window
  branch), such a call runs the batched program instead, which is faster for cuDNN
  at long sequences (no chunk loop).
* ``"batched"`` (:func:`jax_dilated.ops.branch_combine.batched`): one batched kernel
  call per branch with the kernel's own backward, the branches combined afterwards.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jax_dilated.backends.base import Kernel, KernelArgs, window_arg
from jax_dilated.backends.registry import get_kernel
from jax_dilated.core import branch_plans, softmax, validation
from jax_dilated.core.branches import SlidingWindow, is_window
from jax_dilated.core.types import HeadOffsets, Mode
from jax_dilated.ops import branch_combine, dilated_fused, dilated_local, dilated_window
from jax_dilated.ops.dilated_fused import fused_unservable

__all__ = ["DilatedCall", "PROGRAMS", "choose_program", "one_device"]

PROGRAMS = ("fused", "streamed", "batched")


@dataclasses.dataclass(frozen=True, eq=False)
class DilatedCall:
    """One :func:`jax_dilated.dilated_attention` call's static options, validated once
    by it; every path (one device, packed rows, each strategy over a mesh) reads them
    from here and validates nothing again.

    branches: the ``(w, r)`` of every branch (``w`` an int or a sliding window);
    mode, head_offsets: as the call gave them (checked); args: the kernel arguments
    (scale, causality, dropout rate, blocks, soft-cap); kernel: the kernel chosen for
    the call (:func:`jax_dilated.backends.get_kernel`); max_documents: the packed
    rows' bound or None.
    """

    branches: tuple[tuple[int | SlidingWindow, int], ...]
    mode: Mode
    head_offsets: HeadOffsets
    args: KernelArgs
    kernel: Kernel
    max_documents: int | None

    @classmethod
    def of(cls, segment_lengths, dilation_rates, *, mode: Mode, head_offsets: HeadOffsets,
           head_dim: int, is_causal: bool, scale: float | None = None,
           dropout_rate: float = 0.0, block_q: int | None = None,
           block_k: int | None = None, logit_soft_cap: float | None = None,
           implementation=None, max_documents: int | None = None) -> DilatedCall:
        """The call of these options, each checked here (a ``ValueError`` or
        ``TypeError`` naming the argument): the one validation of a dilated call's
        static options, by :func:`jax_dilated.dilated_attention` and by decoding.
        ``dropout_rate`` is checked (with its key) by the caller."""
        branches = branch_plans.validate_branches(segment_lengths, dilation_rates)
        branch_plans.check_mode(mode, head_offsets)
        if mode == "torchscale":
            # torchscale's own offset rule; its computation has no windows or soft-cap
            head_offsets = "blocked"
            check_torchscale_options(branches, logit_soft_cap=logit_soft_cap,
                                     max_documents=max_documents)
        is_causal = validation.check_flag("is_causal", is_causal)
        for w, _ in branches:  # an explicit right > 0 with causal attention is an error
            if is_window(w):
                window_arg(w.resolve(is_causal))
        validation.check_max_documents(max_documents)
        block_q, block_k = validation.check_block_sizes(block_q, block_k)
        args = KernelArgs(scale=validation.check_scale(scale, head_dim), is_causal=is_causal,
                          dropout_rate=dropout_rate, block_q=block_q, block_k=block_k,
                          logit_soft_cap=validation.check_logit_soft_cap(logit_soft_cap))
        return cls(branches, mode, head_offsets, args, get_kernel(implementation),
                   max_documents)

    def plans(self, *, seq_len: int, num_heads: int, num_kv_heads: int):
        """Every branch's :class:`~jax_dilated.core.branch_plans.BranchPlan` for
        these shapes."""
        return branch_plans.plan_branches(self.branches, seq_len=seq_len,
                                          num_heads=num_heads, num_kv_heads=num_kv_heads,
                                          mode=self.mode, offsets_rule=self.head_offsets)


def check_torchscale_options(branches=(), **options) -> None:
    """``mode="torchscale"`` computes what torchscale computes, which has no
    sliding-window branch and none of the ``options`` given not None (soft-cap,
    packed rows, a padding mask, sinks, the lse): a ``ValueError`` naming the first.
    The one check of the mode's options, by :meth:`DilatedCall.of` (the static ones)
    and :func:`jax_dilated.dilated_attention` (the arrays)."""
    for i, (w, _) in enumerate(branches):
        if is_window(w):
            raise ValueError(f'mode="torchscale" has no sliding-window branches, got {w!r} '
                             f'(segment_lengths[{i}]); use mode="longnet".')
    for name, value in options.items():
        if value is not None and value is not False:
            why = (" (torchscale ignores key padding masks on this path)"
                   if name == "kv_mask" else "")
            shown = "an array" if hasattr(value, "shape") else repr(value)
            raise ValueError(f'mode="torchscale" computes torchscale\'s attention, which has '
                             f'no {name}{why}, got {name}={shown}; use mode="longnet".')


def choose_program(kernel, args, plans, mode: str, query, key, kv_mask, rng) -> tuple[str, str]:
    """``(program, why)``: the one of :data:`PROGRAMS` that runs this call (module
    docstring) and the reason, in words."""
    why_not_fused = fused_unservable(kernel, args, plans, query, key, kv_mask, rng)
    if why_not_fused is None:
        return "fused", f"the {kernel.name} kernel runs every branch in one call per pass"
    if kernel.blockwise:
        return "streamed", (f"the {kernel.name} kernel is blockwise (cheap calls); not "
                            f"fused: {why_not_fused}")
    whole = all(query.shape[1] % p.branch.effective_length == 0
                and p.branch.padded_length == p.branch.effective_length for p in plans
                if p.branch.window is None)
    if mode == "longnet" and whole:
        return "streamed", ("longnet with every segment dividing the sequence: each "
                            "branch's backward runs from the merged output (the kernel's "
                            "own backward)")
    return "batched", f"one {kernel.name} call per branch with its own backward"


def one_device(kernel, args, plans, mode: str, query, key, value, kv_mask, rng,
               sinks=None, lse_grad=True):
    """``(out, lse)`` of unpacked dilated attention of ``plans`` on one device, by the
    program :func:`choose_program` picks. ``rng``: the dropout key or None;
    ``sinks``: None or the [H] attention sinks, included in the result; ``lse_grad``:
    False when the caller does not differentiate through ``lse`` (returned with its
    gradient stopped where that lets cuDNN run its own backward).

    Each program is entered from here (no layer between it and its kernel calls);
    sliding-window branches run beside the fused or streamed program
    (:func:`jax_dilated.ops.dilated_window.add_windows`)."""
    program, _ = choose_program(kernel, args, plans, mode, query, key, kv_mask, rng)
    if program == "batched":
        # the sinks are merged by the lse, so it has a gradient wherever there are sinks
        return softmax.sinks_on_output(*branch_combine.batched(
            kernel, args, plans, mode, query, key, value, kv_mask, rng,
            lse_grad=lse_grad or sinks is not None), sinks)
    dense = tuple(p for p in plans if p.branch.window is None)
    n, t = len(plans), query.shape[1]
    if len(dense) == n and program == "fused":  # the sinks fold into its backward
        o, lse, _ = dilated_fused.attend(dilated_fused.fused_call(kernel, args, plans, mode, t),
                                         query, key, value, kv_mask, sinks)
        return o, lse
    if len(dense) == n:
        primal = None if kernel.blockwise or rng is not None else functools.partial(
            branch_combine.batched, kernel, args, plans, mode, rng=rng)
        call = dilated_local.StreamedCall(kernel, args, dense, mode, n, primal, lse_grad)
        run = dilated_local.attend if primal is None else dilated_local.attend_with_primal
        o, lse, _ = run(call, query, key, value, kv_mask, rng, None, sinks)
        return o, (lse if lse_grad else jax.lax.stop_gradient(lse))
    partial = None  # the other branches' (o, lse, lse_lo), the windows mixed in below
    if dense and program == "fused":
        partial = dilated_fused.attend(
            dilated_fused.fused_call(kernel, args, dense, mode, t, num_branches=n),
            query, key, value, kv_mask)
    elif dense:
        partial = dilated_local.attend(dilated_local.StreamedCall(kernel, args, dense, mode, n),
                                       query, key, value, kv_mask, rng)
    return dilated_window.add_windows(partial, kernel, args, plans, mode, query, key, value,
                                      kv_mask, rng, sinks=sinks)
