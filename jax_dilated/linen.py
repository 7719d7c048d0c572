"""Flax Linen layers of jax-dilated (the public namespace ``jax_dilated.linen``).

Defined in :mod:`jax_dilated.layers.linen`.
"""

# the names and their list live in jax_dilated.layers.linen
from jax_dilated.layers.linen import *  # noqa: F401,F403
from jax_dilated.layers.linen import __all__  # noqa: F401
