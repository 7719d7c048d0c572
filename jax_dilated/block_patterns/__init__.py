"""Block-sparsity patterns as data: which key blocks each query block attends to.

A pattern is a small, hashable description; :meth:`BlockPattern.to_mask` turns it
into a NumPy bool mask over (query block, key block), shared by all heads
(``[num_q_blocks, num_k_blocks]``) or per head (``[num_heads, num_q_blocks,
num_k_blocks]``). Everything here is static (NumPy), evaluated at trace time.

Parts (``i`` is the query block, ``j`` the key block):

* :class:`LocalWindow` ``(before, after)``: ``i - before <= j <= i + after``.
* :class:`Dilated` ``(rate, span, offset)``: ``(i - j) mod rate == offset`` and
  ``|i - j| <= span``: every ``rate``-th block, relative to the query block.
* :class:`GlobalBlocks` ``(indices)``: global blocks see every key block and every
  query block sees them (row and column ``g`` for each index ``g``).
* :class:`Strided` ``(stride, offset)``: absolute "summary" columns,
  ``j mod stride == offset``, seen by every query block.
* :class:`CausalBlocks`: ``j <= i``.
* :class:`AllBlocks`: every block (dense attention).
* :class:`RandomBlocks` ``(density | num_blocks, seed, per_head, within)``: every row
  draws its blocks at random.
* :class:`MaskPattern`: an explicit NumPy mask.

They combine with ``|`` (union) and ``&`` (intersection), and
:meth:`BlockPattern.with_density` tops a pattern up with random blocks to a target
density.

Density rule: a density target ``d`` (or ``sparsity_ratio = 1 - d``) is honoured row
by row. Row ``i`` has ``c_i`` candidate blocks (all key blocks, or the blocks of the
``within`` pattern, e.g. ``CausalBlocks()``); it ends with exactly
``max(b_i, round(d * c_i))`` active candidates, ``b_i`` being what the base
pattern already activates there (``b_i = 0`` for :class:`RandomBlocks`). Unless the
base pattern alone exceeds the target, the realised density over the candidates
is within half a block per row of ``d``.
"""

from jax_dilated.block_patterns.base import (
    BlockPattern,
    Intersection,
    MaskPattern,
    TopUp,
    Union,
    as_pattern,
)
from jax_dilated.block_patterns.shapes import (
    AllBlocks,
    CausalBlocks,
    Dilated,
    GlobalBlocks,
    LocalWindow,
    RandomBlocks,
    Strided,
)

__all__ = [
    "BlockPattern",
    "LocalWindow",
    "Dilated",
    "GlobalBlocks",
    "Strided",
    "CausalBlocks",
    "AllBlocks",
    "RandomBlocks",
    "MaskPattern",
    "TopUp",
    "Union",
    "Intersection",
    "as_pattern",
]
