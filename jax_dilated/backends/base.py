"""The kernel interface every backend implements: :class:`Kernel`.

A kernel computes attention of a block of queries against a block of keys and
values and returns the output together with the log-sum-exp, so that partial
results over different key sets can be merged exactly
(:mod:`jax_dilated.core.softmax`). One class per backend implements the whole
protocol (:class:`~jax_dilated.backends.xla.XlaKernel`,
:class:`~jax_dilated.backends.cudnn.CudnnKernel`,
:class:`~jax_dilated.backends.registry.AutoKernel`); an entry point a backend has no
kernel for says so explicitly (``None`` from the ring-step factories, a
``ValueError`` from a call it cannot serve).

Shapes, for every method: ``q`` [N, Lq, H, D], ``k``/``v`` [N, Lk, H_kv, D],
``H % H_kv == 0``; ``q_positions`` [Lq] / ``k_positions`` [Lk] int positions used
by the causal rule ``k_pos <= q_pos`` (default ``arange``); ``kv_valid`` [N, Lk] or
[N, Lk, H_kv] bool (per kv head when heads see different keys). The statistics
(``lse``, ``delta``) are float32, float64 for float64 inputs (the *stats dtype*).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax.numpy as jnp

__all__ = ["KernelArgs", "BlockLists", "any_pair_allowed", "Kernel"]


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


class BlockLists(NamedTuple):
    """The blocks a block-sparse kernel call visits, as padded index lists.

    rows: int [num_q_blocks, L], key-block indices each query block visits.
    rows_ok: bool [num_q_blocks, L] marking real entries (False = padding, skipped),
      or None when every entry is real.
    cols: int [num_k_blocks, Lt], the transpose: query-block indices per key block
      (the backward's dk/dv loop).
    cols_ok: bool [num_k_blocks, Lt] or None, as ``rows_ok``.

    Arrays may be NumPy constants or traced (e.g. picked by device index inside a
    ring); only their shapes are static. Padding entries must still be valid indices.
    """

    rows: Any
    rows_ok: Any
    cols: Any
    cols_ok: Any


def any_pair_allowed(is_causal: bool, q_pos, k_pos, kv_valid):
    """Whether any (query, key) pair of a block is allowed; None when statically always.

    Used to skip whole blocks (kernel) and whole ring steps: causal blocks whose
    earliest key is after the latest query, and blocks with no valid key.
    """
    need = None
    if is_causal:
        need = jnp.min(k_pos) <= jnp.max(q_pos)
    if kv_valid is not None:
        any_valid = jnp.any(kv_valid)
        need = any_valid if need is None else need & any_valid
    return need


@runtime_checkable
class Kernel(Protocol):
    """An attention backend (shapes and dtypes: module docstring).

    ``name`` says which backend it is (``"xla"``, ``"cudnn"``, ``"auto"``).
    """

    name: str

    def forward(self, q, k, v, args: KernelArgs, *, q_positions=None, k_positions=None,
                kv_valid=None, dropout_rng=None):
        """Attention of ``q`` against every allowed key of ``k``/``v``.

        Returns ``(o, lse)``: ``o`` [N, Lq, H, D] in the input dtype, ``lse``
        [N, Lq, H] in the stats dtype; ``o = 0``, ``lse = -inf`` for a row with no
        allowed key. ``dropout_rng`` is needed when ``args.dropout_rate > 0``.
        """

    def backward(self, q, k, v, do, lse, delta, args: KernelArgs, *, q_positions=None,
                 k_positions=None, kv_valid=None, dropout_rng=None):
        """Gradients of the forward from saved statistics: ``(dq, dk, dv)``.

        With ``p = exp(scale q.k - lse)``: ``dv = p^T do``, ``ds = p (do.v - delta)``,
        ``dq = scale ds k``, ``dk = scale ds^T q``. ``lse`` and ``delta`` [N, Lq, H]
        may be *global* statistics (over more keys than this call sees), which is how
        a ring or a branch merge differentiates through a partial:
        ``delta = rowsum(do * o) - dlse`` with the global ``o``
        (:func:`~jax_dilated.core.softmax.backward_delta`). The same ``dropout_rng``
        as the forward draws the same masks. Gradients in the input dtypes.
        """

    def attention(self, q, k, v, args: KernelArgs, *, q_positions=None, k_positions=None,
                  kv_valid=None, dropout_rng=None):
        """:meth:`forward`, differentiable in ``q``, ``k``, ``v`` through both outputs
        ``(o, lse)``."""

    def block_sparse_forward(self, q, k, v, args: KernelArgs, *, blocks: BlockLists,
                             q_positions=None, k_positions=None, kv_valid=None):
        """As :meth:`forward`, over the blocks listed in ``blocks`` only.

        Blocks are exactly ``args.block_q`` x ``args.block_k``; ``Lq``/``Lk`` are
        padded up to whole blocks (padded keys are never attended). Within a listed
        block the causal rule and ``kv_valid`` still apply; all listed blocks of a
        query block share one softmax.
        """

    def block_sparse_backward(self, q, k, v, do, lse, delta, args: KernelArgs, *,
                              blocks: BlockLists, q_positions=None, k_positions=None,
                              kv_valid=None):
        """As :meth:`backward`, over the blocks listed in ``blocks`` only:
        ``(dq, dk, dv)``."""

    def ring_steps(self, q, k, args: KernelArgs) -> RingSteps | None:
        """The backend's own :class:`RingSteps` for queries like ``q`` and keys like
        ``k``, or None (not for these shapes, or no such kernel in this backend).

        Fused ring steps let a ring (:mod:`jax_dilated.ops.ring`) keep keys and values
        in the kernel's own layout for the whole ring and accumulate in place,
        instead of converting every visiting block and allocating fresh outputs at
        every step. With None the ring runs :meth:`forward`/:meth:`backward` per
        step (the generic steps of :func:`jax_dilated.ops.ring_steps.kernel_steps`).
        A ring uses one of the two for both passes, so the steps must draw the
        dropout masks :meth:`forward` would.
        """

    def block_sparse_ring_steps(self, q, k, args: KernelArgs) -> RingSteps | None:
        """:class:`RingSteps` as :meth:`ring_steps` that fold in only the listed key
        blocks of each query block (``KeySide.blocks``, a :class:`BlockLists` in
        blocks of exactly ``args.block_q`` x ``args.block_k``; ``rows`` and
        ``rows_ok`` are read, ``cols`` may be None). None where the shapes do not
        allow them or the backend has no block-sparse kernel (the block-sparse ring
        then calls :meth:`block_sparse_forward`/:meth:`block_sparse_backward` per
        step).
        """
