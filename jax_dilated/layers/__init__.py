"""Flax layers (NNX and Linen), the drop-in ``attention_fn`` and the layer factory.

Import them as ``jax_dilated.nnx`` / ``jax_dilated.linen`` (the public namespaces)."""
