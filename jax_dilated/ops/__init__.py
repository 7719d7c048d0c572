"""The public attention operations on arrays: dilated, ring, distributed dilated,
block-sparse attention, KV-cache decoding, and :func:`sharded` for global arrays."""
