"""The native CPU kernel (``implementation="native"``): a compiled C++ forward.

On CPU, XLA runs the blockwise kernel of :mod:`jax_dilated.backends.xla` one
operation at a time: each block's matmuls, row maximum, exponentials and sums are
separate passes over a logits block too large for the core's cache. The native
kernel (``attention_cpu.cc``, an XLA FFI custom call) fuses them: it keeps each
tile of logits in registers and L1/L2 while it runs the online softmax, as PyTorch's
CPU flash attention does. A plain call computes the forward (output and
log-sum-exp); its gradients come from the XLA kernel's backward, which reads the
log-sum-exp, so a call on this kernel is differentiable like one on the XLA kernel.
One-device dilated attention runs every branch in one call per pass instead
(:func:`native_dilated_forward`, :func:`native_dilated_backward`): each dilated
segment is read where it lies in the ``[B, T, H, D]`` arrays and its rows are
written (or its gradients added) in place, so nothing is gathered, scattered or
merged outside the kernel.

It serves float32, bfloat16 and float16 calls (half-precision inputs are converted
to float32 where the kernel packs its tiles; products, softmax statistics and
accumulators are float32, and outputs come back in the input dtype) with head_dim a
multiple of 16 up to 256, with or without causality and a kv mask, grouped-query
heads included. Everything else (float64, dropout, a sliding window, soft-capping,
causal positions other than ``0..L-1``, segment ids) goes to the XLA kernel, per
call at trace time (:meth:`NativeCpuKernel.call_reason`), as on a GPU the calls
cuDNN cannot serve do.

It is compiled on first use for this machine (:mod:`.build`): Linux on x86-64 with
AVX2 and FMA (an AVX-512 build where the CPU has it) or on aarch64, and a C++
compiler. Where it cannot be built, ``implementation=None`` runs the XLA kernel on
CPU and :func:`jax_dilated.backend_report` says why.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends import call_specs, selection
from jax_dilated.backends.base import NO_MASKS, KernelArgs, Masks
from jax_dilated.backends.native import build
from jax_dilated.backends.xla import XlaKernel, dense
from jax_dilated.core import softmax
from jax_dilated.core.vma import varying_like

__all__ = ["NativeCpuKernel", "KERNEL", "unavailable_reason", "instruction_set",
           "native_forward", "native_dilated_forward", "native_dilated_backward"]


def unavailable_reason() -> str | None:
    """None when the native kernel is built and registered, else why not (once per
    process: the first call compiles it or loads it from the cache)."""
    return build.load()


def instruction_set() -> str | None:
    """The instruction set of the build in use, as ``jd.backend_report()`` names it
    (``"AVX-512"``, ``"AVX2+FMA"``, ``"NEON"``), or None where it cannot run."""
    isa = build.isa()
    return None if isa is None else build.ISA_NAMES[isa]


class NativeCpuKernel(XlaKernel):
    """The native forward where it serves a call, the XLA kernel elsewhere.

    A :class:`~jax_dilated.backends.base.Kernel`: ``forward`` and ``attention`` go
    to the native forward for the calls :meth:`call_reason` accepts; the backward,
    block-sparse entry points and ring steps are the XLA kernel's.
    """

    name = "native"
    fused_dilated = True

    def call_reason(self, q, k, args: KernelArgs, masks: Masks = NO_MASKS) -> str | None:
        """None when the native forward serves this call, else why not (static: from
        dtypes, shapes and which masks are present; the rules are
        :func:`~jax_dilated.backends.selection.native_call_reason`)."""
        kv_valid = masks.kv_valid
        reason = selection.native_call_reason(call_specs.call_spec(
            q, k, args, q_positions=masks.q_positions, k_positions=masks.k_positions,
            kv_valid=kv_valid))
        if reason is None and (masks.q_segment_ids is not None
                               or masks.k_segment_ids is not None):
            reason = "segment ids"
        if reason is None and kv_valid is not None and kv_valid.ndim not in (2, 3):
            reason = f"a kv mask of rank {kv_valid.ndim}"
        if reason is None and k.dtype != q.dtype:
            reason = f"keys of dtype {k.dtype} with queries of dtype {q.dtype}"
        return reason or unavailable_reason()

    def forward(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS):
        """``(o, lse, lse_lo)`` as :func:`jax_dilated.backends.xla.dense.forward`."""
        if self.call_reason(q, k, args, masks) is not None or v.dtype != q.dtype:
            return super().forward(q, k, v, args, masks)
        return native_forward(q, k, v, args, kv_valid=masks.kv_valid)

    def _forward_keywords(self, q, k, v, args: KernelArgs, **masks):
        # dense.attention's forward_fn takes the masks as dense.forward's keywords
        return self.forward(q, k, v, args, Masks(**masks))

    def attention(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, *, sinks=None,
                  lse_grad=True):
        """Differentiable: the native forward, the XLA kernel's backward
        (:func:`jax_dilated.backends.xla.dense.attention`)."""
        o, *lse = dense.attention(q, k, v, args, sinks=sinks,
                                  forward_fn=self._forward_keywords, **masks._asdict())
        return o, *(lse if lse_grad else jax.lax.stop_gradient(lse))

    def dilated_forward(self, q, k, v, args: KernelArgs, plans, **kw):
        """:func:`native_dilated_forward`: one-device dilated attention runs its
        forward as this one call where :meth:`call_reason` accepts every branch's
        calls (:mod:`jax_dilated.ops.dilated_local`)."""
        return native_dilated_forward(q, k, v, args, plans, **kw)

    def dilated_backward(self, q, k, v, do, c, lse, delta, args: KernelArgs, plans, **kw):
        """:func:`native_dilated_backward`, the gradients of :meth:`dilated_forward`."""
        return native_dilated_backward(q, k, v, do, c, lse, delta, args, plans, **kw)

    def __repr__(self):
        return "NativeCpuKernel()"


def native_forward(q, k, v, args: KernelArgs, *, kv_valid=None):
    """The FFI call: q [N, Lq, H, D], k, v [N, Lk, Hkv, D] of one dtype (float32,
    bfloat16 or float16), kv_valid None or [N, Lk] / [N, Lk, Hkv] bool -> ``(o [N, Lq,
    H, D] in that dtype, lse, lse_lo [N, Lq, H] float32)``."""
    valid = (jnp.zeros((0,), jnp.uint8) if kv_valid is None
             else jnp.broadcast_to(kv_valid, k.shape[:2] + kv_valid.shape[2:])
             .astype(jnp.uint8))
    rows = jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)
    call = jax.ffi.ffi_call(build.target(build.TARGET),
                            (jax.ShapeDtypeStruct(q.shape, q.dtype), rows, rows),
                            vmap_method="broadcast_all")
    o, m, l = call(q, k, v, valid, scale=np.float32(args.scale),
                   causal=bool(args.is_causal))
    # inside shard_map the custom call's results vary as its inputs do
    return varying_like((o, *softmax.lse_parts(m, l)), (q, k, v))


def native_dilated_forward(q, k, v, args: KernelArgs, plans, *, kv_mask=None,
                           accumulate: bool, out_scale: float = 1.0,
                           shared_pairs: bool = False):
    """Every branch of dilated attention in one FFI call, reading each branch's
    dilated segments where they lie in ``q``, ``k``, ``v`` and writing its rows of
    the result in place (nothing gathered, scattered or merged outside the kernel).

    Args:
      q: [B, T, H, D]; k, v: [B, T, Hkv, D]; float32, bfloat16 or float16 (one dtype).
      args: the kernel arguments (``scale``, ``is_causal``; causal inside each
        dilated segment).
      plans: the :class:`~jax_dilated.core.branch_plans.BranchPlan` of every branch
        (none a sliding window), in the order they run.
      kv_mask: None or [B, T] bool.
      accumulate: static. True (longnet): every branch continues each row's softmax,
        so the result is one softmax over all the branches' keys (docs/semantics.md,
        Eq. 10). False (head_groups): each row's one branch writes it.
      out_scale: static; the output is ``out_scale`` times the normalised one.
      shared_pairs: static; with ``accumulate``, for ``plans`` in the order
        :func:`~jax_dilated.core.branch_plans.nested_order` gives (finest first):
        each (query, key) pair is computed once, by the finest branch that lets it
        attend, weighted ``m exp(s)`` (``m`` the branches that let it), instead
        of once per branch (docs/semantics.md, section 7). Same result, fewer products.

    Returns:
      ``(o [B, T, H, D] in q's dtype, lse, lse_lo [B, T, H] float32)``; rows no
      branch selects hold ``o = 0``, ``lse = -inf``, ``lse_lo = 0``.
    """
    mask = _kv_mask_bytes(kv_mask, q.shape[:2])
    rows = jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)
    # with accumulate each branch reads back the output the ones before wrote, so the
    # kernel keeps it in float32 (rounded to q's dtype once, at the end)
    o_dtype = jnp.float32 if accumulate else q.dtype
    call = jax.ffi.ffi_call(build.target(build.TARGET_DILATED),
                            (jax.ShapeDtypeStruct(q.shape, o_dtype), rows, rows),
                            vmap_method="broadcast_all")
    o, m, l = call(q, k, v, mask, **_branch_attributes(plans), scale=np.float32(args.scale),
                   causal=bool(args.is_causal), accumulate=bool(accumulate),
                   out_scale=np.float32(out_scale), shared_pairs=bool(shared_pairs))
    return varying_like((o.astype(q.dtype), *softmax.lse_parts(m, l)), (q, k, v))


def native_dilated_backward(q, k, v, do, c, lse, delta, args: KernelArgs, plans, *,
                            kv_mask=None, shared_pairs: bool = False):
    """The gradients of :func:`native_dilated_forward`'s result, every branch in one
    FFI call: ``(dq, dk, dv)``, summed over the branches.

    ``do`` [B, T, H, D] is the output cotangent, ``c`` [B, T, H] the factor it is
    scaled by where read (``do' = c do``), ``lse`` [B, T, H] the rounded log-sum-exp
    of the rows (0 for a row without keys) and ``delta`` [B, T, H] (``c`` times
    ``rowsum(do o) - dlse``; :func:`jax_dilated.core.softmax.backward_scale`): with
    ``p = exp(s - lse)`` over each branch's keys, ``dv = p^T do'``, ``ds = p (do' v -
    delta)``, ``dq = scale ds k``, ``dk = scale ds^T q``, as
    :meth:`~jax_dilated.backends.base.Kernel.backward` on every dilated segment. The
    other arguments are :func:`native_dilated_forward`'s (``shared_pairs``: ``p = m
    exp(s - lse)``, each pair once). ``q``, ``k``, ``v`` and ``do`` are of one dtype
    (float32, bfloat16 or float16), ``c``, ``lse`` and ``delta`` float32; the
    gradients are summed over the branches in float32 and returned in the inputs'
    dtype.
    """
    call = jax.ffi.ffi_call(build.target(build.TARGET_DILATED_BACKWARD),
                            (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                             jax.ShapeDtypeStruct(k.shape, jnp.float32),
                             jax.ShapeDtypeStruct(v.shape, jnp.float32)),
                            vmap_method="broadcast_all")
    f32 = jnp.float32
    grads = call(q, k, v, do.astype(q.dtype), c.astype(f32), lse.astype(f32),
                 delta.astype(f32), _kv_mask_bytes(kv_mask, q.shape[:2]),
                 **_branch_attributes(plans), scale=np.float32(args.scale),
                 causal=bool(args.is_causal), shared_pairs=bool(shared_pairs))
    grads = tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    return varying_like(grads, (q, k, v, do))


def _kv_mask_bytes(kv_mask, rows):
    """The kv mask as the calls take it: [B, T] uint8, or an empty array for none."""
    return (jnp.zeros((0,), jnp.uint8) if kv_mask is None
            else jnp.broadcast_to(kv_mask, rows).astype(jnp.uint8))


def _branch_attributes(plans) -> dict:
    """The branches of a dilated call as the FFI calls' attributes (int64 arrays):
    per branch its segment length, rate and head counts; per served head its head and
    offset, concatenated over the branches (attention_cpu.cc, read_branches)."""
    def ints(per_plan):
        return np.concatenate([np.asarray(x, np.int64).reshape(-1) for x in per_plan])

    return dict(segments=ints([[p.branch.effective_length] for p in plans]),
                rates=ints([[p.branch.rate] for p in plans]),
                branch_heads=ints([[len(p.query_heads)] for p in plans]),
                q_heads=ints([p.query_heads for p in plans]),
                q_offsets=ints([p.offsets for p in plans]),
                branch_kv_heads=ints([[len(p.kv_heads)] for p in plans]),
                kv_heads=ints([p.kv_heads for p in plans]),
                kv_offsets=ints([p.kv_offsets for p in plans]))


# The one instance the registry hands out (the kernel holds no state).
KERNEL = NativeCpuKernel()
