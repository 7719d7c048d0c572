"""Flax NNX layers of jax-dilated (the public namespace ``jax_dilated.nnx``).

Defined in :mod:`jax_dilated.layers.nnx`.
"""

# the names and their list live in jax_dilated.layers.nnx
from jax_dilated.layers.nnx import *  # noqa: F401,F403
from jax_dilated.layers.nnx import __all__  # noqa: F401
