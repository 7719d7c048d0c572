"""cuDNN fused attention (the ``"cudnn"`` backend), with the kernel interface of :mod:`.base`.

What cuDNN gives, and what this module adds
-------------------------------------------
JAX lowers ``jax._src.cudnn.fused_attention_stablehlo`` to cuDNN's flash
attention. Its forward, run in training mode, returns the output *and* the
softmax statistics ``stats`` [B, N, T] in **float32**: the log-sum-exp of the
scaled logits, which is exactly the ``lse`` of this library's contract. The
public ``jax.nn.dot_product_attention(..., return_residual=True)`` casts that
residual to the output dtype and stops its gradient, so it cannot feed exact
merges; this backend calls the cuDNN-level function instead (float32 kept) and
wraps everything in its own ``jax.custom_vjp``.

cuDNN's backward primitive takes ``(q, k, v, stats, o, do)`` and computes
``p = exp(s - stats)``, ``delta = rowsum(do * o)`` (float32), ``ds = p (dp - delta)``.
Any ``stats``/``o`` may be passed, so:

* a backward through a merge whose *global* ``lse`` and ``o`` are known (a ring,
  a branch merge with no cotangent on the merged lse) is one cuDNN call with the
  global statistics (``native`` path);
* the interface's generic ``backward(q, k, v, do, lse, delta)`` - an arbitrary
  ``delta``, e.g. ``rowsum(do o) - dlse`` when the log-sum-exp itself has a
  cotangent (LongNet's denominator mixing) - is served exactly by widening the
  head by 8 zero columns: ``q, k, v`` get zeros, ``do`` gets three columns of
  ones and ``o`` gets zeros plus ``delta`` split into three half-precision parts
  (``hi + mid + lo``, ~2^-24 relative), so cuDNN's own ``rowsum(do' o')`` is
  ``delta`` while ``q k^T``, ``do v^T`` and the first ``head_dim`` columns of
  ``dq, dk, dv`` are unchanged (``augmented`` path, ~6% more backward work at
  head_dim 128). Where ``head_dim + 8`` exceeds cuDNN's limit (128 before
  Hopper) that backward runs on the XLA kernel instead, decided at trace time. A
  segment batch whose widened copies would exceed ``WIDEN_CHUNK_BYTES`` runs in
  chunks (``lax.map``), so the transient memory stays bounded.

The differentiable ``attention`` takes the native path with its own ``o`` when its
caller says the log-sum-exp is not differentiated (``lse_grad=False``, static: the
lse then comes with its gradient stopped), the widened one otherwise. (A
``custom_vjp`` with ``symbolic_zeros`` could tell by itself, but JAX refuses those
inside an eagerly run ``shard_map``.)

What cuDNN serves (anything else: ``implementation=None`` falls back to the XLA
kernel per call at trace time; ``implementation="cudnn"`` raises ``ValueError``
with the reason; see :mod:`.selection`): bfloat16/float16; head_dim a multiple of
8, at most 128 (compute capability 8.x) or 256 (9.0+); no mask or the plain
causal mask of a square block (positions ``arange``); no ``kv_valid`` (cuDNN's
padding mask is a per-batch prefix length, which a traced boolean mask cannot be
proven to be); no dropout (cuDNN's dropout seed is static); sliding windows that end
at their query (``KernelArgs.window = (left, 0)``, or any window of a causal call: cuDNN's
causal mask with its ``sliding_window_length = left + 1``, square blocks, positions
``arange``), not windows reaching right of the query; no logit soft-cap; grouped-query
heads natively.

On a real GPU the kernel first runs a small program with two calls of one signature
(:func:`repeated_calls_check`, once per device and process): JAX 0.11.2 on an H200
raised ``IndexError`` (``raw_hash_map<>::at``) on such programs. Where it fails, every
call gets a dropout seed of its own (no dropout runs; the seed makes each call's
fingerprint in XLA its own; seeds come from a process-wide counter, so a program
traced again differs in them), and if that fails too, no call runs on cuDNN on that
device, with the reason.

Testing without a GPU: the fused primitive is injectable. :class:`CudnnKernel`
takes any ``ops`` object with the contract of :class:`FusedOps`;
:class:`ReferenceOps` (:mod:`.cudnn_reference`, re-exported here) is a small dense
pure-JAX implementation of exactly that contract (float32 stats, backward from
given stats and output), used by the CPU tests to check everything this module
does around the primitive.
"""

from __future__ import annotations

