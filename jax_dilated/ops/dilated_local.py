"""Dilated attention on one device, streamed: branch by branch, a few segments at a time,
accumulating into the output in place (docs/semantics.md, section 2).

The plain way to run a branch is to gather every dilated segment of the whole
sequence into one array, run the kernel over all of them, scatter the result back
to a full-size array and merge the branches afterwards. Each of those steps makes
a sequence-sized temporary, and on CPU the temporaries cost more than their
copies: every run touches fresh pages of them (page faults), a quarter of the
forward's time at 16K tokens. Here instead one loop per branch walks over chunks
of segments; a chunk's queries, keys and values are sliced and dilated into a
kernel-sized buffer, the kernel runs on it, and its result goes straight into the
accumulators (the output and the log-sum-exp, carried through every branch and
updated in place). Temporaries stay the size of one chunk. (A branch's chunks, their
geometry and views of the arrays: :mod:`jax_dilated.ops.dilated_chunks`.)

The accumulated pair ``(O, LSE)`` is, per mode:

* longnet: the partials of all branches merged with
  :func:`~jax_dilated.core.softmax.merge_partials` as they arrive, so ``O`` and
  ``LSE`` are those of the equivalent dense softmax (Eq. 10);
* head_groups: head ``j``'s branch output divided by the number of branches, and
  that branch's ``LSE`` (the groups' heads are disjoint).

A kernel that reads segments where they lie runs the fused program instead
(:mod:`jax_dilated.ops.dilated_fused`; :mod:`jax_dilated.ops.dilated_programs` chooses).

Packed rows (ops/dilated_packed.py) run the same program through *slots*: a row of
``T'`` slots in which every document starts at a multiple of every segment length,
given by ``source`` [B, T'] (the packed position of each slot's token, ``T`` for an
empty slot). Chunks then gather their rows from the packed arrays and scatter their
results back into packed accumulators, so nothing of size ``T'`` is made; empty
slots are invalid keys, and their queries are dropped.

The backward (a ``jax.custom_vjp``) walks the same chunks. Both modes
differentiate through the *global* statistics: with ``P = exp(s - LSE)`` over a
branch's keys, branch ``i`` contributes ``P v`` to ``O`` in longnet mode (its
mixing weight ``exp(LSE_i - LSE)`` times its own ``exp(s - LSE_i)``), so the
kernel's backward with ``lse = LSE`` and ``delta = rowsum(dO * O) - dLSE`` is the
exact gradient of the merged result, mixing weights included. In head_groups
mode the same holds with the output cotangent divided by the number of branches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_dilated.backends.base import Kernel, KernelArgs, Masks
from jax_dilated.core import branch_plans, dilation, softmax
from jax_dilated.core.vma import varying_like
from jax_dilated.ops.dilated_chunks import BranchView, branch_rng, chunk_rng, slice_items

__all__ = ["StreamedCall", "attend", "attend_with_primal"]


@dataclasses.dataclass(frozen=True, eq=False)
class StreamedCall:
    """Static description of one streamed call (identity-hashed: it holds NumPy plans).

    kernel: runs the chunks of dilated segments ``[N, w/r, H_g, D]`` (its
    ``batch_chunk`` sizes them); args: static kernel arguments; plans: the
    :class:`~jax_dilated.core.branch_plans.BranchPlan` of the branches run here (none
    a sliding window: those run beside, :func:`jax_dilated.ops.dilated_window.add_windows`);
    mode: ``"longnet"`` or ``"head_groups"``; groups: head_groups divides the output
    by this (the number of the call's branches, these and any others).
    """

    kernel: Kernel
    args: KernelArgs
    plans: tuple[branch_plans.BranchPlan, ...]
    mode: str
    groups: int
    # None, or f(query, key, value, kv_mask) -> (out, lse): the same result computed
    # another way, run where the call is not differentiated (the custom_vjp's primal);
    # only without dropout or slots
    primal: Callable | None = None
    # False: nothing differentiates through the lse (the caller stops its gradient),
    # so delta = c rowsum(do * o) and the kernel calls' backward gets o (Kernel.backward)
    lse_grad: bool = True
    # None, or one kernel per plan (a plan's chunks run on it instead of ``kernel``):
    # a spanning branch of distributed dilated attention exchanges heads around it
    branch_kernels: tuple[Kernel, ...] | None = None

    def kernel_of(self, i: int) -> Kernel:
        """The kernel that runs plan ``i``'s chunks."""
        return self.kernel if self.branch_kernels is None else self.branch_kernels[i]


# --------------------------------------------------------------------------- forward


def _forward(call: StreamedCall, query, key, value, kv_mask, rng, source=None, sinks=None):
    """The streamed program: ``(o, lse, lse_lo)`` of the branches ``call.plans``.

    query: [B, T, H, D]; key, value: [B, T, H_kv, D]; kv_mask: None or [B, T] bool.
    rng: None or the dropout key (branch ``i`` folds in ``i``, its chunk ``c`` then
    ``c``). source: None, or the slots of packed rows ([B, T'] int32, module
    docstring) that every segment length divides; arrays, ``kv_mask`` and results
    stay packed. sinks: None or the [H] attention sinks, folded into the result
    (:func:`jax_dilated.core.softmax.add_sinks`).

    ``(o, lse)`` are as :func:`jax_dilated.ops.branch_combine.combine_branches`
    defines them (head_groups: heads of no branch here hold 0 and ``-inf``),
    differentiable in query, key, value and sinks through both; as everywhere,
    ``lse_lo``'s cotangent is ignored (core/softmax.py).
    """
    b, t, h, d = query.shape
    stats = softmax.stats_dtype(query.dtype)
    longnet = call.mode == "longnet"
    o_dtype = stats if longnet else query.dtype
    nb = len(call.plans)
    o = jnp.zeros((b, t, h, d), o_dtype)
    lse = jnp.full((b, t, h), -jnp.inf, stats)
    lse_lo = jnp.zeros((b, t, h), stats)
    o, lse, lse_lo = varying_like((o, lse, lse_lo), (query, key, value))
    # Last branch first: a single-chunk branch (typically the longest segments) is then
    # not the last write, and XLA keeps the accumulator in the output buffer instead of
    # copying it there at the end (a sequence-sized temporary less).
    for n_done, i in enumerate(reversed(range(nb))):
        br = BranchView(call.plans[i], call.kernel_of(i), call.args, query, key, source)
        q_v, k_v, v_v = br.view(query), br.view(key), br.view(value)
        valid_v = br.valid(kv_mask)
        rng_i = branch_rng(rng, i)

        def body(i, acc, run, br=br, q_v=q_v, k_v=k_v, v_v=v_v, valid_v=valid_v,
                 rng_i=rng_i, first=n_done == 0):
            c = run.chunk(i)
            start, size = c * run.stride, run.size
            o_acc, lse_acc, lo_acc = acc
            valid = slice_items(valid_v, start, size)
            o_c, lse_c, lo_c = br.kernel.forward(
                br.dilated(q_v, start, size, "q"), br.dilated(k_v, start, size, "kv"),
                br.dilated(v_v, start, size, "kv"), call.args,
                Masks(kv_valid=None if valid is None else br.gather_kv(valid),
                      dropout_rng=chunk_rng(rng_i, c)))
            if not longnet:
                o_c = o_c / jnp.asarray(call.groups, o_c.dtype)
                return (br.put_selected(o_acc, o_c, start),
                        br.put_selected(lse_acc, lse_c, start),
                        br.put_selected(lo_acc, lo_c, start))
            if first:  # merging into nothing is the identity
                o_c, lse_c, lo_c = (br.scatter_q(o_c.astype(stats), 0),
                                    br.scatter_q(lse_c, -jnp.inf), br.scatter_q(lo_c, 0))
            else:
                # merge at the positions this branch selects only, then write them back
                old = tuple(br.read(x, start, size, br.h0, br.hs)
                            for x in (o_acc, lse_acc, lo_acc))
                o_c, lse_c, lo_c = dilation.merge_selected(
                    old, br.cut, br.plan.offsets, br.plan.query_heads, (o_c, lse_c, lo_c))
            return tuple(br.store(x, y, start, br.h0)
                         for x, y in zip((o_acc, lse_acc, lo_acc), (o_c, lse_c, lo_c)))

        acc = (br.view(o), br.view(lse, -jnp.inf), br.view(lse_lo))
        for run in br.runs():  # inline, so the kernel is called from the program's body
            step = run.skipping(functools.partial(body, run=run))
            acc = step(0, acc) if run.trips == 1 else jax.lax.fori_loop(0, run.trips, step, acc)
        o, lse, lse_lo = (br.unview(x) for x in acc)
    return softmax.fold_sinks(o.astype(query.dtype), lse, lse_lo, sinks)


# --------------------------------------------------------------------------- backward


def _backward(call: StreamedCall, query, key, value, kv_mask, rng, source, lse, do, c_do, delta,
              out=None):
    """dq, dk, dv from ``(c_do, delta) = softmax.backward_scale(do, o, lse_lo, dlse)``.

    ``out``: None, or the output ``o`` when the log-sum-exp has no cotangent (then
    ``delta = c rowsum(do * o)``): each kernel call also gets its rows of it
    (``Kernel.backward(out=)``), so cuDNN runs its own backward instead of carrying
    an arbitrary delta in widened heads.
    """
    stats = softmax.stats_dtype(query.dtype)
    nb = len(call.plans)
    head_groups = call.mode == "head_groups"
    # do' = c do (softmax.backward_rows) is applied chunk by chunk, where do is read:
    # a scaled copy of the whole do would be a sequence-sized temporary
    if head_groups:
        # O_j = O_branch / nb: the branch's output cotangent is dO / nb, and
        # rowsum(dO_branch * O_branch) = rowsum(dO * O_j), so delta is unchanged
        # (and the kernel's own output is nb O_j).
        c_do = c_do / call.groups
        if out is not None:
            out = (out.astype(stats) * call.groups).astype(query.dtype)
    lse_k = jnp.where(jnp.isneginf(lse), 0.0, lse)  # rows without keys: see dense.backward
    dq = jnp.zeros(query.shape, stats)
    dk = jnp.zeros(key.shape, stats)
    dv = jnp.zeros(value.shape, stats)
    dq, dk, dv = varying_like((dq, dk, dv), (query, key, value, do))
    for n_done, i in enumerate(reversed(range(nb))):  # order: as in _forward
        br = BranchView(call.plans[i], call.kernel_of(i), call.args, query, key, source)
        q_v, k_v, v_v, do_v = br.view(query), br.view(key), br.view(value), br.view(do)
        # rows that hold no position (past T, or completing a segment's last row)
        # get lse = inf: p = 0 there, whatever their logits
        lse_v, delta_v, c_v = br.view(lse_k, jnp.inf), br.view(delta), br.view(c_do)
        out_v = None if out is None else br.view(out)
        valid_v = br.valid(kv_mask)
        rng_i = branch_rng(rng, i)

        def body(i, acc, run, br=br, q_v=q_v, k_v=k_v, v_v=v_v, do_v=do_v,
                 lse_v=lse_v, delta_v=delta_v, c_v=c_v, out_v=out_v, valid_v=valid_v,
                 rng_i=rng_i, first=n_done == 0):
            c = run.chunk(i)
            start, size = c * run.stride, run.size
            dq_acc, dk_acc, dv_acc = acc
            valid = slice_items(valid_v, start, size)
            do_c = (br.dilated(do_v, start, size, "q", 0).astype(stats)
                    * br.dilated(c_v, start, size, "q", 0)[..., None]).astype(do.dtype)
            dq_c, dk_c, dv_c = br.kernel.backward(
                # empty slots' queries (slots): no cotangent, and lse = inf, so p = 0
                br.dilated(q_v, start, size, "q"), br.dilated(k_v, start, size, "kv"),
                br.dilated(v_v, start, size, "kv"), do_c,
                br.dilated(lse_v, start, size, "q", jnp.inf),
                br.dilated(delta_v, start, size, "q", 0), call.args,
                Masks(kv_valid=None if valid is None else br.gather_kv(valid),
                      dropout_rng=chunk_rng(rng_i, c)),
                out=None if out_v is None else br.dilated(out_v, start, size, "q", 0))
            dk_c, dv_c = br.scatter_kv(dk_c.astype(stats)), br.scatter_kv(dv_c.astype(stats))
            if not first:  # the accumulators start at zero
                dk_c = dk_c + br.load(dk_acc, start, size)
                dv_c = dv_c + br.load(dv_acc, start, size)
            if head_groups:  # disjoint heads: this branch alone writes its heads' dq
                dq_acc = br.put_selected(dq_acc, dq_c, start)
            else:
                dq_c = br.scatter_q(dq_c.astype(stats), 0)
                if not first:
                    dq_c = dq_c + br.read(dq_acc, start, size, br.h0, br.hs)
                dq_acc = br.store(dq_acc, dq_c, start, br.h0)
            return dq_acc, br.store(dk_acc, dk_c, start, 0), br.store(dv_acc, dv_c, start, 0)

        acc = (br.view(dq), br.view(dk), br.view(dv))
        for run in br.runs():  # as in _forward
            step = run.skipping(functools.partial(body, run=run))
            acc = step(0, acc) if run.trips == 1 else jax.lax.fori_loop(0, run.trips, step, acc)
        dq, dk, dv = (br.unview(x) for x in acc)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


# --------------------------------------------------------------------------- custom_vjp


def _with_primal(call: StreamedCall, query, key, value, kv_mask, rng, source=None,
                 sinks=None):
    """:func:`attend`, but ``call.primal`` where the call is not differentiated."""
    if call.primal is None:
        return _forward(call, query, key, value, kv_mask, rng, source, sinks)
    o, lse = call.primal(query, key, value, kv_mask)
    return softmax.fold_sinks(o, lse, jnp.zeros_like(lse), sinks)


def _attend_fwd(call, query, key, value, kv_mask, rng, source=None, sinks=None):
    # the sinks are folded in here, not after the custom_vjp: the backward then runs
    # on the sink-including statistics (the sink is one more key the kernel never
    # reads), and no output-sized cotangent or copy of o is made for a merge outside
    o, lse, lse_lo = _forward(call, query, key, value, kv_mask, rng, source, sinks)
    return (o, lse, lse_lo), (query, key, value, kv_mask, rng, source, o, lse, lse_lo, sinks)


def _attend_bwd(call, res, cotangents):
    query, key, value, kv_mask, rng, source, o, lse, lse_lo, sinks = res
    do, dlse, _ = cotangents
    # Without an lse cotangent (call.lse_grad False: the caller stopped its gradient,
    # so dlse is 0), delta = c rowsum(do * o): the kernel calls get o too (a kernel
    # that forms delta from an output, cuDNN, then needs no widened head). The XLA
    # kernel reads delta: it gets none, so no chunk of o is gathered for it.
    out = None if call.lse_grad or call.kernel.blockwise else o
    c_do, delta = softmax.backward_scale(do, o, lse_lo, dlse)
    dq, dk, dv = _backward(call, query, key, value, kv_mask, rng, source, lse, do, c_do, delta,
                           out)
    return dq, dk, dv, None, None, None, softmax.sink_gradient(lse, delta, sinks)


# The streamed program, differentiable; the forward is the primal itself, so the chunk
# body calls the kernel two frames below the dispatcher
attend = jax.custom_vjp(_forward, nondiff_argnums=(0,))
attend.defvjp(_attend_fwd, _attend_bwd)
# The same, running ``call.primal`` where the call is not differentiated
attend_with_primal = jax.custom_vjp(_with_primal, nondiff_argnums=(0,))
attend_with_primal.defvjp(_attend_fwd, _attend_bwd)
