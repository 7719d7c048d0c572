"""jax-dilated: dilated (LongNet), ring and block-sparse attention for very long sequences.

Public API only; see DESIGN.md for the semantics.
"""

from jax_dilated.dilated import dilated_attention
from jax_dilated.layouts import from_layout, to_layout
from jax_dilated.ring import ring_attention
from jax_dilated.sharding import sharded

__all__ = ["dilated_attention", "ring_attention", "sharded", "to_layout", "from_layout"]
__version__ = "0.1.0"