import functools
import itertools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends import cudnn_probe, selection, xla
from jax_dilated.backends.base import NO_MASKS, BlockLists, KernelArgs, KernelBase, Masks
from jax_dilated.backends.call_specs import call_spec
from jax_dilated.backends.cudnn_probe import primitive_signature_reason
from jax_dilated.backends.cudnn_reference import ReferenceOps
from jax_dilated.core import softmax
from jax_dilated.core.arrays import round_to

__all__ = ["FusedOps", "CudnnOps", "ReferenceOps", "CudnnKernel", "KERNEL", "forward",
           "backward", "attention", "primitive_signature_reason", "repeated_calls_check",
           "two_of_a_kind"]


class FusedOps(Protocol):
    """The fused-attention primitive the backend wraps (BTNH layout, GQA allowed).

    forward(q, k, v, *, scale, causal, window_left=None) -> (o [B, T, N, D] in q's
        dtype, stats [B, N, T] float32 = logsumexp of the scaled, masked logits)
    backward(q, k, v, o, stats, do, *, scale, causal, window_left=None) -> (dq, dk, dv)
        in input dtypes,
        with p = exp(scale q.k - stats) (masked entries 0), delta = rowsum(do * o)
        in float32, ds = p (do.v - delta), dq = scale ds k, dk = scale ds^T q,
        dv = p^T do. ``stats`` and ``o`` are whatever the caller passes.

    ``causal``: query ``p`` sees keys ``t <= p``; ``window_left`` (only with
    ``causal``): also ``t >= p - window_left``.
    """

    def forward(self, q, k, v, *, scale: float, causal: bool,
                window_left: int | None = None): ...

    def backward(self, q, k, v, o, stats, do, *, scale: float, causal: bool,
                 window_left: int | None = None): ...


# ------------------------------------------------------------- the real primitive

# Dropout seeds for the calls when each call needs one of its own (see
# repeated_calls_check): no dropout runs here, so the seed changes nothing but the
# call's backend configuration, hence its fingerprint in XLA.
_SEEDS = itertools.count(1)
_DEFAULT_SEED = 42  # what JAX's functions pass when none is given


class CudnnOps:
    """The cuDNN primitive through JAX (GPU only; traced, not run, anywhere else).

    ``distinct_seeds``: None (the module's setting, :data:`DISTINCT_SEEDS`, which
    :func:`repeated_calls_check` sets on a GPU where it is needed) or a bool: whether
    every call gets a dropout seed of its own."""

    name = "cudnn"

    def __init__(self, distinct_seeds: bool | None = None):
        self.distinct_seeds = distinct_seeds

    def _seed(self) -> int:
        distinct = DISTINCT_SEEDS if self.distinct_seeds is None else self.distinct_seeds
        return next(_SEEDS) % (1 << 31) if distinct else _DEFAULT_SEED

    def _mask_type(self, causal: bool):
        fused = cudnn_probe.fused_module()
        return fused.MaskType.CAUSAL if causal else fused.MaskType.NO_MASK

    @staticmethod
    def _sliding_window(causal: bool, window_left: int | None) -> int | None:
        """cuDNN's ``sliding_window_length``: a query sees the keys in ``(p - length,
        p]``, so ``left + 1`` (as ``jax.nn.dot_product_attention`` maps its
        ``local_window_size``), with the causal mask it bounds."""
        if window_left is None:
            return None
        if not causal:
            raise ValueError("cuDNN's sliding window comes with its causal mask "
                             "(window_left needs causal=True).")
        return int(window_left) + 1

    def forward(self, q, k, v, *, scale: float, causal: bool,
                window_left: int | None = None):
        fused = cudnn_probe.fused_module()
        # The cuDNN-level function keeps the float32 statistics (jax.nn casts them);
        # it is never differentiated here: the custom_vjp below owns the gradient.
        o, stats = fused.dot_product_attention(
            q, k, v, scale=scale, mask_type=self._mask_type(causal), return_residual=True,
            sliding_window_length=self._sliding_window(causal, window_left),
            seed=self._seed())
        return o, stats

    def backward(self, q, k, v, o, stats, do, *, scale: float, causal: bool,
                 window_left: int | None = None):
        reason = primitive_signature_reason()
        if reason:
            raise ValueError(f"implementation='cudnn': {reason}; use implementation='xla'.")
        fused = cudnn_probe.fused_module()
        names = cudnn_probe.backward_parameters()
        unused = jnp.zeros((0,), q.dtype)
        arrays = dict(query=q, key=k, value=v, activation=stats.astype(jnp.float32),
                      fwd_output=o, grad_output=do)
        params = dict(scale=scale, seed=self._seed(), dropout_rate=0.0,
                      variadic_args=(False, False),
                      mask_type=self._mask_type(causal),
                      layout=fused.AttentionLayout.BTNH.value,
                      sliding_window_length=self._sliding_window(causal, window_left),
                      score_mod=None)
        first_param = min(names.index(p) for p in cudnn_probe.BWD_PARAMS if p in names)
        positional = [arrays.get(n, unused) for n in names[:first_param]
                      if n not in cudnn_probe.BWD_SPREAD]
        keywords = {n: params[n] for n in names[first_param:]}
        dq, dk, dv = fused._dot_product_attention_bwd_p_wrapper.bind(*positional, **keywords)[:3]
        return dq, dk, dv


