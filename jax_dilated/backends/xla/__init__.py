"""Blockwise online-softmax attention in pure XLA (the ``"xla"`` backend).

One module per job: :mod:`.layout` (block geometry, the blocked layout), :mod:`.chunks`
(batch chunking),
:mod:`.block_math` (one query block against one key block), :mod:`.dense` (every
key block: ``forward``/``backward``/``attention``), :mod:`.ring` (blocks kept
in the kernel's layout around a ring), :mod:`.block_sparse` (listed blocks only).
:class:`XlaKernel` is the backend as a :class:`~jax_dilated.backends.base.Kernel`;
the functions of :mod:`.dense` and :mod:`.block_sparse` stay importable from here.
"""

from __future__ import annotations

import jax

from jax_dilated.backends.base import NO_MASKS, BlockLists, KernelArgs, KernelBase, Masks
from jax_dilated.backends.xla import block_sparse, dense, ring
from jax_dilated.backends.xla.block_sparse import (
           block_sparse_backward,
           block_sparse_forward,
)
from jax_dilated.backends.xla.dense import attention, backward, forward
from jax_dilated.backends.xla.layout import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

__all__ = ["XlaKernel", "KERNEL", "forward", "backward", "attention",
           "block_sparse_forward", "block_sparse_backward", "DEFAULT_BLOCK_Q",
           "DEFAULT_BLOCK_K"]


class XlaKernel(KernelBase):
    """The blockwise XLA kernel, every entry point of :class:`~.base.Kernel`.

    Stateless: the methods look their function up on :mod:`.dense`,
    :mod:`.block_sparse` and :mod:`.ring` at call time (so a test patching one of
    those module functions reaches every caller of the kernel).
    """

    name = "xla"
    blockwise = True

    def forward(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS):
        """:func:`.dense.forward`."""
        return dense.forward(q, k, v, args, **masks._asdict())

    def backward(self, q, k, v, do, lse, delta, args: KernelArgs, masks: Masks = NO_MASKS,
                 *, out=None):
        """:func:`.dense.backward` (``out`` is not needed: ``delta`` is read)."""
        del out
        return dense.backward(q, k, v, do, lse, delta, args, **masks._asdict())

    def attention(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, *, sinks=None,
                  lse_grad=True):
        """:func:`.dense.attention` (its backward reads ``delta``, so ``lse_grad`` only
        stops the log-sum-exp's gradient)."""
        o, *lse = dense.attention(q, k, v, args, sinks=sinks, **masks._asdict())
        return o, *(lse if lse_grad else jax.lax.stop_gradient(lse))

    def batch_chunk(self, n: int, q, k, args: KernelArgs) -> int:
        """Items whose logits blocks together stay near the cache-friendly size
        (:func:`.dense.batch_chunk`)."""
        return dense.batch_chunk(n, q, k, args)

    def block_sparse_forward(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, *,
                             blocks: BlockLists):
        """:func:`.block_sparse.block_sparse_forward` (no dropout)."""
        return block_sparse.block_sparse_forward(q, k, v, args, blocks=blocks,
                                                 **_without_dropout(masks))

    def block_sparse_backward(self, q, k, v, do, lse, delta, args: KernelArgs,
                              masks: Masks = NO_MASKS, *, blocks: BlockLists):
        """:func:`.block_sparse.block_sparse_backward` (no dropout)."""
        return block_sparse.block_sparse_backward(q, k, v, do, lse, delta, args,
                                                  blocks=blocks, **_without_dropout(masks))

    def ring_steps(self, q, k, args: KernelArgs):
        """:func:`.ring.ring_steps` (None where the shapes do not allow them)."""
        return ring.ring_steps(q, k, args)

    def block_sparse_ring_steps(self, q, k, args: KernelArgs):
        """:func:`.ring.block_sparse_ring_steps` (None where the shapes do not allow them)."""
        return ring.block_sparse_ring_steps(q, k, args)

    def __repr__(self):
        return "XlaKernel()"


def _without_dropout(masks: Masks) -> dict:
    """The masks as keywords of a function that draws no dropout (block-sparse)."""
    kw = masks._asdict()
    kw.pop("dropout_rng")
    return kw


# The one instance the registry hands out (the kernel holds no state).
KERNEL = XlaKernel()
