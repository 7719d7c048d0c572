"""The kernel interface every backend implements.

A kernel computes attention of a block of queries against a block of keys and
values and returns the output together with the log-sum-exp, so that partial
results over different key sets can be merged exactly (:mod:`jax_dilated.softmax`):

    forward(q, k, v, args, *, q_positions, k_positions, kv_valid, dropout_rng)
        -> o [N, Lq, H, D] (input dtype), lse [N, Lq, H] (float32; float64 for float64)
    backward(q, k, v, do, lse, delta, args, *, ...same keywords)
        -> dq, dk, dv            (lse, delta may be global statistics)
    attention(q, k, v, args, *, ...same keywords)
        -> (o, lse), differentiable in q, k, v through both outputs

with ``q`` [N, Lq, H, D], ``k``/``v`` [N, Lk, H_kv, D], ``H % H_kv == 0``;
``q_positions`` [Lq] / ``k_positions`` [Lk] int positions used by the causal
rule ``k_pos <= q_pos`` (default ``arange``); ``kv_valid`` [N, Lk] or
[N, Lk, H_kv] bool (per kv head when heads see different keys).
"""

from __future__ import annotations

import dataclasses

__all__ = ["KernelArgs"]


@dataclasses.dataclass(frozen=True)
class KernelArgs:
    """Static (hashable) arguments of one kernel call.

    scale: multiplier of ``q.k``.
    is_causal: key ``t`` is allowed for query ``p`` only if ``pos(t) <= pos(p)``.
    dropout_rate: attention-probability dropout rate in ``[0, 1)``.
    block_q, block_k: target block sizes (None: the backend's default).
    """

    scale: float
    is_causal: bool = False
    dropout_rate: float = 0.0
    block_q: int | None = None
    block_k: int | None = None
