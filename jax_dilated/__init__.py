"""jax-dilated: dilated (LongNet), ring and block-sparse attention for very long sequences.

Public API only; the semantics are stated in docs/semantics.md.
"""

from jax_dilated import block_patterns, linen, models, nnx
from jax_dilated.backends import backend_report
from jax_dilated.core.branches import SlidingWindow
from jax_dilated.core.layouts import from_layout, to_layout
from jax_dilated.layers.factory import (
                                       create_multihead_attention,
                                       create_multihead_dilated_attention,
)
from jax_dilated.layers.flax_adapter import attention_fn
from jax_dilated.ops.block_sparse import block_sparse_attention
from jax_dilated.ops.decode import dilated_attention_decode
from jax_dilated.ops.dilated import dilated_attention
from jax_dilated.ops.ring import ring_attention
from jax_dilated.ops.sharded import sharded
from jax_dilated.ops.strategies import explain_strategy

__all__ = [
    # operations on arrays
    "dilated_attention", "ring_attention", "block_sparse_attention",
    "dilated_attention_decode",
    # a sliding-window branch of dilated attention (an entry of segment_lengths)
    "SlidingWindow",
    # global arrays over a mesh, and the ring layouts
    "sharded", "to_layout", "from_layout",
    # which context-parallel strategy (ring / allgather / heads) "auto" picks, and why
    "explain_strategy",
    # block-sparse patterns (jd.block_patterns.LocalWindow(2) | ...)
    "block_patterns",
    # Flax layers (jd.nnx.*, jd.linen.*), the drop-in attention_fn, the factory
    "nnx", "linen", "attention_fn", "create_multihead_dilated_attention",
    "create_multihead_attention",
    # models (jd.models.LongNetLM)
    "models",
    # which kernel (cuDNN / XLA) each operation uses on this machine, and why
    "backend_report",
]
__version__ = "0.1.0"
