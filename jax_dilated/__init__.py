"""jax-dilated: dilated (LongNet), ring and block-sparse attention for very long sequences.

Public API only; see DESIGN.md for the semantics.
"""

from jax_dilated.dilated import dilated_attention

__all__ = ["dilated_attention"]
__version__ = "0.1.0"
