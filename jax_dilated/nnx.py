"""Flax NNX layers of jax-dilated (the public namespace ``jax_dilated.nnx``).

Defined in :mod:`jax_dilated.layers.nnx`.
"""

from jax_dilated.layers.nnx import (  # noqa: F401
    DilatedAttention,
    MultiheadBlockSparseAttention,
    MultiheadDilatedAttention,
    MultiheadRingAttention,
    RingAttention,
)

__all__ = ["DilatedAttention", "RingAttention", "MultiheadDilatedAttention", "MultiheadRingAttention", "MultiheadBlockSparseAttention"]
