"""jax-dilated: dilated (LongNet), ring and block-sparse attention for very long sequences.

Public API only; see DESIGN.md for the semantics.
"""

from jax_dilated.dilated import dilated_attention
from jax_dilated.layouts import from_layout, to_layout
from jax_dilated.ring import ring_attention
from jax_dilated.sharding import sharded

__all__ = ["dilated_attention", "ring_attention", "sharded", "to_layout", "from_layout"]
# Flax layers (jd.nnx.*, jd.linen.*), the drop-in attention_fn, the factory, decoding
from jax_dilated import linen, nnx  # noqa: E402
from jax_dilated.decode import dilated_attention_decode  # noqa: E402
from jax_dilated.factory import attention_fn, create_multihead_dilated_attention  # noqa: E402

__all__ += ["nnx", "linen", "attention_fn", "create_multihead_dilated_attention",
            "dilated_attention_decode"]
__version__ = "0.1.0"