# ------------------------------------------------------------------- the kernel


def _mask(args: KernelArgs, len_k: int) -> dict:
    """The primitive's mask arguments for ``args``: ``causal`` and ``window_left``.

    A window ``(left, 0)`` ends at its query, so it is the causal mask with a left
    bound whether or not the call is causal (:func:`.selection.cudnn_call_reason`
    refuses windows reaching right). ``left`` is capped at the keys there are, which
    changes no mask and keeps ``left + 1`` inside int32.
    """
    window = getattr(args, "window", None)
    if window is None:
        return dict(causal=args.is_causal)
    return dict(causal=True, window_left=min(int(window[0]), len_k))


def _split3(delta, dtype):
    """``delta`` (float32) as three ``dtype`` parts whose float32 sum is ``delta`` to ~2^-24."""
    # round_to, not a round trip through astype, which XLA may drop inside a fusion
    # (on GPUs): every part but the first would be zero, delta only to dtype's precision
    parts = []
    rest = delta
    for _ in range(3):
        part = round_to(rest, dtype)
        parts.append(part.astype(dtype))
        rest = rest - part
    return parts


class CudnnKernel(KernelBase):
    """The cuDNN backend as a :class:`~.base.Kernel`.

    ``forward``, ``backward``, ``attention`` run cuDNN's fused attention. cuDNN has
    no block-sparse kernel and this backend no ring steps, and it says so:
    ``block_sparse_forward``/``block_sparse_backward`` raise ``ValueError``, and
    ``ring_steps``/``block_sparse_ring_steps`` return None (a ring then calls
    ``forward``/``backward`` per step).

    Args:
      ops: the fused primitive (:class:`FusedOps`); default :class:`CudnnOps`.
      device: the device (or :class:`~.selection.DeviceInfo`) whose limits apply
        (head_dim); default ``jax.devices()[0]`` when first needed.

    Every call is checked at trace time with :func:`selection.cudnn_call_reason`;
    a call cuDNN cannot serve raises ``ValueError`` (the registry's automatic
    kernel never sends one here).
    """

    name = "cudnn"

    # Bytes of widened operands (q, k, v, do, o with 8 more columns) one cuDNN call of
    # the generic backward may hold; a larger segment batch is cut into chunks run one
    # after another (lax.map), so the transient copies stay bounded at 1M tokens.
    WIDEN_CHUNK_BYTES = 2 << 30
    # Bytes of queries and keys one call of a streamed batch takes (batch_chunk).
    STREAM_CHUNK_BYTES = 1 << 30

    def __init__(self, ops: FusedOps | None = None, device=None,
                 widen_chunk_bytes: int | None = None):
        self._ops = ops
        self._device = device
        self.widen_chunk_bytes = widen_chunk_bytes or self.WIDEN_CHUNK_BYTES

    @property
    def ops(self) -> FusedOps:
        if self._ops is None:
            self._ops = CudnnOps()
        return self._ops

    @property
    def info(self) -> selection.DeviceInfo:
        if self._device is None:
            self._device = jax.devices()[0]
        return selection.describe_device(self._device)

    # -------------------------------------------------------------- checks

    def call_reason(self, q, k, args: KernelArgs, masks: Masks = NO_MASKS) -> str | None:
        """Why this call cannot run on cuDNN, or None."""
        if masks.q_segment_ids is not None or masks.k_segment_ids is not None:
            return "segment ids (packed documents; this backend has no document mask)"
        device = self._device if self._device is not None else jax.devices()[0]
        if _is_cuda_device(device):  # a real GPU: programs with repeated calls run?
            reason = repeated_calls_check(device)
            if reason:
                return reason
        return selection.cudnn_call_reason(
            self.info, call_spec(q, k, args, masks.q_positions, masks.k_positions,
                                 masks.kv_valid))

    def _check(self, q, k, args, masks: Masks):
        reason = self.call_reason(q, k, args, masks)
        if reason:
            raise ValueError(
                f"implementation='cudnn' cannot serve this call: {reason}. Use "
                f"implementation=None (cuDNN where it can, the XLA kernel elsewhere) "
                f"or 'xla'.")

    def augmented_backward_ok(self, head_dim: int) -> bool:
        return selection.augmented_backward_reason(self.info, head_dim) is None

    # ------------------------------------------------------------ interface

    def forward(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS):
        """As :func:`jax_dilated.backends.xla.forward` (o in q's dtype, lse float32).

        cuDNN returns the log-sum-exp rounded to float32 and not the row maximum, so
        ``lse_lo`` is 0: at extreme logits (|lse| ~ 1e4) this call's probabilities
        carry that rounding (docs/semantics.md, "Numerics").
        """
        self._check(q, k, args, masks)  # (no dropout here: checked)
        o, stats = self.ops.forward(q, k, v, scale=float(args.scale),
                                    **_mask(args, k.shape[1]))
        lse = jnp.swapaxes(stats, 1, 2).astype(jnp.float32)
        return o.astype(q.dtype), lse, jnp.zeros_like(lse)

    def _native_backward(self, q, k, v, do, lse, o, args):
        stats = jnp.swapaxes(jnp.where(jnp.isneginf(lse), 0.0, lse), 1, 2)
        return self.ops.backward(q, k, v, o.astype(q.dtype), stats.astype(jnp.float32),
                                 do.astype(q.dtype), scale=float(args.scale),
                                 **_mask(args, k.shape[1]))

    def backward(self, q, k, v, do, lse, delta, args: KernelArgs, masks: Masks = NO_MASKS,
                 *, out=None):
        """As :func:`jax_dilated.backends.xla.backward`: ``lse``/``delta`` may be global.

        With ``out`` (``delta = rowsum(do * out)``) cuDNN's own backward runs on it.
        Otherwise the arbitrary ``delta`` goes through the augmented head (module
        docstring); where ``head_dim + 8`` is above the device's limit, the XLA
        kernel's backward.
        """
        self._check(q, k, args, masks)
        if out is not None:
            return self._native_backward(q, k, v, do, lse, out, args)
        d = q.shape[-1]
        if not self.augmented_backward_ok(d):
            return xla.KERNEL.backward(q, k, v, do, lse, delta, args, masks)
        n = q.shape[0]
        width = d + selection.AUGMENT_COLUMNS
        rows_q, rows_k = int(np.prod(q.shape[1:-1])), int(np.prod(k.shape[1:-1]))
        per_item = (3 * rows_q + 2 * rows_k) * width * jnp.dtype(q.dtype).itemsize
        chunks = max(1, -(-n * per_item // self.widen_chunk_bytes))
        lse = jnp.where(jnp.isneginf(lse), 0.0, lse).astype(jnp.float32)
        delta = delta.astype(jnp.float32)
        if chunks == 1:
            return self._widened_backward(q, k, v, do, lse, delta, args)
        chunk = -(-n // chunks)
        chunks = -(-n // chunk)

        def split(x):
            x = jnp.pad(x, [(0, chunks * chunk - n)] + [(0, 0)] * (x.ndim - 1))
            return x.reshape(chunks, chunk, *x.shape[1:])

        outs = jax.lax.map(lambda xs: self._widened_backward(*xs, args),
                           tuple(split(x) for x in (q, k, v, do, lse, delta)))
        return tuple(y.reshape(chunks * chunk, *y.shape[2:])[:n] for y in outs)

    def _widened_backward(self, q, k, v, do, lse, delta, args):
        """One cuDNN backward with ``delta`` carried in 8 extra head columns (see module)."""
        d = q.shape[-1]
        dt = q.dtype
        extra = selection.AUGMENT_COLUMNS

        def widen(x, cols=None):
            tail = jnp.zeros(x.shape[:-1] + (extra,), dt) if cols is None else cols
            return jnp.concatenate([x.astype(dt), tail], axis=-1)

        parts = _split3(delta, dt)
        rows = q.shape[:-1]
        ones = jnp.ones(rows + (len(parts),), dt)
        pad = jnp.zeros(rows + (extra - len(parts),), dt)
        do_w = widen(do, jnp.concatenate([ones, pad], axis=-1))
        o_w = jnp.concatenate([jnp.zeros(rows + (d,), dt), jnp.stack(parts, -1), pad], -1)
        dq, dk, dv = self.ops.backward(widen(q), widen(k), widen(v), o_w,
                                       jnp.swapaxes(lse, 1, 2), do_w,
                                       scale=float(args.scale), **_mask(args, k.shape[1]))
        return (dq[..., :d].astype(q.dtype), dk[..., :d].astype(k.dtype),
                dv[..., :d].astype(v.dtype))

    def attention(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, *, sinks=None,
                  lse_grad=True):
        """Differentiable :meth:`forward`; gradients flow through ``o`` and (unless
        ``lse_grad`` is False) the log-sum-exp, and to ``sinks`` [H] (or None), folded
        into the result."""
        self._check(q, k, args, masks)
        o, *lse = _attention(self, args, lse_grad, q, k, v, sinks)
        return o, *(lse if lse_grad else jax.lax.stop_gradient(lse))

    # ------------------------------------------- what cuDNN has no kernel for

    def batch_chunk(self, n: int, q, k, args: KernelArgs) -> int:
        """As many as hold ``STREAM_CHUNK_BYTES`` of queries and keys (at least one):
        a call that size fills a GPU, and a caller streaming a long batch (dilated
        segments at 1M tokens) keeps its per-chunk copies bounded."""
        del args
        per_item = sum(int(np.prod(x.shape[1:])) * jnp.dtype(x.dtype).itemsize
                       for x in (q, k))
        return max(1, min(n, self.STREAM_CHUNK_BYTES // max(per_item, 1)))

    def block_sparse_forward(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, *,
                             blocks: BlockLists):
        """Always ``ValueError``: cuDNN has no block-sparse attention kernel."""
        raise ValueError(_NO_BLOCK_SPARSE)

    def block_sparse_backward(self, q, k, v, do, lse, delta, args: KernelArgs,
                              masks: Masks = NO_MASKS, *, blocks: BlockLists):
        """Always ``ValueError``: cuDNN has no block-sparse attention kernel."""
        raise ValueError(_NO_BLOCK_SPARSE)

    def ring_steps(self, q, k, args: KernelArgs):
        """None: no ring steps of its own (a ring calls ``forward``/``backward`` per step)."""
        return None

    def block_sparse_ring_steps(self, q, k, args: KernelArgs):
        """None: no block-sparse kernel, hence no block-sparse ring steps."""
        return None


_NO_BLOCK_SPARSE = ("implementation='cudnn' has no block-sparse kernel (cuDNN has no "
                    "block-sparse attention); use implementation=None or 'xla'.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(kernel: CudnnKernel, args: KernelArgs, lse_grad: bool, q, k, v, sinks=None):
    return softmax.fold_sinks(*kernel.forward(q, k, v, args), sinks)


def _attention_fwd(kernel, args, lse_grad, q, k, v, sinks=None):
    o, lse, lse_lo = softmax.fold_sinks(*kernel.forward(q, k, v, args), sinks)
    return (o, lse, lse_lo), (q, k, v, o, lse, lse_lo, sinks)


def _attention_bwd(kernel, args, lse_grad, res, cotangents):
    q, k, v, o, lse, lse_lo, sinks = res
    do, dlse, _ = cotangents  # lse_lo is a constant correction (core/softmax.py)
    if not lse_grad:
        # nothing depends on this call's lse (its gradient is stopped outside): cuDNN's
        # own backward, with its o (with sinks both include them, which is all it
        # needs). It reads the rounded lse alone: lse_lo is 0 without sinks; with them
        # it is the float32 rounding of their merge, the size of cuDNN's own rounding
        # of its statistics.
        dq, dk, dv = kernel._native_backward(q, k, v, do, lse, o, args)
        if sinks is None:
            return dq, dk, dv, None
        _, delta = softmax.backward_scale(do, o, lse_lo, jnp.zeros_like(lse))
        return dq, dk, dv, softmax.sink_gradient(lse, delta, sinks)
    if sinks is None:  # lse_lo is 0: no scaled copy of do is needed
        return (*kernel.backward(q, k, v, do, lse, softmax.backward_delta(do, o, dlse), args),
                None)
    # with sinks lse_lo is the merge's: backward_rows folds it into do and delta
    do, delta = softmax.backward_rows(do, o, lse_lo, dlse)
    dq, dk, dv = kernel.backward(q, k, v, do, lse, delta, args)
    return dq, dk, dv, softmax.sink_gradient(lse, delta, sinks)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ------------------------------------------- two calls of one signature in a program

# Whether every cuDNN call gets a dropout seed of its own (set by repeated_calls_check).
DISTINCT_SEEDS = False
_REPEATED = ("two cuDNN attention calls of one signature (shapes, dtypes, mask, window, "
             "scale) in one program")


def _is_cuda_device(device) -> bool:
    """A real device of this process that runs cuDNN (not a described one)."""
    return isinstance(device, jax.Device) and device.platform in ("gpu", "cuda") and \
        selection.cudnn_device_reason(device) is None


def two_of_a_kind(ops, q, k, v, do):
    """The probe program of :func:`repeated_calls_check`: two forwards and two backwards
    of one signature (the keys' two halves), plainly causal and with a window; their
    outputs and gradients."""
    half = k.shape[1] // 2
    out = []
    for window_left in (None, 8):
        mask = dict(scale=0.125, causal=True, window_left=window_left)
        for part in (slice(0, half), slice(half, None)):
            kp, vp = k[:, part], v[:, part]
            o, stats = ops.forward(q, kp, vp, **mask)
            out += [o, *ops.backward(q, kp, vp, o, stats, do, **mask)]
    return out


def _run_probe(ops, device) -> str | None:
    """Run :func:`two_of_a_kind` with ``ops`` on ``device`` (eagerly, also when called
    while a program is traced): None, or the error it raised, in words."""
    q = np.full((1, 64, 1, 64), 0.1, np.float32)
    kv = np.concatenate([q, -q], axis=1)
    try:
        with jax.ensure_compile_time_eval():
            args = [jax.device_put(x, device).astype(jnp.bfloat16) for x in (q, kv, kv, q)]
            jax.block_until_ready(jax.jit(functools.partial(two_of_a_kind, ops))(*args))
    except Exception as e:  # XLA's errors are of several types (IndexError, XlaRuntimeError)
        return f"{type(e).__name__}: {e}".split("\n")[0][:300]
    return None


@functools.lru_cache(maxsize=None)
def repeated_calls_check(device) -> str | None:
    """Whether this JAX runs :data:`_REPEATED` on ``device`` (once per device and
    process, on the device itself, by a small program: :func:`two_of_a_kind`).

    On an H200 with JAX 0.11.2 (cuDNN 9.19) the two test programs that held two such
    calls raised ``IndexError: absl::container_internal::raw_hash_map<>::at`` when
    they ran, and the twenty-odd whose calls all differed ran. That is the message of
    a failed lookup in an absl map; XLA's cuDNN thunk looks its compiled graph up by
    the call's fingerprint (shapes and backend configuration), which such calls share.
    A dropout seed of its own (unused: no dropout runs) makes each call's fingerprint
    its own. So: None where the program runs as it is; where it fails, the seeds are
    made distinct (:data:`DISTINCT_SEEDS`) and, if it then runs, None; else the
    reason, and no call runs on cuDNN on this device (``implementation=None`` takes
    the XLA kernel, ``"cudnn"`` raises it). (Not yet run on a GPU: whether the seeds
    are the cure there is what this check finds out.)
    """
    global DISTINCT_SEEDS
    first = _run_probe(CudnnOps(distinct_seeds=False), device)
    if first is None:
        return None
    if _run_probe(CudnnOps(distinct_seeds=True), device) is None:
        DISTINCT_SEEDS = True
        return None
    return f"this JAX's cuDNN attention fails on {_REPEATED} ({first})"


# The module-level kernel on this process's default device with the real primitive.
KERNEL = CudnnKernel()


def forward(q, k, v, args: KernelArgs, masks: Masks = NO_MASKS):
    """:meth:`CudnnKernel.forward` of :data:`KERNEL`: ``(o, lse, lse_lo)``."""
    return KERNEL.forward(q, k, v, args, masks)


def backward(q, k, v, do, lse, delta, args: KernelArgs, masks: Masks = NO_MASKS, *, out=None):
    """:meth:`CudnnKernel.backward` of :data:`KERNEL`."""
    return KERNEL.backward(q, k, v, do, lse, delta, args, masks, out=out)


def attention(q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, **kwargs):
    """:meth:`CudnnKernel.attention` of :data:`KERNEL`."""
    return KERNEL.attention(q, k, v, args, masks, **kwargs)
