"""Flax Linen layers of jax-dilated (the public namespace ``jax_dilated.linen``).

Defined in :mod:`jax_dilated.layers.linen`.
"""

from jax_dilated.layers.linen import (  # noqa: F401
    DilatedAttention,
    MultiheadBlockSparseAttention,
    MultiheadDilatedAttention,
    MultiheadRingAttention,
    RingAttention,
)

__all__ = ["DilatedAttention", "RingAttention", "MultiheadDilatedAttention", "MultiheadRingAttention", "MultiheadBlockSparseAttention"]
