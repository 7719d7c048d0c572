"""A dense pure-JAX stand-in for cuDNN's fused attention primitive (CPU tests).

:class:`ReferenceOps` implements the :class:`~jax_dilated.backends.cudnn.FusedOps`
contract exactly (float32 stats; a backward from *given* stats and output,
``delta = rowsum(do * o)``), so the tests check everything
:class:`~jax_dilated.backends.cudnn.CudnnKernel` does around the primitive without a
GPU. Re-exported as ``jax_dilated.backends.cudnn.ReferenceOps``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dilated.core.arrays import round_to

__all__ = ["ReferenceOps"]


class ReferenceOps:
    """Dense pure-JAX implementation of the ``FusedOps`` contract of :mod:`.cudnn`.

    Float32 math on the half-precision inputs (like cuDNN: products accumulated in
    float32, p rounded to the input dtype before ``p v``), causal = top-left
    diagonal, and ``window_left`` (with ``causal``) the left bound of cuDNN's sliding
    window: keys ``p - window_left <= t <= p``. Used to test the wrapper on CPU; not a
    kernel to run at scale.
    """

    name = "reference"

    @staticmethod
    def _logits(q, k, scale, causal, window_left=None):
        b, t, n, d = q.shape
        kv = k.shape[2]
        qg = q.astype(jnp.float32).reshape(b, t, kv, n // kv, d)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
        if window_left is not None and not causal:
            raise ValueError("window_left needs causal=True (as cuDNN's sliding window)")
        if causal:
            key, query = jnp.arange(k.shape[1])[None, :], jnp.arange(t)[:, None]
            mask = key <= query
            if window_left is not None:
                mask = mask & (key >= query - window_left)
            s = jnp.where(mask, s, -jnp.inf)
        return s  # [B, Hkv, G, T, S]

    def forward(self, q, k, v, *, scale: float, causal: bool, window_left=None):
        b, t, n, d = q.shape
        s = self._logits(q, k, scale, causal, window_left)
        stats = jax.nn.logsumexp(s, axis=-1)
        p = round_to(jnp.exp(s - stats[..., None]), q.dtype)  # as cuDNN rounds p
        o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
        return o.reshape(b, t, n, d).astype(q.dtype), stats.reshape(b, n, t)

    def backward(self, q, k, v, o, stats, do, *, scale: float, causal: bool,
                 window_left=None):
        b, t, n, d = q.shape
        kv = k.shape[2]
        g = n // kv
        s = self._logits(q, k, scale, causal, window_left)
        st = stats.astype(jnp.float32).reshape(b, kv, g, t)
        p = jnp.exp(s - st[..., None])
        do32 = do.astype(jnp.float32).reshape(b, t, kv, g, -1)
        o32 = o.astype(jnp.float32).reshape(b, t, kv, g, -1)
        delta = jnp.einsum("btkgd,btkgd->bkgt", do32, o32)
        dv = jnp.einsum("bkgts,btkgd->bskd", p, do32)
        dp = jnp.einsum("btkgd,bskd->bkgts", do32, v.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(jnp.float32)) * scale
        dk = jnp.einsum("bkgts,btkgd->bskd", ds,
                        q.astype(jnp.float32).reshape(b, t, kv, g, d)) * scale
        return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
