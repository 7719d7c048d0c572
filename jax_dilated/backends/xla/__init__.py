"""Blockwise online-softmax attention in pure XLA (the ``"xla"`` backend).

One module per job: :mod:`.layout` (block geometry, the blocked layout),
:mod:`.block_math` (one query block against one key block), :mod:`.dense` (every
key block: ``forward``/``backward``/``attention``), :mod:`.ring` (blocks kept
in the kernel's layout around a ring), :mod:`.block_sparse` (listed blocks only).
"""

from jax_dilated.backends.xla.block_sparse import (
           block_sparse_backward,
           block_sparse_forward,
)
from jax_dilated.backends.xla.dense import attention, backward, forward
from jax_dilated.backends.xla.layout import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from jax_dilated.backends.xla.ring import block_sparse_ring_steps, ring_steps

__all__ = ["forward", "backward", "attention", "ring_steps", "block_sparse_forward",
           "block_sparse_backward", "block_sparse_ring_steps", "DEFAULT_BLOCK_Q",
           "DEFAULT_BLOCK_K"]
