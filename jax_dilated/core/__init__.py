"""The arithmetic every operation shares: branch plans (segment lengths, dilation
rates, head offsets), the dilation gather/scatter, ring layouts, the online softmax,
input validation, and varying-manual-axes helpers for ``shard_map``."""
