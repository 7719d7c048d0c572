"""Data for long-context training: byte-level corpora packed into fixed-length rows
with document (segment) ids. Pure NumPy (no JAX import)."""

from jax_dilated.data.packing import (
    BYTE_VOCAB,
    Corpus,
    Packed,
    heldout_mask,
    load_corpus,
    pack,
    stdlib_root,
)

__all__ = ["BYTE_VOCAB", "Corpus", "Packed", "heldout_mask", "load_corpus", "pack",
           "stdlib_root"]
