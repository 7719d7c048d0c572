"""The static description of one kernel call (:class:`~.selection.CallSpec`), read from
its arrays and arguments at trace time: what the selection rules decide on, for cuDNN
(:func:`.selection.cudnn_call_reason`) and the native CPU kernel
(:func:`.selection.native_call_reason`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends import selection
from jax_dilated.backends.base import KernelArgs

__all__ = ["call_spec"]


def _positions_kind(positions, length: int) -> str:
    """``"arange"`` for None or a concrete ``arange(length)``, else ``"arbitrary"``."""
    if positions is None:
        return "arange"
    if isinstance(positions, jax.core.Tracer):
        return "arbitrary"
    try:
        value = np.asarray(positions)
    except Exception:  # pragma: no cover
        return "arbitrary"
    return "arange" if np.array_equal(value, np.arange(length)) else "arbitrary"


def call_spec(q, k, args: KernelArgs, q_positions=None, k_positions=None, kv_valid=None,
              *, block_sparse: bool = False) -> selection.CallSpec:
    """The static :class:`~.selection.CallSpec` of one kernel call."""
    lq, lk = q.shape[1], k.shape[1]
    window = getattr(args, "window", None)
    positions = "arange"
    # positions matter to masks that follow them: causality and windows
    if (args.is_causal or window is not None) and "arbitrary" in (
            _positions_kind(q_positions, lq), _positions_kind(k_positions, lk)):
        positions = "arbitrary"
    return selection.CallSpec(dtype=jnp.dtype(q.dtype).name, head_dim=q.shape[-1],
                              len_q=lq, len_k=lk, is_causal=args.is_causal,
                              positions=positions, kv_valid=kv_valid is not None,
                              dropout=args.dropout_rate > 0.0, block_sparse=block_sparse,
                              window=window is not None,
                              window_right=0 if window is None else int(window[1]),
                              soft_cap=getattr(args, "logit_soft_cap", None) is not None)
